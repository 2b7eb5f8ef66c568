"""A tiny random transformers image classifier saved like a real checkpoint (no download)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_beit(folder: Path, head: bool = True) -> Path:
    """BeitForImageClassification (2 layers, 32 px, 1000 labels; classifier std 1 so its top-1
    varies across images) + BeitImageProcessor for 32 px, via save_pretrained; `head=False`
    saves a BeitModel (no classifier head)."""
    from transformers import BeitConfig, BeitForImageClassification, BeitImageProcessor, BeitModel

    torch.manual_seed(0)
    cfg = BeitConfig(
        image_size=32,
        patch_size=8,
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1000,
    )
    if head:
        model = BeitForImageClassification(cfg)
        torch.nn.init.normal_(model.classifier.weight, std=1.0)
    else:
        model = BeitModel(cfg)
    model.save_pretrained(folder)
    BeitImageProcessor(size={"height": 32, "width": 32}, do_center_crop=False).save_pretrained(
        folder
    )
    return folder
