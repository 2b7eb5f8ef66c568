"""The angle maths of the Mod-X rotation analysis: cosines to degrees in float64, the per-sample
angles between two checkpoints (RAM), the SAM change counted block by block, the samples a
checkpoint retrieves correctly and their inter-modal angle change (ImAV), and the right-closed
histogram bins the papers' tables use.

The definitions are in `cvl.analysis.rotation`'s docstring. Pure tensor functions, kept apart
from the tables, plots and run folders that use them so that each can be tested on small
hand-computed tensors. `cvl.analysis.rotation` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cvl.errors import CvlError
from cvl.progress import progress_bar

SAM_EDGES: tuple[float, ...] = (0.0, 5.0, 10.0, 15.0, 20.0, 180.0)


RAM_EDGES: tuple[float, ...] = (0.0, 15.0, 20.0, 25.0, 30.0, 180.0)


EDGE_TOL = 1e-9  # degrees; a value within this of an edge counts as on the edge (right-closed)


DEFAULT_CHUNK_ELEMS = 1 << 23  # float64 elements held by one SAM block (~64 MB)


# -- binning ---------------------------------------------------------------------------------
def _fmt_edge(x: float) -> str:
    return f"{x:g}"


def bin_labels(edges: Sequence[float]) -> list[str]:
    """The papers' column names: '[0°, 5°]', '(5°, 10°]', ..."""
    out = []
    for k in range(len(edges) - 1):
        lo, hi = _fmt_edge(edges[k]), _fmt_edge(edges[k + 1])
        out.append(f"{'[' if k == 0 else '('}{lo}°, {hi}°]")
    return out


def histogram(values: torch.Tensor, edges: Sequence[float]) -> torch.Tensor:
    """Counts of `values` (degrees) in right-closed bins [e0,e1], (e1,e2], ... (int64)."""
    v = values.reshape(-1)
    n = v.numel()
    gt = [int((v > e + EDGE_TOL).sum()) for e in edges[1:-1]]
    counts = [n - gt[0]] + [gt[k - 1] - gt[k] for k in range(1, len(gt))] + [gt[-1]]
    return torch.tensor(counts, dtype=torch.long)


# -- angle math ------------------------------------------------------------------------------
def _unit64(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float64)
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def cos_to_deg(cos: torch.Tensor) -> torch.Tensor:
    """arccos in degrees of float64 cosines, clamped to [-1, 1] first (in place)."""
    return torch.rad2deg_(torch.arccos_(cos.clamp_(-1.0, 1.0)))


def paired_angles(a: torch.Tensor, b: torch.Tensor, chunk_rows: int = 8192) -> torch.Tensor:
    """Angle (deg, float64) between row k of `a` and row k of `b`, for every k."""
    if a.shape != b.shape:
        raise CvlError(
            f"paired angles need equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    out = torch.empty(a.shape[0], dtype=torch.float64)
    for s in range(0, a.shape[0], chunk_rows):
        e = s + chunk_rows
        out[s:e] = cos_to_deg((_unit64(a[s:e]) * _unit64(b[s:e])).sum(-1))
    return out


def checkpoint_pairs(k: int) -> list[tuple[int, int]]:
    """Consecutive pairs (i, i+1) and, with three or more checkpoints, first vs last."""
    if k < 2:
        raise CvlError(f"the rotation analysis needs at least two checkpoints, got {k}")
    pairs = [(i, i + 1) for i in range(k - 1)]
    if k > 2:
        pairs.append((0, k - 1))
    return pairs


def check_feats(feats: Sequence[torch.Tensor]) -> tuple[int, int]:
    if not feats:
        raise CvlError("no feature matrices given")
    n, d = feats[0].shape
    for f in feats:
        if f.shape != (n, d):
            raise CvlError(f"feature matrices differ in shape: {tuple(f.shape)} vs {(n, d)}")
        if not torch.isfinite(f).all():
            raise CvlError("features contain NaN or inf (a diverged checkpoint?)")
    return n, d


def sam_counts(
    feats: Sequence[torch.Tensor],
    pairs: Sequence[tuple[int, int]],
    edges: Sequence[float] = SAM_EDGES,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    progress: bool = False,
    desc: str = "SAM",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram counts of |SAM_a - SAM_b| for each (a, b) in `pairs`, and their sums.

    feats[k] is checkpoint k's [N, D] feature matrix (one modality). Only pairs i < j of the
    upper triangle are counted (diagonal excluded): each row of the result sums to N(N-1)/2.
    Rows of the triangle are processed in blocks of about `chunk_elems` float64 values in
    total (for all checkpoints involved), so memory stays bounded for any N.
    Returns (counts [len(pairs), bins] int64, sums [len(pairs)] float64 for the mean).
    """
    n, _ = check_feats(feats)
    need = sorted({k for p in pairs for k in p})
    nb = len(edges) - 1
    counts = torch.zeros(len(pairs), nb, dtype=torch.long)
    sums = torch.zeros(len(pairs), dtype=torch.float64)
    total = n * (n - 1) // 2
    with progress_bar(
        total=total, desc=desc, unit="pair", unit_scale=True, show=progress, leave=False
    ) as bar:
        s = 0
        while s < n - 1:
            cols = n - s
            rows = max(1, chunk_elems // (cols * (len(need) + 1)))
            e = min(n - 1, s + rows)  # the last sample has no partner j > i
            r = e - s
            ang = {}
            for k in need:
                x = _unit64(feats[k][s:])  # samples s..n-1; the block's rows are its first r
                ang[k] = cos_to_deg(x[:r] @ x.T)  # [r, cols]: column c is sample s + c
            tri = torch.ones(r, r, dtype=torch.bool).triu_(1)  # j > i inside the block
            for p, (a, b) in enumerate(pairs):
                d = (ang[a] - ang[b]).abs_()
                left, right = d[:, :r][tri], d[:, r:]
                counts[p] += histogram(left, edges) + histogram(right, edges)
                sums[p] += left.sum() + right.sum()
            bar.update(r * (n - 1) - (s + e - 1) * r // 2)
            s = e
    return counts, sums


def sam_counts_dense(
    feats: Sequence[torch.Tensor],
    pairs: Sequence[tuple[int, int]],
    edges: Sequence[float] = SAM_EDGES,
) -> torch.Tensor:
    """Reference: the same counts from full N x N matrices (small N only; used by tests)."""
    n, _ = check_feats(feats)
    iu = torch.triu_indices(n, n, offset=1)
    sams = {}
    for k in {k for p in pairs for k in p}:
        x = _unit64(feats[k])
        sams[k] = cos_to_deg(x @ x.T)[iu[0], iu[1]]
    return torch.stack([histogram((sams[a] - sams[b]).abs(), edges) for a, b in pairs])


def retrieval_correct(
    image: torch.Tensor,
    text: torch.Tensor,
    captions: Sequence[str] | None = None,
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """Bool [N]: image a's top-1 caption within the set (image->text) is its own.

    With `captions`, a retrieved caption whose text equals a's caption also counts as a hit.
    Ties go to the lowest index (argmax).
    """
    n = image.shape[0]
    if text.shape[0] != n:
        raise CvlError(f"need one caption per image, got {n} images and {text.shape[0]} captions")
    top = torch.empty(n, dtype=torch.long)
    t = text.float()
    for s in range(0, n, chunk_rows):
        top[s : s + chunk_rows] = (image[s : s + chunk_rows].float() @ t.T).argmax(dim=1)
    own = top == torch.arange(n)
    if captions is None:
        return own
    if len(captions) != n:
        raise CvlError(f"{len(captions)} captions for {n} samples")
    return torch.tensor(
        [bool(o) or captions[int(j)] == captions[i] for i, (o, j) in enumerate(zip(own, top))]
    )


def imav_angles(
    img_a: torch.Tensor,
    txt_a: torch.Tensor,
    img_b: torch.Tensor,
    txt_b: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """|angle(V_b, L_b) - angle(V_a, L_a)| (deg) of the samples where `mask` is true."""
    return (paired_angles(img_b[mask], txt_b[mask]) - paired_angles(img_a[mask], txt_a[mask])).abs()
