"""Co2L: contrastive continual learning (Cha et al. 2021), as IncCLIP and DHA adapt it.

Two parts, both over the **global** batch of current-task and replayed items (the loop mixes
the buffer into the task's data; `--buffer ring|reservoir --buffer-size N` is required):

- **Asymmetric contrastive loss**: only current-task items are anchors; buffer items take part
  only as negatives ("the sample pairs in the buffer are only used as negative samples", DHA
  appendix B). For VL the positive of an image is its caption and vice versa (no labels)::

      L_asym = ½ mean_{i ∈ C} [CE(s·v_i·Wᵀ, i) + CE(s·w_i·Vᵀ, i)]

  with C the current-task rows and V, W all rows of the global batch (CLIP's scale s).
- **Instance-wise relation distillation** (IRD, Co2L Eq. 5–6): for every item i of the batch,
  the distribution over the *other* items j ≠ i of its similarity, from the previous task's
  model with τ_old = 0.01 and from the training model with τ_new = 0.2::

      p(i, j) = exp(z_i·z_j/τ) / Σ_{k≠i} exp(z_i·z_k/τ),   L_IRD = mean_i Σ_j −p_old(i,j)·log p_new(i,j)

  applied to the image embeddings and to the text embeddings (self-similarities within one
  representation, as Co2L's), averaged. The cross-entropy is reported as KL(p_old ‖ p_new)
  (the same gradient; 0 when the models agree).

Total on task t > 0: L_asym + λ·L_IRD, λ = 1 (Co2L's default); task 0: the base loss (no
buffer, no old model). Co2L's two augmented views per image (DHA: "two augmentations for input
images in each mini-batch") are not reproduced: one view, the loop's augmentation. A fusion
model adds its MLM loss. Logged: `itc`, `co2l_ird`, (`mlm`); metric `co2l_anchor_rows`.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.checks import POSITIVE_FLOAT
from cvl.dist import gather_no_grad, gather_with_grad
from cvl.losses import kl_rows, masked_clip_loss, off_diagonal_logits
from cvl.methods.base import PreviousModelMethod, TaskContext, mlm_term
from cvl.methods.registry import register


def ird(new: torch.Tensor, old: torch.Tensor, tau_new: float, tau_old: float) -> torch.Tensor:
    """KL(p_old ‖ p_new) of the off-diagonal self-similarity rows, mean over the global rows."""
    new_logits = off_diagonal_logits(new, gather_with_grad(new), tau_new)
    with torch.no_grad():
        old_logits = off_diagonal_logits(old, gather_no_grad(old), tau_old)
    return kl_rows(old_logits, new_logits)


@register("co2l")
class Co2L(PreviousModelMethod):
    """Co2L: asymmetric contrastive (buffer items negatives only) + relation distillation."""

    itc_only = True  # its own contrastive objective: no --base-loss class-ce
    defaults = {"weight": 1.0, "tau_old": 0.01, "tau_new": 0.2}
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {"tau_old": POSITIVE_FLOAT, "tau_new": POSITIVE_FLOAT}
    needs_buffer = True
    buffer_hint = "ring"

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        a = self.args
        v, w, s = out["image_features"], out["text_features"], out["logit_scale"]
        current = ~ctx.buffer.in_buffer(batch, v.device)
        terms = {"itc": masked_clip_loss(v, w, s, anchors=current)}
        if getattr(ctx.model, "has_fusion", False):
            terms["mlm"] = mlm_term(ctx.model, batch, out, ctx)[0]
        ctx.metrics["co2l_anchor_rows"] = current.float().mean()  # a tensor: no host sync
        if self.old is None:
            return terms
        ov, ow = self.old_features(batch)
        kd = ird(v, ov, a["tau_new"], a["tau_old"]) + ird(w, ow, a["tau_new"], a["tau_old"])
        terms["co2l_ird"] = a["weight"] * kd / 2
        return terms
