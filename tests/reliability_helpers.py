"""Shared pieces of the reliability tests: a tiny stream, per-method CLI arguments, running
`python -m cvl ...` as a real subprocess and SIGKILLing it from outside, comparing runs.

Per-method tests are parametrized over the method registry: a method gets `METHOD_EXTRA`'s
arguments when it has an entry there, else defaults (a reservoir buffer if it needs one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from cvl.methods.registry import all_methods
from cvl.runs import finished_tasks

STEPS = 4  # optimizer steps per task (the kill lands inside task 2's)
BATCH = 8

# Extra `cvl train` arguments a method needs (methods without an entry: `method_args`).
METHOD_EXTRA: dict[str, list[str]] = {
    "incclip": [
        *("--buffer", "reservoir", "--buffer-size", "8"),
        *("--method-arg", "n_pseudo=16", "--method-arg", "gen_steps=2"),  # every path, cheaper
    ],
    "zscl": ["--method-arg", "ref_stream={stream}"],  # the reference set: the stream itself
    "cclip": ["--tune", "lora"],  # a LoRA per task (the method requires it)
    "lora_per_task": ["--tune", "lora"],
    # the code's 22 experts of bottleneck 64 scaled down (the ResNet `tiny` adapts its text
    # tower only; test_distributed's tiny-vit and test_method_moe_adapters.py both towers)
    "moe_adapters": ["--method-arg", "experts=4", "--method-arg", "bottleneck=8"],
}


def method_args(name: str, stream: Path | str = "STREAM") -> list[str]:
    """The CLI arguments that make `name` runnable on the tiny stream (at `stream`)."""
    if name in METHOD_EXTRA:
        return [a.format(stream=stream) for a in METHOD_EXTRA[name]]
    cls = all_methods()[name]
    if getattr(cls, "needs_buffer", False):  # the buffer the method asks for (iCaRL: mof)
        return ["--buffer", getattr(cls, "buffer_hint", "reservoir"), "--buffer-size", "8"]
    return []


def trained_methods() -> list[str]:
    """Registered methods that take optimizer steps (zeroshot has none to interrupt); a
    preset of another registered method (`preset_of`: the same code and defaults under a
    paper's name) is tested as that method."""
    return [
        n
        for n, c in all_methods().items()
        if getattr(c, "trains", True) and not getattr(c, "preset_of", None)
    ]


# One method per way a method's data, state or steps differ from seqft's, for the tests that
# cross methods with another feature (a data mixture, a time-ordered stream with cumulative
# replay, a budget's probes): bitwise resume and 2 processes = 1 run over every method
# (test_reliability_resume.py, test_distributed.py).
FAMILIES = {
    "seqft": "the base loss only",
    "joint": "its own task data (the union of the tasks)",
    "lwf": "an old model's forward",
    "icarl": "its own herding buffer, class-style distillation",
    "der": "stored outputs of replayed items",
    "co2l": "its own contrastive objective over replay",
    "ctp": "momentum model + queue",
    "incclip": "pseudo-negatives and a memory of features",
    "dha": "best-val selection, its own buffer rule",
    "ewc": "a penalty in after_backward, an importance pass per task",
    "si": "a path integral in after_step",
    "afec": "an expanded model trained per epoch",
    "zscl": "a reference stream and a teacher",
    "wise": "a merge wrapper (weights replaced after the task)",
    "ties": "task vectors from the initial weights (every task restarts)",
    "opcm": "a merge state beyond task vectors (the projected running sum)",
    "moe_adapters": "layers added to the model (run.json's model config), per-step noise",
    "cclip": "required adapters, a projector",
}


def family_methods() -> list[str]:
    """`FAMILIES`' methods (each must be registered and trained)."""
    missing = set(FAMILIES) - set(trained_methods())
    assert not missing, f"not registered: {missing}"
    return list(FAMILIES)


def build_tiny_stream(out: Path) -> Path:
    """3 tasks × 32 training pairs (4 steps of 8), small eval sets (val for best-val methods)."""
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    spec = SynthSpec(
        tasks=3,
        per_task=STEPS * BATCH,
        test_per_task=8,
        val_per_task=4,
        query_per_task=4,
        gallery_per_task=8,
        overlap=0,
        seed=0,
    )
    build_synthetic(out, spec, progress=False)
    return out


def train_argv(stream: Path, out: Path, method: str, device: str = "cpu") -> list[str]:
    """`cvl train` of `method` on the tiny stream, on `device`, deterministic (runs are compared
    bit for bit; the CPU by default: a forked child cannot use CUDA its parent initialised)."""
    return [
        "train",
        "--stream",
        str(stream),
        "--out",
        str(out),
        "--method",
        method,
        *method_args(method, stream),
        "--model-config",
        "tiny",
        "--epochs",
        "1",
        "--batch-size",
        str(BATCH),
        "--max-steps-per-task",
        str(STEPS),
        "--checkpoint-every",
        "1",
        "--log-with",
        "none",
        "--quiet",
        "--device",
        device,
        "--deterministic",
    ]


def cli(argv: list[str]) -> None:
    """Run a cvl command in this process (imports already paid); it must succeed."""
    from cvl.cli import main

    rc = main(argv)
    assert rc in (0, None), f"cvl {' '.join(argv)} exited {rc}"


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CVL_TEST_THREADS": "1"}


class _Forked:
    """A forked child of the test process running `cvl ARGV` (imports already paid: a real
    OS process killed from outside, without the ~10 s CPU of a fresh interpreter's imports)."""

    def __init__(self, argv: list[str]) -> None:
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                cli(argv)
                code = 0
            finally:
                os._exit(code)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def kill_when(argv: list[str], ready, fork: bool = True, timeout: float = 600.0) -> int:
    """Run `cvl ARGV` in another process and SIGKILL it as soon as `ready()` is true (polled
    every 5 ms): a forked child of this process, or (`fork=False`) `python -m cvl ARGV`.

    Fails if the process ends by itself first (the kill point was missed). Once this process
    has initialised CUDA a forked child could not use it, so the child is then a fresh
    interpreter whatever `fork` says."""
    if fork and not torch.cuda.is_initialized():
        p = _Forked(argv)
    else:
        p = subprocess.Popen(
            [sys.executable, "-m", "cvl", *argv],
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    t0 = time.monotonic()
    try:
        while not ready():
            if p.poll() is not None:
                raise AssertionError(f"cvl {argv[0]} ended (rc {p.returncode}) before the kill")
            if time.monotonic() - t0 > timeout:
                raise AssertionError("kill point never reached")
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL
    return p.returncode


def log_lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def _tensors_equal(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys(), a
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), f"{a}: {k}"


# task.json "cost" fields that are measured, not computed: they differ between equal runs
MEASURED_COST = ("wall_s", "device_hours", "peak_memory_bytes", "peak_memory_total_bytes")


def comparable(d: dict) -> dict:
    """A task.json without its measured cost fields (time, memory)."""
    if isinstance(d.get("cost"), dict):
        d = {**d, "cost": {k: v for k, v in d["cost"].items() if k not in MEASURED_COST}}
    return d


def assert_same_run(a: Path, b: Path) -> int:
    """Runs `a` and `b` finished the same tasks with bit-identical weights and method state
    (every .safetensors file), equal JSON state/task info (the counted FLOPs included, the
    measured time and memory not) and equal per-step losses.
    Returns the number of task folders compared."""
    ta, tb = finished_tasks(a), finished_tasks(b)
    assert [c.path.name for c in ta] == [c.path.name for c in tb]
    for ca, cb in zip(ta, tb):
        fa = sorted(p.name for p in ca.path.iterdir())
        assert fa == sorted(p.name for p in cb.path.iterdir()), ca.path
        for name in fa:
            pa, pb = ca.path / name, cb.path / name
            if name.endswith(".safetensors"):
                _tensors_equal(pa, pb)
            elif name.endswith(".json"):
                ja, jb = json.loads(pa.read_text()), json.loads(pb.read_text())
                assert comparable(ja) == comparable(jb), pa
            elif name == "train_log.jsonl":
                ra = [json.loads(x) for x in pa.read_text().splitlines()]
                rb = [json.loads(x) for x in pb.read_text().splitlines()]
                drop = ("samples_per_s",)
                assert [{k: v for k, v in r.items() if k not in drop} for r in ra] == [
                    {k: v for k, v in r.items() if k not in drop} for r in rb
                ], pa
    return len(ta)
