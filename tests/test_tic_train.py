"""TiC-CLIP's training protocol: the Oracle (`joint cumulative=true restart=true`) retrains
every task from the initial weights, under a budget with the compute of all tasks so far;
`--warmup-later` is the warm-up of the tasks that start from trained weights (not the Oracle's); a run with a
cumulative buffer killed inside a task resumes to the bits of an uninterrupted one."""

from __future__ import annotations

import json
import random

import pytest
import torch
from reliability_helpers import (
    STEPS,
    assert_same_run,
    build_tiny_stream,
    cli,
    family_methods,
    kill_when,
    log_lines,
    train_argv,
)
from safetensors.torch import load_file
from train_helpers import FAST, train_run

from cvl.errors import CvlError
from cvl.methods.registry import get_method
from cvl.runs import finished_tasks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("tic") / "s")


def _same_weights(a, b) -> bool:
    wa, wb = load_file(str(a.model_path)), load_file(str(b.model_path))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _log(run, i: int) -> list[dict]:
    p = sorted((run / "logs").glob(f"{i:02d}-*.jsonl"))[0]
    return [json.loads(x) for x in p.read_text().splitlines()]


def test_oracle_retrains_each_task_from_the_initial_weights(tiny, tmp_path):
    """The Oracle's model of task 2 = a plain joint run on tasks 0..2 from the same initial
    weights (same data, batches and seeds), bit for bit; task 1's = joint on tasks 0..1."""
    kw = dict(FAST, batch_size=8, max_steps_per_task=3)
    args = {"cumulative": True, "restart": True}
    train_run(tiny, tmp_path / "oracle", kw, method="joint", method_args=args)
    train_run(tiny, tmp_path / "joint", kw, method="joint")
    oracle, joint = finished_tasks(tmp_path / "oracle"), finished_tasks(tmp_path / "joint")
    assert [c.name for c in oracle] == ["t0", "t1", "t2"] and [c.name for c in joint] == ["t2"]
    assert _same_weights(oracle[2], joint[0])
    # cumulative without restart continues from task 1's weights: not the same model
    train_run(tiny, tmp_path / "cum", kw, method="joint", method_args={"cumulative": True})
    assert not _same_weights(finished_tasks(tmp_path / "cum")[2], joint[0])


def test_oracle_arguments():
    Joint = get_method("joint")
    with pytest.raises(CvlError, match="restart=true needs cumulative=true"):
        Joint({"restart": True})
    m = Joint({"restart": True, "cumulative": True})
    assert m.restarts and m.budget_seen and not m.single_task
    assert not Joint({"cumulative": True}).budget_seen


def test_oracle_budget_is_the_compute_of_all_tasks_so_far(tiny, tmp_path):
    """samples=16/task buys 2 steps of 8 per task for seqft; the Oracle's task t gets
    (t + 1) × 16 samples."""
    kw = dict(FAST, batch_size=8, epochs=20, budget="samples=16/task")
    train_run(tiny, tmp_path / "seq", kw)
    train_run(tiny, tmp_path / "o", kw, method="joint", method_args={"cumulative": 1, "restart": 1})
    for run, want in (("seq", [2, 2, 2]), ("o", [2, 4, 6])):
        got = [
            json.loads((c.path / "task.json").read_text())["budget"]["steps_trained"]
            for c in finished_tasks(tmp_path / run)
        ]
        assert got == want, run


def test_warmup_later_spares_the_tasks_that_start_from_the_initial_weights(tiny, tmp_path):
    """--warmup 2 --warmup-later 0: the first task's rate climbs lr/2, lr; later tasks start
    at lr; the Oracle warms up every task (each starts from scratch)."""
    kw = dict(FAST, batch_size=8, max_steps_per_task=3, lr=1e-3, warmup=2.0, warmup_later=0.0)
    train_run(tiny, tmp_path / "seq", kw)
    lrs = [[r["lr"] for r in _log(tmp_path / "seq", i)] for i in range(3)]
    assert lrs[0][:2] == pytest.approx([5e-4, 1e-3]) and lrs[1][0] == pytest.approx(1e-3)
    train_run(tiny, tmp_path / "o", kw, method="joint", method_args={"cumulative": 1, "restart": 1})
    assert all(_log(tmp_path / "o", i)[0]["lr"] == pytest.approx(5e-4) for i in range(3))
    with pytest.raises(CvlError, match="--warmup-later"):
        train_run(tiny, tmp_path / "bad", kw | {"warmup_later": -1.0})


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["--buffer", "cumulative-exp", "--buffer-size", "8"],
        ["--buffer", "cumulative-all"],
        ["--method", "joint", "--method-arg", "cumulative=true", "--method-arg", "restart=true"],
    ],
    ids=["cumulative-exp", "cumulative-all", "oracle"],
)
def test_killed_run_with_a_cumulative_policy_resumes_bitwise(extra, tiny, tmp_path):
    """SIGKILL at a seeded step inside task 2 (its data: task 2 + the buffer of tasks 0-1);
    the same command resumes to the bits of an uninterrupted run."""

    def argv(out):
        a = train_argv(tiny, out, "seqft")
        if extra[0] == "--method":
            a[a.index("--method") : a.index("--method") + 2] = []
        return a + extra

    cli(argv(tmp_path / "whole"))
    k = random.Random(f"tic/{extra[1]}").randint(1, STEPS - 1)
    log = tmp_path / "cut" / "logs" / "01-t1.jsonl"
    kill_when(argv(tmp_path / "cut"), lambda: log_lines(log) >= k)
    assert not (tmp_path / "cut" / "tasks" / "01-t1").exists()
    cli(argv(tmp_path / "cut"))
    assert assert_same_run(tmp_path / "whole", tmp_path / "cut") == 3


# -- every method, buffer, --tune mode and --budget on a time-ordered stream --------------------
@pytest.fixture(scope="module")
def drifting(tmp_path_factory):
    """A drifting synthetic stream: 3 tasks, the first merging 2 yearly periods."""
    from cvl.streams.synthetic_time import TimeSpec, build_synthetic_time

    out = tmp_path_factory.mktemp("tic") / "drift"
    spec = TimeSpec(tasks=3, first_periods=2, per_period=16, test_per_period=4, val_per_task=4)
    build_synthetic_time(out, spec, progress=False)
    return out


def _with_buffer(args: list[str], buffer: str) -> list[str]:
    """`args` with its replay buffer replaced by (or, without one, added as) `buffer`."""
    if "--buffer" in args:
        i = args.index("--buffer")
        args = args[:i] + args[i + 4 :]
    size = [] if buffer == "cumulative-all" else ["--buffer-size", "8"]
    return [*args, "--buffer", buffer, *size]


@pytest.mark.slow
@pytest.mark.parametrize("method", family_methods())
def test_every_kind_of_method_trains_on_a_time_ordered_stream_with_a_cumulative_buffer(
    method, drifting, tmp_path
):
    """One method of each kind (`FAMILIES`), with TiC's Cumulative-Exp buffer (iCaRL and LUCIR keep their
    herding buffer: it is part of their definition) and a per-step sample budget, trains the
    drifting stream (2 steps a task) and evaluates to a TiC table."""
    argv = train_argv(drifting, tmp_path / "r", method)
    if getattr(get_method(method), "buffer_hint", None) != "mof":
        argv = _with_buffer(argv, "cumulative-exp")
    argv[argv.index("--max-steps-per-task") + 1] = "2"
    cli([*argv, "--budget", "samples=16/task"])
    done = finished_tasks(tmp_path / "r")
    assert [c.name for c in done][-1] == "2017"
    cli(
        [
            "eval",
            "--run",
            str(tmp_path / "r"),
            "--no-probe",
            "--no-zeroshot",
            "--no-plots",
            "--quiet",
        ]
    )
    tic = json.loads((tmp_path / "r" / "eval" / "metrics.json").read_text())["tic"]
    assert tic["periods"] == ["2014", "2015", "2016", "2017"] and tic["id"] is not None


@pytest.mark.slow
@pytest.mark.parametrize("tune", ["lora", "bitfit", "locked-text"])
@pytest.mark.parametrize("buffer", ["cumulative-all", "cumulative-equal"])
def test_tune_modes_with_cumulative_buffers(tune, buffer, drifting, tmp_path):
    argv = train_argv(drifting, tmp_path / "r", "lwf") + ["--tune", tune]
    cli(_with_buffer(argv, buffer) + ["--budget", "samples=16/task"])
    assert len(finished_tasks(tmp_path / "r")) == 3
