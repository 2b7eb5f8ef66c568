"""The `fusion` model: ALBEF-style, as in CTP (ViT + BERT split into text and fusion layers).

- image encoder: a timm `VisionTransformer` (tiny: 32 px, patch 8, width 64, depth 2; CTP:
  `deit_base_patch16_224`, weights from a local file);
- a BERT whose first `text_layers` layers are the text encoder (self-attention only) and whose
  last `fusion_layers` layers add cross-attention to the image tokens (the fusion encoder);
- an MLM head (BertForMaskedLM's, decoder tied to the word embeddings);
- linear projections of both CLS states to `embed_dim` (CTP: 256) and a fixed τ = 0.07.

The BERT layers are implemented in cvl (`fusion_layers.py`, with the same parameter names as
HF `BertModel` / `BertForMaskedLM` and as ALBEF's `xbert`), so `bert-base-chinese`-style
folders and ALBEF/CTP checkpoints load without depending on a transformers version's
internals; the config is read and checked in `fusion_config.py` (both re-exported here). The
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
from cvl.models.fusion_config import (  # noqa: F401  (re-exported: their home was this module)
    BERT_DEFAULTS,
    VIT_DEFAULTS,
    normalize_config,
)
from cvl.models.fusion_layers import (  # noqa: F401  (re-exported: their home was this module)
    BertModel,
    TextEncoder,
    build_vit,
    init_bert,
)
from cvl.models.weights import is_cvl_checkpoint, load_weights

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


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

        self.visual_encoder = build_vit(self._cfg["vision"])
        vision_width = int(self.visual_encoder.embed_dim)
        self.text_encoder = TextEncoder(c, self.text_layers, self.fusion_layers, vision_width)
        init_bert(self.text_encoder, c["initializer_range"])
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
    def bert(self) -> BertModel:
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
