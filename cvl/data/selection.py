"""A task's training samples as `Entries`, whether its shards hold them all or it selects rows
of shards it was built on in place (`cvl build-stream shards`).

A task built in place lists its source shards and an integer array file (``rows``): the
positions of its samples among the usable samples of those shards (their index rows, shard
after shard), ascending. Its `Entries` are the packed (shard, row) ids at those positions: 8 B
a training sample in each process (shared with forked loader workers), computed once per
task with one vectorised search; every reader, buffer and epoch order works on them as on any
other `Entries`. A selection is checked against the shards it counts in: their usable samples
must still be `of` (an index rebuilt over a changed tar, a shard replaced, would otherwise
shift every position silently).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from cvl.data.index import Entries, is_remote
from cvl.data.reader import PairDataset
from cvl.errors import CvlError


def read_rows(path: Any) -> np.ndarray:
    """A rows file: a 1-D array of non-negative integers, strictly increasing (memory-mapped
    locally; a stream at a URL fetches it whole)."""
    p = str(path)
    try:
        if is_remote(p):
            from cvl.data.remote import read_bytes

            rows = np.load(io.BytesIO(read_bytes(p)), allow_pickle=False)
        else:
            rows = np.load(p, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise CvlError(f"{p}: not a rows file ({e})") from None
    if rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise CvlError(f"{p}: a rows file holds a 1-D integer array, got {rows.dtype} {rows.shape}")
    if len(rows) and (rows[0] < 0 or not bool(np.all(rows[1:] > rows[:-1]))):
        raise CvlError(f"{p}: rows must be non-negative and strictly increasing")
    return rows


def selected_entries(shards: list[Any], rows_file: Any, of: int, count: int, what: str) -> Entries:
    """The samples at the rows of `rows_file` among the usable samples of `shards` (module
    doc); `of`, `count`: the manifest's numbers, checked."""
    every = Entries.of_shards(shards)
    if len(every) != of:
        raise CvlError(
            f"{what}: its {len(shards)} source shard(s) now hold {len(every)} usable samples, "
            f"not the {of} it was built on (a shard changed or was replaced): build the "
            "stream again"
        )
    rows = read_rows(rows_file)
    if len(rows) != count or (len(rows) and int(rows[-1]) >= of):
        raise CvlError(
            f"{what}: {rows_file} holds {len(rows)} rows up to "
            f"{int(rows[-1]) if len(rows) else '-'}; the manifest says {count} of {of}"
        )
    return Entries.of_ids(every.ids(np.asarray(rows, dtype=np.int64)))


def task_dataset(manifest: Any, task: str, **kw: Any) -> PairDataset:
    """A task's training set as a `PairDataset` (its shards' usable samples, or its selection
    of rows); `kw` as `PairDataset`'s (transform, tokenize)."""
    name = kw.pop("name", f"task {task}")
    sel = manifest.selection(task)
    if sel is None:
        return PairDataset.from_shards(manifest.train_shards(task), name=name, **kw)
    shards, rows, of = sel
    what = f"stream '{manifest.name}', task '{task}'"
    entries = selected_entries(shards, rows, of, manifest.tasks[task].train.count, what)
    return PairDataset(entries, name=name, **kw)
