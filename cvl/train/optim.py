"""The training optimizer with its learning-rate schedule (`cvl.train.schedules`) and the
per-step seeding of torch's generators (shared by the loop, the budget's probe step and
AFEC's expanded model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cvl.errors import CvlError
from cvl.train.schedules import cosine_schedule


def task_lr(cfg: Any, task: str | None) -> float:
    """The peak learning rate of `task`: its `task_lr` entry (the ZSCL scripts give Aircraft
    and MNIST 5e-5, the others 1e-5), else `lr`."""
    per = getattr(cfg, "task_lr", None) or {}
    return float(per.get(task, cfg.lr)) if task is not None else float(cfg.lr)


def adamw_impl(cfg: Any, device: torch.device) -> str:
    """Which AdamW implementation trains on `device`: "fused" (`--fused-adamw`; by default on
    CUDA, torch's recommendation there: one kernel per update) or "default" (torch's choice
    without it: for-each on a GPU, for-loop on the CPU, which keeps CPU runs bit-identical to
    earlier cvl versions); "lamb" for LAMB. fp16 keeps the default: its loss scaler would
    skip an overflowed step inside the fused kernel, where the loop cannot see it (and must
    not run the method's `after_step`)."""
    if getattr(cfg, "optimizer", "adamw") == "lamb":
        return "lamb"
    choice = getattr(cfg, "fused_adamw", None)
    if choice is None:
        choice = device.type == "cuda" and getattr(cfg, "precision", "no") != "fp16"
    fused = bool(choice)
    return "fused" if fused else "default"


def optimizer_with_schedule(
    params: list,
    cfg: Any,
    steps: int,
    lr_lambda: Callable[[int], float] | None = None,
    task: str | None = None,
):
    """The training optimizer + its learning-rate schedule: AdamW, or (`optimizer: lamb`)
    LAMB (You et al. 2020; timm's, with no clipping of its own: `grad_clip` does that), no
    weight decay on gains, biases and scales (LAMB's trust ratio only where weights decay, as
    NVLAMB); AdamW fused where `adamw_impl` says so. The peak rate is `task_lr(cfg, task)`;
    `lr_lambda`: its multiplier at each step of the task (`cvl.train.schedules.lr_multiplier`);
    default: warm-up + cosine over `steps`."""
    lr = task_lr(cfg, task)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (cfg.beta1, cfg.beta2)
    try:  # the config's rules (cvl.train.config.LIMITS) check these first; this is the backstop
        if getattr(cfg, "optimizer", "adamw") == "lamb":
            from timm.optim import Lamb

            opt = Lamb(groups, lr=lr, betas=betas, eps=cfg.eps, max_grad_norm=None)
        else:
            dev = params[0].device if params else torch.device("cpu")
            fused = True if adamw_impl(cfg, dev) == "fused" else None
            opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps, fused=fused)
    except ValueError as e:
        raise CvlError(
            f"the optimizer refuses the settings ({e}): check --lr, --weight-decay and the "
            "--config values beta1, beta2, eps"
        ) from None
    if lr_lambda is None:
        lr_lambda = cosine_schedule(steps, cfg.warmup, lr, cfg.min_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
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
