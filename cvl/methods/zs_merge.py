"""Zero-shot merge (FoMo-in-Flux's "ZeroShot-merge", Roth et al. 2024): after every task the
deployed weights interpolate the task's fine-tuned weights with the run's initial (zero-shot,
pre-trained) weights θ_0,

    θ_t = α·θ̂_t + (1 − α)·θ_0,

α = `alpha` = 0.5 (WiSE-FT's mixing coefficient, Wortsman et al. 2022, whose zero-shot /
fine-tuned interpolation this applies at every task). By default (`init=merged`) task t+1
trains from θ_t; `init=finetuned` continues from θ̂_t (the deployed model is then WiSE-FT of
sequential fine-tuning), `init=base` restarts every task from θ_0. FoMo-in-Flux's code is not
public (its repository holds a placeholder README). Wraps a base method (`base=NAME`, default
seqft), see `cvl.methods.merging`.
"""

from __future__ import annotations

from typing import Any

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.ft_merge import lerp
from cvl.methods.merging import MergeMethod, Weights
from cvl.methods.registry import register


@register("zs_merge")
class ZeroShotMerge(MergeMethod):
    """Zero-shot merge: after each task θ_t = α·θ̂_t + (1−α)·θ_0 (FoMo-in-Flux; wraps a method)."""

    defaults = {"base": "seqft", "alpha": 0.5, "init": "merged"}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if not 0.0 <= self.args["alpha"] <= 1.0:
            raise CvlError(f"method 'zs_merge': alpha must be in [0, 1] (got {self.args['alpha']})")

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        return lerp(tuned, self.initial(ctx), self.args["alpha"])
