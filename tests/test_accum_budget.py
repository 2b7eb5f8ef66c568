"""`--budget` under `--accum-mode cached` (cvl/train/budget.py's probe runs the cached step)
and the records saying which accumulation ran (task.json / run.json "cost").

One task of 32 pairs, the tiny ViT, K = 4 micro-batches of B = 8. A cached step is one batch
of 32's step plus one more forward of the 32 rows (the second pass), so:

- its FLOPs exceed one batch of 32's by exactly that forward, counted here on its own;
- against plain K × B (forward F, backward ≤ 2F: weight and input gradients of every matmul,
  the patch embedding's input gradient skipped; ≥ F), cached / plain = 1 + F / plain lies in
  [1 + 1/3, 1 + 1/2] (the loss matrices are 32 × 32 instead of 4 of 8 × 8: ~0.06 % more);
- the probe's count equals the count of the loop's own first cached step, and a tflops budget
  buys budget / that count steps (fewer than plain's: the re-forward is paid for).
"""

from __future__ import annotations

import json
import math

import pytest
from reliability_helpers import cli, train_argv

from cvl.runs import finished_tasks

K, B = 4, 8


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    out = tmp_path_factory.mktemp("accum_budget") / "stream"
    spec = SynthSpec(tasks=1, per_task=K * B, test_per_task=4, val_per_task=4, overlap=0)
    build_synthetic(out, spec, progress=False)
    return out


def _run(stream, out, *extra: str) -> tuple[dict, dict]:
    """(task.json, run.json) of a one-task seqft run, at most 3 steps (3 epochs of one)."""
    argv = [*train_argv(stream, out, "seqft"), "--model-config", "tiny-vit", "--epochs", "3"]
    cli([*argv, "--max-steps-per-task", "3", "--checkpoint-every", "0", *extra])
    (task,) = finished_tasks(out)
    run = json.loads((out / "run.json").read_text())
    return json.loads((task.path / "task.json").read_text()), run


def _forward_flops(rows: int) -> int:
    """FLOPs of the tiny ViT CLIP's training forward on `rows` pairs (images and texts)."""
    import torch

    from cvl.models import build_model
    from cvl.train.cost import count_flops

    model = build_model("clip", "tiny-vit").train()
    size = model.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    images = torch.zeros(rows, 3, size, size)
    with torch.no_grad():
        return count_flops(model, images, model.tokenizer(["a caption"] * rows))[0]


ACCUM = ("--batch-size", str(B), "--grad-accum", str(K))
CACHED = (*ACCUM, "--accum-mode", "cached")


def test_a_cached_step_counts_its_second_forward_and_a_budget_pays_for_it(stream, tmp_path):
    one, _ = _run(stream, tmp_path / "one", "--batch-size", str(K * B), "--max-steps-per-task", "1")
    plain, _ = _run(stream, tmp_path / "plain", *ACCUM, "--max-steps-per-task", "1")
    cached, run = _run(stream, tmp_path / "cached", *CACHED, "--max-steps-per-task", "1")
    f_one, f_plain = one["cost"]["flops_per_step"], plain["cost"]["flops_per_step"]
    f_cached = cached["cost"]["flops_per_step"]
    assert cached["cost"]["step_counted_on"].startswith("step 1")  # the loop's own step
    # one batch of K·B's step + the second pass: one more forward of the K·B rows, exactly
    assert f_cached - f_one == _forward_flops(K * B)
    ratio = f_cached / f_plain  # measured 1.3344 (module doc: in [4/3, 3/2])
    assert 4 / 3 - 1e-3 <= ratio <= 1.5, ratio

    # --budget tflops under cached mode: the probe counts the step the loop trains, and the
    # budget buys budget / that count steps: 2.5 steps' worth buys 2 (plain's 3: 3.34 steps)
    budget = f"tflops={2.5 * f_cached / 1e12!r}/task"
    cb, cb_run = _run(stream, tmp_path / "cb", *CACHED, "--budget", budget)
    assert cb["budget"]["flops_per_step"] == f_cached
    assert cb["steps"] == cb["budget"]["steps_trained"] == math.floor(2.5) == 2
    assert math.floor(2.5 * f_cached / f_plain) == 3  # what the same budget buys plain K × B
    assert cb["cost"]["train_flops"] == 2 * f_cached

    # the records say which accumulation ran
    for rec, mode in ((cached, "cached"), (cb, "cached"), (plain, "plain"), (one, "plain")):
        assert (rec["cost"]["grad_accum"], rec["cost"]["accum_mode"]) == (
            K if rec is not one else 1,
            mode,
        )
    assert (run["cost"]["grad_accum"], run["cost"]["accum_mode"]) == (K, "cached")
    assert run["config"]["accum_mode"] == "cached"
    assert cb_run["cost"]["accum_mode"] == "cached"


@pytest.mark.matrix  # three maf runs (~4 s): make matrix
def test_maf_memory_of_a_cached_step_holds_the_step_inputs_not_its_activations(stream, tmp_path):
    """`--budget maf` (memory `tensors` on the CPU): the cached step holds every micro-batch's
    images and the step's features (plain holds one micro-batch's images, saved by the patch
    embedding) and one micro-batch's activations (one batch of K·B holds K times those)."""
    maf = ("--budget", "maf=1000", "--max-steps-per-task", "1")
    m = {
        name: _run(stream, tmp_path / name, *args, *maf)[0]["budget"]["memory_bytes"]
        for name, args in (
            ("one", ("--batch-size", str(K * B))),
            ("plain", ACCUM),
            ("cached", CACHED),
        )
    }
    image = 3 * 32 * 32 * 4  # one 32 × 32 float image of the synthetic stream
    assert m["plain"] + (K - 1) * B * image <= m["cached"] < m["one"], m
