"""fp16 loss scaling (issue 33): methods see unscaled gradients; fp16 on the CPU is refused.

Accelerate creates a GradScaler only for fp16 on a GPU. On the CPU the tests inject torch's
own (`torch.amp.GradScaler("cpu")`, the same kernels) into the training loop's accelerator
and train in float32: the loss is multiplied by 2¹⁶ before the backward, every gradient is
then exactly 2¹⁶ times the unscaled one (a power of two only moves exponents), so a run whose
methods read and add to unscaled gradients is bit-identical to a run without a scaler.
"""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import FAST, assert_same_task_weights, train_run

import cvl.device
from cvl.errors import CvlError
from cvl.methods.base import Method, Wrapper
from cvl.methods.registry import all_methods
from cvl.runs import finished_tasks


def _after_backward_methods() -> list[str]:
    """Every registered method with its own `after_backward` (penalty gradients, SI's path)."""
    own = (Method.after_backward, Wrapper.after_backward)
    return sorted(n for n, c in all_methods().items() if c.after_backward not in own)


def _inject_scaler(
    monkeypatch: pytest.MonkeyPatch, init_scale: float, backoff: float = 0.5
) -> list:
    """The loop's accelerator gets a GradScaler (as Accelerate's fp16 on a GPU); returns the
    list the scalers land in."""
    real, made = cvl.device.accelerator, []

    def scaled(*a, **k):
        acc = real(*a, **k)
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=backoff)
        made.append(acc.scaler)
        return acc

    monkeypatch.setattr(cvl.device, "accelerator", scaled)
    return made


def _logs(run) -> list[dict]:
    out = []
    for c in finished_tasks(run):
        for line in (c.path / "train_log.jsonl").read_text().splitlines():
            out.append({k: v for k, v in json.loads(line).items() if k != "samples_per_s"})
    return out


def _args(method: str, stream) -> dict:
    if method == "zscl":  # a reference set (the stream itself), its L2 to the task start and
        # no weight ensemble (over 2 steps it would keep only the start and step 1)
        return {"method_args": {"ref_stream": str(stream), "ref_batch": 8, "we_every": 0}}
    return {}


def test_the_methods_with_after_backward_are_found():
    assert {"ewc", "si", "mas", "rwalk", "afec", "zscl"} <= set(_after_backward_methods())


@pytest.mark.parametrize(
    "method, clip",
    [(m, 0.0) for m in _after_backward_methods()] + [("ewc", 1.0), ("si", 1.0)],
)
def test_a_loss_scaled_run_equals_an_unscaled_one(
    method, clip, synth_stream, tmp_path, monkeypatch
):
    """2¹⁶-scaled steps (gradients unscaled once before `after_backward`, with and without
    clipping) train bit-identical to unscaled ones: EWC / MAS / RWalk / AFEC penalties and
    ZSCL's L2 add to true gradients, SI and RWalk integrate true gradients."""
    kw = dict(
        FAST, method=method, max_steps_per_task=2, grad_clip=clip, **_args(method, synth_stream)
    )
    train_run(synth_stream, tmp_path / "plain", kw)
    scalers = _inject_scaler(monkeypatch, 2.0**16)
    train_run(synth_stream, tmp_path / "scaled", kw)
    assert scalers and scalers[0].get_scale() == 2.0**16  # used, never overflowed
    assert_same_task_weights(tmp_path / "plain", tmp_path / "scaled")
    assert _logs(tmp_path / "plain") == _logs(tmp_path / "scaled")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_an_overflowed_step_gets_no_after_step(synth_stream, tmp_path, monkeypatch):
    """A scale so large that the scaled loss overflows: the scaler skips the update (and
    backs off, here to 2¹⁷), and the method's `after_step` does not run for it (SI would integrate
    inf gradients times a zero parameter change: NaN importance, a NaN penalty next task)."""
    seen = []
    real = all_methods()["si"].after_step

    def spy(self, ctx):
        seen.append((ctx.task_index, ctx.step))
        real(self, ctx)

    monkeypatch.setattr(all_methods()["si"], "after_step", spy)
    scalers = _inject_scaler(monkeypatch, 2.0**127, backoff=2.0**-110)
    train_run(synth_stream, tmp_path / "r", FAST, method="si", max_steps_per_task=3)
    assert scalers[0].get_scale() == 2.0**17  # it overflowed once and backed off
    assert (0, 1) not in seen and seen  # task 0's first step was skipped, later ones ran
    for rec in _logs(tmp_path / "r"):
        assert all(v == v and abs(v) != float("inf") for k, v in rec.items() if k == "loss")


def test_fp16_on_the_cpu_is_refused(synth_stream, tmp_path):
    """Accelerate runs neither float16 autocast nor loss scaling on the CPU: a run asked
    for fp16 would train in float32 and record fp16."""
    with pytest.raises(CvlError, match="--precision fp16 needs a GPU"):
        train_run(synth_stream, tmp_path / "r", FAST, precision="fp16", device="cpu")
    assert not (tmp_path / "r" / "run.json").exists()
