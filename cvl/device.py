"""Where a command runs its model, and how reproducibly: one home for every model-running command.

`--device auto|cpu|cuda|cuda:N` (auto = the first CUDA device when torch sees one, else the
CPU) for a single process; under `accelerate launch` / `torchrun` (WORLD_SIZE > 1) the launcher
gives each process its device and `--device` can only force the CPU (gloo).

Determinism (`set_deterministic`): torch's deterministic algorithms, cuBLAS's fixed workspace
(the variable must be set before the first cuBLAS call, so commands set it before any model
reaches the GPU) and no cuDNN benchmarking. About free on the CPU; on a GPU it costs time
(measured in `docs/reproducibility.md`, profiled by `benchmarks/bench_determinism.py`), so the default is
per device (`deterministic_default`). Under several processes on CUDA each process of a node
needs a GPU of its own (`check_processes_per_gpu`); `accelerator()` builds the Accelerate
object of a command on the chosen device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from cvl.errors import CvlError

if TYPE_CHECKING:  # torch is imported where it is used: `cvl --help` stays fast
    import torch


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """float32 in full float32 inside the block: no TF32 on GPUs, neither in matmuls nor in
    cuDNN's convolutions (on by default in torch: a ViT's patch embedding would otherwise run
    in TF32, ~1e-3 relative error, enough to reorder an evaluation's near-tied scores). The
    previous settings are restored afterwards; on the CPU this changes nothing."""
    import torch

    prev = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev[0])
        torch.backends.cudnn.allow_tf32 = prev[1]


DEVICE_HELP = (
    "Where the model runs: auto (CUDA when available, else CPU), cpu, cuda, cuda:N. Under "
    "accelerate launch / torchrun each process takes the launcher's device (cpu forces gloo)."
)
CUBLAS_WORKSPACE = ":4096:8"


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch device named by `spec`, checked against what this machine has (one line if not)."""
    import torch

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
    import torch

    return torch.cuda.is_available()


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; a CPU tensor bound for a GPU goes through pinned memory, non-blocking.

    A plain `.to("cuda")` of ordinary (pageable) host memory makes the host wait until the
    GPU has finished its queue: a host sync inside a training step. Tensors built on the CPU
    during a step (replay masks, stored targets, draws from a CPU generator) use this instead.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def distributed_launch() -> bool:
    """True inside `accelerate launch` / `torchrun` with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_processes_per_gpu(spec: str = "auto") -> None:
    """Under a multi-process launch on CUDA, each process of a node needs a GPU of its own.

    Otherwise two ranks share a device and NCCL refuses ("Duplicate GPU detected"); say what
    to do instead, before any process group exists.
    """
    import torch

    s = (spec or "auto").strip().lower()
    if not distributed_launch() or s == "cpu" or not _cuda():
        return
    # processes on this node: torchrun / accelerate say it; other launchers give the local rank
    if "LOCAL_WORLD_SIZE" in os.environ:
        local = int(os.environ["LOCAL_WORLD_SIZE"])
    elif "LOCAL_RANK" in os.environ:
        local = int(os.environ["LOCAL_RANK"]) + 1
    else:
        return
    n = torch.cuda.device_count()
    if local > n:
        raise CvlError(
            f"this node launches {local} processes but has {n} GPU(s): launch at most {n} "
            "(torchrun --nproc_per_node / accelerate --num_processes), or add --device cpu "
            "to run every process on the CPU (gloo)"
        )


def launch_device(spec: str = "auto") -> torch.device:
    """The device this process will run on, known before any Accelerator or CUDA context exists
    (for the determinism default and the records): `resolve_device` for one process; under a
    multi-process launch the CPU (`--device cpu`, or no CUDA) or this rank's GPU (LOCAL_RANK)."""
    import torch

    if not distributed_launch():
        return resolve_device(spec)
    s = (spec or "auto").strip().lower()
    if s not in ("auto", "cpu", "cuda"):
        raise CvlError(
            f"--device {spec}: under a multi-process launch each process takes the launcher's "
            "device; use auto, cuda or cpu"
        )
    if s == "cpu" or not _cuda():
        if s == "cuda":
            raise CvlError(f"--device {spec}: torch sees no CUDA device on this machine")
        return torch.device("cpu")
    check_processes_per_gpu(s)
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def accelerator(spec: str = "auto", **kwargs: Any) -> Any:
    """An Accelerate `Accelerator` on the device `spec` names (kwargs: mixed_precision, ...).

    One process: a fresh Accelerator each call (Accelerate keeps its state per process and would
    otherwise keep the first call's device and precision), on the CPU or the named GPU.
    Several processes: the launcher's device per rank, or gloo on the CPU (`--device cpu`, or
    no CUDA); more processes than GPUs on a node is a one-line error.
    """
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    dev = launch_device(spec)
    if not distributed_launch():
        AcceleratorState._reset_state(reset_partial_state=True)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            with _env("ACCELERATE_TORCH_DEVICE", str(dev)):
                return Accelerator(**kwargs)
    return Accelerator(cpu=dev.type == "cpu", **kwargs)


def drop_optimizers(acc: Any) -> None:
    """Make `acc` forget the optimizers it prepared (and its step count), as
    `Accelerator.free_memory()` does, without that method's full `gc.collect()`: ~0.4 s per
    call in a process holding torch and open_clip, paid by the trainer at every task. An
    optimizer and its LR schedule hold no reference cycle, so reference counting frees it and
    its moments once the caller drops its own references (tests/test_train.py checks)."""
    acc._optimizers.clear()  # Accelerate's list: no public way to empty it without collecting
    acc.step = 0


@contextlib.contextmanager
def _env(key: str, value: str) -> Iterator[None]:
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def model_runner(spec: str = "auto") -> tuple[Any, torch.device]:
    """(Accelerator or None, device) for a command that runs a model outside training.

    One process: no Accelerator, the device `spec` names. Several processes: an Accelerator
    (each rank on the launcher's device; `--device cpu`, or a machine without CUDA, uses gloo).
    """
    if not distributed_launch():
        return None, resolve_device(spec)
    from accelerate import Accelerator

    acc = Accelerator(cpu=launch_device(spec).type == "cpu")
    return acc, acc.device


def deterministic_default(device: torch.device | str) -> bool:
    """On where determinism is free (the CPU); off on GPUs, where it slows a step (docs/reproducibility.md)."""
    import torch

    return torch.device(device).type == "cpu"


def set_deterministic(on: bool) -> None:
    """Switch torch's deterministic mode for this process (call before the model reaches a GPU).

    On: deterministic algorithms (an op without one raises; see `nondeterministic_op`), the
    cuBLAS workspace fixed (`CUBLAS_WORKSPACE_CONFIG`, unless the user set it), cuDNN in its
    deterministic mode without benchmarking. Off: torch's defaults.
    """
    import torch

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


@contextlib.contextmanager
def nondeterministic_ops_stop(device: torch.device | str) -> Iterator[None]:
    """Turn torch's error for an op without a deterministic implementation (deterministic mode
    on) into a one-line CvlError naming the op and the way out; other errors pass through."""
    try:
        yield
    except RuntimeError as e:
        op = nondeterministic_op(e)
        if op is None:
            raise
        raise CvlError(
            f"{op} has no deterministic implementation on {device} (--deterministic is on): "
            "rerun with --no-deterministic (steps are then not bit-reproducible)"
        ) from None


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
        "no cuDNN benchmarking); an op without a deterministic kernel stops the command. "
        "Reruns and resumes are bit-identical only with it on. Default: on for the CPU, off "
        "on GPUs, where it costs time (one H100, bare ViT-B-32 bf16 step, batch 256: "
        "1.5-1.9x slower; docs/reproducibility.md).",
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


def fork_rng(device: torch.device):  # noqa: ANN201
    """Torch's RNG states (the CPU's and, on CUDA, this device's) restored on exit."""
    import torch

    if device.type != "cuda":
        return torch.random.fork_rng(devices=[])
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.random.fork_rng(devices=[idx])
