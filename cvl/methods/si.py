"""SI: synaptic intelligence (Zenke et al. 2017; CTP appendix B.1; CTP code).

Along task t's training path, per optimizer step (`regularizers`, `track_path`):

    ω ← ω − g·Δθ        g = gradient of the base loss alone (no penalty), averaged over ranks,
                        before clipping; Δθ = the step's actual parameter change

(ω starts at 0 on every task). At the end of the task, with Δθ_task = θ_end − θ_start:

    Ω ← Ω + ω / (Δθ_task² + ξ),     ξ = `xi` = 0.1 (CTP code)

Loss on task t > 0: L_base + c · Σ_k Ω_k (θ_k − θ*_k)², c = `c` = 1 (CTP code: no ½), θ* = the
previous task's final weights (= θ_start). Ω is not clipped at 0 (as the code); the penalty sum
is taken with signs. The CTP code gets g from a second forward/backward without the penalty;
here the penalty's gradient 2cΩ(θ−θ*) is analytic and added after g is read, so one forward
and one backward per step suffice (same g). Task 0 accumulates Ω and trains with the base
loss. Logged term: `si`.
"""

from __future__ import annotations

import torch

from cvl.checks import POSITIVE_FLOAT
from cvl.methods.base import TaskContext
from cvl.methods.registry import register
from cvl.methods.regularizers import ParamRegularizer


@torch.no_grad()
def si_consolidate(omega: list | None, w: list, start: list, end: list, xi: float) -> list:
    """Ω + ω/((θ_end − θ_start)² + ξ), fused; returns the new Ω list (in place if given)."""
    d = torch._foreach_sub(end, start)
    torch._foreach_mul_(d, d)
    torch._foreach_add_(d, xi)
    add = torch._foreach_div(w, d)
    if omega is None:
        return add
    torch._foreach_add_(omega, add)
    return omega


@register("si")
class SI(ParamRegularizer):
    """SI: c·ΣΩ(θ−θ*)², Ω += ω/(Δθ²+ξ), ω = −Σ g·Δθ with the unregularised gradient (c = 1)."""

    defaults = {"c": 1.0, "xi": 0.1}
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {"xi": POSITIVE_FLOAT}
    term = "si"
    track_path = True
    persistent = ("omega",)
    in_task = ("w",)

    def anchors(self):
        om = self.get("omega")
        if om is None or self.star is None:
            return []
        return [(self.star, om, self.args["c"], True)]

    def after_task(self, ctx: TaskContext) -> None:
        end = [p.detach() for p in self.params(ctx)]
        self.lists["omega"] = si_consolidate(
            self.get("omega"), self.lists["w"], self.star, end, self.args["xi"]
        )
        self.counters["omega_tasks"] = ctx.task_index + 1
        self.end_task()
