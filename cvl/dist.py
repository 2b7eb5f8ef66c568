"""Distributed helpers (torch.distributed through the process group Accelerate created).

Every helper is the identity in a single process, so methods call them unconditionally.
Ranks hold contiguous slices of each global batch (see `cvl.data.reader.rank_slice`), so
gathering in rank order restores the global batch order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All ranks' rows concatenated in rank order; gradients flow back to every rank's rows.

    Assumes equal row counts on all ranks (global batches are cut into equal slices).
    """
    if world_size() == 1:
        return x
    return torch.cat(dist_fn.all_gather(x.contiguous()), dim=0)


@torch.no_grad()
def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """All ranks' rows concatenated in rank order, without gradient (queues, old models)."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


def local_rows(n_local: int) -> slice:
    """This rank's rows inside a gathered global batch."""
    return slice(rank() * n_local, (rank() + 1) * n_local)


@torch.no_grad()
def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (in place on a copy); used for logging and importance terms."""
    if world_size() == 1:
        return x
    y = x.detach().clone()
    dist.all_reduce(y)
    return y / world_size()


@torch.no_grad()
def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average gradients across ranks with one coalesced all_reduce (DDP's arithmetic).

    The model is not wrapped in DDP, so methods use the plain module and extra passes through
    sub-encoders need no DDP bookkeeping; parameters without a gradient count as zero.
    """
    w = world_size()
    if w == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= w
    off = 0
    for p, g in zip(params, grads):
        n = g.numel()
        if p.grad is None:
            p.grad = flat[off : off + n].view_as(p).clone()
        else:
            p.grad.copy_(flat[off : off + n].view_as(p))
        off += n


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank `src`'s."""
    if world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src)
