"""2 processes × batch B (torchrun) train exactly like 1 process × batch 2B: gloo on the CPU,
or one GPU per process on a machine with two or more (tests/device_helpers.py).

`test_every_method_two_processes_equal_one`: every registered method (parametrized over the
registry, per-method CLI arguments from tests/reliability_helpers.py), all in ONE torchrun
launch (tests/dist_many.py: each rank imports torch/open_clip once); per-step losses of
every logged term within 1e-5 on a 3-task run (task 2's old-model/buffer terms active)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from device_helpers import dist_env, shared_device
from reliability_helpers import build_tiny_stream, cli, method_args, train_argv, trained_methods
from safetensors.torch import load_file
from test_method_dha import assert_weights_close

from cvl.methods.registry import all_methods
from cvl.runs import finished_tasks

HERE = Path(__file__).resolve().parent

# tiny-vit: no BatchNorm (per-process BN statistics on CPU would differ from one process's).
ARGS = [
    "--model-config",
    "tiny-vit",
    "--epochs",
    "1",
    "--max-steps-per-task",
    "3",
    "--log-with",
    "none",
    "--quiet",
    "--checkpoint-every",
    "0",
    "--log-every",
    "1",
    "--workers",
    "0",
]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run):
    out = []
    for c in finished_tasks(run):
        out += [json.loads(x) for x in (c.path / "train_log.jsonl").read_text().splitlines()]
    return out


def _common(stream, extra: list[str]) -> list[str]:
    return ["train", "--stream", str(stream), *ARGS, "--device", shared_device(2), *extra]


def _torchrun(args: list[str], timeout: str = "600") -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 ARGS` (tests/ on the path of its processes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(_free_port()), *args]
    return subprocess.run(
        cmd,
        env={**dist_env(2), "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])},
        capture_output=True,
        text=True,
        timeout=int(os.environ.get("CVL_DIST_TIMEOUT", timeout)),
    )


def _one_process(stream, extra: list[str], out: Path, in_process=contextlib.nullcontext):
    """The 1-process run (batch 16) in `out`/one, next to the 2-process `out`/two: both
    runs' logs and final weights."""
    with in_process():
        cli([*_common(stream, extra), "--batch-size", "16", "--out", str(out / "one")])
    w1 = load_file(str(finished_tasks(out / "one")[-1].model_path))
    w2 = load_file(str(finished_tasks(out / "two")[-1].model_path))
    return _losses(out / "one"), _losses(out / "two"), w1, w2


# Tests marked `torchrun_pair(*extra, context=None)` on the session's synthetic stream get
# (1-process logs, 2-process logs, 1-process weights, 2-process weights) from the fixture
# `pair_runs` (tests/conftest.py): torchrun ×2 at batch 8 each, 1 process at 16. The
# 2-process runs all go in ONE torchrun launch (tests/dist_many.py; each rank imports torch,
# open_clip and cvl once instead of once per test, ~25 s of CPU a test), on one xdist
# worker; the 1-process runs in the test's process. In `extra`, {eps}
# is a YAML config setting Adam's ε to 1e-3 and {stream} the stream; `context` ("module:name")
# a context manager both sides run in (unused_param_run:unused_param).
def pair_key(mark) -> str:
    return json.dumps([list(mark.args), mark.kwargs.get("context")])


def _pair_extra(mark, stream: Path, root: Path) -> list[str]:
    return [str(a).format(stream=stream, eps=root / "eps.yaml") for a in mark.args]


def _context(spec: str | None):
    if not spec:
        return contextlib.nullcontext
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


def launch_pairs(stream: Path, root: Path, marks: dict) -> dict:
    """The 2-process runs of `marks` (pair_key -> mark) in one torchrun launch: pair_key ->
    (its folder, exit code or error, the launch's stderr tail)."""
    (root / "eps.yaml").write_text("eps: 0.001\n")
    cmds, dirs = {}, {}
    for i, (key, mark) in enumerate(marks.items()):
        dirs[key] = root / f"p{i}"
        argv = [*_common(stream, _pair_extra(mark, stream, root)), "--batch-size", "8"]
        cmds[key] = {"argv": [*argv, "--out", str(dirs[key] / "two")]}
        cmds[key]["context"] = mark.kwargs.get("context")
    (root / "cmds.json").write_text(json.dumps(cmds))
    r = _torchrun([str(HERE / "dist_many.py"), str(root / "cmds.json"), str(root / "res.json")])
    res = json.loads((root / "res.json").read_text()) if r.returncode == 0 else {}
    return {k: (dirs[k], res.get(k), r.stderr[-3000:]) for k in marks}


def pair_of(batch: dict, mark, stream: Path, tmp_path: Path) -> tuple[list, list, dict, dict]:
    """The 4-tuple for a `torchrun_pair` mark: its launched 2-process run (from `batch`, see
    launch_pairs) and the 1-process run, made now in this process (imports already paid)."""
    folder, result, err = batch[pair_key(mark)]
    assert result == 0, f"torchrun run of {mark.args}: {result} {err}"
    shutil.copytree(folder / "two", tmp_path / "two")  # the test's folder holds both runs
    extra = _pair_extra(mark, stream, folder.parent)
    return _one_process(stream, extra, tmp_path, _context(mark.kwargs.get("context")))


def assert_equivalent(l1, l2, w1, w2, keys=("loss",), weight_atol=1e-5):
    assert len(l1) == len(l2) > 0
    for a, b in zip(l1, l2):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-5, (k, a, b)
    for k in w1:
        d = float((w1[k] - w2[k]).abs().max())
        assert torch.allclose(w1[k], w2[k], atol=weight_atol), (k, d)


@pytest.mark.slow
# loader workers on, and log lines averaging 2 steps reduced across the 2 ranks
@pytest.mark.torchrun_pair(
    *("--method", "seqft", "--buffer", "reservoir", "--buffer-size", "16"),
    *("--workers", "1", "--log-every", "2"),
)
def test_two_processes_equal_one_with_double_batch(pair_runs, tmp_path):
    l1, l2, w1, w2 = pair_runs
    assert_equivalent(l1, l2, w1, w2, keys=("loss", "itc"))
    assert_same_step_cost(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow
@pytest.mark.torchrun_pair(
    "--method", "seqft", "--weight-decay", "0.5", context="unused_param_run:unused_param"
)
def test_a_parameter_no_step_reaches_is_left_alone_by_two_processes(pair_runs):
    """A trainable 2-D parameter that no loss reaches (tests/unused_param_run.py), weight decay
    on: one process leaves its gradient None and AdamW skips it; 2 processes must too (a
    zero gradient from the reduction would let AdamW decay it, in multi-process runs only)."""
    from unused_param_run import UNUSED, unused_init

    l1, l2, w1, w2 = pair_runs
    assert torch.equal(w1[UNUSED], unused_init())  # one process: untouched
    assert torch.equal(w2[UNUSED], unused_init())  # 2 processes: untouched too
    assert len(l1) == len(l2) > 0
    for a, b in zip(l1, l2):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
    assert_weights_close(w1, w2, atol=WEIGHT_ATOL)


_BUDGET = ("--budget", "samples=32/task")


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(
            "cumulative-exp",
            marks=pytest.mark.torchrun_pair(
                *("--method", "seqft", "--buffer", "cumulative-exp", "--buffer-size", "16"),
                *_BUDGET,
            ),
        ),
        pytest.param(
            "oracle",
            marks=pytest.mark.torchrun_pair(
                *("--method", "joint", "--method-arg", "cumulative=true"),
                *("--method-arg", "restart=true", *_BUDGET),
            ),
        ),
    ],
)
def test_two_processes_equal_one_with_tic_policies(policy, pair_runs):
    """TiC-CLIP's Cumulative-Exp buffer (every rank computes the same buffer) and the Oracle
    (every rank restarts from the initial weights), under a per-task sample budget: every
    logged loss within 1e-5; weights within WEIGHT_ATOL (measured: 1.01e-5 for 1 element of
    289,537 with the buffer, Adam's normalisation of rounding noise; a rank training other
    data or weights would move them by ~lr = 5e-4)."""
    l1, l2, w1, w2 = pair_runs
    assert_equivalent(l1, l2, {}, {}, keys=("loss", "itc"))
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=WEIGHT_ATOL), k


@pytest.mark.slow
@pytest.mark.torchrun_pair("--method", "ties", "--tune", "lora")
def test_two_processes_equal_one_with_lora_adapters(pair_runs):
    """--tune lora: the adapters (drawn from the seed on every rank) get rank-averaged
    gradients, and a merge (TIES, every task from θ_0) deploys the same weights."""
    l1, l2, w1, w2 = pair_runs
    assert_equivalent(l1, l2, w1, w2, keys=("loss", "itc"))


# Relative per-step loss tolerance where a temperature demands it (default: 1e-5 absolute).
# IncCLIP: τ_old = 0.01 puts the old logits at ~100, where float32 log-softmax is exact to
# ~2e-5 per entry (×λ = 5 in `kd`); measured 2.7e-5 on kd ≈ 19 (1.4e-6 relative).
# LwF / iCaRL (CTP code's variant): softmax of *unnormalised* projections / 0.07 over the
# embedding dims; after one AdamW step the rounding of the two reductions shows at ~1e-5
# relative (measured 2.7e-5 on a loss of 2.87, step 2 of task 2; step 1 within 1e-5).
# AFC: its importance-weighted feature distillation term, measured 1.43e-5 on a loss of 1.34
# at step 2 of task 2 (1.1e-5 relative) with issue 44's batch order (the earlier order's
# batches happened to stay within 1e-5).
TOL: dict[str, float] = {"incclip": 5e-5, "lwf": 5e-5, "icarl": 5e-5, "afc": 5e-5}
# Adam ε 1e-3 instead of 1e-6 (a YAML recipe; the CLI has no --eps): with τ_old = 0.01,
# AdamW's first steps turn gradient rounding on near-zero-gradient weights into updates of
# up to ±lr (final weights 2e-4 apart at ε = 1e-6; see test_method_incclip.py).
# iCaRL likewise (LwF's 0.07-temperature softmax of unnormalised features on buffer + new
# items): final weights beyond 5e-5 at ε = 1e-6 although every logged loss agrees.
EPS_1E3 = {"incclip", "icarl"}
# Measured (torch 2.14.1, open_clip 3.x, 2026-11-24): ≤ 4.4e-5 for every element but one per
# run in der (6.1e-5, 1 of 4,096 in an out_proj) and lwf (5.4e-5, 1 of 16,384 in a c_fc):
# Adam's element-wise normalisation of rounding noise (see assert_weights_close). A real
# distribution fault (a rank's gradient or rows missing) moves weights by ~lr = 5e-4 per step.
WEIGHT_ATOL = 1e-4
# LwF (CTP's variant: a 0.07-temperature softmax of unnormalised projections) with issue 44's
# batch order (2026-11-27, 2-core CPU): 23 of 289,537 entries beyond 1e-4 in 14 tensors, at
# most 5.5e-4, every logged loss within TOL: Adam's normalisation of rounding noise on
# near-zero gradients (the earlier order happened to give one entry, 5.4e-5). Held to the
# flips' rule: within KEY_BIAS_ATOL but for FLIP_FRACTION of a tensor's entries.
ADAM_NOISE = {"lwf"}
# Attention key biases get no gradient in exact arithmetic (the softmax ignores a per-query
# shift): each run's values are pure rounding noise normalised by Adam, measured up to 6.6e-5
# in each of zscl's runs (2026-11-25 CI: 1.2e-4 apart). Half a real step (lr / 2) still
# catches a distribution fault.
KEY_BIAS_ATOL = 2.5e-4
# Merges that select task-vector entries by magnitude (a rank, a threshold, the larger of two):
# an entry at the selection's edge flips between kept and dropped when the two runs' task
# vectors differ by rounding (~1e-5), which moves that one weight by λ·τ, not by noise.
# Measured 2026-11-26 (2-core CPU): breadcrumbs 4 of 289,537 entries beyond 1e-4 (worst tensor
# 0.02 % of its entries, at most 3e-4); dare_ties, magmax none. For these the final weights may
# differ beyond KEY_BIAS_ATOL in at most FLIP_FRACTION of a tensor's entries (every logged
# loss is still compared at 1e-5: training does not see the flips).
MAGNITUDE_SELECTING = {"breadcrumbs", "ties", "dare_ties", "tall_masks", "magmax"}
FLIP_FRACTION = 1e-3


def _argv(stream: Path, out: Path, method: str, batch: int) -> list[str]:
    a = train_argv(stream, out, method)
    if method in EPS_1E3:
        (stream.parent / "eps.yaml").write_text("eps: 0.001\n")
        a += ["--config", str(stream.parent / "eps.yaml")]
    for opt, val in (
        ("--batch-size", str(batch)),
        ("--model-config", "tiny-vit"),  # no BatchNorm (per-process statistics on CPU)
        ("--max-steps-per-task", "2"),
        ("--checkpoint-every", "0"),
        ("--device", shared_device(2)),  # the 1-process run on the 2-process runs' kind
    ):
        a[a.index(opt) + 1] = val
    return a


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    stream = build_tiny_stream(root / "s")
    methods = trained_methods()
    cmds = {m: _argv(stream, root / "two" / m, m, 8) for m in methods}
    (root / "cmds.json").write_text(json.dumps(cmds))
    r = _torchrun(
        [str(HERE / "dist_many.py"), str(root / "cmds.json"), str(root / "results.json")], "900"
    )
    results = json.loads((root / "results.json").read_text()) if r.returncode == 0 else {}
    return stream, root, results, r.stderr[-3000:]


def _all_logs(run: Path) -> list[dict]:
    out = []
    for c in finished_tasks(run):
        out += [json.loads(x) for x in (c.path / "train_log.jsonl").read_text().splitlines()]
    return out


@pytest.mark.matrix  # every method, ~2.5 min of launches: make matrix
@pytest.mark.xdist_group("dist_runs")  # one worker runs the module fixture's torchrun launches
@pytest.mark.parametrize("method", trained_methods())
def test_every_method_two_processes_equal_one(method, dist_runs):
    stream, root, results, err = dist_runs
    assert results.get(method) == 0, f"torchrun run of {method}: {results.get(method)} {err}"
    cli(_argv(stream, root / "one" / method, method, 16))
    l1, l2 = _all_logs(root / "one" / method), _all_logs(root / "two" / method)
    tol, rel = TOL.get(method, 1e-5), method in TOL
    assert len(l1) == len(l2) > 0
    single = getattr(all_methods()[method]({}), "single_task", False)  # joint: one task
    assert single or any(r["task_index"] == 1 for r in l1)  # task 2's steps are compared
    skip = {"samples_per_s", "grad_norm"}
    for a, b in zip(l1, l2):
        keys = {k for k, v in a.items() if isinstance(v, float) and k not in skip}
        assert keys == {k for k, v in b.items() if isinstance(v, float) and k not in skip}
        for k in keys:
            assert abs(a[k] - b[k]) <= tol * (max(1.0, abs(a[k])) if rel else 1.0), (k, a, b)
    w1 = load_file(str(finished_tasks(root / "one" / method)[-1].model_path))
    w2 = load_file(str(finished_tasks(root / "two" / method)[-1].model_path))
    if method in MAGNITUDE_SELECTING or method in ADAM_NOISE:
        assert_close_but_for_flips(w1, w2)
    else:
        assert_weights_close(w1, w2, atol=WEIGHT_ATOL, key_bias_atol=KEY_BIAS_ATOL)
    # adapters (--tune lora, ...): each rank computes ΔW = B·A once per step whatever its batch
    # (and C-CLIP its projector on the gathered batch), so the ranks' sum counts that work
    # twice; measured +2.2 % (cclip) and +2.3 % (lora_per_task) at batch 8 per rank
    rel = 0.03 if "--tune" in method_args(method) else 0.01
    assert_same_step_cost(root / "one" / method, root / "two" / method, rel)


def assert_close_but_for_flips(w1: dict, w2: dict) -> None:
    """Every tensor within KEY_BIAS_ATOL except at most FLIP_FRACTION of its entries (at least
    one): a magnitude selection's edge entries (see MAGNITUDE_SELECTING)."""
    assert set(w1) == set(w2)
    for k in w1:
        far = (w1[k].float() - w2[k].float()).abs() > KEY_BIAS_ATOL
        assert int(far.sum()) <= max(1, int(FLIP_FRACTION * far.numel())), (k, int(far.sum()))


def assert_same_step_cost(one: Path, two: Path, rel: float = 0.01) -> None:
    """task.json's cost sums the ranks: 2 processes × batch B count the FLOPs of 1 × 2B
    (within `rel`)."""
    for a, b in zip(finished_tasks(one), finished_tasks(two)):
        ca, cb = (json.loads((c.path / "task.json").read_text())["cost"] for c in (a, b))
        assert (ca["processes"], cb["processes"]) == (1, 2) and ca["samples"] == cb["samples"]
        assert abs(cb["flops_per_step"] - ca["flops_per_step"]) <= rel * ca["flops_per_step"]
