"""`cvl train --budget SPEC`: train every method to the same compute budget.

SPEC is `samples=N`, `tflops=N` or `maf=N`, for the whole stream, or with `/task` appended
(`tflops=2/task`) for each task:

- `samples=N`: training samples (replayed ones included), N / (global batch × grad_accum)
  steps; no measurement needed.
- `tflops=N`: 10^12 FLOPs of training steps; each task's steps = its budget / the FLOPs of one
  of its steps (forward, backward and the method's extra passes, summed over processes).
- `maf=N`: memory-adjusted FLOPs (FoMo-in-Flux, Roth et al. 2024: MAF = FLOPs per step × peak
  memory / full fine-tuning's peak memory), in the same 10^12 unit, so `maf=N` is `tflops=N`
  for a method that needs seqft's memory. Full fine-tuning = a seqft-style reference step on
  the same model and batch (base loss, forward + backward, no update; `reference_step`).
  Peak memory is that of forward + backward plus the optimizer's two moments per trainable
  parameter (AdamW, LAMB; allocated at the first update, so added rather than measured).
  On the CPU memory is the process's resident set, which libraries dominate for small models
  and which varies from run to run: `maf` is meant for GPUs.

A stream budget is shared by the trained tasks in proportion to their training pairs (the
stream's counts); a joint run (one task on everything) gets all of it, or N × tasks with
`/task`. Each task's steps = floor(its budget / cost per step), at least one; `--epochs` (and
`--max-steps-per-task`) stay an upper bound: a budget beyond them trains that many steps, says
so and records the unspent part (raise `--epochs` to spend it). The learning-rate schedule
spans the derived steps.

What is budgeted is the training steps. Per-task extras (Fisher / importance passes, buffer
selection, AFEC's expanded model, validation) are measured and reported (task.json "cost",
the comparison's total TFLOPs), not charged: they are known only after they run.

The cost of a step is measured before the task trains, by a probe (`probe_step`): one real
optimizer step of the method on the task's first batch, with a throwaway optimizer, counted,
then undone — weights restored, `before_task` rerun and the method and buffer state reloaded
from an in-memory copy, as a resume from a checkpoint does — so the task then trains exactly
as it would have. The derived steps and the measured costs go to task.json "budget" and to
every mid-task checkpoint: a resumed task keeps them (never measured again).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from cvl.dist import average_gradients
from cvl.errors import CvlError
from cvl.train.cost import (
    GIGA,
    TERA,
    optimizer_state_bytes,
    peak_memory,
    reduce_values,
    reset_peak_memory,
)

KINDS = ("samples", "tflops", "maf")
_SPEC = re.compile(r"^(samples|tflops|maf)=([0-9.eE+-]+)(/task)?$")


@dataclass(frozen=True)
class Budget:
    """A parsed `--budget` value."""

    kind: str  # samples | tflops | maf
    amount: float
    per_task: bool
    spec: str

    @property
    def unit(self) -> str:
        return {"samples": "samples", "tflops": "TFLOPs", "maf": "MAF (memory-adjusted TFLOPs)"}[
            self.kind
        ]


def parse_budget(spec: str | None) -> Budget | None:
    """`samples=N`, `tflops=N`, `maf=N`, each optionally `/task`; None for no budget."""
    if spec is None or str(spec).strip() == "":
        return None
    s = str(spec).strip().replace(" ", "")
    m = _SPEC.match(s)
    amount = None
    if m:
        try:
            amount = float(m.group(2))
        except ValueError:
            amount = None
    if m is None or amount is None or not math.isfinite(amount) or amount <= 0:
        raise CvlError(
            f"--budget {spec!r}: expected samples=N, tflops=N or maf=N with N > 0, for the "
            "whole stream, or with /task for each task (e.g. tflops=2.5 or samples=20000/task)"
        )
    return Budget(m.group(1), amount, bool(m.group(3)), s)


def task_share(
    b: Budget, counts: dict[int, int], ti: int, n_tasks: int, single_task: bool
) -> float:
    """Task `ti`'s part of the budget (in the spec's unit). `counts`: training pairs of the
    trained tasks, by index."""
    if b.per_task:
        return b.amount * (n_tasks if single_task else 1)
    total = sum(counts.values())
    return b.amount * counts[ti] / total if total else 0.0


def derive_steps(share: float, per_step: float, upper: int) -> tuple[int, int]:
    """(steps the budget buys (at least 1), steps to train (≤ `upper`))."""
    n = max(1, math.floor(share / per_step * (1 + 1e-9))) if per_step > 0 else upper
    return n, min(n, upper)


# -- measurements ----------------------------------------------------------------------------
def _fork_rng(device: torch.device):  # noqa: ANN202
    """Torch's RNG states (the CPU's and, on CUDA, this device's) restored on exit."""
    if device.type != "cuda":
        return torch.random.fork_rng(devices=[])
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.random.fork_rng(devices=[idx])


def _first_batches(trainer: Any, ctx: Any, ds: Any, gb: int) -> list[dict]:
    """This rank's micro-batches of the task's first optimizer step (epoch 0)."""
    from cvl.data.augment import device_images
    from cvl.data.reader import global_batches, make_loader, sample_seed

    cfg, acc = trainer.cfg, trainer.acc
    bs = global_batches(len(ds), gb, sample_seed(cfg.seed, ctx.task_index), 0)[: cfg.grad_accum]
    batches = list(make_loader(ds, bs, acc.process_index, acc.num_processes, 0))
    for b in batches:  # images finished on the device once (the split transform's batched part)
        b["image"] = device_images(b, ds.transform, acc.device)
    return batches


def _global(x: float, op: str, device: torch.device) -> float:
    """`x` summed (op "sum") or maximised ("max") over the processes."""
    return reduce_values([float(x)], op, device)[0]


def reference_step(trainer: Any, ctx: Any, batch: dict) -> dict[str, float]:
    """FLOPs and memory of a seqft-style step on the current model and `batch`: the base
    loss's forward and backward, no update. Leaves weights, buffers (BatchNorm statistics),
    gradients and RNG streams as they were."""
    from cvl.methods.base import base_loss
    from cvl.train.cost import FlopMeter

    model, acc, dev = trainer.model, trainer.acc, trainer.acc.device
    model.train()  # as a training step (BatchNorm statistics restored below)
    bufs = {n: b.detach().clone() for n, b in model.named_buffers()}
    params = [p for p in model.parameters() if p.requires_grad]
    meter = FlopMeter()
    gen = ctx.generator
    with _fork_rng(dev):
        ctx.generator = torch.Generator().manual_seed(0)
        trainer.cost.keep_peak()
        reset_peak_memory(dev)
        with meter.counting("ref"):
            img, txt = batch["image"].to(dev), batch["text"].to(dev)
            with acc.autocast():
                out = model(img, txt)
                loss = sum(base_loss(model, batch, out, ctx).values())
            loss.backward()
        peak = peak_memory(dev)
    ctx.generator = gen
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(bufs[n])
    for p in params:
        p.grad = None
    return {
        "flops": _global(meter.counts.get("ref", 0), "sum", dev),
        "memory": _global(peak + optimizer_state_bytes(params), "max", dev),
    }


def probe_step(trainer: Any, ctx: Any, batches: list[dict]) -> dict[str, float]:
    """FLOPs (summed over processes) and memory of one optimizer step of the method, run and
    undone (module doc). Uses the eager model also with `--compile`."""
    from cvl.data.reader import sample_seed
    from cvl.train.checkpoint import state_copy
    from cvl.train.optim import optimizer_with_schedule, seed_torch

    cfg, acc, dev = trainer.cfg, trainer.acc, trainer.acc.device
    model, method, tracker = trainer.model, trainer.method, trainer.cost
    model.train()  # as the task's steps will run
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    state = state_copy(trainer._method_state(ctx))
    saved = (ctx.step, ctx.global_step, ctx.epoch, ctx.generator, ctx.resuming)
    params = trainer._params()
    opt, _ = optimizer_with_schedule(params, cfg, max(1, ctx.steps_in_task), ctx.task_name)
    tracker.probing = ctx.probing = True
    try:
        with _fork_rng(dev):
            tracker.keep_peak()
            reset_peak_memory(dev)
            tracker.meter.push("probe")
            try:
                for micro, batch in enumerate(batches):
                    if micro == 0:
                        ti = ctx.task_index
                        seed_torch(sample_seed(cfg.seed, ti, 0, 0, acc.process_index), dev)
                        ctx.generator = torch.Generator().manual_seed(
                            sample_seed(cfg.seed, ti, 0, 0)
                        )
                        method.before_step(ctx)
                    _, loss = trainer._micro(batch, ctx, model)
                    (loss / len(batches)).backward()
                peak = peak_memory(dev)
                trainer._update(ctx, opt, params, torch.nn.utils.clip_grad_norm_, average_gradients)
                opt.zero_grad(set_to_none=True)
                ctx.step += 1
                method.after_step(ctx)
            finally:
                tracker.meter.pop()
        flops = tracker.meter.counts.pop("probe", 0)
        # undo: what a resume from a checkpoint taken before the step would restore
        del opt
        model.load_state_dict(weights)
        for p in params:
            p.grad = None
        ctx.step, ctx.global_step, ctx.epoch, ctx.generator = saved[:4]
        ctx.metrics = {}
        ctx.resuming = True
        method.before_task(ctx)
        trainer._restore_method_state(state, ctx)
    finally:
        ctx.resuming = saved[4]
        tracker.probing = ctx.probing = False
    return {
        "flops": _global(flops, "sum", dev),
        "memory": _global(peak + optimizer_state_bytes(params), "max", dev),
    }


def plan_task(
    trainer: Any, ctx: Any, ds: Any, gb: int, upper: int, pos: dict | None
) -> tuple[int, dict[str, Any]]:
    """(steps to train, task.json's "budget") for task `ctx.task_index` under `--budget`;
    from the mid-task checkpoint when resuming, else measured now."""
    b = trainer.budget
    if pos is not None and pos.get("budget"):
        rec = pos["budget"]
        if trainer.cost.enabled and rec.get("flops_per_step") is not None:
            trainer.cost.set_step(rec["flops_per_step"], rec.get("step_counted_on", "probe"))
        return int(rec["steps_trained"]), rec
    cfg, acc = trainer.cfg, trainer.acc
    counts = {i: trainer.manifest.tasks[trainer.order[i]].train.count for i in trainer.indices}
    single = getattr(trainer.method, "single_task", False)
    share = task_share(b, counts, ctx.task_index, len(trainer.order), single)
    rec: dict[str, Any] = {"spec": b.spec, "kind": b.kind, "per_task": b.per_task}
    rec["share"] = share
    samples_per_step = gb * cfg.grad_accum
    if b.kind == "samples":
        per_step = float(samples_per_step)
    else:
        batches = _first_batches(trainer, ctx, ds, gb)
        ref = reference_step(trainer, ctx, batches[0]) if b.kind == "maf" else None
        probe = probe_step(trainer, ctx, batches)
        rec["flops_per_step"] = int(probe["flops"])
        rec["step_counted_on"] = "probe"
        trainer.cost.set_step(rec["flops_per_step"], "probe")
        per_step = probe["flops"] / TERA
        if ref is not None:
            ratio = probe["memory"] / max(ref["memory"], 1.0)
            rec["reference"] = {
                "flops_per_step": int(ref["flops"]),
                "memory_bytes": int(ref["memory"]),
            }
            rec["memory_bytes"] = int(probe["memory"])
            rec["memory_ratio"] = ratio
            rec["maf_per_step_gflops"] = probe["flops"] / GIGA * ratio  # FoMo-in-Flux's MAF
            per_step *= ratio
    wanted, steps = derive_steps(share, per_step, upper)
    rec.update(
        cost_per_step=per_step,
        steps=wanted,
        steps_trained=steps,
        upper_bound=upper,
        capped=wanted > upper,
        spent=steps * per_step,
        unspent=max(0.0, share - steps * per_step),
    )
    if acc.is_main_process:
        name = ctx.task_name
        if wanted > upper:
            acc.print(
                f"budget: task {name}: {share:.4g} {b.unit} buy {wanted} steps of "
                f"{per_step:.4g}, but --epochs {cfg.epochs}"
                + (
                    f" / --max-steps-per-task {cfg.max_steps_per_task}"
                    if cfg.max_steps_per_task
                    else ""
                )
                + f" allow {upper}: training {upper} (raise --epochs to spend the rest)"
            )
        elif share < per_step:
            acc.print(
                f"budget: task {name}: {share:.4g} {b.unit} do not buy one step "
                f"({per_step:.4g}): training 1"
            )
        else:
            acc.print(f"budget: task {name}: {steps} steps of {per_step:.4g} {b.unit}")
    return steps, rec


def measure_step(trainer: Any, ctx: Any, ds: Any, gb: int) -> None:
    """Count the task's step with a probe (on the eager model) instead of a training step:
    `--compile`'s graphs run kernels no dispatch mode sees."""
    probe = probe_step(trainer, ctx, _first_batches(trainer, ctx, ds, gb))
    trainer.cost.set_step(int(probe["flops"]), "probe on the eager model (--compile)")
