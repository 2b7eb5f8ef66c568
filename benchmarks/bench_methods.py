"""Per-step time of each method relative to SeqF, measured in one process (JSON on stdout).

Every method trains the same 2-task synthetic stream with the same tiny model; we time the
second task (where reference / old models exist) from the training logs: median seconds per
optimizer step over the task's steps after a short warm-up. Each run is repeated `--repeats`
times, interleaved with SeqF's, and the fastest median of each is kept (load from other
processes only ever slows a run down), so the ratio to SeqF is robust to a busy machine.

    python benchmarks/bench_methods.py [--methods ctp,modx,...] [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def step_times(
    stream: Path, out: Path, method: str, model: str, steps: int, batch: int, extra: dict
) -> float:
    from cvl.runs import finished_tasks
    from cvl.train.config import resolve
    from cvl.train.loop import Trainer

    cfg = resolve(
        None,
        {
            "stream": str(stream),
            "out": str(out),
            "method": method,
            "model": model,
            "model_config": "tiny-vit" if model == "clip" else "tiny",
            "epochs": 100,
            "batch_size": batch,
            "max_steps_per_task": steps,
            "log_with": "none",
            "checkpoint_every": 0,
            "log_every": 1,  # one line per step: the per-step times below
            "workers": 0,  # as when the table below was measured
            **extra,
        },
    )
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
        Trainer(cfg, progress=False).run()
    log = [
        json.loads(x)
        for x in (finished_tasks(out)[-1].path / "train_log.jsonl").read_text().splitlines()
    ]
    per_step = [batch / r["samples_per_s"] for r in log[3:]]
    return statistics.median(per_step)


def incclip_generation(stream: Path, batch: int, repeats: int) -> dict:
    """IncCLIP's pseudo-text generation (n_pseudo 256, 5 SGD steps, the real memory captions):
    CPU seconds with the text tower run up to the last end token (default) vs on the whole
    context (what it did before), same inputs, interleaved, fastest of `repeats`."""
    import cvl.methods.incclip as inc
    from cvl.data.reader import PairDataset
    from cvl.methods.base import frozen_copy
    from cvl.models import build_model
    from cvl.streams.manifest import load_manifest

    torch.manual_seed(0)
    old = frozen_copy(build_model("clip", "tiny-vit"))
    m = load_manifest(stream)
    ds = PairDataset.from_shards(m.train_shards(m.task_order[0]))
    caps = [ds.read_raw(k)[1] for k in range(batch)]
    tokens = old.tokenizer(caps)
    u = torch.nn.functional.normalize(torch.randn(batch, old.embed_dim), dim=-1)
    g = torch.Generator().manual_seed(0)
    i, j = torch.randint(batch, (256,), generator=g), torch.randint(batch, (256,), generator=g)
    beta = torch.rand(256, generator=g)
    real = inc.pooled_length
    best = {"trimmed": float("inf"), "full": float("inf")}
    for _ in range(repeats):
        for k in best:
            inc.pooled_length = real if k == "trimmed" else (lambda *a: None)
            t = time.process_time()
            inc.generate_pseudo(old, tokens, u, i, j, beta, 5, 0.1, 0.2, 0.4)
            best[k] = min(best[k], time.process_time() - t)
    inc.pooled_length = real
    return {
        "context_length": tokens.shape[1],
        "pooled_length": real(old, tokens),
        "trimmed_s": round(best["trimmed"], 4),
        "full_s": round(best["full"], 4),
        "full_over_trimmed": round(best["full"] / best["trimmed"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ctp,modx,dkr,dha,incclip")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from cvl.methods.registry import all_methods
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    extras = {"incclip": {"buffer": "reservoir", "buffer_size": 256, "method_args": {}}}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stream = tmp / "stream"
        build_synthetic(
            stream, SynthSpec(tasks=2, per_task=args.batch_size * 8, seed=0), progress=False
        )
        runs = []
        for name in args.methods.split(","):
            if name not in all_methods():
                results[name] = {"error": "not registered"}
                continue
            runs += [
                (name, model) for model in (("clip", "fusion") if name == "ctp" else ("clip",))
            ]
        runs = sorted({("seqft", model) for _, model in runs}) + runs
        best: dict[tuple[str, str], float] = {}
        for r in range(args.repeats):
            for name, model in runs:
                t = step_times(
                    stream,
                    tmp / f"{name}-{model}-{r}",
                    name,
                    model,
                    args.steps,
                    args.batch_size,
                    extras.get(name, {}),
                )
                best[(name, model)] = min(t, best.get((name, model), float("inf")))
        if "incclip" in args.methods.split(","):
            results["incclip_generation"] = incclip_generation(
                stream, args.batch_size, args.repeats
            )
        for (name, model), t in best.items():
            if name == "seqft":
                continue
            base = best[("seqft", model)]
            results[f"{name}/{model}"] = {
                "step_s": round(t, 4),
                "seqft_step_s": round(base, 4),
                "ratio": round(t / base, 3),
            }
    print(
        json.dumps(
            {
                "benchmark": "method step time / seqft step time (task 2, median)",
                "batch_size": args.batch_size,
                "threads": args.threads,
                "steps": args.steps,
                "repeats": args.repeats,
                "time": time.strftime("%Y-%m-%d %H:%M"),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
