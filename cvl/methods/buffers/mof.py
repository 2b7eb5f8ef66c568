"""Mean-of-features buffer (iCaRL herding), keeping the herding order.

Per-task quota ∝ task size (as `kmeans`). Herding picks, one at a time, the item that brings
the running mean of the picked features closest to the task's mean feature; the list keeps
that order, so shrinking an old task to a smaller quota keeps its best items (the CTP code
loses the order). Features as in `kmeans` (fusion CLS, else normalised image+text sum).
"""

from __future__ import annotations

import numpy as np

from cvl.data.index import Entries
from cvl.methods.buffers.base import Buffer, quotas_by_size, register_buffer


def herding_order(feats: np.ndarray, k: int) -> list[int]:
    """Indices of the first k herding picks (each item at most once)."""
    mu = feats.mean(0)
    picked: list[int] = []
    acc = np.zeros_like(mu)
    free = np.ones(len(feats), dtype=bool)
    for n in range(1, k + 1):
        cand = (acc[None, :] + feats) / n
        dist = ((cand - mu[None, :]) ** 2).sum(1)
        dist[~free] = np.inf
        i = int(np.argmin(dist))
        picked.append(i)
        free[i] = False
        acc += feats[i]
    return picked


@register_buffer("mof")
class MoFBuffer(Buffer):
    """Herding selection towards the task's mean feature; shrinking keeps the herding prefix."""

    needs_features = True

    def select(
        self, task: str, entries: Entries, feats: np.ndarray | None
    ) -> dict[str, np.ndarray]:
        quotas = quotas_by_size(self.sizes, self.size)
        out = {t: held[: quotas[t]] for t, held in self.items.items()}
        k = min(quotas[task], len(entries))
        out[task] = np.array(herding_order(feats, k) if k else [], dtype=np.int64)
        return out
