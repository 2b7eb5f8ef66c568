"""What deterministic mode costs a bare open_clip training step, and which ops pay (JSON).

The step is open_clip's own, on pre-made tensors (no data, no cvl loop): `clip(images,
tokens)`, `ClipLoss`, backward, AdamW step, zero_grad, under autocast when `--precision bf16`.
Three modes, interleaved `--repeats` times in one process (the fastest repeat of each is kept):

- `off`: torch's defaults (what `cvl train --no-deterministic` runs, the GPU default);
- `on`: `cvl.device.set_deterministic(True)` (what `--deterministic` runs): deterministic
  algorithms, cuDNN deterministic, no cuDNN benchmarking; torch then also fills
  uninitialised memory (`torch.utils.deterministic.fill_uninitialized_memory`);
- `on_nofill`: `on` without that filling: the share of the cost that is memory filling, not
  kernels (results are the same unless an op reads memory it never wrote).

Wall seconds per step with the device synchronised before each timestamp. The fixed cuBLAS
workspace (`CUBLAS_WORKSPACE_CONFIG`, needed by `on`) is set before the first CUDA call, so
it holds for every mode: the ratios isolate the algorithm switch. Then `--profile-steps`
steps of each mode under torch.profiler: per op (self time on the device, or on the CPU when
running there) the milliseconds per step in each mode, the `--top` ops whose time changes the
most listed first, so a GPU session sees where the deterministic step loses its time.

    python benchmarks/bench_determinism.py     # GPU: ViT-B-32, 224 px, bf16, batch 256
    python benchmarks/bench_determinism.py --device cpu   # CPU: tiny-vit, float32, batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # cvl without installing it

MODES = ("off", "on", "on_nofill")


def set_mode(mode: str) -> None:
    """Switch the process to one of MODES (cvl's own switch, plus the fill flag)."""
    import torch

    from cvl.device import set_deterministic

    set_deterministic(mode != "off")
    torch.utils.deterministic.fill_uninitialized_memory = mode != "on_nofill"


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(model: Any, images: Any, tokens: Any, precision: str, fused: bool | None = None):
    """One bare open_clip training step as a closure (AdamW with open_clip's decay groups;
    `fused`: torch's fused AdamW). `images`: the batch, or a function that makes each step's
    (from a loader's pixels, as cvl's loop does: `gpu_check`)."""
    import torch
    from open_clip.loss import ClipLoss

    clip = model.clip
    clip.train()
    decay = [p for p in clip.parameters() if p.ndim >= 2]
    no_decay = [p for p in clip.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=5e-4,
        betas=(0.9, 0.98),
        eps=1e-6,
        fused=fused,
    )
    loss_fn = ClipLoss()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    feed = images if callable(images) else lambda: images

    def step() -> None:
        with torch.autocast(tokens.device.type, dtype=dtype, enabled=precision == "bf16"):
            image_features, text_features, scale = clip(feed(), tokens)[:3]
            loss = loss_fn(image_features, text_features, scale)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_steps(step, device: Any, steps: int, warmup: int) -> float:
    """Mean wall seconds per step after `warmup` steps, synchronised at both ends."""
    for _ in range(warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def profile_ops(step, device: Any, steps: int) -> dict[str, dict[str, float]]:
    """Per op: self milliseconds per step (device time on CUDA, else CPU time) and calls."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()  # not profiled: first calls of a mode may choose kernels
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync(device)
    out = {}
    for e in prof.key_averages():
        us = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        if us > 0:
            out[e.key] = {"ms": us / 1000 / steps, "calls": e.count / steps}
    return out


def op_table(per_mode: dict[str, dict], top: int) -> list[dict[str, Any]]:
    """Ops sorted by |on − off| per step (ops of one mode only included), the first `top`."""
    off, on = per_mode["off"], per_mode["on"]
    nofill = per_mode.get("on_nofill", {})
    rows = []
    for k in set(off) | set(on):
        a, b = off.get(k, {}).get("ms", 0.0), on.get(k, {}).get("ms", 0.0)
        rows.append(
            {
                "op": k,
                "off_ms": round(a, 4),
                "on_ms": round(b, 4),
                "on_nofill_ms": round(nofill.get(k, {}).get("ms", 0.0), 4),
                "delta_ms": round(b - a, 4),
                "calls_off": off.get(k, {}).get("calls", 0.0),
                "calls_on": on.get(k, {}).get("calls", 0.0),
            }
        )
    rows.sort(key=lambda r: -abs(r["delta_ms"]))
    return rows[:top]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark; returns the JSON object (deterministic mode left off afterwards)."""
    from cvl.device import CUBLAS_WORKSPACE, resolve_device

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # before any CUDA call
    import open_clip
    import torch

    from cvl.models import build_model

    device = resolve_device(args.device)
    gpu = device.type == "cuda"  # defaults: the GPU setting, or a CPU-sized one
    args.model_config = args.model_config or ("ViT-B-32" if gpu else "tiny-vit")
    args.batch = args.batch or (256 if gpu else 64)
    args.precision = args.precision or ("bf16" if gpu else "no")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model("clip", args.model_config).to(device)
    b, s = args.batch, model.image_size
    images = torch.randn(b, 3, s, s, device=device)
    tokens = model.tokenizer([f"a photo of shape {i % 7} in colour {i % 5}" for i in range(b)])
    tokens = tokens.to(device)
    step = make_step(model, images, tokens, args.precision)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    peak: dict[str, float] = {}
    checked: dict[str, bool] = {}
    try:
        for _ in range(args.repeats):
            for m in MODES:
                set_mode(m)
                checked[m] = torch.are_deterministic_algorithms_enabled()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                times[m].append(time_steps(step, device, args.steps, args.warmup))
                if device.type == "cuda":
                    peak[m] = torch.cuda.max_memory_allocated(device) / 2**30
        per_mode = {}
        for m in MODES:
            set_mode(m)
            per_mode[m] = profile_ops(step, device, args.profile_steps)
    finally:
        set_mode("off")
    best = {m: min(v) for m, v in times.items()}
    return {
        "benchmark": "bare open_clip step: deterministic mode on vs off",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "open_clip": open_clip.__version__,
        "model_config": args.model_config,
        "image_size": s,
        "batch": b,
        "precision": args.precision,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "deterministic_algorithms": checked,
        "seconds_per_step": {m: round(v, 5) for m, v in best.items()},
        "all_runs": {m: [round(x, 5) for x in v] for m, v in times.items()},
        "pairs_per_s": {m: round(b / v, 1) for m, v in best.items()},
        "on_over_off": round(best["on"] / best["off"], 3),
        "on_nofill_over_off": round(best["on_nofill"] / best["off"], 3),
        "peak_memory_gib": {m: round(v, 2) for m, v in peak.items()},
        "profile": {
            "steps": args.profile_steps,
            "time": "device self time" if device.type == "cuda" else "CPU self time",
            "total_ms_per_step": {
                m: round(sum(o["ms"] for o in ops.values()), 3) for m, ops in per_mode.items()
            },
            "top_ops": op_table(per_mode, args.top),
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model-config",
        default=None,
        help="open_clip name or cvl config [GPU: ViT-B-32; CPU: tiny-vit]",
    )
    ap.add_argument("--batch", type=int, default=None, help="[GPU: 256; CPU: 64]")
    ap.add_argument(
        "--precision", default=None, choices=["bf16", "no"], help="[GPU: bf16; CPU: no]"
    )
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per repeat and mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="ops listed")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
