"""The method contract: hooks the one training loop calls, and what they receive.

A method is a small class registered under its CLI name (`cvl.methods.registry.register`).
It holds only what makes it different: extra loss terms and the state they need (reference,
momentum or historical models, queues, importance weights). Replay buffers are separate
(`cvl.methods.buffers`) and combine with any method.

Hook order per task: `before_task` → for every step [`before_step` → forward →
`loss` → backward (per micro-batch) → gradients averaged over ranks → `after_backward` →
clipping → optimizer step → `after_step`] → `after_task`. `after_backward` sees the averaged
gradient of the loss terms (e.g. SI's unregularised gradient) and may add to `p.grad` (an
analytic penalty gradient) before clipping and the step. On resume mid-task the loop calls
`before_task(ctx)` (with `ctx.resuming` True) and then `load_state_dict(saved)`, so state that
evolves during a task (momentum/historical models, queues) must be in `state_dict()`; state
fixed at task start (the previous task's model) is rebuilt by `before_task` from disk through
`ctx.previous_model()`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cvl.dist import all_reduce_mean, gather_no_grad, local_rows, world_size
from cvl.errors import CvlError
from cvl.losses import clip_loss
from cvl.methods.registry import get_method


@dataclass
class TaskContext:
    """What hooks see: the model, where we are in the stream, and loop services."""

    model: Any  # VLModel (plain module, never DDP-wrapped)
    accelerator: Any
    config: Any  # TrainConfig
    manifest: Any
    run_dir: Any
    task_index: int = 0
    task_name: str = ""
    epoch: int = 0
    step: int = 0  # optimizer steps taken in this task
    global_step: int = 0
    steps_in_task: int = 0
    #: the task's multiplier of --lr per step (`--lr-schedule`, cvl.train.schedules)
    lr_lambda: Any = None
    resuming: bool = False
    #: True while the loop measures a step it then undoes (`cvl.train.budget.probe_step`):
    #: work that is not part of a step (AFEC's per-epoch expanded model) may be skipped.
    probing: bool = False
    buffer: Any = None
    generator: torch.Generator | None = None  # re-seeded every step: same on all ranks
    task_entries: list = field(default_factory=list)  # this task's training samples
    #: diagnostics a method reports for this step (floats, not part of the loss); the loop
    #: averages them over ranks and micro-batches and logs them next to the loss terms.
    metrics: dict = field(default_factory=dict)
    services: Any = None  # the loop: previous_model(), embed(entries), log_note(...)

    @property
    def first_task(self) -> bool:
        return self.task_index == 0

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def previous_model(self) -> nn.Module | None:
        """The frozen model saved at the end of the previous task (None on the first task)."""
        return self.services.previous_model(self) if self.task_index > 0 else None

    def initial_model(self) -> nn.Module:
        """A frozen copy of the run's initial weights (`RUN/init/`, where task 0 started)."""
        from cvl.models import load_weights
        from cvl.runs import MODEL_FILE

        m = frozen_copy(self.model)
        load_weights(m, Path(self.run_dir) / "init" / MODEL_FILE)
        return m


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy with gradients off, in eval mode (reference / old / teacher models); a model
    carrying `--tune lora/dora` adapters is copied with them merged (a plain model).

    It keeps the training model's parameter dtype and runs inside the step's autocast (the
    loop calls `Method.loss` under it; hooks outside it use `step_autocast`), so its forward
    computes in the training precision exactly as the training model's does. It is not cast
    to bf16/fp16 itself: open_clip casts the text input to the weights' dtype and would then
    add positional embeddings, LayerNorms and the logit scale in half precision too.
    """
    from cvl.models.tune import plain_copy

    m = plain_copy(model)
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def step_autocast(ctx: TaskContext) -> contextlib.AbstractContextManager:
    """The training step's autocast (`--precision`) for a hook's forward passes outside the
    loop's forward block (e.g. IncCLIP's generation in `before_step`); a no-op without an
    accelerator (unit tests)."""
    acc = ctx.accelerator
    return acc.autocast() if hasattr(acc, "autocast") else contextlib.nullcontext()


class Method:
    """Base class: plain fine-tuning with the architecture's own loss (ITC, + MLM for fusion)."""

    name = "base"
    defaults: dict[str, Any] = {}
    #: False for methods that never train (zero-shot).
    trains = True
    #: True if the method cannot work without a replay buffer.
    needs_buffer = False
    #: The `--tune` modes the method works with (None: any); the loop refuses the others.
    tunes: tuple[str, ...] | None = None

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        self.args = self.resolve_args(args or {})

    @classmethod
    def resolve_args(cls, args: dict[str, Any]) -> dict[str, Any]:
        """Defaults overridden by `args`, each coerced to its default's type (clear errors)."""
        out = dict(cls.defaults)
        for k, v in args.items():
            if k not in cls.defaults:
                known = ", ".join(cls.defaults) or "none"
                raise CvlError(f"method '{cls.name}' has no argument '{k}' (arguments: {known})")
            d = cls.defaults[k]
            try:
                if isinstance(d, bool):
                    v = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
                elif d is not None and not isinstance(v, type(d)):
                    v = type(d)(v)
            except (TypeError, ValueError):
                raise CvlError(
                    f"method '{cls.name}': {k}={v!r} is not a {type(d).__name__}"
                ) from None
            out[k] = v
        return out

    def check_choice(self, key: str, choices: tuple[str, ...]) -> None:
        """A clear error unless argument `key` is one of `choices`."""
        if self.args[key] not in choices:
            allowed = " or ".join(repr(c) for c in choices)
            raise CvlError(
                f"method '{self.name}': {key} must be {allowed} (got {self.args[key]!r})"
            )

    @classmethod
    def summary(cls) -> str:
        """First line of the class docstring."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    # -- hooks ------------------------------------------------------------------------------
    def setup(self, ctx: TaskContext) -> None:
        """Once per run, after the model exists (before the first task or after a resume)."""

    def own_entries(self, ctx: TaskContext) -> list:
        """This task's training samples without the buffer's: the task source of a
        `--mixture` (which draws the buffer's items as a source of their own)."""
        return list(ctx.task_entries)

    def task_entries(self, ctx: TaskContext) -> list:
        """Training samples of this task: its own data plus the replay buffer's items."""
        extra = ctx.buffer.entries() if ctx.buffer is not None else []
        return self.own_entries(ctx) + list(extra)

    def before_task(self, ctx: TaskContext) -> None:
        pass

    def before_step(self, ctx: TaskContext) -> None:
        pass

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        return base_loss(ctx.model, batch, out, ctx)

    def after_backward(self, ctx: TaskContext) -> None:
        """Once per optimizer step: gradients are summed over micro-batches and averaged over
        ranks, not yet clipped or applied (read them, or add an analytic gradient to them)."""

    def after_step(self, ctx: TaskContext) -> None:
        pass

    def after_task(self, ctx: TaskContext) -> None:
        pass

    def extra_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters the method owns besides the model's (optimised with it)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Everything that evolves during a task (tensors and JSON-able values, nested)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


_PASSED = ("needs_buffer", "buffer_hint", "selects_best_val", "trains", "tunes")


class Wrapper(Method):
    """A method that runs a base method (`base=NAME`) and adds to it (ZSCL, WiSE, the merges).

    Its own arguments are its `defaults`; every other argument goes to the base method, which
    runs unchanged (its losses, hooks and state). Wrappers do not nest.
    """

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
        own_tunes = type(self).tunes
        for k in _PASSED:
            if hasattr(self.inner, k):
                setattr(self, k, getattr(self.inner, k))
        if own_tunes is not None:  # the modes both work with
            self.tunes = tuple(t for t in own_tunes if self.tunes is None or t in self.tunes)

    # -- every hook goes to the base method ---------------------------------------------------
    def setup(self, ctx: TaskContext) -> None:
        self.inner.setup(ctx)

    def own_entries(self, ctx: TaskContext) -> list:
        return self.inner.own_entries(ctx)

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


class PreviousModelMethod(Method):
    """Base of methods that compare the training model with the previous task's final model.

    `self.old` is that model (frozen, eval mode), rebuilt from disk by `before_task` (also on
    resume); None on the first task, where such methods train with the base loss.
    """

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.old: nn.Module | None = None

    def before_task(self, ctx: TaskContext) -> None:
        self.old = ctx.previous_model()

    @torch.no_grad()
    def old_features(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The old model's normalised (image, text) features of this rank's batch."""
        return self.old.encode_image(batch["image"]), self.old.encode_text(batch["text"])


def base_loss(
    model: Any, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
) -> dict[str, torch.Tensor]:
    """The architecture's own pretraining loss: ITC over the global batch (+ MLM for fusion)."""
    terms = {"itc": clip_loss(out["image_features"], out["text_features"], out["logit_scale"])}
    if getattr(model, "has_fusion", False):
        terms["mlm"] = mlm_term(model, batch, out, ctx)[0]
    return terms


def mlm_term(model: Any, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext):
    """MLM loss of the fusion model on this step's masking; returns (loss, logits, masked, labels).

    The masking is drawn from `ctx.generator` for the whole global batch and this rank keeps
    its rows, so N processes mask exactly as one process would; a teacher (momentum or old
    model) can be queried on the same `masked` ids. With N processes the loss is the mean over
    the masked tokens of the *global* batch (each rank scales its mean by its share of them),
    so the rank-averaged gradient is the one-process gradient also when ranks mask different
    numbers of tokens (EWC's Fisher squares it).
    """
    model.require_fusion("MLM")
    tokens = batch["text"]
    masked, labels = model.mask_tokens(gather_no_grad(tokens), generator=ctx.generator)
    rows = local_rows(tokens.shape[0])
    masked, labels = masked[rows], labels[rows]
    loss, logits, labels = model.mlm_loss(
        out["image_embeds"], tokens, masked=(masked, labels), image_atts=out.get("image_atts")
    )
    if world_size() > 1:
        n_local = (labels != -100).sum().float()
        n_global = all_reduce_mean(n_local) * world_size()
        loss = loss * (n_local * world_size() / n_global.clamp(min=1.0))
    return loss, logits, masked, labels
