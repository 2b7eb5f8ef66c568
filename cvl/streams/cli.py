"""`cvl build-stream SOURCE ...`: one subcommand per source, all writing the same format."""

from __future__ import annotations

import importlib

import click

from cvl.streams.manifest import Manifest


def echo_summary(m: Manifest, out: str) -> None:
    """Print what a builder wrote (tasks, counts, eval sets)."""
    click.echo(f"wrote stream '{m.name}' to {out} ({len(m.task_order)} tasks)")
    for t in m.task_order:
        evals = ", ".join(
            f"{s} {es.tasks[t].count}" for s, es in m.eval_sets.items() if t in es.tasks
        )
        click.echo(
            f"  {t:>12}: train {m.tasks[t].train.count:>7}" + (f" | {evals}" if evals else "")
        )


@click.group("build-stream")
def build_stream() -> None:
    """Build a stream folder (stream.json + webdataset shards) from a source.

    Every source writes the same manifest format (`cvl.stream/1`, see datasets/README.md),
    into a temporary folder renamed into place when complete: an interrupted build leaves
    nothing half-written. An existing output folder is refused unless --overwrite.
    """


def _positive(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value <= 0:
        raise click.BadParameter(f"must be a positive integer, got {value}")
    return value


def _non_negative(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 0:
        raise click.BadParameter(f"must be >= 0, got {value}")
    return value


@build_stream.command("synthetic")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Stream folder to write."
)
@click.option(
    "--tasks", default=5, show_default=True, callback=_positive, help="Number of tasks (domains)."
)
@click.option(
    "--per-task",
    default=2000,
    show_default=True,
    callback=_positive,
    help="Training pairs per task.",
)
@click.option(
    "--first-task",
    type=int,
    default=None,
    callback=_positive,
    help="Training pairs of task 0 if different (a larger first task, as Mod-X's COCO).",
)
@click.option(
    "--test-per-task",
    type=int,
    default=None,
    callback=_non_negative,
    help="Test pairs per task [max(50, per_task/5)].",
)
@click.option(
    "--val-per-task",
    type=int,
    default=None,
    callback=_non_negative,
    help="Validation pairs per task [max(20, per_task/10)].",
)
@click.option(
    "--query-per-task",
    type=int,
    default=None,
    callback=_non_negative,
    help="mAP queries per task [max(20, per_task/10)].",
)
@click.option(
    "--gallery-per-task",
    type=int,
    default=None,
    callback=_non_negative,
    help="mAP gallery items per task [max(50, per_task/2)].",
)
@click.option(
    "--shapes-per-task",
    type=int,
    default=None,
    callback=_positive,
    help="Shapes (categories) per task [min(4, 28/tasks)].",
)
@click.option(
    "--image-size", default=32, show_default=True, callback=_positive, help="Image side in pixels."
)
@click.option("--seed", default=0, show_default=True, help="Same seed -> byte-identical stream.")
@click.option("--name", default=None, help="Stream name [folder name].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def synthetic_cmd(
    out: str, name: str | None, overwrite: bool, quiet: bool, **kw: int | None
) -> None:
    """Procedurally drawn shapes with compositional captions, one domain per task.

    Runs offline in seconds; the embedded default of `make demo` and the tests. Tasks share
    colours, sizes, positions and background patterns, and differ in shapes (the category
    label used by mAP), drawing style and background tint, so sequential fine-tuning forgets.
    """
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    m = build_synthetic(out, SynthSpec(**kw), name=name, overwrite=overwrite, progress=not quiet)
    echo_summary(m, out)


# -- URL / file sources (p9d, cc12m, cc3m, wit, goodnews, table) --------------------------------
# All of them take the same output, image and download options and go through one pipeline
# (cvl/streams/pipeline.py); downloads are cached beside the stream (see --downloads).


def _common_options(f):  # noqa: ANN001, ANN202
    """Options shared by every URL/file source (output, order, images, img2dataset)."""
    opts = [
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
            callback=_positive,
            help="Samples per output tar shard.",
        ),
        click.option(
            "--image-size",
            default=256,
            show_default=True,
            callback=_positive,
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
            callback=_non_negative,
            help="Drop images whose shorter side is smaller (failed_to_resize).",
        ),
        click.option("--encode-quality", default=95, show_default=True, help="JPEG quality."),
        click.option(
            "--processes",
            default=1,
            show_default=True,
            callback=_positive,
            help="img2dataset processes (and local-image workers).",
        ),
        click.option(
            "--threads",
            default=32,
            show_default=True,
            callback=_positive,
            help="img2dataset download threads per process.",
        ),
        click.option(
            "--timeout", default=10.0, show_default=True, help="Seconds per URL before giving up."
        ),
        click.option(
            "--retries",
            default=0,
            show_default=True,
            callback=_non_negative,
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
            callback=_positive,
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
            default=30.0,
            show_default=True,
            help="Watchdog: seconds img2dataset may linger after its last shard before it is killed.",
        ),
        click.option(
            "--stall-timeout",
            default=900.0,
            show_default=True,
            help="Watchdog: kill img2dataset after this many seconds without progress.",
        ),
        click.option("--overwrite", is_flag=True, help="Replace an existing output folder."),
        click.option(
            "--quiet", is_flag=True, help="No progress bars or messages (errors still print)."
        ),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _split_options(default_chunks: int):  # noqa: ANN202
    def deco(f):  # noqa: ANN001, ANN202
        opts = [
            click.option(
                "--chunks",
                default=default_chunks,
                show_default=True,
                callback=_positive,
                help="Tasks: seeded random equal chunks of the training pairs.",
            ),
            click.option(
                "--sample",
                type=int,
                default=None,
                callback=_positive,
                help="Training pairs in total (a seeded random draw) [all].",
            ),
            click.option(
                "--val",
                default=0,
                show_default=True,
                callback=_non_negative,
                help="Validation pairs per task, held out from the same draw.",
            ),
            click.option(
                "--test",
                default=0,
                show_default=True,
                callback=_non_negative,
                help="Test pairs per task, held out from the same draw.",
            ),
        ]
        for o in reversed(opts):
            f = o(f)
        return f

    return deco


_BUILD_KEYS = (
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


def _build_options(kw: dict):  # noqa: ANN202
    """Pop the common options from a command's kwargs into a BuildOptions."""
    from pathlib import Path

    from cvl.streams.download import DownloadOptions, ImageOptions
    from cvl.streams.pipeline import BuildOptions

    c = {k: kw.pop(k) for k in _BUILD_KEYS}
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


def _finish(m: Manifest, out: str) -> None:
    """Summary of a URL/file build: tasks, counts, what was dropped and where the details are."""
    import json
    from pathlib import Path

    echo_summary(m, out)
    rep_path = Path(out) / "build_report.json"
    try:
        rep = json.loads(rep_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
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
    click.echo(f"  details: {rep_path} and dropped.jsonl")


@build_stream.command("p9d")
@click.option(
    "--annotations",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder with train.json (required) and test.json / query.json / gallery.json.",
)
@click.option(
    "--images",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Folder(s) of {item_id}.jpg (also searched: train_images/, gallery_images/). "
    "Given: no downloads. Repeatable.",
)
@click.option(
    "--download-missing",
    is_flag=True,
    help="With --images: download the links of items whose file is missing.",
)
@click.option(
    "--limit-per-task",
    type=int,
    default=None,
    callback=_positive,
    help="At most N training pairs per industry (seeded random subset).",
)
@click.option(
    "--eval-limit-per-task",
    type=int,
    default=None,
    callback=_positive,
    help="At most N pairs per industry in each eval set (test, query, gallery).",
)
@_common_options
def p9d_cmd(
    annotations: str,
    images: tuple[str, ...],
    download_missing: bool,
    limit_per_task: int | None,
    eval_limit_per_task: int | None,
    **kw,
) -> None:
    """P9D (CTP): nine industries as tasks; test, query and gallery eval sets with categories.

    \b
    Tasks in the paper's default order: Household, Furnishings, Food, Beauty, Clothing, Auto,
    Parenting, Outdoor, Electronics (--order reversed, or e.g. "Food,Beauty,Auto"; Chinese
    industry names work too). Caption = product title, category = cate_name. Licence:
    CC BY-NC-SA 4.0 (non-commercial). See datasets/p9d.md.

    \b
      cvl build-stream p9d --annotations P9D/json --images P9D --out streams/p9d
      cvl build-stream p9d --annotations P9D/json --out streams/p9d-small --limit-per-task 2000
    """
    from cvl.streams.p9d import build_p9d

    opts = _build_options(kw)
    m = build_p9d(
        annotations,
        opts,
        images=list(images),
        limit_per_task=limit_per_task,
        eval_limit_per_task=eval_limit_per_task,
        download_missing=download_missing,
    )
    _finish(m, str(opts.out))


def _cc_command(source: str, layout: str, paper: str, example: str):  # noqa: ANN202
    doc = (
        f"{source.upper()}: instance split into seeded random equal chunks ({paper}).\n\n"
        f"\b\n{layout} per line; ids are {source}-<line>; --test/--val pairs per task are held\n"
        f"out from the same seeded draw. See datasets/{source}.md.\n  {example}"
    )

    @build_stream.command(source, help=doc)
    @click.option(
        "--tsv",
        required=True,
        type=click.Path(dir_okay=False),
        help=f"The {source.upper()} TSV (headerless, {layout} per line).",
    )
    @click.option(
        "--split",
        default="instance",
        show_default=True,
        type=click.Choice(["instance"]),
        help="Split rule (the BEiT class split plugs in as pipeline.ClassSplit).",
    )
    @_split_options(4 if source == "cc12m" else 1)
    @_common_options
    def cmd(
        tsv: str, split: str, chunks: int, sample: int | None, val: int, test: int, **kw
    ) -> None:
        from cvl.streams.cc import build_cc

        opts = _build_options(kw)
        m = build_cc(
            source, tsv, opts, split=split, chunks=chunks, sample=sample, val=val, test=test
        )
        _finish(m, str(opts.out))

    return cmd


cc12m_cmd = _cc_command(
    "cc12m",
    "url<TAB>caption",
    "IncCLIP: 2M pairs in 4 chunks of 0.5M",
    "cvl build-stream cc12m --tsv cc12m.tsv --out streams/cc2m --chunks 4 \\\n"
    "      --sample 2000000 --test 5000 --processes 16 --threads 64",
)
cc3m_cmd = _cc_command(
    "cc3m",
    "caption<TAB>url",
    "DHA's CITM task: one chunk, 130k/13k/5k",
    "cvl build-stream cc3m --tsv Train_GCC-training.tsv --out streams/cc3m \\\n"
    "      --sample 130000 --val 13000 --test 5000",
)


@build_stream.command("wit")
@click.option(
    "--tsv",
    "tsvs",
    required=True,
    multiple=True,
    type=click.Path(dir_okay=False),
    help="WIT TSV(.gz) file(s) with the 17-column header. Repeatable.",
)
@click.option(
    "--language",
    "languages",
    multiple=True,
    default=("en",),
    show_default=True,
    help="Keep rows of these languages. Repeatable.",
)
@click.option(
    "--caption-col",
    default="caption_reference_description",
    show_default=True,
    type=click.Choice(
        [
            "caption_reference_description",
            "caption_attribution_description",
            "caption_alt_text_description",
        ]
    ),
    help="Caption column.",
)
@click.option(
    "--mime-types",
    default="image/jpeg,image/png,image/webp",
    show_default=True,
    help="Comma list of MIME types to keep (others are dropped as mime_type).",
)
@_split_options(1)
@_common_options
def wit_cmd(
    tsvs: tuple[str, ...],
    languages: tuple[str, ...],
    caption_col: str,
    mime_types: str,
    chunks: int,
    sample: int | None,
    val: int,
    test: int,
    **kw,
) -> None:
    """WIT (Wikipedia image-text): English reference descriptions as captions, one task.

    \b
    DHA's CITM task: --sample 130000 --val 13000 --test 5000. See datasets/wit.md.
      cvl build-stream wit --tsv wit_v1.train.all-00000-of-00010.tsv.gz --out streams/wit \\
          --sample 130000 --val 13000 --test 5000
    """
    from cvl.streams.wit import build_wit

    opts = _build_options(kw)
    mimes = tuple(m.strip() for m in mime_types.split(",") if m.strip())
    m = build_wit(
        list(tsvs),
        opts,
        languages=languages,
        caption_col=caption_col,
        mime_types=mimes,
        chunks=chunks,
        sample=sample,
        val=val,
        test=test,
    )
    _finish(m, str(opts.out))


@build_stream.command("goodnews")
@click.option(
    "--captions",
    required=True,
    type=click.Path(dir_okay=False),
    help="captioning_dataset.json (article+caption.json).",
)
@click.option("--urls", type=click.Path(dir_okay=False), default=None, help="img_urls.json.")
@click.option(
    "--splits",
    type=click.Path(dir_okay=False),
    default=None,
    help="img_splits.json (official train/val/test); else val/test are drawn at random.",
)
@click.option(
    "--images",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder of <article>_<index>.jpg; used before URLs.",
)
@_split_options(1)
@_common_options
def goodnews_cmd(
    captions: str,
    urls: str | None,
    splits: str | None,
    images: str | None,
    chunks: int,
    sample: int | None,
    val: int,
    test: int,
    **kw,
) -> None:
    """GoodNews (NYT images, journalists' captions): one task, official or random splits.

    \b
    DHA's CITM task: --sample 130000 --val 13000 --test 5000. See datasets/goodnews.md.
      cvl build-stream goodnews --captions captioning_dataset.json --urls img_urls.json \\
          --splits img_splits.json --out streams/goodnews --sample 130000 --val 13000 --test 5000
    """
    from cvl.streams.goodnews import build_goodnews

    opts = _build_options(kw)
    m = build_goodnews(
        captions,
        opts,
        urls=urls,
        splits=splits,
        images=images,
        chunks=chunks,
        sample=sample,
        val=val,
        test=test,
    )
    _finish(m, str(opts.out))


@build_stream.command("table")
@click.option(
    "--input",
    "inputs",
    required=True,
    multiple=True,
    type=click.Path(dir_okay=False),
    help="CSV / TSV / JSONL / JSON / parquet file (.gz ok). Repeatable.",
)
@click.option(
    "--format",
    "fmt",
    default=None,
    type=click.Choice(["csv", "tsv", "jsonl", "json", "parquet"]),
    help="File format [from the extension].",
)
@click.option("--url-col", required=True, help="Column with an image URL or a local path.")
@click.option("--caption-col", required=True, help="Column with the caption.")
@click.option(
    "--task-col", default=None, help="Column naming each pair's task [one task, or --chunks]."
)
@click.option("--category-col", default=None, help="Column with a category label (for mAP).")
@click.option("--id-col", default=None, help="Column with a unique id [row number].")
@click.option(
    "--split-col",
    default=None,
    help="Column with train / val / test / query / gallery [held out with --val/--test].",
)
@click.option(
    "--images-root",
    type=click.Path(file_okay=False),
    default=None,
    help="Where relative image paths start [the input file's folder].",
)
@click.option("--no-header", is_flag=True, help="CSV/TSV without a header: columns are 0, 1, ...")
@click.option("--task-name", default="all", show_default=True, help="Task name without --task-col.")
@click.option(
    "--limit-per-task",
    type=int,
    default=None,
    callback=_positive,
    help="With --task-col: at most N training pairs per task (seeded).",
)
@_split_options(1)
@_common_options
def table_cmd(
    inputs: tuple[str, ...],
    fmt: str | None,
    url_col: str,
    caption_col: str,
    task_col: str | None,
    category_col: str | None,
    id_col: str | None,
    split_col: str | None,
    images_root: str | None,
    no_header: bool,
    task_name: str,
    limit_per_task: int | None,
    chunks: int,
    sample: int | None,
    val: int,
    test: int,
    **kw,
) -> None:
    """Any image-text table: URL or path + caption (+ task, category, id, split columns).

    \b
    Your own data: one row per pair. URLs are downloaded (img2dataset, cached), paths are read
    from disk. With --task-col each value is a task (order of first appearance; --order to
    change); without it --chunks seeded random chunks. See datasets/README.md.
      cvl build-stream table --input pairs.csv --url-col image --caption-col text \\
          --task-col domain --test 500 --out streams/mine
    """
    from cvl.streams.table import build_table

    opts = _build_options(kw)
    m = build_table(
        list(inputs),
        opts,
        url_col=url_col,
        caption_col=caption_col,
        task_col=task_col,
        category_col=category_col,
        id_col=id_col,
        split_col=split_col,
        fmt=fmt,
        no_header=no_header,
        images_root=images_root,
        chunks=chunks,
        sample=sample,
        val=val,
        test=test,
        limit_per_task=limit_per_task,
        task_name=task_name,
    )
    _finish(m, str(opts.out))


build_stream.add_command(importlib.import_module("cvl.streams.classsplit").class_split_cmd)
