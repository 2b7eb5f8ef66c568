"""Check a GPU install of cvl: the `gpu` tests, then a short benchmark, one table (`make gpu-check`).

Runs from the Python environment it is started with (no venv, no network): the repository's
`tests/` with `pytest -m gpu` (every method on CUDA in float32 and bf16, CTP on the fusion
model, bitwise resume on CUDA, evaluation on CUDA), then the wall time per step with CUDA
synchronised at each step. Every step takes its inputs the same way, as cvl's loop does
with a loader batch: uint8 HWC pixels, normalised on the GPU by cvl's device transform
(`SplitTransform.finish`), and tokens; fed two ways, each row says which:

- `device`: the pixels and tokens already on the GPU (no copy: the step alone);
- `pinned`: in pinned host memory, copied with `non_blocking=True` at every step, as cvl's
  loader (`pin_memory` on CUDA) hands them over.

Rows: a bare open_clip step (`bench_determinism.make_step`: forward, ClipLoss, backward,
AdamW with the implementation cvl's run uses, fused on CUDA by default; also torch's
for-each AdamW and cvl's deterministic mode); cvl's SeqF step (the real `Trainer`, the
loader replaced by the pre-made batch) at task 1 and task 2 over the bare step fed the same
way: the loop's per-step work; the old-model methods' step (task 2, where their old /
momentum / reference models run) over SeqF's task-2 step; and, with `--e2e-steps`, the real
loader-fed `cvl train` (pairs/s end to end, synthetic JPEGs at the model's image size).

Exit status: 0 when the tests pass and the benchmark ran, 1 when a test failed, 2 when this
environment cannot check a GPU (torch sees no CUDA device, or a package is missing).

    python benchmarks/gpu_check.py [--no-tests] [--batch 256] [--steps 15] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # cvl from this checkout, installed or not

# modules cvl's training, evaluation and the tests import (GPU images often lack some)
NEEDED = ("open_clip", "accelerate", "safetensors", "webdataset", "ftfy", "click")
OLD_MODEL_METHODS = "modx,dkr,lwf,ctp"


def environment_problem(device: str, tests: bool) -> str | None:
    """Why this environment cannot run the check (one line), or None. CUDA first: it needs
    only torch, so a machine without a GPU is told at once."""
    try:
        import torch
    except ModuleNotFoundError:
        return f"torch is not installed in {sys.executable}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (
            f"torch {torch.__version__} ({build}) sees no CUDA device here: nothing to check "
            "(run it on a machine with a GPU and a CUDA build of torch)"
        )
    missing = []
    for m in (*NEEDED, *(("pytest",) if tests else ())):
        try:
            importlib.import_module(m)
        except ModuleNotFoundError:
            missing.append(m)
    if missing:
        return (
            f"missing Python package(s) {', '.join(missing)} in {sys.executable}: install them "
            "into this environment (offline: pip install --no-index from wheel files)"
        )
    return None


def run_gpu_tests(pytest_args: list[str]) -> dict[str, Any]:
    """`pytest -m gpu` on tests/, its output passed through; returns the exit code and the
    summary line."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [*cmd, *pytest_args, str(ROOT / "tests")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    last = ""
    assert p.stdout is not None
    for line in p.stdout:
        sys.stdout.write(line)
        if line.strip():
            last = line.strip()
    rc = p.wait()
    return {"returncode": rc, "summary": last.strip("= "), "seconds": time.perf_counter() - t0}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_seconds(
    model: Any, batch: dict, args: argparse.Namespace, mode: str, fused: bool | None
) -> float:
    """Median wall seconds of a bare open_clip step in a determinism mode (bench_determinism),
    its pixels normalised at every step as cvl's loop does (copied first if on the host)."""
    from bench_determinism import make_step, set_mode

    from cvl.data.augment import train_transform

    device = resolve_device(args.device)
    split = train_transform(model.image_size, "openclip", device)

    def feed():
        return split.finish({"image": batch["image"]}, device)

    set_mode(mode)
    try:
        text = batch["text"].to(device, non_blocking=True)
        step = make_step(model, feed, text, args.precision, fused=fused)
        times = []
        for i in range(args.warmup + args.steps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    finally:
        set_mode("off")
    return statistics.median(times)


def resolve_device(name: str) -> Any:
    from cvl.device import resolve_device as resolve

    return resolve(name)


def cvl_seconds(
    stream: Path,
    out: Path,
    method: str,
    premade: dict | None,
    args: argparse.Namespace,
    tasks: int = 2,
    steps: int | None = None,
) -> list[float]:
    """Median wall seconds per optimizer step of each task of a `cvl train` run, the loader
    replaced by `premade` (None: the real loader; each step timed from one step's start to
    the next's)."""
    import cvl.train.loop as loop
    from cvl.train.config import resolve

    n = args.warmup + (steps or args.steps) + 1  # starts of steps: n - 1 whole steps per task
    starts: list[float] = []
    real_seed, real_loader = loop.seed_torch, loop.make_loader

    def seed_torch(seed, device):  # called once at the start of every optimizer step
        _sync(device)
        starts.append(time.perf_counter())
        real_seed(seed, device)

    def fake_loader(ds, plan, *a, **k):
        for _ in plan:
            yield dict(premade)

    loop.seed_torch = seed_torch
    if premade is not None:
        loop.make_loader = fake_loader
    try:
        cfg = resolve(
            None,
            {
                "stream": str(stream),
                "out": str(out),
                "method": method,
                "model_config": args.model_config,
                "batch_size": args.batch,
                "epochs": 1000,
                "max_steps_per_task": n,
                "precision": args.precision,
                "device": args.device,
                "deterministic": False,
                "log_with": "none",
                "checkpoint_every": 0,
                "log_every": 1000,
                "workers": 0 if premade is not None else -1,
            },
        )
        with contextlib.redirect_stdout(sys.stderr):
            loop.Trainer(cfg, progress=False).run()
    finally:
        loop.seed_torch, loop.make_loader = real_seed, real_loader
    per_task = []
    for k in range(tasks):
        s = starts[k * n : (k + 1) * n]
        w = args.warmup
        per_task.append(statistics.median(b - a for a, b in zip(s[w:], s[w + 1 :])))
    return per_task


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The timings (see the module docstring) as a dict of rows."""
    import open_clip
    import torch

    from cvl import __version__
    from cvl.models import build_model
    from cvl.streams.synthetic import SynthSpec, build_synthetic
    from cvl.train.config import TrainConfig
    from cvl.train.optim import adamw_impl

    device = resolve_device(args.device)
    torch.manual_seed(0)
    model = build_model("clip", args.model_config).to(device)
    b, s = args.batch, model.image_size
    text = model.tokenizer([f"a photo of shape {i % 7} in colour {i % 5}" for i in range(b)])
    # what the loader hands cvl's loop: uint8 HWC pixels (normalised on the device)
    pixels = torch.randint(0, 256, (b, s, s, 3), dtype=torch.uint8)
    pin = device.type == "cuda"  # cvl's loader pins its batches on CUDA
    feeds = {
        "device": {"image": pixels.to(device), "text": text.to(device), "n_replaced": 0},
        "pinned": {
            "image": pixels.pin_memory() if pin else pixels,
            "text": text.pin_memory() if pin else text,
            "n_replaced": 0,
        },
    }
    impl = adamw_impl(TrainConfig(), device)  # the AdamW cvl's run uses here
    rows: dict[str, Any] = {}
    for f, batch in feeds.items():
        rows[f"bare_{f}"] = bare_seconds(model, batch, args, "off", impl == "fused")
    rows["bare_foreach"] = bare_seconds(model, feeds["device"], args, "off", None)
    rows["bare_deterministic"] = bare_seconds(model, feeds["device"], args, "on", impl == "fused")
    del model
    methods = [m for m in args.methods.split(",") if m and m != "seqft"]
    e2e = None
    with tempfile.TemporaryDirectory() as tmp:
        stream = Path(tmp) / "stream"  # only its task structure is used: batches are premade
        spec = SynthSpec(tasks=2, per_task=b, test_per_task=8, seed=0)
        build_synthetic(stream, spec, progress=False)
        for f, batch in feeds.items():
            rows[f"seqft_{f}"] = cvl_seconds(stream, Path(tmp) / f"seqft-{f}", "seqft", batch, args)
        for m in methods:
            rows[m] = cvl_seconds(stream, Path(tmp) / m, m, feeds["pinned"], args)
        if args.e2e_steps:  # the real loader on JPEGs of the model's size
            real = Path(tmp) / "jpegs"
            n = (args.warmup + args.e2e_steps + 1) * b
            spec = SynthSpec(tasks=1, per_task=n, image_size=s, test_per_task=8, seed=0)
            build_synthetic(real, spec, progress=False)
            e2e = cvl_seconds(real, Path(tmp) / "e2e", "seqft", None, args, 1, args.e2e_steps)[0]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "open_clip": open_clip.__version__,
        "cvl": __version__,
        "model_config": args.model_config,
        "image_size": s,
        "batch": b,
        "precision": args.precision,
        "steps": args.steps,
        "adamw": impl,
        "seconds_per_step": rows,
        "e2e_seconds_per_step": e2e,
    }


def table(res: dict[str, Any], tests: dict[str, Any] | None) -> str:
    """The one table the check prints."""
    t = res["seconds_per_step"]
    b = res["batch"]
    lines = [
        f"cvl {res['cvl']} gpu-check on {res['device_name']} ({res['device']}): torch "
        f"{res['torch']}, open_clip {res['open_clip']}",
        "gpu tests: "
        + (
            "not run (--no-tests)"
            if tests is None
            else f"{tests['summary']} (exit {tests['returncode']}, {tests['seconds']:.0f} s)"
        ),
        f"{res['model_config']}, {res['image_size']} px, precision {res['precision']}, batch {b}: "
        f"median wall seconds per step over {res['steps']} steps"
        + (", CUDA synchronised" if res["device"].startswith("cuda") else "")
        + f"; AdamW {res['adamw']} unless a row says otherwise; inputs: device = already on "
        "the GPU, pinned = copied from pinned host memory at every step (cvl's loader)",
        "",
        "| step | inputs | s/step | pairs/s | ratio |",
        "|---|---|---|---|---|",
    ]

    def row(what: str, feed: str, sec: float, ratio: float | None, of: str) -> None:
        r = "1.00" if ratio is None else f"{ratio:.3f} × {of}"
        lines.append(f"| {what} | {feed} | {sec:.4f} | {b / sec:,.0f} | {r} |")

    for f in ("device", "pinned"):
        row("bare open_clip", f, t[f"bare_{f}"], None, "")
    bd = t["bare_device"]
    row(
        "bare open_clip, for-each AdamW",
        "device",
        t["bare_foreach"],
        t["bare_foreach"] / bd,
        "bare",
    )
    det = t["bare_deterministic"]
    row("bare open_clip, --deterministic", "device", det, det / bd, "bare")
    for f in ("device", "pinned"):
        bare, (t1, t2) = t[f"bare_{f}"], t[f"seqft_{f}"]
        row("cvl seqft, task 1", f, t1, t1 / bare, f"bare ({f})")
        row("cvl seqft, task 2", f, t2, t2 / bare, f"bare ({f})")
    s2 = t["seqft_pinned"][1]
    for m, v in t.items():
        if not m.startswith(("bare", "seqft")):
            row(f"cvl {m}, task 2", "pinned", v[1], v[1] / s2, "seqft task 2")
    if res.get("e2e_seconds_per_step"):
        e = res["e2e_seconds_per_step"]
        row("cvl seqft, real loader (JPEGs)", "loader", e, e / t["seqft_pinned"][0], "seqft task 1")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-tests", action="store_true", help="only the benchmark")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments (one string)")
    ap.add_argument("--model-config", default="ViT-B-32")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "no"])
    ap.add_argument("--steps", type=int, default=15, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--methods", default=OLD_MODEL_METHODS, help="timed against seqft")
    ap.add_argument(
        "--e2e-steps", type=int, default=10, help="steps of the loader-fed run (0: none)"
    )
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N (cpu: a dry run)")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = environment_problem(args.device, tests=not args.no_tests)
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    tests = None if args.no_tests else run_gpu_tests(args.pytest_args.split())
    res = benchmark(args)
    print(table(res, tests))
    if args.json:
        Path(args.json).write_text(json.dumps({**res, "tests": tests}, indent=1))
    return 1 if tests is not None and tests["returncode"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
