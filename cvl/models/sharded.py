"""What the model layer needs to know of a sharded model (`cvl train --fsdp`): whether a
model or tensor is sharded, the names of its tied tensors, and whole tensors copied into its
shards. Here, not in `cvl.train.fsdp`, so that writing and reading weights
(`cvl.models.weights`) does not depend on the training package."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_TIED = "_cvl_tied"  # on a sharded model: {dropped name: kept name} of its tied tensors


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_sharded(model: Any) -> bool:
    """Whether `model` was sharded (`cvl.train.fsdp.shard_`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def tied_names(model: nn.Module) -> dict[str, str]:
    """{dropped name: kept name} of the state dict's tied tensors, as `save_weights` (and
    safetensors' `save_model`) drop them: the first name in sorted order is kept."""
    groups: dict[int, list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(v), []).append(k)
    out = {}
    for names in groups.values():
        names = sorted(names)
        out.update({n: names[0] for n in names[1:]})
    return out


def reshard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`whole` sharded as `like` is (this process's slice, no communication) on `like`'s
    device; for a `like` that is not sharded, `whole` on its device."""
    whole = whole.to(like.device)
    if not is_dtensor(like):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


def assign(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst ← src in place, whichever of them is sharded (a whole `src` is sliced)."""
    with torch.no_grad():
        if is_dtensor(dst) and not is_dtensor(src):
            src = reshard_like(src.to(dst.dtype), dst)
        elif is_dtensor(src) and not is_dtensor(dst):
            src = src.full_tensor()
        dst.copy_(src)


def load_state_(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list, list]:
    """Copy whole tensors (plain names) into a sharded model, each process its slice;
    returns (missing, unexpected) names (a tied name counts as given with its partner)."""
    ties = getattr(model, _TIED, {})
    live = model.state_dict()
    unexpected = sorted(set(state) - set(live))
    missing = sorted(k for k in live if k not in state and ties.get(k) not in state)
    for k, v in state.items():
        if k in live:
            assign(live[k], v)
    return missing, unexpected
