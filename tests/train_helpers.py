"""Shared steps of the training tests: run a config, read its logs, interrupt and resume."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cvl.runs import finished_tasks
from cvl.train.config import resolve
from cvl.train.loop import Trainer

# one epoch of the tiny RN CLIP, batch 16, a log line per step, no mid-task checkpoints;
# deterministic on any device (the default device: CUDA where present), since tests compare
# runs bit for bit
FAST = dict(
    epochs=1,
    batch_size=16,
    log_with="none",
    checkpoint_every=0,
    model_config="tiny",
    log_every=1,
    workers=0,
    deterministic=True,
)


def train_run(stream: Path, out: Path, defaults: dict, **kw) -> None:
    """Train `defaults` overridden by `kw` from `stream` into `out` (no progress bars),
    deterministic unless they say otherwise (interrupted and whole runs are compared bitwise)."""
    over = {"deterministic": True, **defaults, **kw}
    cfg = resolve(None, {"stream": str(stream), "out": str(out), **over})
    Trainer(cfg, progress=False).run()


def metric(rec: dict, k: str) -> float:
    """A method metric from a log record (the loop prefixes metrics with `m/`)."""
    return rec[k] if k in rec else rec[f"m/{k}"]


def interrupt_then_resume(
    train: Callable[[Path], None],
    method_cls: type,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    task: int = 1,
    step: int = 3,
) -> dict:
    """`train(out)` stopped by a KeyboardInterrupt after optimizer step `step` of task `task`
    (the method's own `after_step` still runs first), then rerun to the end; returns the
    interrupted run's `last/position.json` (the mid-task checkpoint it resumed from)."""
    real = method_cls.after_step

    def boom(self, ctx):
        real(self, ctx)
        if ctx.task_index == task and ctx.step == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(method_cls, "after_step", boom)
    with pytest.raises(KeyboardInterrupt):
        train(out)
    pos = json.loads((out / "last" / "position.json").read_text())
    monkeypatch.setattr(method_cls, "after_step", real)
    train(out)
    return pos


def assert_same_task_weights(a: Path, b: Path) -> None:
    """Every finished task of runs `a` and `b` saved bit-identical weights."""
    ta, tb = finished_tasks(a), finished_tasks(b)
    assert [c.name for c in ta] == [c.name for c in tb]
    for ca, cb in zip(ta, tb):
        wa, wb = load_file(str(ca.model_path)), load_file(str(cb.model_path))
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), ca.name


def task_log(run: Path, index: int) -> list[dict]:
    """The per-step records of finished task `index` of a run."""
    path = finished_tasks(run)[index].path / "train_log.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]
