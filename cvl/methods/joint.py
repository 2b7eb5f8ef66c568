"""JointT: the base loss on the union of all tasks (upper bound), or cumulatively per task."""

from __future__ import annotations

from cvl.methods.base import Method, TaskContext
from cvl.methods.registry import register


@register("joint")
class Joint(Method):
    """Joint training on the union of all tasks (upper bound); cumulative=true: tasks seen so far.

    Plain joint trains once, on every task's data, and writes one checkpoint (after the last
    task). With `cumulative=true` each task trains on the union of tasks 0..t, continuing from
    the previous checkpoint, and writes a checkpoint per task.
    """

    defaults = {"cumulative": False}

    @property
    def single_task(self) -> bool:
        return not self.args["cumulative"]

    def own_entries(self, ctx: TaskContext) -> list:
        order = ctx.manifest.task_order
        seen = order if self.single_task else order[: ctx.task_index + 1]
        return [e for t in seen for e in ctx.services.entries_of(t)]

    def task_entries(self, ctx: TaskContext) -> list:
        return self.own_entries(ctx)  # no replay: the union already holds every task
