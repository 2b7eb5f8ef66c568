"""Run a benchmark's worker on two processes of this machine (gloo on the CPU) and return what
rank 0 wrote: shared by the benchmarks that time a 2-process step (`bench_grad_reduce.py`,
`bench_fsdp.py`)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any


def run_two(worker: Callable[..., None], args: Any, cpu: bool = True) -> dict:
    """`worker(rank, port, args, out)` on 2 spawned processes; rank 0 writes JSON to `out`.
    `cpu`: the GPUs hidden (gloo on the CPU even on a GPU machine)."""
    import torch.multiprocessing as mp

    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(port, args, out), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f)
