"""TiC-CLIP's replay policies (Garg et al., ICLR 2024, §3 "Cumulative"): the data of each
time step is replayed in the following steps, under a budget of D items (`--buffer-size D`).

Each step trains, from the previous checkpoint, on its new data plus the buffer (shuffled
together); TiC found random subsampling as good as smarter selection for a fixed per-step
budget, so every choice here is a seeded random subset. With D = the size of a step's data,
a step trains on 2D pairs (TiC's setting); any D works.

- `cumulative-all`: replay every past training pair (no budget: `--buffer-size` is not
  given). With `seqft` this is `joint cumulative=true` (the same data each step).
- `cumulative-equal`: D items split equally among the past steps: after t steps each keeps
  ⌊D/t⌋ (TiC: "at the 4th step it retains D/3, D/3, D/3 of old data"); the rounding
  remainder goes to the newest step, so the buffer holds exactly D once the data allows.
  DHA's `ring` is the same split with the remainder left unused.
- `cumulative-exp`: D items whose share halves with each step of age: the newest past step
  holds D/2, the one before D/4, ..., the two oldest the same (TiC: "at the 3rd step D/2, D/2,
  at the 4th D/2, D/4, D/4"). After each step every old step keeps ⌊half⌋ of what it held and
  the newest takes the rest (≈ D/2; all D after the first step).

Both split D by these shares while every step has the data; where a step has fewer items than
its share (a short time step, or an old step that already holds less), its unused quota goes to
the steps that have more (`fill_up`): first the new step, then the old steps newest first, each
up to what it has. So the buffer always holds min(D, items seen) — TiC's budget is D, its
shares assume full steps and it is silent on short ones (sizes 1,503 and 87, D = 4,096: the
halving alone would keep 751 + 87; filled up, all 1,590).

Old steps are always re-selected from what the buffer already holds (nested subsets: a
step's items only shrink), so the buffer never needs past data it no longer has; the new
step's items are a random sample of its training pairs. The budget is in samples (pairs).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cvl.data.index import Entries
from cvl.methods.buffers.base import Buffer, Whole, register_buffer
from cvl.methods.buffers.ring import QuotaBuffer


@register_buffer("cumulative-all")
class CumulativeAll(Buffer):
    """Every training pair of every past step (TiC's Cumulative-All); no size limit."""

    rank0_only = False
    unbounded = True  # --buffer-size is not used

    def __init__(self, size: int = 0, seed: int = 0, **kw: Any) -> None:
        super().__init__(max(1, size), seed=seed, **kw)
        self.size = 0  # no capacity: everything is kept (a task as `Whole`: no array)

    def select(self, task: str, entries: Entries, feats: Any) -> dict[str, np.ndarray | Whole]:
        return {**self.items, task: Whole(len(entries))}

    def load_extra_state(self, d: dict[str, Any], refs: dict) -> None:
        """An earlier cvl's state listed every sample: a whole task again (no array)."""
        for t, h in self.items.items():
            if not isinstance(h, Whole) and np.array_equal(h, np.arange(self.sizes.get(t, -1))):
                self.items[t] = Whole(len(h))


def fill_up(
    size: int, held: dict[str, int], n_new: int, old: dict[str, int], new: int
) -> tuple[dict[str, int], int]:
    """The shares (`old`, `new`) cut to what each step has (`held`, `n_new`), then the quota
    left unused given to the steps with more: the new step first, then the old steps newest
    first (`held` is in time order), each up to what it has; min(size, Σ held + n_new) in all."""
    out = {t: min(q, held[t]) for t, q in old.items()}
    new = min(new, n_new)
    spare = size - sum(out.values()) - new
    take = min(max(spare, 0), n_new - new)
    new, spare = new + take, spare - take
    for t in reversed(list(out)):
        take = min(max(spare, 0), held[t] - out[t])
        out[t], spare = out[t] + take, spare - take
    return out, new


@register_buffer("cumulative-equal")
class CumulativeEqual(QuotaBuffer):
    """D items split equally among the past steps (⌊D/t⌋ each; the remainder to the newest)."""

    def quotas(self, held: dict[str, int], n_new: int) -> tuple[dict[str, int], int]:
        q = self.size // len(self.sizes)
        return fill_up(self.size, held, n_new, dict.fromkeys(held, q), self.size - q * len(held))


@register_buffer("cumulative-exp")
class CumulativeExp(QuotaBuffer):
    """D items, halved per step of age: each old step keeps ⌊half⌋, the newest the rest."""

    def quotas(self, held: dict[str, int], n_new: int) -> tuple[dict[str, int], int]:
        old = {t: n // 2 for t, n in held.items()}
        return fill_up(self.size, held, n_new, old, self.size - sum(old.values()))
