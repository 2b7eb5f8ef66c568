"""`--accum-mode cached` (cvl/train/accum.py): K = 4 micro-batches of 8 train as one batch of
32, for every method that trains (per-step losses within 1e-5 relative, weights after the
run's 3 optimizer steps within the 2-processes tolerances of tests/test_distributed.py), and
so do 2 processes × K = 4 × 4 (one torchrun launch for every method); a method or option
cached accumulation cannot serve is refused in one line."""

from __future__ import annotations

import json
import time

import pytest
import torch
from reliability_helpers import (
    build_tiny_stream,
    cli,
    family_methods,
    train_argv,
    trained_methods,
)
from safetensors.torch import load_file
from test_distributed import (
    ADAM_NOISE,
    EPS_1E3,
    HERE,
    KEY_BIAS_ATOL,
    MAGNITUDE_SELECTING,
    WEIGHT_ATOL,
    _torchrun,
    assert_close_but_for_flips,
)
from test_method_dha import assert_weights_close

from cvl.runs import finished_tasks

CACHED = ("--grad-accum", "4", "--accum-mode", "cached")
# what a method needs besides reliability_helpers' arguments to be served: ZSCL's reference
# batch of its own size (ref_batch=0, a reference batch as large as the step's, is refused)
ACCUM_EXTRA = {"zscl": ["--method-arg", "ref_batch=8"]}
# the default suite keeps seqft (its budget is tight); every other method under `matrix`
# Mod-X, 2 processes × 4 × 4 vs one batch of 32: one out_proj entry of 289,537 1.15e-4 apart
# at Adam's ε = 1e-6, 6.7e-7 at most at ε = 1e-3 (2026-11-29, 2-core CPU): Adam's normalisation
# of rounding noise on a near-zero gradient, held to the flips' rule like test_distributed's
ADAM_NOISE_CACHED = ADAM_NOISE | {"modx"}
METHODS = [
    m if m == "seqft" else pytest.param(m, marks=pytest.mark.matrix) for m in trained_methods()
]


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("accum") / "stream")


def _argv(stream, out, method, *extra) -> list[str]:
    """`cvl train` of `method`: tiny ViT (no BatchNorm), 3 tasks × 1 optimizer step."""
    argv = train_argv(stream, out, method) + ACCUM_EXTRA.get(method, [])
    if method in EPS_1E3:  # test_distributed's Adam ε for τ_old = 0.01 / 0.07 methods
        (stream.parent / "eps.yaml").write_text("eps: 0.001\n")
        argv += ["--config", str(stream.parent / "eps.yaml")]
    return [
        *argv,
        *("--model-config", "tiny-vit", "--max-steps-per-task", "1", "--log-every", "1"),
        *("--checkpoint-every", "0", *extra),
    ]


def _result(out):
    tasks = finished_tasks(out)
    logs = [
        json.loads(x) for t in tasks for x in (t.path / "train_log.jsonl").read_text().splitlines()
    ]
    return logs, load_file(str(tasks[-1].model_path))


@pytest.fixture(scope="module")
def one_batch(stream, tmp_path_factory):
    """The reference runs, made once a method: one process, one batch of 32 a step."""
    root, done = tmp_path_factory.mktemp("one_batch"), {}

    def get(method):
        if method not in done:
            cli(_argv(stream, root / method, method, "--batch-size", "32"))
            done[method] = _result(root / method)
        return done[method]

    return get


def assert_same_training(method, ref, got):
    """Every logged float of every step within 1e-5 relative (absolute below 1), the final
    weights within the 2-processes tolerances (Adam normalises rounding noise on near-zero
    gradients; magnitude-selecting merges may flip an edge entry: test_distributed)."""
    (l1, w1), (l2, w2) = ref, got
    single = method == "joint"  # one task of the union
    assert len(l1) == len(l2) == (1 if single else 3)
    skip = {"samples_per_s", "grad_norm"}
    for a, b in zip(l1, l2):
        keys = {k for k, v in a.items() if isinstance(v, float) and k not in skip}
        assert keys == {k for k, v in b.items() if isinstance(v, float) and k not in skip}
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])
    if method in MAGNITUDE_SELECTING or method in ADAM_NOISE_CACHED:
        assert_close_but_for_flips(w1, w2)
    else:
        assert_weights_close(w1, w2, atol=WEIGHT_ATOL, key_bias_atol=KEY_BIAS_ATOL)


@pytest.mark.xdist_group("accum_runs")  # the reference runs are shared with the 2-process test
@pytest.mark.parametrize("method", METHODS)
def test_cached_accumulation_equals_one_big_batch(method, stream, one_batch, tmp_path):
    cli(_argv(stream, tmp_path / "four", method, "--batch-size", "8", *CACHED))
    assert_same_training(method, one_batch(method), _result(tmp_path / "four"))


@pytest.mark.matrix
def test_batchnorm_statistics_move_once_per_micro_batch_as_in_plain(stream, tmp_path):
    """The tiny RN model (BatchNorm): after a task's one step, cached K = 4 × 8 leaves every
    running mean, variance and count as plain K = 4 × 8 does (each micro-batch's forward moves
    them once; the second pass puts them back after its backward), not moved twice."""

    def bn_buffers(out, mode):
        argv = [*train_argv(stream, out, "seqft"), "--max-steps-per-task", "1"]
        cli([*argv, "--batch-size", "8", "--grad-accum", "4", "--accum-mode", mode])
        w = load_file(str(finished_tasks(out)[0].model_path))
        return {k: v for k, v in w.items() if "running_" in k or "num_batches" in k}

    plain, cached = bn_buffers(tmp_path / "plain", "plain"), bn_buffers(tmp_path / "c", "cached")
    assert plain and plain.keys() == cached.keys()
    for k in plain:
        assert torch.allclose(plain[k].double(), cached[k].double(), atol=1e-6), k
    assert {int(v) for k, v in cached.items() if "num_batches" in k} == {4}


# options that change what a step's batch holds or how its forward runs
OPTIONS = {
    "class-ce": ("--base-loss", "class-ce"),  # class texts: gradients straight into the weights
    "mixture": (  # buffer items drawn into every global batch in set shares
        *("--buffer", "reservoir", "--buffer-size", "16", "--mixture", "task=0.5,buffer=0.5"),
    ),
    "cumulative-exp": ("--buffer", "cumulative-exp", "--buffer-size", "16"),  # TiC's replay
    "grad-checkpointing": ("--grad-checkpointing",),  # the second pass recomputes in backward
}


@pytest.mark.matrix
@pytest.mark.parametrize("option", OPTIONS)
def test_cached_accumulation_equals_one_big_batch_under_options(option, stream, tmp_path):
    extra = OPTIONS[option]
    cli(_argv(stream, tmp_path / "one", "seqft", "--batch-size", "32", *extra))
    cli(_argv(stream, tmp_path / "four", "seqft", "--batch-size", "8", *CACHED, *extra))
    assert_same_training("seqft", _result(tmp_path / "one"), _result(tmp_path / "four"))


def _fsdp_families() -> list[str]:
    """One method per family (reliability_helpers.FAMILIES) that --fsdp trains."""
    from cvl.methods.registry import all_methods
    from cvl.train.fsdp import method_support

    return [m for m in family_methods() if method_support(all_methods()[m]) is True]


@pytest.fixture(scope="module")
def two_processes(stream, tmp_path_factory):
    """Every method in one torchrun launch: 2 processes × K = 4 micro-batches of 4; and each
    family's method the same under --fsdp (by hand every method --fsdp trains passed, 36 of
    36, 2026-11-29; that launch takes ~7 min, so CI runs one method a family)."""
    root = tmp_path_factory.mktemp("accum_two")
    cmds = {m: _argv(stream, root / m, m, "--batch-size", "4", *CACHED) for m in trained_methods()}
    for m in _fsdp_families():
        cmds[f"fsdp/{m}"] = _argv(stream, root / "fsdp" / m, m, "--batch-size", "4", *CACHED)
        cmds[f"fsdp/{m}"].append("--fsdp")
    (root / "cmds.json").write_text(json.dumps(cmds))
    r = _torchrun([str(HERE / "dist_many.py"), str(root / "cmds.json"), str(root / "results.json")])
    results = json.loads((root / "results.json").read_text()) if r.returncode == 0 else {}
    return root, results, r.stderr[-3000:]


@pytest.mark.matrix
@pytest.mark.xdist_group("accum_runs")
@pytest.mark.parametrize("method", trained_methods())
def test_two_processes_of_cached_accumulation_equal_one_big_batch(method, one_batch, two_processes):
    root, results, err = two_processes
    assert results.get(method) == 0, f"torchrun run of {method}: {results.get(method)} {err}"
    assert_same_training(method, one_batch(method), _result(root / method))


@pytest.mark.matrix
@pytest.mark.xdist_group("accum_runs")
@pytest.mark.parametrize("method", _fsdp_families())
def test_fsdp_with_cached_accumulation_equals_one_big_batch(method, one_batch, two_processes):
    """--fsdp (FSDP2: the second pass's forward gathers, its backward reduce-scatters on the
    step's last micro-batch only) × cached accumulation, 2 processes × 4 × 4 = one batch of 32."""
    root, results, err = two_processes
    name = f"fsdp/{method}"
    assert results.get(name) == 0, f"torchrun run of {name}: {results.get(name)} {err}"
    assert_same_training(method, one_batch(method), _result(root / "fsdp" / method))


@pytest.mark.matrix
@pytest.mark.parametrize("method", ["seqft", "ctp", "lwf", "der"])  # MLM; momentum; old; replay
def test_fusion_model_cached_equals_one_big_batch(method, stream, tmp_path):
    """--model fusion (ViT + BERT, fusion layers, MLM): its encoders cached, its fusion and MLM
    passes inside the loss over the step's batch: K = 4 × 8 equals one batch of 32. (By hand,
    2026-11-29: also joint, icarl, co2l, dha, ewc, si, zscl, wise, ties, opcm, cclip, modx,
    dkr; afec within the flips' rule, one BERT entry of 16,384 1.5e-4 apart.)"""
    fusion = ("--model", "fusion", "--model-config", "tiny")
    cli(_argv(stream, tmp_path / "one", method, "--batch-size", "32", *fusion))
    cli(_argv(stream, tmp_path / "four", method, "--batch-size", "8", *CACHED, *fusion))
    assert_same_training(method, _result(tmp_path / "one"), _result(tmp_path / "four"))


@pytest.mark.parametrize(
    "over, says",
    [
        ({"method": "zscl"}, "method 'zscl': ref_batch=0 makes its reference batch"),
        ({"method": "seqft", "compile": True}, "method 'seqft': with --compile"),
    ],
)
def test_an_untested_method_or_option_is_refused_by_name(over, says, stream, tmp_path):
    from cvl.errors import CvlError
    from cvl.train.config import resolve
    from cvl.train.loop import Trainer

    over = {**over, "grad_accum": 2, "accum_mode": "cached"}
    cfg = resolve(None, {"stream": str(stream), "out": str(tmp_path / "r"), **over})
    with pytest.raises(CvlError, match=f"--accum-mode cached: {says}".replace("(", r"\(")):
        Trainer(cfg, progress=False)


def test_cvl_methods_says_which_methods_cached_accumulation_trains():
    from click.testing import CliRunner

    from cvl.methods.cli import methods

    text = CliRunner().invoke(methods).output
    assert "--accum-mode cached: yes" in text
    assert "--accum-mode cached: refused: ref_batch=0" in text  # zscl at its defaults


@pytest.mark.matrix
@pytest.mark.parametrize("method", ["ctp", "moe_adapters"])  # a queue; noisy router gates
def test_sigkill_mid_step_resumes_bitwise(method, stream, tmp_path):
    """A cached run SIGKILLed inside an optimizer step (after the 2nd of its 4 first-pass
    forwards, step 2 of task 2), rerun with the same command, ends bit-identical to an
    uninterrupted run (weights, method state, losses): the step restarts from its checkpoint
    and replays the same micro-batches and random draws."""
    import os
    import signal
    import subprocess
    import sys

    from reliability_helpers import assert_same_run, env

    def argv(out):  # the tiny RN model (BatchNorm), 4 steps of 4 × 2 a task
        return [*train_argv(stream, out, method), "--batch-size", "2", *CACHED]

    cli(argv(tmp_path / "ref"))
    marker = tmp_path / "paused"
    pause = {"CVL_TEST_PAUSE_AT": str(4 * 4 + 4 + 2), "CVL_TEST_PAUSE_FILE": str(marker)}
    p = subprocess.Popen(
        [sys.executable, str(HERE / "accum_kill_run.py"), *argv(tmp_path / "run")],
        env={**env(), **pause},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert p.poll() is None, p.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the pause point was never reached"
            time.sleep(0.01)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    position = json.loads((tmp_path / "run" / "last" / "position.json").read_text())
    assert (position["task_index"], position["step"]) == (1, 1)  # step 2 of task 2 not ended
    cli(argv(tmp_path / "run"))  # the same command again
    assert assert_same_run(tmp_path / "ref", tmp_path / "run") == 3
