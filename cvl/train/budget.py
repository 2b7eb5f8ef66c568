"""`cvl train --budget SPEC [--budget-arg NAME=VALUE ...]`: train every method to the same
compute budget.

SPEC is `samples=N`, `tflops=N` or `maf=N`, for the whole stream, or with `/task` appended
(`tflops=2/task`) for each task:

- `samples=N`: training samples (replayed ones included), N / (global batch × grad_accum)
  steps; no measurement needed (`--accum-mode cached` trains the same samples per step: its
  second forward costs FLOPs, not samples).
- `tflops=N`: 10^12 FLOPs of training steps; each task's steps = its budget / the FLOPs of one
  of its steps (forward, backward and the method's extra passes, summed over processes).
- `maf=N`: FoMo-in-Flux's memory-adjusted FLOPs (Roth et al., NeurIPS 2024 D&B), in 10^12
  units. Its code (the authors' push in the fork pseudope/fomo_in_flux) measures a method's
  GFLOPs (`flops_computation.py`: torch's `FlopCounterMode` over one forward + backward + update
  step, "forward_backward_step", and over the end of a task, "end_task") and its memory
  (`memory_computation.py`, `get_gpu_memory`: nvidia-smi's used device memory after each of
  those stages) once, and the paper's Tab. 4 (the repository's `images/gflops.png`) turns them
  into steps per task: MAF per step = (step GFLOPs + end-of-task GFLOPs) × memory / full
  fine-tuning's memory (the table's EWC row charges its Fisher pass over 50,000 samples to
  every step: 6,276,081 GFLOPs, 99 × full fine-tuning's step), and steps = round(1.8·10^9 / T / MAF) for T tasks (full
  fine-tuning of ViT-B/16 at batch 512, 63,394.76 GFLOPs, gets 1,420 at T = 20: the configs'
  `n_samples` 727,040 = 1,420 × 512; with ⌊·⌋ it would be 1,419, and rounding to nearest
  reproduces every entry of the table). The configs then hard-code those steps
  (`experiment.task.n_samples`), the same for every task.

`--budget-arg` chooses how (`budget_options`; `maf` defaults to FoMo-in-Flux's definition,
`samples` and `tflops` to cvl's earlier choices, which stay available for `maf` too):
TiC-CLIP's Oracle (`joint restart=true`, each task retrained from scratch on tasks 0..t) gets
for task t the budget of tasks 0..t.

| option | maf (FoMo-in-Flux) | samples, tflops (cvl) | the other choice |
|---|---|---|---|
| `split` | `equal`: the stream's budget / the trained tasks | `pairs`: in proportion to each task's training pairs | the other |
| `extras` | `step`: the end-of-task work (`before_task`, `after_task`, buffer update) charged to every step | `none`: measured and reported, not charged | `task`: charged once, before the steps |
| `rounding` | `nearest` | `floor` | the other |
| `reference` (maf) | `full`: a full fine-tuning step of the same model and batch (every weight trained, no adapters) | – | `tune`: a step under the run's own `--tune` (cvl's earlier reference) |
| `memory` (maf) | `auto`: `device` on CUDA, `tensors` elsewhere | – | `device`, `tensors`, `allocated` (`cvl.train.memory`) |

A joint run (one task on everything) gets the whole stream's budget, or N × tasks with
`/task`. Each task's steps = its budget (less the extras under `extras=task`) / cost per step,
rounded, at least one; `--epochs` (and `--max-steps-per-task`) stay an upper bound: a budget
beyond them trains that many steps, says so and records the unspent part (raise `--epochs` to
spend it). The learning-rate schedule spans the derived steps. Per-epoch work (validation
under `--select best-val`, AFEC's expanded model) is measured and reported, never charged.

The costs are measured before the task trains, on its start weights, and undone, so the task
then trains exactly as it would have: `probe_step` runs one real optimizer step of the method
on the task's first batch (throwaway optimizer; under `--accum-mode cached` the cached step the
task trains: K first-pass forwards, the loss once, K second-pass forwards and backwards, so
its count holds the re-forward, as the loop's own counted step does), counted, then restores the weights, reruns
`before_task` and reloads the method and buffer state from an in-memory copy, as a resume
from a checkpoint does; `probe_extras` runs the end-of-task work counted (FoMo-in-Flux
profiles its `end_task` the same way, on the initial model) and puts back deep copies of the
method and the buffer taken before, and the weights (one more end-of-task pass per task: for
EWC a Fisher pass); `reference_step` runs full fine-tuning's forward + backward on a plain
copy of the model (no update; on the model itself under `--tune full`, its buffers, gradients
and random streams put back). The derived steps and the measured costs go to task.json
"budget" and to every mid-task checkpoint: a resumed task keeps them (never measured again).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from cvl.device import fork_rng
from cvl.dist import average_gradients
from cvl.train.accum import accumulate, rank_major
from cvl.train.budgetspec import (  # noqa: F401  (re-exported: budget.py was their home)
    CVL,
    FOMO,
    KINDS,
    MAF_ONLY,
    OPTIONS,
    Budget,
    budget_options,
    charged_cost,
    derive_steps,
    parse_budget,
    task_share,
)
from cvl.train.cost import GIGA, TERA, reduce_values, reset_peak_memory
from cvl.train.memory import StageMemory, held_tensors, resolve_measure, tensor_bytes


# -- measurements ----------------------------------------------------------------------------
def _first_batches(trainer: Any, ctx: Any, ds: Any, gb: int) -> list[dict]:
    """This rank's micro-batches of the task's first optimizer step (epoch 0)."""
    from cvl.data.augment import device_images
    from cvl.data.reader import make_loader

    cfg, acc = trainer.cfg, trainer.acc
    bs = trainer._task_data.epoch(0)[: cfg.grad_accum]  # the loop's own (mixed) batches
    if trainer._cache is not None:  # laid out as the loop's cached steps (cvl.train.accum)
        bs = list(rank_major(bs, cfg.grad_accum, acc.num_processes))
    batches = list(make_loader(ds, bs, acc.process_index, acc.num_processes, 0))
    for b in batches:  # images finished on the device once (the split transform's batched part)
        b["image"] = device_images(b, ds.transform, acc.device)
    return batches


def _global(x: float, op: str, device: torch.device) -> float:
    """`x` summed (op "sum") or maximised ("max") over the processes."""
    return reduce_values([float(x)], op, device)[0]


def _memory(measure: str | None, device: torch.device, **kw: Any) -> Any:
    return StageMemory(measure, device, **kw) if measure else contextlib.nullcontext()


def reference_step(
    trainer: Any, ctx: Any, batch: dict, reference: str = "full", measure: str | None = None
) -> dict[str, float]:
    """FLOPs and memory of the reference step on `batch`: the base loss's forward and backward,
    no update, of full fine-tuning (every floating weight trained, no adapters: a plain copy
    of the model, or the model itself when `--tune full` trains all of it) or, `reference=tune`,
    of the model as the run tunes it. Leaves the model's weights, buffers (BatchNorm
    statistics), gradients and RNG streams as they were."""
    from cvl.methods.base import base_loss
    from cvl.models.tune import full_finetuning_copy, has_adapters
    from cvl.train.cost import FlopMeter

    model, acc, dev = trainer.model, trainer.acc, trainer.acc.device
    floating = [p for p in model.parameters() if p.is_floating_point()]
    live = reference == "tune" or (
        not has_adapters(model) and all(p.requires_grad for p in floating)
    )
    ref = model if live else full_finetuning_copy(model)
    ref.train()  # as a training step (the live model's BatchNorm statistics restored below)
    bufs = {n: b.detach().clone() for n, b in ref.named_buffers()} if live else {}
    params = [p for p in ref.parameters() if p.requires_grad]
    meter = FlopMeter()
    gen = ctx.generator
    mem = _memory(
        measure,
        dev,
        owned=[*ref.parameters(), *ref.buffers()],
        trained=params,
        moments_allocated=False,
        exclude_live=True,
    )
    with fork_rng(dev):
        ctx.generator = torch.Generator().manual_seed(0)
        trainer.cost.keep_peak()
        with mem:
            with meter.counting("ref"):
                img, txt = batch["image"].to(dev), batch["text"].to(dev)
                with acc.autocast():
                    out = ref(img, txt)
                    loss = sum(base_loss(ref, batch, out, ctx).values())
                loss.backward()
            del out, loss
            if measure:
                mem.micro_done()
                mem.backward_done()
    ctx.generator = gen
    with torch.no_grad():
        for n, b in ref.named_buffers():
            if n in bufs:
                b.copy_(bufs[n])
    for p in params:
        p.grad = None
    del ref
    return {
        "flops": _global(meter.counts.get("ref", 0), "sum", dev),
        "memory": _global(mem.value, "max", dev) if measure else 0.0,
    }


def probe_step(
    trainer: Any, ctx: Any, batches: list[dict], measure: str | None = None
) -> dict[str, float]:
    """FLOPs (summed over processes) and memory (`measure`; None: not measured) of one
    optimizer step of the method, run and undone (module doc). Uses the eager model also
    with `--compile`."""
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
    owned = [*model.parameters(), *model.buffers(), *held_tensors(method)]
    if ctx.buffer is not None:
        owned += list(held_tensors(ctx.buffer))
    opt, _ = optimizer_with_schedule(params, cfg, max(1, ctx.steps_in_task), task=ctx.task_name)
    cache = trainer._cache  # --accum-mode cached: the probe runs the cached step

    def held(last: bool) -> None:  # before each backward of a cached step: a stage ends
        if measure:
            mem.hold(cache.held())
            mem.micro_done()

    tracker.probing = ctx.probing = True
    try:
        with fork_rng(dev):
            tracker.keep_peak()
            reset_peak_memory(dev)
            mem = _memory(measure, dev, owned=owned, trained=params, moments_allocated=True)
            tracker.meter.push("probe")
            try:
                with mem:
                    for micro, batch in enumerate(batches):
                        if micro == 0:
                            ti = ctx.task_index
                            seed_torch(sample_seed(cfg.seed, ti, 0, 0, acc.process_index), dev)
                            ctx.generator = torch.Generator().manual_seed(
                                sample_seed(cfg.seed, ti, 0, 0)
                            )
                            method.before_step(ctx)
                        if cache is not None:  # the cached step the task trains (re-forward)
                            accumulate(trainer, batch, ctx, micro, None, model, held, False)
                        else:
                            _, loss = trainer._micro(batch, ctx, model)
                            (loss / len(batches)).backward()
                            del loss
                        if measure:
                            mem.micro_done()
                    if measure:
                        mem.backward_done()
                    trainer._update(ctx, opt, params, trainer._clip, average_gradients)
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
        if cache is not None:
            cache.reset()
        ctx.resuming = saved[4]
        tracker.probing = ctx.probing = False
    return {
        "flops": _global(flops, "sum", dev),
        "memory": _global(mem.value, "max", dev) if measure else 0.0,
    }


def _shared(trainer: Any, ctx: Any) -> dict[int, Any]:
    """A deepcopy memo that keeps the run's objects shared (the trainer, the context, the
    model and its tensors, the cached previous model, the task's entries): a copy of the
    method or the buffer then holds only copies of what is theirs."""
    keep: list[Any] = [trainer, ctx, trainer.model, ctx.task_entries]
    keep += [v for k, v in vars(trainer).items() if k != "method"]
    keep += [v for k, v in vars(ctx).items() if k != "buffer"]
    memo: dict[int, Any] = {}
    for obj in keep:
        memo[id(obj)] = obj
        if isinstance(obj, torch.nn.Module):
            for x in [*obj.modules(), *obj.parameters(), *obj.buffers()]:
                memo[id(x)] = x
    prev = getattr(trainer, "_prev_cache", None)
    if prev is not None:
        for x in [*prev[1].modules(), *prev[1].parameters(), *prev[1].buffers()]:
            memo[id(x)] = x
    return memo


def probe_extras(trainer: Any, ctx: Any, measure: str | None = None) -> dict[str, float]:
    """FLOPs (summed over processes) and memory of the task's end-of-task work — the method's
    `after_task` and the buffer update — run counted on the task's start weights, then undone
    (module doc). `before_task` has run already; its count is added by the caller."""
    model, dev, tracker = trainer.model, trainer.acc.device, trainer.cost
    memo = _shared(trainer, ctx)
    method, buffer = trainer.method, ctx.buffer
    method_copy = copy.deepcopy(method, memo)
    buffer_copy = copy.deepcopy(buffer, memo) if buffer is not None else None
    copies = tensor_bytes(
        t
        for t in held_tensors([method_copy, buffer_copy])
        if t.device.type == "cuda" and id(t) not in memo
    )
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    saved = (ctx.step, ctx.global_step, ctx.epoch, ctx.generator, dict(ctx.metrics))
    owned = [*model.parameters(), *model.buffers(), *held_tensors([method, buffer])]
    # the end of a task holds no gradients or moments; under `tensors` the step's memory is used
    stage = measure if measure in ("device", "allocated") else None
    mem = _memory(stage, dev, owned=owned, trained=[], moments_allocated=True)
    tracker.probing = ctx.probing = True
    try:
        with fork_rng(dev):
            tracker.keep_peak()
            reset_peak_memory(dev)
            tracker.meter.push("probe_extras")
            try:
                with mem:
                    method.after_task(ctx)
                    if buffer is not None:
                        buffer.update(ctx.task_name, ctx.task_entries, ctx)
            finally:
                tracker.meter.pop()
        flops = tracker.meter.counts.pop("probe_extras", 0)
    finally:
        model.load_state_dict(weights)
        for p in model.parameters():
            p.grad = None
        trainer.method, ctx.buffer = method_copy, buffer_copy
        ctx.step, ctx.global_step, ctx.epoch, ctx.generator, ctx.metrics = saved
        tracker.probing = ctx.probing = False
    memory = mem.value - (copies if stage == "device" else 0) if stage else 0.0
    return {"flops": _global(flops, "sum", dev), "memory": _global(memory, "max", dev)}


def _extras_before(trainer: Any) -> float:
    """FLOPs of this task's `before_task` (counted by the loop just before; summed)."""
    return _global(trainer.cost.meter.counts.get("extra:before_task", 0), "sum", trainer.acc.device)


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
    opts = dict(trainer.budget_opts)
    counts = {i: trainer.manifest.tasks[trainer.order[i]].train.count for i in trainer.indices}
    single = getattr(trainer.method, "single_task", False)
    seen = getattr(trainer.method, "budget_seen", False)
    share = task_share(b, counts, ctx.task_index, len(trainer.order), single, opts["split"], seen)
    rec: dict[str, Any] = {"spec": b.spec, "kind": b.kind, "per_task": b.per_task}
    rec["share"] = share
    samples_per_step = gb * cfg.grad_accum
    per_task = 0.0
    if b.kind == "samples":
        per_step = float(samples_per_step)
    else:
        measure = None
        if b.kind == "maf":
            measure = opts["memory"] = resolve_measure(opts["memory"], acc.device)
        batches = _first_batches(trainer, ctx, ds, gb)
        trainer._opt = None  # the previous task's optimizer and moments: not this task's memory
        ref = (
            reference_step(trainer, ctx, batches[0], opts["reference"], measure)
            if measure
            else None
        )
        probe = probe_step(trainer, ctx, batches, measure)
        extras = None
        if opts["extras"] != "none":
            extras = probe_extras(trainer, ctx, measure)
            extras["flops"] += _extras_before(trainer)
        rec["flops_per_step"] = int(probe["flops"])
        rec["step_counted_on"] = "probe"
        trainer.cost.set_step(rec["flops_per_step"], "probe")
        ratio = 1.0
        if ref is not None:
            memory = max(probe["memory"], extras["memory"] if extras else 0.0)
            ratio = memory / max(ref["memory"], 1.0)
            rec["reference"] = {
                "of": opts["reference"],
                "flops_per_step": int(ref["flops"]),
                "memory_bytes": int(ref["memory"]),
            }
            rec["memory_bytes"] = int(memory)
            rec["memory_ratio"] = ratio
        if extras is not None:
            rec["extras_flops"] = int(extras["flops"])
        step_cost, per_task = charged_cost(
            probe["flops"] / TERA,
            extras["flops"] / TERA if extras else 0.0,
            ratio,
            opts["extras"],
        )
        per_step = step_cost
        if b.kind == "maf":
            rec["maf_per_step_gflops"] = per_step * TERA / GIGA  # FoMo-in-Flux's MAF
    rec["options"] = opts
    wanted, steps = derive_steps(share - per_task, per_step, upper, opts["rounding"])
    rec.update(
        cost_per_step=per_step,
        cost_per_task=per_task,
        steps=wanted,
        steps_trained=steps,
        upper_bound=upper,
        capped=wanted > upper,
        spent=steps * per_step + per_task,
        unspent=max(0.0, share - steps * per_step - per_task),
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
        elif share - per_task < per_step:
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
