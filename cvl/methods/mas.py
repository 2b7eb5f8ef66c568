"""MAS: memory aware synapses (Aljundi et al. 2018; CTP appendix B.1; CTP code).

Unsupervised importance: after task t, over all of the task's training pairs in global batches
(`regularizers.importance_pass`, model in eval mode),

    Ω_t = mean over batches b of |∂ f(b) / ∂θ|,
    f(b) = mean_i ‖v_i‖ + mean_i ‖w_i‖ (+ mean_i ‖h_i‖ with `fusion`)

with v, w the *unnormalised* projected image / text features (`image_raw`, `text_raw`) and h the
fusion encoder's [CLS] state — the CTP code's "sum of the norms of the visual, textual and
multi-modal features" (unsquared L2 norms, batch means; the MAS paper squares them). Merged like
EWC: Ω ← t/(t+1)·Ω + 1/(t+1)·Ω_t. Loss on task t > 0: L_base + λ/2·ΣΩ(θ−θ*)², λ = `lam` = 1
(CTP code). Skipped after the last task. Logged term: `mas`.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.checks import NON_NEGATIVE_INT
from cvl.data.reader import sample_seed
from cvl.methods.base import TaskContext
from cvl.methods.registry import register
from cvl.methods.regularizers import (
    ParamRegularizer,
    importance_pass,
    is_last_task,
    merge_running_mean,
    note,
    task_batches,
)


def mas_objective(model: Any, batch: dict, ctx: TaskContext) -> torch.Tensor:
    """f(b): batch means of the unnormalised feature norms (+ the fusion [CLS] norm)."""
    out = model(batch["image"], batch["text"])
    f = out["image_raw"].norm(dim=-1).mean() + out["text_raw"].norm(dim=-1).mean()
    if getattr(model, "has_fusion", False):
        cls = model.fusion_cls(out["image_embeds"], batch["text"], out.get("image_atts"))
        f = f + cls.norm(dim=-1).mean()
    return f


@register("mas")
class MAS(ParamRegularizer):
    """MAS: λ/2·ΣΩ(θ−θ*)², Ω = mean |∂(‖v‖+‖w‖+‖fusion CLS‖)/∂θ| over the task (λ = 1)."""

    defaults = {"lam": 1.0, "importance_batches": 0}
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {"importance_batches": NON_NEGATIVE_INT}
    term = "mas"
    persistent = ("omega",)

    def anchors(self):
        om = self.get("omega")
        if om is None or self.star is None:
            return []
        return [(self.star, om, self.args["lam"] / 2, False)]

    def after_task(self, ctx: TaskContext) -> None:
        if is_last_task(ctx):
            note(ctx, self.name, "last task: no importance pass (nothing left to protect it for)")
        else:
            seed = sample_seed(int(ctx.config.seed), ctx.task_index, 4343)
            new = importance_pass(
                ctx.model,
                task_batches(ctx, ctx.task_entries, seed),
                mas_objective,
                ctx,
                square=False,
                max_batches=int(self.args["importance_batches"]),
            )
            self.lists["omega"] = merge_running_mean(self.get("omega"), new, ctx.task_index)
            self.counters["omega_tasks"] = ctx.task_index + 1
        self.end_task()
