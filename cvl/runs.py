"""Run folder layout, shared by train, eval, analyze and export.

runs/RUN/
  run.json                      {"schema": "cvl.run/1", "config": {...resolved config...},
                                 "model": model.config(), "stream": {path, name, task_order,
                                 fingerprint}, "versions": {...}, "processes": N,
                                 "runtime": {device, deterministic, deterministic_source,
                                 optimizer_impl, batchnorm_statistics (--sync-bn)},
                                 "earlier_runtimes": [earlier sessions' runtimes that differ],
                                 "cost": totals over the finished tasks (cvl.train.cost)}
  tasks/NN-<task>/model.safetensors      weights after task NN (safetensors, no pickle)
  tasks/NN-<task>/method_state.safetensors (+ method_state.json)
  tasks/NN-<task>/train_log.jsonl
  tasks/NN-<task>/task.json     steps, items, faults, selection, "cost" (FLOPs, memory, time,
                                samples: cvl.train.cost), "budget" (--budget: cvl.train.budget)
  last/                         mid-task checkpoint for resume
  eval/  analysis/              written by `cvl eval` / `cvl analyze`
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cvl.errors import CvlError
from cvl.io import read_json

RUN_SCHEMA = "cvl.run/1"
RUN_JSON = "run.json"
MODEL_FILE = "model.safetensors"


@dataclass(frozen=True)
class TaskCheckpoint:
    """A finished task's folder: its position in the order, task name and path."""

    index: int
    name: str
    path: Path

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE


def task_dir(run: str | os.PathLike, index: int, name: str) -> Path:
    return Path(run) / "tasks" / f"{index:02d}-{name}"


def load_run(run: str | os.PathLike) -> dict[str, Any]:
    """The parsed run.json of a run folder (clear error if it is not one)."""
    p = Path(run)
    if not (p / RUN_JSON).is_file():
        raise CvlError(f"{p}: not a run folder (no {RUN_JSON}); create one with `cvl train`")
    d = read_json(p / RUN_JSON)
    if d.get("schema") != RUN_SCHEMA:
        raise CvlError(
            f"{p / RUN_JSON}: unsupported schema {d.get('schema')!r} (expected {RUN_SCHEMA})"
        )
    return d


def finished_tasks(run: str | os.PathLike) -> list[TaskCheckpoint]:
    """Finished tasks in training order (those whose model file exists)."""
    root = Path(run) / "tasks"
    out = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            idx, _, name = d.name.partition("-")
            if d.is_dir() and idx.isdigit() and (d / MODEL_FILE).is_file():
                out.append(TaskCheckpoint(int(idx), name, d))
    return out


def find_task(run: str | os.PathLike, task: str | int | None = None) -> TaskCheckpoint:
    """A finished task by name or index; None = the last finished task."""
    done = finished_tasks(run)
    if not done:
        raise CvlError(f"{run}: no finished task checkpoint yet")
    if task is None:
        return done[-1]
    for c in done:
        if str(task) in (c.name, str(c.index), f"{c.index:02d}-{c.name}"):
            return c
    raise CvlError(f"{run}: no finished task '{task}' (have: {', '.join(c.name for c in done)})")


def load_task_model(run: str | os.PathLike, task: str | int | None = None):  # -> VLModel
    """Rebuild the run's model and load the weights saved after `task` (default: last)."""
    from cvl.models import load_weights, model_from_config

    d = load_run(run)
    ck = find_task(run, task)
    model = model_from_config(d["model"])
    load_weights(model, ck.model_path)
    model.eval()
    return model, ck


def init_weights_file(path: str | os.PathLike) -> Path:
    """The weights `--init-run` starts from: a run's last finished task, or a task folder."""
    p = Path(path)
    if (p / MODEL_FILE).is_file() and not (p / RUN_JSON).is_file():
        return p / MODEL_FILE  # a task folder (RUN/tasks/NN-name)
    load_run(p)  # clear error if it is not a run folder
    return find_task(p).model_path
