"""`LogWindow`: the loss terms, metrics and counts of the optimizer steps since the trainer's
last log line, summed on the device (no host sync per step) and averaged over the window's
steps and the ranks with one all_reduce when a line is written.

Kept apart from the training loop (loop.py), which only feeds it each micro-batch and step.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cvl.dist import world_size


class LogWindow:
    """Loss terms, metrics and counts of the optimizer steps since the last log line.

    Sums stay on the device (no host sync per step); `reduce()` averages them over the
    window's steps and the ranks with one all_reduce, when a line is written.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, float] = {}  # metrics: steps (micro-batches / grad_accum) set
        self.steps, self.samples, self.replaced, self.t0 = 0, 0, 0, time.perf_counter()
        self.skipped = 0  # optimizer steps skipped for a non-finite loss
        self.skipped_terms: dict[str, float] = {}  # the last skipped step's terms (NaN/Inf)

    def _add(self, key: str, v: Any, weight: float) -> None:
        v = torch.as_tensor(v).detach().to(self.device, torch.float32) * weight
        self.sums[key] = self.sums[key] + v if key in self.sums else v

    def add_micro(
        self, terms: dict[str, Any], metrics: dict[str, Any], grad_accum: int, batch: dict
    ) -> None:
        """One micro-batch: terms and metrics enter with weight 1/grad_accum."""
        for k, v in terms.items():
            self._add("t:" + k, v, 1 / grad_accum)
        for k, v in metrics.items():
            self._add("m:" + k, v, 1 / grad_accum)
            self.counts["m:" + k] = self.counts.get("m:" + k, 0.0) + 1 / grad_accum
        self.samples += batch["image"].shape[0]
        self.replaced += batch["n_replaced"]

    def add_step(self, grad_norm: torch.Tensor | None) -> None:
        self.steps += 1
        if grad_norm is not None:
            self._add("grad_norm", grad_norm, 1.0)

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def reduce(self) -> dict[str, float]:
        """Step means of the window (metrics: over the steps that set them), rank means;
        `samples` and `replaced` are totals over ranks. Resets the window."""
        keys = sorted(self.sums)
        vec = torch.stack(
            [self.sums[k] for k in keys]
            + [torch.tensor(float(x), device=self.device) for x in (self.samples, self.replaced)]
        )
        w = world_size()
        if w > 1:
            torch.distributed.all_reduce(vec)
        vals = vec.tolist()
        out = {}
        for k, v in zip(keys, vals):
            n = self.counts[k] if k.startswith("m:") else self.steps
            out[k] = v / w / max(n, 1e-9)
        out["samples"], out["replaced"] = vals[-2], vals[-1]
        self._reset()
        return out
