"""The built-in synthetic stream: procedurally drawn shapes with compositional captions.

Each task is a "domain" like a P9D industry: its own shapes, drawing style and background
tint, while colours, sizes, positions and background patterns are shared by all tasks.
Captions read "a large red outlined hexagon at the top left on a striped background"; the
category label (for mAP) is the shape. Deterministic: same arguments -> byte-identical shards.

Two layouts:

- ``overlap = K > 0`` (the default benchmark, K = shapes per task - 1 = 3): neighbouring tasks
  share vocabulary, as COCO and Flickr30K or two P9D industries do. Task t keeps the last K
  shapes of task t-1 and adds new ones, and draws its style from {style of task t-1, its own
  style}; so a model trained on task t-1 already understands much of task t, while task 0's
  style leaves the stream after task 1 and its shapes one by one, and sequential fine-tuning
  forgets them. A picture drawn in task t-1's style also takes task t-1's background tint, so
  half of task t looks like task t-1 but for the new shapes. Styles here are never also
  background words (no "dotted" object on a "dotted" background: one word, one attribute).
- ``overlap = 0`` ("disjoint", the earlier stream): every task has shapes and a style never seen
  in another task. The hard case for old-vs-new distillation.

``pretrain = N`` also writes a broad pretraining set as its own one-task stream in
``OUT/pretrain/`` (N pairs, each drawn from a uniformly chosen domain, so it covers the whole
vocabulary at low density): train CLIP_0 on it once and start every method from it with
``cvl train --init-run`` (the papers' regime: every paper starts from a trained model).

The drawing (vocabulary, domains, one sample planned and rendered) lives in
`synthetic_draw.py`, its names importable from here; this module lays out and writes the stream.
"""

from __future__ import annotations

from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import click
import numpy as np

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT, SEED, Num
from cvl.errors import CvlError
from cvl.io import atomic_dir
from cvl.progress import progress_bar
from cvl.streams.manifest import EvalSet, Manifest, TaskInfo, save_manifest
from cvl.streams.options import echo_summary
from cvl.streams.synthetic_draw import (  # noqa: F401  (re-exported: their home was this module)
    BACKGROUNDS,
    CHAINED_STYLES,
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    SS,
    STYLES,
    TINTS,
    SynthSpec,
    draw_sample,
    drawing_pool,
    encoded_sample,
    plan_sample,
    render_sample,
    task_domains,
    texture_jitter,
)
from cvl.streams.synthetic_time import build_synthetic_time, time_spec
from cvl.streams.writer import BuildReport, ShardSink

SPLITS = ("train", "test", "val", "query", "gallery")
SPLIT_KIND = {"test": "pairs", "val": "pairs", "query": "query", "gallery": "gallery"}


def _write_tasks(
    tmp: Path,
    spec: SynthSpec,
    tasks_def: list[tuple[str, list[dict], dict[str, int]]],
    report: BuildReport,
    bar: Any,
    pool: Pool | None = None,
) -> tuple[dict[str, TaskInfo], dict[str, EvalSet]]:
    """Draw and write every split of every task; a task samples from one or several domains.

    Plans (every random draw) are made in order here; with a `pool` its processes render and
    encode them, and the results come back in the same order, so the shards are the same bytes.
    """

    def jobs():
        for t, (_, doms, counts) in enumerate(tasks_def):
            for si, split in enumerate(SPLITS):
                rng = np.random.default_rng(
                    [spec.seed, t, si] if len(doms) == 1 else [spec.seed, 99, si]
                )
                for _ in range(counts.get(split, 0)):
                    dom = doms[0] if len(doms) == 1 else doms[rng.integers(len(doms))]
                    yield spec.image_size, plan_sample(spec, dom, rng)

    results = (
        pool.imap(encoded_sample, jobs(), chunksize=16) if pool else map(encoded_sample, jobs())
    )
    tasks: dict[str, TaskInfo] = {}
    evals: dict[str, dict] = {sp: {} for sp in SPLITS[1:]}
    for name, doms, counts in tasks_def:
        for split in SPLITS:
            rel = f"train/{name}" if split == "train" else f"eval/{split}/{name}"
            sink = ShardSink(tmp, rel, maxcount=5000)
            for i in range(counts.get(split, 0)):
                jpg, cap, cat = next(results)
                sid = f"{name}-{split}-{i:06d}"
                meta = {"id": sid, "task": name, "category": cat, "source": "synthetic"}
                sink.write(sid, jpg, cap, meta)
                report.read += 1
                report.keep(split)
                bar.update()
            shards = sink.close()
            if split == "train":
                shapes = list(dict.fromkeys(s for d in doms for s in d["shapes"]))
                styles = list(dict.fromkeys(s for d in doms for s in d["styles"]))
                tasks[name] = TaskInfo(
                    name=name,
                    train=shards,
                    description=f"{'/'.join(styles)} {', '.join(shapes)}",
                    categories=shapes,
                    extra={"style": styles[-1], "styles": styles},
                )
            elif shards.count > 0:
                evals[split][name] = shards
    return tasks, {sp: EvalSet(SPLIT_KIND[sp], ts) for sp, ts in evals.items() if ts}


PRETRAIN_DIR = "pretrain"


def build_synthetic(
    out: str | Path,
    spec: SynthSpec,
    name: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    processes: int = 1,
) -> Manifest:
    """Write a synthetic stream folder (atomically) and return its manifest.

    With `spec.pretrain` > 0 the folder also holds the pretraining stream in `pretrain/`.
    `processes` > 1 renders and encodes the images in that many processes: the same bytes.
    """
    if processes < 1:
        raise CvlError("--processes must be positive")
    for field_name in ("tasks", "per_task", "image_size"):
        if getattr(spec, field_name) <= 0:
            raise CvlError(f"--{field_name.replace('_', '-')} must be positive")
    if spec.image_size < 16:
        raise CvlError("--image-size must be at least 16")
    if spec.pretrain < 0:
        raise CvlError("--pretrain must be >= 0")
    for split in SPLITS[1:]:
        if spec.count(split, 1) < 0:
            raise CvlError(f"--{split}-per-task must be >= 0")
    doms = task_domains(spec)
    out = Path(out)
    defs = [(d["name"], [d], {sp: spec.count(sp, t) for sp in SPLITS}) for t, d in enumerate(doms)]
    pre = {"train": spec.pretrain, "test": min(500, max(50, spec.pretrain // 10))}
    total = sum(sum(c.values()) for *_, c in defs) + (sum(pre.values()) if spec.pretrain else 0)
    report = BuildReport()
    args = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    layout = (
        f"neighbouring tasks share {spec.n_overlap()} shapes and a style with its background tint"
        if spec.n_overlap()
        else "disjoint shapes and style per task; own background tint"
    )
    with (
        atomic_dir(out, overwrite=overwrite, kind="stream") as tmp,
        drawing_pool(processes) as pool,
    ):
        bar = progress_bar(total=total, desc="synthetic", unit="img", show=progress, leave=False)
        tasks, eval_sets = _write_tasks(tmp, spec, defs, report, bar, pool)
        if spec.pretrain:
            ptmp = tmp / PRETRAIN_DIR
            pdef = [("pretrain", doms, pre)]
            ptasks, pevals = _write_tasks(ptmp, spec, pdef, BuildReport(), bar, pool)
            pm = Manifest(
                name=f"{name or out.name}-pretrain",
                source="synthetic",
                split_rule="pretraining set: each pair drawn from a uniformly chosen domain of "
                f"the stream '{name or out.name}' (the whole vocabulary)",
                seed=spec.seed,
                task_order=["pretrain"],
                tasks=ptasks,
                eval_sets=pevals,
                source_args={**args, "pretrain_of": name or out.name},
            )
            save_manifest(pm, ptmp)
        bar.close()
        m = Manifest(
            name=name or out.name,
            source="synthetic",
            split_rule=f"one domain per task ({layout}); "
            "colours, sizes, positions and background patterns shared",
            seed=spec.seed,
            task_order=[d["name"] for d in doms],
            tasks=tasks,
            eval_sets=eval_sets,
            source_args={**args, **({"pretrain_stream": PRETRAIN_DIR} if spec.pretrain else {})},
        )
        save_manifest(m, tmp)
        report.save(tmp)
    m.root = out.absolute()
    return m


# -- command line ------------------------------------------------------------------------------
@click.command("synthetic")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Stream folder to write."
)
@click.option(
    "--tasks", default=5, show_default=True, type=POSITIVE_INT, help="Number of tasks (domains)."
)
@click.option(
    "--per-task",
    default=2000,
    show_default=True,
    type=POSITIVE_INT,
    help="Training pairs per task.",
)
@click.option(
    "--first-task",
    default=None,
    type=POSITIVE_INT,
    help="Training pairs of task 0 if different (a larger first task, as Mod-X's COCO).",
)
@click.option(
    "--test-per-task",
    default=None,
    type=NON_NEGATIVE_INT,
    help="Test pairs per task [max(50, per_task/5)].",
)
@click.option(
    "--val-per-task",
    default=None,
    type=NON_NEGATIVE_INT,
    help="Validation pairs per task [max(20, per_task/10)].",
)
@click.option(
    "--query-per-task",
    default=None,
    type=NON_NEGATIVE_INT,
    help="mAP queries per task [max(20, per_task/10)].",
)
@click.option(
    "--gallery-per-task",
    default=None,
    type=NON_NEGATIVE_INT,
    help="mAP gallery items per task [max(50, per_task/2)].",
)
@click.option(
    "--shapes-per-task",
    default=None,
    type=POSITIVE_INT,
    help="Shapes (categories) per task [min(4, 28/tasks)].",
)
@click.option(
    "--overlap",
    default=None,
    type=NON_NEGATIVE_INT,
    help="Shapes each task keeps from the previous task (it also draws half its pictures in "
    "the previous task's style) [shapes per task - 1]; 0 = the 'disjoint' stream (no shape or "
    "style shared between tasks).",
)
@click.option(
    "--pretrain",
    default=0,
    show_default=True,
    type=NON_NEGATIVE_INT,
    help="Also write a broad pretraining stream of N pairs (all domains) to OUT/pretrain: "
    "train CLIP_0 on it, then start methods from it with `cvl train --init-run`.",
)
@click.option(
    "--image-size", default=32, show_default=True, type=POSITIVE_INT, help="Image side in pixels."
)
@click.option(
    "--seed", type=SEED, default=0, show_default=True, help="Same seed -> byte-identical stream."
)
@click.option(
    "--mode",
    default="domains",
    show_default=True,
    type=click.Choice(["domains", "time"]),
    help="domains: one domain per task (above); time: a drifting, time-ordered stream "
    "(TiC-CLIP's setting): one period (year) per task, shapes entering and fading, colour and "
    "size words taking newer names, per-period retrieval sets (benchmarks ret-YEAR). In time "
    "mode --per-task and --test-per-task count per period, --shapes-per-task are the shapes "
    "live in a period, --val-per-task defaults to 0 and there are no query/gallery sets.",
)
@click.option(
    "--first-periods",
    default=1,
    show_default=True,
    type=POSITIVE_INT,
    help="Time mode: periods merged into the first task (TiC-DataComp's 2014-2016: 3).",
)
@click.option(
    "--start-year",
    default=2014,
    show_default=True,
    type=Num(int),
    help="Time mode: the first period's label.",
)
@click.option("--name", default=None, help="Stream name [folder name].")
@click.option(
    "--processes",
    default=1,
    show_default=True,
    type=POSITIVE_INT,
    help="Processes that draw and encode the images (the same bytes for any number).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def synthetic_cmd(
    out: str,
    name: str | None,
    overwrite: bool,
    quiet: bool,
    processes: int,
    mode: str,
    first_periods: int,
    start_year: int,
    **kw: int | None,
) -> None:
    """Procedurally drawn shapes with compositional captions, one domain per task.

    Runs offline in seconds; the embedded default of `make demo` and the tests. Tasks share
    colours, sizes, positions and background patterns, and differ in shapes (the category
    label used by mAP), drawing style and background tint, so sequential fine-tuning forgets.
    By default neighbouring tasks also share most shapes and a style (--overlap), as COCO and
    Flickr30K share vocabulary; --overlap 0 gives the disjoint stream.

    \b
    The papers' regime (a trained start):
      cvl build-stream synthetic --out streams/s --pretrain 3000
      cvl train --stream streams/s/pretrain --method seqft --out runs/clip0
      cvl train --stream streams/s --init-run runs/clip0 --method modx --out runs/modx
    A drifting time-ordered stream (TiC-CLIP's protocol, recipes/tic.sh):
      cvl build-stream synthetic --mode time --tasks 5 --first-periods 3 --out streams/tic
    """
    if mode == "time":
        m = build_synthetic_time(
            out,
            time_spec(kw, first_periods, start_year),
            name=name,
            overwrite=overwrite,
            progress=not quiet,
            processes=processes,
        )
        echo_summary(m, out, quiet)
        return
    if first_periods != 1:
        raise CvlError("--first-periods: only with --mode time")
    m = build_synthetic(
        out,
        SynthSpec(**kw),
        name=name,
        overwrite=overwrite,
        progress=not quiet,
        processes=processes,
    )
    echo_summary(m, out, quiet)
