"""`cvl build-stream class-split`: a class-incremental stream cut from a labelled stream.

IncCLIP's class split of CC12M: every image gets an ImageNet-1k class (BEiT top-1, from
`cvl pseudo-label`), the 1000 classes are cut into K chunks (4 x 250 or 8 x 125) and task t holds
the images whose class is in chunk t. Here the classes are put in a seeded random order (or
kept in index order) and cut into `steps` near-equal contiguous groups of that order. Labels
come from a pseudo-label folder of the stream, or from the samples' own categories (a stream
with categories, e.g. Mod-X's "Flickr30K with cls"). Optional: a confidence threshold on the
pseudo-labels, per-task caps (seeded), held-out test pairs per task.

The new stream gets **new shards** written through the one shard writer (`ShardSink`): image
and caption bytes are copied unchanged, KEY.json gets the new task, `category` = the class
name (so zero-shot, mAP and probes use the classes) and `class`, `label_score`,
`source_task`, `source_category`. A task is a subset of many source shards, and the manifest
lists whole shards, so referencing the source shards would need a per-sample index in the
manifest and a reader that filters: copying keeps one format and a self-contained folder,
at the price of disk (IncCLIP's 2M images at ~25 KB: ~50 GB). The source's eval sets are
re-split by class the same way. The class -> task map goes into the manifest (`class_map`).
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT, SEED, Num
from cvl.errors import CvlError
from cvl.io import atomic_dir, read_json
from cvl.streams.manifest import EvalSet, Manifest, TaskInfo, load_manifest, save_manifest


def partition_classes(
    n_classes: int, steps: int, seed: int = 0, shuffle: bool = True
) -> tuple[list[int], list[list[int]]]:
    """(class order, `steps` groups): a seeded permutation of 0..n-1 cut into near-equal parts.

    Groups differ in size by at most one (the first n % steps groups get the extra class).
    """
    import numpy as np

    if steps <= 0:
        raise CvlError(f"--steps must be positive, got {steps}")
    if steps > n_classes:
        raise CvlError(f"--steps {steps}: more steps than classes ({n_classes})")
    order = (
        np.random.default_rng([seed, 15]).permutation(n_classes)
        if shuffle
        else np.arange(n_classes)
    ).tolist()
    groups = [g.tolist() for g in np.array_split(np.array(order, dtype=np.int64), steps)]
    return order, groups


@dataclass
class ClassSplitOptions:
    steps: int = 4
    labels: str = "auto"  # auto | category | labels folder name or path
    seed: int = 0
    shuffle: bool = True
    min_score: float | None = None
    per_task: int | None = None
    eval_per_task: int | None = None
    test: int = 0
    class_names: str = "auto"  # auto | imagenet | labels | FILE
    task_prefix: str = "step"
    name: str | None = None
    shard_size: int = 10000
    processes: int = 1  # processes writing whole shards (the output does not depend on it)
    overwrite: bool = False
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Labels:
    """Where a sample's class comes from: a pseudo-label folder or its category."""

    kind: str  # "pseudo" | "category"
    names: list[str]  # category string per class id (distinct)
    prompts: list[str]  # zero-shot prompt name per class id
    describe: str
    folder: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _distinct(names: list[str]) -> list[str]:
    """Make repeated names distinct by appending the class id (`crane` -> `crane [517]`)."""
    seen = Counter(names)
    return [n if seen[n] == 1 else f"{n} [{i}]" for i, n in enumerate(names)]


def _find_labels(m: Manifest, src: Path, spec: str) -> Path:
    root = src / "labels"
    if spec == "auto":
        done = sorted(p for p in root.glob("*") if (p / "labels.json").is_file())
        if not done:
            raise CvlError(
                f"stream '{m.name}' has no labels: run `cvl pseudo-label --stream {src} "
                "--model ...` first, or pass --labels category for a stream with categories"
            )
        if len(done) > 1:
            raise CvlError(
                f"stream '{m.name}' has several labels ({', '.join(p.name for p in done)}): "
                "choose one with --labels NAME"
            )
        return done[0]
    for cand in (Path(spec), root / spec):
        if (cand / "labels.json").is_file():
            return cand
    if (root / spec / ".parts").is_dir():
        raise CvlError(f"{root / spec}: labelling is unfinished; rerun `cvl pseudo-label` first")
    raise CvlError(f"--labels {spec}: no labels folder (STREAM/labels/NAME or a path)")


def _prompt_names(spec: str, names: list[str], from_classifier: bool) -> list[str]:
    from cvl.evaluation.zeroshot import load_classnames

    if spec == "auto":
        spec = "imagenet" if from_classifier and len(names) == 1000 else "labels"
    if spec == "labels":
        return [n.split(",")[0].strip() or n for n in names] if from_classifier else list(names)
    out = load_classnames(spec)
    if len(out) != len(names):
        raise CvlError(f"--class-names {spec}: {len(out)} names for {len(names)} classes")
    return out


def _iter_samples(shards: list[Path]):  # noqa: ANN202
    """(entry, raw meta dict) of every usable sample, in shard order."""
    from cvl.data.reader import index_shard
    from cvl.data.samples import read_member

    for s in shards:
        for e in index_shard(str(Path(s).absolute()))[0]:
            meta = {}
            if e.meta:
                try:
                    meta = json.loads(read_member(e, "meta").decode("utf-8"))
                except (ValueError, UnicodeDecodeError):
                    meta = {}
            yield e, meta


def resolve_labels(m: Manifest, src: Path, opts: ClassSplitOptions) -> _Labels:
    """The class universe and where labels come from; errors for a stream without labels."""
    if opts.labels == "category":
        cats: set[str] = set()
        for t in m.task_order:
            for c in m.tasks[t].categories or []:
                cats.add(str(c))
            for _, meta in _iter_samples(m.train_shards(t)):
                if meta.get("category") is not None:
                    cats.add(str(meta["category"]))
        if len(cats) < 2:
            raise CvlError(
                f"stream '{m.name}' has no category labels to split by "
                f"({len(cats)} distinct); label it with `cvl pseudo-label` first"
            )
        names = sorted(cats)
        prompts = _prompt_names(opts.class_names, names, False)
        return _Labels("category", names, prompts, f"sample categories of '{m.name}'")
    folder = _find_labels(m, src, opts.labels)
    info = read_json(folder / "labels.json")
    classes = info.get("classes")
    if not isinstance(classes, list) or not classes:
        raise CvlError(f"{folder}/labels.json: no class list")
    if info.get("stream") != m.fingerprint:
        raise CvlError(
            f"{folder}: labels were made for another version of stream '{m.name}' "
            "(its tasks or counts changed); label it again"
        )
    names = _distinct([str(c) for c in classes])
    prompts = _prompt_names(opts.class_names, [str(c) for c in classes], True)
    return _Labels(
        "pseudo",
        names,
        prompts,
        f"top-1 pseudo-labels of {info.get('model')} ({folder.name})",
        folder,
        info,
    )


def _pick(n: int, cap: int | None, seed: int, salt: int) -> list[int]:
    """Sorted seeded subset of range(n) of size cap (all when cap is None or >= n)."""
    import numpy as np

    if cap is None or cap >= n:
        return list(range(n))
    rng = np.random.default_rng([seed, 15, salt])
    return sorted(rng.permutation(n)[:cap].tolist())


def build_class_split(
    src: str | Path, out: str | Path, opts: ClassSplitOptions
) -> tuple[Manifest, dict[str, Any]]:
    """Write the class-incremental stream `out` from the labelled stream `src`."""
    from cvl.data.samples import read_member
    from cvl.progress import progress_bar
    from cvl.streams.manifest import ShardSet
    from cvl.streams.parallel import join_sets, map_shards, shard_ranges, unique_keys
    from cvl.streams.pseudolabel import read_labels
    from cvl.streams.writer import BuildReport, ShardSink

    src = Path(src)
    m = load_manifest(src)
    if Path(out).absolute() == src.absolute():
        raise CvlError("--out must differ from --from (the source stream is read while writing)")
    if opts.min_score is not None and not 0.0 <= opts.min_score <= 1.0:
        raise CvlError(f"--min-score must be in [0, 1], got {opts.min_score}")
    lab = resolve_labels(m, src, opts)
    n_classes = len(lab.names)
    order, groups = partition_classes(n_classes, opts.steps, opts.seed, opts.shuffle)
    tasks = [f"{opts.task_prefix}{i}" for i in range(opts.steps)]
    task_of: list[str | None] = [None] * n_classes
    for t, g in zip(tasks, groups):
        for c in g:
            task_of[c] = t
    cat_index = {n: i for i, n in enumerate(lab.names)}
    report = BuildReport()
    if opts.test and "test" in m.eval_sets:
        raise CvlError(
            "--test: the source stream already has a 'test' eval set (it is re-split by class); "
            "drop --test or cap it with --eval-per-task"
        )

    def parts() -> list[tuple[str, str, str, list[Path]]]:
        """(split, source set, source task, shards) of every part of the source stream."""
        ps = [("train", "train", t, m.train_shards(t)) for t in m.task_order]
        for s, es in m.eval_sets.items():
            ps += [(s, s, t, m.eval_shards(s, t)) for t in es.tasks]
        return ps

    # Pass 1: the class of every usable sample; counts and drops.
    chosen: dict[tuple[str, str], list[tuple[Any, int, float | None, str]]] = {}
    for split, sset, stask, shards in parts():
        labels = None
        if lab.kind == "pseudo":
            rel = f"train/{stask}" if split == "train" else f"eval/{sset}/{stask}"
            labels = read_labels(lab.folder, rel)
        for e, meta in _iter_samples(shards):
            report.read += 1
            where = f"{sset}/{stask}/{e.key}"
            score = None
            if labels is not None:
                rec = labels.get(e.key)
                if rec is None:
                    report.drop("no_label", where)
                    continue
                c = rec.get("class")
                if c is None:
                    report.drop("unreadable_image", where)
                    continue
                if not isinstance(c, int) or not 0 <= c < n_classes:
                    raise CvlError(
                        f"{lab.folder}/{rel}.jsonl: key {e.key}: class {c!r} is outside the "
                        f"classifier's range 0..{n_classes - 1}"
                    )
                score = rec.get("score")
                if opts.min_score is not None and (score is None or score < opts.min_score):
                    report.drop("below_min_score", where)
                    continue
            else:
                cat = meta.get("category")
                if cat is None or str(cat) not in cat_index:
                    report.drop("no_label", where)
                    continue
                c = cat_index[str(cat)]
            t = task_of[c]
            if t is None:
                report.drop("class_in_no_task", where)
                continue
            chosen.setdefault((split, t), []).append((e, c, score, stask))  # no meta: memory
    # Held-out test pairs, caps.
    if opts.test:
        for i, t in enumerate(tasks):
            rows = chosen.get(("train", t), [])
            hold = set(_pick(len(rows), opts.test, opts.seed, 1000 + i)) if rows else set()
            if len(hold) >= len(rows) and rows:
                raise CvlError(f"--test {opts.test}: task '{t}' has only {len(rows)} samples")
            chosen[("test", t)] = [r for j, r in enumerate(rows) if j in hold]
            chosen[("train", t)] = [r for j, r in enumerate(rows) if j not in hold]
    for (split, t), rows in list(chosen.items()):
        cap = opts.per_task if split == "train" else opts.eval_per_task
        keep = _pick(len(rows), cap, opts.seed, zlib.crc32(f"{split}/{t}".encode()))
        if len(keep) < len(rows):
            reason = "over_per_task_cap" if split == "train" else "over_eval_per_task_cap"
            report.dropped[reason] += len(rows) - len(keep)
        chosen[(split, t)] = [rows[j] for j in keep]
    for i, t in enumerate(tasks):
        if not chosen.get(("train", t)):
            g = groups[i]
            shown = ", ".join(lab.names[c] for c in g[:3]) + (", ..." if len(g) > 3 else "")
            raise CvlError(
                f"task '{t}' (chunk {i}: {len(g)} classes: {shown}) has no training samples"
                + (f" with score >= {opts.min_score}" if opts.min_score is not None else "")
                + "; use fewer --steps or a lower --min-score"
            )
    # Pass 2: write.
    name = opts.name or Path(out).name
    eval_kinds = {s: es.kind for s, es in m.eval_sets.items()}
    if opts.test:
        eval_kinds["test"] = "pairs"
    with atomic_dir(out, overwrite=opts.overwrite, kind="stream", inputs=[src]) as tmp:
        train_sets, eval_sets = {}, {s: {} for s in eval_kinds}
        total = sum(len(v) for v in chosen.values())
        bar = progress_bar(total=total, desc="class split", unit="img", show=opts.progress)
        sets = [  # (task, split, rows) in the order they are written
            (t, split, chosen[(split, t)])
            for t in tasks
            for split in ["train", *eval_kinds]
            if chosen.get((split, t))
        ]
        keys = [unique_keys(r[0].key for r in rows) for _, _, rows in sets]
        jobs = [  # (set, shard number, its rows): fixed by the rows and --shard-size alone
            (si, k, rg)
            for si, (_, _, rows) in enumerate(sets)
            for k, rg in enumerate(shard_ranges(len(rows), opts.shard_size))
        ]

        def write(j: int) -> ShardSet:
            si, k, rg = jobs[j]
            t, split, rows = sets[si]
            rel = f"train/{t}" if split == "train" else f"eval/{split}/{t}"
            sink = ShardSink(tmp, rel, opts.shard_size, first=k)
            for pos in rg:
                e, c, score, stask = rows[pos]
                meta = json.loads(read_member(e, "meta").decode("utf-8")) if e.meta else {}
                jpg = read_member(e, "image")
                cap = read_member(e, "text").decode("utf-8")
                new = dict(meta)
                new.update(
                    {
                        "id": meta.get("id", e.key),
                        "task": t,
                        "category": lab.names[c],
                        "class": c,
                        "source_task": stask,
                    }
                )
                if lab.kind == "pseudo":
                    new["label_score"] = score
                    new["source_category"] = meta.get("category")
                sink.write(keys[si][pos], jpg, cap, new)
            return sink.close()

        done: dict[int, list[ShardSet]] = {}
        for (si, _, rg), ss in zip(jobs, map_shards(write, len(jobs), opts.processes)):
            done.setdefault(si, []).append(ss)
            report.kept[sets[si][1]] += ss.count
            bar.update(len(rg))
        for si, (t, split, _) in enumerate(sets):
            if split == "train":
                train_sets[t] = join_sets(done[si])
            else:
                eval_sets[split][t] = join_sets(done[si])
        bar.close()
        class_counts = {
            t: dict(sorted(Counter(r[1] for r in chosen[("train", t)]).items())) for t in tasks
        }
        man = Manifest(
            name=name,
            source=m.source,
            split_rule=(
                f"class split of stream '{m.name}': {n_classes} classes "
                f"({lab.describe}) in a {'seeded random' if opts.shuffle else 'index'} order "
                f"(seed {opts.seed}) cut into {opts.steps} groups; task t = samples whose class "
                f"is in group t"
                + (f"; score >= {opts.min_score}" if opts.min_score is not None else "")
                + (f"; at most {opts.per_task} training pairs per task" if opts.per_task else "")
                + (f"; {opts.test} test pairs per task held out" if opts.test else "")
            ),
            seed=opts.seed,
            task_order=tasks,
            tasks={
                t: TaskInfo(
                    name=t,
                    train=train_sets[t],
                    description=f"{len(g)} classes of chunk {i}",
                    categories=[lab.names[c] for c in sorted(g)],
                    extra={"classes": sorted(g)},
                )
                for i, (t, g) in enumerate(zip(tasks, groups))
            },
            eval_sets={s: EvalSet(kind=eval_kinds[s], tasks=v) for s, v in eval_sets.items() if v},
            source_args={
                "from": str(src.absolute()),
                "from_name": m.name,
                "labels": str(lab.folder) if lab.folder else "category",
                "steps": opts.steps,
                "shuffle": opts.shuffle,
                "min_score": opts.min_score,
                "per_task": opts.per_task,
                "eval_per_task": opts.eval_per_task,
                "test": opts.test,
                "class_names": opts.class_names,
            },
            class_map={
                "labels": lab.describe,
                "names": lab.names,
                "prompts": lab.prompts,
                "task_of": task_of,
                "order": order,
            },
        )
        save_manifest(man, tmp)
        report.notes["split"] = {
            "rule": man.split_rule,
            "classes_per_task": {t: len(g) for t, g in zip(tasks, groups)},
            "classes_with_samples": {t: len(class_counts[t]) for t in tasks},
            "train_class_counts": {
                t: {str(k): v for k, v in cc.items()} for t, cc in class_counts.items()
            },
        }
        report.save(tmp)
    return load_manifest(out), report.to_json()


@click.command("class-split")
@click.option(
    "--from",
    "src",
    required=True,
    type=click.Path(file_okay=False),
    help="Labelled source stream (e.g. one CC12M chunk labelled by `cvl pseudo-label`).",
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Stream to write.")
@click.option(
    "--labels",
    default="auto",
    show_default=True,
    help="Pseudo-labels NAME (STREAM/labels/NAME) or folder; `category` = the samples' "
    "categories; auto = the stream's only labels folder.",
)
@click.option(
    "--steps", default=4, show_default=True, type=POSITIVE_INT, help="Tasks (class groups)."
)
@click.option(
    "--seed", type=SEED, default=0, show_default=True, help="Seed of the class order and caps."
)
@click.option(
    "--ordered", is_flag=True, help="Cut the classes in index order instead of a seeded order."
)
@click.option(
    "--min-score",
    type=Num(float, 0, 1),
    default=None,
    help="Drop samples whose pseudo-label confidence is lower (0..1).",
)
@click.option(
    "--per-task",
    default=None,
    type=POSITIVE_INT,
    help="At most N training pairs per task (seeded) [all].",
)
@click.option(
    "--eval-per-task",
    default=None,
    type=POSITIVE_INT,
    help="At most N pairs per task in each eval set [all].",
)
@click.option(
    "--test",
    type=NON_NEGATIVE_INT,
    default=0,
    show_default=True,
    help="Test pairs per task held out from its training pairs (eval set 'test').",
)
@click.option(
    "--class-names",
    default="auto",
    show_default=True,
    help="Names in zero-shot prompts: imagenet (CLIP's cleaned names), labels (the "
    "classifier's, first synonym), or a file; auto = imagenet for 1000 classes.",
)
@click.option("--name", default=None, help="Stream name [folder name].")
@click.option("--shard-size", default=10000, show_default=True, type=POSITIVE_INT)
@click.option(
    "--processes",
    type=POSITIVE_INT,
    default=1,
    show_default=True,
    help="Processes writing the shards (whole shards each; the output does not depend on it).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def class_split_cmd(
    src: str,
    out: str,
    labels: str,
    steps: int,
    seed: int,
    ordered: bool,
    min_score: float | None,
    per_task: int | None,
    eval_per_task: int | None,
    test: int,
    class_names: str,
    name: str | None,
    shard_size: int,
    processes: int,
    overwrite: bool,
    quiet: bool,
) -> None:
    """Class-incremental stream: classes in a seeded order, cut into --steps tasks (IncCLIP).

    \b
    Task t holds the samples whose class (pseudo-label or category) is in class group t; the
    class -> task map is stored in stream.json (`class_map`) and `cvl eval` reports zero-shot
    classification among each task's classes, the classes seen so far and all classes.
      cvl pseudo-label --stream streams/cc12m-pool --model microsoft/beit-base-patch16-224
      cvl build-stream class-split --from streams/cc12m-pool --out streams/cc2m-class4 \\
          --steps 4 --per-task 500000 --test 5000
    """
    from cvl.streams.cli import echo_summary

    opts = ClassSplitOptions(
        steps=steps,
        labels=labels,
        seed=seed,
        shuffle=not ordered,
        min_score=min_score,
        per_task=per_task,
        eval_per_task=eval_per_task,
        test=test,
        class_names=class_names,
        name=name,
        shard_size=shard_size,
        processes=processes,
        overwrite=overwrite,
        progress=not quiet,
    )
    m, rep = build_class_split(src, out, opts)
    if quiet:
        return
    echo_summary(m, out)
    click.echo(
        f"  read {rep['read']}, kept {rep['kept_total']}, dropped {rep['dropped_total']}"
        + (
            f" ({', '.join(f'{k} {v}' for k, v in rep['dropped'].items())})"
            if rep["dropped"]
            else ""
        )
    )
