"""`cvl train --budget` (cvl.train.budget): parsing, options and shares, FoMo-in-Flux's MAF
steps on its own Tab. 4, steps derived from the measured cost per step (a method costing 1.5 ×
seqft's step gets 2/3 of the steps), memory against full fine-tuning (LoRA, locked-image,
BitFit below it), end-of-task work charged, the run stops at the derived step and trains
exactly like the same number of steps without a budget, for every registered method (the
probes of the step and of the end of the task are undone), and resumes bitwise after a
SIGKILL without measuring again."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from reliability_helpers import (
    STEPS,
    assert_same_run,
    build_tiny_stream,
    cli,
    comparable,
    family_methods,
    kill_when,
    log_lines,
    train_argv,
)
from train_helpers import FAST, assert_same_task_weights, task_log, train_run

from cvl.errors import CvlError
from cvl.losses import clip_loss
from cvl.methods.base import Method, base_loss
from cvl.methods.registry import _REGISTRY, register
from cvl.runs import finished_tasks
from cvl.train.budget import (
    Budget,
    budget_options,
    charged_cost,
    derive_steps,
    parse_budget,
    task_share,
)
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
    assert [task_share(b, counts, i, 3, False, "equal") for i in range(3)] == [10 / 3] * 3
    assert task_share(b, {2: 400}, 2, 3, True) == 10.0  # joint: one task, all of it
    assert task_share(b, {2: 400}, 2, 3, True, "equal") == 10.0
    per = Budget("tflops", 2.0, True, "tflops=2/task")
    assert task_share(per, counts, 1, 3, False) == 2.0
    assert task_share(per, {2: 400}, 2, 3, True) == 6.0  # joint stands for the 3 tasks
    # TiC's Oracle (joint restart=true): task t stands for tasks 0..t
    assert [task_share(per, counts, i, 3, False, seen=True) for i in range(3)] == [2.0, 4.0, 6.0]
    assert [task_share(b, counts, i, 3, False, seen=True) for i in range(3)] == [5.0, 7.5, 10.0]
    assert derive_steps(6.0, 1.0, 10) == (6, 6)  # exact multiples are not lost to rounding
    assert derive_steps(6.0, 1.0, 4) == (6, 4)  # capped by the epochs
    assert derive_steps(0.5, 1.0, 4) == (1, 1)  # less than one step: one
    assert derive_steps(6.6, 1.0, 10) == (6, 6)
    assert derive_steps(6.6, 1.0, 10, "nearest") == (7, 7)
    assert derive_steps(6.4, 1.0, 10, "nearest") == (6, 6)


def test_budget_options_default_to_fomo_for_maf_and_refuse_bad_ones():
    maf, tfl = parse_budget("maf=1"), parse_budget("tflops=1")
    assert budget_options(maf, {}) == {
        "split": "equal",
        "extras": "step",
        "rounding": "nearest",
        "reference": "full",
        "memory": "auto",
    }
    assert budget_options(tfl, {}) == {"split": "pairs", "extras": "none", "rounding": "floor"}
    assert budget_options(maf, {"split": "Pairs", "extras": "none"})["split"] == "pairs"
    assert budget_options(tfl, {"extras": "step"})["extras"] == "step"
    for b, given, err in [
        (maf, {"splitt": "equal"}, "unknown"),
        (maf, {"split": "size"}, "expected equal or pairs"),
        (tfl, {"reference": "tune"}, "maf budgets only"),
        (parse_budget("samples=9"), {"extras": "step"}, "counts samples"),
        (None, {"split": "equal"}, "without --budget"),
    ]:
        with pytest.raises(CvlError, match=err):
            budget_options(b, given)


# FoMo-in-Flux's Tab. 4 (its repository's images/gflops.png): ViT-B/16, batch 512; per method
# the GFLOPs of a step (end-of-task work included: EWC's Fisher pass), the memory multiplier
# w.r.t. full fine-tuning and the steps per task at T = 20, 50, 100, 200 tasks.
FOMO_TAB4 = {
    "full-ft": (63394.7585, 1, (1420, 568, 284, 142)),
    "locked-text": (57254.6183, 0.8064, (1949, 780, 390, 195)),
    "locked-image": (27176.6698, 0.2551, (12982, 5193, 2596, 1298)),
    "LNFit": (43165.5968, 0.6558, (3179, 1272, 636, 318)),
    "BitFit": (43165.5968, 0.6558, (3179, 1272, 636, 318)),
    "LoRA, r=4": (54479.2515, 0.8702, (1898, 759, 380, 190)),
    "LoRA, r=64": (54505.0151, 0.873, (1891, 757, 378, 189)),
    "DoRA, r=4": (54479.8241, 0.8726, (1893, 757, 379, 189)),
    "DoRA, r=64": (54514.1754, 0.8754, (1886, 754, 377, 189)),
    "VeRA, r=4": (54479.3393, 0.8702, (1898, 759, 380, 190)),
    "VeRA, r=64": (54507.8336, 0.8708, (1896, 758, 379, 190)),
    "EWC": (6276081.094, 1.0132, (14, 6, 3, 1)),
    # the table's SI row gives MAF = its GFLOPs (not × 1.0013): its steps follow that MAF
    "SI": (63477.1716, 1, (1418, 567, 284, 142)),
}


@pytest.mark.parametrize("method", list(FOMO_TAB4))
def test_maf_steps_reproduce_fomo_in_flux_table_4(method):
    """The stream's budget, 1.8·10^9 GFLOPs (Tab. 4: 28,400 full fine-tuning steps of
    63,394.76 GFLOPs; its configs: n_samples 727,040 = 1,420 × 512 per task at T = 20),
    shared equally by T tasks; steps = share / MAF rounded to nearest: every entry."""
    gflops, mult, want = FOMO_TAB4[method]
    total = Budget("maf", 1.8e9, False, "maf=1.8e9")
    opts = budget_options(total, {})
    for n_tasks, steps in zip((20, 50, 100, 200), want):
        counts = dict.fromkeys(range(n_tasks), 1)
        share = task_share(total, counts, 0, n_tasks, False, opts["split"])
        per_step, per_task = charged_cost(gflops, 0.0, mult, opts["extras"])
        assert derive_steps(share - per_task, per_step, 10**9, opts["rounding"])[0] == steps
    if method == "full-ft":
        # the configs (continualfomo_default.yaml: 20 tasks, n_samples 727,040, batch 512)
        # give 1,420 steps per task: 28,400 steps of full fine-tuning, 1.8004·10^9 GFLOPs
        steps_cfg = 727040 // 512
        total_cfg = 20 * steps_cfg * gflops
        assert steps_cfg == 1420 and total_cfg == pytest.approx(1.8e9, rel=3e-4)
        assert derive_steps(total_cfg / 20, gflops, 10**9, "floor")[0] == 1420
        # at the table's round 1.8·10^9, ⌊·⌋ would lose the 1,420th step: to nearest keeps it
        assert derive_steps(1.8e9 / 20, gflops, 10**9, "floor")[0] == 1419


def test_extras_are_charged_per_step_or_per_task():
    """EWC-like: a step of 1 and an end-of-task pass of 98 (FLOPs), memory 1.0132 × full FT."""
    assert charged_cost(1.0, 98.0, 1.0132, "step") == pytest.approx((99 * 1.0132, 0.0))
    assert charged_cost(1.0, 98.0, 1.0132, "task") == pytest.approx((1.0132, 98 * 1.0132))
    assert charged_cost(1.0, 98.0, 2.0, "none") == (2.0, 0.0)
    share = 99 * 14.2  # FoMo: EWC at T = 20 gets 14 steps of (step + Fisher)
    assert derive_steps(share, charged_cost(1.0, 98.0, 1.0, "step")[0], 10**6, "nearest")[0] == 14
    per_step, per_task = charged_cost(1.0, 98.0, 1.0, "task")
    assert derive_steps(share - per_task, per_step, 10**6)[0] == math.floor(99 * 14.2 - 98)


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


def test_tensors_memory_of_a_linear_step_by_hand():
    """memory=tensors: weights + gradients + two moments of what trains + the activations
    autograd saves (not the weights it saves, which are counted once)."""
    from cvl.train.memory import StageMemory

    lin = torch.nn.Linear(4, 3)  # 15 floats: 60 bytes
    x = torch.randn(2, 4)  # saved by the matmul for the weight's gradient: 32 bytes
    params = list(lin.parameters())
    with StageMemory("tensors", torch.device("cpu"), params, params, True) as mem:
        lin(x).sum().backward()
        mem.micro_done()
    assert mem.value == 60 + 60 + 2 * 60 + 32
    lin.weight.requires_grad_(False)  # BitFit-like: nothing saved for a weight gradient
    with StageMemory("tensors", torch.device("cpu"), params, [lin.bias], True) as mem:
        lin(x).sum().backward()
        mem.micro_done()
    assert mem.value == 60 + 12 + 2 * 12


def test_device_memory_reads_the_device_less_what_is_not_the_stage(monkeypatch):
    """memory=device (FoMo-in-Flux's nvidia-smi reading), its arithmetic with torch.cuda
    stubbed (no GPU needed): used = total − free after the stage; the reference takes out the
    live tensors that are not its own; moments are added for a stage without an update."""
    from cvl.train import memory as mm

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1000)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (7000, 10000))
    p = torch.zeros(5)  # 20 bytes trained: moments 40
    dev = torch.device("cuda")
    with mm.StageMemory("device", dev, [p], [p], moments_allocated=True) as step:
        pass
    assert step.value == 3000
    with mm.StageMemory("device", dev, [p], [p], False, exclude_live=True) as ref:
        pass
    assert ref.value == 3000 - 1000 + 40  # p is on the CPU here: none of the live bytes is its
    with pytest.raises(CvlError, match="memory=device reads CUDA"):
        mm.resolve_measure("device", torch.device("cpu"))
    assert mm.resolve_measure("auto", torch.device("cpu")) == "tensors"
    assert mm.resolve_measure("auto", dev) == "device"


def _budget_rec(run, i: int = 1) -> dict:
    return _task_json(run, i)["budget"]


def test_maf_is_against_full_finetuning_with_extras_charged_equally_per_task(
    synth_stream, tmp_path
):
    """maf (FoMo-in-Flux): seqft's step is its own full fine-tuning reference (ratio 1 on the
    CPU's `tensors` memory); LwF's old model adds memory and its forward FLOPs; EWC's Fisher
    pass is charged to each of its steps (none after the last task); the stream's budget is
    split equally; steps = share / cost, to nearest."""
    for m in ("seqft", "lwf", "ewc"):
        train_run(synth_stream, tmp_path / m, FAST, budget="maf=0.03", method=m)
    s, lw = _budget_rec(tmp_path / "seqft"), _budget_rec(tmp_path / "lwf")
    assert s["options"] == {**budget_options(parse_budget("maf=1"), {}), "memory": "tensors"}
    assert s["reference"]["of"] == "full" and s["memory_ratio"] == 1.0
    assert s["reference"]["flops_per_step"] == s["flops_per_step"]
    assert lw["reference"]["flops_per_step"] == s["flops_per_step"] < lw["flops_per_step"]
    assert lw["memory_ratio"] > 1.0
    for run in ("seqft", "lwf", "ewc"):
        for i in range(3):
            b = _budget_rec(tmp_path / run, i)
            assert b["share"] == pytest.approx(0.01)  # equal thirds (the tasks are equal too)
            cost = (b["flops_per_step"] + b["extras_flops"]) / 1e12 * b["memory_ratio"]
            assert b["cost_per_step"] == pytest.approx(cost)
            assert b["maf_per_step_gflops"] == pytest.approx(cost * 1e3)
            assert b["steps"] == max(1, math.floor(b["share"] / cost + 0.5))
    ewc = [_budget_rec(tmp_path / "ewc", i) for i in range(3)]
    assert ewc[0]["extras_flops"] > 2 * ewc[0]["flops_per_step"]  # a Fisher pass over the task
    assert ewc[2]["extras_flops"] == 0  # the last task has no Fisher pass
    assert ewc[0]["steps"] < ewc[2]["steps"]
    assert _budget_rec(tmp_path / "seqft", 0)["extras_flops"] == 0


@pytest.mark.parametrize("tune", ["lora", "locked-image", "bitfit"])
def test_parameter_efficient_tuning_needs_less_memory_than_full_finetuning(
    synth_stream, tmp_path, tune
):
    """The reference is full fine-tuning of the same model and batch, not the run's --tune:
    LoRA, a locked image tower and BitFit hold less (FoMo-in-Flux: 0.87, 0.26, 0.66 on
    ViT-B/16); `reference=tune` (cvl's earlier choice) compares the run with itself."""
    kw = dict(budget="maf=1/task", tune=tune, method="seqft", max_steps_per_task=1)
    train_run(synth_stream, tmp_path / "full", FAST, **kw)
    train_run(synth_stream, tmp_path / "self", FAST, **kw, budget_args={"reference": "tune"})
    full, own = _budget_rec(tmp_path / "full", 0), _budget_rec(tmp_path / "self", 0)
    assert 0.0 < full["memory_ratio"] < 1.0
    assert own["memory_ratio"] == 1.0 and own["reference"]["of"] == "tune"
    assert full["reference"]["flops_per_step"] >= full["flops_per_step"]
    assert full["reference"]["memory_bytes"] > own["reference"]["memory_bytes"]


def test_cvl_choices_stay_available_for_maf(synth_stream, tmp_path):
    """split=pairs, extras=none, rounding=floor: cvl's earlier maf (memory still against
    full fine-tuning unless reference=tune)."""
    args = {"split": "pairs", "extras": "none", "rounding": "floor"}
    train_run(synth_stream, tmp_path / "c", FAST, budget="maf=0.03", method="ewc", budget_args=args)
    b = _budget_rec(tmp_path / "c", 0)
    assert "extras_flops" not in b and b["options"]["extras"] == "none"
    cost = b["flops_per_step"] / 1e12 * b["memory_ratio"]
    assert b["cost_per_step"] == pytest.approx(cost)
    assert b["steps"] == max(1, math.floor(b["share"] / cost * (1 + 1e-9)))


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
@pytest.mark.parametrize("method", family_methods())
def test_every_kind_of_method_trains_under_a_budget_as_without(method, tiny, tmp_path):
    """One method of each kind (`FAMILIES`, and the buffer it needs): a maf budget measured by
    the probes (full fine-tuning's reference step, the method's step, its end-of-task work;
    larger than the run allows, so every task trains its 4 steps) leaves the run bit for bit
    as the unbudgeted one: the probes are undone completely."""
    cli(train_argv(tiny, tmp_path / "plain", method))
    cli(train_argv(tiny, tmp_path / "budget", method) + ["--budget", "maf=1000"])
    assert_same_run_but_budget(tmp_path / "plain", tmp_path / "budget")
    for c in finished_tasks(tmp_path / "budget"):
        t = json.loads((c.path / "task.json").read_text())
        assert t["budget"]["capped"] and t["budget"]["steps_trained"] == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("buffer", BUFFER_CHOICES)
@pytest.mark.parametrize("method", ["lwf"])
def test_every_buffer_trains_under_a_budget_as_without(method, buffer, tiny, tmp_path):
    """The same with each replay buffer (its state is part of what the probes restore; the
    end-of-task probe runs its update), under LwF (an old model beside the buffer: the
    probes restore both)."""
    extra = ["--buffer", buffer] + ([] if buffer == "cumulative-all" else ["--buffer-size", "8"])
    cli(train_argv(tiny, tmp_path / "plain", method) + extra)
    cli(train_argv(tiny, tmp_path / "budget", method) + extra + ["--budget", "maf=1000"])
    assert_same_run_but_budget(tmp_path / "plain", tmp_path / "budget")


@pytest.mark.slow
@pytest.mark.parametrize("tune", ["lora", "dora", "bitfit", "locked-image"])
def test_tuned_runs_train_under_a_budget_as_without(tune, tiny, tmp_path):
    """The same with --tune: the probe's step trains the task's fresh adapters (or the
    unfrozen parameters) and is undone with them; the reference runs on a plain copy."""
    extra = ["--tune", tune]
    cli(train_argv(tiny, tmp_path / "plain", "lwf") + extra)
    cli(train_argv(tiny, tmp_path / "budget", "lwf") + extra + ["--budget", "maf=1000"])
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

    def probe(trainer, ctx, batches, *rest):
        assert ctx.task_index != 1, "the resumed task measured again"
        return real(trainer, ctx, batches, *rest)

    monkeypatch.setattr(bud, "probe_step", probe)
    cli(argv)
    assert assert_same_run(tmp_path / "whole", tmp_path / "cut") == 3
    for c in finished_tasks(tmp_path / "cut"):
        t = comparable(json.loads((c.path / "task.json").read_text()))
        assert t["steps"] == 3 and t["budget"]["steps_trained"] == 3


def test_the_stream_plan_shares_a_budget_as_the_tasks_do():
    """--lr-schedule stream-cosine plans with the budget's shares: maf equally (FoMo-in-Flux),
    tflops by training pairs (unless --budget-arg split says otherwise)."""
    from types import SimpleNamespace

    from cvl.train.schedules import stream_plan

    tasks = {"a": 200, "b": 100, "c": 100}
    manifest = SimpleNamespace(
        task_order=list(tasks),
        tasks={k: SimpleNamespace(train=SimpleNamespace(count=n)) for k, n in tasks.items()},
    )

    def plan(spec, **given):
        b = parse_budget(spec)
        t = SimpleNamespace(
            cfg=None, manifest=manifest, method=None, budget=b, budget_opts=budget_options(b, given)
        )
        return stream_plan(t, [0, 1, 2])

    assert plan("maf=12") == (4.0, 4.0, 4.0)
    assert plan("maf=12", split="pairs") == (6.0, 3.0, 3.0)
    assert plan("tflops=12") == (6.0, 3.0, 3.0)
