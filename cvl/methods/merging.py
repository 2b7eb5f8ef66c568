"""Weight-space merging: the one home of reading, writing and interpolating a model's weights,
and the base class of the merging methods (`wise`, `ema_merge`, `zs_merge`, `ft_merge`,
`task_arith`, `ties`, `model_stock`).

**Weights** are the model's floating-point parameters and buffers under their plain names
(`floating_state`), restricted to what `--tune` trains (all of them under `--tune full`; the
adapted weights under `lora`/`dora`, read as they compute; the biases under `bitfit`, ...):
a merge never touches a frozen tensor. `write_` and `interpolate_` change them in place; a
model carrying adapters has them merged first and gets a zero delta after (it then computes
exactly the written weights).

**Merging in a continual stream** (TIME's framework, Dziadzio et al. 2025: where a task's
training starts, what is deployed). Notation: θ_0 = the run's initial weights (`init/`);
θ̂_t = the weights at the end of training task t (after the base method's `after_task`: the
"fine-tuned model" of task t); θ_t = the deployed weights of task t (what `tasks/NN-name/`
saves, what is evaluated); start_t = the weights task t trained from, set by `init`:

- `merged` (cvl's default contract): start_t = θ_{t−1} (θ_0 for t = 0);
- `finetuned`: start_t = θ̂_{t−1}, the previous task's un-merged weights (kept in the method's
  state; the deployed θ_{t−1} is only evaluated and used as the base method's previous model);
- `base`: start_t = θ_0 for every task (each task model fine-tuned from the pre-trained one,
  as task arithmetic, TIES and Model Stock assume).

The task vector of task t is τ_t = θ̂_t − start_t (the task's own update; = θ̂_t − θ_0 under
`base`, the papers' definition). Each method's `deploy` maps θ̂_t (and its state) to θ_t.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from cvl.errors import CvlError
from cvl.methods.base import TaskContext, Wrapper
from cvl.models.tune import assign_, effective_state, merge_adapters, trained_names

Weights = dict[str, torch.Tensor]
INITS = ("merged", "finetuned", "base")


def floating_state(model: nn.Module) -> Weights:
    """The model's floating weights and buffers by plain name, restricted to what `--tune`
    trains; live tensors (detached) for a plain model, the effective (computed) ones for an
    adapted weight. Read-only: change them with `write_` / `interpolate_`."""
    keep = trained_names(model)
    return {
        k: v
        for k, v in effective_state(model).items()
        if v.is_floating_point() and (keep is None or k in keep)
    }


def clone_weights(w: Weights, device: torch.device | str | None = None) -> Weights:
    """Independent copies (optionally moved), for state that must not follow the model."""
    return {k: v.detach().to(device or v.device, copy=True) for k, v in w.items()}


@torch.no_grad()
def write_(model: nn.Module, weights: Weights) -> None:
    """model ← `weights` (plain names; the tensors not named keep their values)."""
    merge_adapters(model)
    live = floating_state(model)
    bad = sorted(set(weights) - set(live))
    if bad:
        raise CvlError(f"weights to write do not match the model ({', '.join(bad[:3])}, ...)")
    assign_(model, {k: v.to(live[k].device, live[k].dtype) for k, v in weights.items()})


@torch.no_grad()
def interpolate_(model: nn.Module, other: nn.Module | Weights, alpha: float) -> None:
    """model ← α·model + (1 − α)·other, in place (the weights `floating_state` names)."""
    mine = floating_state(model)
    theirs = other if isinstance(other, dict) else floating_state(other)
    out = {}
    for k, v in mine.items():
        out[k] = v * alpha + theirs[k].to(v.device, v.dtype) * (1.0 - alpha)
    write_(model, out)


def load_initial(ctx: TaskContext) -> Weights:
    """θ_0: the run's initial weights (`RUN/init/`), as `floating_state` names them."""
    from cvl.methods.base import frozen_copy
    from cvl.models import load_weights
    from cvl.runs import MODEL_FILE

    m = frozen_copy(ctx.model)
    load_weights(m, Path(ctx.run_dir) / "init" / MODEL_FILE)
    return clone_weights(floating_state(m))


class MergeMethod(Wrapper):
    """Base of the merges: runs a base method (`base=NAME`), then deploys a merge of weights.

    Subclasses set `defaults` (with `init` when it is a choice, else class attribute `init`)
    and implement `deploy(ctx, tuned) -> Weights` (θ_t from θ̂_t = `tuned`), using
    `self.start` (start_t) and `self.initial(ctx)` (θ_0); `merge_first_task` = False keeps
    θ̂_0 on the first task. State that must survive a task (θ̂_{t−1}, running sums) goes in
    `own_state` / `load_own_state` (tensors on the CPU).
    """

    init = "merged"
    merge_first_task = True

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.init = self.args.get("init", type(self).init)
        if self.init not in INITS:
            raise CvlError(
                f"method '{self.name}': init must be {' or '.join(INITS)} (got {self.init!r})"
            )
        self.start: Weights | None = None
        self.finetuned: Weights | None = None  # θ̂_{t−1} (init=finetuned)
        self._initial: Weights | None = None

    def initial(self, ctx: TaskContext) -> Weights:
        """θ_0 (loaded once, on the model's device)."""
        if self._initial is None:
            self._initial = load_initial(ctx)
        return self._initial

    def before_task(self, ctx: TaskContext) -> None:
        if self.init == "finetuned" and self.finetuned is not None:
            write_(ctx.model, self.finetuned)
        elif self.init == "base" and not ctx.first_task:
            write_(ctx.model, self.initial(ctx))
        self.start = clone_weights(floating_state(ctx.model))  # also on resume (before last/)
        super().before_task(ctx)

    def after_task(self, ctx: TaskContext) -> None:
        super().after_task(ctx)  # the base method's own end of task (e.g. EWC's Fisher)
        tuned = clone_weights(floating_state(ctx.model))
        if ctx.first_task and not self.merge_first_task:
            self.record(ctx, tuned)
        else:
            write_(ctx.model, self.deploy(ctx, tuned))
        if self.init == "finetuned":
            self.finetuned = clone_weights(tuned, "cpu")
        self.start = None

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        raise NotImplementedError

    def record(self, ctx: TaskContext, tuned: Weights) -> None:
        """What a method keeps of a task it does not merge (`merge_first_task` False)."""

    def own_state(self) -> dict[str, Any]:
        st = self.merge_state()
        if self.finetuned is not None:
            st["finetuned"] = dict(self.finetuned)
        return st

    def load_own_state(self, state: dict[str, Any]) -> None:
        if "finetuned" in state:
            self.finetuned = dict(state["finetuned"])
        self.load_merge_state(state)

    def merge_state(self) -> dict[str, Any]:
        return {}

    def load_merge_state(self, state: dict[str, Any]) -> None:
        pass

    def task_vector(self, tuned: Weights) -> Weights:
        """τ_t = θ̂_t − start_t."""
        return {k: v - self.start[k] for k, v in tuned.items()}
