"""Reading stream shards back as a map-style torch Dataset.

Shards are real webdataset tars; we index each tar's members once (headers only, no image
decoding) and read samples by offset. A map-style dataset makes three things exact that an
iterable one makes hard: resume at a batch position, the same global batches for 1 process
with batch 2B as for 2 processes with batch B (rank r takes slice r of each global batch),
and replay-buffer items addressed by (shard, key).

Samples without an image or with a missing/empty caption are left out at index time and
counted in `skipped`; an image that fails to decode (truncated, not an image, a header larger
than `MAX_PIXELS`: checked before any pixel is decoded, so a decompression bomb costs no
memory) or a caption that is not UTF-8 is replaced by the next good sample at load time and
counted in the batch's `n_replaced` (training: every rank keeps the same batch size);
evaluation sets drop such samples instead (`drop_unreadable`), so no item is counted twice.
A missing KEY.json is harmless (the key is the id). 16-bit greyscale images are scaled to
8 bits (PIL's own RGB conversion would clip them to white).
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import tarfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from cvl.errors import CvlError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
MAX_PIXELS = 8192 * 8192  # larger image headers are refused before decoding (memory bound)


@dataclass(frozen=True)
class Entry:
    """Where one sample lives: shard file, key, and (offset, size) of its members."""

    shard: str
    key: str
    image: tuple[int, int]
    text: tuple[int, int]
    meta: tuple[int, int] | None

    @property
    def ref(self) -> tuple[str, str]:
        return (self.shard, self.key)


@lru_cache(maxsize=4096)
def index_shard(path: str) -> tuple[tuple[Entry, ...], tuple[tuple[str, str], ...]]:
    """Entries of one tar (in file order) and the (key, reason) of samples left out."""
    members: dict[str, dict[str, tuple[int, int]]] = {}
    order: list[str] = []
    try:
        with tarfile.open(path, mode="r:") as tf:
            for ti in tf:
                if not ti.isfile():
                    continue
                name = ti.name.rsplit("/", 1)[-1]
                if "." not in name:
                    continue
                key, ext = name.split(".", 1)
                prefix = ti.name[: len(ti.name) - len(name)]
                key = prefix + key
                if key not in members:
                    members[key] = {}
                    order.append(key)
                members[key][ext.lower()] = (ti.offset_data, ti.size)
    except (tarfile.TarError, OSError) as e:
        raise CvlError(f"{path}: not a readable tar shard ({e})") from None
    entries, skipped = [], []
    for key in order:
        m = members[key]
        img = next((m[e] for e in IMAGE_EXTS if e in m), None)
        if img is None:
            skipped.append((key, "missing_image"))
        elif "txt" not in m:
            skipped.append((key, "missing_caption"))
        elif m["txt"][1] == 0:
            skipped.append((key, "empty_caption"))
        else:
            entries.append(Entry(path, key, img, m["txt"], m.get("json")))
    return tuple(entries), tuple(skipped)


class _Files:
    """Per-process cache of open shard files (re-opened after a fork into a worker)."""

    def __init__(self) -> None:
        self.pid = -1
        self.handles: dict[str, Any] = {}

    def read(self, path: str, span: tuple[int, int]) -> bytes:
        if self.pid != os.getpid():
            self.handles, self.pid = {}, os.getpid()
        f = self.handles.get(path)
        if f is None:
            if len(self.handles) > 64:
                for h in self.handles.values():
                    h.close()
                self.handles.clear()
            f = self.handles[path] = open(path, "rb")  # noqa: SIM115 (kept open on purpose)
        f.seek(span[0])
        return f.read(span[1])


_FILES = _Files()


def sample_seed(seed: int, *parts: int) -> int:
    """A stable 31-bit seed from integers (same on every rank, worker and Python run)."""
    return zlib.crc32(repr((seed, *parts)).encode()) & 0x7FFFFFFF


class PairDataset(Dataset):
    """Image-caption pairs from shards; items are indices or (index, augmentation seed)."""

    def __init__(
        self,
        entries: Sequence[Entry],
        transform: Callable[[Image.Image], torch.Tensor] | None = None,
        tokenize: Callable[[list[str]], torch.Tensor] | None = None,
        skipped: Counter | None = None,
        name: str = "",
    ) -> None:
        self.entries = list(entries)
        self.transform = transform
        self.tokenize = tokenize
        self.skipped = skipped if skipped is not None else Counter()
        self.name = name  # for error messages ("task t1", "test/t0")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_shards(
        cls, shards: Iterable[str | os.PathLike], name: str = "", **kw: Any
    ) -> PairDataset:
        """All good samples of the shards, in shard order; raises if there are none."""
        entries: list[Entry] = []
        skipped: Counter = Counter()
        shards = [str(Path(s).absolute()) for s in shards]
        for s in shards:
            e, sk = index_shard(s)
            entries.extend(e)
            skipped.update(reason for _, reason in sk)
        if not entries:
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
        by_shard: dict[str, dict[str, Entry]] = {}
        out = []
        for shard, key in refs:
            if shard not in by_shard:
                by_shard[shard] = {e.key: e for e in index_shard(str(shard))[0]}
            e = by_shard[shard].get(key)
            if e is None:
                raise CvlError(f"{shard}: no usable sample with key '{key}'")
            out.append(e)
        return cls(out, **kw)

    def with_entries(self, entries: Sequence[Entry]) -> PairDataset:
        """The same transform/tokenizer over other entries (e.g. task data + buffer items)."""
        return PairDataset(entries, self.transform, self.tokenize, name=self.name)

    def drop_unreadable(self) -> PairDataset:
        """Leave out (and count in `skipped['unreadable']`) samples that fail to decode.

        For evaluation sets: replacing a bad item by its neighbour would count that one twice.
        Decodes every sample once (results are remembered per shard member)."""
        good = [e for i, e in enumerate(self.entries) if _readable(self, i)]
        if len(good) < len(self.entries):
            self.skipped["unreadable"] += len(self.entries) - len(good)
            self.entries = good
        if not good:
            raise CvlError(f"{self.name or 'dataset'}: every sample failed to decode")
        return self

    # -- reading -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def read_raw(self, i: int) -> tuple[Image.Image, str, dict[str, Any]]:
        """Decode sample i: PIL image (RGB), caption, metadata. Raises on corrupt data."""
        e = self.entries[i]
        img = Image.open(io.BytesIO(_FILES.read(e.shard, e.image)))  # header only
        if img.width * img.height > MAX_PIXELS:
            raise ValueError(f"image of {img.width}x{img.height} pixels exceeds MAX_PIXELS")
        img.load()
        if img.mode in ("I;16", "I;16B", "I;16L", "I;16N"):  # 16-bit grey -> 8-bit
            img = img.point(lambda v: v * (1 / 256)).convert("L")
        img = img.convert("RGB")
        caption = _FILES.read(e.shard, e.text).decode("utf-8").strip()
        if not caption:
            raise ValueError("empty caption")
        meta = json.loads(_FILES.read(e.shard, e.meta).decode("utf-8")) if e.meta else {}
        return img, caption, meta

    def __getitem__(self, item: int | tuple[int, int]) -> dict[str, Any]:
        i, aug = (item, None) if isinstance(item, int) else item
        n = len(self.entries)
        for replaced in range(n):
            j = (i + replaced) % n
            try:
                img, caption, meta = self.read_raw(j)
                break
            except Exception:  # corrupt JPEG, non-UTF-8 text, bad JSON: take the next sample
                continue
        else:
            raise CvlError(
                f"{self.name or 'dataset'}: all {n} samples failed to decode "
                f"(left out at indexing: {dict(self.skipped) or 'none'})"
            )
        captions = meta.get("captions") or [caption]
        if aug is not None and len(captions) > 1:  # training: one caption per visit
            caption = captions[aug % len(captions)]
        if self.transform is not None:
            if aug is None:
                image = self.transform(img)
            else:
                with torch.random.fork_rng(devices=[]):
                    # the CPU generator only: what the transforms draw from (torch.manual_seed
                    # would also queue lazy seeding of every accelerator type, with a traceback
                    # each time: ~40 % of a 32 px sample's cost)
                    torch.default_generator.manual_seed(aug)
                    image = self.transform(img)
        else:
            image = img
        out = {
            "image": image,
            "caption": caption,
            "captions": list(captions),
            "index": j,
            "key": self.entries[j].key,
            "shard": self.entries[j].shard,
            "task": meta.get("task"),
            "category": meta.get("category"),
            "id": meta.get("id", self.entries[j].key),
            "n_replaced": replaced,
        }
        if self.tokenize is not None:
            out["text"] = self.tokenize([caption])[0]
        return out


_READABLE: dict[tuple[str, str], bool] = {}


def _readable(ds: PairDataset, i: int) -> bool:
    e = ds.entries[i]
    if e.ref not in _READABLE:
        try:
            ds.read_raw(i)
            _READABLE[e.ref] = True
        except Exception:
            _READABLE[e.ref] = False
    return _READABLE[e.ref]


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors, keep the rest as lists; `n_replaced` becomes the batch total."""
    out: dict[str, Any] = {}
    for k in items[0]:
        vals = [it[k] for it in items]
        if isinstance(vals[0], torch.Tensor):
            out[k] = torch.stack(vals)
        elif k == "n_replaced":
            out[k] = int(sum(vals))
        else:
            out[k] = vals
    return out


def global_batches(
    n: int, global_batch: int, seed: int, epoch: int, shuffle: bool = True, drop_last: bool = True
) -> list[list[tuple[int, int]]]:
    """The epoch's global batches as lists of (index, augmentation seed).

    Depends only on (n, global_batch, seed, epoch): every rank computes the same list.
    A dataset smaller than one global batch gives one (smaller) batch rather than none.
    """
    if n <= 0:
        raise CvlError("cannot make batches from an empty dataset")
    if shuffle:
        g = torch.Generator().manual_seed(sample_seed(seed, epoch))
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    batches = []
    for s in range(0, n, global_batch):
        idx = order[s : s + global_batch]
        if drop_last and len(idx) < global_batch and batches:
            break
        batches.append([(i, sample_seed(seed, epoch, s + k)) for k, i in enumerate(idx)])
    return batches


def rank_slice(batch: list, rank: int, world: int) -> list:
    """Rank r's contiguous part of a global batch (gathering in rank order restores it)."""
    per = -(-len(batch) // world)
    return batch[rank * per : (rank + 1) * per]


def default_workers(processes_per_node: int = 1) -> int:
    """Loader worker processes per training process when `--workers` is not given.

    The CPUs this process may use, shared by the node's training processes, minus one for the
    training process itself; at least 1 (decoding and augmentation leave the main process),
    at most 8 (more rarely helps with tar shards on local disk).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // max(1, processes_per_node) - 1))


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
