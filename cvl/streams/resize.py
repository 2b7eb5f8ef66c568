"""How a stream's images are resized and encoded: `ImageOptions` (img2dataset's Resizer options,
part of the download cache's key) and the same img2dataset `Resizer` applied to local files and
to image bytes (`process_local`, `process_bytes`), so a stream gets the same image processing
whatever the origin; `CHILD_ENV`, the environment img2dataset's imports need.

Kept apart from the download cache (download.py) and the img2dataset child process
(img2dataset_run.py): local sources resize without either. `cvl.streams.download` re-exports
every name.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cvl.data.images import MAX_PIXELS, ImageTooLarge, open_image
from cvl.errors import CvlError

RESIZE_MODES = ("no", "keep_ratio", "center_crop", "border", "keep_ratio_largest")
TOO_LARGE = "too_large"  # the error (and drop reason) of an image past MAX_PIXELS
# img2dataset imports albumentations, which otherwise checks PyPI for updates at import time.
# OpenCV (img2dataset's decoder) refuses images past cvl's pixel limit, read at its import.
CHILD_ENV = {
    "NO_ALBUMENTATIONS_UPDATE": "1",
    "WANDB_MODE": "disabled",
    "WANDB_SILENT": "true",
    "OPENCV_IO_MAX_IMAGE_PIXELS": str(MAX_PIXELS),
}


@dataclass(frozen=True)
class ImageOptions:
    """How images are resized and encoded (img2dataset's Resizer options); part of the cache key."""

    image_size: int = 256
    resize_mode: str = "keep_ratio"
    resize_only_if_bigger: bool = True
    encode_quality: int = 95
    min_image_size: int = 0
    max_aspect_ratio: float = float("inf")

    def __post_init__(self) -> None:
        if self.resize_mode not in RESIZE_MODES:
            raise CvlError(f"--resize-mode must be one of {', '.join(RESIZE_MODES)}")
        if self.image_size <= 0:
            raise CvlError("--image-size must be positive")
        if not 0 <= self.encode_quality <= 100:
            raise CvlError("--encode-quality must be in 0..100")

    def img2dataset_kwargs(self) -> dict[str, Any]:
        return {
            "image_size": self.image_size,
            "resize_mode": self.resize_mode,
            "resize_only_if_bigger": self.resize_only_if_bigger,
            "encode_quality": self.encode_quality,
            "encode_format": "jpg",
            "min_image_size": self.min_image_size,
            "max_aspect_ratio": self.max_aspect_ratio,
        }

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if math.isinf(d["max_aspect_ratio"]):
            d["max_aspect_ratio"] = None
        return d


def short_error(msg: str | None) -> str:
    """A compact, countable error message (img2dataset's are already short; trim the rest)."""
    if not msg:
        return "unknown error"
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= 120 else msg[:117] + "..."


# -- local images --------------------------------------------------------------------------------
_RESIZER: dict[str, Any] = {}


def _resizer(image: ImageOptions):  # noqa: ANN202
    key = json.dumps(image.to_json(), sort_keys=True)
    r = _RESIZER.get(key)
    if r is None:
        for k, v in CHILD_ENV.items():
            os.environ.setdefault(k, v)
        import warnings

        with warnings.catch_warnings():  # img2dataset imports the deprecated imghdr module
            warnings.simplefilter("ignore", DeprecationWarning)
            from img2dataset.resizer import Resizer

        kw = image.img2dataset_kwargs()
        r = _RESIZER[key] = Resizer(**kw)
    return r


def process_local(path: str, image: ImageOptions) -> tuple[bytes | None, str | None]:
    """Read a local image and resize/encode it like a downloaded one: (jpeg bytes, error)."""

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return None, f"cannot read image file: {e.strerror or e}"
    if not data:
        return None, "empty image file"
    return process_bytes(data, image)


def process_bytes(data: bytes, image: ImageOptions) -> tuple[bytes | None, str | None]:
    """Resize/encode image bytes from an archive like a downloaded image: (jpeg bytes, error).

    The header is checked against `MAX_PIXELS` first (error "too_large: ..."), so a
    decompression bomb is refused before any pixel is decoded."""
    import io

    try:
        open_image(data).close()
    except ImageTooLarge as e:
        return None, f"{TOO_LARGE}: {e}"
    except Exception:  # noqa: BLE001 (not an image PIL knows: the resizer decides)
        pass
    img, _, _, _, _, err = _resizer(image)(io.BytesIO(data))
    if err is not None or img is None:
        return None, short_error(err or "image decoding error")
    return img, None
