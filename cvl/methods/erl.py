"""ERL: exemplar relation loss (Dong et al., AAAI 2021, "Few-shot class-incremental learning
via relation knowledge distillation"), a DKR baseline (DKR §5 names it and gives no detail).

What is implemented (our adaptation to contrastive VL; Dong et al.'s graph is over class
exemplars, here the exemplars are the replayed pairs): the **exemplar relation graph** has the
buffer items of the global batch as nodes and their cosine similarities as edges, for the
image-image, text-text and image-text relations. The previous task's model (frozen) gives the
graph to keep, the training model the current one::

    L_erl = ⅓ Σ_{R ∈ {VVᵀ, WWᵀ, VWᵀ}} mean_{i,j ∈ E} (R_new[i, j] − R_old[i, j])²

over all ordered pairs (i, j) of exemplars E in the global batch (normalised embeddings; the
same-modal diagonals are 1 for both models and contribute 0). Total: base loss on the mixed
batch (current + replayed pairs, as ER) + λ·L_erl, λ = `weight` = 1 (our choice). Task 0:
base loss. Needs a buffer (`--buffer reservoir --buffer-size N`): the relations are among the
stored exemplars. Choices where the sources are silent: squared error of the edge weights
(not a KL over rows), the three relation types averaged. Logged: `itc`, `erl` (+ `mlm`).
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.dist import gather_no_grad, gather_with_grad
from cvl.losses import global_count, global_masked_mean
from cvl.methods.base import PreviousModelMethod, TaskContext, base_loss
from cvl.methods.registry import register


def relation_rows(
    x: torch.Tensor,
    y: torch.Tensor,
    old_x: torch.Tensor,
    old_y: torch.Tensor,
    exemplar: torch.Tensor,
) -> torch.Tensor:
    """Per row i (this rank's): Σ over the global batch's exemplar columns j of
    (x_i·y_j − x'_i·y'_j)² (`exemplar`: this rank's mask)."""
    cols = gather_no_grad(exemplar)
    new = x @ gather_with_grad(y).t()
    with torch.no_grad():
        old = old_x @ gather_no_grad(old_y).t()
    return ((new - old) ** 2 * cols[None, :].to(new.dtype)).sum(-1)


def relation_mse(
    x: torch.Tensor,
    y: torch.Tensor,
    old_x: torch.Tensor,
    old_y: torch.Tensor,
    exemplar: torch.Tensor,
) -> torch.Tensor:
    """mean over exemplar pairs (i, j) of (x_i·y_j − x'_i·y'_j)², i this rank's rows, j the
    global batch's; rows and columns restricted to `exemplar` (this rank's mask)."""
    n = global_count(exemplar)
    per_row = relation_rows(x, y, old_x, old_y, exemplar)
    return global_masked_mean(per_row, exemplar, n) / n.clamp(min=1.0)


@register("erl")
class ERL(PreviousModelMethod):
    """ERL: keep the old model's similarity graph among the replayed exemplars (squared error)."""

    defaults = {"weight": 1.0}
    needs_buffer = True

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        if self.old is None:
            return terms
        v, w = out["image_features"], out["text_features"]
        ex = ctx.buffer.in_buffer(batch, v.device)
        ov, ow = self.old_features(batch)
        # the three relations' rows summed first: one exemplar count (one all_reduce) per step
        rows = relation_rows(v, v, ov, ov, ex) + relation_rows(w, w, ow, ow, ex)
        rows = rows + relation_rows(v, w, ov, ow, ex)
        n = global_count(ex)
        rel = global_masked_mean(rows, ex, n) / n.clamp(min=1.0)
        terms["erl"] = self.args["weight"] * rel / 3
        ctx.metrics["erl_exemplar_rows"] = ex.float().mean()  # a tensor: no host sync
        return terms
