"""The method contract: hooks the one training loop calls, and what they receive.

A method is a small class registered under its CLI name (`cvl.methods.registry.register`).
It holds only what makes it different: extra loss terms and the state they need (reference,
momentum or historical models, queues, importance weights). Replay buffers are separate
(`cvl.methods.buffers`) and combine with any method.

Hook order per task: `before_task` → for every step [`before_step` → forward →
`loss` → backward (per micro-batch) → gradients averaged over ranks → `after_backward` →
clipping → optimizer step → `after_step`] → `after_task`. `after_backward` sees the averaged
gradient of the loss terms (e.g. SI's unregularised gradient; with fp16 already unscaled) and
may add to `p.grad` (an analytic penalty gradient) before clipping and the step. A step
without an update (a non-finite loss under `--skip-nonfinite`, an fp16 overflow that the loss
scaler skips) gets no `after_step`. On resume mid-task the loop calls
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

from cvl.checks import Num, check_scalar
from cvl.data.index import Entries
from cvl.dist import all_reduce_mean, gather_no_grad, local_rows, world_size
from cvl.errors import CvlError
from cvl.losses import class_text_ce, clip_loss
from cvl.methods.registry import get_method
from cvl.train.accum import frozen_rows

#: `--base-loss` choices and their `--base-loss-arg` defaults. class-ce: the ZSCL code's MTIL
#: objective: logits = the model's own logit scale (the code's `logit_scale.exp()`, a parameter
#: it leaves out of its optimizer: 100 for OpenAI's CLIP; cvl freezes it too) × cosine, or a
#: fixed `scale` > 0; label smoothing 0.2 (every script's `--ls 0.2`); the first template.
BASE_LOSSES: dict[str, dict[str, Any]] = {
    "itc": {},
    "class-ce": {"scale": 0.0, "smoothing": 0.2, "template": 0},
}


def freeze_logit_scale(model: nn.Module) -> list[str]:
    """Take the model's learnable logit scale out of training (the ZSCL code never trains it);
    returns the parameter names frozen."""
    names = [n for n, p in model.named_parameters() if n.split(".")[-1] == "logit_scale"]
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    return names


def resolve_base_loss_args(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The base loss's arguments: its defaults overridden by `args` (typed, clear errors)."""
    if name not in BASE_LOSSES:
        raise CvlError(f"--base-loss must be one of {', '.join(BASE_LOSSES)}, got '{name}'")
    out = dict(BASE_LOSSES[name])
    for k, v in args.items():
        if k not in out:
            known = ", ".join(out) or "none"
            raise CvlError(f"--base-loss {name} has no argument '{k}' (arguments: {known})")
        try:
            out[k] = type(out[k])(v)
        except (TypeError, ValueError):
            raise CvlError(f"--base-loss-arg {k}={v!r} is not a {type(out[k]).__name__}") from None
    if name == "class-ce" and not 0.0 <= out["smoothing"] < 1.0:
        raise CvlError(f"--base-loss-arg smoothing must be in [0, 1), got {out['smoothing']}")
    if name == "class-ce" and out["scale"] < 0:
        raise CvlError(
            f"--base-loss-arg scale must be > 0 (0: the model's own), got {out['scale']}"
        )
    return out


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
        """A frozen copy of the run's initial weights (`RUN/init/`, where task 0 started). A
        new run writes init/ once the method's setup has passed: during that setup the model
        still holds them, and is copied."""
        from cvl.models import load_weights
        from cvl.runs import MODEL_FILE

        m = frozen_copy(self.model)
        s = self.services
        if s is not None and not getattr(s, "resumed", True) and not getattr(s, "_committed", 1):
            return m
        load_weights(m, Path(self.run_dir) / "init" / MODEL_FILE)
        return m


def state_mismatch(method: str, key: str, saved: Any, names: Any) -> str:
    """Why a saved per-parameter state (`key`: tensors by parameter name) does not fit the
    parameters that train now: it was saved for other trainable parameters (another --tune
    mode or targets, another model), named with an example of each side."""
    saved, now = set(saved), set(names)
    only_saved, only_now = sorted(saved - now), sorted(now - saved)
    eg = "; ".join(
        f"e.g. {what} '{xs[0]}'"
        for what, xs in (("saved for", only_saved), ("training now", only_now))
        if xs
    )
    return (
        f"method '{method}': its saved '{key}' was computed for other trainable parameters "
        f"({len(saved)} tensors saved, {len(now)} train now; {eg}): the run's --tune mode or "
        "model differs from the one that saved it"
    )


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
    from cvl.train.fsdp import is_sharded, sharded_copy

    if is_sharded(model):  # --fsdp: sharded on the same plan, from the local shards
        return sharded_copy(model)
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
    #: bounds of numeric arguments (`cvl.checks.Num`), checked with the defaults' types:
    #: e.g. a temperature > 0, a momentum in [0, 1], a count >= 1.
    limits: dict[str, Num] = {}
    #: False for methods that never train (zero-shot).
    trains = True
    #: True if the method cannot work without a replay buffer.
    needs_buffer = False
    #: True for methods whose objective is their own contrastive loss (momentum, replay-aware
    #: or pseudo-negative ITC): they refuse `--base-loss class-ce`.
    itc_only = False
    #: The `--tune` modes the method works with (None: any); the loop refuses the others.
    tunes: tuple[str, ...] | None = None
    #: parameter-name patterns that train besides what `--tune` trains (`Tuning.apply`'s `also`)
    tune_also: tuple[str, ...] = ()
    #: the method's defaults for `--tune-arg`s, by `--tune` mode (the user's args win)
    tune_defaults: dict[str, dict[str, Any]] = {}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        self.args = self.resolve_args(args or {})

    @classmethod
    def resolve_args(cls, args: dict[str, Any]) -> dict[str, Any]:
        """Defaults overridden by `args`, each coerced to its default's type and checked
        (`cvl.checks.check_scalar`: finite numbers, real booleans; then `limits`)."""
        out = dict(cls.defaults)
        for k, v in args.items():
            if k not in cls.defaults:
                known = ", ".join(cls.defaults) or "none"
                raise CvlError(f"method '{cls.name}' has no argument '{k}' (arguments: {known})")
            out[k] = check_scalar(v, cls.defaults[k], f"method '{cls.name}': {k}")
        for k, rule in cls.limits.items():
            if k in out:  # a subclass may drop an argument of the class it extends
                out[k] = rule.check(out[k], f"method '{cls.name}': {k}")
        return out

    @classmethod
    def variant(cls, args: dict[str, Any]) -> str | None:
        """What tables call a run of this method with resolved arguments `args` when they
        make it another protocol (joint's Oracle); None: the method's plain form."""
        return None

    def accum_refusal(self, cfg: Any) -> str | None:
        """Why `--accum-mode cached` cannot train this method with `cfg` (None: it can, with
        its `loss` run once on the step's whole batch and frozen models through
        `cvl.train.accum.frozen_rows`); a method overrides it when a term cannot be cached."""
        return None

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

    def own_entries(self, ctx: TaskContext) -> Entries:
        """This task's training samples without the buffer's: the task source of a
        `--mixture` (which draws the buffer's items as a source of their own)."""
        return ctx.task_entries

    def task_entries(self, ctx: TaskContext) -> Entries:
        """Training samples of this task: its own data plus the replay buffer's items."""
        own = self.own_entries(ctx)
        return own + ctx.buffer.entries() if ctx.buffer is not None else own

    def before_task(self, ctx: TaskContext) -> None:
        """At the start of each task that trains (also when it resumes mid-task), before its
        data is built: load the old model, reset per-task state."""

    def before_step(self, ctx: TaskContext) -> None:
        """Before the first micro-batch of each optimizer step (random state already seeded)."""

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        """Named loss terms of one micro-batch, summed by the loop and logged one by one.

        `out` holds the training model's normalised `image_features` / `text_features`,
        `logit_scale` and the raw `image_raw` / `text_raw`; the default is the base loss
        (ITC over the global batch, + MLM for the fusion model).
        """
        return base_loss(ctx.model, batch, out, ctx)

    def after_backward(self, ctx: TaskContext) -> None:
        """Once per optimizer step: gradients are summed over micro-batches and averaged over
        ranks, not yet clipped or applied (read them, or add an analytic gradient to them)."""

    def after_step(self, ctx: TaskContext) -> None:
        """After each applied optimizer step (not after a skipped one): EMAs, path integrals."""

    def after_task(self, ctx: TaskContext) -> None:
        """At the end of each task, with its final (or best-val) weights loaded and before the
        replay buffer is updated and the checkpoint written: importances, merges."""

    def extra_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters the method owns besides the model's (optimised with it)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Everything that evolves during a task (tensors and JSON-able values, nested)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (on resume, and from a finished task's folder)."""


_PASSED = (
    "needs_buffer",
    "buffer_hint",
    "selects_best_val",
    "trains",
    "itc_only",
    "tunes",
    "tune_also",
    "tune_defaults",
)


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
    def accum_refusal(self, cfg: Any) -> str | None:
        return self.inner.accum_refusal(cfg)

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
        """The old model's normalised (image, text) features of this rank's batch (a micro-batch
        at a time under cached accumulation: `frozen_rows`)."""
        return frozen_rows(self.old.encode_image, batch["image"]), frozen_rows(
            self.old.encode_text, batch["text"]
        )


def base_loss(
    model: Any, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
) -> dict[str, torch.Tensor]:
    """The base loss: `base_terms` (+ MLM for the fusion model)."""
    terms = base_terms(batch, out, ctx)
    if getattr(model, "has_fusion", False):
        terms["mlm"] = mlm_term(model, batch, out, ctx)[0]
    return terms


def class_ce_space(cfg: Any, manifest: Any, task: str) -> tuple[dict[str, Any], Any]:
    """`--base-loss class-ce`'s arguments and task `task`'s label space (`cvl.classtext`):
    one line when the task lists no classes or lacks the template asked for. The loss and
    the check before a run starts (`check_base_loss`) both go through here."""
    from cvl.classtext import task_label_space

    a = resolve_base_loss_args("class-ce", getattr(cfg, "base_loss_args", None) or {})
    space = task_label_space(manifest, task)
    if not 0 <= a["template"] < len(space.templates):
        raise CvlError(
            f"--base-loss-arg template={a['template']}: task '{task}' has "
            f"{len(space.templates)} template(s)"
        )
    return a, space


def check_base_loss(cfg: Any, manifest: Any, tasks: list[str]) -> None:
    """Before anything is written: `--base-loss` fits every task the run trains."""
    if cfg.base_loss == "class-ce":
        for task in tasks:
            class_ce_space(cfg, manifest, task)


def base_terms(
    batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
) -> dict[str, torch.Tensor]:
    """The base loss's image-text term, as `--base-loss` chooses (every method that trains
    with the base loss goes through here):

    - ``itc``: symmetric InfoNCE over the global batch, ``{"itc": ...}``;
    - ``class-ce``: cross-entropy of each image over the text embeddings of *all* the current
      task's classes, its first template filled with each class name (`cvl.classtext`),
      with gradient into the text tower, logits = s·cos with s the model's logit scale (not
      trained: `freeze_logit_scale`) or `scale` when > 0, label smoothing `smoothing`; rows of
      other tasks' classes (replayed items) take no part; ``{"class_ce": ...}``.
    """
    cfg = getattr(ctx, "config", None)  # (unit tests pass bare contexts)
    if getattr(cfg, "base_loss", "itc") != "class-ce":
        return {"itc": clip_loss(out["image_features"], out["text_features"], out["logit_scale"])}
    from cvl.classtext import class_text_features

    a, space = class_ce_space(cfg, ctx.manifest, ctx.task_name)
    image = out["image_features"]
    w = class_text_features(ctx.model, space, a["template"])
    labels = space.labels(batch["category"], image.device)
    scale = a["scale"] or out["logit_scale"].detach()
    return {"class_ce": class_text_ce(image, w, labels, scale, a["smoothing"])}


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
