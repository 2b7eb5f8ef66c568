"""The layers of MoE-Adapters4CL (`cvl.methods.moe_adapters`): the adapters, the noisy top-k
router, the mixture that joins the MLP branch of a transformer block, the DDAS autoencoders,
and how they attach to a cvl CLIP model so that `cvl eval` rebuilds them from run.json.

Source: JiazuoYu/MoE-Adapters4CL, `mtil/clip/adapter.py` (`Adapter`), `mtil/clip/model.py`
(`ResidualAttentionBlock.noisy_top_k_gating`, `.forward`), `mtil/src/models/AutoEncoder.py`
(`Autoencoder`, `encoder_criterion`), `mtil/src/models/evaluation.py` (`zeroshot_eval`).
The equations and every choice are in `cvl.methods.moe_adapters`' docstring.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.dist import row_span
from cvl.errors import CvlError

#: The model-config key that carries the layers' settings (`model_from_config` attaches them).
CONFIG_KEY = "moe_adapters"
TOWERS = ("both", "image", "text")


class Adapter(nn.Module):
    """One expert: x → up(dropout(ReLU(down(x)))) · scale, no residual (the source's `Adapter`
    with `adapter_layernorm_option='none'`, `init_option='lora'`: down Kaiming-uniform(a=√5),
    up and both biases zero, so a fresh expert adds 0)."""

    def __init__(self, dim: int, bottleneck: int, scale: float, dropout: float) -> None:
        super().__init__()
        self.down = nn.Linear(dim, bottleneck)
        self.up = nn.Linear(bottleneck, dim)
        self.scale, self.dropout = scale, dropout
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
            nn.init.zeros_(self.down.bias)
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor, drop_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = F.relu(self.down(x))
        if drop_mask is not None:  # inverted dropout with a mask drawn for the global batch
            h = h * drop_mask.to(h.dtype) / (1.0 - self.dropout)
        return self.up(h) * self.scale


def top_k_gates(
    clean: torch.Tensor,
    k: int,
    noise_std: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """The source's `noisy_top_k_gating` gates [B, E]: logits = clean (+ noise · noise_std in
    training), the k largest per row kept, a softmax over those k (over the experts, dim 1),
    zeros elsewhere."""
    logits = clean if noise is None else clean + noise * noise_std
    top, idx = logits.topk(min(k, logits.shape[1]), dim=1)
    return torch.zeros_like(logits).scatter(1, idx, torch.softmax(top, dim=1))


class MoEAdapter(nn.Module):
    """E experts and one router (w_gate[t], w_noise[t] ∈ R^{d×E}, zero-initialised) per task.

    Each task's router is its own parameter (the source's `router_list`, `w_noise_list`), so a
    finished task's router is in no later task's optimizer: no weight decay or moment moves it
    (one stacked [T, d, E] parameter would put every row in the decay group of every task).

    `forward(x)` with `routes` set (`routed`): x [B, L, d] (batch first), routes [B] (a task
    index per row, −1: no adapter, the zero-shot block). Each row's router reads its first
    token; its output is Σ_e g_e · expert_e(x) over the whole sequence (the source's
    `SparseDispatcher.combine`; computed densely, see `cvl.methods.moe_adapters`).
    `counts` accumulates, in training, how often each expert was among a row's top k (the
    source's `choose_map`); `frozen` marks experts frozen after an earlier task (model state).
    """

    #: what a forward that cached accumulation runs again leaves as it was (`cvl.train.accum`):
    #: the choices are counted once per micro-batch
    replayed_state = ("pending",)

    def __init__(self, dim: int, spec: dict[str, Any]) -> None:
        super().__init__()
        e, t = int(spec["experts"]), int(spec["tasks"])
        self.k, self.noise_eps, self.dropout = int(spec["top_k"]), float(spec["noise_eps"]), 0.0
        self.dropout = float(spec["dropout"])
        self.experts = nn.ModuleList(
            Adapter(dim, int(spec["bottleneck"]), float(spec["scale"]), self.dropout)
            for _ in range(e)
        )
        self.w_gate = nn.ParameterList(nn.Parameter(torch.zeros(dim, e)) for _ in range(t))
        self.w_noise = nn.ParameterList(nn.Parameter(torch.zeros(dim, e)) for _ in range(t))
        self.register_load_state_dict_pre_hook(_split_stacked_routers)
        self.register_buffer("counts", torch.zeros(e, dtype=torch.float64))
        self.register_buffer("frozen", torch.zeros(e, dtype=torch.bool))
        self.routes: torch.Tensor | None = None  # set around each encode (`routed`)
        self.seed: int | None = None  # per step (the method's before_step): same on all ranks
        self.salt = 0  # this layer's place (tower, block): each layer draws its own noise
        self.pending = torch.zeros(e, dtype=torch.float64)  # choices since the last step

    def take_pending(self) -> torch.Tensor:
        """The choice counts since the last call (then zero), on the counts' device."""
        p, self.pending = self.pending, torch.zeros_like(self.pending)
        return p.to(self.counts.device)

    def _draw(self, shape: tuple[int, ...], n_local: int, salt: int, device: Any) -> torch.Tensor:
        """Standard normal noise for this rank's rows of the global batch (so N processes
        draw what one process with all rows would), from the step's seed; else torch's RNG."""
        if self.seed is None:
            return torch.randn((n_local, *shape), device=device)
        from cvl.data.reader import sample_seed

        g = torch.Generator().manual_seed(sample_seed(self.seed, self.salt, salt))
        total, rows = row_span(n_local)  # cached accumulation: the step's batch (cvl.dist)
        full = torch.randn((total, *shape), generator=g)
        return full[rows].to(device)

    def gates(self, x0: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        """Gates [B, E] of the rows' routers on their first tokens x0 [B, d]."""
        r = routes.clamp(min=0)
        clean = torch.einsum("bd,bde->be", x0, _rows(self.w_gate, r).to(x0.dtype))
        if not self.training:
            return top_k_gates(clean, self.k)
        raw = torch.einsum("bd,bde->be", x0, _rows(self.w_noise, r).to(x0.dtype))
        std = F.softplus(raw) + self.noise_eps
        noise = self._draw((clean.shape[1],), x0.shape[0], 0, x0.device).to(x0.dtype)
        return top_k_gates(clean, self.k, std, noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routes = self.routes
        if routes is None:
            raise CvlError("MoE adapters ran without routes (call through `routed`)")
        g = self.gates(x[:, 0], routes) * (routes >= 0)[:, None].to(x.dtype)
        if self.training:
            with torch.no_grad():
                self.pending = self.pending.to(g.device) + (g > 0).sum(0).to(torch.float64)
        # every expert on every row, weighted by its gate (0 off the row's top k): the same
        # sum as the code's sparse dispatch, without reading the gates back to the host
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = None
            if self.training and self.dropout > 0:
                u = self._draw((x.shape[1], expert.down.out_features), x.shape[0], 1 + e, x.device)
                mask = torch.special.ndtr(u) >= self.dropout
            y = y + (g[:, e, None, None] * expert(x, mask)).to(y.dtype)
        return y


def _rows(routers: nn.ParameterList, r: torch.Tensor) -> torch.Tensor:
    """The routers [B, d, E] of the rows' tasks r [B]."""
    return torch.stack(list(routers))[r]


def _split_stacked_routers(module, state_dict, prefix, *_args) -> None:
    """A checkpoint from before the routers were one parameter per task (`w_gate` [T, d, E])
    loads as T parameters (`w_gate.0` ...)."""
    for name in ("w_gate", "w_noise"):
        stacked = state_dict.pop(prefix + name, None)
        if stacked is not None:
            for i, row in enumerate(stacked.unbind(0)):
                state_dict[f"{prefix}{name}.{i}"] = row


def _block_forward(self: nn.Module, q_x, k_x=None, v_x=None, attn_mask=None):
    """open_clip's `ResidualAttentionBlock.forward` with the mixture added in parallel to the
    MLP branch: x ← x + MLP(LN(x)) + MoE(x) (the source's `ffn_option='parallel'`)."""
    k_x = self.ln_1_kv(k_x) if hasattr(self, "ln_1_kv") and k_x is not None else None
    v_x = self.ln_1_kv(v_x) if hasattr(self, "ln_1_kv") and v_x is not None else None
    x = q_x + self.ls_1(self.attention(q_x=self.ln_1(q_x), k_x=k_x, v_x=v_x, attn_mask=attn_mask))
    if self.moe_batch_first:
        y = self.moe(x)
    else:  # LND
        y = self.moe(x.transpose(0, 1)).transpose(0, 1)
    return x + self.ls_2(self.mlp(self.ln_2(x))) + y


_CLASSES: dict[type, type] = {}


def _moe_block_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"MoE{cls.__name__}", (cls,), {"forward": _block_forward})
    return _CLASSES[cls]


def tower_blocks(model: nn.Module, tower: str) -> list[nn.Module]:
    """open_clip's residual attention blocks of a tower (none for a ResNet image tower)."""
    c = model.clip
    t = (
        getattr(c.visual, "transformer", None)
        if tower == "image"
        else getattr(c, "transformer", None)
    )
    if t is None or not hasattr(t, "resblocks"):
        return []
    for b in t.resblocks:
        b.moe_batch_first = bool(getattr(t, "batch_first", True))
    return list(t.resblocks)


class Autoencoders(nn.Module):
    """DDAS: one autoencoder per task on a tower's frozen features u (unit norm, dim D):
    target z = σ(√D·u), ẑ_t = σ(W2_t·ReLU(W1_t·z + b1_t) + b2_t), error e_t = mean((ẑ_t − z)²)
    (the source's `Autoencoder` + `encoder_criterion`, per sample here)."""

    def __init__(self, dim: int, code: int, tasks: int) -> None:
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(dim, code) for _ in range(tasks))
        self.dec = nn.ModuleList(nn.Linear(code, dim) for _ in range(tasks))
        self.register_buffer("threshold", torch.zeros(()))

    @staticmethod
    def target(u: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(u.float() * math.sqrt(u.shape[-1]))

    def error(self, u: torch.Tensor, t: int) -> torch.Tensor:
        """Per-sample reconstruction error [B] of autoencoder t."""
        z = self.target(u).to(self.enc[t].weight.dtype)
        rec = torch.sigmoid(self.dec[t](F.relu(self.enc[t](z))))
        return ((rec - z) ** 2).mean(dim=-1)

    def errors(self, u: torch.Tensor, n: int) -> torch.Tensor:
        """Errors [B, n] of the first n (trained) autoencoders."""
        return torch.stack([self.error(u, t) for t in range(n)], dim=1)


def select(errors: torch.Tensor, threshold: float) -> torch.Tensor:
    """DDAS's rule (`zeroshot_eval`): the task whose autoencoder reconstructs best, or −1 (the
    frozen zero-shot model) when even that error exceeds the threshold (≤ 0: no fallback)."""
    best, task = errors.min(dim=1)
    if threshold > 0:
        task = torch.where(best > threshold, torch.full_like(task, -1), task)
    return task


class MoEState(nn.Module):
    """The model's MoE bookkeeping: the DDAS autoencoders of each adapted tower and how many
    tasks are trained (`done`: the autoencoders and routers DDAS may choose)."""

    def __init__(self, dim: int, spec: dict[str, Any], towers: list[str]) -> None:
        super().__init__()
        t = int(spec["tasks"])
        self.ddas = nn.ModuleDict({w: Autoencoders(dim, int(spec["code"]), t) for w in towers})
        self.register_buffer("done", torch.zeros((), dtype=torch.long))
        self.task = 0  # the router that trains (the method's before_task)


def adapted_towers(model: nn.Module, towers: str) -> list[str]:
    want = ("image", "text") if towers == "both" else (towers,)
    return [w for w in want if tower_blocks(model, w)]


def attach(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    """Add the mixture to every transformer block of the chosen towers and DDAS to the model;
    the model's config records `spec`, so `model_from_config` rebuilds the same layers. The
    BatchNorm layers (a ResNet tower's) keep their running statistics, as every CLIP weight."""
    if getattr(model, "kind", None) != "clip":
        raise CvlError("method 'moe_adapters' needs --model clip (open_clip transformer blocks)")
    if hasattr(model, "moe_state"):
        return model
    towers = adapted_towers(model, spec["towers"])
    if not towers:
        raise CvlError(
            f"method 'moe_adapters': towers={spec['towers']} has no transformer blocks in this "
            "model (a ResNet image tower has none: use towers=text or both)"
        )
    for w in towers:
        for j, b in enumerate(tower_blocks(model, w)):
            b.moe = MoEAdapter(int(b.ln_2.normalized_shape[0]), spec)
            b.moe.salt = 1000 * (w == "text") + j
            b.__class__ = _moe_block_class(type(b))
    from cvl.models.tune import _eval_mode

    for mod in model.modules():  # CLIP stays the start model: BatchNorm statistics too
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            if _eval_mode not in mod._forward_pre_hooks.values():
                mod.register_forward_pre_hook(_eval_mode)
    model.moe_state = MoEState(int(model.embed_dim), spec, towers)
    model.moe_spec = dict(spec)
    model.__class__ = _moe_model_class(type(model))
    return model


def moe_layers(model: nn.Module, tower: str) -> list[MoEAdapter]:
    return [b.moe for b in tower_blocks(model, tower) if hasattr(b, "moe")]


@contextlib.contextmanager
def routed(model: nn.Module, tower: str, routes: torch.Tensor):
    """Run a tower's mixtures with these per-row routes (−1: no adapter)."""
    layers = moe_layers(model, tower)
    for m in layers:
        m.routes = routes
    try:
        yield
    finally:
        for m in layers:
            m.routes = None


def _base(self: nn.Module) -> Any:
    """The model's methods below its MoE class (`--fsdp` subclasses the class once more)."""
    moe = next(c for c in type(self).__mro__ if c in _CLASSES.values())
    return super(moe, self)


def _encode(self: nn.Module, tower: str, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    base = _base(self)
    with routed(self, tower, routes):
        return (base.encode_image if tower == "image" else base.encode_text)(x, normalize=False)


def zero_shot_features(model: nn.Module, tower: str, x: torch.Tensor) -> torch.Tensor:
    """The frozen model's unnormalised features (every adapter off): DDAS reads them."""
    routes = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
    return _encode(model, tower, x, routes)


def ddas_routes(model: nn.Module, tower: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes, unnormalised zero-shot features) of a batch: DDAS's choice per sample."""
    st = model.moe_state
    f0 = zero_shot_features(model, tower, x)
    n = int(st.done)
    if n == 0:
        return torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device), f0
    ae = st.ddas[tower]
    u = F.normalize(f0.float(), dim=-1)
    return select(ae.errors(u, n), float(ae.threshold)), f0


def _encode_tower(self: nn.Module, tower: str, x: torch.Tensor, normalize: bool) -> torch.Tensor:
    st = self.moe_state
    if tower not in st.ddas:  # a tower without adapters: the plain encoder
        base = _base(self)
        f = (base.encode_image if tower == "image" else base.encode_text)(x, normalize=False)
    elif self.training:  # the task being trained: its own router for every row
        routes = torch.full((x.shape[0],), st.task, dtype=torch.long, device=x.device)
        f = _encode(self, tower, x, routes)
    else:  # deployed: DDAS per sample; −1 rows are exactly the zero-shot model
        with torch.no_grad():
            routes, u = ddas_routes(self, tower, x)
        f = _encode(self, tower, x, routes) if bool((routes >= 0).any()) else u
    return F.normalize(f, dim=-1) if normalize else f


def _moe_model_class(cls: type) -> type:
    if cls in _CLASSES:
        return _CLASSES[cls]

    def encode_image(self, images, normalize=True):
        return _encode_tower(self, "image", images, normalize)

    def encode_text(self, tokens, normalize=True):
        return _encode_tower(self, "text", tokens, normalize)

    def config(self):
        return {**cls.config(self), CONFIG_KEY: copy.deepcopy(self.moe_spec)}

    _CLASSES[cls] = type(
        f"MoE{cls.__name__}",
        (cls,),
        {"encode_image": encode_image, "encode_text": encode_text, "config": config},
    )
    return _CLASSES[cls]
