"""EWC: elastic weight consolidation (Kirkpatrick et al. 2017; CTP appendix B.1, Eq. 12; CTP code).

After task t, the diagonal empirical Fisher of the base loss (ITC over the global batch, + MLM
for `fusion`) at the task's final weights, over all of the task's training pairs in global
batches (`cvl.methods.regularizers.importance_pass`):

    F_t = mean over batches b of (∂L_base(b)/∂θ)²        (the batch gradient, squared)
    F  ← t/(t+1)·F + 1/(t+1)·F_t                          (running mean over tasks, CTP code)

and θ* = the weights at the end of the previous task. Loss on task t > 0 (Eq. 12):

    L = L_base + λ/2 · Σ_k F_k (θ_k − θ*_k)²,    λ = `lam` = 5000 (CTP code)

Trainable parameters only; the penalty and its analytic gradient λF(θ−θ*) are one fused pass
(see `regularizers`). Task 0 trains with the base loss only (no F yet). The pass is skipped
after the last task. `fisher_batches` > 0 caps the pass (0 = the whole task, as the code).
Logged term: `ewc` (already × λ/2).
"""

from __future__ import annotations

from cvl.checks import NON_NEGATIVE_INT
from cvl.data.reader import sample_seed
from cvl.methods.base import TaskContext
from cvl.methods.registry import register
from cvl.methods.regularizers import (
    ParamRegularizer,
    fisher_objective,
    importance_pass,
    is_last_task,
    merge_running_mean,
    note,
    task_batches,
)


def task_fisher(ctx: TaskContext, model=None, max_batches: int = 0) -> list:
    """The Fisher of the base loss over the current task's training pairs (see module doc)."""
    seed = sample_seed(int(ctx.config.seed), ctx.task_index, 4242)
    batches = task_batches(ctx, ctx.task_entries, seed)
    return importance_pass(
        model if model is not None else ctx.model,
        batches,
        fisher_objective,
        ctx,
        square=True,
        max_batches=max_batches,
    )


@register("ewc")
class EWC(ParamRegularizer):
    """EWC: λ/2·ΣF(θ−θ*)², F = Fisher of the base loss, running mean over tasks (λ = 5000)."""

    defaults = {"lam": 5000.0, "fisher_batches": 0}
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {"fisher_batches": NON_NEGATIVE_INT}
    term = "ewc"
    persistent = ("fisher",)

    def anchors(self):
        f = self.get("fisher")
        if f is None or self.star is None:
            return []
        return [(self.star, f, self.args["lam"] / 2, False)]

    def after_task(self, ctx: TaskContext) -> None:
        if is_last_task(ctx):
            note(ctx, self.name, "last task: no Fisher pass (nothing left to protect it for)")
        else:
            new = task_fisher(ctx, max_batches=int(self.args["fisher_batches"]))
            self.lists["fisher"] = merge_running_mean(self.get("fisher"), new, ctx.task_index)
            self.counters["fisher_tasks"] = ctx.task_index + 1
        self.end_task()
