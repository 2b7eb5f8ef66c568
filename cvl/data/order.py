"""Epoch orders computed per position: a seeded permutation of [0, n) evaluated on the
positions a global batch needs, with nothing stored per sample.

`permute(n, key, positions)` is a keyed Feistel network on the smallest even-bit power of
two ≥ n, restricted to [0, n) by cycle walking (Black & Rogaway, "Ciphers with arbitrary
finite domains", 2002): a bijection of [0, n) for every key, computed for a batch of
positions in vectorised numpy (a global batch of 4,096 positions costs well under a
millisecond, whatever n). Every rank, loader worker and resumed run computes the same order
from (n, key) alone, so a stored `randperm` (8 B per sample, rebuilt every epoch) is not
needed.

`block > 1` gives the shard-local order (`cvl train --shuffle-block K`): the items are cut into
blocks of K consecutive items (items of one shard stay together: a task's items are its
shards' samples in file order), the blocks are permuted, and so are the items inside each
block. A global batch of B then reads ~B / K runs of K neighbouring samples (1-2 when K ≥ B),
which storage with slow random reads (object stores, network file systems) serves far faster.
Every epoch the blocks are cut anew (their boundaries shift by a keyed offset in [0, K)) and
each block's inner order has a key of its own, so batch-mates change from epoch to epoch (a
contrastive batch does not see the same negatives again) while the I/O stays as local. It is
still a bijection of [0, n) (cycle walking over the padded ends). `block < -1` is the order of
runs started before blocks were re-cut (fixed blocks [jK, (j+1)K), one inner order for all):
such a run resumes with the order it began with.

Augmentation seeds are a hash of (seed, epoch, position): `aug_seeds`.
"""

from __future__ import annotations

import numpy as np

from cvl.errors import CvlError

_ROUNDS = 6
_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), 0x9E3779B97F4A7C15


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic): a well-mixed hash."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int) -> int:
    """A 64-bit key from integers (same on every rank, worker and Python run)."""
    h = np.uint64(0x6A09E667F3BCC908)
    with np.errstate(over="ignore"):
        for p in parts:
            h = mix64(h ^ np.uint64((int(p) * _GOLD) & 0xFFFFFFFFFFFFFFFF))
    return int(h)


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    """One pass of the balanced Feistel network on 2·half-bit values (keys: per round, each a
    scalar or one key per value)."""
    mask = np.uint64((1 << half) - 1)
    sh = np.uint64(half)
    left, right = x >> sh, x & mask
    for k in keys:
        left, right = right, left ^ (mix64(right ^ k) & mask)
    return (left << sh) | right


def _walk(x: np.ndarray, n: int, half: int, keys: np.ndarray) -> np.ndarray:
    """Cycle walking (keys: per round, or [rounds, len(x)] per value)."""
    y = _feistel(x, half, keys)
    bad = y >= np.uint64(n)
    while bad.any():  # cycle walking: at most a few rounds (the domain is < 4n)
        y[bad] = _feistel(y[bad], half, keys if keys.ndim == 1 else keys[:, bad])
        bad = y >= np.uint64(n)
    return y


def _round_keys(key: int) -> np.ndarray:
    return np.array([derive_key(key, r) for r in range(_ROUNDS)], dtype=np.uint64)


def _half_bits(m: int) -> int:
    return max(1, (max(1, m - 1).bit_length() + 1) // 2)


def _perm(n: int, key: int, pos: np.ndarray) -> np.ndarray:
    if n == 1:
        return np.zeros(len(pos), dtype=np.uint64)
    return _walk(pos.astype(np.uint64), n, _half_bits(n), _round_keys(key))


def permute(n: int, key: int, positions: np.ndarray, block: int = 1) -> np.ndarray:
    """The items at `positions` of the seeded permutation of [0, n) (int64 array).

    `block > 1`: the block order (module doc): blocks of `block` consecutive items, re-cut
    and keyed per epoch (each epoch has its own `key`); `block < -1`: the fixed blocks of
    runs started before re-cutting."""
    if n <= 0:
        raise CvlError("cannot order an empty dataset")
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    if block < -1:
        return _fixed_blocks(n, key, pos, -block)
    if block <= 1 or block >= n:
        return _perm(n, key, pos).astype(np.int64)
    k = np.uint64(block)
    shift = np.uint64(derive_key(key, 3) % block)  # this epoch's block boundaries
    nb = -(-(n + int(shift)) // block)
    bkey, ikey = derive_key(key, 1), derive_key(key, 2)
    half_b, keys_b = _half_bits(nb), _round_keys(bkey)
    half_i, keys_i = _half_bits(block), _round_keys(ikey)

    def g(z: np.ndarray) -> np.ndarray:  # a bijection of [0, nb * block)
        b, r = z // k, z % k
        pb = _walk(b, nb, half_b, keys_b) if nb > 1 else b
        with np.errstate(over="ignore"):  # each block's own inner key
            per = mix64(keys_i[:, None] ^ (pb[None, :] * np.uint64(_GOLD)))
        return pb * k + _walk(r, block, half_i, per)

    lo, hi = shift, shift + np.uint64(n)
    z = g(pos.astype(np.uint64) + shift)
    bad = (z < lo) | (z >= hi)
    while bad.any():  # cycle walking over the padded ends, back into [shift, shift + n)
        z[bad] = g(z[bad])
        bad = (z < lo) | (z >= hi)
    return (z - shift).astype(np.int64)


def _fixed_blocks(n: int, key: int, pos: np.ndarray, block: int) -> np.ndarray:
    """The block order before re-cutting: fixed blocks, one inner order for every block."""
    if block >= n:
        return _perm(n, key, pos).astype(np.int64)
    nb = -(-n // block)
    bkey, ikey = derive_key(key, 1), derive_key(key, 2)
    half_b, keys_b = _half_bits(nb), _round_keys(bkey)

    def g(x: np.ndarray) -> np.ndarray:  # a bijection of [0, nb * block)
        b, r = x // np.uint64(block), x % np.uint64(block)
        pb = _walk(b, nb, half_b, keys_b) if nb > 1 else b
        return pb * np.uint64(block) + _inner_u(block, ikey, r)

    y = g(pos.astype(np.uint64))
    bad = y >= np.uint64(n)
    while bad.any():  # the padded last block: walk on to an item that exists
        y[bad] = g(y[bad])
        bad = y >= np.uint64(n)
    return y.astype(np.int64)


def _inner_u(m: int, key: int, r: np.ndarray) -> np.ndarray:
    return r if m == 1 else _walk(r, m, _half_bits(m), _round_keys(key))


def aug_seeds(key: int, positions: np.ndarray) -> np.ndarray:
    """31-bit augmentation seeds of the items at `positions` (a function of (key, position))."""
    k = np.uint64(derive_key(key, 7))
    return (mix64(np.asarray(positions, dtype=np.uint64) ^ k) & np.uint64(0x7FFFFFFF)).astype(
        np.int64
    )


def block_note(block: int, global_batch: int, order: str = "recut") -> str:
    """The log's one line on what `--shuffle-block` does to a global batch."""
    runs = "1-2 runs" if block >= global_batch else f"~{-(-global_batch // block)} runs"
    how = (
        "blocks are re-cut and re-keyed every epoch"
        if order == "recut"
        else "fixed blocks: this run began before blocks were re-cut, and keeps its order"
    )
    return (
        f"note: --shuffle-block {block}: each global batch of {global_batch} draws from {runs} "
        f"of up to {block} neighbouring samples (its negatives come from that few shard "
        f"regions; {how})"
    )
