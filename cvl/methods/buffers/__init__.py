"""Replay buffers, combinable with any method (`--buffer NAME --buffer-size N`).

A buffer stores item *references* (shard path relative to the stream folder + key), never
images, per task and in a meaningful order (herding order for `mof`). After each task the
loop calls `update(task, entries, ctx)`; the next task trains on its own data plus
`entries()`. Selection runs on rank 0 and is broadcast, so every rank holds the same buffer.

Per-item payload (DER's stored outputs): `set_payload(refs, name=tensor)` attaches tensors
(one row per reference) to items; they live in the buffer's state (safetensors, resumable),
are dropped when their item leaves the buffer, and `payload_rows(batch, name)` returns a
training batch's rows of them with the mask of the rows that are buffer items.
"""

from __future__ import annotations

from cvl.errors import CvlError
from cvl.methods.buffers.base import BUFFERS, Buffer, quotas_by_size, register_buffer

__all__ = ["BUFFERS", "Buffer", "build_buffer", "buffer_names", "quotas_by_size", "register_buffer"]


def buffer_names() -> list[str]:
    """Every registered buffer's CLI name (the modules below register themselves)."""
    from cvl.methods.buffers import cumulative, kmeans, mof, reservoir, ring  # noqa: F401

    return list(BUFFERS)


def build_buffer(name: str, size: int, seed: int, stream_root: str | None) -> Buffer:
    """A buffer by CLI name (reservoir, ring, kmeans, mof, cumulative-all|-equal|-exp)."""
    if name not in buffer_names():
        raise CvlError(f"unknown buffer '{name}' (available: {', '.join(sorted(BUFFERS))})")
    return BUFFERS[name](size, seed=seed, stream_root=stream_root)
