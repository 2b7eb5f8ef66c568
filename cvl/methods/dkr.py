"""DKR: Dynamic Knowledge Rectification (Cui et al., "Continual Vision-Language Retrieval via
Dynamic Knowledge Rectification", Alg. 1, Eq. 3-11).

Affinities (Eq. 3) are row-softmaxes of the scaled similarities over the **global** batch, for
image→text and text→image: M_new = softmax(s·v·wᵀ) with the training model's learned scale
s = 1/τ, M_old = softmax(s'·v'·w'ᵀ) with the previous task's frozen model and its own learned
scale s' (τ "is a learnable temperature parameter" of each model; z and τ of the old model
are those "trained after the (s−1)-th stage"). Each row i of M_old is rectified into M_T
(Alg. 1):

(a) old retrieves i (argmax_j M_old[i, j] = i): M_T[i] = M_old[i];
(b) else new retrieves i: M_T[i, j] = M_old[i, j]·(1 − M_new[i, i])/(1 − M_old[i, i]) for
    j ≠ i (Eq. 7) and M_T[i, i] = 1 (Eq. 8). With `rnk_star=true` (the RNK* ablation, "RNK
    w/o Eq. 8") M_T[i, i] = M_new[i, i] (Eq. 6) instead;
(c) else: M_T[i, i] = 1 (Eq. 9) and the row is divided by 1 + Σ_{k≠i} M_old[i, k] (Eq. 10).

Loss (Eq. 5, 11): L = L_clip + λ·[JS(M_T, M_new)_i2t + JS(M_T, M_new)_t2i], the two directions
summed, JS(a, b) = KL(a‖m) + KL(b‖m), m = (a+b)/2, KL(x‖y) = Σ x·log(x/y) (Eq. 4, no ½).

Choices (the paper is silent or its formulas are taken literally):

- Row (b) sums to 2 − M_new[i, i], not 1 (the diagonal is set to 1 *after* the off-diagonals
  were rescaled to sum to 1 − M_new[i, i]); as published, the KL sums are taken over the
  unnormalised row. `normalize=true` divides every rectified row by its sum (changes only
  rows (b); rows (a), (c) and RNK* rows already sum to 1).
- Reduction: Eq. 2 sums L_clip over the batch and Eq. 4 sums the KLs over the matrix, so the
  paper's ratio between the two is per sample; the base loss here is the per-row mean, so the
  JS term is the per-row mean too (`reduction=mean`, = the paper's loss / N; Adam is
  insensitive to that common factor). `reduction=sum` sums the JS rows over the global batch.
- M_T is a fixed target (no gradient, also through M_new[i, i] in rows (b)); the gradient
  flows through M_new in both KL terms (also through m), including the learned scale. The old
  model runs under `torch.no_grad()`.
- L_clip is the architecture's base loss (`itc`; + MLM for the fusion model). On the first
  task there is no old model: base loss only.

Defaults: λ = 1.0 (Setting-1, five different datasets); the paper uses λ = 0.1 for Setting-2
(one dataset split into 5 parts): `--method-arg lam=0.1`. Logged terms: `itc`, `dkr_js`
(already × λ); metrics `dkr_old_correct`, `dkr_new_only`, `dkr_neither`: share of rows in
cases (a), (b), (c), averaged over the two directions.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.losses import js_rows, old_new_global_logits, row_correct, sum_over_global_rows
from cvl.methods.base import PreviousModelMethod, TaskContext, base_loss
from cvl.methods.registry import register


@torch.no_grad()
def rectify(
    old_aff: torch.Tensor,
    new_aff: torch.Tensor,
    targets: torch.Tensor,
    rnk_star: bool = False,
    normalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 1: the rectified old affinity M_T and each row's case (0 = a, 1 = b, 2 = c).

    `old_aff`, `new_aff`: row-softmax affinities (rows = this rank's samples, columns = the
    global batch); `targets`: each row's own column (its "diagonal").
    """
    old, new = old_aff.detach().float(), new_aff.detach().float()
    diag = torch.arange(old.shape[1], device=old.device)[None, :] == targets[:, None]
    p_old = old.gather(1, targets[:, None])
    p_new = new.gather(1, targets[:, None])
    ok_old = row_correct(old, targets)[:, None]
    ok_new = row_correct(new, targets)[:, None]
    # (b) Eq. 7 off-diagonals, Eq. 8 diagonal (RNK*: Eq. 6 diagonal)
    off_b = old * (1 - p_new) / (1 - p_old).clamp_min(1e-12)
    row_b = torch.where(diag, p_new if rnk_star else torch.ones_like(old), off_b)
    # (c) Eq. 9 diagonal, Eq. 10 renormalisation by 1 + Σ_{k≠i} M_old[i, k]
    off_sum = old.masked_fill(diag, 0).sum(-1, keepdim=True)
    row_c = old.masked_fill(diag, 1.0) / (1 + off_sum)
    out = torch.where(ok_old, old, torch.where(ok_new, row_b, row_c))
    if normalize:
        out = out / out.sum(-1, keepdim=True)
    case = torch.where(ok_old, 0, torch.where(ok_new, 1, 2)).squeeze(1)
    return out, case


def dkr_js(
    new_logits: torch.Tensor,
    old_logits: torch.Tensor,
    targets: torch.Tensor,
    rnk_star: bool = False,
    normalize: bool = False,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One direction of DKR: JS(M_T, softmax(new_logits)) over rows; returns (js, cases).

    `new_logits` / `old_logits` are scaled similarities (s·cosine) whose row-softmaxes are
    the affinities M_new / M_old (Eq. 3).
    """
    new_aff = new_logits.float().softmax(-1)
    old_aff = old_logits.float().softmax(-1)
    target, case = rectify(old_aff, new_aff, targets, rnk_star, normalize)
    per_row = js_rows(target, new_logits.float())
    js = sum_over_global_rows(per_row) if reduction == "sum" else per_row.mean()
    return js, case


@register("dkr")
class DKR(PreviousModelMethod):
    """DKR: JS distillation of the old affinities rectified per row (keep / new-knowledge / label)."""

    defaults = {"lam": 1.0, "rnk_star": False, "normalize": False, "reduction": "mean"}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.check_choice("reduction", ("sum", "mean"))

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        if self.old is None:
            return terms
        ov, ow = self.old_features(batch)
        with torch.no_grad():
            old_scale = self.old.logit_scale()
        m = old_new_global_logits(
            out["image_features"], out["text_features"], ov, ow, out["logit_scale"], old_scale
        )
        a = self.args
        opts = (a["rnk_star"], a["normalize"], a["reduction"])
        js_i2t, c_i2t = dkr_js(m["i2t"], m["old_i2t"], m["targets"], *opts)
        js_t2i, c_t2i = dkr_js(m["t2i"], m["old_t2i"], m["targets"], *opts)
        terms["dkr_js"] = a["lam"] * (js_i2t + js_t2i)
        cases = torch.cat([c_i2t, c_t2i])
        for k, name in enumerate(("dkr_old_correct", "dkr_new_only", "dkr_neither")):
            ctx.metrics[name] = (cases == k).float().mean()  # a tensor: no host sync
        return terms
