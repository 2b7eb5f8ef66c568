"""Fine-tuned merge (FoMo-in-Flux's "Finetune-merge", Roth et al. 2024): after each task the
deployed weights interpolate the task's fine-tuned weights with the weights it started from,

    θ_t = α·θ̂_t + (1 − α)·start_t,

α = `alpha` = 0.5 (WiSE-FT's mixing coefficient, Wortsman et al. 2022, which FoMo-in-Flux's
merges follow). By default (`init=finetuned`) training continues from the fine-tuned weights:
start_t = θ̂_{t−1}, so θ_t merges consecutive fine-tuned models and the sequence of fine-tuned
models is plain sequential fine-tuning; `init=merged` trains from the deployed θ_{t−1}, which
is `wise`. The first task is kept as trained unless `first_task=true` (then θ_0 + α·τ_0).
FoMo-in-Flux's code is not public (its repository holds a placeholder README): the reading
of "previous weights" as the previous fine-tuned model is ours. Wraps a base method
(`base=NAME`, default seqft), see `cvl.methods.merging`.
"""

from __future__ import annotations

from typing import Any

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.merging import MergeMethod, Weights
from cvl.methods.registry import register


def lerp(a: Weights, b: Weights, alpha: float) -> Weights:
    """α·a + (1 − α)·b, by name."""
    return {k: v * alpha + b[k].to(v.device, v.dtype) * (1.0 - alpha) for k, v in a.items()}


@register("ft_merge")
class FinetuneMerge(MergeMethod):
    """Fine-tuned merge: θ_t = α·θ̂_t + (1−α)·θ̂_{t−1}, training continues from θ̂_t (FoMo-in-Flux)."""

    defaults = {"base": "seqft", "alpha": 0.5, "init": "finetuned", "first_task": False}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if not 0.0 <= self.args["alpha"] <= 1.0:
            raise CvlError(
                f"method '{self.name}': alpha must be in [0, 1] (got {self.args['alpha']})"
            )
        self.merge_first_task = bool(self.args["first_task"])

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        return lerp(tuned, self.start, self.args["alpha"])
