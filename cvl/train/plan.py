"""How many optimizer steps a task gets, and whether its batches can train the model at all.

One computation serves the check before a run starts (from the stream's counts: settings
that would leave a task without a single optimizer step, or a process without rows, are
refused before anything is written) and the loop itself (from the task's real size, which
can be smaller when bad samples are left out): a task then trains exactly the steps planned
here, and where that is zero, `task.json` and the console say so instead of "saved".

Batches follow `cvl.data.reader.global_batches`: an epoch of n items has max(1, n // B)
global batches of B = batch size × processes (the remainder is dropped; a task smaller than
B is one batch of n), each split into contiguous rank slices of ceil(b / processes) rows;
--grad-accum K consecutive batches make one optimizer step, and batches left over at the end
of an epoch (fewer than K) are not trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cvl.device import fork_rng
from cvl.errors import CvlError
from cvl.train.budgetspec import parse_budget, task_share

BN_MESSAGE = "Expected more than 1 value per channel"  # torch's BatchNorm batch-size error


@dataclass(frozen=True)
class TaskPlan:
    """The optimizer steps and batch shapes of one task of `items` training pairs."""

    items: int
    global_batch: int
    processes: int
    grad_accum: int
    batches_per_epoch: int
    steps: int  # optimizer steps of the whole task (after --max-steps-per-task)
    min_rows: int  # the fewest rows a process gets in one micro-batch (0: a process gets none)

    @property
    def steps_per_epoch(self) -> int:
        return self.batches_per_epoch // self.grad_accum

    @property
    def epochs(self) -> int:
        """Passes over the task's data its steps take (--epochs, or as many as
        --steps-per-task needs)."""
        per = self.steps_per_epoch
        return -(-self.steps // per) if per else 0

    @property
    def usable_batches(self) -> int:
        """Batches of an epoch that belong to a complete optimizer step."""
        return self.steps_per_epoch * self.grad_accum

    def why_no_step(self, cfg: Any) -> str | None:
        """Why the task takes no optimizer step (None when it takes some)."""
        if self.steps > 0:
            return None
        if self.items == 0:
            return "the task has no training pairs"
        n, b = self.items, self.global_batch
        batches = (
            f"{n} training pairs make {self.batches_per_epoch} global batch(es) of "
            f"{min(n, b)} per epoch (--batch-size {cfg.batch_size} × {self.processes} "
            "process(es))"
        )
        return f"{batches}, fewer than the --grad-accum {cfg.grad_accum} of one optimizer step"


def steps_of(batches: int, cfg: Any) -> int:
    """Optimizer steps of a task of `batches` global batches per epoch: epochs × complete
    accumulations, or --steps-per-task (as many epochs as they take), capped by
    --max-steps-per-task; 0 when an epoch cannot fill one step."""
    per = batches // cfg.grad_accum
    fixed = getattr(cfg, "steps_per_task", 0)
    steps = (fixed if fixed else per * cfg.epochs) if per else 0
    return min(steps, cfg.max_steps_per_task) if cfg.max_steps_per_task else steps


def plan_steps(items: int, cfg: Any, processes: int, batches: int | None = None) -> TaskPlan:
    """The plan of a task of `items` pairs under `cfg` (batch size, accumulation, epochs,
    step limit) with `processes` training processes; `batches`: the global batches of an
    epoch when a data mixture decides them (`cvl.data.mixture`), else items // batch."""
    gb = cfg.batch_size * processes
    if batches is None:
        batches = max(1, items // gb) if items > 0 else 0
    steps = steps_of(batches, cfg)
    rows = min(items, gb)
    per = math.ceil(rows / processes) if rows else 0
    min_rows = max(0, rows - per * (processes - 1)) if rows else 0
    return TaskPlan(items, gb, processes, cfg.grad_accum, batches, steps, min_rows)


def check_plan(plan: TaskPlan, task: str, cfg: Any, *, stop_on_zero_steps: bool) -> None:
    """One-line errors for a task whose batches leave a process without rows, or (when
    `stop_on_zero_steps`: before a run starts) that would take no optimizer step."""
    if plan.items and plan.min_rows == 0 and plan.steps:
        raise CvlError(
            f"task {task}: its {min(plan.items, plan.global_batch)}-pair batches split over "
            f"{plan.processes} processes leave a process without rows; launch fewer processes "
            "or use a larger --batch-size"
        )
    why = plan.why_no_step(cfg)
    if why and stop_on_zero_steps:
        fix = "; lower --grad-accum or --batch-size" if plan.items else ""
        raise CvlError(
            f"task {task}: no optimizer step would be taken: {why}{fix} (nothing was written)"
        )


def check_run(cfg: Any, manifest: Any, method: Any, processes: int) -> dict[str, TaskPlan]:
    """Before a run starts, from the stream's counts: refuse settings that leave a task
    without an optimizer step or a process without rows (`check_plan`). Checked are the
    tasks whose training size is known in advance: every task of a method that trains on
    the task's own pairs without a replay buffer, the first one with a buffer, a joint
    run's one task (none under a --mixture, whose batches the loop decides); the loop checks
    the others when it gets to them. Returns their plans."""
    if not getattr(method, "trains", True):
        return {}
    from cvl.methods.base import Method

    order = list(manifest.task_order)
    counts = [manifest.tasks[t].train.count for t in order]
    own = getattr(method, "inner", method)  # a wrapper trains on its base method's entries
    plain = type(own).task_entries is Method.task_entries
    plans = {}
    if getattr(method, "single_task", False):
        known = [(len(order) - 1, sum(counts))]
    else:
        known = [(i, counts[i]) for i in range(len(order)) if plain and (i == 0 or not cfg.buffer)]
    if getattr(cfg, "mixture", None):  # a mixture decides the batches: the loop checks them
        known = []
    for ti, n in known:
        plan = plan_steps(n, cfg, processes)
        check_plan(plan, order[ti], cfg, stop_on_zero_steps=True)
        plans[order[ti]] = plan
    _check_samples_budget(cfg, counts, order, method, processes)
    return plans


def _check_samples_budget(
    cfg: Any, counts: list[int], order: list[str], method: Any, processes: int
) -> None:
    """`--budget samples=N` is known before training: a task whose share is less than one
    optimizer step's samples would train a step it cannot pay for (the loop's minimum of one
    step), so the budget is refused. (tflops / maf are measured per task by the loop.)"""
    b = parse_budget(cfg.budget)
    if b is None or b.kind != "samples":
        return
    single = getattr(method, "single_task", False)
    indices = [len(order) - 1] if single else list(range(len(order)))
    trained = {i: counts[i] for i in indices}
    per_step = cfg.batch_size * processes * cfg.grad_accum
    for ti in indices:
        share = task_share(b, trained, ti, len(order), single)
        if share < per_step:
            raise CvlError(
                f"--budget {b.spec}: task {order[ti]}'s share, {share:.4g} samples, is less than "
                f"one optimizer step ({per_step} samples: --batch-size {cfg.batch_size} × "
                f"{processes} process(es) × --grad-accum {cfg.grad_accum}); raise the budget or "
                "lower the batch (nothing was written)"
            )


def batchnorm_message(task: str, rows: int) -> str:
    return (
        f"task {task}: a batch of {rows} pair(s) per process is too small for the model's "
        "BatchNorm layers in training mode (they need more than one value per channel): use a "
        "larger --batch-size or fewer processes, or a task with more pairs"
    )


def needs_two_rows(model: torch.nn.Module, device: torch.device) -> bool:
    """True when the model cannot train on a micro-batch of one row per process: a BatchNorm
    layer in training mode meets a 1×1 map (torch then refuses the batch). Found by one
    forward pass of a single blank pair; BatchNorm statistics and RNG are left as they were."""
    bns = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if not bns:
        return False
    saved = {id(m): [b.detach().clone() for b in m.buffers()] for m in bns}
    size = getattr(model, "image_size", 224)
    tokens = model.tokenizer(["a"]).to(device)
    try:
        with torch.no_grad(), fork_rng(device):
            model(torch.zeros(1, 3, size, size, device=device), tokens)
        return False
    except ValueError as e:
        if BN_MESSAGE in str(e):
            return True
        raise
    finally:
        with torch.no_grad():
            for m in bns:
                for b, s in zip(m.buffers(), saved[id(m)]):
                    b.copy_(s)
