"""Loss terms shared by several methods (each lives once, here).

Conventions: features are L2-normalised; `scale` multiplies cosine similarities (1/τ); every
similarity matrix is built from this rank's rows against the **global** batch (gathered with
gradient), open_clip's `ClipLoss(local_loss=True, gather_with_grad=True)` arithmetic, so the
averaged gradient over ranks equals the single-process gradient on the whole global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cvl.dist import gather_no_grad, gather_with_grad, local_rows


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


# -- old-vs-new contrastive matrices (Mod-X, DKR) ---------------------------------------------


def old_new_global_logits(
    image: torch.Tensor,
    text: torch.Tensor,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
    old_scale: torch.Tensor | float = 1.0,
) -> dict[str, torch.Tensor]:
    """The current and the old (frozen) model's i2t / t2i matrices on the same global batch.

    Rows are this rank's samples, columns the whole gathered batch (see `global_logits`):
    `i2t[i, j] = scale·v_i·w_j`, `t2i[i, j] = scale·w_i·v_j`; `old_*` the same with the old
    model's features v', w' and `old_scale`, computed without gradient (old features are
    gathered too). Keys: i2t, t2i, old_i2t, old_t2i, targets (global index of each row's pair).
    """
    i2t, t2i, y = global_logits(image, text, scale)
    with torch.no_grad():
        oi2t, ot2i, _ = global_logits(old_image.detach(), old_text.detach(), old_scale)
    return {"i2t": i2t, "t2i": t2i, "old_i2t": oi2t, "old_t2i": ot2i, "targets": y}


def row_correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Bool per row: the row's largest entry is its own pair (argmax_j M[i, j] == target_i).

    Invariant to a positive scale and to a row-wise softmax, so it can be asked of cosines,
    logits or affinities alike ("the model retrieves sample i correctly").
    """
    return logits.detach().argmax(dim=-1) == targets


def sum_over_global_rows(per_row: torch.Tensor) -> torch.Tensor:
    """Σ over the rows of the whole global batch, given this rank's per-row values.

    Each rank returns world_size × its local sum: gradients are averaged over ranks, and the
    logged value is the rank mean, so both equal the single-process sum over all rows (ranks
    hold equal row counts). Use `.mean()` for a per-row mean (no factor needed).
    """
    from cvl.dist import world_size

    return per_row.sum() * world_size()


_LOG2 = 0.6931471805599453


def js_rows(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-row Jensen-Shannon term KL(a‖m) + KL(b‖m), m = (a+b)/2 (no ½ factors; DKR Eq. 5).

    a = `target` (non-negative rows, no gradient; they need not sum to 1, the sums
    Σ a·log(a/m) are taken as written), b = softmax(`logits`). Computed in log space
    (log m = logaddexp(log a, log b) − log 2) so rows with vanishing probabilities keep finite
    gradients.
    """
    a = target.detach()
    log_b = F.log_softmax(logits, dim=-1)
    b = log_b.exp()
    log_m = torch.logaddexp(a.log(), log_b) - _LOG2  # a.log() is −inf where a = 0: fine
    kl_a = (torch.xlogy(a, a) - a * log_m).sum(-1)
    kl_b = (b * (log_b - log_m)).sum(-1)
    return kl_a + kl_b


# -- distillation from a teacher (old / momentum model) -----------------------------------------


def global_mlm_distillation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, temp: float
) -> torch.Tensor:
    """`mlm_distillation` averaged over the masked positions of the *global* batch.

    Each rank returns (its sum) · world / (global count), so the rank-averaged gradient is the
    one-process gradient even when ranks mask different numbers of tokens. Used by CTP (from
    the momentum model), LwF, iCaRL and LUCIR (from the previous task's model).
    """
    from cvl.dist import all_reduce_mean, world_size
    from cvl.models.fusion import IGNORE_INDEX, mlm_distillation

    n_local = (labels != IGNORE_INDEX).sum().float()
    n_global = all_reduce_mean(n_local) * world_size()
    loss = mlm_distillation(student_logits, teacher_logits, labels, temp)
    return loss * n_local * world_size() / n_global.clamp(min=1.0)


def cosine_distance(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over all leading positions of 1 − cos(x, target) along the last dimension.

    `target` (the old model's states) carries no gradient. LUCIR's "less-forget" term.
    """
    return (1.0 - F.cosine_similarity(x, target.detach(), dim=-1)).mean()


# -- masked rows / columns of the global batch (replay-aware methods: DER, Co2L, ERL) -----------


def global_count(mask: torch.Tensor) -> torch.Tensor:
    """Number of True entries of a per-row mask over the whole global batch (no gradient)."""
    from cvl.dist import all_reduce_mean, world_size

    return all_reduce_mean(mask.float().sum()) * world_size()


def global_masked_mean(
    per_row: torch.Tensor, mask: torch.Tensor, n: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of `per_row` over the rows of the global batch where `mask` holds.

    Each rank returns (its masked sum)·world/(global count), so the rank-averaged value and
    gradient are the one-process mean even when ranks hold different numbers of masked rows;
    0 (with a graph) when no row of the global batch is masked in. `n`: the global count
    (`global_count(mask)`) when the caller has it already (saves an all_reduce).
    """
    from cvl.dist import world_size

    n = global_count(mask) if n is None else n
    return (per_row * mask.float()).sum() * world_size() / n.clamp(min=1.0)


_MASKED = -1.0e4  # a left-out column's logit: exp underflows to 0, finite in fp16 too


def masked_clip_loss(
    image: torch.Tensor,
    text: torch.Tensor,
    scale: torch.Tensor | float,
    anchors: torch.Tensor,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Symmetric InfoNCE over the global batch with only some rows as anchors.

    `anchors` (bool, this rank's rows): rows whose i2t and t2i cross-entropies are averaged;
    `candidates` (bool, this rank's rows; default all): columns that take part in the softmax
    (gathered over ranks). Co2L's asymmetric loss: anchors = current-task items, candidates =
    all (buffer items are negatives only); DER: anchors = candidates = current-task items.
    """
    i2t, t2i, y = global_logits(image, text, scale)
    if candidates is not None:
        cols = gather_no_grad(candidates.to(image.device))
        i2t = i2t.masked_fill(~cols[None, :], _MASKED)
        t2i = t2i.masked_fill(~cols[None, :], _MASKED)
    ce = F.cross_entropy(i2t, y, reduction="none") + F.cross_entropy(t2i, y, reduction="none")
    anchors = anchors.to(image.device)
    return global_masked_mean(torch.where(anchors, ce / 2, torch.zeros_like(ce)), anchors)


def off_diagonal_logits(x: torch.Tensor, all_x: torch.Tensor, temp: float) -> torch.Tensor:
    """x·all_xᵀ/temp for this rank's rows against the global batch, each row's own column
    removed: shape (n_local, N − 1). Self-similarity rows for relation distillation.

    The kept columns are gathered by index (a boolean mask would need a host sync on a GPU
    to size its result)."""
    sim = x @ all_x.t() / temp
    rows = local_rows(x.shape[0])
    own = torch.arange(rows.start, rows.stop, device=x.device)[:, None]
    cols = torch.arange(sim.shape[1] - 1, device=x.device)[None, :]
    return sim.gather(1, cols + (cols >= own).long())


# -- classification over class texts (`--base-loss class-ce`: MTIL, the ZSCL code) ---------------


def class_text_ce(
    image: torch.Tensor,
    class_text: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor | float,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of each image over the class-text embeddings, averaged over the rows of
    the global batch that carry a label (label -1: an item of no class here, e.g. a replayed
    item of an earlier task, which only the method's own terms see).

    logits = `scale`·v·Wᵀ (v: normalised image features [n, D], W: normalised class texts
    [C, D], every class of the task, not only the batch's); the ZSCL code's
    ``F.cross_entropy(logit_scale.exp() * out @ embeddings.t(), labels, label_smoothing=ls)``,
    i.e. per row −(1−ε)·log p_y − ε/C·Σ_c log p_c. Every rank holds the same W (computed from
    the same prompts and weights), so the rank-averaged gradient is the one-process gradient
    of the global-batch mean (`global_masked_mean`).
    """
    logits = scale * image @ class_text.t()
    keep = labels >= 0
    ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none", label_smoothing=smoothing)
    return global_masked_mean(torch.where(keep, ce, torch.zeros_like(ce)), keep)
