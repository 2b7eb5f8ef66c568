"""Task arithmetic (Ilharco et al., ICLR 2023, "Editing models with task arithmetic"): the
deployed model adds the scaled sum of the task vectors to the pre-trained weights,

    θ_t = θ_0 + λ·Σ_{i≤t} τ_i,      τ_i = θ̂_i − start_i.

By default (`init=base`) every task trains from θ_0, so τ_i = θ̂_i − θ_0 is the paper's task
vector (each task model fine-tuned from the pre-trained one) and θ_t adds those of the tasks
seen so far. `init=merged` trains task t from θ_{t−1} and τ_t is the task's own update (then
θ_t = θ_{t−1} + λ·τ_t). λ = `lam` = 0.4: the paper picks λ on held-out validation data (0 to 1
in steps of 0.05); 0.4 is the task-arithmetic example value of the TIES-Merging authors'
code (prateeky2806/ties-merging, `ties_minimal.ipynb`). Only the
running sum Σ τ_i is kept (one copy of the trained weights, CPU in the checkpoint). Wraps a
base method (`base=NAME`, default seqft), see `cvl.methods.merging`. `lines=true` scales Σ τ_i
per layer by LiNeS in place of λ (`lines_alpha`, `lines_beta`; `cvl.methods.merging.TaskVectorMerge`).
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.methods.base import TaskContext
from cvl.methods.merging import LINES, TaskVectorMerge, Weights, clone_weights
from cvl.methods.registry import register


@register("task_arith")
class TaskArithmetic(TaskVectorMerge):
    """Task arithmetic: θ_t = θ_0 + λ·Σ τ_i, each task trained from θ_0 (Ilharco et al. 2023)."""

    defaults = {"base": "seqft", "lam": 0.4, "init": "base", **LINES}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.tau_sum: Weights | None = None

    def vector(self, ctx: TaskContext, tuned: Weights) -> Weights:
        """The task's vector as summed (`dare`: dropped; `breadcrumbs`: masked)."""
        return self.task_vector(tuned)

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        tau = self.vector(ctx, tuned)
        if self.tau_sum is None:
            self.tau_sum = tau
        else:
            with torch.no_grad():
                for k, v in tau.items():
                    self.tau_sum[k] = self.tau_sum[k].to(v.device) + v
        return self.apply(self.initial(ctx), self.tau_sum)

    def merge_state(self) -> dict[str, Any]:
        return {"tau_sum": dict(self.tau_sum)} if self.tau_sum is not None else {}

    def load_merge_state(self, state: dict[str, Any]) -> None:
        if "tau_sum" in state:
            self.tau_sum = clone_weights(state["tau_sum"])
