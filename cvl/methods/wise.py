"""WiSE: weight-space ensembling of each task's final weights with the previous task's.

After task t (t > 0) the final weights become

    θ_t ← α·θ_t + (1 − α)·θ_{t−1}

with θ_{t−1} the previous task's saved final weights (themselves already interpolated), α =
`alpha` = 0.5 (the weight of the new task). This is WiSE-FT (Wortsman et al. 2022)
interpolation between fine-tuned and starting weights, applied at every task boundary;
`first_task=true` also interpolates task 0 with the run's initial (e.g. pre-trained) weights,
which is WiSE-FT proper. All floating-point weights and buffers are interpolated.

Combining with other methods: `wise` wraps a **base method** named by `--method-arg
base=NAME` (default `seqft`); every other `--method-arg` goes to the base method, which runs
unchanged (its losses, hooks and state), and the interpolation happens after its `after_task`
(so e.g. EWC's Fisher is measured on the un-interpolated weights, its next anchor θ* is the
interpolated model; a replay buffer selects with the interpolated model). Example:
`--method wise --method-arg base=lwf --method-arg alpha=0.7 --method-arg variant=logits`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cvl.errors import CvlError
from cvl.methods.base import Method, TaskContext
from cvl.methods.registry import get_method, register

_PASSED = ("needs_buffer", "buffer_hint", "selects_best_val", "trains")


class Wrapper(Method):
    """A method that runs a base method (`base=NAME`) and adds to it (WiSE, ZSCL)."""

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        args = dict(args or {})
        own = {k: args.pop(k) for k in list(args) if k in type(self).defaults}
        super().__init__(own)
        base = self.args["base"]
        cls = get_method(base)
        if issubclass(cls, Wrapper) or getattr(cls, "single_task", False):
            raise CvlError(f"method '{self.name}': base={base} cannot be wrapped")
        try:
            self.inner: Method = cls(args)
        except CvlError as e:
            own_args = ", ".join(type(self).defaults)
            raise CvlError(
                f"method '{self.name}' (base {base}): {e}; {self.name}'s own: {own_args}"
            ) from None
        for k in _PASSED:
            if hasattr(self.inner, k):
                setattr(self, k, getattr(self.inner, k))

    # -- every hook goes to the base method ---------------------------------------------------
    def setup(self, ctx: TaskContext) -> None:
        self.inner.setup(ctx)

    def task_entries(self, ctx: TaskContext) -> list:
        return self.inner.task_entries(ctx)

    def before_task(self, ctx: TaskContext) -> None:
        self.inner.before_task(ctx)

    def before_step(self, ctx: TaskContext) -> None:
        self.inner.before_step(ctx)

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        return self.inner.loss(batch, out, ctx)

    def after_backward(self, ctx: TaskContext) -> None:
        self.inner.after_backward(ctx)

    def after_step(self, ctx: TaskContext) -> None:
        self.inner.after_step(ctx)

    def after_task(self, ctx: TaskContext) -> None:
        self.inner.after_task(ctx)

    def extra_parameters(self) -> list[nn.Parameter]:
        return self.inner.extra_parameters()

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.inner.state_dict(), **self.own_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("base", {}))
        self.load_own_state(state)

    def own_state(self) -> dict[str, Any]:
        return {}

    def load_own_state(self, state: dict[str, Any]) -> None:
        pass


def floating_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's floating-point parameters and buffers by name (live tensors)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if v.is_floating_point()}


@torch.no_grad()
def interpolate_(model: nn.Module, other: nn.Module | dict, alpha: float) -> None:
    """model ← α·model + (1 − α)·other, in place (floating weights and buffers)."""
    mine = floating_state(model)
    theirs = other if isinstance(other, dict) else floating_state(other)
    for k, v in mine.items():
        v.data.mul_(alpha).add_(theirs[k].to(v.device, v.dtype), alpha=1.0 - alpha)


@register("wise")
class WiSE(Wrapper):
    """WiSE: after each task, θ ← α·θ + (1−α)·θ_previous-task (wraps a base method, default seqft)."""

    defaults = {"base": "seqft", "alpha": 0.5, "first_task": False}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if not 0.0 <= self.args["alpha"] <= 1.0:
            raise CvlError(f"method 'wise': alpha must be in [0, 1] (got {self.args['alpha']})")

    def after_task(self, ctx: TaskContext) -> None:
        super().after_task(ctx)
        if ctx.first_task:
            if not self.args["first_task"]:
                return
            from cvl.methods.base import frozen_copy
            from cvl.models import load_weights
            from cvl.runs import MODEL_FILE

            prev = frozen_copy(ctx.model)
            load_weights(prev, ctx.run_dir / "init" / MODEL_FILE)
        else:
            prev = ctx.previous_model()
        interpolate_(ctx.model, prev, self.args["alpha"])
