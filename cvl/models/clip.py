"""The `clip` model: an open_clip `CLIP` (or `CustomTextCLIP`) behind the `VLModel` interface.

Config (what `CLIPModel.config()` returns, JSON-able, enough to rebuild the architecture):

    {"kind": "clip", "name": "tiny" | "ViT-B-32" | null,
     "model_cfg": {embed_dim, vision_cfg, text_cfg, ...},   # open_clip's own model config
     "tokenizer": {"type": "hash" | "openclip" | "bert", ...},
     "image_size": 32, "embed_dim": 64, "context_length": 32,
     "init": {"pretrained": path | null}}                  # provenance only, never re-loaded

The wrapped open_clip module is `self.clip`, so its `state_dict()` has open_clip's key names
(used by `cvl export` to write open_clip's `local-dir:` format).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.data.tokenizers import build_tokenizer
from cvl.errors import CvlError
from cvl.models.base import VLModel
from cvl.models.weights import is_cvl_checkpoint, load_weights

log = logging.getLogger(__name__)

MAX_LOGIT_SCALE = 100.0


def _instantiate(model_cfg: dict[str, Any]) -> nn.Module:
    """Build the open_clip module exactly as `open_clip.create_model` would, without downloads."""
    from open_clip.model import CLIP, CustomTextCLIP

    cfg = copy.deepcopy(model_cfg)
    if "multimodal_cfg" in cfg:
        raise CvlError("CoCa-style open_clip models (multimodal_cfg) are not supported")
    for key in ("embed_dim", "vision_cfg", "text_cfg"):
        if key not in cfg:
            raise CvlError(f"open_clip model config lacks '{key}'")
    text_cfg, vision_cfg = cfg["text_cfg"], cfg["vision_cfg"]
    is_hf_text = "hf_model_name" in text_cfg
    if is_hf_text:
        text_cfg["hf_model_pretrained"] = False
    if vision_cfg.get("timm_model_name"):
        vision_cfg["timm_model_pretrained"] = False
    custom_text = cfg.pop("custom_text", False) or is_hf_text
    cls = CustomTextCLIP if custom_text else CLIP
    try:
        return cls(**cfg)
    except (TypeError, ValueError) as e:
        raise CvlError(f"invalid open_clip model config: {e}") from None
    except OSError as e:  # an HF text tower whose config is not available offline
        raise CvlError(f"cannot build the text tower offline: {e}") from None


def _image_size(vision_cfg: dict[str, Any]) -> int:
    size = vision_cfg.get("image_size", 224)
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise CvlError(f"non-square image_size {size} is not supported")
        size = size[0]
    return int(size)


def default_tokenizer_config(model_cfg: dict[str, Any], arch: str | None) -> dict[str, Any]:
    """open_clip's tokenizer for open_clip-sized vocabularies, else the hash tokenizer."""
    text_cfg = model_cfg["text_cfg"]
    ctx = int(text_cfg.get("context_length", 77))
    vocab = int(text_cfg.get("vocab_size", 49408))
    if arch is not None:
        return {"type": "openclip", "model_name": arch, "context_length": ctx}
    if vocab == 49408 and "hf_tokenizer_name" not in text_cfg:
        return {"type": "openclip", "model_name": "ViT-B-32", "context_length": ctx}
    return {"type": "hash", "vocab_size": vocab, "context_length": ctx}


def normalize_config(
    cfg: dict[str, Any], tokenizer: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A complete `clip` config from a packaged/user config (cvl or open_clip format)."""
    cfg = copy.deepcopy(cfg)
    if "model_cfg" in cfg:
        model_cfg = cfg["model_cfg"]
    elif "vision_cfg" in cfg:  # a bare open_clip model config file
        model_cfg = {k: v for k, v in cfg.items() if k not in ("kind", "name", "tokenizer", "init")}
    else:
        raise CvlError(
            "clip model config needs 'model_cfg' (or open_clip's embed_dim/vision_cfg/text_cfg)"
        )
    arch = cfg.get("arch")
    exported = cfg.get("cvl") or {}  # an `open_clip_config.json` written by `cvl export`
    tok = tokenizer or cfg.get("tokenizer") or exported.get("tokenizer")
    tok = tok or default_tokenizer_config(model_cfg, arch)
    text_cfg = model_cfg["text_cfg"]
    if tokenizer is not None:  # an explicit tokenizer decides vocabulary and context length
        ctx = tokenizer.get("context_length")
        if ctx is not None:
            text_cfg["context_length"] = int(ctx)
        if tokenizer.get("type", "hash") == "hash" and "vocab_size" in tokenizer:
            text_cfg["vocab_size"] = int(tokenizer["vocab_size"])
    return {
        "kind": "clip",
        "name": cfg.get("name"),
        "arch": arch,
        "model_cfg": model_cfg,
        "tokenizer": tok,
        "image_size": _image_size(model_cfg["vision_cfg"]),
        "embed_dim": int(model_cfg["embed_dim"]),
        "context_length": int(text_cfg.get("context_length", 77)),
        "init": cfg.get("init", {"pretrained": None}),
    }


class CLIPModel(VLModel):
    """A CLIP dual encoder: open_clip module in `self.clip`, tokenizer in `self.tokenizer`."""

    kind = "clip"
    has_fusion = False

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self._cfg = normalize_config(cfg)
        self.clip = _instantiate(self._cfg["model_cfg"])
        try:
            self.tokenizer = build_tokenizer(self._cfg["tokenizer"])
        except OSError as e:  # an HF tokenizer that is not available offline
            raise CvlError(f"cannot load the tokenizer: {e}") from None
        self.embed_dim = self._cfg["embed_dim"]
        self.image_size = self._cfg["image_size"]
        self.context_length = self._cfg["context_length"]
        vocab = int(self._cfg["model_cfg"]["text_cfg"].get("vocab_size", 49408))
        tv = getattr(self.tokenizer, "vocab_size", None)
        if (
            tv is not None
            and "hf_model_name" not in self._cfg["model_cfg"]["text_cfg"]
            and tv > vocab
        ):
            raise CvlError(f"tokenizer vocabulary ({tv}) is larger than the text tower's ({vocab})")
        tc = getattr(self.tokenizer, "context_length", None)
        if tc is not None and tc != self.context_length:
            raise CvlError(
                f"tokenizer context length {tc} != text tower context length {self.context_length}"
            )

    # --- interface ---------------------------------------------------------------------------
    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        x = self.clip.encode_image(images)
        return F.normalize(x, dim=-1) if normalize else x

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        x = self.clip.encode_text(tokens)
        return F.normalize(x, dim=-1) if normalize else x

    def logit_scale(self) -> torch.Tensor:
        return self.clip.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)

    def config(self) -> dict[str, Any]:
        return copy.deepcopy(self._cfg)

    def towers(self) -> dict[str, tuple[str, ...]]:
        """open_clip's `visual`; the text tower of `CLIP` (or `CustomTextCLIP.text`)."""
        text = ("transformer.", "token_embedding.", "positional_embedding", "ln_final.")
        text += ("text_projection", "text.")
        return {"image": ("clip.visual.",), "text": tuple(f"clip.{t}" for t in text)}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """open_clip's own: every transformer block (ViT and text) is checkpointed.

        open_clip's ModifiedResNet towers (RN50, the packaged `tiny`) keep their activations;
        only their text transformer is checkpointed.
        """
        self.clip.set_grad_checkpointing(enable)

    # --- weights -------------------------------------------------------------------------------
    def load_pretrained(self, path: str | Path) -> None:
        """Weights from a local file: an open_clip/OpenAI checkpoint or a cvl model file."""
        p = Path(path)
        if not p.is_file():
            raise CvlError(f"{p}: pretrained weights file not found")
        if is_cvl_checkpoint(p):
            load_weights(self, p)
        else:
            from open_clip.factory import load_checkpoint

            try:
                load_checkpoint(self.clip, str(p), strict=True, weights_only=True)
            except (RuntimeError, KeyError, ValueError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CvlError(
                    f"{p}: weights do not fit this architecture ({first[:300]}); "
                    "TorchScript/pickled checkpoints need converting to a state_dict"
                ) from None
            except Exception as e:  # unpickling refused with weights_only=True, corrupt file
                raise CvlError(f"{p}: cannot read weights ({type(e).__name__}: {e})") from None
        self._cfg["init"] = {"pretrained": str(p)}

    # --- export ----------------------------------------------------------------------------------
    def open_clip_config(self) -> dict[str, Any]:
        """open_clip's `open_clip_config.json` content: model_cfg + preprocess_cfg."""
        from open_clip.transform import PreprocessCfg

        pp = asdict(PreprocessCfg(size=self.image_size))
        return {"model_cfg": copy.deepcopy(self._cfg["model_cfg"]), "preprocess_cfg": pp}


def build_clip(
    cfg: dict[str, Any], pretrained: str | None = None, tokenizer: dict[str, Any] | None = None
) -> CLIPModel:
    model = CLIPModel(normalize_config(cfg, tokenizer))
    if pretrained:
        model.load_pretrained(pretrained)
    return model


def named_arch_config(name: str) -> dict[str, Any] | None:
    """The cvl config of an open_clip architecture name, or None when open_clip lacks it."""
    import open_clip

    model_cfg = open_clip.get_model_config(name)
    if model_cfg is None:
        return None
    return {"kind": "clip", "name": name, "arch": name, "model_cfg": model_cfg}
