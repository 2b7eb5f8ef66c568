"""Ring buffer (DHA Alg. 2): after t tasks, |M|/t random items from each task seen.

`QuotaBuffer` is the shared mechanism of the per-task-quota buffers (ring here, TiC-CLIP's
Cumulative-Equal and Cumulative-Exp in `cumulative.py`): after each task, every old task keeps
a seeded random subset of the items it already holds (nested: a task's items only ever
shrink, so the buffer never needs data it no longer has) and the new task gets a random
sample of its training items; a subclass only says how many items each task keeps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cvl.data.index import Entries
from cvl.methods.buffers.base import Buffer, positions, register_buffer


class QuotaBuffer(Buffer):
    """Per-task quotas (`quotas`), old tasks re-selected (random subset) from the buffer."""

    rank0_only = False  # a pure function of the seed: every rank computes the same items

    def quotas(self, held: dict[str, int], n_new: int) -> tuple[dict[str, int], int]:
        """(items each old task keeps, items the new task gets); `held` = items each old task
        holds now, `n_new` = the new task's training items (len(self.sizes) tasks seen)."""
        raise NotImplementedError

    def select(self, task: str, entries: Entries, feats: Any) -> dict[str, np.ndarray]:
        rng = self.rng(len(self.sizes))
        old, new = self.quotas({t: len(h) for t, h in self.items.items()}, len(entries))
        out = {}
        for t, held in self.items.items():
            held = positions(held)
            keep = np.sort(rng.choice(len(held), size=min(old[t], len(held)), replace=False))
            out[t] = held[keep]
        out[task] = rng.choice(len(entries), size=min(new, len(entries)), replace=False)
        return out


@register_buffer("ring")
class Ring(QuotaBuffer):
    """Equal per-task quotas ⌊|M|/t⌋; older tasks are re-selected (random subset) from the buffer."""

    def quotas(self, held: dict[str, int], n_new: int) -> tuple[dict[str, int], int]:
        quota = self.size // len(self.sizes)
        return dict.fromkeys(held, quota), quota
