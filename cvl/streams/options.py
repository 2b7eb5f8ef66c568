"""Options and output shared by the `cvl build-stream` source commands.

A source module defines its click command with these helpers (`common_options` for every
URL/file source that goes through `pipeline.build_stream`, `split_options` for seeded random
chunks and held-out sets; numbers are `cvl.checks` types) and prints its result with
`finish`; `cvl/streams/cli.py` only lists the commands.
"""

from __future__ import annotations

import click

from cvl.checks import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, SEED, Num
from cvl.streams.manifest import Manifest


def echo_summary(m: Manifest, out: str, quiet: bool = False) -> None:
    """Print what a builder wrote (tasks, counts, eval sets); nothing with --quiet."""
    if quiet:
        return
    click.echo(f"wrote stream '{m.name}' to {out} ({len(m.task_order)} tasks)")
    for t in m.task_order:
        evals = ", ".join(
            f"{s} {es.tasks[t].count}" for s, es in m.eval_sets.items() if t in es.tasks
        )
        click.echo(
            f"  {t:>12}: train {m.tasks[t].train.count:>7}" + (f" | {evals}" if evals else "")
        )


def common_options(f):  # noqa: ANN001, ANN202
    """Options shared by every URL/file source (output, order, images, img2dataset)."""
    for o in reversed(_option_list()):
        f = o(f)
    return f


# The options of sources read from archives on disk: no downloads, no task order.
ARCHIVE_KEYS = (
    "out",
    "name",
    "seed",
    "shard_size",
    "image_size",
    "resize_mode",
    "resize_always",
    "min_image_size",
    "encode_quality",
    "processes",
    "overwrite",
    "quiet",
)


def archive_options(f):  # noqa: ANN001, ANN202
    """Options shared by the archive sources (output, seed, image resizing, workers)."""
    opts = dict(zip(BUILD_KEYS, _option_list()))
    for k in reversed(ARCHIVE_KEYS):
        f = opts[k](f)
    return f


def _option_list() -> list:
    """The click options of `BUILD_KEYS`, in that order."""
    return [
        click.option(
            "--out", required=True, type=click.Path(file_okay=False), help="Stream folder to write."
        ),
        click.option("--name", default=None, help="Stream name [folder name]."),
        click.option(
            "--order",
            default="default",
            show_default=True,
            help="Task order written to the manifest: default, reversed, or a comma list of "
            "task names (a subset builds only those tasks).",
        ),
        click.option(
            "--seed",
            type=SEED,
            default=0,
            show_default=True,
            help="Seed of every random choice (samples, splits).",
        ),
        click.option(
            "--downloads",
            type=click.Path(file_okay=False),
            default=None,
            help="Download cache folder (img2dataset batches) [OUT/../downloads/SOURCE]. "
            "Shared by rebuilds: only missing or failed URLs are fetched again.",
        ),
        click.option(
            "--shard-size",
            default=10000,
            show_default=True,
            type=POSITIVE_INT,
            help="Samples per output tar shard.",
        ),
        click.option(
            "--image-size",
            default=256,
            show_default=True,
            type=POSITIVE_INT,
            help="Resize target in pixels (see --resize-mode).",
        ),
        click.option(
            "--resize-mode",
            default="keep_ratio",
            show_default=True,
            type=click.Choice(["no", "keep_ratio", "center_crop", "border", "keep_ratio_largest"]),
            help="img2dataset resize mode; keep_ratio: shorter side = --image-size.",
        ),
        click.option(
            "--resize-always",
            is_flag=True,
            help="Also upscale images smaller than --image-size (default: only shrink).",
        ),
        click.option(
            "--min-image-size",
            default=0,
            show_default=True,
            type=NON_NEGATIVE_INT,
            help="Drop images whose shorter side is smaller (failed_to_resize).",
        ),
        click.option(
            "--encode-quality",
            type=Num(int, 1, 100),
            default=95,
            show_default=True,
            help="JPEG quality.",
        ),
        click.option(
            "--processes",
            default=1,
            show_default=True,
            type=POSITIVE_INT,
            help="img2dataset processes, and the processes that resize the images and write "
            "the shards (whole shards each; the output does not depend on it).",
        ),
        click.option(
            "--threads",
            default=32,
            show_default=True,
            type=POSITIVE_INT,
            help="img2dataset download threads per process.",
        ),
        click.option(
            "--timeout",
            type=POSITIVE_FLOAT,
            default=10.0,
            show_default=True,
            help="Seconds per URL before giving up.",
        ),
        click.option(
            "--retries",
            default=0,
            show_default=True,
            type=NON_NEGATIVE_INT,
            help="img2dataset retries per URL within one run.",
        ),
        click.option(
            "--distributor",
            default="multiprocessing",
            show_default=True,
            type=click.Choice(["multiprocessing", "pyspark", "ray"]),
            help="img2dataset distributor (pyspark / ray to spread CC12M over machines).",
        ),
        click.option(
            "--download-shard-size",
            default=10000,
            show_default=True,
            type=POSITIVE_INT,
            help="URLs per img2dataset shard (its number_sample_per_shard).",
        ),
        click.option(
            "--retry-failed/--no-retry-failed",
            default=True,
            show_default=True,
            help="Fetch URLs that failed in an earlier run again.",
        ),
        click.option(
            "--user-agent-token",
            default=None,
            help="Token added to img2dataset's user agent (X-Robots-Tag rules for it apply).",
        ),
        click.option(
            "--exit-grace",
            type=NON_NEGATIVE_FLOAT,
            default=30.0,
            show_default=True,
            help="Watchdog: seconds img2dataset may linger after its last shard before it is killed.",
        ),
        click.option(
            "--stall-timeout",
            type=POSITIVE_FLOAT,
            default=900.0,
            show_default=True,
            help="Watchdog: kill img2dataset after this many seconds without progress.",
        ),
        click.option("--overwrite", is_flag=True, help="Replace an existing output folder."),
        click.option(
            "--quiet",
            is_flag=True,
            help="No progress bars, messages or summary (errors and warnings still print).",
        ),
    ]


def split_options(default_chunks: int):  # noqa: ANN202
    def deco(f):  # noqa: ANN001, ANN202
        opts = [
            click.option(
                "--chunks",
                default=default_chunks,
                show_default=True,
                type=POSITIVE_INT,
                help="Tasks: seeded random equal chunks of the training pairs.",
            ),
            click.option(
                "--sample",
                default=None,
                type=POSITIVE_INT,
                help="Training pairs in total (a seeded random draw) [all].",
            ),
            click.option(
                "--val",
                default=0,
                show_default=True,
                type=NON_NEGATIVE_INT,
                help="Validation pairs per task, held out from the same draw.",
            ),
            click.option(
                "--test",
                default=0,
                show_default=True,
                type=NON_NEGATIVE_INT,
                help="Test pairs per task, held out from the same draw.",
            ),
        ]
        for o in reversed(opts):
            f = o(f)
        return f

    return deco


BUILD_KEYS = (
    "out",
    "name",
    "order",
    "seed",
    "downloads",
    "shard_size",
    "image_size",
    "resize_mode",
    "resize_always",
    "min_image_size",
    "encode_quality",
    "processes",
    "threads",
    "timeout",
    "retries",
    "distributor",
    "download_shard_size",
    "retry_failed",
    "user_agent_token",
    "exit_grace",
    "stall_timeout",
    "overwrite",
    "quiet",
)


def build_options(kw: dict):  # noqa: ANN202
    """Pop the common options from a command's kwargs into a BuildOptions."""
    from pathlib import Path

    from cvl.streams.download import DownloadOptions, ImageOptions
    from cvl.streams.pipeline import BuildOptions

    defaults = {p.name: p.default for p in click.command()(common_options(lambda **_: None)).params}
    c = {k: kw.pop(k) if k in kw else defaults[k] for k in BUILD_KEYS}
    quiet = c["quiet"]
    return BuildOptions(
        out=Path(c["out"]),
        name=c["name"],
        order=c["order"],
        seed=c["seed"],
        image=ImageOptions(
            image_size=c["image_size"],
            resize_mode=c["resize_mode"],
            resize_only_if_bigger=not c["resize_always"],
            encode_quality=c["encode_quality"],
            min_image_size=c["min_image_size"],
        ),
        download=DownloadOptions(
            processes=c["processes"],
            threads=c["threads"],
            timeout=c["timeout"],
            retries=c["retries"],
            distributor=c["distributor"],
            shard_size=c["download_shard_size"],
            retry_failed=c["retry_failed"],
            user_agent_token=c["user_agent_token"],
            exit_grace=c["exit_grace"],
            stall_timeout=c["stall_timeout"],
        ),
        downloads=Path(c["downloads"]) if c["downloads"] else None,
        shard_size=c["shard_size"],
        overwrite=c["overwrite"],
        progress=not quiet,
        log=(lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True)),
    )


def finish(m: Manifest, out: str, quiet: bool = False) -> None:
    """Summary of a URL/file build: tasks, counts, what was dropped and where the details are.

    With --quiet only the build's warnings are printed (on stderr)."""
    import json
    from pathlib import Path

    echo_summary(m, out, quiet)
    rep_path = Path(out) / "build_report.json"
    try:
        rep = json.loads(rep_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if quiet:
        for w in rep.get("warnings", []):
            click.echo(f"warning: {w}", err=True)
        return
    dropped = rep.get("dropped") or {}
    top = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1])[:6])
    click.echo(
        f"  read {rep.get('read', 0)}, kept {rep.get('kept_total', 0)}, "
        f"dropped {rep.get('dropped_total', 0)}" + (f" ({top})" if top else "")
    )
    dl = rep.get("download")
    if dl:
        click.echo(
            f"  downloads: {dl.get('urls', 0)} urls, {dl.get('from_cache', 0)} from cache, "
            f"{dl.get('fetched_now', 0)} fetched now; cache {dl.get('cache')}"
        )
    for w in rep.get("warnings", []):
        click.echo(f"  warning: {w}")
    dropped_file = " and dropped.jsonl" if (Path(out) / "dropped.jsonl").is_file() else ""
    click.echo(f"  details: {rep_path}{dropped_file}")
