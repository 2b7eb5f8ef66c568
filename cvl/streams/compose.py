"""Composite streams: tasks taken from other streams, plus benchmarks (eval sets of no task).

``cvl build-stream compose --task coco=streams/coco --task f30k-1=streams/f30k:part=1/5 ...
--eval f30k-1k=streams/f30k --out streams/modx``

A task spec is ``NAME=STREAM[:task=T][:part=I/K][:test=split|full|none]``:

- whole task (no ``part``): its training shards and its eval sets (test, val, query,
  gallery) are *referenced*, not copied: ``OUT/sources/<stream>`` is a relative symlink to
  the source stream and the manifest lists ``sources/<stream>/train/...``;
- ``part=I/K``: the source task's training samples are cut into K seeded random, equal
  (±1) parts and part I is copied into ``OUT/train/NAME`` (samples are copied byte for byte,
  only KEY.json's task changes). Parts of the same source with the same seed are disjoint.
  Its test/val sets are by default the same part of the source's sets (``test=split``), or
  the whole source sets (``test=full``, referenced), or none (``test=none``).

An eval spec ``NAME=STREAM[:task=T][:set=test]`` adds a benchmark: a source task's eval set
scored after every task (DKR Setting-2: train on EC parts, test on Flickr30K, COCO and EC).

The manifest records every source stream with the SHA-256 of its stream.json; loading the
composed stream refuses a source that changed since (`manifest.check_sources`).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from cvl.checks import POSITIVE_INT, SEED
from cvl.errors import CvlError
from cvl.io import atomic_dir
from cvl.streams.manifest import (
    MANIFEST,
    Benchmark,
    EvalSet,
    Manifest,
    ShardSet,
    TaskInfo,
    load_manifest,
    save_manifest,
)
from cvl.streams.options import echo_summary
from cvl.streams.parallel import copy_entries
from cvl.streams.pipeline import task_folders
from cvl.streams.streamfiles import file_sha256
from cvl.streams.writer import BuildReport

TEST_MODES = ("split", "full", "none")


@dataclass
class TaskSpec:
    """One task of a composed stream: which stream/task, which part, which eval sets."""

    name: str
    stream: Path
    task: str | None = None
    part: tuple[int, int] | None = None
    test: str = "split"


@dataclass
class EvalSpec:
    """One benchmark: the eval set `set` of task `task` of a stream."""

    name: str
    stream: Path
    task: str | None = None
    set: str = "test"


def _split_spec(spec: str, what: str, keys: tuple[str, ...]) -> tuple[str, Path, dict[str, str]]:
    if "=" not in spec:
        raise CvlError(f"{what} '{spec}': expected NAME=STREAM[:key=value...]")
    name, rest = spec.split("=", 1)
    name = name.strip()
    if not name:
        raise CvlError(f"{what} '{spec}': empty name")
    parts = rest.split(":")
    path, opts = parts[0], {}
    for p in parts[1:]:
        if "=" not in p:
            raise CvlError(f"{what} '{spec}': '{p}' is not key=value ({', '.join(keys)})")
        k, v = p.split("=", 1)
        if k not in keys:
            raise CvlError(f"{what} '{spec}': unknown key '{k}' (known: {', '.join(keys)})")
        opts[k] = v
    if not path:
        raise CvlError(f"{what} '{spec}': no stream folder")
    return name, Path(path), opts


def parse_task_spec(spec: str) -> TaskSpec:
    """``NAME=STREAM[:task=T][:part=I/K][:test=split|full|none]``."""
    name, path, o = _split_spec(spec, "--task", ("task", "part", "test"))
    part = None
    if "part" in o:
        try:
            i, k = (int(x) for x in o["part"].split("/"))
        except ValueError:
            raise CvlError(f"--task '{spec}': part must be I/K, e.g. 1/5") from None
        if not (k >= 1 and 1 <= i <= k):
            raise CvlError(f"--task '{spec}': part {i}/{k}: need 1 <= I <= K")
        part = (i, k)
    test = o.get("test", "split")
    if test not in TEST_MODES:
        raise CvlError(f"--task '{spec}': test must be one of {', '.join(TEST_MODES)}")
    return TaskSpec(name, path, o.get("task"), part, test)


def parse_eval_spec(spec: str) -> EvalSpec:
    """``NAME=STREAM[:task=T][:set=test]``."""
    name, path, o = _split_spec(spec, "--eval", ("task", "set"))
    return EvalSpec(name, path, o.get("task"), o.get("set", "test"))


def _source_task(m: Manifest, task: str | None, spec: str) -> str:
    if task is not None:
        if task not in m.tasks:
            raise CvlError(
                f"{spec}: stream '{m.name}' has no task '{task}' (tasks: {m.task_order})"
            )
        return task
    if len(m.task_order) != 1:
        raise CvlError(
            f"{spec}: stream '{m.name}' has {len(m.task_order)} tasks "
            f"({', '.join(m.task_order)}): name one with :task=NAME"
        )
    return m.task_order[0]


def _samples(shards: list[Path]) -> list[tuple[str, Any]]:
    """(shard, Entry) of every usable sample of the shards, in order."""
    from cvl.data.reader import index_shard

    out = []
    for s in shards:
        entries, _ = index_shard(str(Path(s).absolute()))
        out.extend((str(s), e) for e in entries)
    return out


def part_indices(n: int, part: tuple[int, int], key: str, seed: int, what: str = "") -> list[int]:
    """Sorted sample indices of part I of K: a seeded permutation cut into K equal parts.

    The permutation depends on (seed, key) only, so parts 1..K of one key are disjoint.
    """
    i, k = part
    if k > n:
        raise CvlError(f"{what or key}: {k} parts asked but only {n} samples")
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    chunks = np.array_split(rng.permutation(n), k)
    return sorted(chunks[i - 1].tolist())


def copy_part(
    shards: list[Path],
    idx: list[int],
    root: Path,
    rel: str,
    task: str,
    extra: dict[str, Any],
    shard_size: int,
    processes: int = 1,
) -> ShardSet:
    """Copy the samples `idx` of `shards` into `root/rel/*.tar` with task (and extra) meta;
    `processes` > 1 copies whole shards in that many processes (the same bytes)."""
    from cvl.data.index import Entries

    entries = Entries.of_shards([str(Path(s).absolute()) for s in shards]).take(idx)

    def meta(_: int, own: dict[str, Any]) -> dict[str, Any]:
        own.update(extra)
        own["task"] = task
        return own

    return copy_entries(entries, root, rel, meta, shard_size, processes)


class _Refs:
    """Source streams by folder: link names inside OUT and their recorded fingerprints."""

    def __init__(self, tmp: Path, out: Path) -> None:
        self.tmp, self.out = tmp, out.absolute()
        self.by_path: dict[Path, tuple[str, Manifest]] = {}
        self.records: list[dict[str, Any]] = []
        self.used: set[str] = set()

    def get(self, path: Path) -> tuple[str, Manifest]:
        p = Path(path).absolute()
        key = p.resolve()
        if key in self.by_path:
            return self.by_path[key]
        m = load_manifest(p)
        inside = _inside(p, self.tmp)
        if inside is not None:  # built by a protocol preset inside the output folder
            link = inside
        else:
            base = p.name or "stream"
            name, n = base, 1
            while name in self.used or (self.tmp / "sources" / name).exists():
                name, n = f"{base}_{n}", n + 1
            self.used.add(name)
            link = f"sources/{name}"
            (self.tmp / "sources").mkdir(exist_ok=True)
            target = os.path.relpath(p, self.out / "sources")
            os.symlink(target, self.tmp / link, target_is_directory=True)
        self.records.append(
            {
                "name": m.name,
                "link": link,
                "path": str(self.out / link) if inside is not None else str(p),
                "stream_sha256": file_sha256(p / MANIFEST),
                "fingerprint": m.fingerprint,
            }
        )
        self.by_path[key] = (link, m)
        return link, m

    def ref(self, link: str, m: Manifest, shards: list[str]) -> list[str]:
        """Shard entries of `m` as paths inside OUT (absolute ones stay absolute)."""
        out = []
        for s in shards:
            if Path(s).is_absolute():
                out.append(s)
            else:
                out.append(f"{link}/{s}")
        return out


def _inside(p: Path, root: Path) -> str | None:
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None


def compose(
    tasks: list[TaskSpec],
    evals: list[EvalSpec],
    out: str | Path,
    *,
    name: str | None = None,
    seed: int = 0,
    shard_size: int = 10000,
    overwrite: bool = False,
    split_rule: str | None = None,
    source: str = "compose",
    extra_args: dict[str, Any] | None = None,
    tmp: Path | None = None,
    processes: int = 1,
) -> Manifest:
    """Write a composed stream (atomically, unless `tmp` is an already open build folder);
    parts are copied in `processes` processes (whole shards each: the same bytes)."""
    if not tasks:
        raise CvlError("compose: give at least one --task NAME=STREAM")
    names = [t.name for t in tasks]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise CvlError(f"compose: task name(s) given twice: {', '.join(sorted(dup))}")
    bnames = [e.name for e in evals]
    if len(set(bnames)) != len(bnames):
        raise CvlError("compose: an --eval name is given twice")
    out = Path(out)
    if tmp is not None:
        return _compose_into(
            tmp,
            out,
            tasks,
            evals,
            name,
            seed,
            shard_size,
            split_rule,
            source,
            extra_args,
            processes,
        )
    if out.exists() and not overwrite:
        raise CvlError(f"{out.absolute()} exists (pass --overwrite to replace it)")
    inputs = [t.stream for t in tasks] + [e.stream for e in evals]
    with atomic_dir(out, overwrite=overwrite, kind="stream", inputs=inputs) as t:
        m = _compose_into(
            t, out, tasks, evals, name, seed, shard_size, split_rule, source, extra_args, processes
        )
    m.root = out.absolute()
    return m


def _compose_into(
    tmp: Path,
    out: Path,
    tasks: list[TaskSpec],
    evals: list[EvalSpec],
    name: str | None,
    seed: int,
    shard_size: int,
    split_rule: str | None,
    source: str,
    extra_args: dict[str, Any] | None,
    processes: int = 1,
) -> Manifest:
    refs = _Refs(tmp, out)
    report = BuildReport()
    folders = task_folders(names := [t.name for t in tasks])
    infos: dict[str, TaskInfo] = {}
    evsets: dict[str, dict[str, ShardSet]] = {}
    kinds: dict[str, str] = {}
    rules = []
    for spec in tasks:
        label = f"--task {spec.name}"
        link, m = refs.get(spec.stream)
        st = _source_task(m, spec.task, label)
        origin: dict[str, Any] = {"stream": m.name, "link": link, "task": st}
        if spec.part is None:
            m.train_shards(st)  # a task built in place (rows of shards) is refused, in one line
            train = ShardSet(refs.ref(link, m, m.tasks[st].train.shards), m.tasks[st].train.count)
            report.notes.setdefault("referenced", {})[spec.name] = train.count
            rules.append(f"{spec.name} = {m.name}/{st}")
        else:
            i, k = spec.part
            origin["part"] = f"{i}/{k}"
            shards = m.train_shards(st)
            n = len(_samples(shards))
            what = f"{label}: stream '{m.name}' task '{st}' train"
            idx = part_indices(n, spec.part, f"{m.name}/{st}/train", seed, what)
            train = copy_part(
                shards,
                idx,
                tmp,
                f"train/{folders[spec.name]}",
                spec.name,
                {"part": f"{i}/{k}", "source_task": st},
                shard_size,
                processes,
            )
            report.notes.setdefault("copied", {})[spec.name] = train.count
            rules.append(f"{spec.name} = {m.name}/{st} part {i}/{k}")
        report.kept["train"] += train.count
        infos[spec.name] = TaskInfo(
            name=spec.name,
            train=train,
            description=(m.tasks[st].description or m.name)
            + (f" (part {spec.part[0]}/{spec.part[1]})" if spec.part else ""),
            categories=m.tasks[st].categories,
            extra={"from": origin},
        )
        if spec.test == "none":
            continue
        for sname, es in m.eval_sets.items():
            if st not in es.tasks or es.tasks[st].count == 0:
                continue
            if kinds.setdefault(sname, es.kind) != es.kind:
                raise CvlError(f"compose: eval set '{sname}' has different kinds in the sources")
            if spec.part is None or spec.test == "full":
                ss = ShardSet(refs.ref(link, m, es.tasks[st].shards), es.tasks[st].count)
            else:
                shards = m.eval_shards(sname, st)
                n = len(_samples(shards))
                what = f"{label}: stream '{m.name}' task '{st}' {sname}"
                idx = part_indices(n, spec.part, f"{m.name}/{st}/{sname}", seed, what)
                ss = copy_part(
                    shards,
                    idx,
                    tmp,
                    f"eval/{sname}/{folders[spec.name]}",
                    spec.name,
                    {"part": f"{spec.part[0]}/{spec.part[1]}", "source_task": st},
                    shard_size,
                    processes,
                )
            evsets.setdefault(sname, {})[spec.name] = ss
            report.kept[sname] += ss.count
    benchmarks: dict[str, Benchmark] = {}
    for e in evals:
        label = f"--eval {e.name}"
        link, m = refs.get(e.stream)
        st = _source_task(m, e.task, label)
        es = m.eval_sets.get(e.set)
        if es is None or st not in es.tasks:
            raise CvlError(f"{label}: stream '{m.name}' has no '{e.set}' set for task '{st}'")
        if es.kind != "pairs":
            raise CvlError(f"{label}: '{e.set}' is a {es.kind} set; benchmarks are pairs sets")
        benchmarks[e.name] = Benchmark(
            "pairs",
            ShardSet(refs.ref(link, m, es.tasks[st].shards), es.tasks[st].count),
            f"{m.name} {e.set} set" + (f" (task {st})" if len(m.task_order) > 1 else ""),
        )
        report.kept[f"benchmark:{e.name}"] += es.tasks[st].count
    seeds = {r["name"]: r["fingerprint"]["seed"] for r in refs.records}
    m_out = Manifest(
        name=name or out.name,
        source=source,
        split_rule=split_rule or "; ".join(rules),
        seed=seed,
        task_order=names,
        tasks=infos,
        eval_sets={s: EvalSet(kinds[s], per) for s, per in evsets.items()},
        benchmarks=benchmarks,
        sources=refs.records,
        source_args={
            "tasks": [
                {
                    "name": t.name,
                    "task": t.task,
                    "part": list(t.part) if t.part else None,
                    "test": t.test,
                }
                for t in tasks
            ],
            "evals": [{"name": e.name, "task": e.task, "set": e.set} for e in evals],
            "source_seeds": seeds,
            **(extra_args or {}),
        },
    )
    save_manifest(m_out, tmp)
    report.notes["task_order"] = names
    report.notes["counts"] = {
        "train": {t: infos[t].train.count for t in names},
        **{s: {t: ss.count for t, ss in per.items()} for s, per in evsets.items()},
        "benchmarks": {b: bm.shards.count for b, bm in benchmarks.items()},
    }
    report.save(tmp)
    m_out.root = tmp
    return m_out


# -- command line ------------------------------------------------------------------------------
@click.command("compose")
@click.option(
    "--task",
    "task_specs",
    multiple=True,
    required=True,
    help="NAME=STREAM[:task=T][:part=I/K][:test=split|full|none], in training order. Repeatable.",
)
@click.option(
    "--eval",
    "eval_specs",
    multiple=True,
    help="NAME=STREAM[:task=T][:set=test]: a benchmark scored after every task. Repeatable.",
)
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Stream folder to write."
)
@click.option("--name", default=None, help="Stream name [folder name].")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the part split.")
@click.option(
    "--shard-size",
    type=POSITIVE_INT,
    default=10000,
    show_default=True,
    help="Samples per copied shard.",
)
@click.option(
    "--processes",
    type=POSITIVE_INT,
    default=1,
    show_default=True,
    help="Processes copying parts (whole shards each; the output does not depend on it).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
def compose_cmd(
    task_specs: tuple[str, ...],
    eval_specs: tuple[str, ...],
    out: str,
    name: str | None,
    seed: int,
    shard_size: int,
    processes: int,
    overwrite: bool,
) -> None:
    """A stream whose tasks come from other streams (whole, or random parts), + benchmarks.

    \b
    Whole tasks reference the source shards (OUT/sources/<stream> is a relative symlink);
    parts are copied. The source streams' stream.json hashes are recorded: a changed
    source is refused when the stream is loaded. Mod-X's COCO -> Flickr30K in 5 parts:
      cvl build-stream compose --out streams/modx \\
          --task coco=streams/coco --task f30k-1=streams/f30k:part=1/5 ... \\
          --task f30k-5=streams/f30k:part=5/5 \\
          --eval coco-5k=streams/coco --eval f30k-1k=streams/f30k
    """
    m = compose(
        [parse_task_spec(s) for s in task_specs],
        [parse_eval_spec(s) for s in eval_specs],
        out,
        name=name,
        seed=seed,
        shard_size=shard_size,
        overwrite=overwrite,
        processes=processes,
    )
    echo_summary(m, out)
    for b, bm in m.benchmarks.items():
        click.echo(f"  benchmark {b}: {bm.shards.count} pairs ({bm.description})")
