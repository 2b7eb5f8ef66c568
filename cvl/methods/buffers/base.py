"""The replay buffers' base class and registry: what every buffer module builds on.

Kept apart from the package's `__init__` so that the buffer modules (ring, reservoir, ...) can
import their base without importing the package that imports them (no import cycle).

Items are integers: per task, the positions (int64, stored order) of the kept samples in the
task's training `Entries` (the trainer's `entries_of(task)`: every usable sample of the task's
shards in manifest order, the same in every run and resume), or `Whole(n)` for all n of them
(`cumulative-all`: no array). Membership of a batch's samples (`in_buffer`, `payload_rows`)
is a binary search of their packed ids (`batch["sid"]`) in a sorted array of the items' ids,
built once per buffer content. Payloads are keyed by (task, position).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cvl.data.index import Entries, ids_of_refs
from cvl.device import to_device
from cvl.errors import CvlError

BUFFERS: dict[str, type] = {}

#: an item: (task, position in the task's training entries)
Key = tuple[str, int]


def register_buffer(name: str):
    def deco(cls: type) -> type:
        cls.name = name
        BUFFERS[name] = cls
        return cls

    return deco


def quotas_by_size(sizes: dict[str, int], capacity: int) -> dict[str, int]:
    """Per-task quota ∝ task size: round(n_t / Σn · N), trimmed so the total is ≤ N."""
    total = sum(sizes.values())
    q = {t: int(round(n / total * capacity)) for t, n in sizes.items()}
    while sum(q.values()) > capacity:  # rounding overshoot: trim the largest quota
        t = max(q, key=lambda k: q[k])
        q[t] -= 1
    return q


@dataclass(frozen=True)
class Whole:
    """All n samples of a task, in order (Cumulative-All): positions 0..n-1, no array."""

    n: int

    def __len__(self) -> int:
        return self.n


def positions(held: np.ndarray | Whole) -> np.ndarray:
    """A task's item positions as an array (`Whole` materialised)."""
    return np.arange(held.n, dtype=np.int64) if isinstance(held, Whole) else held


class Buffer:
    """Base class: per task, the positions of its kept samples (module doc)."""

    name = "base"

    def __init__(
        self,
        size: int,
        seed: int = 0,
        stream_root: str | os.PathLike | None = None,
        entries_of: Callable[[str], Entries] | None = None,
    ) -> None:
        if size <= 0:
            raise CvlError(f"--buffer-size must be positive, got {size}")
        self.size = size
        self.seed = seed
        self.root = str(stream_root) if stream_root else None  # old states' relative shards
        self.resolve = entries_of  # task -> its training entries (set by the trainer)
        self.items: dict[str, np.ndarray | Whole] = {}
        self.sizes: dict[str, int] = {}  # training-set size of each task seen
        self.payload: dict[Key, dict[str, torch.Tensor]] = {}
        self._given: dict[str, Entries] = {}  # the entries `update` was given, per task
        self._members: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    # -- items as samples --------------------------------------------------------------------
    def entries_of(self, task: str) -> Entries:
        """Task `task`'s training entries (those its positions index)."""
        if task in self._given:
            return self._given[task]
        if self.resolve is None:
            raise CvlError(f"replay buffer: no training entries known for task '{task}'")
        e = self.resolve(task)
        if task in self.sizes and len(e) != self.sizes[task]:
            raise CvlError(
                f"replay buffer: task '{task}' has {len(e)} training samples, the buffer was "
                f"built on {self.sizes[task]} (stream changed?)"
            )
        return e

    def entries(self) -> Entries:
        """The buffer's items as reader entries (all tasks, in task then stored order)."""
        return Entries.concat(
            self.entries_of(t) if isinstance(h, Whole) else self.entries_of(t).take(h)
            for t, h in self.items.items()
        )

    def entries_at(self, keys: Sequence[Key]) -> Entries:
        """The samples of items `keys`, in that order."""
        tasks = np.array([t for t, _ in keys], dtype=object)
        pos = np.array([p for _, p in keys], dtype=np.int64)
        ids = np.empty(len(keys), dtype=np.int64)
        for t in dict.fromkeys(tasks.tolist()):
            sel = tasks == t
            ids[sel] = self.entries_of(t).ids(pos[sel])
        return Entries.of_ids(ids)

    def __len__(self) -> int:
        return sum(len(v) for v in self.items.values())

    def rng(self, task_index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, 991, task_index])

    # -- membership --------------------------------------------------------------------------
    def _index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sorted packed ids of the items, their item numbers in `entries()` order, the
        tasks' first item numbers); built once per buffer content (16 B an item)."""
        if self._members is None:
            ids = [
                self.entries_of(t).ids(positions(h)) if len(h) else np.zeros(0, np.int64)
                for t, h in self.items.items()
            ]
            flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
            order = np.argsort(flat, kind="stable")
            starts = np.cumsum([0] + [len(h) for h in self.items.values()])
            self._members = (flat[order], order, starts)
        return self._members

    def item_numbers(self, sids: Any) -> np.ndarray:
        """Per packed sample id: its item number in `entries()` order, -1 if not an item."""
        ids, order, _ = self._index()
        q = np.asarray(sids, dtype=np.int64).reshape(-1)
        if not len(ids):
            return np.full(len(q), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(ids, q), len(ids) - 1)
        return np.where(ids[at] == q, order[at], -1)

    def _key(self, i: int) -> Key:
        """(task, position) of item number i."""
        starts = self._index()[2]
        k = int(np.searchsorted(starts, i, side="right")) - 1
        t = list(self.items)[k]
        h = self.items[t]
        j = i - int(starts[k])
        return t, j if isinstance(h, Whole) else int(h[j])

    def in_buffer(self, batch: dict[str, Any], device: Any = None) -> torch.Tensor:
        """Bool per batch row: the sample is one of the buffer's items (a replayed pair)."""
        mask = torch.from_numpy(self.item_numbers(batch["sid"]) >= 0)
        return mask if device is None else to_device(mask, device)  # no host sync

    # -- selection ---------------------------------------------------------------------------
    def update(self, task: str, entries: Entries, ctx: Any) -> None:
        """Add task `task` (its training entries) after it finished; called on every rank."""
        from accelerate.utils import broadcast_object_list

        self._given[task] = entries
        self.sizes[task] = len(entries)
        # Features are a collective computation (every rank embeds its part): all ranks join.
        feats = (
            ctx.services.pair_features(entries).numpy().astype("float64")
            if self.needs_features
            else None
        )
        new = self.select(task, entries, feats) if _rank(ctx) == 0 or not self.rank0_only else None
        if self.rank0_only and _world(ctx) > 1:
            box = [new]
            broadcast_object_list(box, from_process=0)
            new = box[0]
        self.items = new
        self._members = None
        keys = list(self.payload)
        self.payload = {k: self.payload[k] for k, kept in zip(keys, self._held(keys)) if kept}

    def _held(self, keys: Sequence[Key]) -> np.ndarray:
        """Bool per (task, position): it is one of the buffer's items."""
        tasks = np.array([t for t, _ in keys], dtype=object)
        pos = np.array([p for _, p in keys], dtype=np.int64)
        out = np.zeros(len(keys), dtype=bool)
        for t, h in self.items.items():
            sel = tasks == t
            out[sel] = pos[sel] < h.n if isinstance(h, Whole) else np.isin(pos[sel], h)
        return out

    #: selection needs features (k-means, herding): compute once on rank 0 and broadcast.
    rank0_only = True
    needs_features = False
    #: keeps every item (TiC's Cumulative-All): takes no --buffer-size
    unbounded = False

    def select(
        self, task: str, entries: Entries, feats: np.ndarray | None
    ) -> dict[str, np.ndarray | Whole]:
        """The buffer after task `task`: per task, positions in its training entries."""
        raise NotImplementedError

    # -- per-item payload --------------------------------------------------------------------
    def keys_without(self, name: str) -> list[Key]:
        """Items (in `entries()` order) that carry no payload `name` yet."""
        out: list[Key] = []
        for t, h in self.items.items():
            have = [p for (u, p), v in self.payload.items() if u == t and name in v]
            p = positions(h)
            out += [(t, int(q)) for q in p[~np.isin(p, np.array(have, dtype=np.int64))]]
        return out

    def set_payload(self, keys: Sequence[Key], **tensors: torch.Tensor) -> None:
        """Attach row i of each tensor to item keys[i] (kept on CPU)."""
        for name, t in tensors.items():
            if t.shape[0] != len(keys):
                raise ValueError(f"payload '{name}': {t.shape[0]} rows for {len(keys)} items")
        for i, (task, p) in enumerate(keys):
            d = self.payload.setdefault((str(task), int(p)), {})
            for name, t in tensors.items():
                d[name] = t[i].detach().cpu().clone()

    def payload_rows(
        self, batch: dict[str, Any], name: str, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask, rows): which batch rows are buffer items carrying payload `name`, and that
        payload stacked (zeros elsewhere), on `like`'s device and dtype."""
        rows = [
            self.payload.get(self._key(int(i)), {}).get(name) if i >= 0 else None
            for i in self.item_numbers(batch["sid"])
        ]
        shape = next((r.shape for r in rows if r is not None), like.shape[1:])
        stacked = torch.stack([r if r is not None else torch.zeros(shape) for r in rows])
        mask = torch.tensor([r is not None for r in rows], dtype=torch.bool)
        return to_device(mask, like.device), to_device(stacked, like.device).to(like.dtype)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Items as int64 tensors (safetensors; `{"all": n}` for a whole task), the rest JSON."""
        return {
            "name": self.name,
            "size": self.size,
            "items": {
                t: {"all": h.n} if isinstance(h, Whole) else torch.from_numpy(np.array(h))
                for t, h in self.items.items()
            },
            "sizes": dict(self.sizes),
            **self._payload_state(),
            **self.extra_state(),
        }

    def _payload_state(self) -> dict[str, Any]:
        """Per payload name: the items' task numbers (in `tasks`) and positions, and the rows
        stacked (safetensors)."""
        if not self.payload:
            return {}
        keys = sorted(self.payload)
        tasks = list(dict.fromkeys(t for t, _ in keys))
        names = sorted({n for v in self.payload.values() for n in v})
        out: dict[str, Any] = {"payload": {}}
        for n in names:
            have = [k for k in keys if n in self.payload[k]]
            out["payload"][n] = {
                "tasks": tasks,
                "task": torch.tensor([tasks.index(t) for t, _ in have], dtype=torch.int64),
                "pos": torch.tensor([p for _, p in have], dtype=torch.int64),
                "rows": torch.stack([self.payload[k][n] for k in have]),
            }
        return out

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, d: dict[str, Any], refs: dict[tuple[str, str], Key]) -> None:
        """A subclass's part of `load_state_dict`; `refs` maps an earlier cvl's (shard, key)
        to (task, position) (empty for a current state)."""

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Load a state of `state_dict`, or of an earlier cvl (items as [shard, key] lists:
        converted to positions in the tasks' training entries)."""
        self.sizes = dict(d.get("sizes", {}))
        self._members = None
        self.payload = {}
        items = d["items"]
        old = any(isinstance(v, list) for v in items.values())
        where = self._positions_of_refs(items) if old else {}
        if old:
            self.items = {t: _int64([where[tuple(r)][1] for r in rs]) for t, rs in items.items()}
        else:
            self.items = {
                t: Whole(int(v["all"])) if isinstance(v, dict) else _int64(v)
                for t, v in items.items()
            }
        for n, p in (d.get("payload") or {}).items():
            if "refs" in p:  # an earlier cvl's payload: keyed by (shard, key)
                keys = [where[tuple(r)] for r in p["refs"]]
            else:
                keys = [(p["tasks"][int(i)], int(q)) for i, q in zip(p["task"], p["pos"])]
            self.set_payload(keys, **{n: p["rows"]})
        self.load_extra_state(d, where)

    def _positions_of_refs(self, items: dict[str, list]) -> dict[tuple[str, str], Key]:
        """(shard, key) -> (task, position) of an earlier cvl's items (shards relative to the
        stream folder, or absolute); a sample no longer in its task's data is an error."""
        out: dict[tuple[str, str], Key] = {}
        for t, refs in items.items():
            refs = [tuple(r) for r in refs]
            ids = ids_of_refs(
                [(os.path.abspath(os.path.join(self.root or "", s)), k) for s, k in refs]
            )
            every = self.entries_of(t).all_ids()
            order = np.argsort(every, kind="stable")
            found = np.zeros(len(ids), dtype=bool)
            j = np.minimum(np.searchsorted(every[order], ids), max(len(every) - 1, 0))
            if len(every):
                found = (ids >= 0) & (every[order][j] == ids)
            if not found.all():
                shard, key = refs[int(np.flatnonzero(~found)[0])]
                raise CvlError(
                    f"replay buffer: task '{t}' has no training sample '{key}' in {shard} "
                    "(stream changed?)"
                )
            out.update(zip(refs, ((t, int(p)) for p in order[j])))
        return out


def _int64(t: Any) -> np.ndarray:
    return (t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)).astype(np.int64)


def _rank(ctx: Any) -> int:
    return ctx.accelerator.process_index if ctx is not None and ctx.accelerator is not None else 0


def _world(ctx: Any) -> int:
    return ctx.accelerator.num_processes if ctx is not None and ctx.accelerator is not None else 1
