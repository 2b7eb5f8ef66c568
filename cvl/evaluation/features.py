"""The features of one checkpoint: every eval set embedded once, whatever metric asks for it.

The metric code (`checkpoint.py`) asks `CheckpointFeatures` for a set's features: a task's
test set (retrieval, zero-shot, the cumulative sets), its val set (the probe's C), query and
gallery (mAP), a benchmark, the probe's training images. A request is answered from what this
checkpoint already embedded when an earlier pass covered the same samples with at least what
is asked (a set embedded with its captions also answers an images-only request). So a set is
embedded once per checkpoint even when it is asked for twice: tasks whose test sets are the
same shards (a composed stream's `test=full` parts), a benchmark that is a task's test set,
a val set that is the test set. Across checkpoints the decoded images come from the
`ImageStore` (decoded once per command).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cvl.evaluation.embed import Embeddings, embed_dataset, eval_dataset
from cvl.evaluation.imagestore import ImageStore


@dataclass
class EmbedSettings:
    """Where and how the embedding passes run (none of it changes a number but `precision`)."""

    batch_size: int = 256
    device: torch.device | None = None
    accelerator: Any = None
    num_workers: int = 0
    precision: str = "no"
    progress: bool = False
    store: ImageStore | None = None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `embed_dataset` / `embed_images` these settings fix."""
        return {
            "device": self.device,
            "num_workers": self.num_workers,
            "precision": self.precision,
            "store": self.store,
        }


class CheckpointFeatures:
    """One model's features of the eval sets, each set embedded at most once."""

    def __init__(self, model: Any, settings: EmbedSettings) -> None:
        self.model, self.s = model, settings
        self.memo: dict[tuple, tuple[tuple[bool, bool, bool], Embeddings]] = {}
        self.passes: Counter = Counter()  # embedding passes per set (tests count them)

    def pairs(
        self,
        shards: Sequence[Any],
        desc: str,
        texts: bool = True,
        all_captions: bool = True,
        fusion: bool = False,
    ) -> Embeddings:
        """Features of the eval set made of `shards` (samples that fail to decode left out)."""
        key = ("shards", *map(str, shards))
        return self.dataset(
            key,
            lambda: eval_dataset(self.model, list(shards), check=False),
            desc,
            texts=texts,
            all_captions=all_captions,
            fusion=fusion,
        )

    def dataset(
        self,
        key: tuple,
        make: Callable[[], Any],
        desc: str,
        texts: bool = True,
        all_captions: bool = True,
        fusion: bool = False,
    ) -> Embeddings:
        """Features of the dataset `make()` builds, remembered under `key` for this model."""
        want = (texts, all_captions, fusion)
        hit = self.memo.get(key)
        if hit is not None:
            have, e = hit
            if have == want or (have[2] or not fusion) and not texts:
                return e if texts else _images_only(e)
        e = embed_dataset(
            self.model,
            make(),
            self.s.batch_size,
            self.s.accelerator,
            progress=self.s.progress,
            all_captions=all_captions,
            desc=desc,
            texts=texts,
            fusion=fusion,
            **self.s.kwargs(),
        )
        self.passes[key] += 1
        if hit is None or texts:  # keep the richer pass
            self.memo[key] = (want, e)
        return e


def _images_only(e: Embeddings) -> Embeddings:
    """The same set's image features and labels, without its captions (texts=False)."""
    return dataclasses.replace(
        e,
        text_features=e.text_features[:0],
        text_to_image=e.text_to_image[:0],
        captions=[],
    )
