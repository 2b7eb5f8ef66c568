"""2 processes × batch B (torchrun, gloo, CPU) train exactly like 1 process × batch 2B."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cvl.runs import finished_tasks

# tiny-vit: no BatchNorm (per-process BN statistics on CPU would differ from one process's).
ARGS = [
    "--model-config",
    "tiny-vit",
    "--epochs",
    "1",
    "--max-steps-per-task",
    "3",
    "--log-with",
    "none",
    "--quiet",
    "--checkpoint-every",
    "0",
    "--log-every",
    "1",
    "--workers",
    "0",
]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run):
    out = []
    for c in finished_tasks(run):
        out += [json.loads(x) for x in (c.path / "train_log.jsonl").read_text().splitlines()]
    return out


def run_pair(stream, tmp_path, extra: list[str]) -> tuple[list, list, dict, dict]:
    """Train the same config with torchrun ×2 (batch 8 each) and 1 process (batch 16)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CVL_TEST_THREADS": "1"}
    common = ["train", "--stream", str(stream), *ARGS, *extra]
    two = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        "-m",
        "cvl",
        *common,
        "--batch-size",
        "8",
        "--out",
        str(tmp_path / "two"),
    ]
    one = [
        sys.executable,
        "-m",
        "cvl",
        *common,
        "--batch-size",
        "16",
        "--out",
        str(tmp_path / "one"),
    ]
    for cmd in (two, one):
        r = subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            text=True,
            timeout=int(os.environ.get("CVL_DIST_TIMEOUT", "600")),
        )
        assert r.returncode == 0, r.stderr[-3000:]
    w1 = load_file(str(finished_tasks(tmp_path / "one")[-1].model_path))
    w2 = load_file(str(finished_tasks(tmp_path / "two")[-1].model_path))
    return _losses(tmp_path / "one"), _losses(tmp_path / "two"), w1, w2


def assert_equivalent(l1, l2, w1, w2, keys=("loss",)):
    assert len(l1) == len(l2) > 0
    for a, b in zip(l1, l2):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-5, (k, a, b)
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-5), k


@pytest.mark.slow
def test_two_processes_equal_one_with_double_batch(synth_stream, tmp_path):
    l1, l2, w1, w2 = run_pair(
        synth_stream,
        tmp_path,
        # loader workers on, and log lines averaging 2 steps reduced across the 2 ranks
        ["--method", "seqft", "--buffer", "reservoir", "--buffer-size", "16"]
        + ["--workers", "1", "--log-every", "2"],
    )
    assert_equivalent(l1, l2, w1, w2, keys=("loss", "itc"))
