"""The collectives the merge operators need when the weights are sharded (`cvl train --fsdp`,
`cvl.train.fsdp`): a merge's element-wise arithmetic runs on each process's shards as it is,
but a statistic over whole tensors or the whole model needs the other processes' shards.
Each function here gives exactly the unsharded result:

- `global_kthvalue`: the k-th smallest of all entries of many tensors (TIES's trim
  threshold) by a bisection over the entries' bit patterns, one all-reduce of a count per
  step (≤ 64 for float64), nothing gathered;
- `whole`: an operator applied to whole tensors, gathered one tensor at a time and resharded
  after (OPCM's SVD of one weight matrix; Breadcrumbs' top-k along a sharded dimension).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from cvl.train.fsdp import full, is_dtensor, reshard_like

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _local_entries(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """This process's entries of `tensors`, flat, in their promoted dtype (`torch.cat`'s):
    its slice of each sharded tensor, and the whole tensors (replicated on every process)
    on process 0 only, so that every entry is counted once."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    parts = [t.to_local().reshape(-1) if is_dtensor(t) else t.reshape(-1) for t in tensors]
    keep = [p for t, p in zip(tensors, parts) if is_dtensor(t) or main]
    dtype = torch.cat([p[:0] for p in parts]).dtype if parts else torch.float32
    dev = parts[0].device if parts else torch.device("cpu")
    return (
        torch.cat([p.to(dtype) for p in keep]) if keep else torch.zeros(0, dtype=dtype, device=dev)
    )


@torch.no_grad()
def global_kthvalue(tensors: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """The k-th smallest (1-based) of all entries of `tensors`, which must be ≥ 0 (|τ|), as
    `torch.cat([t.flatten() ...]).kthvalue(k)` gives it on the whole tensors.

    For non-negative floats the order of the values is the order of their bit patterns read
    as integers, so the smallest pattern b with #{entries ≤ b} ≥ k is found by bisection,
    each step one all-reduced count (a 0-d int64)."""
    x = _local_entries(tensors)
    bits = x.view(_INT[x.element_size()]).to(torch.int64)
    top = bits.max() if bits.numel() else torch.zeros((), dtype=torch.int64, device=bits.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    lo, hi = 0, int(top)
    while lo < hi:
        mid = (lo + hi) // 2
        count = (bits <= mid).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count)
        if int(count) >= k:
            hi = mid
        else:
            lo = mid + 1
    pattern = torch.tensor([lo], dtype=torch.int64).to(_INT[x.element_size()])
    return pattern.view(x.dtype)[0].to(x.device)


def whole(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """`fn` of the whole tensors, sharded as the first one is (a collective per sharded
    argument; for unsharded arguments simply `fn(*tensors)`)."""
    if not any(is_dtensor(t) for t in tensors):
        return fn(*tensors)
    return reshard_like(fn(*(full(t) for t in tensors)), tensors[0])
