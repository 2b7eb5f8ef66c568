"""Shared machinery of the parameter-regularisation baselines (EWC, SI, MAS, RWalk, AFEC).

Each of them adds quadratic anchors c·Σ_k Ω_k (θ_k − θ*_k)² to the base loss and differs only in
how Ω (the importance) and θ* are obtained. What they share lives here once:

- **Tracked parameters**: the model's trainable parameters (`requires_grad`), by name, in
  `named_parameters()` order. Importance, snapshots and path integrals are lists of tensors on
  the parameters' device, updated with fused `torch._foreach_*` kernels.
- **The penalty** (`quadratic_penalty`): value and gradient in one fused pass over the
  parameters, in `before_step` (θ is the same from then until the optimizer step). Its
  gradient 2c·Ω(θ−θ*) is analytic, so it is not backpropagated: `after_backward` adds it to
  `p.grad` after the base-loss gradient has been averaged over ranks and before clipping (the
  penalty is the same on every rank). The logged loss term is its value (no graph), so the
  logged `loss` is the full objective. `after_backward` first reads the *unregularised*
  gradient, which is what SI and RWalk integrate along the path (the CTP code needs a second
  forward and backward pass for it; one suffices here).
- **Path integral** (SI, RWalk; `track_path`): per step ω ← ω − g·Δθ, g the averaged
  unregularised gradient, Δθ the step's actual parameter change (after Adam, clipping, weight
  decay), with `torch._foreach_addcmul_`.
- **Importance passes** (`importance_pass`): after a task, one pass over **all** of the
  task's training pairs (its own data, not the replay buffer) in global batches of the run's
  size, the same augmentation as training, the model in eval mode (deterministic; BatchNorm
  statistics are neither used from the batch nor updated, unlike the CTP code's train mode —
  the pass must not change the model it measures). Per batch, the objective's gradient is
  averaged over ranks (so it is the gradient on the global batch) and accumulated squared
  (Fisher, EWC / RWalk / AFEC) or in absolute value (MAS); the result is divided by the number
  of batches. Every rank ends with the same importance.
- **Skip on the last task**: importance measured after the last task would protect it for a
  next task that never comes; the passes are skipped there (said in the log).
- **State**: importance and merge counters persist across tasks, the in-task path integral
  until the task ends; all of it goes to `state_dict` (safetensors). θ* is the model at the
  start of the task (= the previous task's final weights), snapshot in `before_task`, also on
  resume (the loop loads the mid-task weights after `before_task`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from cvl.dist import average_gradients
from cvl.errors import CvlError
from cvl.methods.base import Method, TaskContext, base_loss, state_mismatch
from cvl.methods.scaling import loop_scaler, scaled_grads
from cvl.train.fsdp import locals_

Tensors = list[torch.Tensor]


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every trainable parameter, in `named_parameters()` order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _sum(ts: Tensors) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(ts, 1)).sum() if ts else torch.zeros(())


@torch.no_grad()
def quadratic_penalty(
    params: Tensors, ref: Tensors, omega: Tensors, signed: bool = False
) -> tuple[torch.Tensor, Tensors]:
    """(Σ_k Σ Ω_k·(θ_k − θ*_k)², [Ω_k·(θ_k − θ*_k)]) with fused kernels, no autograd.

    The gradient of c·value is 2c times the returned list. `signed`: Ω may hold negative
    entries (SI's Ω is not clipped); else Σ|x| (one fused L1 norm) is the sum.
    """
    d = torch._foreach_sub(params, ref)
    od = torch._foreach_mul(d, omega)
    torch._foreach_mul_(d, od)  # d ← Ω·d² (in place)
    value = _sum(d)
    if signed:  # Σx = Σ|x| − 2·Σ|min(x, 0)|
        value = value - 2 * _sum(torch._foreach_clamp_max(d, 0.0))
    return value, od


@torch.no_grad()
def merge_running_mean(old: Tensors | None, new: Tensors, t: int) -> Tensors:
    """F ← t/(t+1)·F_old + 1/(t+1)·F_new (the CTP code's merge; t = task index from 0)."""
    if old is None or t == 0:
        return new
    torch._foreach_mul_(old, t / (t + 1))
    torch._foreach_add_(old, new, alpha=1.0 / (t + 1))
    return old


def task_batches(
    ctx: TaskContext, entries: list, seed: int, epoch: int = 0, step_batches: int = 1
) -> Iterator[dict]:
    """This rank's slices of the global batches of `entries` (training transform), on device;
    `step_batches` > 1: regrouped as cached accumulation's steps of that many (`rank_major`)."""
    from cvl.data.reader import PairDataset, global_batches, make_loader
    from cvl.data.transforms import image_transform
    from cvl.train.accum import rank_major

    cfg, acc, model = ctx.config, ctx.accelerator, ctx.model
    ds = PairDataset(
        entries,
        transform=image_transform(model.image_size, train=True, augment=cfg.augment),
        tokenize=model.tokenizer,
    )
    rank, world = acc.process_index, acc.num_processes
    block = int(getattr(cfg, "shuffle_block", 1) or 1)  # the main loop's order
    batches = global_batches(len(ds), cfg.batch_size * world, seed, epoch, block=block)
    batches = rank_major(batches, step_batches, world)
    for b in make_loader(ds, batches, rank, world, getattr(ctx.services, "workers", 0)):
        b["image"] = b["image"].to(acc.device)
        b["text"] = b["text"].to(acc.device)
        yield b


def fisher_objective(model: Any, batch: dict, ctx: TaskContext) -> torch.Tensor:
    """EWC's objective: the base loss (ITC over the global batch, + MLM for fusion)."""
    out = model(batch["image"], batch["text"])
    return sum(base_loss(model, batch, out, ctx).values())


def importance_pass(
    model: Any,
    batches: Iterator[dict],
    objective: Callable[[Any, dict, TaskContext], torch.Tensor],
    ctx: TaskContext,
    square: bool = True,
    max_batches: int = 0,
) -> Tensors:
    """Mean over batches of g² (`square`) or |g|, g = objective's rank-averaged gradient.

    Trainable parameters only; the model runs in eval mode; its gradients are cleared after.
    Each batch re-seeds `ctx.generator` (MLM masking) from the run seed, task and batch index.
    The objective runs under the step's autocast; under fp16 (a GradScaler) it back-propagates
    loss scaled (`cvl.methods.scaling`), so small gradients do not flush to zero in float16.
    """
    from cvl.data.reader import sample_seed

    params = [p for _, p in trainable(model)]
    acc = [torch.zeros_like(p) for p in params]
    was = model.training
    model.eval()
    seed = int(getattr(ctx.config, "seed", 0)) if ctx.config is not None else 0
    autocast = ctx.accelerator.autocast if ctx.accelerator is not None else None
    n = 0
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break

        def run_objective(batch: dict = batch, i: int = i) -> torch.Tensor:
            for p in params:
                p.grad = None
            # (re)seeded per try: a batch redone at a lower loss scale draws the same masks
            ctx.generator = torch.Generator().manual_seed(sample_seed(seed, ctx.task_index, 99, i))
            if autocast is None:
                return objective(model, batch, ctx)
            with autocast():
                return objective(model, batch, ctx)

        _scaled_backward(run_objective, params, ctx)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if square:
            torch._foreach_addcmul_(acc, grads, grads)
        else:
            torch._foreach_add_(acc, torch._foreach_abs(grads))
        n += 1
    for p in params:
        p.grad = None
    model.train(was)
    if n:
        torch._foreach_div_(acc, float(n))
    return acc


def _scaled_backward(
    run: Callable[[], torch.Tensor], params: list[torch.Tensor], ctx: TaskContext
) -> None:
    """Rank-averaged gradients of `run()`'s loss in `params` (`p.grad`), under fp16 at the
    loop's loss scale (`cvl.methods.scaling.scaled_grads`; the averaged gradients are the
    same on every rank, so every rank decides alike)."""

    def averaged(loss: torch.Tensor) -> list[torch.Tensor | None]:
        loss.backward()
        average_gradients(params)
        return [p.grad for p in params]

    for p, g in zip(params, scaled_grads(run, averaged, loop_scaler(ctx))):
        p.grad = g


def note(ctx: TaskContext, name: str, msg: str) -> None:
    if getattr(ctx, "probing", False):  # a budget's probe of the end of the task: said later
        return
    acc = ctx.accelerator
    if acc is None or getattr(acc, "is_main_process", True):
        print(f"{name}: {msg}", flush=True)


def is_last_task(ctx: TaskContext) -> bool:
    return ctx.manifest is not None and ctx.task_index == len(ctx.manifest.task_order) - 1


class ParamRegularizer(Method):
    """Base of EWC, SI, MAS, RWalk, AFEC: anchors, fused penalty, path integral, state.

    Subclasses define `anchors()` -> [(θ*, Ω, c, signed)] (each adds c·ΣΩ(θ−θ*)²) and update
    their importance in `after_task`; `persistent` names the tensor lists kept across tasks,
    `in_task` those kept only while a task runs (both saved by `state_dict`).
    """

    term = "penalty"
    track_path = False
    persistent: tuple[str, ...] = ()
    in_task: tuple[str, ...] = ()

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.names: list[str] = []
        self.lists: dict[str, Tensors | None] = {}
        self.counters: dict[str, int] = {}
        self.star: Tensors | None = None
        self._value: torch.Tensor | None = None
        self._pen_grad: Tensors | None = None
        self._g: Tensors | None = None
        self._prev: Tensors | None = None

    # -- helpers ------------------------------------------------------------------------------
    def params(self, ctx: TaskContext) -> Tensors:
        return [p for _, p in trainable(ctx.model)]

    def get(self, key: str) -> Tensors | None:
        return self.lists.get(key)

    def anchors(self) -> list[tuple[Tensors, Tensors, float, bool]]:
        return []

    # -- hooks ----------------------------------------------------------------------------------
    def setup(self, ctx: TaskContext) -> None:
        self.names = [n for n, _ in trainable(ctx.model)]

    def before_task(self, ctx: TaskContext) -> None:
        params = self.params(ctx)
        if [n for n, _ in trainable(ctx.model)] != self.names:
            raise CvlError(f"method '{self.name}': the trainable parameters changed between tasks")
        dev = params[0].device if params else torch.device("cpu")
        for k, v in self.lists.items():  # loaded from disk on the CPU
            if v is not None:
                self.lists[k] = [t.to(dev) for t in v]
        self.star = [p.detach().clone() for p in params]
        if self.track_path:
            self.lists["w"] = [torch.zeros_like(p) for p in params]
            self._g = [torch.zeros_like(p) for p in params]
            self._prev = [torch.zeros_like(p) for p in params]

    def before_step(self, ctx: TaskContext) -> None:
        self._value, self._pen_grad = None, None
        params = self.params(ctx)
        if self.track_path:
            torch._foreach_copy_(locals_(self._prev), locals_([p.detach() for p in params]))
        total, grad = None, None
        for ref, omega, coef, signed in self.anchors():
            v, od = quadratic_penalty(params, ref, omega, signed)
            total = coef * v if total is None else total + coef * v
            if grad is None:
                torch._foreach_mul_(od, 2.0 * coef)
                grad = od
            else:
                torch._foreach_add_(grad, od, alpha=2.0 * coef)
        self._value, self._pen_grad = total, grad

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        if self._value is not None:
            terms[self.term] = self._value  # value only: its gradient is added after backward
        return terms

    def after_backward(self, ctx: TaskContext) -> None:
        params = self.params(ctx)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        if self.track_path:
            # the unregularised, rank-averaged gradient (--fsdp: shard by shard)
            torch._foreach_copy_(locals_(self._g), locals_(grads))
        if self._pen_grad is not None:
            torch._foreach_add_(grads, self._pen_grad)

    @torch.no_grad()
    def after_step(self, ctx: TaskContext) -> None:
        if self.track_path:
            delta = torch._foreach_sub([p.detach() for p in self.params(ctx)], self._prev)
            torch._foreach_addcmul_(self.lists["w"], self._g, delta, value=-1.0)

    def end_task(self) -> None:
        """Drop per-task buffers (call at the end of `after_task`)."""
        for k in self.in_task:
            self.lists[k] = None
        self._g = self._prev = self._pen_grad = self._value = None

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        st: dict[str, Any] = {"counters": dict(self.counters)}
        for k in self.persistent + self.in_task:
            v = self.lists.get(k)
            if v is not None:
                st[k] = dict(zip(self.names, v))
        return st

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.counters = {k: int(v) for k, v in state.get("counters", {}).items()}
        for k in self.persistent + self.in_task:
            saved = state.get(k)
            if saved is None:
                continue
            if self.names and set(saved) != set(self.names):
                raise CvlError(state_mismatch(self.name, k, saved, self.names))
            cur = self.lists.get(k)
            if cur is not None:  # in a task: copy into the live tensors (their device)
                with torch.no_grad():
                    for t, n in zip(cur, self.names):
                        t.copy_(saved[n])
            else:
                self.lists[k] = [saved[n] for n in self.names]
