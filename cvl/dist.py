"""Distributed helpers (torch.distributed through the process group Accelerate created).

Every helper is the identity in a single process, so methods call them unconditionally.
Ranks hold contiguous slices of each global batch (see `cvl.data.reader.rank_slice`), so
gathering in rank order restores the global batch order.

Gathers are memoised per live tensor: gathering the same data again while it is alive (the
same tensor, a `.detach()` of it or an identical view, not modified in place since) returns
the first gather's result instead of another collective, so loss terms that each build their
own global matrices from the same features (the base InfoNCE and a distillation term, say)
cost one all_gather per tensor and step. A gather with gradient serves later gathers of the
same data with or without gradient; one without gradient serves only later ones without.
Every rank runs the same code on the same shapes, so every rank makes the same decisions and
the collectives stay in step.

Gradients are averaged by `GradReducer`: in buckets, each all-reduced asynchronously as soon
as its gradients are ready during the backward (DDP's scheme), without wrapping the model.
A parameter that no rank's backward reached keeps `p.grad = None`, as in one process and in
DDP (its `local_used_map`): each all-reduce carries a "had a gradient" flag per parameter, so
AdamW neither decays nor moves a parameter the step did not reach, whatever the processes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

#: Gradient bucket size (DDP's default): large enough for the all-reduce's bandwidth, small
#: enough that the first buckets go out early in the backward.
BUCKET_MB = 25.0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# -- gathers ------------------------------------------------------------------------------------

# signature of the gathered data -> (weak reference to the tensor, result, result has a graph)
_gathered: dict[tuple, tuple[weakref.ref, torch.Tensor, bool]] = {}


def _signature(x: torch.Tensor) -> tuple | None:
    """What identifies `x`'s data while it lives: storage, view geometry and version."""
    if x.is_inference():
        return None
    return (
        x.untyped_storage().data_ptr(),
        x.storage_offset(),
        tuple(x.shape),
        x.stride(),
        x.dtype,
        x.device,
        x._version,
    )


def _remember(x: torch.Tensor, sig: tuple | None, result: torch.Tensor, graph: bool) -> None:
    if sig is None:
        return

    def forget(ref: weakref.ref, key: tuple = sig) -> None:
        entry = _gathered.get(key)
        if entry is not None and entry[0] is ref:
            del _gathered[key]

    _gathered[sig] = (weakref.ref(x, forget), result, graph)


def _recall(sig: tuple | None) -> tuple[torch.Tensor, bool] | None:
    entry = _gathered.get(sig) if sig is not None else None
    if entry is None or entry[0]() is None:
        return None
    return entry[1], entry[2]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All ranks' rows concatenated in rank order; gradients flow back to every rank's rows.

    Assumes equal row counts on all ranks (global batches are cut into equal slices).
    Memoised per live tensor (module docstring).
    """
    if world_size() == 1:
        return x
    sig = _signature(x)
    want_graph = torch.is_grad_enabled() and x.requires_grad
    hit = _recall(sig)
    if hit is not None and (hit[1] or not want_graph):
        return hit[0]
    out = torch.cat(dist_fn.all_gather(x.contiguous()), dim=0)
    _remember(x, sig, out, out.requires_grad)
    return out


def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """All ranks' rows concatenated in rank order, without gradient (queues, old models).

    Memoised per live tensor (module docstring).
    """
    if world_size() == 1:
        return x
    sig = _signature(x)
    hit = _recall(sig)
    if hit is not None:
        return hit[0].detach()
    with torch.no_grad():
        parts = [torch.empty_like(x) for _ in range(world_size())]
        dist.all_gather(parts, x.contiguous())
        out = torch.cat(parts, dim=0)
    _remember(x, sig, out, False)
    return out


def local_rows(n_local: int) -> slice:
    """This rank's rows inside a gathered global batch."""
    return slice(rank() * n_local, (rank() + 1) * n_local)


# -- the micro-batches of cached accumulation (`cvl.train.accum`) ------------------------------

#: (k, K) while micro-batch k of a cached step of K runs its forward; None otherwise
_MICRO: tuple[int, int] | None = None


@contextlib.contextmanager
def micro_batch(k: int, count: int) -> Iterator[None]:
    """Forwards run inside are those of micro-batch `k` of `count` of one cached
    accumulation step (`row_span` places their rows in the step's whole batch)."""
    global _MICRO
    before, _MICRO = _MICRO, (k, count)
    try:
        yield
    finally:
        _MICRO = before


def row_span(n_local: int) -> tuple[int, slice]:
    """(rows of the global batch, this rank's rows of it) for values a forward draws once
    per global batch and slices by row (MoE-Adapters' router noise and adapter dropout).

    Normally n_local × processes rows and `local_rows`. In micro-batch k of K of a cached
    step (`micro_batch`) the batch is the step's: n_local × K × processes rows, rank-major
    (rank r holds rows [r·K·n, (r+1)·K·n), micro-batch k the k-th n of them:
    `cvl.train.accum.rank_major` lays the data out so), so each row draws what it would in
    one batch of K·n rows per process."""
    if _MICRO is None:
        return n_local * world_size(), local_rows(n_local)
    k, count = _MICRO
    start = (rank() * count + k) * n_local
    return n_local * count * world_size(), slice(start, start + n_local)


@torch.no_grad()
def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (in place on a copy); used for logging and importance terms."""
    if world_size() == 1:
        return x
    y = x.detach().clone()
    dist.all_reduce(y)
    return y / world_size()


# -- gradients ------------------------------------------------------------------------------


def _used_elsewhere(params: Sequence[torch.nn.Parameter], flags: torch.Tensor) -> dict[int, bool]:
    """For each parameter without a gradient on this rank: did any rank have one (its flag,
    summed over ranks, > 0)? Reads the flags (a host sync) only when this rank lacks a
    gradient: a decision local to the rank, after the collective."""
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if not missing:
        return {}
    used = (flags[missing] > 0).tolist()
    return dict(zip(missing, used))


@torch.no_grad()
def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average gradients across ranks with one coalesced all_reduce, after the backward.

    The synchronous reference (and what per-task passes outside the training step use:
    importance passes, AFEC's expanded model); the training loop uses `GradReducer`, which
    computes the same averages while the backward runs. A parameter without a gradient on a
    rank counts as zero there; one without a gradient on every rank keeps `grad = None`.
    """
    w = world_size()
    params = [p for p in params if not _sharded(p)]  # FSDP has averaged those (--fsdp)
    if w == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    had = torch.zeros(len(params), dtype=flat.dtype, device=flat.device)
    present = [had[i : i + 1] for i, p in enumerate(params) if p.grad is not None]
    if present:
        torch._foreach_add_(present, 1.0)
    flat = torch.cat([flat, had])
    dist.all_reduce(flat)
    flat /= w
    used = _used_elsewhere(params, flat[-len(params) :])
    off = 0
    for i, (p, g) in enumerate(zip(params, grads)):
        n = g.numel()
        if p.grad is None:
            if used[i]:
                p.grad = flat[off : off + n].view_as(p).clone()
        else:
            p.grad.copy_(flat[off : off + n].view_as(p))
        off += n


def _sharded(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


class _Bucket:
    """Parameters whose gradients travel in one all_reduce, and its flat buffer."""

    def __init__(self, params: list[torch.nn.Parameter], indices: list[int]) -> None:
        self.params, self.indices = params, indices
        n = sum(p.numel() for p in params)
        # the gradients, then one "had a gradient" flag per parameter (reduced with them)
        self.flat = torch.empty(n + len(params), dtype=params[0].dtype, device=params[0].device)
        self.views, off = [], 0
        for p in params:
            self.views.append(self.flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        self.flags = self.flat[n:]
        self.reset()

    def reset(self) -> None:
        self.pending = len(self.params)
        self.seen = [False] * len(self.params)
        self.work = None
        self.sent = self.dirty = False

    def send(self) -> None:
        """Copy the gradients in (missing ones as zeros, their flags 0, the others' 1) and
        start the all_reduce (no host sync: the flags are filled on the device)."""
        if self.work is not None:  # a resend (`dirty`): the earlier reduction must finish first
            self.work.wait()
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        if len(have) < len(self.params):
            self.flat.zero_()
            if have:
                torch._foreach_add_([self.flags[i : i + 1] for i in have], 1.0)
        else:
            self.flags.fill_(1.0)
        if have:
            grads = [self.params[i].grad for i in have]
            torch._foreach_copy_([self.views[i] for i in have], grads)
        self.work = dist.all_reduce(self.flat, async_op=True)
        self.sent = True

    def finish(self, w: int) -> None:
        """Wait for the all_reduce and write the averages into the parameters' gradients
        (a parameter no rank had a gradient for keeps None)."""
        self.work.wait()
        self.work = None
        self.flat.div_(w)
        used = _used_elsewhere(self.params, self.flags)
        dst, src = [], []
        for i, (v, p) in enumerate(zip(self.views, self.params)):
            if p.grad is None:
                if used[i]:
                    p.grad = v.clone()
            else:
                dst.append(p.grad)
                src.append(v)
        if dst:
            torch._foreach_copy_(dst, src)


class GradReducer:
    """Averages the optimizer's gradients across ranks, overlapped with the last backward.

    The parameters are grouped into buckets of about `bucket_mb` MB (per dtype and device), in
    reverse registration order at first (roughly the order the backward produces gradients)
    and, after the first overlapped step, in the order the gradients actually became ready
    (rank 0's order, broadcast: DDP's bucket rebuild). A post-accumulate-grad hook on every
    parameter counts its bucket's ready gradients; in the last backward of an optimizer step
    (`prepare(..., last=True)`), a complete bucket is copied into its flat buffer and
    all-reduced asynchronously while the backward goes on. Buckets are sent strictly in
    order, so every rank issues the same collectives in the same order. `finish()` sends the
    buckets that are not complete (parameters without a gradient count as zero: unused in this
    step on this rank, as `average_gradients`; unused on every rank, they keep None), waits (on a GPU: the compute stream waits, the
    host does not), and writes the average into each `p.grad`. The collectives are the same
    on every rank: each bucket once, in order, then again (in order) each bucket that holds a
    parameter whose gradient was accumulated twice in the backward (reached twice, e.g. by a
    re-entrant checkpoint); which parameters those are depends on the graph, which is the
    same on every rank (as DDP assumes), not on timing.

    Earlier micro-batches of gradient accumulation only accumulate (the hooks are idle); a
    step that is skipped (no backward of the last micro-batch) sends nothing. Other backward
    passes on the model outside the step (importance passes) find the hooks idle too. The
    result equals `average_gradients` up to the order of the float sums over ranks (with
    2 ranks: identical).
    """

    def __init__(self, bucket_mb: float = BUCKET_MB) -> None:
        self.cap = max(1, int(bucket_mb * 2**20))
        self._key: tuple[int, ...] = ()
        self._params: list[torch.nn.Parameter] = []
        self._hooks: list = []
        self._buckets: list[_Bucket] = []
        self._where: list[tuple[int, int]] = []  # param index -> (bucket, slot)
        self._armed = False
        self._overlapped = False  # this step's last backward was armed (same on every rank)
        self._next = 0  # the next bucket to send
        self._ready_order: list[int] = []
        self._rebuilt = False
        #: buckets sent during the last backward (before `finish`): the overlap, for tests and
        #: benchmarks
        self.sent_in_backward = 0

    @property
    def buckets(self) -> list[list[int]]:
        """The parameter indices of each bucket, in sending order."""
        return [list(b.indices) for b in self._buckets]

    def _build(self, params: Sequence[torch.nn.Parameter], order: list[int] | None) -> None:
        for h in self._hooks:
            h.remove()
        self._params = list(params)
        self._key = tuple(id(p) for p in params)
        order = list(range(len(params)))[::-1] if order is None else order
        groups: list[list[int]] = []
        open_: dict[tuple, list[int]] = {}  # (dtype, device) -> the bucket being filled
        size: dict[tuple, int] = {}
        for i in order:
            p = params[i]
            k = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            if k not in open_ or (size[k] + nbytes > self.cap and open_[k]):
                open_[k], size[k] = [], 0
                groups.append(open_[k])
            open_[k].append(i)
            size[k] += nbytes
        self._buckets = [_Bucket([params[i] for i in g], g) for g in groups]
        self._where = [(0, 0)] * len(params)
        for b, bucket in enumerate(self._buckets):
            for s, i in enumerate(bucket.indices):
                self._where[i] = (b, s)
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))
            for i, p in enumerate(params)
        ]
        self._armed, self._next = False, 0

    def prepare(self, params: Sequence[torch.nn.Parameter], last: bool) -> None:
        """Before a backward: `params` are the optimizer's parameters; `last` = this backward
        ends an optimizer step that will be taken (send buckets as gradients become ready)."""
        if world_size() == 1:
            return
        if tuple(id(p) for p in params) != self._key:
            self._build(params, None)
            self._rebuilt = False
        self._drain()
        self._armed = self._overlapped = last
        self._next = 0
        self._ready_order = []
        self.sent_in_backward = 0
        for b in self._buckets:
            b.reset()

    def _drain(self) -> None:
        for b in self._buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None

    def _ready(self, i: int) -> None:
        if not self._armed:
            return
        b, s = self._where[i]
        bucket = self._buckets[b]
        if bucket.seen[s]:  # reached again in this backward: `finish` sends the bucket again
            bucket.dirty = True
            return
        bucket.seen[s] = True
        bucket.pending -= 1
        self._ready_order.append(i)
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._buckets[self._next].send()
            self._next += 1
            self.sent_in_backward += 1

    @torch.no_grad()
    def finish(self, params: Sequence[torch.nn.Parameter]) -> None:
        """After the last backward of a step: every parameter's gradient is the rank mean."""
        w = world_size()
        if w == 1:
            return
        if tuple(id(p) for p in params) != self._key:  # not prepared for these parameters
            self.prepare(params, last=False)
        self._armed = False
        rebuild = self._overlapped and not self._rebuilt
        for bucket in self._buckets:  # every bucket once, in order (the early ones are sent)
            if not bucket.sent:
                bucket.send()
        for bucket in self._buckets:  # then, in order, those with a gradient accumulated twice
            if bucket.dirty:
                bucket.send()
        for bucket in self._buckets:
            bucket.finish(w)
            bucket.reset()
        self._overlapped = False
        if rebuild:  # a collective: decided by the control flow, not by this rank's hooks
            self._rebuild()

    def _rebuild(self) -> None:
        """Buckets in the order gradients became ready (rank 0's), as DDP rebuilds them."""
        seen = set(self._ready_order)
        order = self._ready_order + [i for b in self._buckets for i in b.indices if i not in seen]
        dev = self._params[0].device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(order, dtype=torch.long, device=dev)
        dist.broadcast(t, 0)
        self._build(self._params, t.tolist())
        self._rebuilt = True


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank `src`'s."""
    if world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src)
