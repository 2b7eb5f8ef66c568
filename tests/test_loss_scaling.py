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
from train_helpers import FAST, assert_same_task_weights, interrupt_then_resume, train_run

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


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_loss_scaled_run_resumes_bitwise_with_its_scale(synth_stream, tmp_path, monkeypatch):
    """The scale is checkpointed: a 2¹²⁷ start overflows task 0's first step and backs off to
    2¹⁷ (that step skipped). Interrupted in step 3 of task 1 and resumed from `last/` (step 2),
    the run goes on at 2¹⁷; restarted at 2¹²⁷ it would skip step 3 and save other weights."""
    kw = dict(FAST, method="seqft", max_steps_per_task=4, checkpoint_every=1)
    scalers = _inject_scaler(monkeypatch, 2.0**127, backoff=2.0**-110)

    def train(out):
        train_run(synth_stream, out, kw)

    train(tmp_path / "a")
    assert scalers[-1].get_scale() == 2.0**17
    pos = interrupt_then_resume(train, all_methods()["seqft"], tmp_path / "b", monkeypatch)
    assert pos["step"] == 2
    assert scalers[-1].get_scale() == 2.0**17  # the resumed run's scaler
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize("init, backoff", [(2.0**16, 0.5), (2.0**127, 2.0**-110)])
def test_the_importance_pass_scales_its_loss_as_a_training_step(init, backoff):
    """Under fp16 the importance pass (EWC's / MAS's / RWalk's Fisher, AFEC's F_e) backs its
    loss up scaled. A float16 activation with dL/dy = 2⁻³⁰ (below float16's smallest
    subnormal, 2⁻²⁴) flushes to 0 unscaled; at S = 2¹⁶ it is 2⁻¹⁴ (exact), so g = 2⁻³⁰·x and
    the Fisher is g² = 2⁻⁶⁰·x² exactly. A scale that overflows (2¹²⁷) backs off (to 2¹⁷)."""
    import contextlib
    from types import SimpleNamespace

    from cvl.methods.regularizers import importance_pass

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.tensor([3.0, -2.0]))

    def objective(m, batch, ctx):
        y = (m.w * batch["x"]).half()  # a float16 activation, as under fp16 autocast
        return y.float().sum() * 2.0**-30

    scaler = torch.amp.GradScaler("cpu", init_scale=init, backoff_factor=backoff)
    acc = SimpleNamespace(scaler=scaler, autocast=contextlib.nullcontext)
    ctx = SimpleNamespace(accelerator=acc, config=None, task_index=0)
    (f,) = importance_pass(model, iter([{"x": torch.tensor([1.0, 0.5])}]), objective, ctx)
    assert f.tolist() == [2.0**-60, 2.0**-62]
    assert scaler.get_scale() == init  # read, not updated: the pass is no training step


@pytest.mark.parametrize("init, backoff", [(2.0**16, 0.5), (2.0**127, 2.0**-110)])
def test_incclip_generation_scales_its_loss_as_a_training_step(init, backoff, monkeypatch):
    """IncCLIP's pseudo-text SGD back-propagates at the loop's loss scale (issue 52 item 7),
    as the importance passes do. A stand-in text tower whose feature passes through a float16
    activation y = Σ ē (one feature, s = 2⁻³⁰·y < s_min, one memory image): dL/dy = −2⁻³⁰,
    below float16's smallest subnormal, flushes to 0 unscaled (the pseudo text would not
    move); at S = 2¹⁶ (or 2¹²⁷ backed off to 2¹⁷) it is exact, so one SGD step at lr 2²⁰
    moves every optimised entry by +2⁻¹⁰, exactly. The loop's scaler is read, not updated."""
    import contextlib
    from types import SimpleNamespace

    import cvl.methods.incclip as incclip_mod
    from cvl.methods.base import frozen_copy
    from cvl.models import build_model

    def tower(model, x, tokens, normalize=True, length=None):
        y = x.sum(dim=(1, 2)).half()  # a float16 activation, as under fp16 autocast
        return (y.float() * 2.0**-30)[:, None]

    monkeypatch.setattr(incclip_mod, "encode_text_embeds", tower)
    old = frozen_copy(build_model("clip", "tiny"))
    scaler = torch.amp.GradScaler("cpu", init_scale=init, backoff_factor=backoff)
    acc = SimpleNamespace(scaler=scaler, autocast=contextlib.nullcontext, num_processes=1)

    def generate(steps: int) -> dict:
        m = incclip_mod.IncCLIP({"n_pseudo": 2, "gen_steps": steps, "gen_lr": 2.0**20})
        m.old, m.mem_features = old, torch.ones(1, 1)
        m.mem_tokens = old.tokenizer(["a red circle"])
        ctx = SimpleNamespace(
            accelerator=acc,
            generator=torch.Generator().manual_seed(0),
            config=SimpleNamespace(batch_size=1),
            device=torch.device("cpu"),
        )
        m.before_step(ctx)
        return m.pseudo

    start, moved = generate(0), generate(1)
    n = moved["length"]
    assert float(moved["loss0"]) == pytest.approx(0.2, abs=1e-6)  # s ≈ 0: s_min − s
    assert torch.equal(moved["embeds"][:, :n], start["embeds"][:, :n] + 2.0**-10)
    assert torch.equal(moved["embeds"][:, n:], start["embeds"][:, n:])
    assert scaler.get_scale() == init  # read, not updated


def test_scaled_grads_lets_ranks_with_different_data_agree_on_the_scale(monkeypatch):
    """`agree`: another rank's overflow (the all_reduce's MIN of the finite flags) makes this
    rank redo its finite pass at the backed-off scale too, as one process holding both ranks'
    data would; each try is one all_reduce of one flag."""
    import cvl.methods.scaling as scaling

    calls = []

    def all_reduce(t, op=None):
        calls.append(float(t))
        if len(calls) == 1:
            t.zero_()  # the other rank overflowed at the first scale

    monkeypatch.setattr(scaling, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    scales = []
    x = torch.tensor([3.0], requires_grad=True)

    def loss_of():
        return (x * 2.0).sum()

    def grads_of(loss):
        scales.append(float(loss.detach() / 6.0))
        return list(torch.autograd.grad(loss, x))

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, backoff_factor=0.5)
    (g,) = scaling.scaled_grads(loss_of, grads_of, scaler, agree=True)
    assert scales == [2.0**16, 2.0**15] and calls == [1.0, 1.0]
    assert g.tolist() == [2.0]
    calls.clear()
    scales.clear()
    scaling.scaled_grads(loss_of, grads_of, scaler, agree=False)  # ranks already agree
    assert scales == [2.0**16] and calls == []
