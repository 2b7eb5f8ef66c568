"""The `fusion` model: ALBEF-style, as in CTP (ViT + BERT split into text and fusion layers).

- image encoder: a timm `VisionTransformer` (tiny: 32 px, patch 8, width 64, depth 2; CTP:
  `deit_base_patch16_224`, weights from a local file);
- a BERT whose first `text_layers` layers are the text encoder (self-attention only) and whose
  last `fusion_layers` layers add cross-attention to the image tokens (the fusion encoder);
- an MLM head (BertForMaskedLM's, decoder tied to the word embeddings);
- linear projections of both CLS states to `embed_dim` (CTP: 256) and a fixed τ = 0.07.

The BERT layers are implemented here (same parameter names as HF `BertModel` /
`BertForMaskedLM` and as ALBEF's `xbert`), so `bert-base-chinese`-style folders and
ALBEF/CTP checkpoints load without depending on a transformers version's internals. The
module tree mirrors ALBEF: `visual_encoder`, `text_encoder.bert`, `text_encoder.cls`,
`vision_proj`, `text_proj`.

Config (`FusionModel.config()`):

    {"kind": "fusion", "name": "tiny",
     "vision": {"img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio"}
               or {"timm_model": "deit_base_patch16_224", "img_size": 224},
     "text": {BERT geometry: vocab_size, hidden_size, num_attention_heads, intermediate_size,
              max_position_embeddings, type_vocab_size, layer_norm_eps, dropouts},
     "text_layers": 6, "fusion_layers": 6, "embed_dim": 256, "temperature": 0.07,
     "image_size": 224, "tokenizer": {...},
     "init": {"image_pretrained", "text_pretrained", "pretrained"}}   # provenance only

MLM: `mask_tokens(tokens, generator)` draws the masking once; `mlm_logits(image_embeds,
image_atts, masked_ids)` can then be called on the student and on a teacher (momentum /
previous-task model) with exactly the same ids. `forward(images, tokens, mlm_ids=...)`
computes the MLM logits inside `forward` too (what DDP wants: one forward per step).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.data.tokenizers import build_tokenizer
from cvl.device import to_device
from cvl.errors import CvlError
from cvl.models.base import VLModel

log = logging.getLogger(__name__)

IGNORE_INDEX = -100

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


# --------------------------------------------------------------------------------------------
# BERT layers (HF parameter names)
# --------------------------------------------------------------------------------------------


class _Embeddings(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h = c["hidden_size"]
        self.word_embeddings = nn.Embedding(c["vocab_size"], h)
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(c["type_vocab_size"], h)
        self.LayerNorm = nn.LayerNorm(h, eps=c["layer_norm_eps"])
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(pos)[None]
        x = x + self.token_type_embeddings.weight[0]
        return self.dropout(self.LayerNorm(x))


class _SelfAttention(nn.Module):
    """Multi-head attention named like HF's `BertSelfAttention` (query / key / value)."""

    def __init__(self, c: dict[str, Any], kv_width: int | None = None) -> None:
        super().__init__()
        h = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        if h % self.heads:
            raise CvlError(f"hidden_size {h} is not a multiple of num_attention_heads {self.heads}")
        kv = kv_width or h
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(kv, h)
        self.value = nn.Linear(kv, h)
        self.p_drop = c["attention_probs_dropout_prob"]

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, kv: torch.Tensor | None = None
    ) -> torch.Tensor:
        n, lq, h = x.shape
        src = x if kv is None else kv
        d = h // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, -1, self.heads, d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(src)), split(self.value(src))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.p_drop if self.training else 0.0
        )
        return out.transpose(1, 2).reshape(n, lq, h)


class _SelfOutput(nn.Module):
    def __init__(self, c: dict[str, Any], in_width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_width, c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class _Attention(nn.Module):
    def __init__(self, c: dict[str, Any], kv_width: int | None = None) -> None:
        super().__init__()
        self.self = _SelfAttention(c, kv_width)
        self.output = _SelfOutput(c, c["hidden_size"])

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, kv: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.output(self.self(x, mask, kv), x)


class _Intermediate(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class _Layer(nn.Module):
    """A BERT layer; with `cross_width`, cross-attention to image tokens after self-attention."""

    def __init__(self, c: dict[str, Any], cross_width: int | None = None) -> None:
        super().__init__()
        self.attention = _Attention(c)
        self.has_cross = cross_width is not None
        if self.has_cross:
            self.crossattention = _Attention(c, kv_width=cross_width)
        self.intermediate = _Intermediate(c)
        self.output = _SelfOutput(c, c["intermediate_size"])
        self.grad_checkpointing = False

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        image: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, x, mask, image, image_mask, use_reentrant=False)
        return self._forward(x, mask, image, image_mask)

    def _forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        image: torch.Tensor | None,
        image_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = self.attention(x, mask)
        if self.has_cross:
            x = self.crossattention(x, image_mask, kv=image)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, layers: list[_Layer]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(layers)


class _Bert(nn.Module):
    def __init__(self, c: dict[str, Any], text_layers: int, fusion_layers: int, cross_width: int):
        super().__init__()
        self.embeddings = _Embeddings(c)
        layers = [_Layer(c) for _ in range(text_layers)]
        layers += [_Layer(c, cross_width) for _ in range(fusion_layers)]
        self.encoder = _Encoder(layers)
        self.text_layers = text_layers


class _PredictionHeadTransform(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class _LMPredictionHead(nn.Module):
    def __init__(self, c: dict[str, Any], word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.transform = _PredictionHeadTransform(c)
        self.decoder = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.decoder.weight = word_embeddings.weight  # tied, as in BERT
        self.bias = nn.Parameter(torch.zeros(c["vocab_size"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x)) + self.bias


class _MLMHead(nn.Module):
    def __init__(self, c: dict[str, Any], word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.predictions = _LMPredictionHead(c, word_embeddings)


class _TextEncoder(nn.Module):
    """ALBEF's `text_encoder` (a BertForMaskedLM): `bert` + MLM head `cls`."""

    def __init__(self, c: dict[str, Any], text_layers: int, fusion_layers: int, cross_width: int):
        super().__init__()
        self.bert = _Bert(c, text_layers, fusion_layers, cross_width)
        self.cls = _MLMHead(c, self.bert.embeddings.word_embeddings)


def _init_bert(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def _build_vit(v: dict[str, Any]) -> nn.Module:
    from functools import partial

    from timm.models.vision_transformer import VisionTransformer

    args = {k: val for k, val in v.items() if k != "timm_model"}
    if v.get("timm_model"):
        import timm

        try:
            return timm.create_model(v["timm_model"], pretrained=False, num_classes=0, **args)
        except RuntimeError as e:
            raise CvlError(f"timm model '{v['timm_model']}': {e}") from None
    args = {**VIT_DEFAULTS, **args}
    return VisionTransformer(
        num_classes=0, qkv_bias=True, norm_layer=partial(nn.LayerNorm, eps=1e-6), **args
    )


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


class FusionModel(VLModel):
    """ALBEF-style model; see the module docstring."""

    kind = "fusion"
    has_fusion = True

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self._cfg = normalize_config(cfg)
        c = self._cfg["text"]
        try:
            self.tokenizer = build_tokenizer(self._cfg["tokenizer"])
        except OSError as e:
            raise CvlError(f"cannot load the tokenizer: {e}") from None
        tok = self.tokenizer
        if getattr(tok, "mask_id", None) is None:
            raise CvlError(
                "the fusion model's tokenizer needs a [MASK] id (hash or bert tokenizer)"
            )
        if tok.vocab_size > c["vocab_size"]:
            raise CvlError(
                f"tokenizer vocabulary ({tok.vocab_size}) is larger than BERT's ({c['vocab_size']})"
            )
        if tok.context_length > c["max_position_embeddings"]:
            raise CvlError(
                f"tokenizer context length {tok.context_length} > max_position_embeddings "
                f"{c['max_position_embeddings']}"
            )
        self.pad_id, self.cls_id, self.sep_id = tok.pad_id, tok.cls_id, tok.sep_id
        self.mask_id = tok.mask_id
        self.vocab_size = c["vocab_size"]
        self.embed_dim = self._cfg["embed_dim"]
        self.image_size = self._cfg["image_size"]
        self.text_layers = self._cfg["text_layers"]
        self.fusion_layers = self._cfg["fusion_layers"]

        self.visual_encoder = _build_vit(self._cfg["vision"])
        vision_width = int(self.visual_encoder.embed_dim)
        self.text_encoder = _TextEncoder(c, self.text_layers, self.fusion_layers, vision_width)
        _init_bert(self.text_encoder, c["initializer_range"])
        self.vision_proj = nn.Linear(vision_width, self.embed_dim)
        self.text_proj = nn.Linear(c["hidden_size"], self.embed_dim)
        scale = torch.tensor(1.0 / self._cfg["temperature"])
        self.register_buffer("_logit_scale", scale, persistent=False)
        # ids a "random word" replacement may draw: every id except the special ones
        special = set(getattr(tok, "special_ids", ())) | {self.pad_id, self.cls_id, self.sep_id}
        special.add(self.mask_id)
        words = [i for i in range(tok.vocab_size) if i not in special]
        self.register_buffer("_word_ids", torch.tensor(words, dtype=torch.long), persistent=False)

    @property
    def bert(self) -> _Bert:
        return self.text_encoder.bert

    def towers(self) -> dict[str, tuple[str, ...]]:
        """The ViT + its projection; the BERT embeddings, text layers + their projection (the
        fusion layers and the MLM head are neither)."""
        layers = tuple(f"text_encoder.bert.encoder.layer.{i}." for i in range(self.text_layers))
        return {
            "image": ("visual_encoder.", "vision_proj."),
            "text": ("text_encoder.bert.embeddings.", *layers, "text_proj."),
        }

    # --- encoders ------------------------------------------------------------------------------
    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """ViT output tokens [N, 1+P, W] (CLS first, final LayerNorm applied)."""
        return self.visual_encoder.forward_features(images)

    def _key_mask(self, keep: torch.Tensor) -> torch.Tensor:
        return keep.bool()[:, None, None, :]  # [N, 1, 1, S], True = attend

    def text_hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Text encoder output [N, L, H] (the first `text_layers` BERT layers)."""
        x = self.bert.embeddings(tokens)
        mask = self._key_mask(tokens != self.pad_id)
        for layer in self.bert.encoder.layer[: self.text_layers]:
            x = layer(x, mask)
        return x

    def fuse(
        self,
        text_hidden: torch.Tensor,
        tokens: torch.Tensor,
        image_embeds: torch.Tensor,
        image_atts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fusion encoder output [N, L, H]: text states cross-attending to image tokens."""
        if image_atts is None:
            image_atts = torch.ones(
                image_embeds.shape[:2], dtype=torch.long, device=image_embeds.device
            )
        mask = self._key_mask(tokens != self.pad_id)
        img_mask = self._key_mask(image_atts)
        x = text_hidden
        for layer in self.bert.encoder.layer[self.text_layers :]:
            x = layer(x, mask, image_embeds, img_mask)
        return x

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        x = self.vision_proj(self.image_tokens(images)[:, 0])
        return F.normalize(x, dim=-1) if normalize else x

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        x = self.text_proj(self.text_hidden(tokens)[:, 0])
        return F.normalize(x, dim=-1) if normalize else x

    def logit_scale(self) -> torch.Tensor:
        return self._logit_scale

    def forward(
        self, images: torch.Tensor, tokens: torch.Tensor, mlm_ids: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Embeddings + the states methods need; with `mlm_ids` also `mlm_logits` [N, L, V]."""
        image_embeds = self.image_tokens(images)
        image_atts = torch.ones(image_embeds.shape[:2], dtype=torch.long, device=images.device)
        text_hidden = self.text_hidden(tokens)
        image_cls, text_cls = image_embeds[:, 0], text_hidden[:, 0]
        image_raw, text_raw = self.vision_proj(image_cls), self.text_proj(text_cls)
        out = {
            "image_features": F.normalize(image_raw, dim=-1),
            "text_features": F.normalize(text_raw, dim=-1),
            "image_raw": image_raw,
            "text_raw": text_raw,
            "logit_scale": self.logit_scale(),
            "image_embeds": image_embeds,
            "image_atts": image_atts,
            "text_hidden": text_hidden,
            "image_cls": image_cls,
            "text_cls": text_cls,
        }
        if mlm_ids is not None:
            out["mlm_logits"] = self.mlm_logits(image_embeds, image_atts, mlm_ids)
        return out

    def fusion_cls(
        self,
        image_embeds: torch.Tensor,
        tokens: torch.Tensor,
        image_atts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fusion encoder's CLS state [N, H] (multi-modal retrieval, MAS, k-means)."""
        return self.fuse(self.text_hidden(tokens), tokens, image_embeds, image_atts)[:, 0]

    # --- MLM ---------------------------------------------------------------------------------------
    def mask_tokens(
        self, tokens: torch.Tensor, generator: torch.Generator | None = None, prob: float = 0.15
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT masking: `prob` of the non-special tokens; 80% [MASK], 10% random, 10% kept.

        Returns (masked_ids, labels) with labels = original id at selected positions, -100
        elsewhere. pad / cls / sep are never selected. The draws depend only on `generator`
        and the shape, so a seeded generator gives the same masking everywhere.
        """
        dev = generator.device if generator is not None else torch.device("cpu")
        shape = tokens.shape
        # drawn where the generator lives, moved without a host sync (no boolean indexing)
        sel_r = to_device(torch.rand(shape, generator=generator, device=dev), tokens.device)
        how_r = to_device(torch.rand(shape, generator=generator, device=dev), tokens.device)
        pick = torch.randint(len(self._word_ids), shape, generator=generator, device=dev)
        random_words = self._word_ids[to_device(pick, self._word_ids.device)].to(tokens.device)
        special = (tokens == self.pad_id) | (tokens == self.cls_id) | (tokens == self.sep_id)
        selected = (sel_r < prob) & ~special
        labels = torch.where(selected, tokens, torch.full_like(tokens, IGNORE_INDEX))
        masked = torch.where(selected & (how_r < 0.8), self.mask_id, tokens)
        rnd = selected & (how_r >= 0.8) & (how_r < 0.9)
        masked = torch.where(rnd, random_words, masked)
        return masked, labels

    def mlm_logits(
        self, image_embeds: torch.Tensor, image_atts: torch.Tensor | None, masked_ids: torch.Tensor
    ) -> torch.Tensor:
        """Vocabulary logits [N, L, V] of the fusion encoder on (masked) ids, given image tokens."""
        h = self.fuse(self.text_hidden(masked_ids), masked_ids, image_embeds, image_atts)
        return self.text_encoder.cls.predictions(h)

    def mlm_loss(
        self,
        images_or_embeds: torch.Tensor,
        tokens: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        masked: tuple[torch.Tensor, torch.Tensor] | None = None,
        image_atts: torch.Tensor | None = None,
        prob: float = 0.15,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLM cross-entropy -> (loss, logits [N, L, V], labels [N, L]).

        `images_or_embeds`: images [N, 3, H, W] or ViT tokens [N, T, W] (`out["image_embeds"]`).
        Pass `masked=(masked_ids, labels)` from `mask_tokens` to reuse a masking (e.g. to query
        a teacher on the same ids), else it is drawn from `generator`. 0 when nothing is masked.
        """
        if images_or_embeds.dim() == 4:
            images_or_embeds = self.image_tokens(images_or_embeds)
        masked_ids, labels = (
            masked if masked is not None else self.mask_tokens(tokens, generator, prob)
        )
        logits = self.mlm_logits(images_or_embeds, image_atts, masked_ids)
        return mlm_cross_entropy(logits, labels), logits, labels

    def config(self) -> dict[str, Any]:
        return copy.deepcopy(self._cfg)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's checkpointing of the ViT blocks; each BERT (text and fusion) layer likewise."""
        self.visual_encoder.set_grad_checkpointing(enable)
        for layer in self.text_encoder.bert.encoder.layer:
            layer.grad_checkpointing = enable

    # --- pretrained weights ------------------------------------------------------------------------
    def load_image_pretrained(self, path: str | Path) -> None:
        """ViT weights from a local timm/DeiT file (.pth/.bin with weights_only, .safetensors)."""
        from timm.models.vision_transformer import checkpoint_filter_fn

        sd = _read_state_dict(Path(path))
        try:
            sd = checkpoint_filter_fn(sd, self.visual_encoder)
            sd = {
                k: v for k, v in sd.items() if not k.startswith(("head.", "head_dist.", "fc_norm."))
            }
            res = self.visual_encoder.load_state_dict(sd, strict=False)
        except RuntimeError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln]
            detail = (lines or str(e).splitlines() or ["?"])[0]
            raise CvlError(f"{path}: not a fitting ViT checkpoint ({detail[:300]})") from None
        missing = [k for k in res.missing_keys if not k.startswith(("head", "fc_norm"))]
        if missing:
            raise CvlError(
                f"{path}: not a fitting ViT checkpoint; missing {len(missing)} keys, e.g. {missing[:3]}"
            )
        if res.unexpected_keys:
            log.info(
                "%s: ignored %d ViT keys, e.g. %s",
                path,
                len(res.unexpected_keys),
                res.unexpected_keys[:3],
            )
        self._cfg["init"]["image_pretrained"] = str(path)

    def load_text_pretrained(self, folder: str | Path) -> None:
        """BERT weights from a local HF folder (model.safetensors or pytorch_model.bin)."""
        folder = Path(folder)
        files = [folder / n for n in ("model.safetensors", "pytorch_model.bin")]
        f = next((p for p in files if p.is_file()), None)
        if f is None:
            raise CvlError(f"{folder}: no model.safetensors or pytorch_model.bin")
        sd = _read_state_dict(f)
        n_layers = self.text_layers + self.fusion_layers
        own = self.text_encoder.state_dict()
        out: dict[str, torch.Tensor] = {}
        for k, v in sd.items():
            k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias"
            )
            if k.startswith("bert."):
                k = k[len("bert.") :]
            if k.startswith("cls."):
                key = k
            elif k.startswith(("embeddings.", "encoder.")):
                key = "bert." + k
            else:
                continue  # pooler, NSP head, position_ids ...
            if key.startswith("bert.encoder.layer."):
                if int(key.split(".")[3]) >= n_layers:
                    continue
            if key not in own:
                continue
            if own[key].shape != v.shape:
                raise CvlError(
                    f"{f}: {key} has shape {tuple(v.shape)}, model has {tuple(own[key].shape)}"
                )
            out[key] = v
        res = self.text_encoder.load_state_dict(out, strict=False)
        missing = [
            k for k in res.missing_keys if ".crossattention." not in k and not k.startswith("cls.")
        ]
        if missing:
            raise CvlError(
                f"{f}: not a fitting BERT checkpoint; missing {len(missing)} keys, e.g. {missing[:3]}"
            )
        self._cfg["init"]["text_pretrained"] = str(folder)

    def load_pretrained(self, path: str | Path) -> None:
        """Full-model weights: a cvl model file or an ALBEF/CTP checkpoint (extra keys such as
        the momentum encoders, queues or ITM head are ignored; every model key must be present)."""
        from cvl.models.weights import is_cvl_checkpoint, load_weights

        p = Path(path)
        if is_cvl_checkpoint(p):
            load_weights(self, p)
        else:
            sd = _read_state_dict(p)
            sd = {k[7:] if k.startswith("module.") else k: v for k, v in sd.items()}
            own = self.state_dict()
            sd = {k: v for k, v in sd.items() if k in own}
            sd.setdefault(
                "text_encoder.cls.predictions.decoder.weight",
                sd.get("text_encoder.bert.embeddings.word_embeddings.weight"),
            )
            sd = {k: v for k, v in sd.items() if v is not None}
            try:
                res = self.load_state_dict(sd, strict=False)
            except RuntimeError as e:
                raise CvlError(
                    f"{p}: weights do not fit this model ({str(e).splitlines()[0]})"
                ) from None
            if res.missing_keys:
                raise CvlError(
                    f"{p}: missing {len(res.missing_keys)} model keys, e.g. {res.missing_keys[:3]}"
                )
        self._cfg["init"]["pretrained"] = str(p)


def mlm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over the masked positions; a graph-connected 0 when nothing was masked.

    Summed, then divided by the count (at least 1): no host sync to test for "nothing"."""
    flat = labels.reshape(-1)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), flat, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return ce / (flat != IGNORE_INDEX).sum().clamp(min=1)


def mlm_distillation(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Soft-label MLM loss at the masked positions: −T²·Σ softmax(teacher/T)·log_softmax(student/T).

    CTP's L_mlm^c and ALBEF's momentum distillation (T = 1, where the T² factor is 1 and this
    is exactly their equation); LwF/LUCIR's MLM distillation. T² (Hinton et al.) keeps the
    gradient scale independent of T when T ≠ 1 is chosen.

    Computed at every position and averaged over the masked ones (selecting the masked rows
    first would size a tensor by a count on the device: a host sync per step); a
    graph-connected 0 when nothing was masked.
    """
    sel = labels != IGNORE_INDEX
    t = F.softmax(teacher_logits.detach().float() / temperature, dim=-1)
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    per_pos = torch.where(sel, -(t * s).sum(-1), 0.0)
    return per_pos.sum() / sel.sum().clamp(min=1) * (temperature**2)


def _read_state_dict(p: Path) -> dict[str, torch.Tensor]:
    if not p.is_file():
        raise CvlError(f"{p}: weights file not found")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd: Any = load_file(str(p))
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt file, or a pickle that weights_only refuses
        raise CvlError(f"{p}: cannot read weights ({type(e).__name__}: {str(e)[:200]})") from None
    for key in ("model", "state_dict", "module"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise CvlError(f"{p}: not a state dict")
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def build_fusion(
    cfg: dict[str, Any], pretrained: str | None = None, tokenizer: dict[str, Any] | None = None
) -> FusionModel:
    model = FusionModel(normalize_config(cfg, tokenizer))
    if cfg.get("image_pretrained"):
        model.load_image_pretrained(cfg["image_pretrained"])
    if cfg.get("text_pretrained"):
        model.load_text_pretrained(cfg["text_pretrained"])
    if pretrained:
        model.load_pretrained(pretrained)
    return model
