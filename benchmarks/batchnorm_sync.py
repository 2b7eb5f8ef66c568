"""How far 2 processes × batch B drift from 1 process × 2B on a BatchNorm model, with
BatchNorm statistics per process (`--sync-bn off`, the CPU's `auto`) and over the global
batch (`--sync-bn on`). JSON on stdout; the figure `cvl train`'s note quotes.

A synthetic stream like the tests' (3 tasks × 96 training pairs, disjoint shapes), the tiny
ResNet CLIP (`--model-config tiny`: BatchNorm in its image tower), SeqFT, one epoch per task
(6 optimizer steps of 16 pairs each), lr 5e-4, seed 0. Each 2-process run is a torchrun
launch on the CPU (gloo), one thread per process. Reported per mode, between the 2-process
run and the 1-process one: the difference of the first logged loss and the largest at any
step (and the 1-process run's mean loss, for scale), the largest difference of a final
trained weight (and how many entries differ by more than 1e-4), and of a BatchNorm running
statistic. For scale: 18 Adam steps at lr 5e-4 move a weight by at most ~0.009.

    python benchmarks/batchnorm_sync.py [--tasks 3] [--per-task 96] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(argv: list[str], processes: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if processes == 1:
        cmd = [sys.executable, "-m", "cvl", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        cmd += ["--master_port", str(_port()), "-m", "cvl", *argv]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")


def _logs(run: Path) -> list[dict]:
    from cvl.runs import finished_tasks

    out = []
    for t in finished_tasks(run):
        out += [json.loads(x) for x in (t.path / "train_log.jsonl").read_text().splitlines()]
    return out


def _compare(one: Path, two: Path) -> dict:
    from safetensors.torch import load_file

    from cvl.runs import finished_tasks

    l1, l2 = _logs(one), _logs(two)
    assert len(l1) == len(l2) > 0, (len(l1), len(l2))
    w1 = load_file(str(finished_tasks(one)[-1].model_path))
    w2 = load_file(str(finished_tasks(two)[-1].model_path))
    stats = [k for k in w1 if "running_" in k]  # BatchNorm running mean / variance
    params = [k for k in w1 if w1[k].is_floating_point() and k not in stats]
    dw = {k: float((w1[k] - w2[k]).abs().max()) for k in params}
    worst = max(dw, key=dw.get)
    return {
        "steps": len(l1),
        "first_loss_diff": abs(l1[0]["loss"] - l2[0]["loss"]),
        "max_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in zip(l1, l2)),
        "mean_loss": sum(a["loss"] for a in l1) / len(l1),
        "max_weight_diff": dw[worst],
        "max_weight_diff_at": worst,
        "weight_entries_over_1e-4": sum(int(((w1[k] - w2[k]).abs() > 1e-4).sum()) for k in params),
        "weight_entries": sum(w1[k].numel() for k in params),
        "max_running_stat_diff": max(float((w1[k] - w2[k]).abs().max()) for k in stats),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=3)
    ap.add_argument("--per-task", type=int, default=96)
    ap.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    work = Path(a.out or tempfile.mkdtemp(prefix="bnsync-"))
    stream = work / "stream"
    if not stream.exists():
        spec = SynthSpec(
            tasks=a.tasks,
            per_task=a.per_task,
            test_per_task=24,
            val_per_task=12,
            query_per_task=12,
            gallery_per_task=24,
            overlap=0,
            seed=0,
        )
        build_synthetic(stream, spec, progress=False)
    common = ["train", "--stream", str(stream), "--model-config", "tiny", "--epochs", "1"]
    common += ["--log-every", "1", "--checkpoint-every", "0", "--workers", "0", "--quiet"]
    common += ["--log-with", "none", "--device", "cpu"]
    t0 = time.time()
    _train([*common, "--batch-size", "16", "--out", str(work / "one")], 1)
    result: dict = {}
    for mode in ("off", "on"):
        two = work / f"two-{mode}"
        _train([*common, "--batch-size", "8", "--sync-bn", mode, "--out", str(two)], 2)
        result[f"sync_bn_{mode}"] = _compare(work / "one", two)
    result["setup"] = {
        "model_config": "tiny",
        "tasks": a.tasks,
        "pairs_per_task": a.per_task,
        "one_process_batch": 16,
        "two_process_batch": 8,
        "method": "seqft",
        "lr": 5e-4,
    }
    result["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(),
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
