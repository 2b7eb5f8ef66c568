"""Non-finite guards of `Trainer` (a mixin): a NaN/Inf loss stopped with its exact step and
sample ids (found at the next log line, before any checkpoint: nothing is read from the
device per step) or, within `--skip-nonfinite`, skipped (read before each update), weights
checked before every save, and the hints that go with them (lower the learning rate, how to
resume)."""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

from cvl.dist import world_size
from cvl.errors import CvlError
from cvl.io import read_json
from cvl.methods.base import TaskContext
from cvl.train.fsdp import is_dtensor, local
from cvl.train.logwindow import StepRecord
from cvl.train.rundir import LAST

# A task stops when more than this share of its optimizer steps (and more than one) were
# skipped for a non-finite loss, whatever --skip-nonfinite allows: it is no longer training.
MAX_SKIPPED_SHARE = 0.1


class NonFiniteGuards:
    """Stops (or, within `--skip-nonfinite`, skips) non-finite steps; checks weights."""

    def _step_finite(self, losses: list[torch.Tensor]) -> bool:
        """`--skip-nonfinite N` (N > 0) only: whether this step's losses (one per micro-batch,
        its backward already launched) are finite on every rank, read before the update so a
        bad step can be skipped. One host read per step (and, with several processes, one
        all_reduce of the flag, so all ranks take the same decision); without an allowance the
        loop reads nothing per step and `_nonfinite` runs at the next log line instead."""
        flag = torch.isfinite(torch.stack([x.detach().float() for x in losses])).all().float()
        if world_size() > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag)

    def _nonfinite(self, terms: dict[str, float], rec: StepRecord, ctx: TaskContext) -> None:
        """Count a step whose loss was NaN/Inf on some rank (`terms`: its values here, `rec`:
        its step, lr and sample ids); stop past the allowance, else say it was skipped.

        Past `--skip-nonfinite` the run stops with the term names, the step and the sample
        ids; last/ still holds the previous good checkpoint (checkpoints follow log lines, where
        the loop looks). A task also stops once more than `MAX_SKIPPED_SHARE` of its steps (and
        more than one) were skipped, whatever the allowance: a task that skips that many is no
        longer being trained.
        """
        bad = [k for k, v in terms.items() if not math.isfinite(v)]
        self.nonfinite_skipped = getattr(self, "nonfinite_skipped", 0) + 1
        vals = ", ".join(f"{k}={terms[k]:.4g}" for k in bad)
        where = f"task {ctx.task_name} (index {ctx.task_index}), step {rec.step}"
        ids = [str(i) for i in rec.ids]
        lr = self._lr_hint(rec.lr)
        if self.nonfinite_skipped > self.cfg.skip_nonfinite:
            raise CvlError(
                f"non-finite loss at {where}: {vals or 'on another rank'}; "
                f"sample ids (rank {self.acc.process_index}): {', '.join(ids[:32])}"
                + (" ..." if len(ids) > 32 else "")
                + f"; {lr}; {self._resume_hint(ctx)}: fix the data or the "
                "settings, or add --skip-nonfinite N"
            )
        n_task, limit = self._count_task_skip(ctx)
        if n_task > limit:
            raise CvlError(
                f"non-finite loss at {where}: {n_task} of the task's {ctx.steps_in_task} steps "
                f"skipped, more than {MAX_SKIPPED_SHARE:.0%} (at most {limit}): the task is not "
                f"training; {lr}; {self._resume_hint(ctx)}"
            )
        self.acc.print(
            f"warning: non-finite loss at {where} ({vals or 'on another rank'}): step skipped "
            f"({self.nonfinite_skipped} of --skip-nonfinite {self.cfg.skip_nonfinite})"
        )

    def _count_task_skip(self, ctx: TaskContext) -> tuple[int, int]:
        """Count one more skipped step of this task: (skipped so far, most allowed).

        Steps skipped before a resume come from the task's log (truncated to the resumed
        step); every rank reads it after the step's flag is reduced, so all decide alike."""
        c = getattr(self, "_skips", None)
        if c is None or c[0] != ctx.task_index:
            logged = 0
            if self._log_path.is_file():
                for ln in self._log_path.read_text().splitlines():
                    logged += json.loads(ln).get("nonfinite_skipped", 0) if ln else 0
            c = self._skips = [ctx.task_index, logged]
        c[1] += 1
        return c[1], max(1, int(MAX_SKIPPED_SHARE * ctx.steps_in_task))

    def _lr_hint(self, lr: float | None) -> str:
        now = f"lr {lr:.3g} at this step, " if lr is not None else ""
        return f"{now}--lr {self.cfg.lr:g}: a lower --lr or a --grad-clip often helps"

    def _resume_hint(self, ctx: TaskContext) -> str:
        """What a rerun of the same command starts from (nothing is promised that is not there)."""
        from cvl.runs import finished_tasks

        lp = self.out / LAST / "position.json"
        if lp.is_file():
            p = read_json(lp)
            if p.get("task_index") == ctx.task_index:
                return f"the run can resume from last/ (task {ctx.task_index}, step {p['step']})"
        done = [c for c in finished_tasks(self.out) if c.index < ctx.task_index]
        if done:
            return f"the run can resume from the end of task {done[-1].path.name}"
        return "no checkpoint yet: a rerun starts from the initial weights"

    def _check_weights(self, ctx: TaskContext) -> None:
        """Stop before a checkpoint holds NaN/Inf weights (at each checkpoint and task end:
        one finiteness flag per tensor, one host sync). Replicas are equal on every rank, so
        every rank stops alike without a collective."""
        params = list(self.model.named_parameters())
        if not params:
            return
        # (--fsdp: each process checks its shards, the flags are and-ed over processes)
        ok = torch.stack([torch.isfinite(local(p.detach())).all() for _, p in params])
        if any(is_dtensor(p) for _, p in params) and dist.get_world_size() > 1:
            ok = ok.to(torch.uint8)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if bool(ok.all()):
            return
        bad = [n for (n, _), good in zip(params, ok.tolist()) if not good]
        opt = getattr(self, "_opt", None)
        lr = opt.param_groups[0]["lr"] if opt is not None else None
        raise CvlError(
            f"non-finite weights at task {ctx.task_name} (index {ctx.task_index}), step "
            f"{ctx.step}: {len(bad)} tensor(s), e.g. {bad[0]}; not saved; {self._lr_hint(lr)}; "
            f"{self._resume_hint(ctx)}"
        )

    def _fault_counts(self) -> dict[str, int]:
        """Unreadable samples replaced and NaN/Inf steps skipped in this task (from its log)."""
        recs = []
        if self._log_path.is_file():
            recs = [json.loads(x) for x in self._log_path.read_text().splitlines() if x]
        return {
            "replaced_samples": sum(r.get("replaced_samples", 0) for r in recs),
            "nonfinite_skipped_steps": sum(r.get("nonfinite_skipped", 0) for r in recs),
        }
