"""The pixel limit every image read by cvl obeys, checked from the header before decoding.

A decompression bomb (a few KB of PNG announcing 30000×30000 pixels) costs gigabytes once
decoded; its header says so first. `open_image` reads only the header and refuses images of
more than `MAX_PIXELS` pixels (below PIL's own limit), for the training reader, the stream
builders, pseudo-labelling and zero-shot folders alike.
"""

from __future__ import annotations

import io
import os
import warnings

from PIL import Image

MAX_PIXELS = 8192 * 8192  # larger image headers are refused before decoding (memory bound)


class ImageTooLarge(ValueError):
    """An image whose header announces more than `MAX_PIXELS` pixels."""


def open_image(src: bytes | str | os.PathLike) -> Image.Image:
    """A PIL image of `src` (bytes or a file) with only its header read; `ImageTooLarge` past
    `MAX_PIXELS`, PIL's own errors for what is not an image."""
    with warnings.catch_warnings():  # PIL warns from 89M pixels; the limit below is lower
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(src) if isinstance(src, bytes) else src)
        except Image.DecompressionBombError as e:
            raise ImageTooLarge(f"image header exceeds MAX_PIXELS ({MAX_PIXELS}): {e}") from None
    if img.width * img.height > MAX_PIXELS:
        img.close()
        raise ImageTooLarge(
            f"image of {img.width}x{img.height} pixels exceeds MAX_PIXELS ({MAX_PIXELS})"
        )
    return img
