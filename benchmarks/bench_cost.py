"""What each method's training step costs in FLOPs, and what counting them costs (JSON).

Two parts:

- `methods`: every registered method (or `--methods`) trains `--steps` steps per task of a
  3-task synthetic stream (256 pairs per task) with the tiny ViT CLIP (batch 64, 4 steps an
  epoch; the buffer it needs, 32 pairs), and the cost `cvl train` records in task.json is
  read back for task 2 (where old, reference and momentum models exist; not the last task,
  after which the importance passes are skipped): the counted FLOPs per step relative to
  SeqF's, and the per-task extras (Fisher / importance passes, buffer selection, AFEC's
  expanded model, DHA's validation) in SeqF steps. FLOPs are counted, not timed: these ratios are exact on any machine.
- `overhead`: wall time of a bare training step (forward, InfoNCE, backward, AdamW) plain,
  under cvl's FLOP meter and under torch's `FlopCounterMode`, interleaved `--repeats` times
  (fastest of each kept): what the one counted step per task costs.

    python benchmarks/bench_cost.py                    # both parts, CPU-sized
    python benchmarks/bench_cost.py --part overhead --model-config ViT-B-32 --batch 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # cvl without installing it

# what a method needs to run on the tiny stream (tests/reliability_helpers.py has the same)
NEEDS = {
    "incclip": ["--buffer", "reservoir", "--buffer-size", "32"],
    "zscl": ["--method-arg", "ref_stream={stream}"],
}


def method_costs(methods: list[str], steps: int, root: Path) -> dict[str, Any]:
    """task.json costs of a short run of each method (task 2), relative to SeqF's step."""
    from cvl.cli import main
    from cvl.methods.registry import all_methods
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    stream = root / "stream"
    spec = SynthSpec(tasks=3, per_task=256, test_per_task=8, val_per_task=16)
    build_synthetic(stream, spec, progress=False)
    out: dict[str, Any] = {}
    for m in ["seqft", *[x for x in methods if x != "seqft"]]:
        cls = all_methods()[m]
        if not getattr(cls, "trains", True):
            continue
        extra = [a.format(stream=stream) for a in NEEDS.get(m, [])]
        if getattr(cls, "needs_buffer", False) and not extra:
            extra = ["--buffer", getattr(cls, "buffer_hint", "reservoir"), "--buffer-size", "32"]
        run = root / m
        argv = ["train", "--stream", str(stream), "--out", str(run), "--method", m, *extra]
        argv += ["--model-config", "tiny-vit", "--batch-size", "64", "--epochs", "1"]
        argv += ["--max-steps-per-task", str(steps), "--log-with", "none", "--quiet"]
        argv += ["--workers", "0", "--device", "cpu"]
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON
            assert main(argv) in (0, None), m
        tasks = sorted((run / "tasks").iterdir())
        cost = json.loads((tasks[1 if len(tasks) > 1 else 0] / "task.json").read_text())["cost"]
        out[m] = {
            "flops_per_step": cost["flops_per_step"],
            "extras_flops": {k: v["flops"] for k, v in cost["extras"].items() if v["flops"]},
        }
    seq = out["seqft"]["flops_per_step"]
    for r in out.values():
        r["step_vs_seqft"] = round(r["flops_per_step"] / seq, 3)
        r["extras_in_seqft_steps"] = {k: round(v / seq, 2) for k, v in r["extras_flops"].items()}
    return out


def overhead(config: str, batch: int, steps: int, repeats: int, device: str) -> dict[str, Any]:
    """Seconds per bare step: plain, under cvl's meter, under FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from cvl.losses import clip_loss
    from cvl.models import build_model
    from cvl.train.cost import FlopMeter

    dev = torch.device(device)
    torch.manual_seed(0)
    model = build_model("clip", config).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    img = torch.randn(batch, 3, model.image_size, model.image_size, device=dev)
    txt = model.tokenizer(["a small red square in the corner"] * batch).to(dev)

    def step() -> None:
        out = model(img, txt)
        clip_loss(out["image_features"], out["text_features"], out["logit_scale"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(mode: str) -> float:
        best = float("inf")
        for _ in range(steps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            if mode == "plain":
                step()
            elif mode == "meter":
                m = FlopMeter()
                with m.counting("s"):
                    step()
            else:
                with FlopCounterMode(display=False):
                    step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t)
        return best

    for _ in range(3):
        step()  # warm-up
    res = {k: float("inf") for k in ("plain", "meter", "flop_counter_mode")}
    for _ in range(repeats):
        for k in res:
            res[k] = min(res[k], timed(k))
    return {
        "model_config": config,
        "batch": batch,
        "device": device,
        "seconds_per_step": {k: round(v, 5) for k, v in res.items()},
        "meter_vs_plain": round(res["meter"] / res["plain"], 2),
        "flop_counter_mode_vs_plain": round(res["flop_counter_mode"] / res["plain"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=["all", "methods", "overhead"], default="all")
    p.add_argument("--methods", default="", help="comma list (default: every method)")
    p.add_argument("--steps", type=int, default=2, help="steps per task (methods part)")
    p.add_argument("--model-config", default="tiny-vit", help="overhead part")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    res: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if a.part in ("all", "overhead"):
        res["overhead"] = overhead(a.model_config, a.batch, 5, a.repeats, a.device)
    if a.part in ("all", "methods"):
        from cvl.methods.registry import all_methods

        methods = [m for m in a.methods.split(",") if m] or list(all_methods())
        with tempfile.TemporaryDirectory() as d:
            res["methods"] = method_costs(methods, a.steps, Path(d))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
