"""Data mixtures (`cvl train --mixture`): every global batch drawn in set shares from the
task, the replay buffer and a pretraining source, as FoMo-in-Flux's `data_mixture`
(Roth et al. 2024; public code pseudope/fomo_in_flux).

The split of a batch of B items follows FoMo's `calculate_individual_batch_sizes` (main.py):
each source gets floor(B · share), and the items left over go one each to the sources in
source order — FoMo's config order, pretraining, update (the task), buffer. On a task with no
buffer items yet (the first one), FoMo's training loop (utils/training.py `train`, `task == 0`)
hands the buffer's items to the others: with a pretraining share, the task gets
floor(b / 2) + b mod 2 and the pretraining source floor(b / 2); without one, the task gets
all b. Two deliberate differences, both where FoMo's code has float or bookkeeping accidents:

- shares are read as exact decimals (`0.29` of 100 is 29 items; FoMo's `int(100 * 0.29)`
  gives 28, since 0.29 is 0.28999... in binary);
- a left-over item goes only to a source with a positive share (FoMo's loop walks every key,
  so 0 / 0.33 / 0.67 of 10 hands one item to a pretraining source it then has no data for).

What cvl adds: the split is of the *global* batch (batch size × processes) and every global
batch is a function of (seed, task, epoch) only, so 2 processes × B train exactly as
1 process × 2B; rank r takes slice r of each global batch as without a mixture. A global
batch lists its task items, then its buffer items, then its pretraining items (FoMo's
concatenation order). Each source is a stream of its items reshuffled whenever it runs
through:

- **task**: an epoch is one pass over the task's own items: floor(N_task / k_task) global
  batches (at least 1; the remainder of each epoch's permutation is left out, as without a
  mixture), epoch e drawing from its own permutation (continued with further permutations
  only when N_task < k_task);
- **buffer** and **pretrain**: one stream over the whole task, continued across its epochs.

So `--epochs` counts passes over the task's own items whatever the shares, and a pretraining
or buffer share adds steps (the task's share per step shrinks). `--budget` sets the steps
directly, as without a mixture.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from cvl.data.index import Entries
from cvl.data.order import aug_seeds, derive_key, permute
from cvl.data.reader import PairDataset, batches_in_epoch, global_batch
from cvl.errors import CvlError

#: FoMo's source order (its config's `data_mixture`): the order left-over items go in.
SOURCES = ("pretrain", "task", "buffer")
#: the order a global batch lists its items in (FoMo: update, then buffer, then pretraining)
BATCH_ORDER = ("task", "buffer", "pretrain")
_TAG = {"task": 101, "buffer": 102, "pretrain": 103}  # seed tags of the sources' streams


def parse_mixture(spec: str | Mapping[str, Any] | None) -> dict[str, Fraction] | None:
    """`task=0.34,buffer=0.33,pretrain=0.33` (or a mapping) as exact fractions summing to 1;
    None for no mixture. Missing sources have share 0; the task's share must be positive."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    items = spec.items() if isinstance(spec, Mapping) else _pairs(str(spec))
    shares = dict.fromkeys(SOURCES, Fraction(0))
    for k, v in items:
        k = str(k).strip()
        if k not in shares:
            raise CvlError(
                f"--mixture: unknown source '{k}' (sources: task, buffer, pretrain — FoMo's "
                "update, buffer, pretraining)"
            )
        try:
            f = Fraction(str(v).strip())
        except (ValueError, ZeroDivisionError):
            raise CvlError(f"--mixture: {k}={v!r} is not a number") from None
        if f < 0:
            raise CvlError(f"--mixture: {k}={v} is negative")
        shares[k] = f
    if abs(float(sum(shares.values())) - 1.0) > 1e-6:  # FoMo's own tolerance
        total = ", ".join(f"{k}={float(v):g}" for k, v in shares.items())
        raise CvlError(f"--mixture: the shares must sum to 1 ({total})")
    if shares["task"] <= 0:
        raise CvlError("--mixture: the task's share must be positive")
    return shares


def _pairs(spec: str) -> list[tuple[str, str]]:
    out = []
    for part in spec.replace(" ", "").split(","):
        if "=" not in part:
            raise CvlError(f"--mixture {spec!r}: expected SOURCE=SHARE,... (task=0.34,...)")
        out.append(tuple(part.split("=", 1)))
    return out


def mixture_spec(shares: Mapping[str, Fraction]) -> str:
    """The canonical text of a mixture (run.json's config), in source order."""
    return ",".join(f"{k}={_dec(v)}" for k, v in shares.items())


def _dec(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else f"{float(f):.12g}"


def split_batch(total: int, shares: Mapping[str, Fraction]) -> dict[str, int]:
    """Items per source in a batch of `total` (FoMo's `calculate_individual_batch_sizes`):
    floor(total · share) each, then the remainder one item at a time to the sources with a
    positive share, in source order (pretrain, task, buffer)."""
    sizes = {k: int(total * shares.get(k, 0)) for k in SOURCES}  # exact: floor of a Fraction
    left = total - sum(sizes.values())
    for k in SOURCES:
        if left == 0:
            break
        if shares.get(k, 0) > 0:
            sizes[k] += 1
            left -= 1
    return sizes


def without_buffer(sizes: Mapping[str, int]) -> dict[str, int]:
    """The split on a task with no buffer items (FoMo's first task): the buffer's b items go
    to the task (floor(b/d) + b mod d) and, when it has a share, to the pretraining source
    (floor(b/d)), d = 1 + (pretraining share > 0)."""
    b = sizes["buffer"]
    div = 1 + int(sizes["pretrain"] > 0)
    out = dict(sizes)
    out["task"] += b // div + b % div
    if div > 1:
        out["pretrain"] += b // div
    out["buffer"] = 0
    return out


@dataclass
class TaskData:
    """A task's training samples (`Entries`: integers, nothing per sample) and its epochs'
    global batches, each computed alone by `batch(epoch, b)` as a list of (index into
    `entries`, augmentation seed); `sizes`: items per global batch from each source (None
    without a mixture)."""

    entries: Entries
    per_epoch: int  # global batches per epoch
    batch: Callable[[int, int], list[tuple[int, int]]]
    sizes: dict[str, int] | None = None
    counts: dict[str, int] = field(default_factory=dict)  # items each source holds

    def epoch(self, e: int) -> list[list[tuple[int, int]]]:
        """All global batches of epoch `e` (small sets and tests; training takes them one
        at a time)."""
        return [self.batch(e, b) for b in range(self.per_epoch)]


def plain_data(entries: Entries, gb: int, seed: int, block: int = 1) -> TaskData:
    """No mixture: the task's samples (its own + the buffer's) in shuffled global batches
    (`block`: the shard-local order, `cvl.data.order`)."""
    n = len(entries)
    per = batches_in_epoch(n, gb)
    return TaskData(entries, per, lambda e, b: global_batch(n, gb, seed, e, b, block=block))


def batches_per_epoch(n_task: int, k_task: int) -> int:
    """Global batches in an epoch of a task with `n_task` own items, `k_task` per batch."""
    return max(1, n_task // max(1, k_task))


def stream_items(n: int, key: int, positions: np.ndarray, block: int = 1) -> np.ndarray:
    """Items at `positions` 0, 1, 2, ... of a source of n items that is reshuffled each time
    it runs through (pass c: the permutation keyed by (key, c))."""
    pos = np.asarray(positions, dtype=np.int64)
    out = np.empty(len(pos), dtype=np.int64)
    cyc = pos // n
    for c in np.unique(cyc):
        sel = cyc == c
        out[sel] = permute(n, derive_key(key, int(c)), pos[sel] % n, block)
    return out


def mixed_batch(
    counts: Mapping[str, int],
    sizes: Mapping[str, int],
    per_epoch: int,
    seed: int,
    epoch: int,
    b: int,
    block: int = 1,
) -> list[tuple[int, int]]:
    """Global batch `b` of epoch `epoch`: `sizes[s]` items of each source s, indexed into
    the concatenation task ++ buffer ++ pretrain (`counts[s]` items each); a function of
    (counts, sizes, per_epoch, seed, epoch, b) only (module doc)."""
    offset, start = {}, 0
    for s in BATCH_ORDER:
        offset[s] = start
        start += counts.get(s, 0)
    idx, aug = [], []
    for s in BATCH_ORDER:
        k = sizes.get(s, 0)
        if not k:
            continue
        task = s == "task"
        first = b * k if task else (epoch * per_epoch + b) * k  # task: per epoch
        pos = np.arange(first, first + k, dtype=np.int64)
        key = derive_key(seed, _TAG[s], epoch) if task else derive_key(seed, _TAG[s])
        idx.append(offset[s] + stream_items(counts[s], key, pos, block if task else 1))
        aug.append(aug_seeds(derive_key(key, epoch), pos))
    return list(zip(np.concatenate(idx).tolist(), np.concatenate(aug).tolist()))


def mixed_epoch(
    counts: Mapping[str, int], sizes: Mapping[str, int], per_epoch: int, seed: int, epoch: int
) -> list[list[tuple[int, int]]]:
    """All of epoch `epoch`'s global batches (`mixed_batch` for each)."""
    return [mixed_batch(counts, sizes, per_epoch, seed, epoch, b) for b in range(per_epoch)]


class Mixture:
    """`--mixture` shares and the pretraining source (`--pretrain-data`), for every task."""

    def __init__(self, shares: dict[str, Fraction], pretrain: str | os.PathLike | None) -> None:
        self.shares = shares
        self.pretrain_path = str(pretrain) if pretrain else None
        self._pretrain: Entries | None = None
        if shares["pretrain"] > 0 and not self.pretrain_path:
            raise CvlError("--mixture gives the pretraining source a share: add --pretrain-data")

    def sizes(self, gb: int, buffer_items: bool) -> dict[str, int]:
        """Items per global batch of `gb` from each source (FoMo's split; its first-task
        rule when the buffer holds nothing yet)."""
        s = split_batch(gb, self.shares)
        return s if buffer_items else without_buffer(s)

    def pretrain_entries(self) -> Entries:
        """The pretraining source's samples (indexed once)."""
        if self._pretrain is None:
            self._pretrain = (
                pretrain_entries(self.pretrain_path) if self.pretrain_path else Entries([])
            )
        return self._pretrain

    def data(
        self, own: Entries, buffer: Entries, gb: int, seed: int, task: str, block: int = 1
    ) -> TaskData:
        """A task's mixed samples (own ++ buffer ++ pretraining) and batches."""
        sizes = self.sizes(gb, bool(len(buffer)))
        pre = self.pretrain_entries() if sizes["pretrain"] else Entries([])
        counts = {"task": len(own), "buffer": len(buffer), "pretrain": len(pre)}
        if not own:
            raise CvlError(f"task {task}: no training samples to mix")
        per = batches_per_epoch(len(own), sizes["task"])
        return TaskData(
            own + buffer + pre,
            per,
            lambda e, b: mixed_batch(counts, sizes, per, seed, e, b, block),
            sizes=sizes,
            counts=counts,
        )

    def record(self, gb: int) -> dict[str, Any]:
        """run.json's "mixture": the shares, the source, the split of a global batch of `gb`
        with and without buffer items."""
        return {
            "shares": {k: float(v) for k, v in self.shares.items()},
            "pretrain_data": str(Path(self.pretrain_path).absolute())
            if self.pretrain_path
            else None,
            "global_batch": gb,
            "sizes": self.sizes(gb, True),
            "sizes_without_buffer_items": self.sizes(gb, False),
            "epoch": "one pass over the task's own items: floor(N_task / task items per batch) "
            "global batches",
        }


def task_data(
    method: Any, mixture: Mixture | None, ctx: Any, gb: int, seed: int, block: int = 1
) -> TaskData:
    """A task's samples and global batches: the method's (its own + the buffer's), or with a
    mixture its own, the buffer's and the pretraining source's in set shares."""
    if mixture is None:
        return plain_data(method.task_entries(ctx), gb, seed, block)
    buf = ctx.buffer.entries() if ctx.buffer is not None else Entries([])
    return mixture.data(method.own_entries(ctx), buf, gb, seed, ctx.task_name, block)


def pretrain_source(path: str | os.PathLike) -> Any:
    """A pretraining source, checked: a cvl stream's manifest, or the sorted .tar shards of a
    folder (recursively)."""
    from cvl.streams.manifest import MANIFEST, load_manifest

    p = Path(path)
    if (p / MANIFEST).is_file():
        return load_manifest(p)
    if p.is_dir():
        shards = sorted(p.rglob("*.tar"))
        if shards:
            return shards
    raise CvlError(f"--pretrain-data {path}: not a cvl stream folder or a folder of .tar shards")


def pretrain_entries(path: str | os.PathLike) -> Entries:
    """The samples of a pretraining source: a cvl stream's training samples (every task's, in
    task order, selections of a stream built in place included) or a folder's shards'."""
    from cvl.data.selection import task_dataset

    src = pretrain_source(path)
    if isinstance(src, list):
        return PairDataset.from_shards(src, name="pretrain-data").entries
    return Entries.concat(
        task_dataset(src, t, name="pretrain-data").entries for t in src.task_order
    )


def build_mixture(cfg: Any) -> Mixture | None:
    """The run's mixture from its config (None without `--mixture`); checks the source."""
    shares = parse_mixture(getattr(cfg, "mixture", None))
    if shares is None:
        return None
    mix = Mixture(shares, getattr(cfg, "pretrain_data", None))
    if mix.pretrain_path and shares["pretrain"] > 0:
        pretrain_source(mix.pretrain_path)  # a clear error before any training
    return mix
