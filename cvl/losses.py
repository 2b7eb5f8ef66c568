"""Loss terms shared by several methods (each lives once, here).

Conventions: features are L2-normalised; `scale` multiplies cosine similarities (1/τ); every
similarity matrix is built from this rank's rows against the **global** batch (gathered with
gradient), open_clip's `ClipLoss(local_loss=True, gather_with_grad=True)` arithmetic, so the
averaged gradient over ranks equals the single-process gradient on the whole global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cvl.dist import gather_with_grad, local_rows


def global_logits(
    image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(i2t, t2i, targets): this rank's rows against all ranks' columns, with their labels."""
    all_image, all_text = gather_with_grad(image), gather_with_grad(text)
    i2t = scale * image @ all_text.t()
    t2i = scale * text @ all_image.t()
    rows = local_rows(image.shape[0])
    targets = torch.arange(rows.start, rows.stop, device=image.device)
    return i2t, t2i, targets


def clip_loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Symmetric InfoNCE over the global batch: (CE(i2t) + CE(t2i)) / 2."""
    i2t, t2i, y = global_logits(image, text, scale)
    return (F.cross_entropy(i2t, y) + F.cross_entropy(t2i, y)) / 2


def kl_rows(
    target_logits: torch.Tensor, logits: torch.Tensor, reduction: str = "batchmean"
) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)) per row (target = teacher / old model).

    `batchmean`: summed over the row's entries, averaged over rows; `sum`: summed over all.
    """
    t = F.log_softmax(target_logits, dim=-1)
    s = F.log_softmax(logits, dim=-1)
    return F.kl_div(s, t, reduction=reduction, log_target=True)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Mean over rows of −Σ p·log softmax(logits) (distillation with soft targets)."""
    return -(target_probs * F.log_softmax(logits, dim=-1)).sum(-1).mean()
