"""Replay buffers, combinable with any method (`--buffer NAME --buffer-size N`).

A buffer stores item *references* (shard path relative to the stream folder + key), never
images, per task and in a meaningful order (herding order for `mof`). After each task the
loop calls `update(task, entries, ctx)`; the next task trains on its own data plus
`entries()`. Selection runs on rank 0 and is broadcast, so every rank holds the same buffer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from cvl.data.reader import Entry, index_shard
from cvl.errors import CvlError

BUFFERS: dict[str, type] = {}


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


class Buffer:
    """Base class: per-task ordered lists of (shard, key) references."""

    name = "base"

    def __init__(
        self, size: int, seed: int = 0, stream_root: str | os.PathLike | None = None
    ) -> None:
        if size <= 0:
            raise CvlError(f"--buffer-size must be positive, got {size}")
        self.size = size
        self.seed = seed
        self.root = Path(stream_root) if stream_root else None
        self.items: dict[str, list[tuple[str, str]]] = {}
        self.sizes: dict[str, int] = {}  # training-set size of each task seen

    # -- references --------------------------------------------------------------------------
    def _rel(self, shard: str) -> str:
        if self.root is not None:
            try:
                return str(Path(shard).relative_to(self.root.absolute()))
            except ValueError:
                pass
        return str(shard)

    def _abs(self, shard: str) -> str:
        p = Path(shard)
        return str(p if p.is_absolute() or self.root is None else self.root.absolute() / p)

    def refs(self, entries: list[Entry]) -> list[tuple[str, str]]:
        return [(self._rel(e.shard), e.key) for e in entries]

    def entries(self) -> list[Entry]:
        """The buffer's items as reader entries (all tasks, in task then stored order)."""
        out: list[Entry] = []
        cache: dict[str, dict[str, Entry]] = {}
        for refs in self.items.values():
            for shard, key in refs:
                path = self._abs(shard)
                if path not in cache:
                    cache[path] = {e.key: e for e in index_shard(path)[0]}
                if key not in cache[path]:
                    raise CvlError(f"replay buffer: {path} has no sample '{key}' (stream changed?)")
                out.append(cache[path][key])
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self.items.values())

    def rng(self, task_index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, 991, task_index])

    # -- selection ---------------------------------------------------------------------------
    def update(self, task: str, entries: list[Entry], ctx: Any) -> None:
        """Add task `task` (its training entries) after it finished; called on every rank."""
        from accelerate.utils import broadcast_object_list

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

    #: selection needs features (k-means, herding): compute once on rank 0 and broadcast.
    rank0_only = True
    needs_features = False

    def select(
        self, task: str, entries: list[Entry], feats: Any
    ) -> dict[str, list[tuple[str, str]]]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size": self.size,
            "items": {t: [list(r) for r in refs] for t, refs in self.items.items()},
            "sizes": dict(self.sizes),
            **self.extra_state(),
        }

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.items = {t: [tuple(r) for r in refs] for t, refs in d["items"].items()}
        self.sizes = dict(d.get("sizes", {}))


def _rank(ctx: Any) -> int:
    return ctx.accelerator.process_index if ctx is not None and ctx.accelerator is not None else 0


def _world(ctx: Any) -> int:
    return ctx.accelerator.num_processes if ctx is not None and ctx.accelerator is not None else 1


def build_buffer(name: str, size: int, seed: int, stream_root: str | None) -> Buffer:
    """A buffer by CLI name (reservoir, ring, kmeans, mof)."""
    from cvl.methods.buffers import kmeans, mof, reservoir, ring  # noqa: F401 (register)

    if name not in BUFFERS:
        raise CvlError(f"unknown buffer '{name}' (available: {', '.join(sorted(BUFFERS))})")
    return BUFFERS[name](size, seed=seed, stream_root=stream_root)
