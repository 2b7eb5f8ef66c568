"""The `fusion` model's config: the BERT and ViT defaults and `normalize_config`, which fills a
packaged or user config in (a `bert-base-chinese`-style folder's config.json read for the text
geometry) and checks it.

Kept apart from the layers (fusion_layers.py) and the model (fusion.py): a config is read and
checked without building anything. `cvl.models.fusion` re-exports every name.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from cvl.data.tokenizers import build_tokenizer
from cvl.errors import CvlError

BERT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "initializer_range": 0.02,
}


VIT_DEFAULTS: dict[str, Any] = {
    "img_size": 224,
    "patch_size": 16,
    "embed_dim": 768,
    "depth": 12,
    "num_heads": 12,
    "mlp_ratio": 4.0,
}


def _read_bert_folder_config(folder: Path) -> dict[str, Any]:
    p = folder / "config.json"
    if not p.is_file():
        raise CvlError(f"{folder}: not a BERT folder (no config.json)")
    c = json.loads(p.read_text(encoding="utf-8"))
    return {k: c[k] for k in [*BERT_DEFAULTS, "num_hidden_layers"] if k in c}


def normalize_config(
    cfg: dict[str, Any], tokenizer: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A complete `fusion` config (BERT geometry filled from `text_pretrained` if given)."""
    cfg = copy.deepcopy(cfg)
    init = dict(cfg.get("init") or {})
    for k in ("image_pretrained", "text_pretrained", "pretrained"):
        if cfg.get(k):
            init[k] = str(cfg[k])
        init.setdefault(k, None)
    text = {**BERT_DEFAULTS, **cfg.get("text", {})}
    text_layers, fusion_layers = cfg.get("text_layers"), cfg.get("fusion_layers")
    user_text = cfg.get("text_pretrained")  # only a user config reads the folder, never init
    if user_text:
        folder = Path(user_text)
        if not folder.is_dir():
            raise CvlError(f"{folder}: text_pretrained must be a local BERT folder")
        folder_cfg = _read_bert_folder_config(folder)
        n = folder_cfg.pop("num_hidden_layers", None)
        text.update(folder_cfg)
        if n and text_layers is None and fusion_layers is None:
            text_layers, fusion_layers = n - n // 2, n // 2
    text.pop("num_hidden_layers", None)
    text_layers = 6 if text_layers is None else int(text_layers)
    fusion_layers = 6 if fusion_layers is None else int(fusion_layers)
    if text_layers < 1 or fusion_layers < 1:
        raise CvlError("fusion model needs text_layers >= 1 and fusion_layers >= 1")
    vision = {**cfg.get("vision", {})}
    if not vision.get("timm_model"):
        vision = {**VIT_DEFAULTS, **vision}
    image_size = int(cfg.get("image_size") or vision.get("img_size", 224))
    vision["img_size"] = image_size

    tok = tokenizer or cfg.get("tokenizer")
    if tok is None and user_text:
        folder = Path(user_text)
        if any((folder / f).is_file() for f in ("vocab.txt", "tokenizer.json")):
            tok = {"type": "bert", "path": str(folder), "context_length": 30}
    if tok is None:
        raise CvlError(
            "fusion model needs a tokenizer: set 'text_pretrained' to a local BERT folder "
            "(with vocab.txt), or pass tokenizer={'type': 'bert', 'path': FOLDER} "
            "(or {'type': 'hash', ...} for toy models)"
        )
    tok = dict(tok)
    if tokenizer is not None and not init["text_pretrained"]:
        # a random-init text tower follows the tokenizer's vocabulary
        tok_obj = build_tokenizer(tok)
        text["vocab_size"] = int(tok_obj.vocab_size)
    return {
        "kind": "fusion",
        "name": cfg.get("name"),
        "vision": vision,
        "text": text,
        "text_layers": text_layers,
        "fusion_layers": fusion_layers,
        "embed_dim": int(cfg.get("embed_dim", 256)),
        "temperature": float(cfg.get("temperature", 0.07)),
        "image_size": image_size,
        "tokenizer": tok,
        "init": init,
    }
