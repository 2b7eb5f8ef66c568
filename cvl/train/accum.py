"""`--accum-mode cached`: gradient accumulation that trains the loss of one batch of K·B.

`--grad-accum K` splits an optimizer step into K micro-batches of B pairs per process. In
`plain` mode every micro-batch computes its own loss (contrastive matrices of B × P columns,
distillation and queues over B × P rows) and their gradients are summed: K × B trains another
objective than one batch of K·B. `cached` trains that batch's loss (GradCache, Gao et al.
2021; open_clip's `--accum-freq` for its own contrastive loss), for every method it serves:

1. **first pass**, as each micro-batch arrives: its forward without a graph; its inputs (on
   the device), the RNG states it started from and its outputs are kept;
2. **the loss, once**: the method's `loss` on the K micro-batches joined row-wise (every
   batch field) and their outputs joined as leaf tensors, so every matrix, gather, queue,
   buffer mask and old-model term is that of one batch of K·B pairs per process (K·B·P in
   all); frozen models (previous-task, reference, momentum) run over it one micro-batch at a
   time without a graph (`frozen_rows`). Its backward leaves each output row's gradient on
   its leaf, and the gradient of terms that reach the weights directly (class texts under
   `--base-loss class-ce`, IncCLIP's pseudo texts, C-CLIP's projector) in the weights;
3. **second pass**: each micro-batch runs forward again with a graph, from its saved RNG
   states (dropout and noise replay exactly), and back-propagates its rows' cached
   gradients; the logit scale's once. What forwards accumulate in the model — BatchNorm
   running statistics, the attributes a module lists in `replayed_state` (MoE-Adapters'
   expert choices) — is put back after each second-pass forward, so it moves once per
   micro-batch, as in a plain step (`replaying`).

Memory: one micro-batch's activations, plus every row's outputs (features) and inputs
(device images) of the step. Compute: one more forward per micro-batch (the second pass).

**Data layout.** With P processes the step's K global batches of B·P pairs are regrouped
(`rank_major`) so that rank r's K micro-batches are, in order, its contiguous slice of the
step's batch of K·B·P pairs: the layout of P processes × batch K·B, which trains as one
process × K·B·P. Values a forward draws per row of the global batch (MoE router noise) use
the step's batch (`cvl.dist.row_span`). With one process the order is unchanged.

**The fusion model** (ALBEF / CTP): its image and text encoders are cached as above (their
token states are outputs); its fusion layers and MLM pass run inside the loss, once, on the
step's whole batch with a graph, so they hold K·B rows' activations of those layers (the
text side's: short sequences) — the vision tower, where a ViT's memory goes, is cached.

**Refused**: a method whose loss needs more than the model's outputs over the batch says so
(`Method.accum_refusal`, listed by `cvl methods`), and `--compile` — one line each, before
anything runs. `K = 1` is a plain step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from cvl.dist import micro_batch
from cvl.errors import CvlError

ACCUM_MODES = ("plain", "cached")

COMPILE = (
    "with --compile (the second pass replays the eager RNG states; a compiled graph's random "
    "draws are not tested to replay)"
)


def is_cached(cfg: Any) -> bool:
    """Whether `cfg` trains cached accumulation (`--accum-mode cached` with K > 1)."""
    return getattr(cfg, "accum_mode", "plain") == "cached" and int(cfg.grad_accum) > 1


def loss_batch(cfg: Any, processes: int) -> int:
    """Pairs one call of a method's loss sees over all processes: the global batch
    (batch size × processes), × K under cached accumulation (methods size their per-step
    draws by it: IncCLIP's memory mini-batch)."""
    return int(cfg.batch_size) * processes * (int(cfg.grad_accum) if is_cached(cfg) else 1)


def refusal(method: Any, cfg: Any) -> str | None:
    """Why cached accumulation cannot train `method` with `cfg` (None: it can)."""
    if getattr(cfg, "compile", False):
        return COMPILE
    return method.accum_refusal(cfg)


def check(method: Any, cfg: Any) -> None:
    """One line, before anything runs, when `--accum-mode cached` cannot train the run."""
    if not is_cached(cfg):
        return
    why = refusal(method, cfg)
    if why:
        raise CvlError(
            f"--accum-mode cached: method '{cfg.method}': {why}; use --accum-mode plain (each "
            "micro-batch its own loss)"
        )


# -- the data layout ------------------------------------------------------------------------


def rank_major(batches: Iterable[list], count: int, world: int) -> Iterator[list]:
    """Global batches regrouped by `count` (one step) so that each rank's slices of the
    group are its contiguous part of the group's pairs (module doc); one process, or groups
    that do not cut evenly, pass unchanged. A trailing group of fewer than `count` batches
    (no complete step) is dropped."""
    if world == 1 or count == 1:
        yield from batches
        return
    group: list[list] = []
    for b in batches:
        group.append(b)
        if len(group) < count:
            continue
        whole = [x for g in group for x in g]
        n = len(whole) // (count * world)
        if n * count * world != len(whole) or any(len(g) != n * world for g in group):
            yield from group
        else:
            for k in range(count):
                starts = [(r * count + k) * n for r in range(world)]
                yield [x for s in starts for x in whole[s : s + n]]
        group = []


def join_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Micro-batches joined row-wise: tensors and arrays concatenated, lists chained, counts
    (`n_replaced`) summed; anything else is the first micro-batch's."""
    out: dict[str, Any] = {}
    for k, v in batches[0].items():
        vals = [b[k] for b in batches]
        if torch.is_tensor(v):
            out[k] = torch.cat(vals)
        elif isinstance(v, np.ndarray):
            out[k] = np.concatenate(vals)
        elif isinstance(v, list):
            out[k] = [x for val in vals for x in val]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = sum(vals)
        else:
            out[k] = v
    return out


# -- RNG states, and forwards run again -------------------------------------------------------


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def _bn_buffers(m: nn.Module) -> list[torch.Tensor]:
    bufs = (m.running_mean, m.running_var, m.num_batches_tracked)
    return [b for b in bufs if b is not None]


@contextlib.contextmanager
def replaying(model: nn.Module) -> Iterator[None]:
    """A forward run a second time: what forwards accumulate in `model` — BatchNorm running
    statistics, and each attribute a module names in `replayed_state` — is as before it
    afterwards (it moved in the first pass). Leave it after the forward's backward."""
    bn, attrs = [], []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            bn.append((m, [b.clone() for b in _bn_buffers(m)]))
        attrs += [(m, a, getattr(m, a)) for a in getattr(m, "replayed_state", ())]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, saved in bn:
                torch._foreach_copy_(_bn_buffers(m), saved)
        for m, a, v in attrs:
            setattr(m, a, v)


# -- frozen models over the step's batch -------------------------------------------------------

#: (rows of a micro-batch, micro-batches) while a cached step's loss runs; None otherwise
_LOSS: tuple[int, int] | None = None


def _rows(x: Any, n: int) -> bool:
    return torch.is_tensor(x) and x.dim() > 0 and x.shape[0] == n


def _join(parts: list[Any], n: int) -> Any:
    """Results of micro-batches joined: row tensors (n rows) concatenated, containers per
    element, anything else (a 0-d logit scale) the first's."""
    first = parts[0]
    if torch.is_tensor(first):
        return torch.cat(parts) if _rows(first, n) else first
    if isinstance(first, dict):
        return {k: _join([p[k] for p in parts], n) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_join([p[i] for p in parts], n) for i in range(len(first)))
    return first


def frozen_rows(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`: a frozen model's forward without a graph (old, reference,
    momentum model). While a cached step's loss runs, one micro-batch at a time: arguments
    with the step's rows are cut, the results joined row-wise, so it holds one micro-batch's
    activations, as the student's forward. Elsewhere (and on inputs of other sizes) one call."""
    if _LOSS is None:
        return fn(*args, **kwargs)
    n, count = _LOSS
    total = n * count
    if not any(_rows(a, total) for a in (*args, *kwargs.values())):
        return fn(*args, **kwargs)

    def cut(x: Any, k: int) -> Any:
        return x[k * n : (k + 1) * n] if _rows(x, total) else x

    parts = []
    for k in range(count):
        with micro_batch(k, count):
            parts.append(
                fn(*(cut(a, k) for a in args), **{a: cut(v, k) for a, v in kwargs.items()})
            )
    return _join(parts, n)


# -- one step ------------------------------------------------------------------------------------


class FeatureCache:
    """One optimizer step of cached accumulation on this rank (module doc): `forward` each
    micro-batch, then `whole` for the step's batch and outputs, the method's loss inside
    `loss_pass`, and `backward`."""

    def __init__(self, model: nn.Module, count: int, device: torch.device) -> None:
        self.model, self.count, self.device = model, count, device
        self._micro: list[tuple[dict, tuple, dict]] = []  # (inputs, RNG states, outputs)
        self._leaves: dict[str, Any] = {}
        self.rows = 0  # rows of one micro-batch on this rank

    def forward(self, batch: dict[str, Any], run: Callable[[dict], dict]) -> None:
        """The first pass of the next micro-batch: `run(batch)` (its outputs) without a graph."""
        k = len(self._micro)
        if k == 0:
            self.rows = next(len(v) for v in batch.values() if torch.is_tensor(v) and v.dim())
        states = _rng_states(self.device)
        with torch.no_grad(), micro_batch(k, self.count):
            out = run(batch)
        self._micro.append((batch, states, out))

    def whole(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(batch, outputs) of the whole step: the micro-batches joined row-wise; floating
        outputs are leaves that require grad (the loss's backward leaves their gradients)."""
        n = self.rows
        out: dict[str, Any] = {}
        for key, v in self._micro[0][2].items():
            vals = [m[2][key] for m in self._micro]
            v = torch.cat(vals) if _rows(v, n) else v
            if torch.is_tensor(v):
                v = v.detach()
                if v.is_floating_point():
                    v.requires_grad_(True)
            out[key] = v
        self._micro = [(b, s, {}) for b, s, _ in self._micro]  # the joined copies stay
        self._leaves = out
        return join_batches([m[0] for m in self._micro]), out

    def held(self) -> list[torch.Tensor]:
        """What the step holds between its passes (memory under `--budget maf`'s `tensors`
        measure): every micro-batch's device inputs and the step's outputs (after `whole`:
        the leaves, each with a gradient of its size once the loss's backward ran)."""
        out = [v for b, _, o in self._micro for v in (*b.values(), *o.values())]
        leaves = [v for v in self._leaves.values() if torch.is_tensor(v)]
        return [v for v in out if torch.is_tensor(v)] + leaves

    @contextlib.contextmanager
    def loss_pass(self) -> Iterator[None]:
        """Where the method's loss runs over the step's batch (`frozen_rows` cuts by it)."""
        global _LOSS
        before, _LOSS = _LOSS, (self.rows, len(self._micro))
        try:
            yield
        finally:
            _LOSS = before

    def backward(
        self,
        loss: torch.Tensor,
        run: Callable[[dict], dict],
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        prepare: Callable[[bool], None] | None = None,
    ) -> None:
        """The step's backward: `loss` (`scale`d: fp16's loss scaler) back to its leaves,
        then the second pass (module doc). `prepare(last)` runs before each backward (the
        gradient reducer's; `last`: the step's final one)."""
        prepare = prepare or (lambda last: None)
        prepare(False)
        (scale(loss) if scale is not None else loss).backward()
        grads = {
            k: v.grad
            for k, v in self._leaves.items()
            if torch.is_tensor(v) and v.requires_grad and v.grad is not None
        }
        self._leaves = {}
        n, last = self.rows, len(self._micro) - 1
        for k, (batch, states, _) in enumerate(self._micro):
            _set_rng_states(states, self.device)
            # the state is put back after the backward: BatchNorm's backward checks that its
            # running statistics (saved by the forward) were not modified in place
            with replaying(self.model):
                with micro_batch(k, len(self._micro)):
                    out = run(batch)
                ts, gs = [], []
                for key, g in grads.items():
                    t = out[key]
                    if not t.requires_grad:
                        continue
                    if _rows(g, n * len(self._micro)):
                        ts.append(t)
                        gs.append(g[k * n : (k + 1) * n])
                    elif k == last:  # shared by every row (the logit scale): once
                        ts.append(t)
                        gs.append(g)
                prepare(k == last)
                if ts:
                    torch.autograd.backward(ts, gs)
                del out, ts, gs
        self._micro = []

    def reset(self) -> None:
        """Drop a step's micro-batches (a step abandoned before its backward)."""
        self._micro, self._leaves = [], {}


def accumulate(
    trainer: Any,
    batch: dict[str, Any],
    ctx: Any,
    micro: int,
    transform: Any,
    forward: Any,
    prepare: Callable[[bool], None],
    scaled: bool = True,
) -> tuple[dict, dict, torch.Tensor] | None:
    """Micro-batch `micro` of the training loop's step: (batch, terms, loss) once a loss has
    run its backward, else None. plain: its forward, loss and backward; cached (the trainer
    holds a `FeatureCache`): its first forward and, at the step's last micro-batch, the loss
    of the step's whole batch and the second pass. `prepare(last)` runs before a backward;
    `scaled` False: the cached loss is not scaled by fp16's GradScaler (the budget's probe,
    whose update does not unscale)."""
    last = micro + 1 == trainer.cfg.grad_accum
    cache = trainer._cache
    if cache is None:
        terms, loss = trainer._micro(batch, ctx, forward, transform)
        prepare(last)
        trainer._backward(loss)
        return batch, terms, loss
    trainer._inputs(batch, transform)

    def run(b: dict[str, Any]) -> dict[str, Any]:
        return trainer._outputs(b, ctx, forward)

    cache.forward(batch, run)
    if not last:
        return None
    whole, out = cache.whole()
    with cache.loss_pass():
        terms, loss = trainer._terms(whole, out, ctx)
    scaler = trainer.acc.scaler if scaled else None
    cache.backward(loss, run, scaler.scale if scaler is not None else None, prepare)
    return whole, terms, loss
