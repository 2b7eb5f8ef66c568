"""JointT: the base loss on the union of all tasks (upper bound), or cumulatively per task;
with `restart=true`, TiC-CLIP's Oracle: every task retrained from the initial weights."""

from __future__ import annotations

from pathlib import Path

import torch

from cvl.data.index import Entries
from cvl.errors import CvlError
from cvl.methods.base import Method, TaskContext
from cvl.methods.registry import register


@register("joint")
class Joint(Method):
    """Joint training on the union of all tasks (upper bound); cumulative=true: tasks seen so far.

    Plain joint trains once, on every task's data, and writes one checkpoint (after the last
    task). With `cumulative=true` each task trains on the union of tasks 0..t, continuing from
    the previous checkpoint, and writes a checkpoint per task (TiC-CLIP's Cumulative-All, as
    `seqft --buffer cumulative-all`).

    `restart=true` (with `cumulative=true`) is TiC-CLIP's Oracle (Garg et al. 2024, §3): the
    model of step t is trained from the initial weights (`RUN/init/`) on everything up to t,
    with the compute of all steps so far (t × C: under `--budget ...` a task's share is the
    budget of tasks 0..t; the released TiC-DataComp Oracle trains 7 × 20,500 steps from
    scratch on 2014–2022). Every task warms up with `--warmup` (each starts from scratch; `--warmup-later` is not used).
    Plain joint under a per-task budget is the final Oracle alone (one checkpoint).
    """

    defaults = {"cumulative": False, "restart": False}

    def __init__(self, args: dict | None = None) -> None:
        super().__init__(args)
        if self.args["restart"] and not self.args["cumulative"]:
            raise CvlError(
                "method 'joint': restart=true needs cumulative=true (a model per task, each "
                "from the initial weights; plain joint already trains once from them)"
            )

    @classmethod
    def variant(cls, args: dict) -> str | None:
        """TiC-CLIP's names: the Oracle (restart), Cumulative-All (cumulative)."""
        if args.get("restart"):
            return "Oracle"
        return "cumulative" if args.get("cumulative") else None

    @property
    def single_task(self) -> bool:
        return not self.args["cumulative"]

    @property
    def restarts(self) -> bool:
        """Every task trains from the initial weights (the schedule: --warmup, not
        --warmup-later; the budget)."""
        return bool(self.args["restart"])

    #: under --budget, task t's share is the budget of tasks 0..t (the Oracle's t × C)
    budget_seen = restarts

    def before_task(self, ctx: TaskContext) -> None:
        if self.restarts and not ctx.first_task:  # also on resume: last/ is loaded after
            restore_initial(ctx)

    def own_entries(self, ctx: TaskContext) -> Entries:
        order = ctx.manifest.task_order
        seen = order if self.single_task else order[: ctx.task_index + 1]
        return Entries.concat(ctx.services.entries_of(t) for t in seen)

    def task_entries(self, ctx: TaskContext) -> Entries:
        return self.own_entries(ctx)  # no replay: the union already holds every task


@torch.no_grad()
def restore_initial(ctx: TaskContext) -> None:
    """The model back to the run's initial weights (`RUN/init/`): the weights `--tune` trains
    and every buffer, integer ones included (BatchNorm's batch counts)."""
    from safetensors.torch import load_file

    from cvl.methods.merging import load_initial, write_
    from cvl.runs import MODEL_FILE

    write_(ctx.model, load_initial(ctx))
    saved = load_file(str(Path(ctx.run_dir) / "init" / MODEL_FILE))
    for name, b in ctx.model.named_buffers():
        if not b.is_floating_point() and name in saved:
            b.copy_(saved[name])
