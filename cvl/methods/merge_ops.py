"""The tensor arithmetic of the task-vector merges (MagMax, DARE, Breadcrumbs, SLERP, TALL masks,
LiNeS, OPCM), on dicts of tensors by name; `cvl.methods.merging` registers the operators built
from them and the methods (`magmax`, `dare`, `dare_ties`, `breadcrumbs`, `slerp`, `tall_masks`,
`opcm`) use them. Each function cites the public code it follows; the methods' docstrings give
the defaults and the choices where the code is silent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import torch

from cvl.methods.merge_dist import whole
from cvl.train.fsdp import is_dtensor, plain, reshard_like

Weights = dict[str, torch.Tensor]


# -- MagMax --------------------------------------------------------------------------------------
@torch.no_grad()
def max_abs(taus: Sequence[Weights]) -> Weights:
    """Per entry, the task vector entry of largest |value| (MagMax; danielm1405/magmax,
    `src/merging/task_vectors.py`, `merge_max_abs`: folds `torch.where(|cur| >= |max|, cur,
    max)` over the vectors in order, so a tie goes to the later vector)."""
    out = {}
    for k, first in taus[0].items():
        best = first
        for t in taus[1:]:
            cur = t[k].to(best.device, best.dtype)
            best = torch.where(cur.abs() >= best.abs(), cur, best)
        out[k] = best
    return out


# -- DARE ----------------------------------------------------------------------------------------
@torch.no_grad()
def dare(tau: Weights, p: float, generator: torch.Generator) -> Weights:
    """Drop And REscale: each entry kept where u > p (u ~ U[0, 1), one draw per entry, the
    tensors drawn in sorted name order whatever the dict's order, on the generator's device)
    and divided by 1 − p (tanganke/fusion_bench, `fusion_bench/method/dare/utils.py`,
    `param_random_drop_`: `mask = torch.rand_like(param) > sparsity_level`, then
    `/ (1 - sparsity_level)`; it draws from the global RNG in `parameters()` order, so its
    masks are no fixed sequence: the sorted order makes the masks a function of the names).
    p = 1 drops everything (no rescale: nothing is left)."""
    masks = {k: torch.rand(tau[k].shape, generator=generator) > p for k in sorted(tau)}
    out = {}
    for k, v in tau.items():  # (a sharded τ: the slice of the whole mask, `reshard_like`)
        out[k] = v * reshard_like(masks[k], v) / (1.0 - p) if p < 1.0 else torch.zeros_like(v)
    return out


# -- Model Breadcrumbs ---------------------------------------------------------------------------
@torch.no_grad()
def breadcrumbs(tau: Weights, keep: float, remove: float) -> Weights:
    """Per tensor, along its last dimension (each row of n entries), the top ⌊n·remove⌋ entries
    by |value| are set to 0, then of what is left only the top ⌊n·keep⌋ by |value| are kept:
    the large outliers and the small bulk go, a middle band stays (rezazzr/breadcrumbs,
    `src/task_vectors.py`, `TaskVectorMiddleKeep` with remove_first=True: `mask_remove_top`
    then `mask_keep_top`, each a `torch.topk` of |x| along the last dim). 0-d tensors are kept."""
    out = {}
    for k, v in tau.items():
        if v.dim() == 0:
            out[k] = v
            continue
        if v.dim() == 1 and is_dtensor(v):  # the sharded dim is the one ranked: whole tensor
            out[k] = whole(lambda x: breadcrumbs({"t": x}, keep, remove)["t"], v)
            continue
        n = v.shape[-1]
        x = v
        r = int(n * remove)
        if r:
            idx = torch.topk(x.abs(), r, dim=-1).indices
            x = x * torch.ones_like(x).scatter_(-1, idx, 0.0)
        kk = int(n * keep)
        mask = torch.zeros_like(x)
        if kk:
            mask.scatter_(-1, torch.topk(x.abs(), kk, dim=-1).indices, 1.0)
        out[k] = x * mask
    return out


# -- SLERP ---------------------------------------------------------------------------------------
DOT_THRESHOLD = 0.9995


@torch.no_grad()
def slerp(new: torch.Tensor, old: torch.Tensor, alpha: float, eps: float = 1e-8) -> torch.Tensor:
    """Spherical interpolation of one tensor, weight α on `new` (α = 1 → `new`): with unit
    vectors û, v̂ (each divided by its norm when that is > eps), d = û·v̂, ω = arccos d,
    sin((1−α)ω)/sin ω·old + sin(αω)/sin ω·new; |d| > 0.9995 falls back to (1−α)·old + α·new
    (pseudope/fomo_in_flux, `continual_lib/merge.py`, `SLERP.slerp` with v0 = `new`, v1 = `old`
    and its coefficient w = 1 − α: it gives sin(ω(1 − w)) to v0)."""
    a, b = new.double(), old.double()
    na, nb = plain(a.norm()), plain(b.norm())  # (sharded: reduced over the shards)
    ua = a / na if na > eps else a
    ub = b / nb if nb > eps else b
    dot = float(plain((ua * ub).sum()))
    if abs(dot) > DOT_THRESHOLD:
        return (1.0 - alpha) * old + alpha * new.to(old.dtype)
    omega = math.acos(dot)
    so = math.sin(omega)
    c_new, c_old = math.sin(omega * alpha) / so, math.sin(omega * (1.0 - alpha)) / so
    return c_new * new + c_old * old.to(new.dtype)


# -- TALL masks / consensus ----------------------------------------------------------------------
@torch.no_grad()
def tall_masks(taus: Sequence[Weights], lam: float) -> list[dict[str, torch.Tensor]]:
    """m_t = |θ_0 − θ_t| > |θ_MTL − θ_t|·λ = |τ_t| > |τ_MTL − τ_t|·λ, τ_MTL = Σ_i τ_i
    (nik-dim/tall_masks as tanganke/fusion_bench `fusion_bench/method/tall_mask/utils.py`,
    `generate_task_masks`, and FoMo-in-Flux `TallMasks._generate_task_masks`: strict >)."""
    total = {k: sum(t[k] for t in taus) for k in taus[0]}
    return [{k: t[k].abs() > (total[k] - t[k]).abs() * lam for k in t} for t in taus]


@torch.no_grad()
def consensus(taus: Sequence[Weights], lam: float, k: int) -> Weights:
    """τ_MTL masked to the entries at least k tasks' TALL masks keep: (Σ τ_i)·[Σ_t m_t ≥ k]
    (FoMo-in-Flux `TallMasks.merge` / `_generate_consensus_mask`)."""
    masks = tall_masks(taus, lam)
    out = {}
    for n in taus[0]:
        count = sum(m[n].to(torch.int64) for m in masks)
        out[n] = sum(t[n] for t in taus) * (count >= k)
    return out


# -- LiNeS ---------------------------------------------------------------------------------------
_BLOCK = re.compile(r"\.resblocks\.(\d+)\.")


def lines_scales(names: Iterable[str], alpha: float, beta: float) -> dict[str, float]:
    """Per tensor, α + β·ℓ/(L − 1) for the tensors of residual block ℓ (L = 1 + the largest
    block index in any tower), α for all others (LiNeS, Wang et al. ICLR 2025, Eq. 1; as
    FoMo-in-Flux `BaseLinesMerge._get_lines_weights`, `lines_scaling_type` "linear": blocks
    found by `.resblocks.{i}.` in the name, depth from `transformer.resblocks.`)."""
    names = list(names)
    blocks = {n: int(m.group(1)) for n in names if (m := _BLOCK.search(n))}
    depth = max(blocks.values(), default=-1) + 1
    out = {}
    for n in names:
        if n in blocks and depth > 1:
            out[n] = alpha + beta * blocks[n] / (depth - 1)
        else:
            out[n] = alpha
    return out


# -- OPCM ----------------------------------------------------------------------------------------
@torch.no_grad()
def opcm_project(previous: torch.Tensor, task: torch.Tensor, alpha: float) -> torch.Tensor:
    """The new task vector of one linear weight (out × in) with the previous merged task
    vector's leading singular directions taken out (tanganke/fusion_bench,
    `fusion_bench/method/opcm/opcm.py`, `OPCMForCLIP.merge_linear_weights`): U, s, V = SVD of
    `previous` (full matrices); r = the first index where cumsum(s)/Σs > α; P = Uᵀ·τ·V with its
    diagonal and its top-left r × r block set to 0; returns U·P·Vᵀ."""
    u, s, vh = torch.linalg.svd(previous, full_matrices=True)
    v = vh.T
    split = int((s.cumsum(0) / s.sum() > alpha).float().argmax())
    p = u.T @ task @ v
    p.diagonal().fill_(0)
    p[:split, :split] = 0
    return u @ p @ v.T


def vector_norm(tau: Weights) -> torch.Tensor:
    """‖τ‖ over all entries of all tensors (fusion_bench `get_task_vector_norm`); a sharded
    tensor's norm is reduced over its shards (`plain`)."""
    return torch.linalg.vector_norm(torch.stack([plain(v.double().norm()) for v in tau.values()]))
