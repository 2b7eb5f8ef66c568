"""Distributed equivalence for every registered method: 2 gloo processes × batch B train
like 1 process × batch 2B (per-step losses of every term within 1e-5, final weights within
1e-5), on a run where task 2's old-model, buffer and distillation terms are active.

All methods share ONE torchrun launch (tests/dist_many.py): each rank imports torch and
open_clip once; the 1 × 2B runs happen in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reliability_helpers import build_tiny_stream, cli, env, train_argv, trained_methods
from safetensors.torch import load_file

from cvl.runs import finished_tasks

HERE = Path(__file__).resolve().parent
# Per-method tolerance where a temperature amplifies float reassociation (none needed yet).
TOL: dict[str, float] = {}


def _argv(stream: Path, out: Path, method: str, batch: int) -> list[str]:
    a = train_argv(stream, out, method)
    for opt, val in (
        ("--batch-size", str(batch)),
        ("--model-config", "tiny-vit"),  # no BatchNorm (per-process statistics on CPU)
        ("--max-steps-per-task", "2"),
        ("--checkpoint-every", "0"),
    ):
        a[a.index(opt) + 1] = val
    return a


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    stream = build_tiny_stream(root / "s")
    methods = trained_methods()
    cmds = {m: _argv(stream, root / "two" / m, m, 8) for m in methods}
    (root / "cmds.json").write_text(json.dumps(cmds))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            str(HERE / "dist_many.py"),
            str(root / "cmds.json"),
            str(root / "results.json"),
        ],
        env={**env(), "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])},
        capture_output=True,
        text=True,
        timeout=int(os.environ.get("CVL_DIST_TIMEOUT", "900")),
    )
    results = json.loads((root / "results.json").read_text()) if r.returncode == 0 else {}
    return stream, root, results, r.stderr[-3000:]


def _log(run: Path) -> list[dict]:
    out = []
    for c in finished_tasks(run):
        out += [json.loads(x) for x in (c.path / "train_log.jsonl").read_text().splitlines()]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", trained_methods())
def test_two_processes_equal_one_with_double_batch(method, dist_runs):
    stream, root, results, err = dist_runs
    assert results.get(method) == 0, f"torchrun run of {method}: {results.get(method)} {err}"
    cli(_argv(stream, root / "one" / method, method, 16))
    l1, l2 = _log(root / "one" / method), _log(root / "two" / method)
    tol = TOL.get(method, 1e-5)
    assert len(l1) == len(l2) > 0
    assert any(r["task_index"] == 1 for r in l1)  # task 2's steps are compared
    skip = {"samples_per_s", "grad_norm"}
    for a, b in zip(l1, l2):
        keys = {k for k, v in a.items() if isinstance(v, float) and k not in skip}
        assert keys == {k for k, v in b.items() if isinstance(v, float) and k not in skip}
        for k in keys:
            assert abs(a[k] - b[k]) <= tol, (method, k, a, b)
    w1 = load_file(str(finished_tasks(root / "one" / method)[-1].model_path))
    w2 = load_file(str(finished_tasks(root / "two" / method)[-1].model_path))
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=tol), (method, k)
