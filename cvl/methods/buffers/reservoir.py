"""Reservoir sampling (ER): every item seen so far has the same chance to be in the buffer."""

from __future__ import annotations

from typing import Any

from cvl.data.reader import Entry
from cvl.methods.buffers.base import Buffer, register_buffer


@register_buffer("reservoir")
class Reservoir(Buffer):
    """Algorithm R over the stream of all training items, visited in a seeded random order."""

    rank0_only = False  # pure function of the seed: every rank computes the same slots

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.slots: list[tuple[str, str, str]] = []  # (task, shard, key)
        self.n_seen = 0

    def select(
        self, task: str, entries: list[Entry], feats: Any
    ) -> dict[str, list[tuple[str, str]]]:
        rng = self.rng(len(self.sizes))
        refs = self.refs(entries)
        for i in rng.permutation(len(refs)):
            self.n_seen += 1
            item = (task, *refs[i])
            if len(self.slots) < self.size:
                self.slots.append(item)
            else:
                j = int(rng.integers(0, self.n_seen))
                if j < self.size:
                    self.slots[j] = item
        out: dict[str, list[tuple[str, str]]] = {}
        for t, shard, key in self.slots:
            out.setdefault(t, []).append((shard, key))
        return out

    def extra_state(self) -> dict[str, Any]:
        return {"slots": [list(s) for s in self.slots], "n_seen": self.n_seen}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.slots = [tuple(s) for s in d.get("slots", [])]
        self.n_seen = int(d.get("n_seen", 0))
