"""AFC: adaptive feature consolidation (Kang, Park & Han, CVPR 2022), a DKR baseline (DKR §5
names it and gives no detail).

AFC weighs a feature distillation by each feature channel's importance for the loss, estimated
from its gradient (a Taylor bound on the loss change when the feature drifts). What is
implemented (our adaptation to contrastive VL): the "features" are the projected image and
text embeddings before normalisation (`image_raw`, `text_raw`, d channels each) instead of
pooled CNN maps; after each task (not the last) one pass over the task's training pairs
(global batches, training transform, eval mode) measures per channel

    I_c = mean over the task's items of (∂L_itc/∂f_c)²

(the gradient of the global-batch ITC, as one process would see it), normalised to mean 1
over the channels of a modality and merged across tasks as a running mean
(I ← t/(t+1)·I_old + 1/(t+1)·I_new, as EWC's Fisher here). On task t > 0::

    L_afc = ½ [Σ_c I^v_c · mean_i (f^v_ic − f'^v_ic)² + Σ_c I^w_c · mean_i (f^w_ic − f'^w_ic)²]

with f' the previous task's model (frozen). Total: base loss + λ·L_afc, λ = `weight` = 1.
AFC's class-balanced classifier part has no VL counterpart (no classes) and is left out.
Importance is state (safetensors, resumable). Logged: `itc`, `afc` (+ `mlm`).
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.device import to_device
from cvl.dist import all_reduce_mean, world_size
from cvl.losses import clip_loss
from cvl.methods.base import PreviousModelMethod, TaskContext, base_loss
from cvl.methods.registry import register
from cvl.methods.regularizers import is_last_task, note, task_batches
from cvl.train.accum import frozen_rows


def feature_importance(model: Any, batches, ctx: TaskContext) -> dict[str, torch.Tensor]:
    """Per-channel mean squared ITC gradient of the raw image / text embeddings (mean 1)."""
    from cvl.data.reader import sample_seed

    sums: dict[str, torch.Tensor] = {}
    n = torch.zeros(())
    was = model.training
    model.eval()
    for i, batch in enumerate(batches):
        ctx.generator = torch.Generator().manual_seed(sample_seed(0, ctx.task_index, 77, i))
        out = model(batch["image"], batch["text"])
        loss = clip_loss(out["image_features"], out["text_features"], out["logit_scale"])
        gi, gt = torch.autograd.grad(loss, [out["image_raw"], out["text_raw"]])
        for k, g in (("image", gi), ("text", gt)):
            g = g.detach().float() / world_size()  # the one-process gradient of the mean loss
            sq = all_reduce_mean((g**2).sum(0)) * world_size()
            sums[k] = sums.get(k, 0) + sq
        n += gi.shape[0] * world_size()
    model.train(was)
    model.zero_grad(set_to_none=True)
    out = {}
    for k, s in sums.items():
        imp = s / n
        out[k] = (imp / imp.mean().clamp(min=1e-20)).cpu()
    return out


def weighted_drift(new: torch.Tensor, old: torch.Tensor, imp: torch.Tensor) -> torch.Tensor:
    """Σ_c I_c · mean_i (new_ic − old_ic)² (rank mean over equal row counts = global mean).

    `imp` may live on the CPU (method state): it is moved without a host sync."""
    return (((new - old.detach()) ** 2).mean(0) * to_device(imp, new.device).to(new.dtype)).sum()


@register("afc")
class AFC(PreviousModelMethod):
    """AFC: importance-weighted (squared-gradient) distillation of the raw embeddings."""

    defaults = {"weight": 1.0}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.importance: dict[str, torch.Tensor] = {}
        self.merged = 0

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        if self.old is None or not self.importance:
            return terms
        with torch.no_grad():
            oi = frozen_rows(self.old.encode_image, batch["image"], normalize=False)
            ot = frozen_rows(self.old.encode_text, batch["text"], normalize=False)
        drift = weighted_drift(out["image_raw"], oi, self.importance["image"])
        drift = drift + weighted_drift(out["text_raw"], ot, self.importance["text"])
        terms["afc"] = self.args["weight"] * drift / 2
        return terms

    def after_task(self, ctx: TaskContext) -> None:
        if is_last_task(ctx):
            note(ctx, "afc", "last task: no importance pass (nothing left to protect it for)")
            return
        seed = int(getattr(ctx.config, "seed", 0))
        from cvl.data.reader import sample_seed

        batches = task_batches(ctx, ctx.task_entries, sample_seed(seed, ctx.task_index, 55))
        new = feature_importance(ctx.model, batches, ctx)
        t = self.merged
        if t == 0 or not self.importance:
            self.importance = new
        else:
            self.importance = {k: self.importance[k] * t / (t + 1) + new[k] / (t + 1) for k in new}
        self.merged = t + 1

    def state_dict(self) -> dict[str, Any]:
        return {"importance": dict(self.importance), "merged": self.merged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.importance = {k: v.clone() for k, v in (state.get("importance") or {}).items()}
        self.merged = int(state.get("merged", 0))
