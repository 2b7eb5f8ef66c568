"""Host time per step: cvl's SeqF step vs a bare open_clip step, on a model with ViT-B-32's
structure (12 + 12 blocks, 277 modules, 302 parameter tensors) and tiny widths, so a step is
nearly all host work: Python, dispatch, kernel launches (JSON on stdout).

Both steps take the same inputs the same way: uint8 HWC pixels made once, normalised at
every step by cvl's own device transform (`SplitTransform.finish`), and pre-made tokens;
the bare step is `bench_determinism.make_step` (forward, ClipLoss, backward, AdamW,
zero_grad), cvl's the real `Trainer` (`bench_step.cvl_step_times`, the loader replaced
by the pre-made batch; log lines every `--log-every` steps, no mid-task checkpoints). CPU
seconds of this process, one torch thread, GPUs hidden. The two are paired step by step:
each cvl step is followed by one bare step (on a copy of the model), so a pair shares the
machine's load; the median over pairs of (cvl - bare) is the loop's host work per step
(the mean also counts each log line's share).

    python benchmarks/bench_host.py [--steps 200] [--repeats 3] [--batch 4]

Issue 45's goal: cvl adds at most 0.5 ms of host time per step over the bare step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer takes a GPU when it sees one
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_determinism import make_step  # noqa: E402
from bench_step import cvl_step_times  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ViT-B-32's layout (open_clip's config: 12 vision blocks, patch 32; 12 text blocks, 77
# tokens) at width 16: what a step launches and walks is ViT-B-32's, its arithmetic is not.
HOST_CONFIG = {
    "kind": "clip",
    "name": "vit-b-32-structure",
    "model_cfg": {
        "embed_dim": 16,
        "vision_cfg": {
            "layers": 12,
            "width": 16,
            "head_width": 8,
            "patch_size": 32,
            "image_size": 32,
        },
        "text_cfg": {
            "context_length": 77,
            "vocab_size": 1024,
            "width": 16,
            "heads": 2,
            "layers": 12,
        },
    },
    "tokenizer": {"type": "hash", "vocab_size": 1024, "context_length": 77},
}


def paired_times(stream: Path, out: Path, common: dict, steps: int, premade: dict, bare: Any):
    """One cvl run whose every step is followed by one bare step (`bare()`, on its own copy of
    the model): [(cvl step, bare step)] CPU seconds, each pair measured back to back."""
    from cvl.methods.seqft import SeqFT

    starts: list[float] = []
    real = SeqFT.after_step

    def after_step(self, ctx):  # cvl_step_times stamps the clock right after this returns
        real(self, ctx)
        starts.append(time.process_time())
        bare()

    SeqFT.after_step = after_step
    try:
        ends = [c for _, c in cvl_step_times(stream, out, common, steps, premade)]
    finally:
        SeqFT.after_step = real
    return [(a1 - e0, e0 - a0) for a0, e0, a1 in zip(starts, ends, starts[1:])]


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched (each one a kernel launch on a GPU, or more)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def op_counts(stream: Path, out: Path, common: dict, premade: dict, bare: Any) -> dict:
    """Operators per step of cvl (median over 20 steps, and the mean with the log line's) and
    of the bare step: a count, free of the machine's load."""
    from cvl.methods.seqft import SeqFT

    counter, marks, real = OpCounter(), [], SeqFT.after_step

    def after_step(self, ctx):
        real(self, ctx)
        marks.append(counter.n)

    SeqFT.after_step = after_step
    try:
        with counter:
            cvl_step_times(stream, out, common, 22, premade)
            bare()  # its first step also creates AdamW's state
            before = counter.n
            bare()
            bare_ops = counter.n - before
    finally:
        SeqFT.after_step = real
    per = [b - a for a, b in zip(marks[1:], marks[2:])]
    return {
        "bare": bare_ops,
        "cvl_median": statistics.median(per),
        "cvl_mean": statistics.fmean(per),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200, help="steps per timed run")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from cvl.data.augment import train_transform
    from cvl.models import build_model
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    torch.manual_seed(0)
    model = build_model("clip", HOST_CONFIG)
    b, s = args.batch, model.image_size
    dev = torch.device("cpu")
    tokens = model.tokenizer([f"a photo of shape {i % 7} in colour {i % 5}" for i in range(b)])
    pixels = torch.randint(0, 256, (b, s, s, 3), dtype=torch.uint8)
    split = train_transform(s, "openclip", dev)  # the loop's device half of the transform

    def feed() -> torch.Tensor:  # what cvl's loop does with a loader batch's pixels
        return split.finish({"image": pixels}, dev)

    bare = make_step(copy.deepcopy(model), feed, tokens, "no")  # torch's CPU AdamW, as cvl's
    premade = {"image": pixels, "text": tokens, "n_replaced": 0}
    pairs: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "model.json"
        cfg_path.write_text(json.dumps(HOST_CONFIG))
        stream = Path(tmp) / "stream"
        spec = SynthSpec(tasks=1, per_task=4 * b, image_size=s, test_per_task=4, seed=0)
        build_synthetic(stream, spec, progress=False)
        common = {
            "model_config": str(cfg_path),
            "batch_size": b,
            "checkpoint_every": 0,
            "log_every": args.log_every,
            "workers": 0,
        }
        ops = op_counts(stream, Path(tmp) / "ops", common, premade, bare)
        for r in range(args.repeats):
            t = paired_times(stream, Path(tmp) / f"c{r}", common, args.steps, premade, bare)
            pairs += t[args.warmup :]
    diff = [1e3 * (c - b) for c, b in pairs]
    print(
        json.dumps(
            {
                "model": "ViT-B-32 structure, width 16 (277 modules, 302 parameter tensors)",
                "batch": b,
                "pairs": len(pairs),
                "log_every": args.log_every,
                "clock": "CPU seconds of this process, 1 torch thread",
                "bare_ms_median": round(1e3 * statistics.median(x for _, x in pairs), 3),
                "cvl_ms_median": round(1e3 * statistics.median(x for x, _ in pairs), 3),
                "cvl_minus_bare_ms_median": round(statistics.median(diff), 3),
                "cvl_minus_bare_ms_mean": round(statistics.fmean(diff), 3),
                "cvl_minus_bare_ms_quartiles": [
                    round(q, 3) for q in statistics.quantiles(diff, n=4)
                ],
                "goal_ms": 0.5,
                "operators_per_step": ops,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
