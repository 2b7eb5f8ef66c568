"""The stream manifest (`stream.json`): one versioned format for every source.

A stream is a folder::

    stream.json                      this manifest
    train/<task>/000000.tar ...      webdataset shards: KEY.jpg, KEY.txt, KEY.json
    eval/<set>/<task>/000000.tar ... per-task evaluation sets (test, val, query, gallery)
    build_report.json                what the builder read, kept and dropped, and why

Schema ``cvl.stream/1`` (shard paths are relative to the stream folder, without ``..``; a
shard whose real path leaves the folder is refused unless it goes through a declared source
link ``sources[].link``, the symlinks a composed stream keeps in ``sources/``)::

    {
      "schema": "cvl.stream/1",
      "name": "synth", "source": "synthetic", "source_args": {...},
      "split_rule": "human-readable rule that made the tasks",
      "seed": 0, "created": "ISO time", "cvl_version": "0.1.0",
      "task_order": ["t0", "t1", ...],          # training order (a permutation of the tasks)
      "tasks": {"t0": {"train": {"shards": [...], "count": 300},
                       "description": "...", "categories": ["circle", ...]}, ...},
      "eval_sets": {"test": {"kind": "pairs",
                             "tasks": {"t0": {"shards": [...], "count": 60}, ...}},
                    "query": {"kind": "query", "tasks": {...}},
                    "gallery": {"kind": "gallery", "tasks": {...}}},
      "benchmarks": {"coco-5k": {"kind": "pairs", "shards": [...], "count": 5000,
                                 "description": "..."}},      # optional
      "sources": [{"name": "coco", "link": "sources/coco", "stream_sha256": "..."}], # optional
      "class_map": {...},                        # optional: class-incremental streams only
      "time": {...}                              # optional: time-ordered streams only
    }

``benchmarks`` are evaluation sets that belong to no task (DKR Setting-2 trains on EC parts
and tests on Flickr30K, COCO and EC): `cvl eval` scores every checkpoint on each of them.
``sources`` (composed streams, `cvl build-stream compose`) name the streams whose shards are
referenced and the SHA-256 of their stream.json at composition time: loading the stream
refuses a source that changed since.

``class_map`` (optional, written by `cvl build-stream class-split`; streams without it read as
before) maps class ids to tasks: ``names[i]`` is the category string of class i in the
samples' KEY.json, ``prompts[i]`` the name put in zero-shot prompts, ``task_of[i]`` the task
holding class i (null: in no task), ``order`` the seeded class order that was cut into tasks,
``labels`` where the labels came from; ``same_prompt`` (classification streams) maps a class
whose all-classes prompts are those of an earlier class to that class (one class of ZS-all).

``time`` (optional, written by time-ordered builds: `cvl build-stream table --time-col`, the
synthetic time mode; see `cvl.streams.timesplit`) records the periods in time order (``periods``),
the periods each task trained on (``tasks``: task -> periods) and, per period, the benchmark
holding its dynamic retrieval set (``eval``: period -> benchmark name), plus ``unit`` and the
date ``column``. `cvl eval` derives TiC-CLIP's in-distribution / backward / forward transfer
from it.

A task built in place (`cvl build-stream shards`: a webdataset collection cvl did not write)
adds ``rows`` and ``of`` to its ``train`` set: ``rows`` names an integer array file beside
stream.json holding the positions of the task's samples among the usable samples of its
``shards`` (counted shard after shard, in each shard's index order), ``of`` how many those
shards held at build time (`cvl.data.selection` reads and checks them). Its shards are
entries under a ``sources`` record ``{"name": "shards", "link": "sources/shards", "path" |
"url": ROOT, "index": PREFIX}``: the link points at a local collection, or its entries are
read at ``url`` (`Manifest.resolve`); ``index`` is where the shards' index files lie when not
beside them. Such a manifest's schema is ``cvl.stream/1.1`` (an older cvl refuses it rather
than read every sample of the shards); `train_shards` refuses such a task (tools that read
whole shards), `selection` gives it.

Every sample's KEY.json holds at least ``id``, ``task`` and ``category`` (may be null) and
optionally ``captions`` (all captions of the image; KEY.txt is the first one).
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cvl import __version__
from cvl.errors import CvlError
from cvl.io import read_json, write_json
from cvl.streams.streamfiles import (
    MANIFEST,
    _preload_index,
    check_inside,
    check_sources,
    task_files,
    use_index_prefixes,
    write_index_summary,
)

SCHEMA = "cvl.stream/1"
# a stream with tasks built in place (`rows`): an older cvl, which would read every sample of
# the source shards, refuses the schema instead; this one reads both
SCHEMA_ROWS = "cvl.stream/1.1"
BUILD_REPORT = "build_report.json"
EVAL_KINDS = ("pairs", "query", "gallery")


@dataclass
class ShardSet:
    """A list of shard files and how many samples they hold; with `rows`, the samples are a
    selection of the shards' (a stream built in place: `rows` names the integer array file,
    `of` the usable samples of the shards it counts in)."""

    shards: list[str]
    count: int
    rows: str | None = None
    of: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"shards": list(self.shards), "count": int(self.count)}
        if self.rows is not None:
            d.update(rows=self.rows, of=int(self.of or 0))
        return d


@dataclass
class TaskInfo:
    """One task of the stream: its training shards and descriptive metadata."""

    name: str
    train: ShardSet
    description: str = ""
    categories: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"train": self.train.to_json(), "description": self.description}
        if self.categories is not None:
            d["categories"] = list(self.categories)
        d.update(self.extra)
        return d


@dataclass
class EvalSet:
    """An evaluation set split by task: kind is pairs (test/val), query or gallery."""

    kind: str
    tasks: dict[str, ShardSet]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "tasks": {t: s.to_json() for t, s in self.tasks.items()}}


@dataclass
class Benchmark:
    """An evaluation set outside the tasks (scored after every task, in no R matrix)."""

    kind: str
    shards: ShardSet
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.shards.to_json(), "description": self.description}


@dataclass
class Manifest:
    """In-memory form of `stream.json`; `root` is the folder the relative paths start from."""

    name: str
    source: str
    split_rule: str
    seed: int
    task_order: list[str]
    tasks: dict[str, TaskInfo]
    eval_sets: dict[str, EvalSet] = field(default_factory=dict)
    source_args: dict[str, Any] = field(default_factory=dict)
    benchmarks: dict[str, Benchmark] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)
    created: str = ""
    cvl_version: str = __version__
    root: Path | str | None = None  # a folder, or the URL of a served stream (str)
    class_map: dict[str, Any] | None = None
    time: dict[str, Any] | None = None

    # -- classes (class-incremental streams) ---------------------------------------------------
    def split_classes(self, tasks: list[str] | None = None) -> list[str]:
        """Category names of the class map's classes held by `tasks` (all tasks: None), by id."""
        cm = self.class_map
        if not cm:
            return []
        want = set(self.task_order if tasks is None else tasks)
        return [n for n, t in zip(cm["names"], cm["task_of"]) if t in want]

    def prompt_names(self, categories: list[str]) -> list[str]:
        """The names zero-shot prompts use for categories (the category itself by default)."""
        cm = self.class_map
        if not cm:
            return list(categories)
        of = dict(zip(cm["names"], cm.get("prompts") or cm["names"]))
        return [of.get(c, c) for c in categories]

    # -- paths -----------------------------------------------------------------------------
    def resolve(self, shard: str) -> Path:
        """Absolute path of a shard entry (relative entries start at the stream folder); the
        URL of the shard (a str) in a stream served at a URL, or in a collection at a URL
        (a source with a ``url``: its link's entries lie there)."""
        for src in self.sources:
            link, url = str(src.get("link") or "").rstrip("/"), src.get("url")
            if url and link and shard.startswith(link + "/"):
                return f"{str(url).rstrip('/')}{shard[len(link) :]}"  # type: ignore[return-value]
        if isinstance(self.root, str):
            return f"{self.root.rstrip('/')}/{shard}"  # type: ignore[return-value]
        p = Path(shard)
        if p.is_absolute() or self.root is None:
            return p
        return self.root / p

    def train_shards(self, task: str) -> list[Path]:
        """The shards of a task's training set (all of their samples: refused for a task that
        selects rows of its shards, whose samples `cvl.data.selection` reads)."""
        t = self._task(task)
        if t.train.rows is not None:
            raise CvlError(
                f"stream '{self.name}': task '{task}' is a selection of rows of shards built in "
                "place (`cvl build-stream shards`); this tool reads whole shards: build the "
                "stream with --copy for it"
            )
        return [self.resolve(s) for s in t.train.shards]

    def selection(self, task: str) -> tuple[list[Path], Path | str, int] | None:
        """(shards, rows file, samples of the shards) of a task built in place, else None."""
        tr = self._task(task).train
        if tr.rows is None:
            return None
        return [self.resolve(s) for s in tr.shards], self.resolve(tr.rows), int(tr.of or 0)

    def eval_shards(self, set_name: str, task: str) -> list[Path]:
        es = self.eval_sets.get(set_name)
        if es is None:
            raise CvlError(
                f"stream '{self.name}' has no eval set '{set_name}' "
                f"(it has: {', '.join(self.eval_sets) or 'none'})"
            )
        if task not in es.tasks:
            raise CvlError(f"stream '{self.name}': eval set '{set_name}' has no task '{task}'")
        return [self.resolve(s) for s in es.tasks[task].shards]

    def benchmark_shards(self, name: str) -> list[Path]:
        if name not in self.benchmarks:
            raise CvlError(
                f"stream '{self.name}' has no benchmark '{name}' "
                f"(it has: {', '.join(self.benchmarks) or 'none'})"
            )
        return [self.resolve(s) for s in self.benchmarks[name].shards.shards]

    def _task(self, task: str) -> TaskInfo:
        if task not in self.tasks:
            raise CvlError(f"stream '{self.name}' has no task '{task}' (tasks: {self.task_order})")
        return self.tasks[task]

    # -- (de)serialisation -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = {
            "schema": SCHEMA_ROWS if any(t.train.rows for t in self.tasks.values()) else SCHEMA,
            "name": self.name,
            "source": self.source,
            "source_args": self.source_args,
            "split_rule": self.split_rule,
            "seed": self.seed,
            "created": self.created
            or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "cvl_version": self.cvl_version,
            "task_order": list(self.task_order),
            "tasks": {n: self.tasks[n].to_json() for n in self.tasks},
            "eval_sets": {n: e.to_json() for n, e in self.eval_sets.items()},
            **({"class_map": dict(self.class_map)} if self.class_map else {}),
        }
        if self.benchmarks:  # optional fields: absent unless used (older streams unchanged)
            d["benchmarks"] = {n: b.to_json() for n, b in self.benchmarks.items()}
        if self.sources:
            d["sources"] = [dict(s) for s in self.sources]
        if self.time:
            d["time"] = dict(self.time)
        return d

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What identifies the stream's content for a run's config check."""
        return {
            "name": self.name,
            "source": self.source,
            "seed": self.seed,
            "task_order": list(self.task_order),
            "counts": {t: self.tasks[t].train.count for t in self.task_order},
        }


def _err(where: str, msg: str) -> CvlError:
    return CvlError(f"stream.json: {where}: {msg}")


def _req(d: dict, key: str, typ: type | tuple, where: str) -> Any:
    if key not in d:
        raise _err(where, f"missing field '{key}'")
    v = d[key]
    if typ is int and isinstance(v, bool):
        raise _err(f"{where}.{key}", "must be an integer")
    if not isinstance(v, typ):
        tname = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise _err(f"{where}.{key}", f"must be {tname}, got {type(v).__name__}")
    return v


def _check_name(name: str, where: str) -> None:
    """Task, eval-set and benchmark names become file names in run folders (tasks/NN-name,
    logs/NN-name.jsonl, eval/cache/...): one plain path component, never '..' or hidden."""
    bad = not name or name.startswith(".") or any(c in name for c in "/\\\x00")
    if bad or any(ord(c) < 32 for c in name):
        raise _err(where, f"name {name!r} cannot be a file name (no '/', '\\', NUL, leading '.')")


def _shardset(d: Any, where: str, allow_empty: bool = False, rows: bool = False) -> ShardSet:
    if not isinstance(d, dict):
        raise _err(where, "must be an object with 'shards' and 'count'")
    shards = _req(d, "shards", list, where)
    count = _req(d, "count", int, where)
    if count < 0 or (count == 0 and not allow_empty):
        raise _err(f"{where}.count", f"must be a positive integer, got {count}")
    sel, of = d.get("rows"), None
    if sel is not None:
        if not rows:
            raise _err(f"{where}.rows", "only a task's train set may select rows")
        if not isinstance(sel, str) or not sel.endswith(".npy") or _escapes(sel):
            raise _err(f"{where}.rows", f"must be a relative .npy path in the stream, got {sel!r}")
        of = _req(d, "of", int, where)
        if of < count:
            raise _err(f"{where}.of", f"the shards hold {of} samples, fewer than count {count}")
    for i, s in enumerate(shards):
        if not isinstance(s, str) or not s:
            raise _err(f"{where}.shards[{i}]", "must be a non-empty path string")
        if _escapes(s):
            raise _err(
                f"{where}.shards[{i}]",
                f"path {s!r} escapes the stream folder (shard paths are relative, no '..')",
            )
    if count > 0 and not shards:
        raise _err(f"{where}.shards", "is empty but count > 0")
    return ShardSet(shards=list(shards), count=count, rows=sel, of=of)


def _escapes(path: str) -> bool:
    return ".." in Path(path).parts or Path(path).is_absolute() or "\x00" in path


def manifest_from_json(d: Any, root: Path | None = None) -> Manifest:
    """Validate a parsed `stream.json` and build a Manifest; errors name the exact field."""
    if not isinstance(d, dict):
        raise _err("top level", "must be a JSON object")
    schema = _req(d, "schema", str, "top level")
    if schema not in (SCHEMA, SCHEMA_ROWS):
        raise _err(
            "schema", f"unsupported schema '{schema}' (this cvl reads '{SCHEMA}', '{SCHEMA_ROWS}')"
        )
    name = _req(d, "name", str, "top level")
    source = _req(d, "source", str, "top level")
    split_rule = d.get("split_rule", "")
    seed = _req(d, "seed", int, "top level")
    order = _req(d, "task_order", list, "top level")
    tasks_d = _req(d, "tasks", dict, "top level")
    if not tasks_d:
        raise _err("tasks", "a stream needs at least one task")
    tasks: dict[str, TaskInfo] = {}
    for tname, td in tasks_d.items():
        where = f"tasks['{tname}']"
        _check_name(tname, where)
        if not isinstance(td, dict):
            raise _err(where, "must be an object")
        extra = {k: v for k, v in td.items() if k not in ("train", "description", "categories")}
        cats = td.get("categories")
        if cats is not None and not isinstance(cats, list):
            raise _err(f"{where}.categories", "must be a list")
        tasks[tname] = TaskInfo(
            name=tname,
            train=_shardset(td.get("train"), f"{where}.train", rows=True),
            description=str(td.get("description", "")),
            categories=cats,
            extra=extra,
        )
    for i, t in enumerate(order):
        if t not in tasks:
            raise _err(f"task_order[{i}]", f"unknown task '{t}' (tasks: {sorted(tasks)})")
    if len(set(order)) != len(order):
        raise _err("task_order", "lists a task twice")
    if not order:
        raise _err("task_order", "is empty")
    eval_sets: dict[str, EvalSet] = {}
    for sname, sd in (d.get("eval_sets") or {}).items():
        where = f"eval_sets['{sname}']"
        _check_name(sname, where)
        if not isinstance(sd, dict):
            raise _err(where, "must be an object")
        kind = _req(sd, "kind", str, where)
        if kind not in EVAL_KINDS:
            raise _err(f"{where}.kind", f"must be one of {EVAL_KINDS}, got '{kind}'")
        per_task = _req(sd, "tasks", dict, where)
        sets = {}
        for tname, ss in per_task.items():
            if tname not in tasks:
                raise _err(f"{where}.tasks", f"unknown task '{tname}'")
            sets[tname] = _shardset(ss, f"{where}.tasks['{tname}']", allow_empty=True)
        eval_sets[sname] = EvalSet(kind=kind, tasks=sets)
    benchmarks: dict[str, Benchmark] = {}
    bd = d.get("benchmarks") or {}
    if not isinstance(bd, dict):
        raise _err("benchmarks", "must be an object")
    for bname, b in bd.items():
        where = f"benchmarks['{bname}']"
        _check_name(bname, where)
        if not isinstance(b, dict):
            raise _err(where, "must be an object")
        kind = _req(b, "kind", str, where)
        if kind != "pairs":
            raise _err(f"{where}.kind", f"must be 'pairs', got '{kind}'")
        benchmarks[bname] = Benchmark(
            kind=kind, shards=_shardset(b, where), description=str(b.get("description", ""))
        )
    sources = d.get("sources") or []
    if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
        raise _err("sources", "must be a list of objects")
    class_map = _class_map(d.get("class_map"), tasks)
    time = _time(d.get("time"), tasks, benchmarks)
    return Manifest(
        name=name,
        source=source,
        split_rule=str(split_rule),
        seed=seed,
        task_order=list(order),
        tasks=tasks,
        eval_sets=eval_sets,
        source_args=dict(d.get("source_args") or {}),
        benchmarks=benchmarks,
        sources=[dict(s) for s in sources],
        created=str(d.get("created", "")),
        cvl_version=str(d.get("cvl_version", "")),
        root=root,
        class_map=class_map,
        time=time,
    )


def _class_map(cm: Any, tasks: dict[str, TaskInfo]) -> dict[str, Any] | None:
    """Validate the optional class map (class id -> category, prompt name, task)."""
    if cm is None:
        return None
    if not isinstance(cm, dict):
        raise _err("class_map", "must be an object")
    names = _req(cm, "names", list, "class_map")
    task_of = _req(cm, "task_of", list, "class_map")
    prompts = cm.get("prompts", names)
    if not isinstance(prompts, list):
        raise _err("class_map.prompts", "must be a list")
    if not (len(names) == len(task_of) == len(prompts)):
        raise _err("class_map", "names, prompts and task_of must have one entry per class")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise _err("class_map.names", "must be distinct non-empty strings")
    for i, t in enumerate(task_of):
        if t is not None and t not in tasks:
            raise _err(f"class_map.task_of[{i}]", f"unknown task '{t}'")
    same, known = cm.get("same_prompt", {}), set(names)
    if not isinstance(same, dict) or not all(
        k in known and v in known and k != v for k, v in same.items()
    ):
        raise _err("class_map.same_prompt", "must map class names to other class names")
    order = cm.get("order")
    if order is not None and sorted(order) != list(range(len(names))):
        raise _err("class_map.order", "must be a permutation of the class ids")
    return dict(cm)


def _time(t: Any, tasks: dict[str, TaskInfo], benchmarks: dict[str, Any]) -> dict[str, Any] | None:
    """Validate the optional time layout (periods, the periods of each task, eval benchmarks)."""
    if t is None:
        return None
    if not isinstance(t, dict):
        raise _err("time", "must be an object")
    periods = _req(t, "periods", list, "time")
    if not all(isinstance(p, str) and p for p in periods) or len(set(periods)) != len(periods):
        raise _err("time.periods", "must be distinct non-empty strings")
    for task, ps in _req(t, "tasks", dict, "time").items():
        if task not in tasks:
            raise _err("time.tasks", f"unknown task '{task}'")
        if not isinstance(ps, list) or not ps or any(p not in periods for p in ps):
            raise _err(f"time.tasks['{task}']", "must be a non-empty list of time.periods")
    ev = t.get("eval") or {}
    if not isinstance(ev, dict):
        raise _err("time.eval", "must be an object (period -> benchmark)")
    for p, b in ev.items():
        if p not in periods:
            raise _err("time.eval", f"unknown period '{p}'")
        if b not in benchmarks:
            raise _err(f"time.eval['{p}']", f"unknown benchmark '{b}'")
    return dict(t)


def load_manifest(stream: str | os.PathLike, check_files: bool = True) -> Manifest:
    """Load and validate `STREAM/stream.json` (or a path to the file itself).

    With `check_files`, every listed shard must exist: a clear error names the first missing one.
    A stream served at a URL (`http(s)://HOST/PATH`, `s3://...`: any fsspec URL; its shards
    are read by byte range) is read as it is: its shards are not listed up front.
    """
    from cvl.data.index import is_remote

    if is_remote(str(stream)):
        import json

        from cvl.data.remote import read_bytes

        url = str(stream).rstrip("/")
        url = url[: -len(MANIFEST) - 1] if url.endswith("/" + MANIFEST) else url
        try:
            d = json.loads(read_bytes(f"{url}/{MANIFEST}"))
        except ValueError as e:
            raise CvlError(f"{url}/{MANIFEST}: not a stream manifest ({e})") from None
        m = use_index_prefixes(manifest_from_json(d, root=url))
        _preload_index(m)
        return m
    p = Path(stream)
    if p.is_dir():
        mpath = p / MANIFEST
    elif p.name.endswith(".json"):
        mpath = p
    else:
        raise CvlError(f"{p}: not a stream folder (no such directory)")
    if not mpath.is_file():
        raise CvlError(
            f"{p}: not a stream folder (no {MANIFEST}); build one with `cvl build-stream`"
        )
    m = use_index_prefixes(manifest_from_json(read_json(mpath), root=mpath.parent.absolute()))
    if check_files:
        for t in m.task_order:
            for s in task_files(m, t):
                if not is_remote(str(s)) and not Path(s).is_file():
                    raise CvlError(f"stream '{m.name}': task '{t}': missing shard {s}")
        for sname, es in m.eval_sets.items():
            for t in es.tasks:
                for s in m.eval_shards(sname, t):
                    if not s.is_file():
                        raise CvlError(
                            f"stream '{m.name}': eval set '{sname}', task '{t}': missing shard {s}"
                        )
        for bname in m.benchmarks:
            for s in m.benchmark_shards(bname):
                if not s.is_file():
                    raise CvlError(f"stream '{m.name}': benchmark '{bname}': missing shard {s}")
        check_sources(m)
        check_inside(m)
    return m


def save_manifest(m: Manifest, folder: str | os.PathLike) -> Path:
    """Validate and write `folder/stream.json` (validation runs on the JSON that is written)."""
    d = m.to_json()
    manifest_from_json(d)  # refuse to write something we could not read back
    path = Path(folder) / MANIFEST
    write_json(path, d)
    write_index_summary(manifest_from_json(d, root=Path(folder).absolute()), folder)
    return path


def with_task_order(m: Manifest, order: list[str]) -> Manifest:
    """A copy of `m` trained in another order (no data is touched)."""
    d = m.to_json()
    d["task_order"] = list(order)
    return manifest_from_json(d, root=m.root)
