"""Image transforms: open_clip's own train/eval transforms, plus the CTP recipe's augmentation."""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image


def image_transform(
    image_size: int, train: bool, augment: str = "openclip"
) -> Callable[[Image.Image], torch.Tensor]:
    """open_clip's transform (RandomResizedCrop 0.9-1 for training, resize+crop for eval).

    `augment="ctp"` gives CTP's training pipeline: RandomResizedCrop(0.2-1) + flip +
    RandAugment(2, 5), with the same normalisation.
    """
    import open_clip
    from torchvision import transforms as T

    if not train or augment == "openclip":
        return open_clip.image_transform(image_size, is_train=train)
    if augment == "none":
        return open_clip.image_transform(image_size, is_train=False)
    if augment == "ctp":
        from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

        return T.Compose(
            [
                T.RandomResizedCrop(
                    image_size, scale=(0.2, 1.0), interpolation=T.InterpolationMode.BICUBIC
                ),
                T.RandomHorizontalFlip(),
                T.RandAugment(2, 5),
                T.ToTensor(),
                T.Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD),
            ]
        )
    raise ValueError(f"unknown augmentation '{augment}' (openclip, ctp, none)")


class EvalTransform:
    """open_clip's eval transform in two halves, so decoding and normalising can live apart.

    `to_uint8` (resize, centre crop, RGB, uint8 CHW) is what a loader worker does and what the
    evaluation's image store keeps (a quarter of the float32 bytes); `normalize` turns a uint8
    batch into the model's input (`/255`, mean/std) on whatever device the batch is on.
    Calling the object does both: the same float tensor as `open_clip.image_transform(size,
    is_train=False)`, bit for bit (the same ops in the same order: tested).
    """

    def __init__(self, image_size: int) -> None:
        import open_clip
        from torchvision import transforms as T

        steps = list(open_clip.image_transform(image_size, is_train=False).transforms)
        if not (isinstance(steps[-2], T.ToTensor) and isinstance(steps[-1], T.Normalize)):
            raise ValueError(f"unexpected open_clip eval transform: {steps}")
        self.image_size = image_size
        self.to_uint8 = T.Compose([*steps[:-2], T.PILToTensor()])
        self.mean = tuple(float(v) for v in steps[-1].mean)
        self.std = tuple(float(v) for v in steps[-1].std)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [..., 3, H, W] -> the model's float32 input, on `images`' device."""
        from torchvision.transforms import functional as F

        return F.normalize(images.to(torch.float32).div(255), self.mean, self.std, inplace=True)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        return self.normalize(self.to_uint8(img))

    def __repr__(self) -> str:
        return f"EvalTransform({self.to_uint8!r}, mean={self.mean}, std={self.std})"
