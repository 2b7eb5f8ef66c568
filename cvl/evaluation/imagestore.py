"""Decoded evaluation images kept across checkpoints: each eval set is decoded once per command.

Every checkpoint of a run (and every run of a `cvl eval --compare` on one stream) shares the
first half of the eval transform (resize + centre crop to uint8, `EvalTransform.to_uint8`), so
the tensors decoded for the first checkpoint serve all later ones. The first pass over a set
decodes in the loader's worker processes; the main process copies each batch it receives into
one preallocated uint8 tensor per set (a memo inside the dataset could not fill: workers are
separate processes, and what they remember never reaches the main one). Later passes slice
that tensor: no loader, no JPEG. A set is kept whole or not at all: when its bytes fit in what
is left of the budget (`--image-cache-mb`); a set that does not fit is decoded on every pass.
The captions' tokens are kept the same way (per tokenizer). On CUDA the kept tensors are pinned,
so copies to the device are asynchronous.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from cvl.data.reader import eval_loader
from cvl.evaluation.options import DEFAULT_IMAGE_CACHE_MB


def collate_kept(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack the items that decoded (`image` not None), keep the rest as lists; the items that
    failed are left out and counted in `n_bad` (their messages in `errors`)."""
    good = [it for it in items if it["image"] is not None]
    out: dict[str, Any] = {
        "n_bad": len(items) - len(good),
        "errors": [it.get("error", "") for it in items if it["image"] is None],
    }
    if not good:
        out["image"] = None
        return out
    for k in good[0]:
        vals = [it[k] for it in good]
        out[k] = torch.stack(vals) if isinstance(vals[0], torch.Tensor) else vals
    return out


@dataclass
class StoredSet:
    """One eval set's part of this process, decoded: uint8 images and per-item metadata."""

    images: torch.Tensor  # [n, 3, H, W] uint8 (pinned on CUDA)
    meta: dict[str, list[Any]]  # e.g. id, caption, captions, category, task: one entry per image
    n_bad: int  # items that failed to decode (left out)
    errors: list[str]

    def __len__(self) -> int:
        return self.images.shape[0]


@dataclass
class ImageStore:
    """Eval sets decoded once and kept, within `budget_mb` (0 = keep nothing)."""

    budget_mb: int = DEFAULT_IMAGE_CACHE_MB
    used: int = 0  # bytes kept (images + tokens)
    sets: dict[str, StoredSet] = field(default_factory=dict)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    decoded: int = 0  # images decoded from their files, over every pass
    reused: int = 0  # images served from the store instead
    passes: int = 0  # embedding passes over a set
    too_big: set[str] = field(default_factory=set)  # sets that did not fit

    @property
    def budget(self) -> int:
        return max(0, self.budget_mb) * 2**20

    @staticmethod
    def key(*parts: Any) -> str:
        """A stable key for what a set holds (entries, transform, rank)."""
        blob = json.dumps(parts, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()

    def reserve(self, nbytes: int) -> bool:
        """Count `nbytes` against the budget if they fit; False (nothing counted) if not."""
        if self.used + nbytes > self.budget:
            return False
        self.used += nbytes
        return True

    def stats(self) -> dict[str, Any]:
        """What the store did: for metrics.json's `runtime` and the benchmark."""
        return {
            "image_cache_mb": self.budget_mb,
            "kept_mb": round(self.used / 2**20, 1),
            "sets_kept": len(self.sets),
            "sets_too_big": len(self.too_big),
            "images_decoded": self.decoded,
            "images_reused": self.reused,
            "embedding_passes": self.passes,
        }


class ImageBatches:
    """In-order batches of this rank's part of `items`: from `store` when the set is kept
    there, else decoded by a loader (`num_workers` processes) and kept when it fits.

    Each batch is `collate_kept`'s dict (`image` None when no item of the batch decoded).
    After the iteration `n_bad` / `errors` say what was left out."""

    def __init__(
        self,
        items: Dataset,
        batch_size: int,
        rank: int = 0,
        world: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        store: ImageStore | None = None,
        key: str | None = None,
        collate_fn: Callable[[list[Any]], dict[str, Any]] = collate_kept,
    ) -> None:
        self.items, self.batch_size, self.rank, self.world = items, batch_size, rank, world
        self.num_workers, self.pin_memory, self.collate_fn = num_workers, pin_memory, collate_fn
        self.store = store if key is not None else None
        self.key = key
        n = len(items)
        per = -(-n // world)
        self.n_local = max(0, min(n, (rank + 1) * per) - rank * per)
        self.n_bad, self.errors = 0, []

    def __len__(self) -> int:
        return math.ceil(self.n_local / self.batch_size)

    @property
    def stored(self) -> bool:
        return self.store is not None and self.key in self.store.sets

    def __iter__(self) -> Iterator[dict[str, Any]]:
        st = self.store
        if st is not None:
            st.passes += 1
        if self.stored:
            kept = st.sets[self.key]
            self.n_bad, self.errors = kept.n_bad, list(kept.errors)
            st.reused += len(kept)
            for s in range(0, len(kept), self.batch_size):
                b = {k: v[s : s + self.batch_size] for k, v in kept.meta.items()}
                yield {"image": kept.images[s : s + self.batch_size], "n_bad": 0, "errors": [], **b}
            return
        loader = eval_loader(
            self.items,
            self.batch_size,
            self.rank,
            self.world,
            self.num_workers,
            self.pin_memory,
            self.collate_fn,
        )
        buf: torch.Tensor | None = None
        keep = st is not None and self.key not in st.too_big
        meta: dict[str, list[Any]] = {}
        filled = 0
        for batch in loader:
            self.n_bad += batch["n_bad"]
            self.errors += batch["errors"]
            x = batch["image"]
            if x is not None:
                if st is not None:
                    st.decoded += x.shape[0]
                if keep and buf is None:
                    buf = self._allocate(x)
                    keep = buf is not None
                if keep and buf is not None:
                    buf[filled : filled + x.shape[0]].copy_(x)
                    filled += x.shape[0]
                    for k, v in batch.items():
                        if k not in ("image", "n_bad", "errors"):
                            meta.setdefault(k, []).extend(v)
            yield batch
        if keep and buf is not None and st is not None:
            st.sets[self.key] = StoredSet(buf[:filled], meta, self.n_bad, self.errors)

    def _allocate(self, first: torch.Tensor) -> torch.Tensor | None:
        """The set's tensor, when n_local items shaped like `first`'s fit in the budget."""
        st = self.store
        assert st is not None and self.key is not None
        shape = (self.n_local, *first.shape[1:])
        nbytes = math.prod(shape) * first.element_size()
        if not st.reserve(nbytes):
            st.too_big.add(self.key)
            return None
        if self.pin_memory:
            try:
                return torch.empty(shape, dtype=first.dtype, pin_memory=True)
            except RuntimeError:  # no pinnable memory left: a plain tensor still saves the decode
                pass
        return torch.empty(shape, dtype=first.dtype)
