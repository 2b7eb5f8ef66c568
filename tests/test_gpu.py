"""On a CUDA device (tests marked `gpu`, skipped elsewhere; `make gpu-check` runs them): every
method trains on CUDA in float32 and bf16, CTP on the fusion model, and `cvl eval` runs there
and agrees with the CPU. Bitwise resume on CUDA is the `cuda` case of the resume tests
(test_reliability_resume, test_train, test_selection)."""

from __future__ import annotations

import json
import math

import pytest
from reliability_helpers import cli, method_args, trained_methods

from cvl.runs import finished_tasks, load_run

pytestmark = pytest.mark.gpu

STEPS = 2  # optimizer steps per task: both tasks train, so the old-model terms run too


@pytest.fixture(scope="module")
def two_tasks(tmp_path_factory):
    """2 tasks × 16 training pairs, small eval sets."""
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    out = tmp_path_factory.mktemp("gpu") / "s"
    spec = SynthSpec(
        tasks=2,
        per_task=16,
        test_per_task=8,
        val_per_task=4,
        query_per_task=4,
        gallery_per_task=8,
        overlap=0,
        seed=0,
    )
    build_synthetic(out, spec, progress=False)
    return out


def _train(stream, out, method: str, precision: str, *extra: str) -> None:
    cli(
        [
            *("train", "--stream", str(stream), "--out", str(out), "--method", method),
            *method_args(method, stream),
            *("--model-config", "tiny", "--epochs", "1", "--batch-size", "8"),
            *("--max-steps-per-task", str(STEPS), "--checkpoint-every", "1"),
            *("--log-with", "none", "--quiet", "--workers", "0"),
            *("--device", "cuda", "--precision", precision, *extra),
        ]
    )


def _check(out, tasks: int) -> None:
    run = load_run(out)
    assert run["runtime"]["device"].startswith("cuda"), run["runtime"]
    assert run["runtime"]["deterministic"] is False  # the GPU default
    done = finished_tasks(out)
    assert len(done) == tasks
    for c in done:
        for rec in map(json.loads, (c.path / "train_log.jsonl").read_text().splitlines()):
            assert math.isfinite(rec["loss"]), (c.name, rec)


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("method", trained_methods())
def test_every_method_trains_on_cuda(method, precision, two_tasks, tmp_path):
    from cvl.methods.registry import all_methods

    _train(two_tasks, tmp_path / "r", method, precision)
    single = getattr(all_methods()[method]({}), "single_task", False)  # joint: the last only
    _check(tmp_path / "r", 1 if single else 2)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_ctp_on_the_fusion_model_on_cuda(precision, two_tasks, tmp_path):
    _train(two_tasks, tmp_path / "r", "ctp", precision, "--model", "fusion")
    _check(tmp_path / "r", 2)
    assert load_run(tmp_path / "r")["config"]["model"] == "fusion"


def test_eval_on_cuda_matches_the_cpu(two_tasks, tmp_path):
    """`cvl eval --run R --device cuda` of a run trained on CUDA: the same R matrix as on the
    CPU (float32 embeddings agree to rounding; a near-tie may flip one rank, hence 1 point)."""
    run = tmp_path / "r"
    _train(two_tasks, run, "seqft", "no")
    common = ["eval", "--run", str(run), "--no-probe", "--no-plots", "--quiet"]
    cli([*common, "--device", "cuda", "--out", str(tmp_path / "gpu")])
    cli([*common, "--device", "cpu", "--out", str(tmp_path / "cpu")])
    mg = json.loads((tmp_path / "gpu" / "metrics.json").read_text())
    mc = json.loads((tmp_path / "cpu" / "metrics.json").read_text())
    for rg, rc in zip(mg["matrices"]["Rm"], mc["matrices"]["Rm"], strict=True):
        for a, b in zip(rg, rc, strict=True):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1.0), (rg, rc)
