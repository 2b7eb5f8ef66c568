"""`LogWindow`: the loss terms, metrics and counts of the optimizer steps since the trainer's
last log line, kept on the device as they are (no kernel, no host read per step) and read
with one all_reduce when a line is written: the line's means, and each step's loss terms,
which is where the loop finds a non-finite step (`cvl.train.guards`).

Kept apart from the training loop (loop.py), which only feeds it each micro-batch and step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cvl.dist import world_size
from cvl.errors import CvlError


@dataclass
class StepRecord:
    """One optimizer step of the window: its micro-batches' terms and metrics (device
    tensors or numbers, detached), its grad norm, and what a message about it needs."""

    step: int  # the task's step number (1-based)
    lr: float
    ids: list = field(default_factory=list)  # this rank's sample ids (first micro-batch)
    terms: list[dict[str, Any]] = field(default_factory=list)  # one dict per micro-batch
    metrics: list[dict[str, Any]] = field(default_factory=list)
    grad_norm: Any = None


class LogWindow:
    """Loss terms, metrics and counts of the optimizer steps since the last log line.

    A step's values stay on the device as the step made them; `reduce()` stacks them, sums
    them over the ranks with one all_reduce and averages them over the window's steps on the
    host, when a line is written.
    """

    def __init__(self, device: torch.device, grad_accum: int = 1) -> None:
        self.device = device
        self.grad_accum = grad_accum
        self.current: StepRecord | None = None
        self.lr = 0.0
        self._reset()

    def _reset(self) -> None:
        self.records: list[StepRecord] = []
        self.samples, self.replaced, self.t0 = 0, 0, time.perf_counter()
        self.skipped = 0  # optimizer steps skipped for a non-finite loss
        self.skipped_terms: dict[str, float] = {}  # the last skipped step's terms (NaN/Inf)

    @property
    def steps(self) -> int:
        """Optimizer steps of the window that updated (skipped ones are not counted)."""
        return len(self.records)

    def begin_step(self, step: int, lr: float, ids: Any) -> None:
        """Open the record of the task's step `step` (1-based): its lr and sample ids."""
        self.current = StepRecord(step, lr, list(ids) if ids is not None else [])
        self.lr = lr  # the line's lr: its last step's

    def add_micro(self, terms: dict[str, Any], metrics: dict[str, Any], batch: dict) -> None:
        """One micro-batch's terms and metrics (kept detached; weight 1/grad_accum each)."""
        rec = self.current
        rec.terms.append({k: v.detach() if torch.is_tensor(v) else v for k, v in terms.items()})
        rec.metrics.append({k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()})
        self.samples += batch["image"].shape[0]
        self.replaced += batch["n_replaced"]

    def add_step(self, grad_norm: torch.Tensor | None) -> None:
        """Close the current step (it updated the weights)."""
        self.current.grad_norm = grad_norm
        self.records.append(self.current)
        self.current = None

    def skip_step(self, terms: dict[str, float]) -> None:
        """Close the current step as skipped (non-finite; `terms`: its values, read)."""
        self.skipped += 1
        self.skipped_terms = dict(terms)
        self.current = None

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def _values(self) -> tuple[list[Any], list[tuple[int, str, str]]]:
        """Every value of the window, in an order all ranks share, and (record, kind, key)."""
        vals: list[Any] = []
        where: list[tuple[int, str, str]] = []
        for i, r in enumerate(self.records):
            for kind, dicts in (("t", r.terms), ("m", r.metrics)):
                for d in dicts:
                    for k in sorted(d):
                        vals.append(d[k])
                        where.append((i, kind, k))
            if r.grad_norm is not None:
                vals.append(r.grad_norm)
                where.append((i, "g", "grad_norm"))
        return vals, where

    def reduce(self) -> tuple[dict[str, float], list[tuple[StepRecord, dict[str, float]]]]:
        """(means, steps): step means of the window's terms (`t:NAME`), metrics (`m:NAME`,
        over the steps that set them) and `grad_norm`, rank means; `samples` and `replaced`
        are totals over ranks; `steps` pairs each step's record with its loss terms (rank
        means, summed over its micro-batches) and its grad norm when clipping computed one. One host read (and one all_reduce with several
        processes). Resets the window."""
        vals, where = self._values()
        dev = self.device
        parts = [
            v.to(dev, torch.float32).reshape(1)
            if torch.is_tensor(v)
            else torch.tensor([float(v)], device=dev)
            for v in vals
        ]
        parts.append(torch.tensor([float(self.samples), float(self.replaced)], device=dev))
        vec = torch.cat(parts)
        w = world_size()
        if w > 1:
            torch.distributed.all_reduce(vec)
        host = vec.tolist()
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        per_step: list[dict[str, float]] = [{} for _ in self.records]
        for (i, kind, k), v in zip(where, host):
            v = v / w
            if kind == "g":  # (--grad-clip) a non-finite gradient is found like a loss
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + v
                per_step[i]["grad_norm"] = v
                continue
            v = v / self.grad_accum if self.grad_accum > 1 else v
            key = f"{kind}:{k}"
            sums[key] = sums.get(key, 0.0) + v
            if kind == "t":
                per_step[i][k] = per_step[i].get(k, 0.0) + v
            else:
                counts[key] = counts.get(key, 0.0) + 1 / self.grad_accum
        out = {k: v / max(counts.get(k, len(self.records)), 1e-9) for k, v in sums.items()}
        out["samples"], out["replaced"] = host[-2], host[-1]
        steps = list(zip(self.records, per_step))
        self._reset()
        return out, steps


def first_nonfinite(
    steps: list[tuple[StepRecord, dict[str, float]]],
) -> tuple[StepRecord, dict[str, float]] | None:
    """The first step of a reduced window whose loss terms (or grad norm) are not all
    finite, or None."""
    for rec, terms in steps:
        if not all(math.isfinite(v) for v in terms.values()):
            return rec, terms
    return None


def log_record(
    vals: dict[str, float],
    n: int,
    skipped: int,
    bad_terms: dict[str, float],
    lr: float,
    dt: float,
    ctx: Any,
    epoch: int,
    mixture: dict[str, int] | None,
) -> dict[str, Any]:
    """A log line from a window's reduced values (`LogWindow.reduce`): the task and step, the
    mean loss terms (a line of skipped steps only: the values that failed), the rate and
    counts, metrics, the gradient norm, and the --mixture sizes."""
    terms = {k[2:]: v for k, v in vals.items() if k.startswith("t:")}
    if n == 0 and skipped:
        terms = bad_terms
    rec = {
        "task": ctx.task_name,
        "task_index": ctx.task_index,
        "epoch": epoch,
        "step": ctx.step,
        "global_step": ctx.global_step,
        "steps": n,
        "lr": lr,
        "loss": sum(terms.values()),
        **terms,
        "samples_per_s": vals["samples"] / max(dt, 1e-9),
        "replaced_samples": int(vals["replaced"]),
    }
    rec.update({f"m/{k[2:]}": v for k, v in vals.items() if k.startswith("m:")})
    if "grad_norm" in vals:
        rec["grad_norm"] = vals["grad_norm"]
    if skipped:
        rec["nonfinite_skipped"] = skipped
    if mixture:  # --mixture: items per global batch from each source
        rec["mixture"] = mixture
    return rec


def trackers(log_with: str) -> list[str] | None:
    """Accelerate's trackers for --log-with (auto: tensorboard where installed); one named
    but not installed is one line (Accelerate would only warn and log nothing)."""
    from importlib.util import find_spec

    if log_with == "none":
        return None
    if log_with == "auto":
        return ["tensorboard"] if find_spec("tensorboard") else None
    if not find_spec(log_with):
        raise CvlError(
            f"--log-with {log_with}: the {log_with} package is not installed (pip install "
            f"{log_with}); or use --log-with none"
        )
    return [log_with]
