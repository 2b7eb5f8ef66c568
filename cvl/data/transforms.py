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
