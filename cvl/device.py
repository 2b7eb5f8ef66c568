"""Where a command runs its model, and how reproducibly: one home for every model-running command.

`--device auto|cpu|cuda|cuda:N` (auto = the first CUDA device when torch sees one, else the
CPU) for a single process; under `accelerate launch` / `torchrun` (WORLD_SIZE > 1) the launcher
gives each process its device and `--device` can only force the CPU (gloo).

Determinism (`set_deterministic`): torch's deterministic algorithms, cuBLAS's fixed workspace
(the variable must be set before the first cuBLAS call, so commands set it before any model
reaches the GPU) and no cuDNN benchmarking. Free on the CPU; on a GPU it costs time (measured in
`../README.md`), so the default is per device (`deterministic_default`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import click
import torch

from cvl.errors import CvlError

DEVICE_HELP = (
    "Where the model runs: auto (CUDA when available, else CPU), cpu, cuda, cuda:N. Under "
    "accelerate launch / torchrun each process takes the launcher's device (cpu forces gloo)."
)
CUBLAS_WORKSPACE = ":4096:8"


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch device named by `spec`, checked against what this machine has (one line if not)."""
    s = (spec or "auto").strip().lower()
    if s == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if _cuda() else torch.device("cpu")
    if s == "cpu":
        return torch.device("cpu")
    if s == "cuda" or s.startswith("cuda:"):
        if not _cuda():
            raise CvlError(f"--device {spec}: torch sees no CUDA device on this machine")
        idx = s.partition(":")[2]
        if idx and not idx.isdigit():
            raise CvlError(f"--device {spec}: expected cuda:N with N a device index")
        i = int(idx) if idx else torch.cuda.current_device()
        n = torch.cuda.device_count()
        if i >= n:
            raise CvlError(f"--device {spec}: this machine has {n} CUDA device(s) (0..{n - 1})")
        return torch.device("cuda", i)
    raise CvlError(f"--device {spec}: expected auto, cpu, cuda or cuda:N")


def _cuda() -> bool:
    return torch.cuda.is_available()


def distributed_launch() -> bool:
    """True inside `accelerate launch` / `torchrun` with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def model_runner(spec: str = "auto") -> tuple[Any, torch.device]:
    """(Accelerator or None, device) for a command that runs a model outside training.

    One process: no Accelerator, the device `spec` names. Several processes: an Accelerator
    (each rank on the launcher's device; `--device cpu`, or a machine without CUDA, uses gloo).
    """
    if not distributed_launch():
        return None, resolve_device(spec)
    s = (spec or "auto").strip().lower()
    if s not in ("auto", "cpu", "cuda"):
        raise CvlError(
            f"--device {spec}: under a multi-process launch each process takes the launcher's "
            "device; use auto, cuda or cpu"
        )
    from accelerate import Accelerator

    acc = Accelerator(cpu=s == "cpu" or not _cuda())
    return acc, acc.device


def deterministic_default(device: torch.device | str) -> bool:
    """On where determinism is free (the CPU); off on GPUs, where it slows a step (README)."""
    return torch.device(device).type == "cpu"


def set_deterministic(on: bool) -> None:
    """Switch torch's deterministic mode for this process (call before the model reaches a GPU).

    On: deterministic algorithms (an op without one raises; see `nondeterministic_op`), the
    cuBLAS workspace fixed (`CUBLAS_WORKSPACE_CONFIG`, unless the user set it), cuDNN in its
    deterministic mode without benchmarking. Off: torch's defaults.
    """
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    if on:
        torch.backends.cudnn.benchmark = False


def nondeterministic_op(err: BaseException) -> str | None:
    """The op named by torch's "does not have a deterministic implementation" error, else None."""
    msg = str(err)
    marker = "does not have a deterministic implementation"
    if marker not in msg:
        return None
    return msg.split(marker, 1)[0].strip().rstrip(",").split("\n")[-1].strip() or "an op"


def apply_determinism(flag: bool | None, device: torch.device | str) -> bool:
    """Resolve `--deterministic/--no-deterministic` (None = the device's default), switch torch
    accordingly and return the mode in force (commands record it in their outputs)."""
    on = deterministic_default(device) if flag is None else bool(flag)
    set_deterministic(on)
    return on


def deterministic_option(f: Callable) -> Callable:
    """`--deterministic/--no-deterministic` for a model-running command (default per device)."""
    return click.option(
        "--deterministic/--no-deterministic",
        default=None,
        help="Bit-reproducible kernels (torch deterministic algorithms, fixed cuBLAS workspace, "
        "no cuDNN benchmarking). Default: on for the CPU (free), off on GPUs (slower steps).",
    )(f)


def device_option(f: Callable) -> Callable:
    """`--device` for a model-running command (see DEVICE_HELP)."""
    return click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)(f)


@contextlib.contextmanager
def determinism(flag: bool | None, device: torch.device | str) -> Iterator[bool]:
    """`apply_determinism` for the length of a command, yielding the mode in force; torch's
    previous mode is put back afterwards, so a caller in the same process (a test, a notebook
    calling `cvl.cli.main`) does not inherit it."""
    import torch

    prev = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    try:
        yield apply_determinism(flag, device)
    finally:
        torch.use_deterministic_algorithms(prev[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev[1], prev[2]
