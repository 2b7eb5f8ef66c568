"""Per-step time of each method relative to SeqF, measured in one process (JSON on stdout).

Every method trains the same 2-task synthetic stream with the same tiny model; we time the
second task (where reference / old models exist): median seconds per optimizer step over the
task's steps after a short warm-up. Each run is repeated `--repeats`
times, interleaved with SeqF's, and the fastest median of each is kept (load from other
processes only ever slows a run down), so the ratio to SeqF is robust to a busy machine.

Beside each ratio: the method's arithmetic floor (what its extra forward passes cost if the
model's compute dominated a step: a no-grad forward ≈ 1/3 of a forward + backward) and its
per-task extra cost outside the steps — importance passes after a task (EWC, MAS, RWalk,
AFEC's Fisher), buffer selection (mof / kmeans features + selection), AFEC's expanded epochs —
in seconds and as a multiple of one SeqF epoch (steps per epoch × SeqF step time).

Step times are the intervals between the ends of consecutive optimizer steps: on the CPU
(`--device cpu`, the default; GPUs are hidden from the process) CPU seconds of this process
(one torch thread, `--workers 0`: the step's own work, data included, barely inflated by other
processes on a busy machine), on a GPU wall seconds with the device synchronised at each
end. The CPU models are the tiny ones (`clip` = tiny-vit, `fusion` = tiny) on a 32 px
stream. With `--device cuda` the hooks' timer synchronises the device too, and
`--model-config` / `--precision` / `--workers` / `--batch-size` set the GPU setting (the
stream is built at the model's image size).

    python benchmarks/bench_methods.py [--methods ctp,modx,...] [--steps 30] [--repeats 3]
    python benchmarks/bench_methods.py --device cuda --methods lwf,modx,dkr,ctp --fusion 0 \
        --model-config ViT-B-32 --batch-size 256 --precision bf16 --workers 12 --steps 30
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

# Arithmetic floor of each method's step / SeqF step, and why (see the module docstring).
FLOORS = {
    "ctp": (5 / 3, "two extra no-grad forwards (momentum, reference)"),
    "modx": (4 / 3, "one extra no-grad forward"),
    "dkr": (4 / 3, "one extra no-grad forward"),
    "dha": (1.0, "one _foreach pass over the weights"),
    "ewc": (1.0, "fused penalty: a few _foreach passes over the weights"),
    "si": (1.0, "fused penalty + path integral: _foreach passes"),
    "mas": (1.0, "fused penalty"),
    "rwalk": (1.0, "fused penalty + path integral"),
    "afec": (1.0, "fused penalties (the expanded epochs are per-task extra)"),
    "lwf": (4 / 3, "one extra no-grad forward (old model)"),
    "icarl": (4 / 3, "one extra no-grad forward (old model)"),
    "lucir": (4 / 3, "one extra no-grad forward (old model)"),
    "der": (1.0, "stored-target lookup + MSE (targets are embedded once per task, before it)"),
    "derpp": (1.0, "as der + a masked InfoNCE on the same logits"),
    "co2l": (4 / 3, "one extra no-grad forward (old model)"),
    "geodl": (4 / 3, "one extra no-grad forward (old model) + two d×d SVDs per modality"),
    "erl": (4 / 3, "one extra no-grad forward (old model)"),
    "afc": (4 / 3, "one extra no-grad forward (old model); importance pass per task"),
    "wise": (1.0, "nothing per step (one interpolation per task)"),
    "zscl": (7 / 3, "forward + backward on a reference batch of B + the teacher's no-grad forward"),
}
EXTRAS = {
    "incclip": {"buffer": "reservoir", "buffer_size": 256, "method_args": {}},
    "icarl": {"buffer": "mof", "buffer_size": 64},
    "lucir": {"buffer": "mof", "buffer_size": 64},
    "der": {"buffer": "reservoir", "buffer_size": 64},
    "derpp": {
        "method": "der",
        "buffer": "reservoir",
        "buffer_size": 64,
        "method_args": {"derpp": True},
    },
    "co2l": {"buffer": "ring", "buffer_size": 64},
    "erl": {"buffer": "reservoir", "buffer_size": 64},
    "zscl": {"method_args": {"ref_stream": "STREAM"}},
}


def step_times(
    stream: Path,
    out: Path,
    method: str,
    model: str,
    steps: int,
    batch: int,
    extra: dict,
    setting: dict | None = None,
) -> dict:
    """Median step time of task 2, and the per-task extras measured around the hooks."""
    from cvl.methods.buffers import Buffer
    from cvl.methods.registry import get_method
    from cvl.runs import finished_tasks
    from cvl.train.config import resolve
    from cvl.train.loop import Trainer

    extra = dict(extra)
    method = extra.pop("method", method)
    if "method_args" in extra:  # the reference stream of zscl: the benchmark's own stream
        extra["method_args"] = {
            k: str(stream) if v == "STREAM" else v for k, v in extra["method_args"].items()
        }
    cfg = resolve(
        None,
        {
            "stream": str(stream),
            "out": str(out),
            "method": method,
            "model": model,
            "model_config": "tiny-vit" if model == "clip" else "tiny",
            "workers": 0,  # as when the CPU tables below were measured
            **(setting or {}),
            "epochs": 100,
            "batch_size": batch,
            "max_steps_per_task": steps,
            "log_with": "none",
            "checkpoint_every": 0,
            "log_every": 1,  # one line per step: the per-step times below
            **extra,
        },
    )
    cls = get_method(method)
    timed: dict[str, list[float]] = {
        "before_task": [],
        "after_task": [],
        "buffer": [],
        "expanded_epoch": [],
        "before_step": [],
        "after_backward": [],
        "after_step": [],
    }
    patches = [(cls, "after_task", "after_task"), (Buffer, "update", "buffer")]
    patches.append((cls, "before_task", "before_task"))
    patches += [(cls, h, h) for h in ("before_step", "after_backward", "after_step")]
    if hasattr(cls, "_expanded_epoch"):
        patches.append((cls, "_expanded_epoch", "expanded_epoch"))
    saved = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in patches]

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stamps: list[float] = []  # the end of each optimizer step of the timed (second) task

    def timer(fn, key):
        def wrapped(*a, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                timed[key].append(time.perf_counter() - t0)
                if key == "after_step" and getattr(a[-1], "task_index", 0) == 1:
                    # CUDA: wall seconds (synchronised); CPU: this process's CPU seconds
                    stamps.append(time.perf_counter() if cuda else time.process_time())

        return wrapped

    for owner, attr, key in patches:
        setattr(owner, attr, timer(getattr(owner, attr), key))
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
            Trainer(cfg, progress=False).run()
    finally:
        for owner, attr, orig in saved:
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
    log = [
        json.loads(x)
        for x in (finished_tasks(out)[-1].path / "train_log.jsonl").read_text().splitlines()
    ]
    wall = [batch / r["samples_per_s"] for r in log[3:]]
    per_step = [b - a for a, b in zip(stamps[3:], stamps[4:])] or wall
    hooks = sum(
        statistics.median(timed[h]) if timed[h] else 0.0
        for h in ("before_step", "after_backward", "after_step")
    )
    return {
        "step": statistics.median(per_step),
        # the method's own per-step hooks (penalty, path integral, blends), median per call:
        # measured inside the run, so its share of the step survives a busy machine
        "hooks": hooks,
        # task 0's hooks (after the last task, importance passes are skipped)
        "after_task": timed["after_task"][0] if timed["after_task"] else 0.0,
        # task 1's (DER embeds the buffer items stored after task 0)
        "before_task": timed["before_task"][-1] if timed["before_task"] else 0.0,
        "buffer": timed["buffer"][0] if timed["buffer"] else 0.0,
        "expanded_epoch": statistics.mean(timed["expanded_epoch"])
        if timed["expanded_epoch"]
        else 0.0,
    }


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
    ap.add_argument(
        "--methods",
        default="ctp,modx,dkr,dha,incclip,ewc,si,mas,rwalk,afec,lwf,icarl,lucir,"
        "der,derpp,co2l,geodl,erl,afc,wise,zscl",
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--fusion", type=int, default=1, help="also time fusion for fusion-term methods"
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model-config", default="", help="clip model config (default: tiny-vit)")
    ap.add_argument("--precision", choices=("no", "bf16", "fp16"), default="no")
    ap.add_argument("--workers", type=int, default=0, help="loader workers (-1: auto)")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer takes a GPU when it sees one
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    setting = {"precision": args.precision, "workers": args.workers}
    if args.model_config:
        setting["model_config"] = args.model_config
    torch.set_num_threads(args.threads)
    from cvl.methods.registry import all_methods
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    fusion_too = {"ctp", "lwf", "lucir", "mas"}  # fusion-only terms (MLM distillation, CLS)
    results = {}
    steps_per_epoch = 8
    image_size = 32
    if args.model_config:
        from cvl.models import build_model

        image_size = build_model("clip", args.model_config).image_size
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stream = tmp / "stream"
        spec = SynthSpec(
            tasks=2, per_task=args.batch_size * steps_per_epoch, image_size=image_size, seed=0
        )
        build_synthetic(stream, spec, progress=False)
        runs = []
        for name in args.methods.split(","):
            if EXTRAS.get(name, {}).get("method", name) not in all_methods():
                results[name] = {"error": "not registered"}
                continue
            models = ("clip", "fusion") if name in fusion_too and args.fusion else ("clip",)
            runs += [(name, model) for model in models]
        runs = sorted({("seqft", model) for _, model in runs}) + runs
        best: dict[tuple[str, str], dict] = {}
        for r in range(args.repeats):
            for name, model in runs:
                t = step_times(
                    stream,
                    tmp / f"{name}-{model}-{r}",
                    name,
                    model,
                    args.steps,
                    args.batch_size,
                    EXTRAS.get(name, {}),
                    setting if model == "clip" else {**setting, "model_config": "tiny"},
                )
                prev = best.get((name, model))
                best[(name, model)] = (
                    t if prev is None else {k: min(v, prev[k]) for k, v in t.items()}
                )
        if "incclip" in args.methods.split(","):
            results["incclip_generation"] = incclip_generation(
                stream, args.batch_size, args.repeats
            )
        for (name, model), t in best.items():
            if name == "seqft":
                continue
            base = best[("seqft", model)]["step"]
            epoch = base * steps_per_epoch
            floor, why = FLOORS.get(name, (None, ""))
            ratio = t["step"] / base
            res = {
                "step_s": round(t["step"], 4),
                "seqft_step_s": round(base, 4),
                "ratio": round(ratio, 3),
                "floor": None if floor is None else round(floor, 3),
                "ratio_over_floor": None if floor is None else round(ratio / floor, 3),
                "floor_is": why,
            }
            res["hooks_ms_per_step"] = round(1000 * t["hooks"], 2)
            res["hooks_share_of_step"] = round(t["hooks"] / t["step"], 4)
            extra = {
                k: (round(t[k], 3), round(t[k] / epoch, 2))
                for k in ("before_task", "after_task", "buffer", "expanded_epoch")
                if t[k] > 0.005
            }
            if extra:
                res["per_task_extra_s_and_epochs"] = extra
            results[f"{name}/{model}"] = res
    print(
        json.dumps(
            {
                "benchmark": "method step time / seqft step time (task 2, median)",
                "steps_per_epoch": steps_per_epoch,
                "extra_format": "[seconds, multiple of one seqft epoch]",
                "batch_size": args.batch_size,
                "device": args.device,
                "model_config": args.model_config or "tiny-vit / tiny (fusion)",
                "precision": args.precision,
                "workers": args.workers,
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
