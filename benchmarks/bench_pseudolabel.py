"""Throughput of `cvl pseudo-label` and its scaling with processes; beit-base cost per image.

Prints JSON:

- `tiny`: images/s of the labelling loop (model loaded, JPEG decode + image processor + forward,
  unit files written) with the tiny random BEiT (2 layers, 32 px, 1000 labels) on a synthetic
  stream, per batch size in one process, and per number of processes (torchrun, gloo, 1 thread
  each) with the speed-up over 1 process. The loop time is `labels.json`'s `last_run.seconds`
  (excludes Python/transformers start-up and model loading).
- `beit_base`: a random `BeitConfig()` (= beit-base-patch16-224: 12 layers, 768 wide, 224 px,
  1000 labels): forward FLOPs per image counted by torch's FlopCounterMode, CPU seconds per
  image for a few batches, and CPU seconds per image of JPEG decode + BeitImageProcessor on
  256-px JPEGs (what a DataLoader worker does), for the 12M-image extrapolation in the note.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_pseudolabel.py [--per-task 256]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _tiny(folder: Path) -> Path:
    from transformers import BeitConfig, BeitForImageClassification, BeitImageProcessor

    torch.manual_seed(0)
    cfg = BeitConfig(
        image_size=32,
        patch_size=8,
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1000,
    )
    m = BeitForImageClassification(cfg)
    torch.nn.init.normal_(m.classifier.weight, std=1.0)
    m.save_pretrained(folder)
    BeitImageProcessor(size={"height": 32, "width": 32}, do_center_crop=False).save_pretrained(
        folder
    )
    return folder


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(stream: Path, model: Path, name: str, batch: int, procs: int, unit: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CVL_TEST_THREADS": "1"}
    cli = ["pseudo-label", "--stream", str(stream), "--model", str(model), "--name", name]
    cli += ["--batch-size", str(batch), "--unit-size", str(unit), "--quiet"]
    if procs == 1:
        cmd = [sys.executable, "-m", "cvl", *cli]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs)]
        cmd += ["--master_port", str(_port()), "-m", "cvl", *cli]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    info = json.loads((stream / "labels" / name / "labels.json").read_text())
    lr = info["last_run"]
    return {
        "processes": procs,
        "batch_size": batch,
        "images": lr["images"],
        "loop_seconds": lr["seconds"],
        "images_per_second": round(lr["images"] / lr["seconds"], 1),
        "command_wall_seconds": round(wall, 2),
    }


def _beit_base(batches: int, batch: int) -> dict:
    from PIL import Image
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BeitConfig, BeitForImageClassification, BeitImageProcessor

    torch.manual_seed(0)
    cfg = BeitConfig(num_labels=1000)  # the beit-base-patch16-224 architecture, random weights
    model = BeitForImageClassification(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(pixel_values=x)
    flops = fc.get_total_flops()
    xb = torch.randn(batch, 3, 224, 224)
    with torch.no_grad():
        model(pixel_values=xb)  # warm-up
        t0 = time.perf_counter()
        for _ in range(batches):
            model(pixel_values=xb)
        fwd = (time.perf_counter() - t0) / (batches * batch)
    proc = BeitImageProcessor()  # 224 px, as the checkpoint's preprocessor_config.json
    g = torch.Generator().manual_seed(0)
    jpgs = []
    for _ in range(32):
        arr = (torch.rand(256, 341, 3, generator=g) * 255).to(torch.uint8).numpy()
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=95)
        jpgs.append(buf.getvalue())
    t0 = time.perf_counter()
    for j in jpgs:
        img = Image.open(io.BytesIO(j)).convert("RGB")
        proc(images=img, return_tensors="pt")
    prep = (time.perf_counter() - t0) / len(jpgs)
    return {
        "params": n_params,
        "forward_gflops_per_image": round(flops / 1e9, 2),
        "cpu_forward_seconds_per_image": round(fwd, 4),
        "cpu_threads": torch.get_num_threads(),
        "cpu_decode_and_preprocess_seconds_per_image": round(prep, 4),
        "preprocess_input": "256x341 JPEG (CC12M as built with --image-size 256, keep_ratio)",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--per-task", type=int, default=512)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--unit-size", type=int, default=128)
    ap.add_argument("--base-batches", type=int, default=2)
    ap.add_argument("--base-batch", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        stream = d / "synth"
        build_synthetic(
            stream,
            SynthSpec(
                tasks=a.tasks,
                per_task=a.per_task,
                test_per_task=0,
                val_per_task=0,
                query_per_task=0,
                gallery_per_task=0,
                seed=0,
            ),
            progress=False,
        )
        model = _tiny(d / "tiny-beit")
        per_batch = [_run(stream, model, f"b{b}", b, 1, a.unit_size) for b in a.batch_sizes]
        b = max(a.batch_sizes)
        scaling = [_run(stream, model, f"p{p}", b, p, a.unit_size) for p in a.processes]
        one = scaling[0]["images_per_second"]
        for s in scaling:
            s["speedup_vs_1"] = round(s["images_per_second"] / one, 2)
    out = {
        "machine": f"{os.cpu_count()} CPU cores, shared with other jobs (timings inflated)",
        "tiny": {"images": per_batch[0]["images"], "per_batch_size": per_batch, "scaling": scaling},
        "beit_base": _beit_base(a.base_batches, a.base_batch),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
