"""Multi-modal retrieval mAP@N (CTP §5.1, eq. 11) on query / gallery sets with categories.

Each query (an image-text item) ranks the gallery by cosine similarity of one feature per
item; positives are gallery items of the same category; the query's own item (same id) is
excluded from the gallery. Three normalisations of the per-query AP are computed (percent):

- ``eq11`` (the paper, the headline ``mAP@N``):
  AP@N = (1/m_q) * sum_{k<=N} P(k) * delta(k), m_q = number of positives *within the top N*,
  P(k) = (hits at ranks 1..k) / k. AP = 0 when the top N holds no positive. The paper writes
  P_q(k) = (R_q(k) + 1) / k; read with R_q(k) inclusive of rank k this would exceed 1 (a hit
  at rank 1 gives 2), so R_q(k) must count the hits *before* rank k, which is the usual
  precision at a hit; that is what the CTP code computes and what we implement.
- ``code`` (the public CTP code, `product_evaluation.py: eval_gallery`): the top 10 of the
  whole gallery is taken first, the query's own id is removed from that list (so a query that
  retrieves itself keeps only 9 candidates), and only the first min(N, #gallery items of the
  query's category, list length) candidates are scanned; AP is normalised by the hits found in
  that window (as eq. 11). It differs from eq. 11 when a category has fewer than N gallery
  items (the window shrinks, so later hits are not counted) and at N = 10 when the query
  retrieves itself.
- ``pos``: normalised by min(N, number of positives in the gallery) instead of by the hits
  found (the AP@N of the hashing/re-ID literature): missing positives lower the score.

Ties: candidates with equal scores are ordered negatives first (pessimistic), the same rule as
cross-modal retrieval; the sort is stable otherwise (gallery order).

Memory: queries are processed in blocks (at most `block_elems` scores at once) and only the
top candidates of each query are kept. The scores and the two stable sorts run on `device`
(default: where the features are; full float32, see `cvl.device.exact_float32`); the top
candidates come back to the CPU for the per-query AP.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from cvl.device import exact_float32

NS = (1, 5, 10)
DEFAULT_BLOCK_ELEMS = 1 << 22
VARIANTS = ("eq11", "code", "pos")


def _ap(hits: list[bool], norm: int | None) -> float:
    """sum of precision at each hit, divided by `norm` (None: by the number of hits)."""
    n_hit, s = 0, 0.0
    for k, h in enumerate(hits, start=1):
        if h:
            n_hit += 1
            s += n_hit / k
    d = n_hit if norm is None else norm
    return s / d if d > 0 else 0.0


def ap_variants(
    ranked_hits: list[bool],
    n: int,
    n_pos: int,
    code_hits: list[bool] | None = None,
    code_n_pos: int | None = None,
) -> dict[str, float]:
    """AP@n of one query under the three normalisations (fractions in [0, 1]).

    `ranked_hits`: positive-or-not of the ranked candidates (query excluded), at least the top
    n of them (or all there are). `n_pos`: positives in the gallery (query excluded).
    `code_hits`/`code_n_pos`: the CTP code's candidate list (top 10 of the whole gallery minus
    the query) and its positive count (gallery items of the category, the query's own item
    included when it is in the gallery); default: the same as the first two.
    """
    top = ranked_hits[:n]
    out = {"eq11": _ap(top, None), "pos": _ap(top, min(n, n_pos))}
    ch = ranked_hits if code_hits is None else code_hits
    cp = n_pos if code_n_pos is None else code_n_pos
    window = min(n, cp, len(ch))
    out["code"] = _ap(ch[:window], None)
    return out


@torch.no_grad()
def map_at_n(
    query_features: torch.Tensor,
    gallery_features: torch.Tensor,
    query_labels: Sequence[Any],
    gallery_labels: Sequence[Any],
    query_ids: Sequence[Any] | None = None,
    gallery_ids: Sequence[Any] | None = None,
    ns: Sequence[int] = NS,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """mAP@N for every N in `ns` and every normalisation (percent), plus counts.

    Keys: ``mAP@N`` (eq. 11), ``mAP@N/code``, ``mAP@N/pos``; ``n_queries``, ``n_gallery``,
    ``n_no_positive`` (queries whose category has no other gallery item; they count as 0).
    Queries with a missing (None) label are skipped and counted in ``n_unlabelled``.
    """
    dev = torch.device(device) if device is not None else query_features.device
    q = query_features.to(dev, torch.float32)
    g = gallery_features.to(dev, torch.float32)
    nq, ng = q.shape[0], g.shape[0]
    if len(query_labels) != nq or len(gallery_labels) != ng:
        raise ValueError("labels and features differ in length")
    max_n = max(ns)
    # Label ids (None -> -1 never matches anything).
    vocab: dict[Any, int] = {}
    g_lab = torch.tensor(
        [vocab.setdefault(x, len(vocab)) if x is not None else -1 for x in gallery_labels]
    )
    q_lab = torch.tensor([vocab.get(x, -2) if x is not None else -1 for x in query_labels])
    cat_count = Counter(g_lab.tolist())
    g_index: dict[Any, list[int]] = {}
    if query_ids is not None and gallery_ids is not None:
        for gi, gid in enumerate(gallery_ids):
            g_index.setdefault(gid, []).append(gi)
    sums = {(v, n): 0.0 for v in VARIANTS for n in ns}
    counted = no_pos = unlabelled = 0
    rows = max(1, min(max(nq, 1), block_elems // max(1, ng)))
    g_t = g.t().contiguous()
    g_lab_dev = g_lab.to(dev)
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        same = q_lab[r0:r1, None] == g_lab[None, :]
        excl = torch.zeros_like(same)
        if g_index:
            for r in range(r0, r1):
                for gi in g_index.get(query_ids[r], ()):
                    excl[r - r0, gi] = True
        k_keep = min(ng, max_n + int(excl.sum(1).max()) if excl.numel() else max_n)
        with exact_float32():
            s = q[r0:r1] @ g_t  # [c, ng]
        # Pessimistic, stable order: sort by "is positive" (negatives first), then by score.
        same_dev = q_lab[r0:r1, None].to(dev) == g_lab_dev[None, :]
        o1 = torch.argsort(same_dev.to(torch.int8), dim=1, stable=True)
        s1 = torch.gather(s, 1, o1)
        o2 = torch.argsort(s1, dim=1, descending=True, stable=True)
        top = torch.gather(o1, 1, o2[:, :k_keep]).cpu()
        top_same = torch.gather(same, 1, top)
        top_excl = torch.gather(excl, 1, top)
        for r in range(r0, r1):
            lab = int(q_lab[r])
            if lab == -1:
                unlabelled += 1
                continue
            counted += 1
            rr = r - r0
            n_pos = cat_count.get(lab, 0) - int((excl[rr] & same[rr]).sum())
            if n_pos <= 0:
                no_pos += 1
            keep = ~top_excl[rr]
            hits = top_same[rr][keep].tolist()[:max_n]
            # The CTP code: top 10 of the whole gallery, then the query removed.
            raw = top[rr][: min(ng, max_n)]
            code_hits = [
                bool(h) for h, e in zip(same[rr][raw].tolist(), excl[rr][raw].tolist()) if not e
            ]
            code_n_pos = cat_count.get(lab, 0)
            for n in ns:
                ap = ap_variants(hits, n, n_pos, code_hits, code_n_pos)
                for v in VARIANTS:
                    sums[(v, n)] += ap[v]
    out: dict[str, Any] = {}
    for v in VARIANTS:
        for n in ns:
            key = f"mAP@{n}" if v == "eq11" else f"mAP@{n}/{v}"
            out[key] = 100.0 * sums[(v, n)] / counted if counted else None
    out.update(n_queries=counted, n_gallery=ng, n_no_positive=no_pos, n_unlabelled=unlabelled)
    return out


def fuse_dual(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
    """The dual-encoder item feature for mAP: normalise(normalise(image) + normalise(text)).

    A dual encoder (CLIP) has no fusion encoder to give a joint [CLS]; the sum of the two
    unit embeddings is the simplest symmetric joint feature (the midpoint direction of the
    image and its caption) and needs no training.
    """
    f = torch.nn.functional.normalize(image_features.float(), dim=-1)
    t = torch.nn.functional.normalize(text_features.float(), dim=-1)
    return torch.nn.functional.normalize(f + t, dim=-1)
