"""The synthetic stream's time mode (`cvl build-stream synthetic --mode time`): a drifting web.

A stand-in for TiC-CLIP's time-ordered web data (Garg et al. 2024) that runs in CI: one
period per "year" (labels from ``--start-year``), whose pictures drift as web data does:

- **concepts come and go**: the shapes of period p are a window of ``--shapes-per-task`` over
  a seeded order of all shapes, moved on by (window - ``--overlap``) shapes each period, and
  drawn by popularity ∝ (1, 2, ..., window): the newest concepts are the most frequent, the
  oldest fade out and then leave the stream;
- **vocabulary shifts**: every colour and size word gets a newer name (red -> crimson, large
  -> huge, ...) from a seeded period on: half of the captions use it in the period before,
  all of them from then on, so the same picture is described differently across time;
- **the look changes**: each period has its own drawing style and background tint and draws
  half its pictures in the previous period's (as the domains mode's neighbouring tasks).

Tasks are periods in time order; ``--first-periods K`` merges the first K periods into the
first task (TiC-DataComp's first step is 2014–2016). Each period has its own retrieval set
(``--test-per-task`` pairs drawn from its distribution: TiC's dynamic retrieval), written as
benchmark ``ret-YEAR`` and in its task's ``test`` set; ``--val-per-task`` val pairs per task.
The manifest's ``time`` field, benchmarks and build report are those of a time-ordered table
(`cvl.streams.timesplit`), so `cvl eval` reports TiC's in-distribution / backward / forward
transfer. Same seed -> byte-identical shards, for any ``--processes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cvl.errors import CvlError
from cvl.io import atomic_dir
from cvl.streams.manifest import EvalSet, Manifest, ShardSet, TaskInfo, save_manifest
from cvl.streams.pipeline import task_folders, time_counts
from cvl.streams.synthetic_draw import (
    CHAINED_STYLES,
    SHAPES,
    TINTS,
    SynthSpec,
    drawing_pool,
    encoded_sample,
    plan_sample,
)
from cvl.streams.timesplit import time_layout
from cvl.streams.writer import BuildReport, ShardSink

# the newer name each colour and size word takes on at some period (vocabulary drift)
NEWER_WORDS = {
    "red": "crimson",
    "green": "emerald",
    "blue": "azure",
    "yellow": "golden",
    "purple": "violet",
    "orange": "amber",
    "white": "ivory",
    "cyan": "teal",
    "small": "tiny",
    "medium": "midsize",
    "large": "huge",
}


@dataclass(frozen=True)
class TimeSpec:
    """Parameters of a drifting synthetic stream (recorded in the manifest's source_args)."""

    tasks: int = 5  # training tasks; periods = tasks + first_periods - 1
    first_periods: int = 1
    per_period: int = 400  # training pairs per period
    test_per_period: int = 64  # retrieval pairs per period
    val_per_task: int = 0
    shapes: int = 4  # shapes (concepts) live in a period
    overlap: int | None = None  # shapes neighbouring periods share [shapes - 1]
    start_year: int = 2014
    image_size: int = 32
    seed: int = 0

    @property
    def periods(self) -> int:
        return self.tasks + self.first_periods - 1

    def labels(self) -> list[str]:
        return [str(self.start_year + p) for p in range(self.periods)]


def period_domains(spec: TimeSpec) -> list[dict]:
    """Per period: its shapes with their popularity, styles, tints and word names."""
    n, w = spec.periods, spec.shapes
    ov = w - 1 if spec.overlap is None else spec.overlap
    if not 0 <= ov < w:
        raise CvlError(f"--overlap must be in [0, {w - 1}] with {w} shapes a period (got {ov})")
    need = w + (n - 1) * (w - ov)
    if need > len(SHAPES):
        raise CvlError(
            f"{n} periods of {w} shapes (overlap {ov}) need {need} shapes; there are {len(SHAPES)}"
        )
    rng = np.random.default_rng([spec.seed, 1789])
    order = [list(SHAPES)[i] for i in rng.permutation(len(SHAPES))]
    switch = {word: int(rng.integers(1, max(2, n))) for word in NEWER_WORDS}  # first period of
    doms = []
    for p in range(n):
        shapes = order[p * (w - ov) : p * (w - ov) + w]
        weights = np.arange(1, w + 1, dtype=float)
        own = CHAINED_STYLES[p % len(CHAINED_STYLES)]
        prev = CHAINED_STYLES[(p - 1) % len(CHAINED_STYLES)]
        styles = [own] if p == 0 else [prev, own]
        doms.append(
            {
                "shapes": shapes,
                "weights": (weights / weights.sum()).tolist(),
                "style": own,
                "styles": styles,
                "tint": TINTS[p % len(TINTS)],
                "tints": [
                    TINTS[(p + 1 - len(styles) + i) % len(TINTS)] for i in range(len(styles))
                ],
                # the newer name: half of the captions in the period before its switch, then all
                "words": {
                    word: (new, 1.0 if p >= switch[word] else 0.5 if p == switch[word] - 1 else 0.0)
                    for word, new in NEWER_WORDS.items()
                },
            }
        )
    return doms


def build_synthetic_time(
    out: str | Path,
    spec: TimeSpec,
    name: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    processes: int = 1,
) -> Manifest:
    """Write a drifting synthetic stream folder (atomically) and return its manifest."""
    for k in ("tasks", "first_periods", "per_period", "shapes", "image_size"):
        if getattr(spec, k) <= 0:
            raise CvlError(f"time mode: {k.replace('_', ' ')} must be positive")
    if spec.test_per_period < 0 or spec.val_per_task < 0:
        raise CvlError("time mode: test and val pairs must be >= 0")
    doms = period_domains(spec)
    labels = spec.labels()
    k = spec.first_periods
    groups = [labels[:k]] + [[p] for p in labels[k:]]
    task_periods = {(g[0] if len(g) == 1 else f"{g[0]}-{g[-1]}"): g for g in groups}
    # what is written, in order: (split, task, sub-folder period or None, pairs, the periods
    # (domain indices) its pairs are drawn from, the unit's generator)
    units: list[tuple[str, str, str | None, int, list[int], np.random.Generator]] = []
    for ti, (task, ps) in enumerate(task_periods.items()):
        idx = [labels.index(p) for p in ps]
        sub = len(ps) > 1
        for pi in idx:
            rng = np.random.default_rng([spec.seed, 5150, pi, 0])
            units.append(("train", task, labels[pi] if sub else None, spec.per_period, [pi], rng))
        if spec.val_per_task:
            rng = np.random.default_rng([spec.seed, 5150, 1000 + ti, 2])
            units.append(("val", task, None, spec.val_per_task, idx, rng))
        for pi in idx:
            rng = np.random.default_rng([spec.seed, 5150, pi, 1])
            units.append(
                ("test", task, labels[pi] if sub else None, spec.test_per_period, [pi], rng)
            )
    synth = SynthSpec(image_size=spec.image_size, seed=spec.seed)

    def jobs():
        for *_, n, idx, rng in units:
            for _ in range(n):
                d = doms[idx[0]] if len(idx) == 1 else doms[idx[int(rng.integers(len(idx)))]]
                yield spec.image_size, plan_sample(synth, d, rng)

    out = Path(out)
    folder = task_folders(list(task_periods))
    report = BuildReport()
    sets: dict[tuple[str, str, str | None], ShardSet] = {}
    total = sum(u[3] for u in units)
    with (
        atomic_dir(out, overwrite=overwrite, kind="stream") as tmp,
        drawing_pool(processes) as pool,
    ):
        results = (
            pool.imap(encoded_sample, jobs(), chunksize=16) if pool else map(encoded_sample, jobs())
        )
        bar = tqdm(total=total, desc="synthetic (time)", unit="img", disable=not progress)
        for split, task, period, n, idx, _ in units:
            rel = f"train/{folder[task]}" if split == "train" else f"eval/{split}/{folder[task]}"
            sink = ShardSink(tmp, rel + (f"/{period}" if period else ""), maxcount=5000)
            for i in range(n):
                jpg, cap, cat = next(results)
                per = period or labels[idx[0]] if len(idx) == 1 else None
                sid = f"{task}-{period or 'all'}-{split}-{i:06d}"
                meta = {"id": sid, "task": task, "category": cat, "source": "synthetic"}
                sink.write(sid, jpg, cap, {**meta, **({"period": per} if per else {})})
                report.read += 1
                report.keep(split)
                bar.update()
            ss = sink.close()
            sets[(split, task, period)] = ss
        bar.close()
        for split, task, period in list(sets):  # a merged task's whole sets
            if period is not None and (split, task, None) not in sets:
                parts = [v for (s2, t2, p2), v in sets.items() if (s2, t2) == (split, task) and p2]
                sets[(split, task, None)] = ShardSet(
                    [s for v in parts for s in v.shards], sum(v.count for v in parts)
                )
        tasks = {}
        for task, ps in task_periods.items():
            ds = [doms[labels.index(p)] for p in ps]
            shapes = list(dict.fromkeys(s for d in ds for s in d["shapes"]))
            tasks[task] = TaskInfo(
                name=task,
                train=sets[("train", task, None)],
                description=f"{'/'.join(ps)}: {', '.join(shapes)}",
                categories=shapes,
                extra={"periods": ps},
            )
        evals = {
            split: EvalSet("pairs", {t: sets[(split, t, None)] for t in task_periods})
            for split in ("test", "val")
            if all(
                sets.get((split, t, None)) and sets[(split, t, None)].count for t in task_periods
            )
        }
        tests = {}
        for task, ps in task_periods.items():
            for p in ps:
                ss = sets.get(("test", task, p)) or sets.get(("test", task, None))
                if ss is not None:
                    tests[p] = ss
        layout = time_layout(task_periods, tests, unit="year", column=None)
        m = Manifest(
            name=name or out.name,
            source="synthetic",
            split_rule=f"time-ordered synthetic web ({spec.periods} yearly periods from "
            f"{labels[0]}; the first {k} merged): shapes enter and fade, colour and size words "
            "take newer names, each period has its own style and tint",
            seed=spec.seed,
            task_order=list(task_periods),
            tasks=tasks,
            eval_sets=evals,
            source_args={
                "mode": "time",
                **{f: getattr(spec, f) for f in spec.__dataclass_fields__},
            },
            benchmarks=layout["benchmarks"],
            time=layout["time"],
        )
        save_manifest(m, tmp)
        report.notes["task_order"] = m.task_order
        report.notes["time"] = time_counts(m, sets)
        report.save(tmp)
    m.root = out.absolute()
    return m


def time_spec(kw: dict, first_periods: int, start_year: int) -> TimeSpec:
    """The `synthetic --mode time` command's options as a TimeSpec (clear errors for the
    options of the domains mode)."""
    bad = [k for k in ("first_task", "query_per_task", "gallery_per_task") if kw.get(k)]
    bad += ["pretrain"] if kw.get("pretrain") else []
    if bad:
        opts = ", ".join("--" + k.replace("_", "-") for k in bad)
        raise CvlError(
            f"{opts}: not in --mode time (its first task is the first step; it writes "
            "train, val and per-period test sets)"
        )
    per = int(kw["per_task"])
    test = kw.get("test_per_task")
    return TimeSpec(
        tasks=int(kw["tasks"]),
        first_periods=first_periods,
        per_period=per,
        test_per_period=max(50, per // 5) if test is None else int(test),
        val_per_task=int(kw.get("val_per_task") or 0),
        shapes=int(kw.get("shapes_per_task") or 4),
        overlap=kw.get("overlap"),
        start_year=start_year,
        image_size=int(kw["image_size"]),
        seed=int(kw["seed"]),
    )
