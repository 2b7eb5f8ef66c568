"""Shards written on every core, with the same bytes whatever the number of processes.

A set of samples (one split of one task) is cut into shards by input position only: shard k
holds the samples of input rows ``k * maxcount .. (k + 1) * maxcount - 1`` that were written
(an image that fails to load leaves its shard one sample short; a range that keeps nothing
leaves no file, so numbers may skip). Keys are made unique over the whole set before any
shard is written (`unique_keys`). So each shard is a job that needs nothing from the others:
`ordered_map` runs the jobs in forked processes, each decoding, resizing *and* writing its
shards (no image bytes cross a pipe), and the parent takes the results back in job order to
count and record the drops. The output depends on the input order and `maxcount` only.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from cvl.streams.manifest import ShardSet
from cvl.streams.writer import unique_key

T = TypeVar("T")

_JOB: Callable[[int], object] | None = None  # the running map's function, inherited by fork


def shard_ranges(n: int, maxcount: int) -> list[range]:
    """Input positions of each shard of a set of `n` samples: fixed by `maxcount` alone."""
    return [range(a, min(a + maxcount, n)) for a in range(0, n, maxcount)]


def unique_keys(ids: Iterable[str]) -> list[str]:
    """The tar key of each id in order, made unique over the whole set (as `ShardSink` does
    within one sink): a set's keys do not depend on how it is cut into jobs."""
    used: set[str] = set()
    return [unique_key(i, used) for i in ids]


def join_sets(sets: Iterable[ShardSet]) -> ShardSet:
    """One set from the shard sets of its jobs, in order."""
    shards: list[str] = []
    count = 0
    for ss in sets:
        shards += ss.shards
        count += ss.count
    return ShardSet(shards, count)


def map_shards(fn: Callable[[int], T], n: int, processes: int) -> Iterator[T]:
    """`ordered_map` for jobs that write shards: webdataset (ShardSink's tar writer, which
    imports torch: seconds) is imported here first, so forked workers inherit it."""
    if processes > 1 and n > 1:
        import webdataset  # noqa: F401

    return ordered_map(fn, n, processes)


def _call(i: int) -> object:
    assert _JOB is not None
    return _JOB(i)


def ordered_map(fn: Callable[[int], T], n: int, processes: int) -> Iterator[T]:
    """fn(0), ..., fn(n - 1) in order, computed in `processes` forked processes when > 1.

    `fn` and everything it reads reach the workers by fork (nothing of it is pickled); only
    each result comes back through a pipe, so results should be small. Where fork is missing
    (not Linux / macOS), or for one process or job, the calls run here."""
    global _JOB
    if processes <= 1 or n <= 1 or "fork" not in mp.get_all_start_methods():
        for i in range(n):
            yield fn(i)
        return
    if _JOB is not None:
        raise RuntimeError("ordered_map: one parallel map at a time")
    _JOB = fn
    try:
        with mp.get_context("fork").Pool(min(processes, n)) as pool:
            yield from pool.imap(_call, range(n), chunksize=1)
    finally:
        _JOB = None


def copy_entries(
    entries: Any,
    root: Any,
    rel: str,
    meta: Callable[[int, dict[str, Any]], dict[str, Any]],
    shard_size: int,
    processes: int = 1,
) -> ShardSet:
    """Copy samples (`cvl.data.index.Entries`, local or at URLs) into ``root/rel/*.tar`` as
    they are (image and caption bytes); each KEY.json is `meta(position, its own KEY.json)`.
    Keys are made unique over the set; `processes` write whole shards (the same bytes)."""
    import json

    from cvl.data.remote import Files
    from cvl.streams.writer import ShardSink

    files = Files()
    keys = unique_keys(entries[i].key for i in range(len(entries)))
    ranges = shard_ranges(len(entries), shard_size)

    def write(k: int) -> ShardSet:
        sink = ShardSink(root, rel, maxcount=shard_size, first=k)
        for pos in ranges[k]:
            e = entries[pos]
            own = json.loads(files.read(e.shard, e.meta).decode("utf-8")) if e.meta else {}
            cap = files.read(e.shard, e.text).decode("utf-8")
            sink.write(keys[pos], files.read(e.shard, e.image), cap, meta(pos, own))
        return sink.close()

    return join_sets(map_shards(write, len(ranges), processes))
