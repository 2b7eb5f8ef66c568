"""Reading stream shards back as a map-style torch Dataset.

Shards are real webdataset tars; each has an on-disk index written once (`cvl.data.index`:
member offsets, memory-mapped) and a batch's samples are read together by offset
(`cvl.data.samples`: one range a sample, neighbours merged, the ranges of shards at URLs in
flight together; the loader calls `__getitems__` with a worker's whole batch). A map-style
dataset makes three things exact that an iterable one makes hard: resume at a batch position,
the same global batches for 1 process with batch 2B as for 2 processes with batch B (rank r
takes slice r of each global batch), and replay-buffer items addressed by (shard, key).

Samples without an image or with a missing/empty caption are left out at index time and
counted in `skipped`; an image that fails to decode (truncated, not an image, a header larger
than `MAX_PIXELS`: checked before any pixel is decoded, so a decompression bomb costs no
memory) or a caption that is not UTF-8 is replaced by the next good sample at load time and
counted in the batch's `n_replaced` (training: every rank keeps the same batch size);
evaluation sets drop such samples instead (`drop_unreadable`), so no item is counted twice.
A shard that cannot be read as its index says (gone, unreachable, truncated, changed since it
was indexed) is never a bad sample: it stops the command in one line (`ShardError`).
A missing KEY.json is harmless (the key is the id). 16-bit greyscale images are scaled to
8 bits (PIL's own RGB conversion would clip them to white).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, get_worker_info

from cvl.data.augment import SplitTransform
from cvl.data.images import MAX_PIXELS, open_image  # noqa: F401 (MAX_PIXELS: re-exported)
from cvl.data.index import _ROW, IMAGE_EXTS, TABLE, Entries, Entry, ids_of_refs, is_remote  # noqa: F401
from cvl.data.order import aug_seeds, derive_key, permute
from cvl.data.samples import _FILES, Sample, ShardError, read_entries, read_ids, read_one  # noqa: F401
from cvl.errors import CvlError


@lru_cache(maxsize=64)
def index_shard(path: str) -> tuple[Entries, tuple[tuple[str, str], ...]]:
    """The usable samples of one shard (in file order) and the (key, reason) of those left
    out, from its on-disk index (built once if missing: `cvl.data.index`)."""
    e = Entries.of_shards([path])
    sid = int(TABLE.ids[path if is_remote(path) else os.path.abspath(path)])
    return e, TABLE.skipped[sid]


_READABLE: dict[Any, bool] = {}  # packed id (or (shard, key)) -> decodes (drop_unreadable)


def sample_seed(seed: int, *parts: int) -> int:
    """A stable 31-bit seed from integers (same on every rank, worker and Python run)."""
    return zlib.crc32(repr((seed, *parts)).encode()) & 0x7FFFFFFF


def _text(s: Sample) -> tuple[str, dict[str, Any]]:
    caption = s.text.decode("utf-8").strip()
    if not caption:
        raise ValueError("empty caption")
    return caption, (json.loads(s.meta.decode("utf-8")) if s.meta else {})


class PairDataset(Dataset):
    """Image-caption pairs from shards; items are indices or (index, augmentation seed).

    `window` > 1 (the trainer sets it to `--shuffle-block`): shards at URLs are fetched by
    windows of that many neighbouring rows (`cvl.data.samples`)."""

    def __init__(
        self,
        entries: Entries | Sequence[Entry],
        transform: Callable[[Image.Image], torch.Tensor] | None = None,
        tokenize: Callable[[list[str]], torch.Tensor] | None = None,
        skipped: Counter | None = None,
        name: str = "",
        window: int = 1,
    ) -> None:
        # integers (`Entries`), or a plain list of Entry for hand-made datasets
        self.entries = entries if isinstance(entries, Entries) else list(entries)
        self.transform = transform
        self.tokenize = tokenize
        self.skipped = skipped if skipped is not None else Counter()
        self.name = name  # for error messages ("task t1", "test/t0")
        self.window = window

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_shards(
        cls, shards: Iterable[str | os.PathLike], name: str = "", **kw: Any
    ) -> PairDataset:
        """All good samples of the shards, in shard order; raises if there are none."""
        shards = [str(s) if is_remote(str(s)) else str(Path(s).absolute()) for s in shards]
        entries = Entries.of_shards(shards)
        skipped = entries.skipped()
        if not len(entries):
            raise CvlError(
                (f"{name}: " if name else "")
                + f"no usable samples in {len(shards)} shard(s)"
                + (f" (first: {shards[0]}; left out: {dict(skipped)})" if shards else "")
            )
        return cls(entries, skipped=skipped, name=name, **kw)

    @classmethod
    def from_refs(cls, refs: Iterable[tuple[str, str]], **kw: Any) -> PairDataset:
        """Samples addressed by (shard path, key), e.g. a replay buffer's contents."""
        refs = list(refs)
        ids = ids_of_refs(refs)
        if (ids < 0).any():
            shard, key = refs[int(np.flatnonzero(ids < 0)[0])]
            raise CvlError(f"{shard}: no usable sample with key '{key}'")
        return cls(Entries.of_ids(ids), **kw)

    def with_entries(self, entries: Entries | Sequence[Entry]) -> PairDataset:
        """The same transform/tokenizer over other entries (e.g. task data + buffer items)."""
        return PairDataset(entries, self.transform, self.tokenize, name=self.name)

    def drop_unreadable(self) -> PairDataset:
        """Leave out (and count in `skipped['unreadable']`) samples that fail to decode.

        For evaluation sets: replacing a bad item by its neighbour would count that one twice.
        Decodes every sample once (read 256 at a time; results are remembered per shard
        member); a shard that cannot be read stops it (`ShardError`)."""
        n = len(self.entries)
        e = self.entries
        keys = e.all_ids().tolist() if isinstance(e, Entries) else [x.ref for x in e]
        todo = [i for i in range(n) if keys[i] not in _READABLE]
        for s in range(0, len(todo), 256):
            idx = todo[s : s + 256]
            for i, r in zip(idx, self.read_raw_many(idx)):
                _READABLE[keys[i]] = not isinstance(r, Exception)
        good = [i for i in range(n) if _READABLE[keys[i]]]
        if len(good) < n:
            self.skipped["unreadable"] += n - len(good)
            self.entries = e.take(good) if isinstance(e, Entries) else [e[i] for i in good]
        if not good:
            raise CvlError(f"{self.name or 'dataset'}: every sample failed to decode")
        return self

    # -- reading -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def _samples(self, idx: Sequence[int]) -> tuple[list[Sample], Any]:
        """The bytes of samples `idx` read together, and their packed ids (None: hand-made)."""
        if isinstance(self.entries, Entries):
            if len(idx) == 1:  # PairDataset[i]: no numpy call on the way
                sid, row = self.entries.locate(int(idx[0]))
                return [read_one(sid, row, self.window)], [sid * _ROW + row]
            ids = self.entries.ids(idx)
            return read_ids(ids, self.window), ids
        return read_entries([self.entries[i] for i in idx]), None

    def read_raw(self, i: int) -> tuple[Image.Image, str, dict[str, Any]]:
        """Decode sample i: PIL image (RGB), caption, metadata. Raises on corrupt data."""
        s = self._samples([i])[0][0]
        return (load_rgb(open_image(s.image)), *_text(s))

    def read_raw_many(self, idx: Sequence[int]) -> list[tuple[Image.Image, str, dict] | Exception]:
        """`read_raw` of many samples, their bytes read together; a sample that fails to
        decode comes back as its exception (a shard that cannot be read raises)."""
        out: list[Any] = []
        for s in self._samples(idx)[0]:
            try:
                out.append((load_rgb(open_image(s.image)), *_text(s)))
            except Exception as e:  # noqa: BLE001 (corrupt JPEG, non-UTF-8 text, bad JSON)
                out.append(e)
        return out

    def _open(self, i: int) -> tuple[bytes, Image.Image]:
        """A sample's image bytes and header-only PIL image (no pixel decoded yet)."""
        s = self._samples([i])[0][0]
        return s.image, open_image(s.image)  # header only; MAX_PIXELS checked

    def _decode(self, s: Sample, aug: int | None) -> tuple[Any, str, dict[str, Any]]:
        """(image or the split transform's parts, caption, meta); raises on corrupt data."""
        if isinstance(self.transform, SplitTransform):  # the Compose's draws, in its order
            with _seeded(aug):
                img = open_image(s.image)
                plan = self.transform.prepare(img)
                parts = self.transform.apply(s.image, img, plan, load_rgb)
                return (parts, *_text(s))
        img = load_rgb(open_image(s.image))
        return (img, *_text(s))

    def __getitems__(self, items: Sequence[int | tuple[int, int]]) -> list[dict[str, Any]]:
        """A batch's items (the loader's fetcher calls this with a worker's whole batch):
        their bytes read together, then each decoded (a bad one replaced by the next good)."""
        pairs = [(int(it), None) if not isinstance(it, tuple) else it for it in items]
        samples, ids = self._samples([i for i, _ in pairs])
        return [
            self._item(i, aug, s, -1 if ids is None else int(ids[k]))
            for k, ((i, aug), s) in enumerate(zip(pairs, samples))
        ]

    def __getitem__(self, item: int | tuple[int, int]) -> dict[str, Any]:
        i, aug = (int(item), None) if not isinstance(item, tuple) else item
        (s,), ids = self._samples([i])
        return self._item(i, aug, s, -1 if ids is None else int(ids[0]))

    def _item(self, i: int, aug: int | None, s: Sample, sid: int) -> dict[str, Any]:
        n = len(self.entries)
        j = i
        for replaced in range(n):
            if replaced:
                j = (i + replaced) % n
                (s,), ids = self._samples([j])
                sid = -1 if ids is None else int(ids[0])
            try:
                got, caption, meta = self._decode(s, aug)
            except Exception:  # noqa: BLE001 (corrupt JPEG, non-UTF-8 text, bad JSON): next one
                continue
            break
        else:
            raise CvlError(
                f"{self.name or 'dataset'}: all {n} samples failed to decode "
                f"(left out at indexing: {dict(self.skipped) or 'none'})"
            )
        split = isinstance(self.transform, SplitTransform)
        parts: dict[str, Any] = {}
        captions = meta.get("captions") or [caption]
        if aug is not None and len(captions) > 1:  # training: one caption per visit
            caption = captions[aug % len(captions)]
        if split:
            parts = got
            image = parts.pop("image")
        elif self.transform is not None:
            with _seeded(aug):
                image = self.transform(got)
        else:
            image = got
        out = {
            **parts,
            "image": image,
            "caption": caption,
            "captions": list(captions),
            "index": j,
            "sid": sid,  # packed (shard id, row): the sample's id in this process
            "key": s.key,
            "shard": s.shard,
            "task": meta.get("task"),
            "category": meta.get("category"),
            "id": meta.get("id", s.key),
            "n_replaced": replaced,
        }
        if self.tokenize is not None:
            out["text"] = self.tokenize([caption])[0]
        return out


def load_rgb(img: Image.Image) -> Image.Image:
    """Decode a header-only image to 8-bit RGB (16-bit grey scaled to 8 bits: PIL's own RGB
    conversion would clip it to white)."""
    img.load()
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        img = img.point(lambda v: v * (1 / 256)).convert("L")
    if img.mode != "RGB":  # (convert would copy an RGB image)
        img = img.convert("RGB")
    return img


@contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Torch's CPU generator seeded with `seed` inside, restored after (None: untouched).

    The CPU generator only: what the transforms draw from (torch.manual_seed would also
    queue lazy seeding of every accelerator type, with a traceback each time: ~40 % of a
    32 px sample's cost; fork_rng costs twice this)."""
    if seed is None:
        yield
        return
    gen = torch.default_generator
    state = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(state)


def _stack(vals: list[Any]) -> torch.Tensor:
    """One tensor from a batch's tensors (`torch.stack`) or uint8 arrays (the split
    transform's crops, zero-padded to the largest). In a loader worker the arrays are copied
    straight into shared memory, as torch's default collate does (no copy to send them)."""
    if all(isinstance(v, torch.Tensor) and v.shape == vals[0].shape for v in vals):
        return torch.stack(vals)
    vals = [v.numpy() if isinstance(v, torch.Tensor) else v for v in vals]
    shape = [len(vals)] + [max(a.shape[d] for a in vals) for d in range(vals[0].ndim)]
    elem = torch.from_numpy(np.empty(0, dtype=vals[0].dtype))
    if get_worker_info() is not None:
        out = elem.new(elem._typed_storage()._new_shared(math.prod(shape), device="cpu"))
        out = out.resize_(shape)
    else:
        out = elem.new_empty(shape)
    dst = out.numpy()
    for i, a in enumerate(vals):
        dst[(i, *(slice(0, k) for k in a.shape))] = a
        for d, k in enumerate(a.shape):  # zero the padding (the rest of axis d)
            if k < shape[d + 1]:
                dst[(i, *(slice(0, m) for m in a.shape[:d]), slice(k, None))] = 0
    return out


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors and arrays, keep the rest as lists; `n_replaced` becomes the batch total."""
    out: dict[str, Any] = {}
    for k in items[0]:
        vals = [it[k] for it in items]
        if isinstance(vals[0], (torch.Tensor, np.ndarray)):
            out[k] = _stack(vals)
        elif k == "n_replaced":
            out[k] = int(sum(vals))
        else:
            out[k] = vals
    return out


def batches_in_epoch(n: int, global_batch: int, drop_last: bool = True) -> int:
    """Global batches in an epoch of n items: a partial last batch is dropped (`drop_last`)
    unless it is the only one."""
    if n <= 0:
        raise CvlError("cannot make batches from an empty dataset")
    return max(1, n // global_batch) if drop_last else -(-n // global_batch)


def global_batch(
    n: int,
    global_batch: int,
    seed: int,
    epoch: int,
    b: int,
    shuffle: bool = True,
    block: int = 1,
) -> list[tuple[int, int]]:
    """Global batch `b` of an epoch as (index, augmentation seed) pairs, computed alone: the
    positions [b·B, (b+1)·B) of the epoch's seeded permutation (`cvl.data.order.permute`;
    `block`: the shard-local order). A function of (n, B, seed, epoch, b, block) only."""
    pos = np.arange(b * global_batch, min(n, (b + 1) * global_batch), dtype=np.int64)
    key = derive_key(seed, epoch)
    idx = permute(n, key, pos, block) if shuffle else pos
    return list(zip(idx.tolist(), aug_seeds(key, pos).tolist()))


def global_batches(
    n: int,
    global_batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    drop_last: bool = True,
    block: int = 1,
) -> list[list[tuple[int, int]]]:
    """The epoch's global batches as lists of (index, augmentation seed) (`global_batch`
    for each; a list: for small sets, the trainer computes one batch at a time).

    Depends only on (n, global_batch, seed, epoch): every rank computes the same list.
    A dataset smaller than one global batch gives one (smaller) batch rather than none.
    """
    per = batches_in_epoch(n, global_batch_size, drop_last)
    return [global_batch(n, global_batch_size, seed, epoch, b, shuffle, block) for b in range(per)]


def rank_slice(batch: list, rank: int, world: int) -> list:
    """Rank r's contiguous part of a global batch (gathering in rank order restores it)."""
    per = -(-len(batch) // world)
    return batch[rank * per : (rank + 1) * per]


def default_workers(processes_per_node: int = 1) -> int:
    """Loader worker processes per training process when `--workers` is not given.

    The CPUs this process may use, shared by the node's training processes, minus one for the
    training process itself; at least 1 (decoding and augmentation leave the main process).
    No upper cap: a fast GPU takes every core a node gives it (one worker prepares ~500-2,000
    224-px samples/s with the resize on the GPU, `benchmarks/bench_loader.py`; an H100 steps
    ViT-B-32 at ~3,500 pairs/s).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, processes_per_node) - 1)


class RankBatches:
    """A DataLoader batch sampler: rank r's slice of each global batch of an iterable.

    The global batches may be a lazy generator spanning several epochs, so one loader (and
    one set of worker processes) serves a whole task; the workers prefetch across epoch ends.
    """

    def __init__(self, batches: Iterable[list[Any]], rank: int = 0, world: int = 1) -> None:
        self.batches, self.rank, self.world = batches, rank, world

    def __iter__(self):
        for b in self.batches:
            yield rank_slice(b, self.rank, self.world)


def make_loader(
    dataset: PairDataset,
    batches: Iterable[list[Any]],
    rank: int = 0,
    world: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader over precomputed global batches, each cut to this rank's slice.

    Items are (index, augmentation seed), so a batch's tensors do not depend on which worker
    (or how many) decoded it. With workers, each prefetches 2 batches; `pin_memory` for CUDA.
    """
    kw: dict[str, Any] = {}
    if num_workers > 0:
        kw["prefetch_factor"] = 2
        if "fork" in mp.get_all_start_methods():
            kw["multiprocessing_context"] = "fork"  # no re-import or pickling per worker
    return DataLoader(
        dataset,
        batch_sampler=RankBatches(batches, rank, world),
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        **kw,
    )


def eval_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int = 0,
    world: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Callable[[list[Any]], Any] = collate,
) -> DataLoader:
    """In-order batches of this rank's contiguous part of the dataset (gather + trim after).

    With workers (forked, 2 batches prefetched each) the batches still come in order; a part
    of one batch is read in this process (nothing to overlap; a worker costs a fork).
    `pin_memory` for CUDA."""
    n = len(dataset)
    per = -(-n // world)
    idx = list(range(rank * per, min(n, (rank + 1) * per)))
    batches = [idx[s : s + batch_size] for s in range(0, len(idx), batch_size)]
    workers = min(num_workers, len(batches)) if len(batches) > 1 else 0
    kw: dict[str, Any] = {}
    if workers > 0:
        kw["prefetch_factor"] = 2
        if "fork" in mp.get_all_start_methods():
            kw["multiprocessing_context"] = "fork"
    return DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=collate_fn,
        num_workers=workers,
        pin_memory=pin_memory,
        **kw,
    )
