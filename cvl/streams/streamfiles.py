"""What a stream's manifest says about files: every shard it lists, the index summary of a
stream served at a URL (``shards.idx.json``), the files a task reads (a task built in place:
its rows file), source collections' index prefixes, and the checks that every listed file lies
in the stream (or a declared source) and that composed sources are unchanged."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cvl.errors import CvlError
from cvl.io import read_json

MANIFEST = "stream.json"  # a stream folder's manifest (cvl.streams.manifest)
# (functions take a `cvl.streams.manifest.Manifest`; typed `Manifest` below as a name only:
# this module is imported by that one)
Manifest = Any


def shard_names(m: Manifest) -> list[str]:
    """Every shard the manifest lists (train, eval sets, benchmarks), as it lists them."""
    names = [s for t in m.task_order for s in m.tasks[t].train.shards]
    names += [s for es in m.eval_sets.values() for ss in es.tasks.values() for s in ss.shards]
    names += [s for b in m.benchmarks.values() for s in b.shards.shards]
    return list(dict.fromkeys(names))


def _preload_index(m: Manifest) -> None:
    """A served stream's shard summaries from its ``shards.idx.json``: one request at start,
    whatever the number of shards (without it, the shards' own summaries are fetched in
    parallel when first used)."""
    from cvl.data.remote import fetch_whole
    from cvl.data.shardindex import STREAM_SUMMARY, preload

    raw = fetch_whole([f"{m.root}/{STREAM_SUMMARY}"], missing_ok=True)[0]
    if raw is not None:
        preload({n: str(m.resolve(n)) for n in shard_names(m)}, raw)


def write_index_summary(m: Manifest, folder: str | os.PathLike) -> Path | None:
    """Write ``folder/shards.idx.json`` (every shard's index summary, for a copy of the stream
    served at a URL); nothing when a shard has no index yet (`cvl index STREAM` writes it)."""
    from cvl.data.shardindex import write_stream_summary

    root = Path(folder)
    return write_stream_summary(root, {n: str(m.resolve(n)) for n in shard_names(m)})


def task_files(m: Manifest, task: str) -> list[Path | str]:
    """The files a task's training set reads: its shards, and the rows file of a task built
    in place (paths; URLs as str)."""
    sel = m.selection(task)
    if sel is None:
        return list(m.train_shards(task))
    return [*sel[0], sel[1]]


def use_index_prefixes(m: Manifest) -> Manifest:
    """Register the index prefix of each source collection that has one (``sources[].index``,
    `cvl index --index-prefix`), so its shards' index files are found there."""
    from cvl.data.index import use_index_prefix

    for src in m.sources:
        link, index = str(src.get("link") or "").rstrip("/"), src.get("index")
        if link and index:
            use_index_prefix(str(m.resolve(f"{link}/x"))[:-2], str(index))
    return m


def _source_roots(root: Path, sources: list[dict[str, Any]], seen: set[Path]) -> list[Path]:
    """The folders of the source streams declared by `sources[].link` (relative, inside
    `root`), and recursively of their own sources: a stream composed of composed streams."""
    out = []
    for s in sources:
        link = str(s.get("link") or "")
        if not link or Path(link).is_absolute() or ".." in Path(link).parts:
            continue
        r = (root / link).resolve()
        if r in seen:
            continue
        seen.add(r)
        out.append(r)
        try:
            nested = read_json(r / MANIFEST).get("sources") or []
        except (CvlError, AttributeError):
            nested = []
        if isinstance(nested, list):
            out += _source_roots(r, [n for n in nested if isinstance(n, dict)], seen)
    return out


def check_inside(m: Manifest) -> None:
    """Every shard's real path (symlinks resolved) lies in the stream folder, or in a source
    stream reached through a declared `sources[].link` (composed streams, also nested)."""
    root = m.root.resolve() if m.root is not None else None
    if root is None:
        return
    allowed = [root, *_source_roots(root, m.sources, {root})]
    sets = [("task", t, [s for s in task_files(m, t) if isinstance(s, Path)]) for t in m.task_order]
    sets += [
        (f"eval set '{n}'", t, m.eval_shards(n, t)) for n, e in m.eval_sets.items() for t in e.tasks
    ]
    sets += [("benchmark", b, m.benchmark_shards(b)) for b in m.benchmarks]
    for kind, name, shards in sets:
        for sh in shards:
            real = sh.resolve()
            if not any(real.is_relative_to(a) for a in allowed):
                raise CvlError(
                    f"stream '{m.name}': {kind} '{name}': shard {sh} resolves to {real}, "
                    "outside the stream folder (only sources/ links may point elsewhere)"
                )


def file_sha256(path: Path | str) -> str:
    """SHA-256 of a file (a source stream's stream.json), local or at a URL."""
    import hashlib

    from cvl.data.index import is_remote

    if is_remote(str(path)):
        from cvl.data.remote import read_bytes

        return hashlib.sha256(read_bytes(str(path))).hexdigest()
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def manifest_file(m: Manifest) -> Path | str | None:
    """The stream.json a manifest was read from (a URL for a served stream), if any."""
    if m.root is None:
        return None
    if isinstance(m.root, str):
        return f"{m.root}/{MANIFEST}"
    f = m.root / MANIFEST
    return f if f.is_file() else None


def check_sources(m: Manifest) -> None:
    """A composed stream's sources must be the streams it was composed from (same stream.json)."""
    for s in m.sources:
        link = s.get("link") or s.get("path")
        want = s.get("stream_sha256")
        if not link or not want:
            continue
        mp = m.resolve(str(link)) / MANIFEST
        if not mp.is_file():
            raise CvlError(
                f"stream '{m.name}': source stream '{s.get('name')}' is gone ({mp.parent})"
            )
        if file_sha256(mp) != want:
            raise CvlError(
                f"stream '{m.name}': source stream '{s.get('name')}' ({mp.parent}) changed since "
                "it was composed: compose the stream again"
            )
