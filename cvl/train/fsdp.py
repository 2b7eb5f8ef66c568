"""FSDP2 (`cvl train --fsdp`): the model's parameters, gradients and optimizer state sharded
over the processes, and every model a method holds sharded on the same plan.

**The plan** (`shard_units`): each transformer block (open_clip's `resblocks`, timm's ViT
`blocks`, the BERT `layer`s of the fusion model's text and fusion encoders) is one FSDP unit,
then the towers a forward enters whole (open_clip's `visual`, a custom `text` tower, the
token embedding; the fusion model's ViT), then the model itself (the rest: projections, final
norms, the fusion model's word embeddings with the MLM decoder tied to them). A unit is
all-gathered when its forward starts and freed when it ends (the model's own group stays
gathered from its forward to the end of the backward); gradients are reduce-scattered,
averaged over the processes, as DDP's all-reduce averages them. The model's methods that
methods call outside `forward` (`encode_image`, `encode_text`, `logit_scale`, the fusion
encoder's `fusion_cls`, `mlm_logits`, ...) are registered as FSDP forward methods, so they
gather what they use. Scalar parameters (open_clip's logit scale; FSDP2 refuses 0-d tensors)
stay whole on every process and are averaged by `cvl.dist.GradReducer` like today.

**Sharded tensors.** A sharded parameter is a DTensor (`Shard(0)` over the processes); the
state a method builds from it (`zeros_like(p)`, `p.detach().clone()`: anchors, importance,
path integrals, EMA and merge weights) is sharded alike, so element-wise updates touch only
the local shard and need no communication, and a reduction (a penalty's sum, a norm, a
cosine) is a DTensor with a pending sum that `plain` resolves with one all-reduce: the
result equals the unsharded one (up to the order of float sums). What needs the whole
tensor (a checkpoint, an SVD) gathers it (`full`).

**Files stay as they are.** `model.safetensors`, `method_state.*` and last/'s optimizer
state hold whole tensors (gathered one tensor at a time, written by one process), so eval,
analysis, export and a resume with or without `--fsdp` read the same files; loading takes
each process's slice of the whole tensor (`load_state_`, `reshard_like`) without
communication.

**Evaluation inside training** (best-val selection, buffer features) runs the model
gathered (`gathered`): each process may embed a different number of batches there, which a
sharded forward (a collective per unit) cannot allow.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cvl.errors import CvlError
from cvl.models.sharded import (  # noqa: F401  (re-exported: the training side's names)
    _TIED,
    assign,
    is_dtensor,
    is_sharded,
    load_state_,
    reshard_like,
    tied_names,
)

#: the model's methods that methods call outside `forward` (gather the model's own group)
FORWARD_METHODS = (
    "encode_image",
    "encode_text",
    "logit_scale",
    "image_tokens",
    "text_hidden",
    "fuse",
    "fusion_cls",
    "mlm_logits",
    "mlm_loss",
)
#: towers a forward enters through one module call, with the methods that enter them
TOWERS = {
    "clip.visual": ("forward",),
    "clip.text": ("forward",),
    "clip.token_embedding": ("forward",),
    "visual_encoder": ("forward", "forward_features"),
}
#: names of the module lists whose elements are transformer blocks
_BLOCKS = re.compile(r"(^|\.)(resblocks|blocks|layer)$")
_mesh: Any = None
_own_group = False  # a one-process group made here (a launcher's group is not ours to end)


# -- what is sharded -----------------------------------------------------------------------------
def device_mesh(device: torch.device) -> Any:
    """The 1-D mesh of all processes (one process: a group of one, which shards nothing)."""
    global _mesh, _own_group
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _own_group = True
    if _mesh is None or _mesh.device_type != device.type or _mesh.size() != dist.get_world_size():
        _mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return _mesh


def release() -> None:
    """End the one-process group `device_mesh` made, if it did (at the end of a run)."""
    global _mesh, _own_group
    if _own_group and dist.is_initialized():
        dist.destroy_process_group()
    _mesh, _own_group = None, False


def _owns_its_params(unit: nn.Module, model: nn.Module) -> bool:
    """No parameter of `unit` is reachable from outside it (tied weights stay together)."""
    inside = {id(p) for p in unit.parameters()}
    if not inside:
        return False
    mine = {id(m) for m in unit.modules()}
    for m in model.modules():
        if id(m) in mine:
            continue
        if any(id(p) in inside for p in m.parameters(recurse=False)):
            return False
    return True


def shard_units(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(name, module, forward methods) of each FSDP unit below the model, innermost first
    (module doc): the transformer blocks, then the towers."""
    units: list[tuple[str, nn.Module, tuple[str, ...]]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and _BLOCKS.search(name):
            for i, blk in enumerate(mod):
                if _owns_its_params(blk, model):
                    units.append((f"{name}.{i}", blk, ("forward",)))
    mods = dict(model.named_modules())
    for name, methods in TOWERS.items():
        if name in mods and _owns_its_params(mods[name], model):
            units.append((name, mods[name], methods))
    return units


def _policy(precision: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":  # gathered and computed in bf16, gradients reduced in float32
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_(model: nn.Module, device: torch.device, precision: str = "no") -> nn.Module:
    """Shard `model` in place on the plan of `shard_units` over all processes (its weights
    must be on `device` and equal on every process); returns it. `precision` bf16: units are
    gathered and computed in bf16, gradients reduced in float32 (FSDP2's policy)."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh(device)
    ties = tied_names(model)
    scalars = {p for p in model.parameters() if p.dim() == 0}  # FSDP2 refuses 0-d tensors
    kw = {"mesh": mesh, "mp_policy": _policy(precision), "ignored_params": scalars}
    for _, unit, methods in shard_units(model):
        fully_shard(unit, **kw)
        for m in methods:
            if m != "forward":
                _forward_method(unit, m)
    fully_shard(model, **kw)
    model._cvl_precision = precision
    for m in FORWARD_METHODS:
        if hasattr(model, m):
            _forward_method(model, m)
    setattr(model, _TIED, ties)
    return model


def _forward_method(module: nn.Module, name: str) -> None:
    """`register_fsdp_forward_method` (the method gathers its unit's weights as `forward`
    does), except when called inside the unit's own forward (`forward` calling
    `encode_image`): torch's would end that inner call as if the forward ended, and the
    model's own group would be freed at the end of `forward` instead of after the backward."""
    import functools

    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    orig = getattr(module, name)

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self._get_fsdp_state()
        if state._training_state == TrainingState.FORWARD:  # inside forward: gathered
            return orig(*args, **kwargs)
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, orig(*args, **kwargs))

    setattr(module, name, wrapped.__get__(module, type(module)))


def reshard(model: nn.Module) -> None:
    """Free whatever of a sharded model is gathered (its own group stays gathered after a
    forward without a backward), so that `model.parameters()` are the sharded parameters
    again: hooks that keep per-parameter state or build an optimizer see the shards."""
    for m in fsdp_modules(model):
        m.reshard()


def fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


# -- sharded and whole tensors -------------------------------------------------------------------
def plain(t: Any) -> Any:
    """A DTensor as the whole tensor it stands for (a pending sum all-reduced, a shard
    gathered; differentiable), anything else unchanged."""
    return t.full_tensor() if is_dtensor(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t` (its shard; all of an unsharded tensor), sharing memory."""
    return t.to_local() if is_dtensor(t) else t


def locals_(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`local` of each (for the `torch._foreach_*` kernels DTensor has no rule for)."""
    return [local(t) for t in tensors]


@torch.no_grad()
def tensor_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each whole tensor (a plain 1-d float tensor), with one all-reduce for
    all the sharded ones (the sum of their shards' squares)."""
    if not any(is_dtensor(t) for t in tensors):
        return torch.stack(torch._foreach_norm(list(tensors))).float()
    sq = torch.stack([n.float() ** 2 for n in torch._foreach_norm([local(t) for t in tensors])])
    sharded = torch.tensor([is_dtensor(t) for t in tensors], device=sq.device)
    summed = torch.where(sharded, sq, torch.zeros_like(sq))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(summed)
    return torch.where(sharded, summed, sq).sqrt()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached (a collective for a DTensor: every process calls it)."""
    return t.detach().full_tensor() if is_dtensor(t) else t.detach()


def to_full(obj: Any, main_only: bool = False) -> Any:
    """A nested state (dicts, lists, tensors, values) with every DTensor gathered whole, on
    the CPU (every process calls it: one collective per DTensor, in the state's order, so
    only one whole tensor is on the device at a time). `main_only`: only the main process
    keeps the whole tensors (the one that writes them); the others get None in their place."""
    if is_dtensor(obj):
        w = obj.detach().full_tensor()
        keep = not main_only or not dist.is_initialized() or dist.get_rank() == 0
        return w.cpu() if keep else None
    if isinstance(obj, dict):
        return {k: to_full(v, main_only) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_full(v, main_only) for v in obj)
    return obj


def reshard_state(obj: Any, model: nn.Module) -> Any:
    """A nested state loaded from disk (whole tensors) with each tensor kept under one of the
    model's state names, at that tensor's whole shape, sharded as the model's is (the
    per-parameter state methods key by parameter name: importance, anchors, merge weights,
    copies of the model)."""
    live = {k: v for k, v in _state_names(model).items() if is_dtensor(v)}
    if not live:
        return obj

    def walk(o: Any) -> Any:
        if isinstance(o, dict):
            out = {}
            for k, v in o.items():
                ref = live.get(k)
                if ref is not None and isinstance(v, torch.Tensor) and v.shape == ref.shape:
                    out[k] = reshard_like(
                        v.to(ref.dtype if v.is_floating_point() else v.dtype), ref
                    )
                else:
                    out[k] = walk(v)
            return out
        if isinstance(o, list):
            return [walk(v) for v in o]
        return o

    return walk(obj)


def _state_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state by name (plain names: adapters' parametrisations left out)."""
    from cvl.models.tune import live_state

    return live_state(model)


def full_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's whole state dict on the CPU (tied tensors once, as `save_weights` writes
    them) for the main process, {} for the others; None for a model that is not sharded.
    Every process calls it (one all-gather per sharded tensor)."""
    if not is_sharded(model):
        return None
    ties = getattr(model, _TIED, {})
    main = dist.get_rank() == 0
    out = {}
    for k, v in model.state_dict().items():
        if k in ties:
            continue
        w = full(v)
        if main:
            out[k] = w.to("cpu", copy=True).contiguous()
    return out


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's state that does not follow it: local shards (sharded model, no
    communication) or CPU copies."""
    if is_sharded(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def load_copy_(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `state_copy` (also from whole tensors read from a file)."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    live = model.state_dict()
    for k, v in state.items():
        assign(live[k], v)


def sharded_copy(model: nn.Module, trainable: bool = False) -> nn.Module:
    """A copy of a sharded model, sharded on the same plan, built from its config and given
    its local shards (no communication); frozen and in eval mode unless `trainable` (then it
    trains the same parameters, in train mode). Adapters are not copied: a copy of a model
    carrying `--tune` adapters is refused by `check_method` first."""
    from cvl.models import model_from_config

    dev = next(iter(model.parameters())).device
    mp = getattr(model, "_cvl_precision", "no")
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        m = model_from_config(model.config())
    if getattr(model, "_cvl_grad_ckpt", False) and trainable:
        m.set_grad_checkpointing(True)
    m.to(dev)
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in m.named_parameters():
        p.requires_grad_(trainable and grads.get(n, False))
    shard_(m, dev, mp)
    from cvl.models.tune import _TRAINED_ATTR

    if hasattr(model, _TRAINED_ATTR):  # what --tune trains (the merges' weights), as a copy
        setattr(m, _TRAINED_ATTR, getattr(model, _TRAINED_ATTR))
    src = model.state_dict()
    with torch.no_grad():
        for k, v in m.state_dict().items():
            v.copy_(src[k].detach())
    m.train(trainable)
    if not trainable:  # no backward frees its own group: free it after each forward
        m._cvl_root_reshard = True
        m.set_reshard_after_forward(True, recurse=False)
    return m


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside the block the sharded model stays whole on every process (gathered once, no
    collective per forward or backward), so processes may run different numbers of forward
    passes (evaluation over uneven slices) and code may read its weights directly (IncCLIP's
    text pass from token embeddings, back-propagated to the embeddings); sharded again
    after. For frozen models or outside a training step (its weights get no gradient
    here). No-op for a plain model."""
    mods = fsdp_modules(model)
    if not mods:
        yield
        return
    # FSDP finds its root at the first forward; a block called directly first would take
    # that role
    model._get_fsdp_state()._lazy_init()
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.set_reshard_after_backward(True, recurse=False)
            m.reshard()
            # blocks and towers free their weights after each forward again (the model's own
            # group too on a frozen copy; a trained model's stays gathered until its backward)
            root = getattr(model, "_cvl_root_reshard", False)
            m.set_reshard_after_forward(m is not model or root, recurse=False)


# -- gradients and the optimizer -------------------------------------------------------------
class ShardedReducer:
    """`cvl.dist.GradReducer` for a sharded model: FSDP reduce-scatters (averages) the
    sharded parameters' gradients in the backward, and only in the last backward of an
    optimizer step (`requires_gradient_sync`); the reducer averages the rest (scalars,
    a method's own parameters) as before."""

    def __init__(self, model: nn.Module, inner: Any) -> None:
        self.model, self.inner = model, inner

    @staticmethod
    def _whole(params: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        return [p for p in params if not is_dtensor(p)]

    def prepare(self, params: Sequence[torch.nn.Parameter], last: bool) -> None:
        self.model.set_requires_gradient_sync(last)
        self.inner.prepare(self._whole(params), last)

    def finish(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.model.set_requires_gradient_sync(True)
        self.inner.finish(self._whole(params))


@torch.no_grad()
def clip_grad_norm_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` (the 2-norm over all gradients, scaled by max/(norm + 1e-6)
    where that is < 1) over sharded and whole gradients together: the shards' squares summed
    and all-reduced, the whole tensors' (equal on every process) added once."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    shards = [g.to_local() for g in grads if is_dtensor(g)]
    whole = [g for g in grads if not is_dtensor(g)]
    dev = (shards or whole)[0].device
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    if shards:
        sq = sq + torch.stack([n.float() ** 2 for n in torch._foreach_norm(shards)]).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq)
    if whole:
        sq = sq + torch.stack([n.float().to(dev) ** 2 for n in torch._foreach_norm(whole)]).sum()
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    local = shards + whole
    torch._foreach_mul_(local, [coef.to(t.device, t.dtype) for t in local])
    return total


def optimizer_state_out(opt: Any) -> dict[str, Any]:
    """`opt.state_dict()` with every sharded moment gathered whole on the CPU of the main
    process (every process calls it; the others keep None), so last/optimizer.pt is the
    file a run without --fsdp writes."""
    sd = opt.state_dict()
    return {"state": to_full(sd["state"], main_only=True), "param_groups": sd["param_groups"]}


def optimizer_state_in(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
    """A whole-tensor optimizer state (`optimizer_state_out`'s, or a run's without --fsdp)
    with each moment sharded as its parameter is, for `opt.load_state_dict`."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, st in sd["state"].items():
        p = params[int(i)]
        state[i] = {
            k: reshard_like(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
            for k, v in st.items()
        }
    return {"state": state, "param_groups": sd["param_groups"]}


# -- what runs under --fsdp ----------------------------------------------------------------------
def check_config(cfg: Any) -> None:
    """One line for the settings `--fsdp` does not train with."""
    if not getattr(cfg, "fsdp", False):
        return
    if cfg.precision == "fp16":
        raise CvlError(
            "--fsdp with --precision fp16: the loss scaler would have to unscale sharded "
            "gradients (torch's ShardedGradScaler is FSDP1's); use --precision bf16"
        )
    if cfg.compile:
        raise CvlError(
            "--fsdp with --compile: not supported yet (the sharded forward is not compiled); "
            "drop one of them"
        )
    budget = str(getattr(cfg, "budget", None) or "")
    if budget and not budget.strip().startswith("samples"):
        raise CvlError(
            f"--fsdp with --budget {budget}: a FLOPs or memory budget measures a step on "
            "copies of the whole model, which is not done sharded; use --budget samples=N"
        )
    from cvl.models.tune import ADAPTER_MODES

    if cfg.tune in ADAPTER_MODES:
        raise CvlError(
            f"--fsdp with --tune {cfg.tune}: adapters are added to and merged into the "
            "model's modules per task, which FSDP2 cannot re-plan once sharded; use --tune "
            "full, bitfit, lnfit, locked-image or locked-text"
        )


def check_method(method: Any) -> None:
    """One line naming what a method lacks under `--fsdp` (its `fsdp` attribute: True, or
    the reason it cannot run sharded)."""
    why = method_support(method)
    if why is not True:
        raise CvlError(f"method '{method.name}' under --fsdp: {why}")


def method_support(method: Any) -> bool | str:
    """True, or why `method` (an instance or class; a wrapper with its base) cannot train
    under `--fsdp`: its `fsdp` attribute (the reason, where it has one), or the adapters
    it needs (`tunes` without full)."""
    for m in (method, getattr(method, "inner", None)):
        why = getattr(m, "fsdp", True) if m is not None else True
        if why is not True:
            return why
    tunes = getattr(method, "tunes", None)
    if tunes and "full" not in tunes:
        return f"it trains adapters (--tune {' or '.join(tunes)}), which --fsdp does not shard"
    return True
