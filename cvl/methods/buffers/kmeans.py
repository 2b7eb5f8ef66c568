"""K-means buffer: per-task quota ∝ task size; keep the item nearest each centroid.

Features: the fusion CLS feature for `fusion` models, else the L2-normalised sum of the
image and text embeddings (the pair's joint feature). Each task's list is ordered by cluster
size (largest first), so shrinking an old task's list keeps the most representative items.
"""

from __future__ import annotations

import numpy as np

from cvl.data.index import Entries
from cvl.methods.buffers.base import Buffer, quotas_by_size, register_buffer


@register_buffer("kmeans")
class KMeansBuffer(Buffer):
    """sklearn KMeans (k = the task's quota) on the task's features; nearest item per centroid."""

    needs_features = True

    def select(
        self, task: str, entries: Entries, feats: np.ndarray | None
    ) -> dict[str, np.ndarray]:
        from sklearn.cluster import KMeans

        quotas = quotas_by_size(self.sizes, self.size)
        out = {t: held[: quotas[t]] for t, held in self.items.items()}
        k = min(quotas[task], len(entries))
        if k == 0:
            out[task] = np.zeros(0, dtype=np.int64)
            return out
        km = KMeans(n_clusters=k, n_init=3, random_state=self.seed).fit(feats)
        counts = np.bincount(km.labels_, minlength=k)
        chosen: list[int] = []
        for c in np.argsort(-counts, kind="stable"):
            members = np.flatnonzero(km.labels_ == c)
            if len(members) == 0:
                continue
            d = ((feats[members] - km.cluster_centers_[c]) ** 2).sum(1)
            chosen.append(int(members[np.argmin(d)]))
        out[task] = np.array(chosen, dtype=np.int64)
        return out
