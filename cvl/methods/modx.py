"""Mod-X: maintain the off-diagonal information matrix (Ni et al. 2023, §4.3; public code).

On each batch of the current task, the previous task's final model (old, frozen) and the
training model (new) build contrastive matrices over the **global** batch (Eq. 1, 2)::

    M_old[i, j] = v'_i · w'_j        M_new[i, j] = v_i · w_j        (cosines, features L2-normed)

Rows the old model mis-retrieves (argmax_j M_old[i, j] ≠ i) are replaced by the new model's
row (Eq. 3), so their distillation term is 0. Then (Eq. 4, 5)::

    L = InfoNCE + α · ½ [KL_i2t + KL_t2i],
    KL_d = Σ_i Σ_j P_old[i, j] · log(P_old[i, j] / P_new[i, j]),  P = row-softmax(M / τ)

for d = i2t (rows images) and t2i (rows texts, the transposed matrices, rows checked on their
own). Choices, where the paper, its code and METHODS.md differ or are silent:

- Reduction: Eq. 4 is a plain Σ over the whole matrix, i.e. per-row KLs **summed** over the
  rows (the public code: `F.kl_div(..., reduction="sum")`), while InfoNCE is the usual mean
  over rows; so the KL term grows with the batch (α = 20 was tuned at batch 280).
  `reduction=mean` gives the batch-size-free per-row mean instead. Under N processes the sum
  runs over the global batch (`cvl.losses.sum_over_global_rows`).
- Directions: Eq. 4 is written for one matrix; the public code applies it to the i2t and the
  t2i matrices and averages the two (as here).
- Temperature: the paper defines M by cosine similarity s(a, b) = aᵀb and puts no temperature
  in Eq. 4; the public code takes the softmax of the raw cosines. So τ = 1 by default
  (`tau`); with CLIP's learned 1/τ ≈ 14–100 the distributions would be far sharper.
- The replaced rows are the new row detached (the public code keeps the graph, but the KL of a
  row with itself is 0 and so is its gradient); the old model runs under `torch.no_grad()`.
- InfoNCE is the architecture's base loss (`itc`, CLIP's learned temperature; + MLM for
  the fusion model). On the first task there is no old model: base loss only.

Defaults: α = 20 (paper, Table 6), τ = 1, reduction = sum. Logged terms: `itc`, `modx_kl`
(already × α); metrics `modx_old_correct_i2t` / `_t2i`: share of rows the old model retrieves
correctly (the rows that are distilled).
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.errors import CvlError
from cvl.losses import kl_rows, old_new_global_logits, row_correct, sum_over_global_rows
from cvl.methods.base import PreviousModelMethod, TaskContext, base_loss
from cvl.methods.registry import register


def modx_kl(
    new_logits: torch.Tensor,
    old_logits: torch.Tensor,
    targets: torch.Tensor,
    tau: float = 1.0,
    reduction: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One direction of Mod-X's spatial alignment (Eq. 3, 4); returns (kl, old_correct).

    `new_logits` / `old_logits`: cosine matrices (rows = this rank's samples, columns = the
    global batch), `targets` each row's own column. Rows with argmax_j old ≠ target take the
    (detached) new row. kl = Σ_rows (or mean) KL(softmax(old/τ) ‖ softmax(new/τ)).
    """
    ok = row_correct(old_logits, targets)
    teacher = torch.where(ok[:, None], old_logits.detach(), new_logits.detach())
    per_row = kl_rows(teacher / tau, new_logits / tau, reduction="none").sum(-1)
    kl = sum_over_global_rows(per_row) if reduction == "sum" else per_row.mean()
    return kl, ok


@register("modx")
class ModX(PreviousModelMethod):
    """Mod-X: KL(old ‖ new) on the batch's contrastive matrices, mis-retrieved old rows replaced."""

    defaults = {"alpha": 20.0, "tau": 1.0, "reduction": "sum"}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if self.args["tau"] <= 0:
            raise CvlError(f"method 'modx': tau must be positive (got {self.args['tau']})")
        self.check_choice("reduction", ("sum", "mean"))

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        if self.old is None:
            return terms
        ov, ow = self.old_features(batch)
        m = old_new_global_logits(out["image_features"], out["text_features"], ov, ow)
        a = self.args
        kl_i2t, ok_i2t = modx_kl(m["i2t"], m["old_i2t"], m["targets"], a["tau"], a["reduction"])
        kl_t2i, ok_t2i = modx_kl(m["t2i"], m["old_t2i"], m["targets"], a["tau"], a["reduction"])
        terms["modx_kl"] = a["alpha"] * (kl_i2t + kl_t2i) / 2
        ctx.metrics["modx_old_correct_i2t"] = ok_i2t.float().mean()  # tensors: no host sync
        ctx.metrics["modx_old_correct_t2i"] = ok_t2i.float().mean()
        return terms
