"""The documented multi-node launch (docs/scaling.md, "Several GPUs, several nodes"), run as two "nodes"
on one machine: two `torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d
--rdzv_endpoint 127.0.0.1:PORT` launches, one process each (gloo, the CPU: both "nodes" would
otherwise take GPU 0). The run must train exactly as one node with two processes, its files
must be written once (by the global rank 0, whichever launch holds it), and it must resume
after one node is killed (every process of that launch SIGKILLed mid-run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from device_helpers import dist_env
from reliability_helpers import assert_same_run, build_tiny_stream, train_argv

TIMEOUT = int(os.environ.get("CVL_DIST_TIMEOUT", "600"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(stream: Path, out: Path) -> list[str]:
    """`cvl train` args: tiny ViT (no BatchNorm), 2 epochs of 4 steps per task, a checkpoint
    every step, batch 4 per process (global 8, as the reliability tests' single process)."""
    a = train_argv(stream, out, "seqft")
    for opt, val in (("--model-config", "tiny-vit"), ("--batch-size", "4"), ("--epochs", "2")):
        a[a.index(opt) + 1] = val
    i = a.index("--max-steps-per-task")
    del a[i : i + 2]
    return [*a, "--workers", "0"]


def _node(rank: int, port: int, rdzv: str, args: list[str], log: Path) -> subprocess.Popen:
    """One "node": the documented torchrun line (docs/scaling.md) with a local c10d rendezvous."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1"),
        *("--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", rdzv),
        *("--max_restarts", "0", "-m", "cvl", *args),
    ]
    env = {**dist_env(2), "CUDA_VISIBLE_DEVICES": ""}
    f = open(log, "w")  # noqa: SIM115 (closed with the process, below)
    p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    p.log = f  # type: ignore[attr-defined]
    return p


def _wait(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[int]:
    t0 = time.monotonic()
    for p in procs:
        try:
            p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            _kill_node(p)
        p.log.close()  # type: ignore[attr-defined]
    return [p.returncode for p in procs]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own, so
    killing its process group would not reach them)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_node(p: subprocess.Popen) -> None:
    """SIGKILL a launch and every process it started: the node dies."""
    for pid in [*_descendants(p.pid), p.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def _two_nodes(args: list[str], tmp: Path, tag: str) -> list[subprocess.Popen]:
    port, rdzv = _free_port(), f"cvl-test-{tag}-{os.getpid()}"
    return [_node(r, port, rdzv, args, tmp / f"{tag}-node{r}.log") for r in (0, 1)]


@pytest.mark.matrix  # ~90 s: make matrix
def test_two_nodes_train_as_one_node_of_two_processes_and_resume_after_a_node_dies(tmp_path):
    stream = build_tiny_stream(tmp_path / "s")
    # one node, two processes: the reference
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *("--nproc_per_node", "2", "--master_port", str(_free_port())),
            *("-m", "cvl", *_train(stream, tmp_path / "one")),
        ],
        env={**dist_env(2), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert one.returncode == 0, one.stderr[-3000:]

    # two nodes of one process; node 1 dies in the middle of task 1 (t1)
    out = tmp_path / "two"
    args = _train(stream, out)
    nodes = _two_nodes(args, tmp_path, "first")
    pos = out / "last" / "position.json"
    t0 = time.monotonic()
    while True:
        try:
            if json.loads(pos.read_text())["task_index"] == 1:
                break
        except (OSError, ValueError, KeyError):
            pass
        assert all(n.poll() is None for n in nodes), "the run ended before the kill"
        assert time.monotonic() - t0 < TIMEOUT, "task 1 never started"
        time.sleep(0.005)
    _kill_node(nodes[1])
    (rc0,) = _wait(nodes[:1], timeout=180)  # node 0 loses its peer: it must stop, not hang
    nodes[1].log.close()  # type: ignore[attr-defined]
    said = (tmp_path / "first-node0.log").read_text()
    assert rc0 > 0, said[-2000:]  # ended by itself (not killed at the timeout)
    assert "error: another process of this run stopped" in said
    assert "rerun the same command on each to resume" in said
    assert not (out / "tasks" / "02-t2").exists()

    # both nodes again: the run resumes and ends as the one-node run did
    nodes = _two_nodes(args, tmp_path, "again")
    rcs = _wait(nodes)
    logs = [(tmp_path / f"again-node{r}.log").read_text() for r in (0, 1)]
    assert rcs == [0, 0], "\n".join(x[-2000:] for x in logs)
    assert "resuming" in "".join(logs)
    assert assert_same_run(tmp_path / "one", out) == 3  # weights, state, task.json, losses
    # written once: one log line per step (no second writer appended), one 'saved' per task
    for t in ("01-t1", "02-t2"):
        lines = (out / "tasks" / t / "train_log.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(1, 9))
    said = "".join(logs)
    assert [said.count(f"task {i}/3 t{i - 1}: saved") for i in (2, 3)] == [1, 1]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir()
    )
