"""`cvl eval`'s embedding path and a whole `cvl eval` against bare open_clip passes (JSON).

Two comparisons, each in this one process, repeats interleaved (the fastest of each is kept:
load from other processes only ever slows a run down):

- `embed`: images + captions embedded per second of one test set by cvl eval's path
  (`embed_dataset`: shards read, decoded to uint8 by `--workers` loader processes, normalised on
  the device, captions tokenised, features back on the CPU) against a bare loop: open_clip's
  `encode_image` / `encode_text` over the same pre-decoded, pre-normalised tensors and
  pre-tokenised captions already on the device, same batch. Three cvl figures: the first pass
  of a command (decoding, with workers; and with none), and a later checkpoint's pass (the
  images from the image store). Target (issue 24): `ratio` >= 0.9 with workers.
- `whole_eval`: `cvl eval --run R --force` of a 5-task run (5 checkpoints x 5 test sets:
  retrieval, zero-shot, cumulative sets, reports; `--no-probe`, the stream has no val / query /
  gallery sets, so the embedding work is the same 25 passes) against 5 x 5 bare passes over
  pre-decoded tensors. Target: <= 1.3. Also without the image store (`--image-cache-mb 0`),
  and the store's counts (each image decoded once, reused by the other checkpoints).

    .venv/bin/python benchmarks/bench_eval.py [--device cpu] [--workers 1] [--per-task 200]
    python benchmarks/bench_eval.py --device cuda --model-config ViT-B-32 --image-size 224 \\
        --per-task 1000 --batch 256 --workers 8

Each variant is timed in wall seconds (CUDA synchronised before each clock read) and in CPU
seconds (this process + its finished loader workers): on a machine shared with other jobs the
wall clock measures the neighbours too, the CPU seconds only the work (on the CPU device);
the `cpu_ratio*` keys are the same ratios in CPU seconds. The JSON says which is which.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SMALL_VIT = {  # the default: a real ViT at 96 px, small enough for a 2-core CPU
    "extends": "tiny-vit",
    "model_cfg": {
        "embed_dim": 128,
        "vision_cfg": {"layers": 4, "width": 128, "head_width": 32, "patch_size": 16},
        "text_cfg": {"width": 128, "heads": 4, "layers": 4},
    },
}


def _clock(device: torch.device) -> tuple[float, float]:
    """(wall, CPU seconds of this process and its waited-for children) after a device sync."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), time.process_time() + ch.ru_utime + ch.ru_stime


class Best:
    """The fastest wall and CPU time seen per variant."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.wall, self.cpu = device, {}, {}

    @contextlib.contextmanager
    def time(self, name: str) -> Any:
        w0, c0 = _clock(self.device)
        yield
        w1, c1 = _clock(self.device)
        self.wall[name] = min(self.wall.get(name, float("inf")), w1 - w0)
        self.cpu[name] = min(self.cpu.get(name, float("inf")), c1 - c0)


def build(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """A 5-task synthetic stream with test sets only, and a run with 5 random checkpoints."""
    from cvl.io import write_json
    from cvl.models import build_model, save_weights
    from cvl.streams.manifest import load_manifest
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    stream = root / "stream"
    spec = SynthSpec(
        tasks=args.tasks,
        per_task=8,
        test_per_task=args.per_task,
        val_per_task=0,
        query_per_task=0,
        gallery_per_task=0,
        image_size=args.image_size,
        overlap=0,
        seed=0,
    )
    build_synthetic(stream, spec, progress=False)
    m = load_manifest(stream)
    cfg = args.model_config
    if cfg == "small-vit":
        cfg = {**SMALL_VIT, "model_cfg": {**SMALL_VIT["model_cfg"]}}
        cfg["model_cfg"]["vision_cfg"] = {
            **SMALL_VIT["model_cfg"]["vision_cfg"],
            "image_size": args.image_size,
        }
    torch.manual_seed(0)
    model = build_model("clip", cfg)
    run = root / "run"
    write_json(
        run / "run.json",
        {
            "schema": "cvl.run/1",
            "config": {"method": "seqft", "model": "clip", "stream": str(stream)},
            "model": model.config(),
            "stream": {
                "path": str(stream),
                "name": m.name,
                "task_order": list(m.task_order),
                "fingerprint": m.fingerprint,
            },
        },
    )
    for i, t in enumerate(m.task_order):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        save_weights(model, run / "tasks" / f"{i:02d}-{t}" / "model.safetensors")
    return stream, run


def predecoded(model: Any, shards: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The set's images (model input, float32) and its captions' tokens, on the device."""
    from cvl.evaluation.embed import eval_dataset

    ds = eval_dataset(model, shards, check=False)
    items = [ds[i] for i in range(len(ds))]
    images = torch.stack([it["image"] for it in items]).to(device)
    tokens = model.tokenizer([c for it in items for c in it["captions"]]).to(device)
    return images, tokens


@torch.no_grad()
def bare_pass(clip: Any, images: torch.Tensor, tokens: torch.Tensor, batch: int) -> None:
    """open_clip's own encoders over pre-made tensors (features left on the device)."""
    out = []
    for s in range(0, images.shape[0], batch):
        out.append(torch.nn.functional.normalize(clip.encode_image(images[s : s + batch]), dim=-1))
    for s in range(0, tokens.shape[0], batch):
        out.append(torch.nn.functional.normalize(clip.encode_text(tokens[s : s + batch]), dim=-1))


def embed_bench(run: Path, stream: Path, args: argparse.Namespace, device: torch.device) -> dict:
    from cvl.evaluation.embed import embed_dataset, eval_dataset
    from cvl.evaluation.imagestore import ImageStore
    from cvl.models import load_weights, model_from_config
    from cvl.streams.manifest import load_manifest

    m = load_manifest(stream)
    rd = json.loads((run / "run.json").read_text())
    model = model_from_config(rd["model"])
    load_weights(model, next((run / "tasks").glob("*/model.safetensors")))
    model.eval().to(device)
    shards = m.eval_shards("test", m.task_order[0])
    images, tokens = predecoded(model, shards, device)
    n_items = images.shape[0] + tokens.shape[0]
    kw = {"device": device, "precision": args.precision}
    warm = eval_dataset(model, shards, check=False)
    embed_dataset(model, warm, args.batch, **kw)  # warm-up (kernels, page cache)
    bare_pass(model.clip, images, tokens, args.batch)
    best = Best(device)
    for _ in range(args.repeats):
        with best.time("bare"):
            with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16"):
                bare_pass(model.clip, images, tokens, args.batch)
        store = ImageStore(4096)
        ds = eval_dataset(model, shards, check=False)
        with best.time("cvl_workers"):  # a command's first pass: decode in the workers
            embed_dataset(model, ds, args.batch, num_workers=args.workers, store=store, **kw)
        with best.time("cvl_stored"):  # a later checkpoint's pass: images from the store
            embed_dataset(model, ds, args.batch, num_workers=args.workers, store=store, **kw)
        with best.time("cvl_no_workers"):
            embed_dataset(model, eval_dataset(model, shards, check=False), args.batch, **kw)
    out: dict[str, Any] = {
        "images": int(images.shape[0]),
        "captions": int(tokens.shape[0]),
        "items_per_s": {k: round(n_items / v, 1) for k, v in best.wall.items()},
        "items_per_cpu_s": {k: round(n_items / v, 1) for k, v in best.cpu.items()},
    }
    for k in ("workers", "stored", "no_workers"):
        out[f"ratio_{k}"] = round(best.wall["bare"] / best.wall[f"cvl_{k}"], 3)
        out[f"cpu_ratio_{k}"] = round(best.cpu["bare"] / best.cpu[f"cvl_{k}"], 3)
    return out


def whole_bench(run: Path, stream: Path, args: argparse.Namespace, device: torch.device) -> dict:
    from cvl.cli import main
    from cvl.models import load_weights, model_from_config
    from cvl.streams.manifest import load_manifest

    m = load_manifest(stream)
    rd = json.loads((run / "run.json").read_text())
    model = model_from_config(rd["model"]).eval().to(device)
    sets = [predecoded(model, m.eval_shards("test", t), device) for t in m.task_order]
    cks = sorted((run / "tasks").glob("*/model.safetensors"))
    argv = ["eval", "--run", str(run), "--force", "--quiet", "--no-plots", "--no-probe"]
    argv += ["--device", str(device), "--workers", str(args.workers)]
    argv += ["--batch-size", str(args.batch), "--precision", args.precision]
    best = Best(device)
    store_stats: dict[str, Any] = {}
    for _ in range(args.repeats):
        bare = {"wall": 0.0, "cpu": 0.0}
        for ck in cks:
            load_weights(model, ck)
            model.to(device)
            w0, c0 = _clock(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16"):
                for images, tokens in sets:
                    bare_pass(model.clip, images, tokens, args.batch)
            w1, c1 = _clock(device)
            bare["wall"] += w1 - w0
            bare["cpu"] += c1 - c0
        best.wall["bare"] = min(best.wall.get("bare", float("inf")), bare["wall"])
        best.cpu["bare"] = min(best.cpu.get("bare", float("inf")), bare["cpu"])
        for name, extra in (("cvl_eval", []), ("cvl_eval_no_store", ["--image-cache-mb", "0"])):
            with best.time(name), contextlib.redirect_stdout(io.StringIO()):  # not the tables
                assert main([*argv, *extra]) == 0
            met = json.loads((run / "eval" / "metrics.json").read_text())
            store_stats[name] = met["timing"]["image_store"]
    return {
        "checkpoints": len(cks),
        "test_sets": len(sets),
        "wall_s": {k: round(v, 3) for k, v in best.wall.items()},
        "cpu_s": {k: round(v, 3) for k, v in best.cpu.items()},
        "ratio": round(best.wall["cvl_eval"] / best.wall["bare"], 3),
        "ratio_no_store": round(best.wall["cvl_eval_no_store"] / best.wall["bare"], 3),
        "cpu_ratio": round(best.cpu["cvl_eval"] / best.cpu["bare"], 3),
        "cpu_ratio_no_store": round(best.cpu["cvl_eval_no_store"] / best.cpu["bare"], 3),
        "image_store": store_stats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--workers", type=int, default=-1, help="loader workers (-1 = cvl's auto)")
    ap.add_argument("--tasks", type=int, default=5)
    ap.add_argument("--per-task", type=int, default=200, help="test images per task")
    ap.add_argument("--image-size", type=int, default=96, help="stream JPEGs and model input")
    ap.add_argument(
        "--model-config", default="small-vit", help="small-vit (below), or any cvl clip config"
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--precision", default="no", choices=["no", "bf16"])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from cvl.device import resolve_device
    from cvl.evaluation.options import resolve_workers

    device = resolve_device(args.device)
    args.workers = resolve_workers(args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        stream, run = build(Path(tmp), args)
        out = {
            "device": str(device),
            "torch_threads": args.threads,
            "workers": args.workers,
            "batch": args.batch,
            "precision": args.precision,
            "model_config": args.model_config,
            "image_size": args.image_size,
            "embed": embed_bench(run, stream, args, device),
            "whole_eval": whole_bench(run, stream, args, device),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
