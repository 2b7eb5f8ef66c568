"""Devices in the tests: a `cpu` / `cuda` parametrisation and the environment of multi-process
tests, so the suite passes on a CPU-only machine and on a GPU machine alike.

- `DEVICES`: parametrise a test over the CPU (always) and CUDA (marked `gpu`: the conftest
  hook skips it where torch sees no CUDA device).
- `dist_env(n)` / `spawn_env(n)`: processes started by a test get one GPU each when the machine
  has at least `n`, otherwise none (CUDA_VISIBLE_DEVICES=""), so they take the gloo/CPU path
  instead of several ranks landing on one GPU (NCCL refuses a shared device); `start_method()`:
  how torch.multiprocessing starts them (forked while this process has not started CUDA);
  `shared_device(n)`: the `--device` that puts the single-process run it is compared with on
  the same kind of device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def gpus() -> int:
    """CUDA devices torch sees here (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def shared_device(nproc: int) -> str:
    """`--device` for every run of a test comparing `nproc` processes with one: `cuda` (one GPU
    per process) when the machine has enough GPUs, else `cpu` (gloo), for both sides."""
    return "cuda" if gpus() >= nproc else "cpu"


def process_env(nproc: int) -> dict[str, str]:
    """The variables a test sets for `nproc` processes it launches: one thread each, and no
    visible GPU when there are fewer GPUs than processes."""
    env = {"OMP_NUM_THREADS": "1", "CVL_TEST_THREADS": "1"}
    if gpus() < nproc:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def dist_env(nproc: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The full environment for a subprocess that launches `nproc` processes (torchrun,
    accelerate launch): `base` (default: this process's) plus `process_env(nproc)`."""
    return {**(os.environ if base is None else base), **process_env(nproc)}


def start_method() -> str:
    """`start_method` for torch.multiprocessing in a test: "fork" (the children inherit the
    imports of torch, open_clip and cvl: ~10 s of CPU less each than a fresh interpreter) unless
    this process has started CUDA, which a forked child can neither use nor start again:
    "spawn" then (and where the platform has no fork)."""
    import multiprocessing

    if "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


@contextlib.contextmanager
def spawn_env(nproc: int) -> Iterator[None]:
    """`process_env(nproc)` in os.environ while a test starts processes that inherit it
    (torch.multiprocessing.spawn), restored afterwards."""
    saved = {k: os.environ.get(k) for k in process_env(nproc)}
    os.environ.update(process_env(nproc))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
