"""What `cvl train --fsdp` saves per process, and what it costs per step (JSON on stdout).

**Memory** (arithmetic, nothing allocated): each open_clip architecture is built on the meta
device and sharded with cvl's plan (`cvl.train.fsdp.shard_`, per transformer block) over a
fake process group of N ranks (torch's `fake` backend: real DTensor shard shapes, no
communication); the bytes are the sizes of rank 0's shards (the largest: FSDP2 pads the
first dimension to a multiple of N). Per process, fp32 weights:

- DDP (cvl without --fsdp): weights P, gradients P, the reducer's buckets P (one flat copy of
  the gradients, as DDP's), AdamW's two moments 2P; each frozen model a method holds
  (previous-task, teacher, momentum: the training dtype, cvl does not cast them) P;
- FSDP2: weights, gradients, moments and each frozen model at their shard size S ≈ P/N, plus
  what is gathered while computing, in the compute dtype (`--precision bf16`: bf16): the
  model's own group G (projections, norms, embeddings outside the towers) and its gradient,
  kept whole from the forward to the end of the backward, and at most three units U (the
  largest block or tower: the one computing, the one prefetched, the gradient of the one in
  the backward before it is reduce-scattered): 2G + 3U. A frozen model frees everything
  after each forward: its shards S only (+ G + 2U while it computes).

Activations are not counted (they depend on the batch; `--grad-checkpointing` bounds them).

**Step time** (measured): 2 processes (gloo, one thread each) train a small model with
`clip_loss` over the gathered batch and AdamW, DDP-style (`GradReducer`) and sharded,
interleaved on the same batches; the median step of each and their ratio.

    python benchmarks/bench_fsdp.py [--models ViT-B-16,ViT-L-14,ViT-bigG-14]
        [--processes 2,8] [--step-model tiny-vit] [--batch 8] [--steps 8] [--no-step]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

GB = 2**30


def _bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def memory(name: str, n: int, precision: str) -> dict:
    """Per-process GB of a `name` CLIP (open_clip config) trained on `n` processes."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cvl.models import build_model
    from cvl.train import fsdp

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    fsdp._mesh = None  # a mesh of this group
    try:
        with torch.device("meta"):
            model = build_model("clip", name)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        numel = sum(p.numel() for p in model.parameters())
        units, taken = [], set()  # each unit's own parameters (innermost units come first)
        for _, u, _ in fsdp.shard_units(model):
            mine = [p for p in u.parameters() if id(p) not in taken]
            taken |= {id(p) for p in mine}
            units.append(sum(p.numel() * p.element_size() for p in mine))
        own = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in taken)
        unit = max(units)
        fsdp.shard_(model, torch.device("cpu"))
        shard = sum(_bytes(p) for p in model.parameters())
    finally:
        dist.destroy_process_group()
        fsdp._mesh = None
    compute = 0.5 if precision == "bf16" else 1.0  # gathered in the compute dtype
    gathered = compute * (2 * own + 3 * unit)
    ddp = {"weights": whole, "grads": whole, "buckets": whole, "adamw": 2 * whole}
    sh = {"weights": shard, "grads": shard, "adamw": 2 * shard, "gathered": gathered}
    return {
        "params_m": round(numel / 1e6, 1),
        "ddp_gb": {k: round(v / GB, 2) for k, v in ddp.items()},
        "ddp_total_gb": round(sum(ddp.values()) / GB, 2),
        "ddp_frozen_model_gb": round(whole / GB, 2),
        "fsdp_gb": {k: round(v / GB, 2) for k, v in sh.items()},
        "fsdp_total_gb": round(sum(sh.values()) / GB, 2),
        # a frozen model: its shards (it frees what it gathers after each forward)
        "fsdp_frozen_model_gb": round(shard / GB, 2),
        "model_group_mb": round(own / 2**20, 1),
        "largest_unit_mb": round(unit / 2**20, 1),
    }


def _now() -> float:
    return time.perf_counter()


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from cvl.dist import GradReducer
    from cvl.losses import clip_loss
    from cvl.models import build_model
    from cvl.train import fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        plain = build_model("clip", args.step_model)
        sharded = build_model("clip", args.step_model)
        sharded.load_state_dict(plain.state_dict())
        fsdp.shard_(sharded, torch.device("cpu"))
        g = torch.Generator().manual_seed(rank)
        s, b = plain.image_size, args.batch
        images = torch.randn(b, 3, s, s, generator=g)
        tokens = plain.tokenizer([f"a photo of thing {rank * b + i}" for i in range(b)])
        runs = {}
        for mode, model in (("ddp", plain), ("fsdp", sharded)):
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-6)
            reducer = GradReducer()
            if mode == "fsdp":
                reducer = fsdp.ShardedReducer(model, reducer)
            runs[mode] = (model, params, opt, reducer)
        times: dict[str, list[float]] = {"ddp": [], "fsdp": []}
        for step in range(args.steps + 1):  # the first is a warm-up
            for mode, (model, params, opt, reducer) in runs.items():
                t0 = _now()
                reducer.prepare(params, True)
                o = model(images, tokens)
                loss = clip_loss(o["image_features"], o["text_features"], o["logit_scale"])
                loss.backward()
                reducer.finish(params)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step:
                    times[mode].append(_now() - t0)
        if rank == 0:
            ddp, sh = (statistics.median(times[m]) for m in ("ddp", "fsdp"))
            with open(out, "w") as f:
                json.dump(
                    {
                        "model_config": args.step_model,
                        "params_m": round(sum(p.numel() for p in plain.parameters()) / 1e6, 2),
                        "batch_per_process": b,
                        "steps": args.steps,
                        "ddp_step_s": round(ddp, 4),
                        "fsdp_step_s": round(sh, 4),
                        "fsdp_over_ddp": round(sh / ddp, 3),
                    },
                    f,
                )
    finally:
        dist.destroy_process_group()


def step_time(args: argparse.Namespace) -> dict:
    from two_procs import run_two

    return run_two(_worker, args)  # gloo on the CPU


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="ViT-B-16,ViT-L-14,ViT-bigG-14")
    ap.add_argument("--processes", default="2,8")
    ap.add_argument("--precision", choices=("no", "bf16"), default="no")
    ap.add_argument("--step-model", default="tiny-vit")
    ap.add_argument("--batch", type=int, default=8, help="per process")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-step", action="store_true", help="the memory arithmetic only")
    args = ap.parse_args()
    mem = {}
    for name in args.models.split(","):
        mem[name] = {
            int(n): memory(name, int(n), args.precision) for n in args.processes.split(",")
        }
    res = {
        "benchmark": "per-process memory of DDP vs FSDP2 (arithmetic), step time on this CPU",
        "precision": args.precision,
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "memory": mem,
    }
    if not args.no_step:
        res["step"] = step_time(args)
    sys.stdout.write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
