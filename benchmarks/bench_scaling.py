"""Step time and peak memory vs model width and batch size, with and without gradient
checkpointing (JSON on stdout), so a run's cost on other hardware can be extrapolated.

Each (model, batch, checkpointing) cell runs in a fresh subprocess: random weights, random
pre-made images and captions, `--steps` SeqF training steps (cvl's CLIP wrapper,
`cvl.losses.clip_loss`, AdamW). Reported: median seconds per step after one warm-up step
(CUDA: wall seconds; CPU: CPU seconds of the process, i.e. × threads when several are used),
and peak memory: on CUDA `torch.cuda.max_memory_allocated`, on CPU the growth of the
process's peak RSS during the steps over its RSS after building the model (activations +
gradients + AdamW state; the weights themselves are in `params_mb`).

    python benchmarks/bench_scaling.py [--models tiny-vit,ViT-S-32] [--batches 16,64]
    python benchmarks/bench_scaling.py --models ViT-B-32 --batches 8,32 --steps 1  # CPU: ~10 min
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def cell(model_config: str, batch: int, ckpt: bool, steps: int) -> dict:
    """One measurement, in this process."""
    import torch

    from cvl.losses import clip_loss
    from cvl.models import build_model

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_model("clip", model_config).to(dev)
    if ckpt:
        model.set_grad_checkpointing(True)
    model.train()
    s = model.image_size
    images = torch.randn(batch, 3, s, s, device=dev)
    tokens = model.tokenizer([f"a photo of thing number {i}" for i in range(batch)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    n_params = sum(p.numel() for p in model.parameters())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = time.perf_counter if dev.type == "cuda" else time.process_time  # CPU: busy-proof
    times = []
    for _ in range(steps + 1):
        t = clock()
        out = model(images, tokens)
        loss = clip_loss(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - t)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return {
        "model": model_config,
        "image_size": s,
        "batch": batch,
        "grad_checkpointing": ckpt,
        "device": dev.type,
        "params_m": round(n_params / 1e6, 2),
        "params_mb": round(n_params * 4 / 2**20, 1),
        "s_per_step": round(statistics.median(times[1:]), 4),
        "peak_mb": round(peak, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-vit,ViT-S-32")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cell", nargs=3, metavar=("MODEL", "BATCH", "CKPT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        m, b, c = args.cell
        print(json.dumps(cell(m, int(b), c == "1", args.steps)))
        return
    rows = []
    for m in args.models.split(","):
        for b in [int(x) for x in args.batches.split(",")]:
            for c in ("0", "1"):
                cmd = [sys.executable, __file__, "--steps", str(args.steps), "--cell", m, str(b), c]
                r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                if r.returncode != 0:
                    rows.append({"model": m, "batch": b, "error": r.stderr.strip()[-300:]})
                    continue
                rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"threads": os.environ.get("OMP_NUM_THREADS"), "cells": rows}, indent=1))


if __name__ == "__main__":
    main()
