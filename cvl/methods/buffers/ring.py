"""Ring buffer (DHA Alg. 2): after t tasks, |M|/t random items from each task seen."""

from __future__ import annotations

from typing import Any

from cvl.data.reader import Entry
from cvl.methods.buffers import Buffer, register_buffer


@register_buffer("ring")
class Ring(Buffer):
    """Equal per-task quotas; older tasks are re-selected (random subset) from the buffer."""

    rank0_only = False

    def select(
        self, task: str, entries: list[Entry], feats: Any
    ) -> dict[str, list[tuple[str, str]]]:
        t = len(self.sizes)  # tasks seen, this one included
        quota = self.size // t
        rng = self.rng(t)
        out = {}
        for old, refs in self.items.items():
            keep = sorted(rng.choice(len(refs), size=min(quota, len(refs)), replace=False))
            out[old] = [refs[i] for i in keep]
        refs = self.refs(entries)
        pick = rng.choice(len(refs), size=min(quota, len(refs)), replace=False)
        out[task] = [refs[i] for i in pick]
        return out
