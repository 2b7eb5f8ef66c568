"""The gradient reduction's share of a training step on 2 processes (JSON on stdout).

Two ways to average the gradients over ranks, interleaved in the same 2 processes (gloo on
the CPU by default, NCCL with `--device cuda` on a machine with 2 GPUs), on the same model,
batch and optimizer (cvl's CLIP wrapper, `clip_loss` over the gathered global batch, AdamW):

- `after`: `cvl.dist.average_gradients` (before issue 27): one flat all_reduce of every
  gradient, after the backward.
- `overlapped`: `cvl.dist.GradReducer` (the training loop since issue 27): ~25 MB buckets
  all-reduced asynchronously as their gradients become ready during the backward.

Per step (rank 0, the fastest of `--repeats` medians): the whole step's wall seconds, and the
*exposed* reduction: wall seconds from the end of the backward to gradients averaged
(`average_gradients`, or `GradReducer.finish`: what is left to wait for). CUDA timings
synchronise the device at each timestamp.

    python benchmarks/bench_grad_reduce.py [--model-config ViT-S-32] [--batch 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _now(cuda: bool) -> float:
    import torch

    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from cvl.dist import GradReducer, average_gradients
    from cvl.losses import clip_loss
    from cvl.models import build_model

    cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
    )
    try:
        torch.manual_seed(0)
        model = build_model("clip", args.model_config).to(dev)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-6)
        g = torch.Generator().manual_seed(rank)
        s, b = model.image_size, args.batch
        images = torch.randn(b, 3, s, s, generator=g).to(dev)
        tokens = model.tokenizer([f"a photo of thing {rank * b + i}" for i in range(b)]).to(dev)
        reducer = GradReducer(args.bucket_mb)
        res: dict[str, list[tuple[float, float]]] = {"after": [], "overlapped": []}
        for _ in range(args.repeats):
            for mode in res:
                steps = []
                for _ in range(args.steps + 1):  # the first is a warm-up
                    t0 = _now(cuda)
                    if mode == "overlapped":
                        reducer.prepare(params, True)
                    with torch.autocast(dev.type, torch.bfloat16, enabled=args.precision == "bf16"):
                        o = model(images, tokens)
                        loss = clip_loss(o["image_features"], o["text_features"], o["logit_scale"])
                    loss.backward()
                    t1 = _now(cuda)
                    if mode == "overlapped":
                        reducer.finish(params)
                    else:
                        average_gradients(params)
                    t2 = _now(cuda)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t3 = _now(cuda)
                    steps.append((t3 - t0, t2 - t1))
                res[mode].append(steps[1:])
        if rank == 0:
            n_params = sum(p.numel() for p in params)
            summary = {}
            for mode, runs in res.items():
                step = min(statistics.median(s for s, _ in r) for r in runs)
                red = min(statistics.median(x for _, x in r) for r in runs)
                summary[mode] = {
                    "step_s": round(step, 4),
                    "exposed_reduction_s": round(red, 4),
                    "share_of_step": round(red / step, 3),
                }
            with open(out, "w") as f:
                json.dump(
                    {
                        "benchmark": "gradient reduction's share of a step, 2 processes",
                        "backend": "nccl" if cuda else "gloo",
                        "model_config": args.model_config,
                        "params_m": round(n_params / 1e6, 2),
                        "grad_mb": round(4 * n_params / 2**20, 1),
                        "batch_per_process": b,
                        "precision": args.precision,
                        "bucket_mb": args.bucket_mb,
                        "buckets": len(reducer.buckets),
                        "threads_per_process": args.threads,
                        "steps": args.steps,
                        "repeats": args.repeats,
                        "time": time.strftime("%Y-%m-%d %H:%M"),
                        **summary,
                        "exposed_reduction_after_over_overlapped": round(
                            summary["after"]["exposed_reduction_s"]
                            / max(summary["overlapped"]["exposed_reduction_s"], 1e-9),
                            2,
                        ),
                        "step_after_over_overlapped": round(
                            summary["after"]["step_s"] / summary["overlapped"]["step_s"], 3
                        ),
                    },
                    f,
                    indent=1,
                )
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="ViT-S-32")
    ap.add_argument("--batch", type=int, default=2, help="per process")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("no", "bf16"), default="no")
    args = ap.parse_args()
    from two_procs import run_two

    print(json.dumps(run_two(_worker, args, cpu=args.device == "cpu")))


if __name__ == "__main__":
    main()
