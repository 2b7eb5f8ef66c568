"""cvl's training step vs a bare open_clip step on the same model and batch (JSON on stdout).

Three timings, in one process, interleaved `--repeats` times (the fastest of each is kept:
load from other processes only ever slows a run down):

- `bare`: open_clip's own step on pre-made tensors: `clip(images, tokens)`, `ClipLoss`,
  backward, AdamW step, zero_grad. No data, no logging.
- `cvl`: `cvl train --method seqft` (the real `Trainer`, default log/checkpoint settings)
  with the loader replaced by the same pre-made tensors: the loop's per-step work (seeding,
  method hooks, loss terms, log windows, lr schedule, mid-task checkpoints) is what differs.
- `e2e`: the real `cvl train` on a synthetic stream of the same image size, with its real
  loader (`--workers` as given; default: auto from the CPU count): pairs/s of the whole step.

Step times come from timestamps at each optimizer step's end (after `warmup` steps). On the
CPU (`--device cpu`, the default; GPUs are hidden from the process): CPU seconds of this
process for `bare` / `cvl` (one torch thread, no workers: robust to other processes on the
machine), wall seconds for `e2e` and `bare_wall` (the pairs/s ratio). With `--device cuda`:
wall seconds everywhere, the device synchronised at each timestamp, pre-made tensors on the
GPU; `--precision bf16` runs every variant under bf16 autocast (the bare step too).

    python benchmarks/bench_step.py [--model-config tiny-vit] [--batch 64] [--steps 60]
    python benchmarks/bench_step.py --device cuda --model-config ViT-B-32 --batch 256 \
        --precision bf16 --steps 30 --workers 12
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def bare_step_times(
    model, images, tokens, steps: int, lr: float = 5e-4, precision: str = "no"
) -> list[float]:
    """open_clip's training step (ClipLoss, AdamW with open_clip's decay groups); `images`: a
    batch, or a function that makes each step's (e.g. from a loader's uint8 pixels, as cvl)."""
    from open_clip.loss import ClipLoss

    clip = model.clip
    clip.train()
    decay = [p for p in clip.parameters() if p.ndim >= 2]
    no_decay = [p for p in clip.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    loss_fn = ClipLoss()
    times = []
    dev = tokens.device.type
    feed = images if callable(images) else lambda: images
    for _ in range(steps):
        x = feed()
        with torch.autocast(dev, torch.bfloat16, enabled=precision == "bf16"):
            image_features, text_features, scale = clip(x, tokens)[:3]  # scale: exp'd
            loss = loss_fn(image_features, text_features, scale)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(clock())
    return times


def clock() -> tuple[float, float]:
    """(wall, CPU time of this process): with one torch thread and no loader workers the CPU
    time is the step's own work, barely inflated by other processes on a busy machine. On a
    GPU the device is synchronised first (wall time is the measure there)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def cvl_step_times(
    stream: Path, out: Path, cfg: dict, steps: int, premade: dict | None
) -> list[float]:
    """The real Trainer; `premade`: a batch dict served instead of the loader's batches."""
    import cvl.train.loop as loop
    from cvl.methods.seqft import SeqFT
    from cvl.train.config import resolve

    times: list[float] = []
    real_after, real_loader = SeqFT.after_step, loop.make_loader

    def after_step(self, ctx):
        real_after(self, ctx)
        if ctx.task_index == 0:
            times.append(clock())

    def fake_loader(ds, plan, *a, **k):
        for _ in plan:
            yield dict(premade)

    SeqFT.after_step = after_step
    if premade is not None:
        loop.make_loader = fake_loader
    try:
        c = resolve(
            None,
            {
                "stream": str(stream),
                "out": str(out),
                "method": "seqft",
                "epochs": 1000,
                "max_steps_per_task": steps,
                "log_with": "none",
                **cfg,
            },
        )
        with contextlib.redirect_stdout(sys.stderr):
            loop.Trainer(c, progress=False).run()
    finally:
        SeqFT.after_step, loop.make_loader = real_after, real_loader
    return times


def per_step(times: list[tuple[float, float]], warmup: int, cpu: bool) -> float:
    """Mean seconds per step after `warmup` steps (checkpoint and log steps included)."""
    t = [x[1 if cpu else 0] for x in times[warmup:]]
    return (t[-1] - t[0]) / (len(t) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="tiny-vit")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=-1, help="e2e loader workers (-1: auto)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: CPU seconds, GPUs hidden; cuda: wall seconds with synchronisation",
    )
    ap.add_argument("--precision", choices=("no", "bf16"), default="no")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer takes a GPU when it sees one
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    from cvl.data.reader import default_workers
    from cvl.models import build_model
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = build_model("clip", args.model_config).to(dev)
    b, s = args.batch, model.image_size
    images = torch.randn(b, 3, s, s).to(dev)
    tokens = model.tokenizer([f"a photo of shape {i % 7} in colour {i % 5}" for i in range(b)])
    tokens = tokens.to(dev)
    # what the loader hands cvl's loop: uint8 HWC pixels on the host (normalised on the device)
    loaded = torch.randint(0, 256, (b, s, s, 3), dtype=torch.uint8)
    premade = {"image": loaded, "text": tokens, "n_replaced": 0}
    res: dict[str, list[float]] = {k: [] for k in ("bare", "cvl", "cvl_log1", "e2e", "bare_wall")}
    common = {"model_config": args.model_config, "batch_size": b, "precision": args.precision}
    with tempfile.TemporaryDirectory() as tmp:
        stream = Path(tmp) / "stream"
        spec = SynthSpec(tasks=1, per_task=4 * b, image_size=s, test_per_task=8, seed=0)
        build_synthetic(stream, spec, progress=False)
        for r in range(args.repeats):
            t = bare = bare_step_times(model, images, tokens, args.steps, precision=args.precision)
            res["bare"].append(per_step(t, args.warmup, cpu=not cuda))
            t = cvl_step_times(stream, Path(tmp) / f"c{r}", common, args.steps, premade)
            res["cvl"].append(per_step(t, args.warmup, cpu=not cuda))
            c1 = {**common, "log_every": 1}
            t = cvl_step_times(stream, Path(tmp) / f"l{r}", c1, args.steps, premade)
            res["cvl_log1"].append(per_step(t, args.warmup, cpu=not cuda))
            ce = {**common, "workers": args.workers}
            t = cvl_step_times(stream, Path(tmp) / f"e{r}", ce, args.steps, None)
            res["e2e"].append(per_step(t, args.warmup, cpu=False))
            res["bare_wall"].append(per_step(bare, args.warmup, cpu=False))
    best = {k: min(v) for k, v in res.items()}
    print(
        json.dumps(
            {
                "model_config": args.model_config,
                "device": args.device,
                "precision": args.precision,
                "clock": "wall, synchronised" if cuda else "CPU seconds (bare, cvl); wall (e2e)",
                "batch": b,
                "image_size": s,
                "steps": args.steps,
                "threads": torch.get_num_threads(),
                "e2e_workers": args.workers if args.workers >= 0 else default_workers(),
                "seconds_per_step": {k: round(v, 5) for k, v in best.items()},
                "all_runs": {k: [round(x, 5) for x in v] for k, v in res.items()},
                "cvl_over_bare": round(best["cvl"] / best["bare"], 3),
                "cvl_log_every_1_over_bare": round(best["cvl_log1"] / best["bare"], 3),
                "e2e_pairs_per_s": round(b / best["e2e"], 1),
                "bare_pairs_per_s": round(b / best["bare_wall"], 1),
                "e2e_over_bare_pairs_per_s": round(best["bare_wall"] / best["e2e"], 3),
                "median_bare_cpu": round(statistics.median(res["bare"]), 5),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
