"""Model factory: `clip` (open_clip) and `fusion` (ALBEF-style, as in CTP) behind one interface.

    build_model("clip", "tiny")                       # packaged tiny config (cvl/resources/models)
    build_model("clip", "ViT-B-32", pretrained="/path/open_clip_model.safetensors")
    build_model("fusion", {"extends": "base", "image_pretrained": "deit_base.pth",
                           "text_pretrained": "/models/bert-base-chinese"})
    model_from_config(model.config())                 # same architecture (no weights loaded)
    save_weights(model, "model.safetensors"); load_weights(model, "model.safetensors")

`model_config` is a packaged name (`cvl.models.list_configs()`), any open_clip architecture
name (clip only), a path to a JSON file or a dict. A JSON/dict may say `"extends": NAME` to
start from a packaged config and override some keys. Nothing is downloaded: weights come from
local files only.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cvl.errors import CvlError
from cvl.models.weights import load_weights, save_weights

if TYPE_CHECKING:  # torch is imported lazily so that `cvl --help` stays fast
    from cvl.models.base import MissingFusionError, VLModel

__all__ = [
    "KINDS",
    "MissingFusionError",
    "VLModel",
    "build_model",
    "list_configs",
    "load_weights",
    "model_from_config",
    "save_weights",
]

KINDS = ("clip", "fusion")


def __getattr__(name: str) -> Any:
    if name in ("VLModel", "MissingFusionError"):
        from cvl.models import base

        return getattr(base, name)
    raise AttributeError(f"module 'cvl.models' has no attribute {name!r}")


DEFAULT_CONFIG = {"clip": "tiny", "fusion": "tiny"}


def _config_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "resources" / "models"


def list_configs(kind: str | None = None) -> list[str]:
    """Names of the packaged configs (`clip-tiny.json` -> "tiny" for kind "clip")."""
    out = []
    for p in sorted(_config_dir().glob("*.json")):
        k, _, name = p.stem.partition("-")
        if kind is None:
            out.append(p.stem)
        elif k == kind:
            out.append(name)
    return out


def _packaged(kind: str, name: str) -> dict[str, Any] | None:
    p = _config_dir() / f"{kind}-{name}.json"
    if not p.is_file():
        return None
    cfg = json.loads(p.read_text(encoding="utf-8"))
    cfg.pop("description", None)
    cfg.setdefault("name", name)
    return cfg


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _unknown(kind: str, what: str) -> CvlError:
    names = ", ".join(list_configs(kind)) or "none"
    extra = " or any open_clip architecture (e.g. ViT-B-32, RN50; see open_clip.list_models())"
    return CvlError(
        f"unknown {kind} model config '{what}': use a packaged config ({names})"
        f"{extra if kind == 'clip' else ''}, a path to a JSON file, or a dict"
    )


def resolve_config(kind: str, model_config: str | dict | os.PathLike | None) -> dict[str, Any]:
    """The raw config dict (before the model normalises it) for `build_model`."""
    if kind not in KINDS:
        raise CvlError(f"unknown model kind '{kind}' (choose from: {', '.join(KINDS)})")
    if model_config is None:
        model_config = DEFAULT_CONFIG[kind]
    if isinstance(model_config, dict):
        cfg = copy.deepcopy(model_config)
    else:
        s = str(model_config)
        cfg = _packaged(kind, s)
        if cfg is None and (s.endswith(".json") or os.sep in s or Path(s).is_file()):
            p = Path(s)
            if not p.is_file():
                raise CvlError(f"{p}: model config file not found")
            from cvl.io import read_json

            cfg = read_json(p)
            if not isinstance(cfg, dict):
                raise CvlError(f"{p}: a model config must be a JSON object")
            cfg.setdefault("name", p.stem)
        if cfg is None and kind == "clip":
            from cvl.models.clip import named_arch_config

            cfg = named_arch_config(s)
        if cfg is None:
            raise _unknown(kind, s)
    if "extends" in cfg:
        base = _packaged(kind, str(cfg["extends"]))
        if base is None:
            raise _unknown(kind, str(cfg["extends"]))
        over = {k: v for k, v in cfg.items() if k != "extends"}
        cfg = _merge(base, over)
    if cfg.get("kind", kind) != kind:
        raise CvlError(f"model config is for kind '{cfg['kind']}', not '{kind}'")
    cfg["kind"] = kind
    return cfg


def build_model(
    kind: str = "clip",
    model_config: str | dict | None = None,
    pretrained: str | None = None,
    tokenizer: dict | None = None,
) -> VLModel:
    """A new model of `kind` ("clip" | "fusion"); see the module docstring.

    `pretrained`: a local weights file for the whole model (open_clip/OpenAI state dict or a cvl
    model file for clip; a cvl model file or an ALBEF/CTP checkpoint for fusion).
    `tokenizer`: a tokenizer config ({"type": "hash" | "openclip" | "bert", ...}) overriding the
    config's; a random-init text tower then follows its vocabulary / context length.
    """
    cfg = resolve_config(kind, model_config)
    if kind == "clip":
        from cvl.models.clip import build_clip

        return build_clip(cfg, pretrained, tokenizer)
    from cvl.models.fusion import build_fusion

    return build_fusion(cfg, pretrained, tokenizer)


def model_from_config(cfg: dict[str, Any]) -> VLModel:
    """Rebuild the architecture saved by `model.config()` (random weights; see load_weights)."""
    if not isinstance(cfg, dict) or cfg.get("kind") not in KINDS:
        kind = cfg.get("kind") if isinstance(cfg, dict) else None
        raise CvlError(
            f"not a cvl model config (kind {kind!r}; expected one of {', '.join(KINDS)})"
        )
    if cfg.get("moe_adapters"):  # a method's layers (cvl.methods.moe_layers), rebuilt too
        from cvl.methods.moe_layers import CONFIG_KEY, attach

        cfg = dict(cfg)
        spec = cfg.pop(CONFIG_KEY)
        return attach(model_from_config(cfg), spec)
    if cfg["kind"] == "clip":
        from cvl.models.clip import CLIPModel

        return CLIPModel(cfg)
    from cvl.models.fusion import FusionModel

    return FusionModel(cfg)


def count_parameters(model: VLModel) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
