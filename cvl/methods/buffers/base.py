"""The replay buffers' base class and registry: what every buffer module builds on.

Kept apart from the package's `__init__` so that the buffer modules (ring, reservoir, ...) can
import their base without importing the package that imports them (no import cycle).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cvl.data.index import Entries, Entry, ids_of_keys
from cvl.device import to_device
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
        self.payload: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

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

    def entries(self) -> Entries:
        """The buffer's items as reader entries (all tasks, in task then stored order)."""
        refs = [(self._abs(s), k) for rs in self.items.values() for s, k in rs]
        by_shard: dict[str, list[int]] = {}
        for i, (path, _) in enumerate(refs):
            by_shard.setdefault(path, []).append(i)
        ids = np.empty(len(refs), dtype=np.int64)
        for path, pos in by_shard.items():
            got = ids_of_keys(path, [refs[i][1] for i in pos])
            if (got < 0).any():
                key = refs[pos[int(np.flatnonzero(got < 0)[0])]][1]
                raise CvlError(f"replay buffer: {path} has no sample '{key}' (stream changed?)")
            ids[pos] = got
        return Entries.of_ids(ids)

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
        kept = {r for refs in self.items.values() for r in refs}
        self.payload = {r: v for r, v in self.payload.items() if r in kept}

    # -- per-item payload --------------------------------------------------------------------
    def ref_of(self, shard: str, key: str) -> tuple[str, str]:
        """The buffer's reference of a sample read from `shard` (absolute or relative)."""
        return (self._rel(shard), key)

    def refs_without(self, name: str) -> list[tuple[str, str]]:
        """Items (in `entries()` order) that carry no payload `name` yet."""
        return [
            r for refs in self.items.values() for r in refs if name not in self.payload.get(r, {})
        ]

    def set_payload(self, refs: list[tuple[str, str]], **tensors: torch.Tensor) -> None:
        """Attach row i of each tensor to item refs[i] (kept on CPU)."""
        for name, t in tensors.items():
            if t.shape[0] != len(refs):
                raise ValueError(f"payload '{name}': {t.shape[0]} rows for {len(refs)} items")
        for i, r in enumerate(refs):
            d = self.payload.setdefault(tuple(r), {})
            for name, t in tensors.items():
                d[name] = t[i].detach().cpu().clone()

    def payload_rows(
        self, batch: dict[str, Any], name: str, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask, rows): which batch rows are buffer items carrying payload `name`, and that
        payload stacked (zeros elsewhere), on `like`'s device and dtype."""
        mask, rows = [], []
        for shard, key in zip(batch["shard"], batch["key"]):
            p = self.payload.get(self.ref_of(shard, key), {}).get(name)
            mask.append(p is not None)
            rows.append(p if p is not None else None)
        shape = next((r.shape for r in rows if r is not None), like.shape[1:])
        stacked = torch.stack([r if r is not None else torch.zeros(shape) for r in rows])
        m = to_device(torch.tensor(mask, dtype=torch.bool), like.device)  # no host sync
        return m, to_device(stacked, like.device).to(like.dtype)

    def in_buffer(self, batch: dict[str, Any], device: Any = None) -> torch.Tensor:
        """Bool per batch row: the sample is one of the buffer's items (a replayed pair)."""
        kept = {r for refs in self.items.values() for r in refs}
        mask = torch.tensor(
            [self.ref_of(s, k) in kept for s, k in zip(batch["shard"], batch["key"])],
            dtype=torch.bool,
        )
        return mask if device is None else to_device(mask, device)  # no host sync

    #: selection needs features (k-means, herding): compute once on rank 0 and broadcast.
    rank0_only = True
    needs_features = False
    #: keeps every item (TiC's Cumulative-All): takes no --buffer-size
    unbounded = False

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
            **self._payload_state(),
            **self.extra_state(),
        }

    def _payload_state(self) -> dict[str, Any]:
        """Payload as one stacked tensor per name (safetensors) + the item order (JSON)."""
        if not self.payload:
            return {}
        refs = sorted(self.payload)
        names = sorted({n for v in self.payload.values() for n in v})
        out: dict[str, Any] = {"payload": {}}
        for n in names:
            have = [r for r in refs if n in self.payload[r]]
            out["payload"][n] = {
                "refs": [list(r) for r in have],
                "rows": torch.stack([self.payload[r][n] for r in have]),
            }
        return out

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.items = {t: [tuple(r) for r in refs] for t, refs in d["items"].items()}
        self.sizes = dict(d.get("sizes", {}))
        self.payload = {}
        for n, p in (d.get("payload") or {}).items():
            self.set_payload([tuple(r) for r in p["refs"]], **{n: p["rows"]})


def _rank(ctx: Any) -> int:
    return ctx.accelerator.process_index if ctx is not None and ctx.accelerator is not None else 0


def _world(ctx: Any) -> int:
    return ctx.accelerator.num_processes if ctx is not None and ctx.accelerator is not None else 1
