"""Per-step EMA of the weights (momentum weight interpolation, Stojanovski et al. 2022,
"Momentum-based weight interpolation of strong zero-shot models for continual learning"): a
running exponential average of the weights, updated after every optimizer step of every task
and carried across tasks,

    θ̄ ← d·θ̄ + (1 − d)·θ      (after each step; θ̄ starts as θ_0 on the first task),

and after each task the deployed weights are θ_t = θ̄. By default (`init=finetuned`) training
continues from the fine-tuned weights θ̂_t (the fast model), so θ̄ averages the whole
trajectory of sequential fine-tuning, within and across tasks; `init=merged` restarts each
task from θ̄ (then θ̄ and the model coincide at every task start). d = `decay` = 0.999 per
step, the usual weight-EMA value, to be set for the number of steps per task (θ̄ keeps d^n
of its value over n steps: 0.999^300 ≈ 0.74). The average is kept on the model's device (one
extra copy of the trained weights). This was cvl's `ema_merge` before it followed
FoMo-in-Flux's EMA-merge (one ½/½ merge per task end, `ema_merge`). Wraps a base method
(`base=NAME`, default seqft), see `cvl.methods.merging`.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.merging import MergeMethod, Weights, clone_weights, floating_state
from cvl.methods.registry import register


@torch.no_grad()
def ema_update_(avg: Weights, weights: Weights, decay: float) -> None:
    """avg ← d·avg + (1 − d)·weights, in place (fused over the tensors)."""
    keys = list(avg)
    torch._foreach_lerp_([avg[k] for k in keys], [weights[k] for k in keys], 1.0 - decay)


@register("ema_step")
class EMAStep(MergeMethod):
    """Per-step EMA: θ̄ ← d·θ̄ + (1−d)·θ every step across tasks, deployed after each task."""

    defaults = {"base": "seqft", "decay": 0.999, "init": "finetuned"}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if not 0.0 <= self.args["decay"] < 1.0:
            raise CvlError(
                f"method '{self.name}': decay must be in [0, 1) (got {self.args['decay']})"
            )
        self.avg: Weights | None = None

    def before_task(self, ctx: TaskContext) -> None:
        super().before_task(ctx)
        if self.avg is None:  # the first task: θ̄ = θ_0 (on resume, the saved θ̄ replaces it)
            self.avg = clone_weights(self.start)
        else:
            self.avg = clone_weights(self.avg, next(iter(self.start.values())).device)

    def after_step(self, ctx: TaskContext) -> None:
        super().after_step(ctx)
        ema_update_(self.avg, floating_state(ctx.model), self.args["decay"])

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        return self.avg

    def merge_state(self) -> dict[str, Any]:
        return {"ema": dict(self.avg)} if self.avg is not None else {}

    def load_merge_state(self, state: dict[str, Any]) -> None:
        if "ema" not in state:
            return
        if self.avg is None:
            self.avg = dict(state["ema"])
        else:  # inside a task: into the live average (its device)
            with torch.no_grad():
                for k, v in state["ema"].items():
                    self.avg[k].copy_(v)
