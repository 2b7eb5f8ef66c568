"""The training augmentation, split between the loader workers and the training device.

`image_transform` (cvl/data/transforms.py) is what is computed: open_clip's or CTP's
torchvision pipeline, run per sample in a loader worker. A fast GPU eats more samples per
second than a few CPU cores decode and augment that way, so for training `SplitTransform`
runs the same pipeline in two parts:

- **per sample, in a worker** (`SplitTransform.prepare` / `.apply`, called by
  `PairDataset`): the random draws in the Compose's order from the sample's own seed (crop
  box, flip, RandAugment), so batches still do not depend on the worker count and resume
  stays exact; the JPEG decoded at a reduced DCT scale (PIL draft mode: 1/2, 1/4, 1/8)
  where the crop box stays at least the output size after scaling; then either the crop
  only (`resize_on_device`, the GPU path) or crop + resize + flip + the PIL-only ops
  (RandAugment) in uint8 (the CPU path, and CTP's pipeline, whose RandAugment needs the
  resized image). Out goes a uint8 HWC array, no float tensor;
- **per batch, on the training device** (`SplitTransform.finish`): the resize (PIL's own
  antialiased filter and rounding, as two matrix products per batch), the flip, the float
  conversion and the normalisation.

What stays equal to the per-sample Compose: the crop boxes and flips (the same draws); with
the resize in the worker and no draft the tensors are bit-identical; the device resize
uses PIL's own fixed-point filter weights, its pass order and its rounding of each pass to
8 bits, with float32 sums instead of its integer ones, so a value differs by a level where a
near-tie rounds the other way (≤ 2 levels, < 0.1 % of values: tests/test_augment.py). Draft mode changes the low-pass
filter (the DCT's instead of the bicubic's), within interpolation differences (measured in
the same test). A Compose of another shape is not split (`split_transform` returns None).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

# PIL's resampling filters: (support, kernel); kernels as in PIL's Resample.c
_BICUBIC_A = -0.5


def _bicubic(x: torch.Tensor) -> torch.Tensor:
    a, x = _BICUBIC_A, x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _bilinear(x: torch.Tensor) -> torch.Tensor:
    return (1 - x.abs()).clamp(min=0)


FILTERS: dict[int, tuple[float, Callable[[torch.Tensor], torch.Tensor]]] = {
    Image.Resampling.BICUBIC: (2.0, _bicubic),
    Image.Resampling.BILINEAR: (1.0, _bilinear),
}
PIL_ONE = float(1 << 22)  # PIL's PRECISION_BITS for 8-bit images
MAX_DRAFT = 8  # JPEG DCT scaling goes down to 1/8
CHUNK_ELEMENTS = 1 << 26  # device resize: samples per chunk so a chunk's floats stay ~256 MB


@dataclass(frozen=True)
class Axis:
    """One axis of a resize, PIL's way: output pixel o samples the input at
    `in0 + (o + 0.5) * scale`, with filter taps clipped to the input's [0, size).

    `shrink`: PIL's input size minus its resize's output size on this axis (before any
    centre crop): what decides PIL's pass order (`vertical_first`)."""

    in0: float
    scale: float
    size: int
    out: int
    shrink: int = 0

    def taps(self, support: float) -> tuple[int, int]:
        """The input pixels any output pixel reads: [first, last) (PIL's xmin/xmax)."""
        sup = support * max(self.scale, 1.0)
        first = math.floor(self.in0 + 0.5 * self.scale - sup + 0.5)
        last = math.floor(self.in0 + (self.out - 0.5) * self.scale + sup + 0.5)
        return max(first, 0), min(last, self.size)


@dataclass
class Plan:
    """One sample's draws and geometry, made from the image header before decoding."""

    x: Axis  # in original pixels; the crop region (RandomResizedCrop) or the image (Resize)
    y: Axis
    x0: int  # where the resize's input starts in the image (the crop's corner)
    y0: int
    flip: bool = False
    draft: int = 1  # the JPEG DCT scale actually used (1, 2, 4 or 8)
    box: tuple[int, int, int, int] | None = None  # RandomResizedCrop's (i, j, h, w)


def crop_box(
    width: int,
    height: int,
    scale: Sequence[float],
    ratio: Sequence[float],
    log_ratio: Sequence[float] | None = None,
) -> tuple[int, int, int, int]:
    """torchvision's `RandomResizedCrop.get_params` (i, j, h, w): the same draws from torch's
    generator in the same order and the same arithmetic (tested equal), without re-making
    the float32 log-ratio tensor (pass it: `log_ratio`) and torchvision's usage logging on
    every call."""
    if log_ratio is None:
        log_ratio = torch.log(torch.tensor(ratio)).tolist()
    area = height * width
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)  # fallback: the central crop
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class SplitTransform:
    """A recognised training Compose, run as worker part + batched device part."""

    def __init__(
        self,
        kind: str,
        size: tuple[int, int],
        resample: int,
        mean: Sequence[float],
        std: Sequence[float],
        scale: tuple[float, float] = (1.0, 1.0),
        ratio: tuple[float, float] = (1.0, 1.0),
        resize_to: int | tuple[int, int] | None = None,
        flip_p: float | None = None,
        pil_ops: Sequence[Callable[[Image.Image], Image.Image]] = (),
        resize_on_device: bool = True,
        draft: bool = True,
        compose: Any = None,
    ) -> None:
        self.kind = kind  # "crop" (RandomResizedCrop) or "center" (Resize + CenterCrop)
        self.size = size  # output (h, w)
        self.resample = resample  # a PIL filter
        self.scale, self.ratio, self.resize_to = scale, ratio, resize_to
        self._log_ratio = tuple(torch.log(torch.tensor(ratio)).tolist())  # float32, as torchvision
        self.flip_p = flip_p
        self.pil_ops = list(pil_ops)
        # the device cannot run PIL-only ops (RandAugment) after the resize
        self.resize_on_device = resize_on_device and not self.pil_ops
        self.draft = draft
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.compose = compose  # the per-sample pipeline this one computes

    def __repr__(self) -> str:
        where = "device" if self.resize_on_device else "worker"
        return f"SplitTransform({self.compose!r}, resize on the {where})"

    # -- per sample (loader worker) ----------------------------------------------------------
    def prepare(self, img: Image.Image) -> Plan:
        """Draw the sample's parameters from the header-only image; set JPEG draft mode."""
        W, H = img.size
        oh, ow = self.size
        if self.kind == "crop":
            i, j, h, w = crop_box(W, H, self.scale, self.ratio, self._log_ratio)
            ax, ay = Axis(0.0, w / ow, w, ow, w - ow), Axis(0.0, h / oh, h, oh, h - oh)
            plan = Plan(ax, ay, j, i, box=(i, j, h, w))
        else:  # Resize (shorter side or (h, w)) then CenterCrop, as torchvision computes them
            import torchvision.transforms.functional as F

            req = [self.resize_to] if isinstance(self.resize_to, int) else list(self.resize_to)
            nh, nw = F._compute_resized_output_size((H, W), req)
            top, left = int(round((nh - oh) / 2.0)), int(round((nw - ow) / 2.0))
            sx, sy = W / nw, H / nh
            ax, ay = Axis(left * sx, sx, W, ow, W - nw), Axis(top * sy, sy, H, oh, H - nh)
            plan = Plan(ax, ay, 0, 0)
        if self.flip_p is not None:
            plan.flip = bool(torch.rand(1) < self.flip_p)
        if self.draft and img.format == "JPEG":
            s = MAX_DRAFT
            while s > 1 and not (plan.x.scale >= s and plan.y.scale >= s):
                s //= 2
            if s > 1:
                got = img.draft(None, (W // s, H // s))
                plan.draft = round(W / got[1][2]) if got else 1
        return plan

    @staticmethod
    def _drafted(plan: Plan, W: int, H: int) -> tuple[Axis, Axis, tuple[int, int]]:
        """The plan's axes in the decoded image's pixels (W × H), and the resize input's
        corner there: the crop region at the draft's scale, widened to whole pixels."""
        s = plan.draft
        if s == 1:
            return plan.x, plan.y, (plan.x0, plan.y0)
        axes, corner = [], []
        for ax, c0, n in ((plan.x, plan.x0, W), (plan.y, plan.y0, H)):
            lo, hi = math.floor(c0 / s), min(math.ceil((c0 + ax.size) / s), n)
            axes.append(Axis((c0 + ax.in0) / s - lo, ax.scale / s, hi - lo, ax.out, ax.shrink))
            corner.append(lo)
        return axes[0], axes[1], (corner[0], corner[1])

    def apply(
        self,
        data: bytes,
        img: Image.Image,
        plan: Plan,
        load_rgb: Callable[[Image.Image], Image.Image],
    ) -> dict[str, Any]:
        """The worker's part: the image's bytes, its header-only PIL image (draft mode set by
        `prepare`) and the plan -> uint8 HWC pixels (+ geometry and flip for the device).

        `load_rgb` decodes a header-only image to RGB (the reader's)."""
        if self.resize_on_device:
            pixels = _decode(data, img, plan, load_rgb)
            ax, ay, (cx, cy) = self._drafted(plan, pixels.shape[1], pixels.shape[0])
            support = FILTERS[self.resample][0]
            (x0, x1), (y0, y1) = ax.taps(support), ay.taps(support)
            geom = [
                [ay.in0 - y0, ay.scale, y1 - y0, ay.shrink],
                [ax.in0 - x0, ax.scale, x1 - x0, ax.shrink],
            ]
            return {
                "image": pixels[cy + y0 : cy + y1, cx + x0 : cx + x1],
                "image_geom": np.array(geom, dtype=np.float64),
                "image_flip": np.array(plan.flip),
            }
        img = load_rgb(img)
        ax, ay, (cx, cy) = self._drafted(plan, img.width, img.height)
        oh, ow = self.size
        if plan.draft == 1 and self.kind == "crop":  # exactly torchvision's ops
            i, j, h, w = plan.box
            img = img.crop((j, i, j + w, i + h)).resize((ow, oh), self.resample)
        elif plan.draft == 1:
            t = self.compose.transforms
            img = t[1](t[0](img))  # the Compose's own Resize and CenterCrop
        else:
            img = img.crop((cx, cy, cx + ax.size, cy + ay.size))
            box = (ax.in0, ay.in0, ax.in0 + ow * ax.scale, ay.in0 + oh * ay.scale)
            img = img.resize((ow, oh), self.resample, box=box)
        if plan.flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        for op in self.pil_ops:
            img = op(img)
        return {"image": np.asarray(img)}

    # -- per batch (training device) ---------------------------------------------------------
    def _resize(self, x: torch.Tensor, geom: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Padded uint8 crops on the device -> [N, 3, oh, ow] float with PIL's values: the
        samples PIL resizes vertically first apart from the others, in memory-bounded chunks.
        Which is which and the filter lengths come from the host's `geom`: no device sync."""
        first = vertical_first(geom)
        taps = (max_taps(geom[:, 0], self.resample), max_taps(geom[:, 1], self.resample))
        geom = geom.to(device, non_blocking=True)
        out = torch.empty(len(x), 3, *self.size, device=device)
        for order in (False, True):
            idx = torch.nonzero(first == order).flatten()
            if len(idx) == 0:
                continue
            whole = len(idx) == len(x)
            if not whole:
                idx = idx.to(device, non_blocking=True)
            xs, gs = (x, geom) if whole else (x[idx], geom[idx])
            parts = [
                _resize(xs[a : a + k], gs[a : a + k], self.size, self.resample, order, taps)
                for a, k in _chunks(xs)
            ]
            if whole:
                return torch.cat(parts)
            out[idx] = torch.cat(parts)
        return out

    def finish(self, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The batch's images on `device`, as the Compose makes them: float, normalised."""
        x = batch.pop("image").to(device, non_blocking=True)
        if "image_geom" in batch:
            x = self._resize(x, batch.pop("image_geom"), device)
            flip = batch.pop("image_flip").to(device, non_blocking=True)
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        else:
            x = x.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        if device not in self._consts:  # once per device: no copy (or sync) per batch
            self._consts[device] = (self.mean.to(device), self.std.to(device))
        mean, std = self._consts[device]
        # ToTensor's x / 255, then Normalize's (x - mean) / std: the same float operations
        return x.div_(255).sub_(mean).div_(std)


def _decode(
    data: bytes, img: Image.Image, plan: Plan, load_rgb: Callable[[Image.Image], Image.Image]
) -> np.ndarray | torch.Tensor:
    """uint8 HWC pixels of an image as `load_rgb` gives them. A JPEG at full scale goes
    through torchvision's decoder: libjpeg-turbo with PIL's settings, the same pixels (tested)
    at less CPU, straight into a tensor; drafted ones, other formats and JPEGs it refuses
    (or a torchvision without it) go through PIL."""
    op = _jpeg_op() if plan.draft == 1 and img.format == "JPEG" else None
    if op is not None and img.mode in ("RGB", "L"):
        try:
            return op(torch.frombuffer(bytearray(data), dtype=torch.uint8)).permute(1, 2, 0)
        except RuntimeError:
            pass
    return np.asarray(load_rgb(img))


_JPEG_OP: list = []


def _jpeg_op() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torchvision's CPU JPEG decoder to RGB (CHW), found once; None where it is missing.

    The op itself: `torchvision.io.decode_jpeg` adds a deprecation warning on every call
    (its image I/O moves to TorchCodec); the op is what it calls on the CPU."""
    if not _JPEG_OP:
        try:
            from torchvision.io.image import ImageReadMode

            raw = torch.ops.image.decode_jpeg
            mode = ImageReadMode.RGB.value
            _JPEG_OP.append(lambda t: raw(t, mode, False))
        except Exception:  # no torchvision image extension
            _JPEG_OP.append(None)
    return _JPEG_OP[0]


def _chunks(x: torch.Tensor) -> list[tuple[int, int]]:
    per = max(1, CHUNK_ELEMENTS // max(1, x[0].numel()))
    return [(s, min(per, len(x) - s)) for s in range(0, len(x), per)]


def resize_weights(
    geom: torch.Tensor,
    out: int,
    width: int,
    resample: int = Image.Resampling.BICUBIC,
    taps: int | None = None,
) -> torch.Tensor:
    """PIL's 8-bit resampling coefficients for one axis of each sample: [N, out, width].

    `geom` [N, ≥3] = (in0, scale, size, ...) per sample (`Axis`); inputs are zero-padded to
    `width`, so taps past `size` get no weight. PIL's precompute_coeffs, in float64 and in
    its order of operations: centre in0 + (o + 0.5) * scale, support × max(scale, 1), taps
    [floor(c - support + 0.5), floor(c + support + 0.5)) clipped to [0, size), weights
    normalised to sum 1, then its fixed point (× 2^22, rounded away from zero): float32
    holds those exactly, so a pass's sums are PIL's but for float32 rounding.

    `taps`: at least PIL's ksize for the largest scale (`max_taps`); given, nothing here
    waits for the device."""
    support, kernel = FILTERS[resample]
    in0, scale, size = (geom[:, k : k + 1].double() for k in range(3))
    fscale = scale.clamp(min=1.0)
    sup = support * fscale
    centre = in0 + (torch.arange(out, device=geom.device, dtype=torch.float64) + 0.5) * scale
    first = torch.floor(centre - sup + 0.5).clamp(min=0)
    last = torch.minimum(torch.floor(centre + sup + 0.5), size)
    taps = taps or max_taps(geom, resample)
    x = first.unsqueeze(-1) + torch.arange(taps, device=geom.device, dtype=torch.float64)
    w = kernel((x - centre.unsqueeze(-1) + 0.5) * (1.0 / fscale).unsqueeze(-1))
    w = torch.where(x < last.unsqueeze(-1), w, 0.0)
    total = w.sum(-1, keepdim=True)
    w = w / torch.where(total == 0, 1.0, total)
    w = torch.trunc(w * PIL_ONE + torch.where(w < 0, -0.5, 0.5)) / PIL_ONE
    dense = torch.zeros(len(geom), out, width + taps, device=geom.device)
    n, o = (torch.arange(k, device=geom.device) for k in (len(geom), out))
    # distinct indices: index_put_ without accumulation is deterministic (scatter_ is not)
    dense.index_put_((n.view(-1, 1, 1), o.view(1, -1, 1), x.long()), w.float())
    return dense[..., :width]  # taps past `last` carry 0 (into the spare room)


def max_taps(geom: torch.Tensor, resample: int) -> int:
    """PIL's ksize for the largest scale in `geom` [N, ≥2] (in0, scale, ...)."""
    support = FILTERS[resample][0]
    return int(math.ceil(support * max(1.0, float(geom[:, 1].max())))) * 2 + 1


def vertical_first(geom: torch.Tensor) -> torch.Tensor:
    """Which samples PIL resizes vertically first ([N] bool, from `geom` [N, 2, 4]).

    Pillow 13 runs the vertical pass first when the height shrinks by more than twice what
    the width does (`Axis.shrink`, geom[:, :, 3]); each pass rounds to 8 bits. (Earlier
    Pillows always ran the horizontal one first: a difference of a few levels at most, in
    the samples this picks.)"""
    dh, dw = geom[:, 0, 3], geom[:, 1, 3]
    return (dh > 0) & (dh > dw * 2)


def _resize(
    x: torch.Tensor,
    geom: torch.Tensor,
    size: tuple[int, int],
    resample: int,
    vertical_first: bool = False,
    taps: tuple[int, int] | None = None,
) -> torch.Tensor:
    """uint8 [N, H, W, C] (zero-padded crops) -> float [N, C, oh, ow] with PIL's values:
    one pass, rounded and clipped to 0..255, then the other (horizontal first unless
    `vertical_first`). `taps`: (vertical, horizontal) `max_taps`, known on the host."""
    n, h, w, _ = x.shape
    ty, tx = taps or (None, None)
    wy = resize_weights(geom[:, 0], size[0], h, resample, ty).unsqueeze(1)
    wx = resize_weights(geom[:, 1], size[1], w, resample, tx).transpose(1, 2).unsqueeze(1)
    x = x.permute(0, 3, 1, 2).to(torch.float32)
    if vertical_first:
        return _to_8bit(torch.matmul(_to_8bit(torch.matmul(wy, x)), wx))
    return _to_8bit(torch.matmul(wy, _to_8bit(torch.matmul(x, wx))))


def _to_8bit(x: torch.Tensor) -> torch.Tensor:
    """PIL's rounding of a pass's sums: half up (its fixed-point + 0.5 then shift), 0..255."""
    return x.add_(0.5).floor_().clamp_(0, 255)


def split_transform(
    compose: Any, resize_on_device: bool = True, draft: bool = True
) -> SplitTransform | None:
    """The two-part version of a torchvision Compose, or None when it has another shape.

    Recognised: RandomResizedCrop | Resize + CenterCrop (bicubic or bilinear), then any PIL
    ops (RandomHorizontalFlip first is drawn and applied by cvl; others, e.g. RandAugment,
    run in the worker and keep the resize there), RGB conversion, ToTensor, Normalize."""
    import torchvision.transforms as T
    from torchvision.transforms.functional import pil_modes_mapping

    steps = list(getattr(compose, "transforms", []))
    if len(steps) < 3 or not isinstance(steps[-1], T.Normalize):
        return None
    if not isinstance(steps[-2], T.ToTensor):  # open_clip's MaybeToTensor is one
        return None
    kw: dict[str, Any] = {"mean": list(steps[-1].mean), "std": list(steps[-1].std)}
    first, rest = steps[0], steps[1:-2]
    if isinstance(first, T.RandomResizedCrop):
        kw.update(kind="crop", size=tuple(first.size), scale=tuple(first.scale))
        kw["ratio"] = tuple(first.ratio)
    elif isinstance(first, T.Resize) and rest and isinstance(rest[0], T.CenterCrop):
        if first.max_size is not None:
            return None
        size = first.size if isinstance(first.size, int) else tuple(first.size)
        if isinstance(size, tuple) and len(size) == 1:
            size = size[0]
        crop = tuple(rest[0].size)
        kw.update(kind="center", size=crop, resize_to=size)
        rest = rest[1:]
    else:
        return None
    resample = pil_modes_mapping.get(first.interpolation)
    if resample not in FILTERS:
        return None
    if kw["kind"] == "center" and isinstance(size, int) and min(crop) > size:
        return None  # CenterCrop would pad
    rest = [t for t in rest if not _is_rgb_conversion(t)]
    if rest and isinstance(rest[0], T.RandomHorizontalFlip):
        kw["flip_p"] = rest[0].p
        rest = rest[1:]
    if any(_is_rgb_conversion(t) or isinstance(t, T.ToTensor) for t in rest):
        return None
    return SplitTransform(
        resample=resample,
        pil_ops=rest,
        resize_on_device=resize_on_device,
        draft=draft,
        compose=compose,
        **kw,
    )


def _is_rgb_conversion(t: Any) -> bool:
    """open_clip's MaybeConvertMode("RGB"): a no-op on the loader's RGB images."""
    return type(t).__name__ == "MaybeConvertMode" and getattr(t, "mode", None) == "RGB"


def train_transform(image_size: int, augment: str, device: torch.device | str) -> Any:
    """The training transform for a loader feeding `device`: split where recognised (the
    resize on the device unless that is the CPU), else the per-sample Compose."""
    from cvl.data.transforms import image_transform

    compose = image_transform(image_size, train=True, augment=augment)
    on_device = torch.device(device).type != "cpu"
    return split_transform(compose, resize_on_device=on_device) or compose


def device_images(batch: dict[str, Any], transform: Any, device: torch.device) -> torch.Tensor:
    """A loader batch's images on `device`, ready for the model (the split transform's
    batched part, or a plain copy of the per-sample pipeline's float tensors)."""
    if isinstance(transform, SplitTransform):
        return transform.finish(batch, device)
    return batch["image"].to(device, non_blocking=True)
