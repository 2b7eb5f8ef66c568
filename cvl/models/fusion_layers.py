"""The `fusion` model's building blocks: the BERT layers (self-attention, optional
cross-attention to the image tokens, the MLM head with its decoder tied to the word embeddings),
under the same parameter names as HF `BertModel` / `BertForMaskedLM` and ALBEF's `xbert`, their
initialisation, and the timm ViT image encoder.

Kept apart from `FusionModel` (fusion.py), which assembles them, loads pretrained weights into
them and computes the losses' inputs. `cvl.models.fusion` re-exports every name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.errors import CvlError
from cvl.models.fusion_config import (
    VIT_DEFAULTS,
)


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


class BertModel(nn.Module):
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


class TextEncoder(nn.Module):
    """ALBEF's `text_encoder` (a BertForMaskedLM): `bert` + MLM head `cls`."""

    def __init__(self, c: dict[str, Any], text_layers: int, fusion_layers: int, cross_width: int):
        super().__init__()
        self.bert = BertModel(c, text_layers, fusion_layers, cross_width)
        self.cls = _MLMHead(c, self.bert.embeddings.word_embeddings)


def init_bert(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def build_vit(v: dict[str, Any]) -> nn.Module:
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
