"""Image loading for the build (step 4 of `pipeline.build_stream`): each planned image read from
its local file, its base64 text or the download cache, resized by img2dataset's resizer: one
at a time (`load_image`, in the processes that write whole shards: `cvl.streams.parallel`) or
in order from a pool of `--processes` workers (`load_images`, a build of few shards).

Kept apart from the build, which only plans the images (`pipeline._image_plan`) and writes
what comes back.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator

from cvl.streams.resize import (
    ImageOptions,
    process_bytes,
    process_local,
)


def load_image(item: tuple, image: ImageOptions) -> tuple[bytes | None, str | None]:
    """The resized JPEG bytes of one plan item (`pipeline._image_plan`), or (None, error)."""
    if item[0] == "file":
        return process_local(item[1], image)
    if item[0] == "b64":
        return _load_b64(item[1], item[2], item[3], image)
    if item[0] == "bytes":
        return process_bytes(item[1], image)
    kind, tar, off, size = item
    try:
        with open(tar, "rb") as f:
            f.seek(off)
            data = f.read(size)
    except OSError as e:
        return None, f"cannot read {'the shard' if kind == 'raw' else 'cached'} image: {e}"
    # an image inside a source shard is resized as a file; the cache holds resized images
    return process_bytes(data, image) if kind == "raw" else (data, None)


def _load_b64(
    path: str, off: int, size: int, image: ImageOptions
) -> tuple[bytes | None, str | None]:
    """A base64 image stored inside a text file (MUGE / EC-T2I `*.img.tsv`)."""
    try:
        with open(path, "rb") as f:
            f.seek(off)
            raw = f.read(size)
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror or e}"
    try:
        data = base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        return None, f"undecodable base64 ({e})"
    if not data:
        return None, "empty image"
    return process_bytes(data, image)


def _load_star(args: tuple) -> tuple[bytes | None, str | None]:
    return load_image(*args)


def load_images(items: list[tuple], image: ImageOptions, processes: int) -> Iterator[tuple]:
    """Image bytes for each plan item, in order (local files resized in a pool if processes>1)."""
    n_local = sum(1 for it in items if it[0] in ("file", "b64", "raw", "bytes"))
    if processes > 1 and n_local > 256:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(processes) as pool:
            yield from pool.imap(_load_star, ((it, image) for it in items), chunksize=64)
    else:
        for it in items:
            yield load_image(it, image)
