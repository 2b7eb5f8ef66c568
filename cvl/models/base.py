"""The one small interface every model satisfies, so methods never branch on the model type.

A `VLModel` is an `nn.Module` with:

- `kind`: "clip" or "fusion"; `embed_dim`; `image_size`; `tokenizer` (callable
  `list[str] -> LongTensor[N, L]`, with `pad_id`, `cls_id`, `sep_id`, `mask_id`, `vocab_size`);
- `encode_image(images, normalize=True) -> [N, D]` and `encode_text(tokens, normalize=True)
  -> [N, D]`: the projected embeddings used by every contrastive term;
- `logit_scale() -> Tensor`: the multiplier 1/τ applied to cosine similarities (CLIP: learnable,
  `exp` of a parameter clamped at 100; fusion: fixed 1/0.07);
- `forward(images, tokens) -> dict` with at least `image_features`, `text_features`
  (normalised), `image_raw`, `text_raw` (the same projections before normalisation: MAS
  importance, LwF's feature distillation) and `logit_scale`; the fusion model adds `image_embeds` (ViT tokens),
  `image_atts`, `text_cls` / `image_cls` (un-projected CLS states) and `text_hidden`;
- `has_fusion`: whether the fusion encoder (cross-attention + MLM head) exists; then also
  `mask_tokens(tokens, generator, prob=0.15) -> (masked_ids, labels)`,
  `mlm_logits(image_embeds, image_atts, masked_ids) -> [N, L, V]`,
  `mlm_loss(images_or_embeds, tokens, generator | masked=...) -> (loss, logits, labels)`,
  `fusion_cls(image_embeds, tokens) -> [N, H]` and `forward(..., mlm_ids=...)` adding
  `mlm_logits` (see `cvl.models.fusion`);
- `config() -> dict`: JSON-able and complete (kind, architecture, tokenizer, image_size,
  embed_dim); `cvl.models.model_from_config(cfg)` rebuilds the same architecture.

Terms that need the fusion encoder (MLM, MLM distillation) check `model.has_fusion` and raise
`MissingFusionError` with a clear message instead of silently skipping.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.errors import CvlError


class MissingFusionError(CvlError):
    """A loss term needs the fusion encoder (MLM) but the model is a dual encoder."""


class VLModel(nn.Module):
    """Base class: subclasses implement the encoders; see the module docstring."""

    kind: str = "base"
    has_fusion: bool = False
    embed_dim: int
    image_size: int
    tokenizer: Any

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def logit_scale(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        image_raw = self.encode_image(images, normalize=False)
        text_raw = self.encode_text(tokens, normalize=False)
        return {
            "image_features": F.normalize(image_raw, dim=-1),
            "text_features": F.normalize(text_raw, dim=-1),
            "image_raw": image_raw,
            "text_raw": text_raw,
            "logit_scale": self.logit_scale(),
        }

    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    def towers(self) -> dict[str, tuple[str, ...]]:
        """Parameter-name prefixes of the "image" and "text" towers (`--tune locked-*`)."""
        raise CvlError(f"the '{self.kind}' model does not name its towers")

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute the encoders' transformer blocks in backward instead of storing them."""
        raise CvlError(f"--grad-checkpointing is not supported by the '{self.kind}' model")

    def require_fusion(self, what: str) -> None:
        """Raise a clear error when `what` needs the fusion encoder this model lacks."""
        if not self.has_fusion:
            raise MissingFusionError(
                f"{what} needs the fusion encoder (MLM); use --model fusion, "
                f"or disable the term (this model is '{self.kind}')"
            )
