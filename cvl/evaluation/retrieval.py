"""Cross-modal retrieval: TR@K (image -> text), IR@K (text -> image), Rm and R@mean.

Definitions (CTP §5.1, DHA §4.1, and the CTP / ALBEF / CLIP_benchmark evaluation code):

- TR@K: share of images for which *any* of their positive captions is in the top K of the
  ranking of all captions (COCO Karpathy protocol: an image with 5 captions is a hit if one
  of the 5 is retrieved).
- IR@K: share of captions whose image is in the top K of the ranking of all images.
- Rm = mean of TR@1/5/10 and IR@1/5/10 (CTP); TR@mean / IR@mean = mean of the three recalls of
  one direction (DHA's R@mean, reported per direction: I2T and T2I). All values in percent.

Positives form one bipartite relation E between images and captions, used by both directions:

- `match="pair"` (default for real data): caption j is positive for image i iff j was written
  for i (`text_to_image[j] == i`).
- `match="text"` (default for synthetic streams, whose captions repeat inside a test set):
  caption j is positive for image i iff its text is *identical* to one of image i's own
  captions. Otherwise two images with the same caption would count each other's caption as a
  miss, although no model can tell them apart from the text.

Ties: a negative whose score equals the best positive's score (within `TIE_EPS`) is ranked
*before* it ("pessimistic", the default), so a collapsed model that gives every pair the same
score gets 0, not 100. `ties="optimistic"` ranks tied negatives after the positive.

Memory: the similarity matrix is never held whole. One pass over blocks of image rows
computes `block = images[r0:r1] @ texts.T` (at most `block_elems` scores), from which both
directions are counted: the rank of an image's best positive is the number of negatives in
its row scoring >= that positive's score; a caption's rank accumulates the same count down its
column over all blocks. Both thresholds (best positive score per image / per caption) are
computed beforehand from the |E| positive pairs only; positives are counted with everything
else and subtracted again using their values read from the same block (exact). Extra memory
is O(N + |E|) plus one block (~1.25 x block_elems x 4 bytes), and the FLOPs are one N x M
matmul (see benchmarks/bench_retrieval.py).

Device: everything above runs where `device` says (default: where the features are; `cvl eval`
passes its `--device`), the blocks included; only the ranks come back to the CPU. The scores
are full float32 there too: TF32 is switched off for the call (`cvl.device.exact_float32`), so a
GPU ranks as the CPU does up to float32 rounding.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cvl.device import exact_float32

TIE_EPS = 1e-6
DEFAULT_BLOCK_ELEMS = 1 << 24  # 16M scores = 64 MB float32 per block
MAX_BLOCK_ROWS = 32767  # column counts of one block are summed in int16
_ROW_CHUNK = 32767


def _count_rows(mask: torch.Tensor) -> torch.Tensor:
    """Per-row number of True (int16 partial sums over column chunks: much faster than int64)."""
    u = mask.view(torch.uint8)
    out = torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    for c0 in range(0, mask.shape[1], _ROW_CHUNK):
        out += u[:, c0 : c0 + _ROW_CHUNK].sum(1, dtype=torch.int16).long()
    return out


KS = (1, 5, 10)


@dataclass
class Positives:
    """The image-caption relation E as parallel index tensors, sorted by image."""

    image: torch.Tensor  # [P] long
    text: torch.Tensor  # [P] long
    n_images: int
    n_texts: int

    def image_ptr(self) -> torch.Tensor:
        """CSR row pointer: edges of image i are positions ptr[i]:ptr[i+1]."""
        counts = torch.bincount(self.image, minlength=self.n_images)
        return torch.cat([torch.zeros(1, dtype=torch.long, device=counts.device), counts.cumsum(0)])

    def to(self, device: torch.device | str) -> Positives:
        return Positives(self.image.to(device), self.text.to(device), self.n_images, self.n_texts)


def pair_positives(text_to_image: torch.Tensor, n_images: int) -> Positives:
    """E = {(text_to_image[j], j)}: each caption is positive only for its own image."""
    t2i = torch.as_tensor(text_to_image, dtype=torch.long)
    order = torch.sort(t2i, stable=True).indices
    return Positives(t2i[order], order, n_images, t2i.numel())


def text_match_positives(
    text_to_image: torch.Tensor, captions: Sequence[str], n_images: int
) -> Positives:
    """E = {(i, j): caption j's text equals one of image i's captions} (identical strings)."""
    t2i = torch.as_tensor(text_to_image, dtype=torch.long).tolist()
    if len(captions) != len(t2i):
        raise ValueError("captions and text_to_image differ in length")
    by_text: dict[str, list[int]] = defaultdict(list)
    for j, c in enumerate(captions):
        by_text[c].append(j)
    texts_of_image: list[set[str]] = [set() for _ in range(n_images)]
    for j, i in enumerate(t2i):
        texts_of_image[i].add(captions[j])
    img, txt = [], []
    for i in range(n_images):
        js = sorted(j for c in texts_of_image[i] for j in by_text[c])
        img.extend([i] * len(js))
        txt.extend(js)
    return Positives(
        torch.tensor(img, dtype=torch.long), torch.tensor(txt, dtype=torch.long), n_images, len(t2i)
    )


def _best_positive_scores(
    a: torch.Tensor, b: torch.Tensor, pos: Positives
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best positive score per image and per caption, from the positive pairs only."""
    s = torch.empty(0, dtype=torch.float32, device=a.device)
    chunks = []
    for p0 in range(0, pos.image.numel(), 1 << 16):
        ii, jj = pos.image[p0 : p0 + (1 << 16)], pos.text[p0 : p0 + (1 << 16)]
        chunks.append((a[ii].float() * b[jj].float()).sum(-1))
    s = torch.cat(chunks) if chunks else s
    neg_inf = torch.full((pos.n_images,), float("-inf"), device=a.device)
    best_img = neg_inf.scatter_reduce(0, pos.image, s, reduce="amax", include_self=True)
    neg_inf_t = torch.full((pos.n_texts,), float("-inf"), device=a.device)
    best_txt = neg_inf_t.scatter_reduce(0, pos.text, s, reduce="amax", include_self=True)
    return best_img, best_txt


@torch.no_grad()
def retrieval_ranks(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    positives: Positives,
    ties: str = "pessimistic",
    block_elems: int = DEFAULT_BLOCK_ELEMS,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based rank of the best positive for every image (among captions) and caption.

    An item without any positive gets rank = gallery size (never a hit). Scores are dot
    products (features are expected L2-normalised, so these are cosines). Computed on
    `device` (default: the features'); the ranks are returned on the CPU.
    """
    if ties not in ("pessimistic", "optimistic"):
        raise ValueError(f"ties must be 'pessimistic' or 'optimistic', got {ties!r}")
    dev = torch.device(device) if device is not None else image_features.device
    with exact_float32():
        img_rank, txt_rank = _ranks(
            image_features.to(dev, torch.float32),
            text_features.to(dev, torch.float32),
            positives.to(dev),
            ties,
            block_elems,
        )
    return img_rank.cpu(), txt_rank.cpu()


def _ranks(
    img: torch.Tensor, txt: torch.Tensor, positives: Positives, ties: str, block_elems: int
) -> tuple[torch.Tensor, torch.Tensor]:
    n_i, n_t = img.shape[0], txt.shape[0]
    if (n_i, n_t) != (positives.n_images, positives.n_texts):
        raise ValueError("positives were built for another number of images/captions")
    dev = img.device
    best_img, best_txt = _best_positive_scores(img, txt, positives)
    # A score s counts against a positive with best score p when s >= p - eps (pessimistic)
    # or s > p + eps (optimistic).
    shift = -TIE_EPS if ties == "pessimistic" else TIE_EPS
    th_img, th_txt = best_img + shift, best_txt + shift
    ptr = positives.image_ptr().tolist()  # block bounds, read on the host once
    rows = max(1, min(n_i, MAX_BLOCK_ROWS, block_elems // max(1, n_t)))
    img_rank = torch.zeros(n_i, dtype=torch.long, device=dev)
    txt_rank = torch.zeros(n_t, dtype=torch.long, device=dev)
    txt_t = txt.t().contiguous()
    ge = torch.ge if ties == "pessimistic" else torch.gt
    # Reused buffers: one block of scores and one of comparison results (no per-block
    # allocation, so no page-fault churn on large sets).
    block_buf = torch.empty(rows, n_t, dtype=torch.float32, device=dev)
    mask_buf = torch.empty(rows, n_t, dtype=torch.bool, device=dev)
    for r0 in range(0, n_i, rows):
        r1 = min(n_i, r0 + rows)
        block = torch.mm(img[r0:r1], txt_t, out=block_buf[: r1 - r0])  # [c, n_t]
        mask = mask_buf[: r1 - r0]
        # Count every score past the thresholds, then take the positives back out (their
        # values are read from this very block, so the correction is exact).
        img_rank[r0:r1] += _count_rows(ge(block, th_img[r0:r1, None], out=mask))
        ge(block, th_txt[None, :], out=mask)
        txt_rank += mask.view(torch.uint8).sum(0, dtype=torch.int16).long()
        e0, e1 = ptr[r0], ptr[r1]
        pi, pj = positives.image[e0:e1], positives.text[e0:e1]
        vals = block.view(-1)[(pi - r0) * n_t + pj]
        img_rank[r0:r1] -= torch.bincount(pi[ge(vals, th_img[pi])] - r0, minlength=r1 - r0)
        txt_rank -= torch.bincount(pj[ge(vals, th_txt[pj])], minlength=n_t)
    img_rank[torch.isinf(best_img)] = n_t
    txt_rank[torch.isinf(best_txt)] = n_i
    return img_rank, txt_rank


def recall_at(ranks: torch.Tensor, ks: Sequence[int] = KS) -> dict[int, float]:
    """Percent of queries whose best positive has 0-based rank < K."""
    n = max(1, ranks.numel())
    return {k: 100.0 * float((ranks < k).sum()) / n for k in ks}


def summarize(img_rank: torch.Tensor, txt_rank: torch.Tensor, ks: Sequence[int] = KS) -> dict:
    """TR@K, IR@K, TR@mean, IR@mean, Rm (mean of all TR@K and IR@K) from the ranks."""
    tr, ir = recall_at(img_rank, ks), recall_at(txt_rank, ks)
    out: dict[str, float] = {}
    for k in ks:
        out[f"TR@{k}"] = tr[k]
    for k in ks:
        out[f"IR@{k}"] = ir[k]
    out["TR@mean"] = sum(tr.values()) / len(ks)
    out["IR@mean"] = sum(ir.values()) / len(ks)
    out["Rm"] = (out["TR@mean"] + out["IR@mean"]) / 2
    return out


def retrieval_metrics(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: torch.Tensor,
    captions: Sequence[str] | None = None,
    match: str = "pair",
    ks: Sequence[int] = KS,
    ties: str = "pessimistic",
    block_elems: int = DEFAULT_BLOCK_ELEMS,
    device: torch.device | str | None = None,
) -> dict:
    """All retrieval metrics of one eval set (see the module docstring for the definitions);
    similarity and ranking on `device` (default: where the features are)."""
    n_i = image_features.shape[0]
    if match == "text":
        if captions is None:
            raise ValueError("match='text' needs the captions")
        pos = text_match_positives(text_to_image, captions, n_i)
    elif match == "pair":
        pos = pair_positives(text_to_image, n_i)
    else:
        raise ValueError(f"match must be 'pair' or 'text', got {match!r}")
    img_rank, txt_rank = retrieval_ranks(
        image_features, text_features, pos, ties, block_elems, device
    )
    out = summarize(img_rank, txt_rank, ks)
    out["n_images"] = n_i
    out["n_texts"] = int(text_features.shape[0])
    return out
