"""Parameter-efficient tuning (`cvl train --tune MODE`): which parameters train, and adapters.

Modes (orthogonal to the method, as `--buffer` is):

- `full`: every parameter trains (the default; nothing here changes the model).
- `lora` (Hu et al. 2022): each target weight W (frozen) becomes W + (α/r)·B·A, A ∈ R^{r×fan_in}
  (Kaiming-uniform, as `nn.Linear` and peft initialise it), B ∈ R^{out×r} = 0; only A and B
  train. Defaults r = 8, α = 8 (peft's `LoraConfig`), targets `linear`. `qkv=split`: a
  MultiheadAttention's fused q/k/v in-projection gets separate rank-r factors for its q, k
  and v rows (ΔW = s·[B_q·A_q; B_k·A_k; B_v·A_v], rank up to 3r; FoMo-in-Flux's `LoRA_MHA`
  with `kv_only: False`); the default `fused` is one factor over all 3d rows (peft's).
- `dora` (Liu et al. 2024): W' = m ⊙ V/‖V‖ with V = W + (α/r)·B·A, ‖·‖ the norm of each output
  row (peft's layout), m (one scale per output row, initialised to ‖W‖) trains with A and B;
  ‖V‖ is detached from the gradient (DoRA §4.3, as peft does).
- `vera` (Kopiczko et al., ICLR 2024): W' = W + Λ_b·B·Λ_d·A with one pair of *frozen random*
  matrices A ∈ R^{r×n_in}, B ∈ R^{n_out×r} shared by every adapted weight (drawn once at the
  largest fan-in / fan-out among the targets; each weight uses the top-left block
  A[:, :fan_in], B[:out, :], VeRA §3.1 and peft's `VeraModel._find_dim` / `Linear.forward`),
  Λ_d = diag(d), Λ_b = diag(b) the trained scaling vectors (d ∈ R^r starts at `d_initial` =
  0.1, b ∈ R^out at 0, peft's `reset_vera_parameters`). A and B are Kaiming-uniform
  (bound √(6/fan_in), peft's `_kaiming_init`) from `projection_seed` (peft's
  `projection_prng_key`, default 0: A drawn first, then B); they are never saved (peft's
  `save_projection=False`): a function of (seed, rank, shapes), rebuilt identically on
  every rank, task and resume. Defaults r = 256 (peft's `VeraConfig`), no α (VeRA has no
  scale; `alpha` is refused).
- `bitfit` (Zaken et al. 2022): only the biases train (every parameter named `*bias`,
  including MultiheadAttention's `in_proj_bias` and norm layers' biases).
- `lnfit`: only the normalisation layers' affine parameters train (LayerNorm, and the
  BatchNorm / GroupNorm of ResNet towers), as FoMo-in-Flux's LNFit.
- `locked-image` / `locked-text`: the image (text) tower is frozen, everything else trains
  (LiT, Zhai et al. 2022; open_clip's `--lock-image` / `--lock-text`). The towers are the
  model's `towers()`; the fusion model's cross-attention layers and MLM head are neither, they
  train in both (its MLM decoder is tied to the word embeddings, so it is frozen with them).

In every mode but `full` the logit scale is frozen unless a locked tower mode keeps it (LiT
trains it; a method may name more parameters that train, `tune_also`: C-CLIP's embeddings), and BatchNorm layers none of whose parameters train keep their running statistics
(they run in eval mode; `--tune-arg bn_stats=train` lets them update, open_clip's default for a
locked tower).

**Adapters** (`lora`, `dora`, `vera`) are `torch.nn.utils.parametrize` parametrizations of the weight
tensors, so they work on any Parameter however the module reads it: open_clip's fused
`in_proj_weight` of `nn.MultiheadAttention` (read inside `F.multi_head_attention_forward`),
the attention-pool projections its ResNet tower passes to that function, timm's and the fusion
BERT's `nn.Linear` weights, convolutions (`targets=conv`: ΔW = (B·A) reshaped, peft's conv
LoRA). peft (0.21) adapts the fused in-projection too (its `lora.MultiheadAttention`, or
`target_parameters`) and equals this there, on Linear and on Conv2d (tests/test_tune_peft.py);
it leaves the attention pool's directly read weights unadapted, refuses DoRA on attention and
applies its MultiheadAttention's out-projection delta twice (docs/methods.md).
Targets: `linear` (every `nn.Linear` weight and MultiheadAttention in-projection), `attn` /
`mlp` (those whose name contains `attn`/`attention`, or not), `conv`, or shell patterns over
parameter names (`targets=*visual*in_proj_weight`); several joined with `+`. Tied weights
(the fusion MLM decoder) and embeddings are never adapted. No LoRA dropout: a
parametrization acts on the weight, not on the layer input (peft's `lora_dropout`).

**Per task**: each task starts with a fresh adapter (A drawn from the run seed and the task
index, B = 0, m = ‖W‖; VeRA: d = `d_initial`, b = 0; so the model computes exactly its start
weights) and ends with the
adapter merged into W (W ← W', then the adapter's delta is zero again). Checkpoints therefore
always hold the plain merged weights under the model's own key names (`cvl.models.save_weights`
writes the effective weights of an adapted model), so `cvl eval`, analysis and `cvl export`
are unchanged; the mid-task checkpoint adds `tune.safetensors` (adapters and base weights) for
an exact resume. Methods see the parametrised model: their importance, anchors and path
integrals cover its trainable parameters (the adapters; IncCLIP's weight-norm clipping and
DHA's blending act on them too); frozen copies (`frozen_copy`: old,
reference and teacher models) are plain merged copies; weight-space methods (WiSE, the
merges, ZSCL's weight ensemble) read and write the effective weights (`effective_state`,
`assign_`), restricted to the tensors the mode trains (`trained_names`).

The adapter modules themselves are in `cvl.models.adapters` (re-exported here).
"""

from __future__ import annotations

import copy
import fnmatch
import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from cvl.checks import POSITIVE_FLOAT, POSITIVE_INT, SEED
from cvl.errors import CvlError
from cvl.models.adapters import (  # noqa: F401  (re-exported: their home was this module)
    Adapter,
    VeraAdapter,
    VeraProjections,
    WeightAdapter,
)

MODES = ("full", "lora", "dora", "vera", "bitfit", "lnfit", "locked-image", "locked-text")
ADAPTER_MODES = ("lora", "dora", "vera")
DEFAULT_ARGS: dict[str, Any] = {
    "rank": 8,
    "alpha": 8.0,
    "targets": "linear",
    "bn_stats": "frozen",
    "d_initial": 0.1,
    "projection_seed": 0,
    "qkv": "fused",
}
VERA_RANK = 256  # peft's VeraConfig.r: the default rank of --tune vera
_ADAPTER_ARGS = ("rank", "alpha", "targets", "d_initial", "projection_seed", "qkv")
# arguments of some adapter modes only (the others refuse them)
_MODE_ARGS = {
    "alpha": ("lora", "dora"),
    "qkv": ("lora", "dora"),
    "d_initial": ("vera",),
    "projection_seed": ("vera",),
}
QKV = ("fused", "split")
# rank >= 1; α > 0 (the adapter's scale α/r: 0 would make every adapter a no-op); VeRA's d
# starts at d_initial > 0 (0 would make its adapters no-ops too)
_LIMITS = {
    "rank": POSITIVE_INT,
    "alpha": POSITIVE_FLOAT,
    "d_initial": POSITIVE_FLOAT,
    "projection_seed": SEED,
}
_PARAM = ".parametrizations."
_TRAINED_ATTR = "_cvl_trained_names"
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


# -- reading and writing the weights of a model that may carry adapters -------------------------


def adapted(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(plain name, owning module, tensor name) of every weight carrying an `Adapter`."""
    out = []
    for mname, m in model.named_modules():
        if not parametrize.is_parametrized(m):
            continue
        for tname, plist in m.parametrizations.items():
            if any(isinstance(p, WeightAdapter) for p in plist):
                out.append((f"{mname}.{tname}" if mname else tname, m, tname))
    return out


def has_adapters(model: nn.Module) -> bool:
    return any(parametrize.is_parametrized(m) for m in model.modules())


def plain_name(key: str) -> str | None:
    """A state-dict key of a parametrised model as the plain model names it; None for adapter
    tensors (`a.parametrizations.w.original` → `a.w`; `a.parametrizations.w.0.lora_A` → None)."""
    if _PARAM not in key:
        return key
    head, _, rest = key.partition(_PARAM)
    name, _, tail = rest.partition(".")
    return f"{head}.{name}" if tail == "original" else None


def _adapters_of(module: nn.Module, tname: str) -> list[WeightAdapter]:
    return [p for p in module.parametrizations[tname] if isinstance(p, WeightAdapter)]


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """W ← W' for every adapted weight, then zero the adapters' delta (same function, plain W)."""
    for _, m, t in adapted(model):
        plist = m.parametrizations[t]
        plist.original.copy_(getattr(m, t))
        for a in _adapters_of(m, t):
            a.zero_(plist.original)


@torch.no_grad()
def scale_adapters_(model: nn.Module, alpha: float) -> None:
    """ΔW ← α·ΔW for every adapter (before `merge_adapters`: W ← W + α·ΔW)."""
    for _, m, t in adapted(model):
        for a in _adapters_of(m, t):
            a.scale_(alpha)


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' own tensors (LoRA's A and B, DoRA's m, VeRA's d and b) by state-dict key,
    detached live tensors; not the base weights they adapt."""
    return {
        k: v.detach()
        for k, v in model.state_dict(keep_vars=True).items()
        if _PARAM in k and plain_name(k) is None
    }


@torch.no_grad()
def load_adapter_tensors(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` (keys as `adapter_tensors` names them, all of them) into the adapters."""
    mine = adapter_tensors(model)
    if set(mine) != set(state):
        raise CvlError(
            f"adapter tensors do not match this model's ({len(state)} given, {len(mine)} here)"
        )
    for k, v in state.items():
        mine[k].copy_(v)


def effective_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under plain names, adapted weights as they compute now (detached;
    the other entries are the live tensors, detached)."""
    out = {}
    eff = {name: (m, t) for name, m, t in adapted(model)}
    for k, v in model.state_dict(keep_vars=True).items():
        n = plain_name(k)
        if n is None:
            continue
        if n in eff:
            m, t = eff[n]
            with torch.no_grad():
                out[n] = getattr(m, t).detach()
        else:
            out[n] = v.detach()
    return out


def live_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain name → the live tensor that holds it (adapted weights: their base `original`)."""
    return {n: v for k, v in model.state_dict(keep_vars=True).items() if (n := plain_name(k))}


@torch.no_grad()
def assign_(model: nn.Module, state: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy `state` (plain names) into the model; adapted weights get it as their base and a zero
    delta, so the model computes exactly `state`. Returns (missing, unexpected) names; a name
    missing only because it shares its tensor with one given (tied weights) is not missing."""
    live = live_state(model)
    unexpected = sorted(set(state) - set(live))
    given = {live[k].data_ptr() for k in state if k in live}
    missing = sorted(k for k in live if k not in state and live[k].data_ptr() not in given)
    for k, v in state.items():
        if k in live:
            live[k].copy_(v)
    for _, m, t in adapted(model):
        for a in _adapters_of(m, t):
            a.zero_(m.parametrizations[t].original)
    return missing, unexpected


def plain_copy(model: nn.Module) -> nn.Module:
    """A deep copy with every adapter merged away (plain modules, plain state-dict names).

    Not `parametrize.remove_parametrizations` on the copy: a deep copy shares the generated
    `Parametrized<Module>` class with the original, and removal deletes the property from
    that class, so the original would lose its weights. The copy's modules get their plain
    class back instead.
    """
    m = copy.deepcopy(model)
    for mod in m.modules():
        if not parametrize.is_parametrized(mod):
            continue
        with torch.no_grad():
            vals = {t: getattr(mod, t).detach().clone() for t in mod.parametrizations}
        grads = {t: mod.parametrizations[t].original.requires_grad for t in vals}
        del mod._modules["parametrizations"]
        mod.__class__ = mod.__class__.__bases__[0]  # the class parametrize derived from
        for t, v in vals.items():
            mod.register_parameter(t, nn.Parameter(v, requires_grad=grads[t]))
    return m


def full_finetuning_copy(model: nn.Module) -> nn.Module:
    """A plain copy (`plain_copy`) trained as full fine-tuning would train it: every floating
    parameter requires a gradient and BatchNorm layers follow the train/eval mode again (the
    frozen-statistics hook of a tuning mode removed); the reference of `--budget maf`."""
    m = plain_copy(model)
    for p in m.parameters():
        p.requires_grad_(p.is_floating_point())
    for mod in m.modules():
        for k, h in list(mod._forward_pre_hooks.items()):
            if h is _eval_mode:
                del mod._forward_pre_hooks[k]
    return m


def trained_names(model: nn.Module) -> frozenset[str] | None:
    """Plain names of the tensors the tuning mode changes (None: all, `--tune full`)."""
    return getattr(model, _TRAINED_ATTR, None)


def dedupe_shared(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one name per shared tensor (the first in sorted order, as safetensors' `save_model`
    does); returns (kept tensors, {dropped name: kept name})."""
    kept: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    dropped: dict[str, str] = {}
    for k in sorted(sd):
        v = sd[k]
        key = (v.device, v.data_ptr(), tuple(v.shape), tuple(v.stride()))
        if v.numel() and key in seen:
            dropped[k] = seen[key]
            continue
        seen[key] = k
        kept[k] = v.detach().contiguous()
    return kept, dropped


# -- the tuning of a run --------------------------------------------------------------------------


def _names_of(kind: str, model: nn.Module) -> set[str]:
    """Candidate weights for adapters of one `targets` kind."""
    lin, conv = set(), set()
    for mname, m in model.named_modules():
        pre = f"{mname}." if mname else ""
        if isinstance(m, nn.Linear):
            lin.add(pre + "weight")
        elif isinstance(m, nn.MultiheadAttention):
            for t in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                if getattr(m, t, None) is not None:
                    lin.add(pre + t)
        elif isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            conv.add(pre + "weight")
    attn = {n for n in lin if re.search(r"attn|attention", n)}
    return {"linear": lin, "attn": attn, "mlp": lin - attn, "conv": conv}.get(kind, set())


def applies(mode: str, key: str) -> bool:
    """Whether `--tune-arg key` is one of mode's arguments."""
    return mode in _MODE_ARGS.get(key, ADAPTER_MODES if key in _ADAPTER_ARGS else MODES)


def with_defaults(
    mode: str, defaults: Mapping[str, Mapping[str, Any]], args: Mapping[str, Any]
) -> dict:
    """`--tune-arg`s over a method's defaults for this mode (`Method.tune_defaults`, by mode:
    e.g. `lora_per_task`'s FoMo structure for lora and dora)."""
    return {**defaults.get(mode, {}), **args}


class Tuning:
    """One run's `--tune` mode and `--tune-arg`s; applies itself to the training model."""

    def __init__(self, mode: str = "full", args: Mapping[str, Any] | None = None) -> None:
        if mode not in MODES:
            raise CvlError(f"--tune must be one of {', '.join(MODES)} (got '{mode}')")
        self.mode = mode
        self.args = dict(DEFAULT_ARGS)
        if mode == "vera":
            self.args["rank"] = VERA_RANK
        for k, v in (args or {}).items():
            if k not in DEFAULT_ARGS:
                raise CvlError(f"--tune-arg {k}: unknown (known: {', '.join(DEFAULT_ARGS)})")
            modes = _MODE_ARGS.get(k, ADAPTER_MODES if k in _ADAPTER_ARGS else MODES)
            if not applies(mode, k):
                raise CvlError(
                    f"--tune-arg {k} applies to --tune {' or '.join(modes)}, not '{mode}'"
                )
            rule = _LIMITS.get(k)
            self.args[k] = rule.check(v, f"--tune-arg {k}") if rule else str(v)
        if self.args["bn_stats"] not in ("frozen", "train"):
            raise CvlError("--tune-arg bn_stats must be 'frozen' or 'train'")
        if self.args["qkv"] not in QKV:
            raise CvlError("--tune-arg qkv must be 'fused' or 'split'")
        self.trainable = 0
        self.total = 0

    @property
    def adapters(self) -> bool:
        return self.mode in ADAPTER_MODES

    # -- which parameters train -------------------------------------------------------------------
    def _targets(self, model: nn.Module) -> list[str]:
        params = dict(model.named_parameters())
        names_of: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(n)
        tied = {n for ns in names_of.values() if len(ns) > 1 for n in ns}
        out: set[str] = set()
        for spec in self.args["targets"].split("+"):
            spec = spec.strip()
            if any(c in spec for c in "*?["):
                pool = _names_of("linear", model) | _names_of("conv", model)
                out |= {n for n in pool if fnmatch.fnmatchcase(n, spec)}
            elif spec in ("linear", "attn", "mlp", "conv"):
                out |= _names_of(spec, model)
            else:
                raise CvlError(
                    f"--tune-arg targets: '{spec}' is not linear, attn, mlp, conv or a pattern"
                )
        out = {n for n in out if n in params and n not in tied}
        if not out:
            raise CvlError(f"--tune-arg targets={self.args['targets']} matches no weight")
        return sorted(out)

    def _keeps(self, name: str, module: nn.Module, towers: dict[str, tuple[str, ...]]) -> bool:
        """Whether a (non-adapter) parameter trains in this mode."""
        if self.mode == "bitfit":
            return name.endswith("bias")
        if self.mode == "lnfit":
            return isinstance(module, _NORMS)
        if self.mode in ("locked-image", "locked-text"):
            tower = towers["image" if self.mode == "locked-image" else "text"]
            return not name.startswith(tower)
        return False  # lora, dora: only the adapters

    def apply(self, model: nn.Module, seed: int, also: tuple[str, ...] = ()) -> None:
        """Freeze what the mode does not train, attach the adapters (drawn from `seed`, the
        first task's), freeze BatchNorm statistics of frozen layers; records what trains.
        `also`: shell patterns of parameter names that train besides the mode's (a method's
        `tune_also`, e.g. C-CLIP's embeddings beside its LoRA)."""
        self.total = sum(p.numel() for p in model.parameters())
        if self.mode == "full":
            self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            return
        towers = model.towers() if self.mode.startswith("locked-") else {}
        owner = {
            f"{mn}.{pn}" if mn else pn: m
            for mn, m in model.named_modules()
            for pn, _ in m.named_parameters(recurse=False)
        }
        trained: set[str] = set()
        for n, p in model.named_parameters():
            keep = self._keeps(n, owner[n], towers) or any(fnmatch.fnmatchcase(n, a) for a in also)
            p.requires_grad_(keep)
            if keep:
                trained.add(n)
        if self.adapters:
            mods = dict(model.named_modules())
            targets = self._targets(model)
            shared = None
            if self.mode == "vera":  # one frozen pair, at the largest fan-out and fan-in
                shapes = [
                    getattr(mods[n.rpartition(".")[0]], n.rpartition(".")[2]).shape for n in targets
                ]
                out = max(s[0] for s in shapes)
                fan_in = max(math.prod(s[1:]) for s in shapes)
                shared = VeraProjections(
                    int(self.args["rank"]), out, fan_in, self.args["projection_seed"]
                )
            for n in targets:
                mname, _, t = n.rpartition(".")
                m = mods[mname]
                w = getattr(m, t)
                if shared is not None:
                    a: WeightAdapter = VeraAdapter(w, shared, self.args["d_initial"])
                else:
                    split = self.args["qkv"] == "split" and t == "in_proj_weight"
                    a = Adapter(
                        w,
                        int(self.args["rank"]),
                        self.args["alpha"],
                        self.mode == "dora",
                        parts=3 if split else 1,
                    )
                parametrize.register_parametrization(m, t, a)
                m.parametrizations[t].original.requires_grad_(False)
                trained.add(n)
            self.begin_task(model, seed)
        for mname, m in model.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                pre = f"{mname}." if mname else ""
                if any(p.requires_grad for p in m.parameters(recurse=False)) or (
                    self.args["bn_stats"] == "train"
                ):
                    trained |= {pre + b for b in ("running_mean", "running_var")}
                else:
                    m.register_forward_pre_hook(_eval_mode)
        setattr(model, _TRAINED_ATTR, frozenset(trained))
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # -- task boundaries --------------------------------------------------------------------------
    @torch.no_grad()
    def begin_task(self, model: nn.Module, seed: int) -> None:
        """A fresh adapter for the task (anything not yet merged is merged first)."""
        if not self.adapters:
            return
        merge_adapters(model)
        g = torch.Generator().manual_seed(int(seed))
        for _, m, t in adapted(model):
            for a in _adapters_of(m, t):
                a.reset_(m.parametrizations[t].original, g)

    def end_task(self, model: nn.Module) -> None:
        """Merge the task's adapter into the weights (checkpoints hold plain merged weights)."""
        if self.adapters:
            merge_adapters(model)

    # -- the mid-task checkpoint --------------------------------------------------------------------
    def state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Adapters and base weights (the parametrised tensors; CPU copies), for an exact resume."""
        sd = model.state_dict()
        return {
            k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items() if _PARAM in k
        }

    @torch.no_grad()
    def load_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        mine = {k: v for k, v in model.state_dict(keep_vars=True).items() if _PARAM in k}
        if set(mine) != set(state):
            raise CvlError(
                "the mid-task checkpoint's adapters do not match this run's --tune "
                f"({len(state)} saved tensors, {len(mine)} expected)"
            )
        for k, v in state.items():
            mine[k].copy_(v)

    def summary(self) -> dict[str, Any]:
        """What run.json and `cvl info` show."""
        return {
            "mode": self.mode,
            "args": {
                k: v
                for k, v in self.args.items()
                if self.mode != "full"
                and self.mode in _MODE_ARGS.get(k, ADAPTER_MODES if k in _ADAPTER_ARGS else MODES)
            },
            "trainable_params": self.trainable,
            "total_params": self.total,
            "trainable_share": self.trainable / self.total if self.total else 0.0,
        }


def _eval_mode(module: nn.Module, _args: Any) -> None:
    """Forward pre-hook of a frozen BatchNorm: normalise with (and keep) running statistics."""
    module.training = False
