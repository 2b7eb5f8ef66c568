"""Peak memory and step time of gradient accumulation: one batch of K·B, plain K × B, cached
K × B (`cvl train --grad-accum K --accum-mode plain|cached`), JSON on stdout.

For each method and K (default SeqF and the seed papers' methods; K = 1, 4, 16; B = 8 on the
CPU) three runs of `cvl train` (in this process, a 2-task synthetic stream, `--steps` steps
per task) are measured on task 2, where old / momentum / reference models exist:

- `one`: one batch of K·B per step (`--batch-size K·B`);
- `plain`: `--batch-size B --grad-accum K` (each micro-batch its own loss);
- `cached`: the same with `--accum-mode cached` (the loss of one batch of K·B). A method
  `cvl.train.accum.refusal` refuses is reported with its reason, not run.

**Step time**: the intervals between the ends of task 2's consecutive optimizer steps (the
method's `after_step`), median; on the CPU CPU seconds of this process (one torch thread,
`--workers 0`: the batch's decoding included, barely inflated by other processes), on CUDA
wall seconds with the device synchronised.

**Peak memory**: on CUDA `torch.cuda.max_memory_allocated` over task 2 (task.json "cost"
`peak_memory_bytes`); on the CPU, where the allocator keeps no peak, cvl's `tensors` measure
(`cvl.train.memory`, what `--budget maf` charges: read from task 2's `budget` record, the
probe of the step the task trains): the bytes of every tensor of the model and of the method
(frozen models), the gradients and AdamW's two moments of what trains, the activations autograd
saves for a backward (the largest micro-batch's, each storage once), and under cached mode
the step's held inputs and features with their gradients. Exact, the same on any machine; a
kernel's transient buffers are not in it. (The `maf` budget's probe costs a step before each
task; its steps are capped by `--steps`.)

Ratios: step time and memory over those of `one` with the same K·B (in one process).

`--global-batch N` (CUDA; the issue's GPU measurement): SeqF, ViT-B/16 (`--model-config`),
the largest batch that trains without accumulation, found by doubling from `--start-batch`
until CUDA runs out of memory (or `--max-batch`), against a global batch of N with cached
accumulation at that largest batch per micro-batch (K = N / it): peak memory and samples/s.

    python benchmarks/bench_accum.py [--methods seqft,ctp,modx,dkr,dha,incclip] [--ks 1,4,16]
        [--batch 8] [--steps 5] [--model-config tiny-vit] [--markdown TABLE.md]
    python benchmarks/bench_accum.py --device cuda --global-batch 4096 --precision bf16 \
        --workers 12 [--model-config ViT-B-16] [--start-batch 128]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_methods import EXTRAS  # noqa: E402  (the methods' settings on a synthetic stream)

METHODS = "seqft,ctp,modx,dkr,dha,incclip"


def _config(stream: Path, out: Path, method: str, setting: dict[str, Any]) -> Any:
    """The run's TrainConfig: `method` on `stream` with its benchmark settings."""
    from cvl.train.config import resolve

    extra = dict(EXTRAS.get(method, {}))
    name = extra.pop("method", method)
    if "method_args" in extra:  # zscl's reference stream: this stream
        extra["method_args"] = {
            k: str(stream) if v == "STREAM" else v for k, v in extra["method_args"].items()
        }
    over = {"stream": str(stream), "out": str(out), "method": name, "log_with": "none"}
    over.update(checkpoint_every=0, log_every=1, epochs=1000, **extra, **setting)
    return resolve(None, over)


def refused(stream: Path, out: Path, method: str, setting: dict[str, Any]) -> str | None:
    """Why cached accumulation would not train this setting (None: it does)."""
    from cvl.methods.registry import get_method
    from cvl.train import accum

    cfg = _config(stream, out, method, setting)
    return accum.refusal(get_method(cfg.method)(cfg.method_args), cfg)


def measure(stream: Path, out: Path, method: str, setting: dict[str, Any]) -> dict[str, Any]:
    """Step time (median over task 2), peak memory and FLOPs per step of one run."""
    from cvl.runs import finished_tasks
    from cvl.train.loop import Trainer

    cfg = _config(stream, out, method, setting)
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    stamps: list[float] = []
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
        trainer = Trainer(cfg, progress=False)
        cls = type(trainer.method)  # the class's hook (the maf probe swaps in a copy)
        after = cls.__dict__.get("after_step")

        def stamped(self: Any, ctx: Any) -> None:
            super(cls, self).after_step(ctx) if after is None else after(self, ctx)
            if ctx.task_index == 1 and not getattr(ctx, "probing", False):
                if cuda:
                    torch.cuda.synchronize()
                stamps.append(time.perf_counter() if cuda else time.process_time())

        cls.after_step = stamped
        try:
            trainer.run()
        finally:
            if after is None:
                del cls.after_step
            else:
                cls.after_step = after
    task = json.loads((finished_tasks(out)[-1].path / "task.json").read_text())
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    budget = task.get("budget") or {}
    memory = task["cost"]["peak_memory_bytes"] if cuda else budget.get("memory_bytes")
    return {
        "step_s": round(statistics.median(steps), 5) if steps else None,
        "memory_bytes": memory,
        "flops_per_step": task["cost"]["flops_per_step"],
        "samples_per_step": task["cost"]["samples"] // max(1, task["cost"]["steps"]),
    }


def _ratios(row: dict[str, Any], one: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for k, r in (("step_s", "step_ratio"), ("memory_bytes", "memory_ratio")):
        if row.get(k) and one.get(k):
            out[r] = round(row[k] / one[k], 3)
    return out


def _base(args: argparse.Namespace) -> dict[str, Any]:
    """The settings every run shares."""
    base = {"model_config": args.model_config, "precision": args.precision}
    base.update(workers=args.workers, max_steps_per_task=args.steps, device=args.device)
    if args.device == "cpu":  # the `tensors` measure: the maf budget's probe (capped steps)
        base.update(budget="maf=1e9", budget_args={"memory": "tensors"})
    return base


def table(args: argparse.Namespace, stream: Path, tmp: Path) -> dict[str, Any]:
    """{method: {"K=k": {one, plain, cached}}} with ratios to `one`."""
    base = _base(args)
    out: dict[str, Any] = {}
    n = 0
    for method in args.methods.split(","):
        rows: dict[str, Any] = {}
        for k in args.ks:
            kb = k * args.batch
            one = measure(stream, tmp / f"r{(n := n + 1)}", method, {**base, "batch_size": kb})
            row: dict[str, Any] = {"one": one}
            if k > 1:
                acc = {**base, "batch_size": args.batch, "grad_accum": k}
                row["plain"] = _ratios(measure(stream, tmp / f"r{(n := n + 1)}", method, acc), one)
                cached = {**acc, "accum_mode": "cached"}
                why = refused(stream, tmp / "x", method, cached)
                row["cached"] = (
                    {"refused": why}
                    if why
                    else _ratios(measure(stream, tmp / f"r{(n := n + 1)}", method, cached), one)
                )
            rows[f"K={k}"] = row
        out[method] = rows
    return out


def _image_size(config: str) -> int:
    from cvl.models import build_model

    size = build_model("clip", config).image_size
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)


def _fitting(stream: Path, out: Path, setting: dict[str, Any]) -> dict[str, Any] | None:
    """`measure` of a SeqF run, or None when the device runs out of memory."""
    try:
        return measure(stream, out, "seqft", setting)
    except Exception as e:  # noqa: BLE001 (out of memory ends the search; anything else raises)
        if not _oom(e):
            raise
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def global_batch(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The issue's GPU measurement (module doc): the largest plain batch, found by doubling,
    against `--global-batch` with cached accumulation at that batch per micro-batch."""
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    size = _image_size(args.model_config)
    stream = tmp / "big"
    # one global batch per task: each epoch is one step, --steps epochs (the same pairs again:
    # the timing does not depend on which); 2 × N images at the model's size, in every CPU
    spec = SynthSpec(tasks=2, per_task=args.global_batch, image_size=size, test_per_task=8, seed=0)
    build_synthetic(stream, spec, progress=False, processes=os.cpu_count() or 1)
    base = _base(args)
    tried: dict[int, Any] = {}
    b, best = args.start_batch, None
    while b <= min(args.global_batch, args.max_batch or args.global_batch):
        tried[b] = _fitting(stream, tmp / f"b{b}", {**base, "batch_size": b})
        if tried[b] is None:
            tried[b] = "out of memory"
            break
        best, b = b, b * 2
    if best is None:
        return {"tried": tried, "error": f"batch {args.start_batch} does not fit"}
    b, row = best, None  # cached at the largest plain batch, halved while its features do not fit
    while row is None and b >= 1:
        k = args.global_batch // b
        cached = {**base, "batch_size": b, "grad_accum": k, "accum_mode": "cached"}
        row = _fitting(stream, tmp / f"cached{b}", cached)
        b = b if row is not None else b // 2
    if row is None:
        return {"tried": tried, "error": "cached accumulation does not fit"}
    res = {"largest_plain_batch": best, "tried": tried, "cached": {"K": k, "B": b, **row}}
    for name, r in (("largest", tried[best]), ("cached", row)):
        if r["step_s"]:
            res[f"{name}_samples_per_s"] = round(r["samples_per_step"] / r["step_s"], 1)
    return res


def markdown(res: dict[str, Any]) -> str:
    """The table of docs/scaling.md: per method and K, each mode's step time and memory
    (MB), with their ratios to one batch of K·B."""

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "–"
        if "refused" in r:
            return "refused"
        mb = f"{r['memory_bytes'] / 1e6:.2f} MB" if r.get("memory_bytes") else "–"
        ratios = (
            f" ({r['step_ratio']:.2f} ×, {r['memory_ratio']:.2f} ×)" if "step_ratio" in r else ""
        )
        return f"{r['step_s']:.3f} s, {mb}{ratios}"

    lines = [
        "| method | K | one batch of K·B | plain K × B (÷ one) | cached K × B (÷ one) |",
        "|---|---|---|---|---|",
    ]
    for method, rows in res["results"].items():
        for k, row in rows.items():
            one, plain, cached = row["one"], row.get("plain"), row.get("cached")
            lines.append(f"| {method} | {k[2:]} | {cell(one)} | {cell(plain)} | {cell(cached)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--ks", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--batch", type=int, default=8, help="B: pairs per micro-batch")
    ap.add_argument("--steps", type=int, default=5, help="steps per task (task 2 timed)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model-config", default="", help="tiny-vit on the CPU, ViT-B-16 on CUDA")
    ap.add_argument("--precision", choices=("no", "bf16", "fp16"), default="no")
    ap.add_argument("--workers", type=int, default=0, help="loader workers (-1: auto)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=0, help="CUDA: the GPU measurement")
    ap.add_argument("--start-batch", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=0, help="stop doubling here (0: at OOM)")
    ap.add_argument("--markdown", default="", help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer takes a GPU when it sees one
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    args.model_config = args.model_config or ("tiny-vit" if args.device == "cpu" else "ViT-B-16")
    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {
        "benchmark": "gradient accumulation: one batch of K*B vs plain and cached K x B",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "cpus": os.cpu_count(),
        "load": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "model_config": args.model_config,
        "precision": args.precision,
        "batch": args.batch,
        "steps": args.steps,
        "threads": args.threads,
        "step_time": "CPU s of this process" if args.device == "cpu" else "wall s (synced)",
        "memory": "tensors measure (cvl.train.memory)"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated",
        "time": time.strftime("%Y-%m-%d %H:%M"),
    }
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.global_batch:
            res["global_batch"] = {"N": args.global_batch, **global_batch(args, tmp)}
        else:
            stream = tmp / "stream"
            per_task = max(args.ks) * args.batch * args.steps
            size = 32 if args.model_config.startswith("tiny") else _image_size(args.model_config)
            spec = SynthSpec(tasks=2, per_task=per_task, image_size=size, test_per_task=8, seed=0)
            build_synthetic(stream, spec, progress=False)
            res["results"] = table(args, stream, tmp)
    res["load_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(res, indent=2))
    if args.markdown and "results" in res:
        Path(args.markdown).write_text(markdown(res) + "\n")


if __name__ == "__main__":
    main()
