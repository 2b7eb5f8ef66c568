"""Embedding extraction for evaluation and analysis: every image and every caption of a set.

Used by retrieval (all captions of an image count), mAP, zero-shot, linear probe and the
rotation analysis. Distributed-aware: each rank embeds a contiguous part of the set and the
parts are gathered in rank order, so all ranks hold the same full matrices.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from cvl.data.reader import PairDataset, collate
from cvl.data.transforms import EvalTransform
from cvl.device import exact_float32
from cvl.errors import CvlError
from cvl.evaluation.imagestore import ImageBatches, ImageStore, collate_kept
from cvl.evaluation.options import PRECISIONS
from cvl.progress import progress_bar


@dataclass
class Embeddings:
    """L2-normalised features of an eval set (float32, CPU).

    image_features[i] belongs to sample i; text_features[j] to caption j, whose image is
    text_to_image[j] (several captions per image are all embedded).
    """

    image_features: torch.Tensor
    text_features: torch.Tensor
    text_to_image: torch.Tensor
    captions: list[str]
    ids: list[str]
    categories: list[Any]
    tasks: list[Any]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.image_features.shape[0]


def autocast(device: torch.device | str, precision: str = "no") -> Any:
    """The embedding passes' autocast: `no` = none, in full float32 (no TF32 on a GPU, so a GPU
    embeds as the CPU does up to float32 rounding), `bf16` / `fp16` on `device`."""
    if precision not in PRECISIONS:
        raise CvlError(f"--precision must be one of {', '.join(PRECISIONS)}, got '{precision}'")
    if precision == "no":
        return exact_float32()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(torch.device(device).type, dtype=dtype)


def eval_dataset(model: Any, shards: list, check: bool = True) -> PairDataset:
    """A PairDataset over eval shards with the model's eval transform (no tokenisation).

    Unreadable samples are left out and counted: here when `check` (every image is decoded
    once, in this process; a warning on stderr names the shards), or by `embed_dataset` during
    its own pass when not (the evaluation's way: the images are decoded once, by its workers).
    """
    ds = PairDataset.from_shards(shards, transform=EvalTransform(model.image_size))
    ds.shards = [str(s) for s in shards]  # for the warning (entries may miss a shard)
    if check:
        ds.drop_unreadable()
        _warn_left_out(ds)
    return ds


_WARNED: set[tuple] = set()


def _warn_left_out(ds: PairDataset) -> None:
    """One warning per set and process: how many samples were left out of which shards."""
    skipped = ds.skipped
    shards = getattr(ds, "shards", None) or sorted({e.shard for e in ds.entries})
    key = (tuple(shards), tuple(sorted(skipped.items())))
    if skipped and key not in _WARNED:
        _WARNED.add(key)
        print(
            f"warning: {sum(skipped.values())} sample(s) left out of {shards[0]}"
            f"{f' (+{len(shards) - 1} shards)' if len(shards) > 1 else ''}: {dict(skipped)}",
            file=sys.stderr,
        )


class _PairItems(Dataset):
    """A PairDataset's samples as uint8 images (`to_uint8`) with their metadata; a sample that
    fails to decode comes back with image None (left out and counted, never replaced)."""

    def __init__(self, ds: PairDataset, to_uint8: Any) -> None:
        self.ds, self.to_uint8 = ds, to_uint8

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]

    def __getitems__(self, idx: list[int]) -> list[dict[str, Any]]:
        """A batch's items, their bytes read together; a shard that cannot be read raises
        (`ShardError`: never a left-out sample)."""
        return [self._item(i, r) for i, r in zip(idx, self.ds.read_raw_many(idx))]

    def _item(self, i: int, raw: Any) -> dict[str, Any]:
        try:
            if isinstance(raw, Exception):
                raise raw
            img, caption, meta = raw
            image = self.to_uint8(img)
        except Exception as e:  # corrupt JPEG, non-UTF-8 text, bad JSON: left out
            return {"image": None, "error": f"{self.ds.entries[i].key}: {e}"}
        return {
            "image": image,
            "caption": caption,
            "captions": list(meta.get("captions") or [caption]),
            "id": meta.get("id", self.ds.entries[i].key),
            "category": meta.get("category"),
            "task": meta.get("task"),
        }


def _collate_pairs(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A PairDataset's own items (any transform): nothing is left out (`collate_kept`'s keys)."""
    return {**collate(items), "n_bad": 0, "errors": []}


def _tokenizer_id(model: Any) -> str:
    cfg = model.config() if hasattr(model, "config") else {}
    return json.dumps(cfg.get("tokenizer"), sort_keys=True, default=str)


def _tokens(model: Any, texts: list[str], batch_size: int, store: Any, key: str | None) -> Any:
    """Token ids of `texts` ([N, L] on the CPU), kept in `store` under `key` when they fit."""
    if store is not None and key is not None and key in store.tokens:
        return store.tokens[key]
    parts = [model.tokenizer(texts[s : s + batch_size]) for s in range(0, len(texts), batch_size)]
    tok = torch.cat(parts) if parts else torch.zeros(0, 1, dtype=torch.long)
    if store is not None and key is not None and store.reserve(tok.numel() * tok.element_size()):
        store.tokens[key] = tok
    return tok


def placement(model: Any, accelerator: Any, device: Any) -> tuple[int, int, torch.device, bool]:
    """(rank, processes, device, pin memory) of an embedding pass: the accelerator's when there
    is one, else `device`, else where the model's weights are."""
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    if accelerator is not None:
        device = accelerator.device
    elif device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    return rank, world, device, device.type == "cuda"


@torch.no_grad()
def embed_dataset(
    model: Any,
    ds: PairDataset,
    batch_size: int = 256,
    accelerator: Any = None,
    progress: bool = False,
    all_captions: bool = True,
    desc: str = "embed",
    texts: bool = True,
    fusion: bool = False,
    *,
    device: torch.device | None = None,
    num_workers: int = 0,
    precision: str = "no",
    store: ImageStore | None = None,
) -> Embeddings:
    """Embed every image (and every caption, or the first per image) of `ds` with `model`.

    `texts=False` skips the captions (text_features is then empty). `fusion=True` also stores,
    in `extra["fusion"]`, the fusion encoder's [CLS] feature of each (image, first caption)
    pair (L2-normalised; the multi-modal feature CTP uses for mAP): `model.fusion_cls(
    model(images, tokens)["image_embeds"], tokens)`.

    Runs on `device` (default: the accelerator's, else the model's). With the model's eval
    transform (`eval_dataset`), `num_workers` processes decode to uint8, the device
    normalises (bit-identical to the float transform), samples that fail to decode are left
    out, and `store` keeps the decoded set for later checkpoints. `precision`: autocast of the
    encoders (`no` = float32); features are always returned in float32 on the CPU.
    """
    rank, world, device, pin = placement(model, accelerator, device)
    was_training = model.training
    model.eval()
    items, collate_fn, prepare, set_key, tok_key = _source(model, ds, store, rank, world)
    if tok_key is not None:
        tok_key = store.key(tok_key, all_captions)
    batches = ImageBatches(
        items, batch_size, rank, world, num_workers, pin, store, set_key, collate_fn
    )
    imgs, fus, meta = [], [], {"id": [], "category": [], "task": [], "captions": []}
    bar = progress_bar(batches, desc=desc, show=progress and rank == 0, leave=False)
    with autocast(device, precision):
        for batch in bar:
            if batch["image"] is None:
                continue
            images = prepare(batch["image"].to(device, non_blocking=pin))
            if fusion:
                tok = model.tokenizer(list(batch["caption"])).to(device)
                out = model(images, tok)
                cls = model.fusion_cls(out["image_embeds"], tok)
                fus.append(torch.nn.functional.normalize(cls.float(), dim=-1))
                imgs.append(out["image_features"].float())
            else:  # features stay on the device until the end: no sync per batch
                imgs.append(model.encode_image(images).float())
            for k in ("id", "category", "task"):
                meta[k].extend(batch[k])
            caps = batch["captions"] if all_captions else [[c] for c in batch["caption"]]
            meta["captions"].extend(caps)
        # Texts: this rank's captions (tokens kept with the set).
        flat = [c for cs in meta["captions"] for c in cs] if texts else []
        tokens = _tokens(model, flat, batch_size, store, tok_key).to(device) if flat else None
        txts = [
            model.encode_text(tokens[s : s + batch_size]).float()
            for s in range(0, len(flat), batch_size)
        ]
    empty = torch.zeros(0, model.embed_dim)
    feats = {
        "image": torch.cat(imgs).cpu() if imgs else empty,
        "text": torch.cat(txts).cpu() if txts else empty,
        "fusion": torch.cat(fus).cpu() if fus else None,
    }
    if fusion and feats["fusion"] is None:  # this rank's part had no readable sample
        feats["fusion"] = torch.zeros(0, 1)
    n_bad = batches.n_bad
    if world > 1:
        feats, meta, n_bad = _gather(accelerator, feats, meta, n_bad)
    if n_bad:
        ds.skipped["unreadable"] = n_bad
    if rank == 0:
        _warn_left_out(ds)
    if not meta["id"]:
        raise CvlError(f"{ds.name or desc}: every sample failed to decode")
    for what, f in (("image", feats["image"]), ("text", feats["text"])):
        if not bool(torch.isfinite(f).all()):  # NaN scores would compare as hits: refuse
            raise CvlError(
                f"{ds.name or desc}: the model's {what} features are not finite (NaN or inf) "
                f"for {int((~torch.isfinite(f)).any(-1).sum())} of {f.shape[0]} rows: its "
                "weights or normalisation statistics (e.g. a BatchNorm running_var < 0 after a "
                "merge) are broken; nothing was scored"
            )
    counts = [len(c) if texts else 0 for c in meta["captions"]]
    if was_training:
        model.train()
    return Embeddings(
        image_features=feats["image"],
        text_features=feats["text"],
        text_to_image=torch.repeat_interleave(
            torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long)
        ),
        captions=[c for cs in meta["captions"] for c in cs] if texts else [],
        ids=list(meta["id"]),
        categories=list(meta["category"]),
        tasks=list(meta["task"]),
        extra={"fusion": feats["fusion"]} if fusion else {},
    )


def _source(
    model: Any, ds: PairDataset, store: ImageStore | None, rank: int, world: int
) -> tuple[Dataset, Any, Any, str | None, str | None]:
    """How `ds`'s samples reach the model: (items, collate, prepare-on-device, the set's store
    key, the start of its tokens' key). The model's eval transform (`EvalTransform`): uint8
    items, samples that fail left out, normalised on the device, kept in the store. Another
    transform: the dataset's own float items, nothing kept."""
    tf = ds.transform
    if not isinstance(tf, EvalTransform):
        return ds, _collate_pairs, (lambda x: x), None, None
    set_key = tok_key = None
    if store is not None:
        refs = [(e.shard, e.key, e.image) for e in ds.entries]
        set_key = store.key("pairs", repr(tf.to_uint8), rank, world, refs)
        tok_key = store.key(set_key, _tokenizer_id(model))
    return _PairItems(ds, tf.to_uint8), collate_kept, tf.normalize, set_key, tok_key


def _gather(
    accelerator: Any, feats: dict[str, Any], meta: dict[str, list], n_bad: int
) -> tuple[dict[str, Any], dict[str, list], int]:
    """Every rank's features and metadata, in rank order (parts of any size)."""
    from accelerate.utils import gather_object

    out = {k: _gather_rows_var(v, accelerator) if v is not None else None for k, v in feats.items()}
    parts = gather_object([(meta, n_bad)])
    merged: dict[str, list] = {k: [] for k in meta}
    for m, _ in parts:
        for k in merged:
            merged[k] += m[k]
    return out, merged, sum(b for _, b in parts)


def concat_embeddings(parts: list[Embeddings]) -> Embeddings:
    """One Embeddings of several sets in order (text_to_image offsets shifted; extras kept
    when every part has them)."""
    if len(parts) == 1:
        return parts[0]
    t2i, n = [], 0
    for p in parts:
        t2i.append(p.text_to_image + n)
        n += len(p)
    keys = set.intersection(*(set(p.extra) for p in parts)) if parts else set()
    return Embeddings(
        image_features=torch.cat([p.image_features for p in parts]),
        text_features=torch.cat([p.text_features for p in parts]),
        text_to_image=torch.cat(t2i),
        captions=[c for p in parts for c in p.captions],
        ids=[i for p in parts for i in p.ids],
        categories=[c for p in parts for c in p.categories],
        tasks=[t for p in parts for t in p.tasks],
        extra={k: torch.cat([p.extra[k] for p in parts]) for k in sorted(keys)},
    )


def _gather_rows(x: torch.Tensor, accelerator: Any, n: int) -> torch.Tensor:
    """Gather contiguous per-rank parts of n rows (training-side callers: DER, IncCLIP, loop)."""
    if accelerator is None or accelerator.num_processes == 1:
        return x
    # Ranks hold contiguous, possibly unequal parts: pad to the same length, gather, trim.
    per = -(-n // accelerator.num_processes)
    pad = torch.zeros((per - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    g = accelerator.gather(torch.cat([x, pad]).to(accelerator.device)).cpu()
    keep = [
        g[r * per : r * per + min(per, max(0, n - r * per))]
        for r in range(accelerator.num_processes)
    ]
    return torch.cat(keep)


def _gather_rows_var(x: torch.Tensor, accelerator: Any) -> torch.Tensor:
    """Gather tensors of different row counts from all ranks, in rank order."""
    from accelerate.utils import gather_object

    sizes = gather_object([x.shape[0]])
    per = max(sizes)
    pad = torch.zeros((per - x.shape[0], *x.shape[1:]), dtype=x.dtype)
    g = accelerator.gather(torch.cat([x, pad]).to(accelerator.device)).cpu()
    return torch.cat([g[r * per : r * per + s] for r, s in enumerate(sizes)])
