"""`cvl train --budget` (cvl.train.budget): parsing and shares, steps derived from the
measured cost per step (a method costing 1.5 × seqft's step gets 2/3 of the steps), the run
stops at the derived step and trains exactly like the same number of steps without a budget,
for every registered method (the probe that measures a step undoes it), and resumes bitwise
after a SIGKILL without measuring again."""

from __future__ import annotations

import json
import math
import random

import pytest
from reliability_helpers import (
    STEPS,
    assert_same_run,
    build_tiny_stream,
    cli,
    comparable,
    kill_when,
    log_lines,
    train_argv,
    trained_methods,
)
from train_helpers import FAST, assert_same_task_weights, task_log, train_run

from cvl.errors import CvlError
from cvl.losses import clip_loss
from cvl.methods.base import Method, base_loss
from cvl.methods.registry import _REGISTRY, register
from cvl.runs import finished_tasks
from cvl.train.budget import Budget, derive_steps, parse_budget, task_share
from cvl.train.cli import BUFFER_CHOICES


def _task_json(run, i: int) -> dict:
    return json.loads((finished_tasks(run)[i].path / "task.json").read_text())


@pytest.mark.parametrize(
    "spec, want",
    [
        ("tflops=2.5", ("tflops", 2.5, False)),
        ("samples=20000/task", ("samples", 20000.0, True)),
        ("maf=1e3", ("maf", 1000.0, False)),
        (" tflops = 3 ", ("tflops", 3.0, False)),
    ],
)
def test_parse_budget(spec, want):
    b = parse_budget(spec)
    assert (b.kind, b.amount, b.per_task) == want


@pytest.mark.parametrize("spec", ["flops=3", "tflops=", "tflops=-1", "tflops=0", "tflops=x", "3"])
def test_parse_budget_refuses_bad_specs(spec):
    with pytest.raises(CvlError, match="expected samples=N, tflops=N or maf=N"):
        parse_budget(spec)


def test_shares_follow_task_sizes():
    b = Budget("tflops", 10.0, False, "tflops=10")
    counts = {0: 200, 1: 100, 2: 100}
    assert [task_share(b, counts, i, 3, False) for i in range(3)] == [5.0, 2.5, 2.5]
    assert task_share(b, {2: 400}, 2, 3, True) == 10.0  # joint: one task, all of it
    per = Budget("tflops", 2.0, True, "tflops=2/task")
    assert task_share(per, counts, 1, 3, False) == 2.0
    assert task_share(per, {2: 400}, 2, 3, True) == 6.0  # joint stands for the 3 tasks
    # TiC's Oracle (joint restart=true): task t stands for tasks 0..t
    assert [task_share(per, counts, i, 3, False, seen=True) for i in range(3)] == [2.0, 4.0, 6.0]
    assert [task_share(b, counts, i, 3, False, seen=True) for i in range(3)] == [5.0, 7.5, 10.0]
    assert derive_steps(6.0, 1.0, 10) == (6, 6)  # exact multiples are not lost to rounding
    assert derive_steps(6.0, 1.0, 4) == (6, 4)  # capped by the epochs
    assert derive_steps(0.5, 1.0, 4) == (1, 1)  # less than one step: one


def _step_flops(stream, tmp_path, **kw) -> list[int]:
    """Each task's counted step of an unbudgeted run of `kw`."""
    train_run(stream, tmp_path / "measure", FAST, max_steps_per_task=1, **kw)
    return [_task_json(tmp_path / "measure", i)["cost"]["flops_per_step"] for i in range(3)]


def test_budget_stops_at_the_derived_step_and_trains_like_that_many_steps(synth_stream, tmp_path):
    """tflops per task worth 3.5 seqft steps: 3 steps of the 6 an epoch allows (FAST), the
    schedule spanning them; bit-identical to `--max-steps-per-task 3` without a budget."""
    step = _step_flops(synth_stream, tmp_path)[0]
    budget = f"tflops={3.5 * step / 1e12!r}/task"
    train_run(synth_stream, tmp_path / "b", FAST, budget=budget)
    train_run(synth_stream, tmp_path / "m", FAST, max_steps_per_task=3)
    assert_same_task_weights(tmp_path / "b", tmp_path / "m")
    for i in range(3):
        t = _task_json(tmp_path / "b", i)
        b = t["budget"]
        assert t["steps"] == 3 and [r["step"] for r in task_log(tmp_path / "b", i)][-1] == 3
        assert b["steps"] == b["steps_trained"] == 3 and not b["capped"]
        assert b["flops_per_step"] == step == t["cost"]["flops_per_step"]
        assert b["step_counted_on"] == "probe" and b["upper_bound"] == 6
        assert b["spent"] == pytest.approx(3 * step / 1e12)
        assert b["unspent"] == pytest.approx(0.5 * step / 1e12)


class _OneAndAHalf(Method):
    """Test method: seqft plus an extra forward + backward on half of each batch."""

    def loss(self, batch, out, ctx):
        terms = base_loss(ctx.model, batch, out, ctx)
        h = batch["image"].shape[0] // 2
        o = ctx.model(batch["image"][:h], batch["text"][:h])
        terms["half"] = 0.1 * clip_loss(o["image_features"], o["text_features"], o["logit_scale"])
        return terms


@pytest.fixture
def x15():
    """The method, registered for one test only (the registry parametrizes other tests)."""
    register("test_x15")(_OneAndAHalf)
    yield "test_x15"
    _REGISTRY.pop("test_x15", None)


def test_a_step_costing_one_and_a_half_gets_two_thirds_of_the_steps(synth_stream, tmp_path, x15):
    """Same tflops budget: seqft's step buys 6 steps, a step 1.5 × as costly buys 4."""
    seq = _step_flops(synth_stream, tmp_path)[0]
    budget = f"tflops={6.5 * seq / 1e12!r}/task"
    train_run(synth_stream, tmp_path / "seq", FAST, budget=budget, epochs=2)
    train_run(synth_stream, tmp_path / "x15", FAST, budget=budget, epochs=2, method=x15)
    for i in range(3):
        a, b = _task_json(tmp_path / "seq", i), _task_json(tmp_path / "x15", i)
        ratio = b["budget"]["flops_per_step"] / a["budget"]["flops_per_step"]
        assert ratio == pytest.approx(1.5, rel=0.01)
        assert (a["steps"], b["steps"]) == (6, 4)


def test_samples_budget_needs_no_measurement(synth_stream, tmp_path, monkeypatch):
    """samples=N for the stream: each task (96 pairs of 288) gets N/3 samples = N/3/16 steps;
    no probe runs."""

    def no_probe(*a, **k):
        raise AssertionError("samples budgets need no probe")

    monkeypatch.setattr("cvl.train.budget.probe_step", no_probe)
    train_run(synth_stream, tmp_path / "s", FAST, budget="samples=200", epochs=3)
    for i in range(3):
        t = _task_json(tmp_path / "s", i)
        assert t["steps"] == math.floor(200 / 3 / 16) == 4 and t["budget"]["cost_per_step"] == 16


def test_a_budget_beyond_the_epochs_is_capped_and_said(synth_stream, tmp_path, capsys):
    train_run(synth_stream, tmp_path / "c", FAST, budget="samples=1000/task")
    t = _task_json(tmp_path / "c", 0)
    assert t["steps"] == 6 and t["budget"]["steps"] == 62 and t["budget"]["capped"]
    assert t["budget"]["unspent"] == 1000 - 6 * 16
    assert "allow 6: training 6 (raise --epochs to spend the rest)" in capsys.readouterr().out


def test_maf_budget_uses_a_seqft_reference_step(synth_stream, tmp_path):
    """maf: the reference step (base loss, no update) of seqft costs what seqft's step does;
    LwF's step adds the old model's forward, and its old model the memory (on the CPU the
    resident set, so only a bound is checked)."""
    train_run(synth_stream, tmp_path / "seq", FAST, budget="maf=1/task")
    train_run(synth_stream, tmp_path / "lwf", FAST, budget="maf=1/task", method="lwf")
    s, lw = _task_json(tmp_path / "seq", 1)["budget"], _task_json(tmp_path / "lwf", 1)["budget"]
    assert s["reference"]["flops_per_step"] == s["flops_per_step"]
    assert lw["reference"]["flops_per_step"] == s["flops_per_step"] < lw["flops_per_step"]
    for b in (s, lw):
        assert b["cost_per_step"] == pytest.approx(b["flops_per_step"] / 1e12 * b["memory_ratio"])
        assert 0.5 < b["memory_ratio"] < 2.0
        assert b["maf_per_step_gflops"] == pytest.approx(b["cost_per_step"] * 1e3)


def test_budget_is_a_result_setting(synth_stream, tmp_path):
    """Another budget is another run: refused on resume without --force."""
    train_run(synth_stream, tmp_path / "r", FAST, budget="samples=100", max_steps_per_task=1)
    with pytest.raises(CvlError, match="budget: 'samples=100' -> 'samples=200'"):
        train_run(synth_stream, tmp_path / "r", FAST, budget="samples=200", max_steps_per_task=1)


# -- every method; SIGKILL and resume ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("budget") / "s")


@pytest.mark.slow
@pytest.mark.parametrize("method", trained_methods())
def test_every_method_trains_under_a_budget_as_without(method, tiny, tmp_path):
    """Every registered method (and the buffer it needs): a budget measured by the probe
    (larger than the run allows, so every task trains its 4 steps) leaves the run bit for bit
    as the unbudgeted one: the probe's step is undone completely."""
    cli(train_argv(tiny, tmp_path / "plain", method))
    cli(train_argv(tiny, tmp_path / "budget", method) + ["--budget", "tflops=1000"])
    assert_same_run_but_budget(tmp_path / "plain", tmp_path / "budget")
    for c in finished_tasks(tmp_path / "budget"):
        t = json.loads((c.path / "task.json").read_text())
        assert t["budget"]["capped"] and t["budget"]["steps_trained"] == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("buffer", BUFFER_CHOICES)
@pytest.mark.parametrize("method", ["seqft", "lwf"])
def test_every_buffer_trains_under_a_budget_as_without(method, buffer, tiny, tmp_path):
    """The same with each replay buffer (its state is part of what the probe restores)."""
    extra = ["--buffer", buffer] + ([] if buffer == "cumulative-all" else ["--buffer-size", "8"])
    cli(train_argv(tiny, tmp_path / "plain", method) + extra)
    cli(train_argv(tiny, tmp_path / "budget", method) + extra + ["--budget", "tflops=1000"])
    assert_same_run_but_budget(tmp_path / "plain", tmp_path / "budget")


@pytest.mark.slow
@pytest.mark.parametrize("tune", ["lora", "dora", "bitfit", "locked-image"])
def test_tuned_runs_train_under_a_budget_as_without(tune, tiny, tmp_path):
    """The same with --tune: the probe's step trains the task's fresh adapters (or the
    unfrozen parameters) and is undone with them."""
    extra = ["--tune", tune]
    cli(train_argv(tiny, tmp_path / "plain", "lwf") + extra)
    cli(train_argv(tiny, tmp_path / "budget", "lwf") + extra + ["--budget", "tflops=1000"])
    assert_same_run_but_budget(tmp_path / "plain", tmp_path / "budget")


def assert_same_run_but_budget(a, b) -> None:
    """`assert_same_run`, with task.json's budget record and the step's source set aside."""
    import reliability_helpers as rh

    real = rh.comparable

    def lenient(d):
        d = real({k: v for k, v in d.items() if k != "budget"})
        if isinstance(d.get("cost"), dict):
            d["cost"] = {k: v for k, v in d["cost"].items() if k != "step_counted_on"}
        return d

    rh.comparable = lenient
    try:
        assert_same_run(a, b)
    finally:
        rh.comparable = real


@pytest.mark.slow
def test_budgeted_run_killed_and_resumed_is_bitwise_and_not_measured_again(
    tiny, tmp_path, monkeypatch
):
    """A SIGKILL inside task 2 of a budgeted run (3 of 4 steps per task); the same command
    resumes it to the bits of an uninterrupted budgeted run, reading the derived steps from
    the checkpoint (no probe for the resumed task)."""
    argv0 = train_argv(tiny, tmp_path / "m", "seqft")
    argv0[argv0.index("--max-steps-per-task") + 1] = "1"
    cli(argv0)
    step = json.loads((tmp_path / "m/tasks/00-t0/task.json").read_text())["cost"]["flops_per_step"]
    budget = ["--budget", f"tflops={3.5 * step / 1e12!r}/task"]
    cli(train_argv(tiny, tmp_path / "whole", "seqft") + budget)
    argv = train_argv(tiny, tmp_path / "cut", "seqft") + budget
    log = tmp_path / "cut" / "logs" / "01-t1.jsonl"
    kill_when(argv, lambda: log_lines(log) >= random.Random("budget").randint(1, 2))
    assert not (tmp_path / "cut" / "tasks" / "01-t1").exists()
    import cvl.train.budget as bud

    real = bud.probe_step

    def probe(trainer, ctx, batches):
        assert ctx.task_index != 1, "the resumed task measured again"
        return real(trainer, ctx, batches)

    monkeypatch.setattr(bud, "probe_step", probe)
    cli(argv)
    assert assert_same_run(tmp_path / "whole", tmp_path / "cut") == 3
    for c in finished_tasks(tmp_path / "cut"):
        t = comparable(json.loads((c.path / "task.json").read_text()))
        assert t["steps"] == 3 and t["budget"]["steps_trained"] == 3
