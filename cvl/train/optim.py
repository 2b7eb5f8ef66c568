"""The training optimizer, its learning-rate schedule and the per-step seeding of torch's
generators (shared by the loop, the budget's probe step and AFEC's expanded model)."""

from __future__ import annotations

import math
from typing import Any

import torch


def cosine_schedule(total: int, warmup: float, base_lr: float, min_lr: float):
    """LR multiplier: linear warm-up, then cosine from base_lr to min_lr over `total` steps."""
    w = int(round(warmup * total)) if warmup < 1 else int(warmup)
    floor = min_lr / base_lr if base_lr > 0 else 0.0

    def f(step: int) -> float:
        if w > 0 and step < w:
            return (step + 1) / w
        p = (step - w) / max(1, total - w)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))

    return f


def task_lr(cfg: Any, task: str | None) -> float:
    """The peak learning rate of `task`: its `task_lr` entry (the ZSCL scripts give Aircraft
    and MNIST 5e-5, the others 1e-5), else `lr`."""
    per = getattr(cfg, "task_lr", None) or {}
    return float(per.get(task, cfg.lr)) if task is not None else float(cfg.lr)


def optimizer_with_schedule(params: list, cfg: Any, steps: int, task: str | None = None):
    """The training optimizer + warm-up/cosine lr: AdamW, or (`optimizer: lamb`) LAMB (You et
    al. 2020; timm's, with no clipping of its own: `grad_clip` does that), no weight decay on
    gains, biases and scales (LAMB's trust ratio only where weights decay, as NVLAMB). The peak
    rate is `task_lr(cfg, task)`."""
    lr = task_lr(cfg, task)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (cfg.beta1, cfg.beta2)
    if getattr(cfg, "optimizer", "adamw") == "lamb":
        from timm.optim import Lamb

        opt = Lamb(groups, lr=lr, betas=betas, eps=cfg.eps, max_grad_norm=None)
    else:
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, cosine_schedule(steps, cfg.warmup, lr, cfg.min_lr)
    )
    return opt, sched


def seed_torch(seed: int, device: torch.device) -> None:
    """torch.manual_seed (the CPU generator and every CUDA generator), without its lazy
    accelerator seeding when training on the CPU.

    On a CPU-only run `torch.manual_seed` queues a deferred seeding call (with a captured
    traceback) for each accelerator type every time: milliseconds per step and a list that
    grows for the whole run. The CPU generator's draws are the same either way.
    """
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
