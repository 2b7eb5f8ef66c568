"""`--accum-mode cached` (cvl/train/accum.py): K = 4 micro-batches of 8 train as one batch of
32 (per-step losses within 1e-5 relative, weights after the run's 3 optimizer steps within the
2-processes tolerances); a method cached accumulation cannot serve is refused in one line."""

from __future__ import annotations

import json

import pytest
from reliability_helpers import build_tiny_stream, cli, train_argv
from safetensors.torch import load_file
from test_distributed import KEY_BIAS_ATOL, WEIGHT_ATOL
from test_method_dha import assert_weights_close

from cvl.runs import finished_tasks


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("accum") / "stream")


def _run(stream, out, method, *extra):
    argv = train_argv(stream, out, method)
    cli(
        [
            *argv,
            "--model-config",
            "tiny-vit",
            "--max-steps-per-task",
            "1",
            "--log-every",
            "1",
            *extra,
        ]
    )
    tasks = finished_tasks(out)
    logs = [
        json.loads(x) for t in tasks for x in (t.path / "train_log.jsonl").read_text().splitlines()
    ]
    return logs, load_file(str(tasks[-1].model_path))


# modx under `matrix` (make matrix): the default suite keeps seqft (its budget is tight)
@pytest.mark.parametrize("method", ["seqft", pytest.param("modx", marks=pytest.mark.matrix)])
def test_cached_accumulation_equals_one_big_batch(method, stream, tmp_path):
    l1, w1 = _run(stream, tmp_path / "one", method, "--batch-size", "32")
    l4, w4 = _run(
        stream,
        tmp_path / "four",
        method,
        *("--batch-size", "8", "--grad-accum", "4", "--accum-mode", "cached"),
    )
    assert len(l1) == len(l4) == 3
    for a, b in zip(l1, l4):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), (a, b)
    # the per-method 2-processes tolerances (tests/test_distributed.py): Adam normalises
    # rounding noise on near-zero gradients (modx measured 7.4e-5 at most, seqft 8.4e-6)
    assert_weights_close(w1, w4, atol=WEIGHT_ATOL, key_bias_atol=KEY_BIAS_ATOL)


def test_fusion_model_is_refused_in_one_line(stream, tmp_path):
    from cvl.errors import CvlError
    from cvl.train.config import resolve
    from cvl.train.loop import Trainer

    over = {"method": "seqft", "model": "fusion", "grad_accum": 2, "accum_mode": "cached"}
    cfg = resolve(None, {"stream": str(stream), "out": str(tmp_path / "r"), **over})
    with pytest.raises(CvlError, match="--accum-mode cached: method 'seqft' with --model fusion"):
        Trainer(cfg, progress=False)


@pytest.mark.parametrize(
    "over, says",
    [
        ({"method": "lwf"}, "method 'lwf': not yet tested"),
        ({"method": "seqft", "compile": True}, "method 'seqft': with --compile"),
        (
            {"method": "seqft", "buffer": "reservoir", "buffer_size": 16},
            "method 'seqft': with --buffer",
        ),
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
    assert "--accum-mode cached: refused: not yet tested" in text


def test_cached_accumulation_with_fsdp_is_refused_in_one_line(stream, tmp_path):
    from cvl.errors import CvlError
    from cvl.train.config import resolve
    from cvl.train.loop import Trainer

    over = {"method": "seqft", "fsdp": True, "grad_accum": 2, "accum_mode": "cached"}
    cfg = resolve(None, {"stream": str(stream), "out": str(tmp_path / "r"), **over})
    with pytest.raises(CvlError, match="--accum-mode cached: method 'seqft': with --fsdp"):
        Trainer(cfg, progress=False)
