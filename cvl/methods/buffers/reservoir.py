"""Reservoir sampling (ER): every item seen so far has the same chance to be in the buffer."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cvl.data.index import Entries
from cvl.methods.buffers.base import Buffer, Key, register_buffer


@register_buffer("reservoir")
class Reservoir(Buffer):
    """Algorithm R over the stream of all training items, visited in a seeded random order."""

    rank0_only = False  # pure function of the seed: every rank computes the same slots

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        # slot i holds position slot_pos[i] of task slot_tasks[slot_task[i]]
        self.slot_tasks: list[str] = []
        self.slot_task = np.zeros(0, dtype=np.int64)
        self.slot_pos = np.zeros(0, dtype=np.int64)
        self.n_seen = 0

    def select(self, task: str, entries: Entries, feats: Any) -> dict[str, np.ndarray]:
        """Algorithm R, vectorised: the same draws as one `rng.integers(0, n_seen)` per item
        once the slots are full (numpy draws an array of bounds element by element)."""
        rng = self.rng(len(self.sizes))
        order = rng.permutation(len(entries))
        k = len(self.slot_tasks)
        self.slot_tasks.append(task)
        fill = min(self.size - len(self.slot_pos), len(order))
        self.slot_pos = np.concatenate([self.slot_pos, order[:fill]])
        self.slot_task = np.concatenate([self.slot_task, np.full(fill, k, dtype=np.int64)])
        rest = order[fill:]
        seen = self.n_seen + fill + 1 + np.arange(len(rest), dtype=np.int64)
        self.n_seen += len(order)
        j = rng.integers(0, seen) if len(rest) else np.zeros(0, dtype=np.int64)
        hit = j < self.size
        j, rest = j[hit], rest[hit]
        _, last = np.unique(j[::-1], return_index=True)  # a slot keeps its last replacement
        win = len(j) - 1 - last
        self.slot_pos[j[win]] = rest[win]
        self.slot_task[j[win]] = k
        _, first = np.unique(self.slot_task, return_index=True)
        return {  # per task its slots' items, tasks in the order of their first slot
            self.slot_tasks[i]: self.slot_pos[self.slot_task == i]
            for i in self.slot_task[np.sort(first)].tolist()
        }

    def extra_state(self) -> dict[str, Any]:
        return {
            "slots": {
                "tasks": list(self.slot_tasks),
                "task": torch.from_numpy(self.slot_task.copy()),
                "pos": torch.from_numpy(self.slot_pos.copy()),
            },
            "n_seen": self.n_seen,
        }

    def load_extra_state(self, d: dict[str, Any], refs: dict[tuple[str, str], Key]) -> None:
        slots = d.get("slots", [])
        if isinstance(slots, list):  # an earlier cvl's [task, shard, key] per slot
            self.slot_tasks = list(dict.fromkeys([*self.sizes, *(s[0] for s in slots)]))
            keys = [refs[(s[1], s[2])] for s in slots]
            self.slot_task = np.array([self.slot_tasks.index(t) for t, _ in keys], np.int64)
            self.slot_pos = np.array([p for _, p in keys], dtype=np.int64)
        else:
            self.slot_tasks = list(slots["tasks"])
            self.slot_task = slots["task"].numpy().astype(np.int64)
            self.slot_pos = slots["pos"].numpy().astype(np.int64)
        self.n_seen = int(d.get("n_seen", 0))
