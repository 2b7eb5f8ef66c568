"""Replay buffers, combinable with any method (`--buffer NAME --buffer-size N`).

A buffer stores integers, never images: per task, the positions of its kept samples in the
task's training entries (the trainer's `entries_of(task)`), in a meaningful order (herding
order for `mof`); `cumulative-all` keeps whole tasks without an array. After each task the
loop calls `update(task, entries, ctx)`; the next task trains on its own data plus
`entries()`. Selection runs on rank 0 and is broadcast, so every rank holds the same buffer.

Per-item payload (DER's stored outputs): `set_payload(keys, name=tensor)` attaches tensors
(one row per (task, position) key) to items; they live in the buffer's state (safetensors,
resumable), are dropped when their item leaves the buffer, and `payload_rows(batch, name)`
returns a training batch's rows of them (found by the batch's packed sample ids, `sid`) with
the mask of the rows that are buffer items.
"""

from __future__ import annotations

from collections.abc import Callable

from cvl.data.index import Entries
from cvl.errors import CvlError
from cvl.methods.buffers.base import BUFFERS, Buffer, quotas_by_size, register_buffer

__all__ = ["BUFFERS", "Buffer", "build_buffer", "buffer_names", "quotas_by_size", "register_buffer"]


def buffer_names() -> list[str]:
    """Every registered buffer's CLI name (the modules below register themselves)."""
    from cvl.methods.buffers import cumulative, kmeans, mof, reservoir, ring  # noqa: F401

    return list(BUFFERS)


def build_buffer(
    name: str,
    size: int,
    seed: int,
    stream_root: str | None,
    entries_of: Callable[[str], Entries] | None = None,
) -> Buffer:
    """A buffer by CLI name (reservoir, ring, kmeans, mof, cumulative-all|-equal|-exp);
    `entries_of(task)`: a task's training entries, which the buffer's positions index."""
    if name not in buffer_names():
        raise CvlError(f"unknown buffer '{name}' (available: {', '.join(sorted(BUFFERS))})")
    return BUFFERS[name](size, seed=seed, stream_root=stream_root, entries_of=entries_of)
