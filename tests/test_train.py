"""The training engine: per-task checkpoints, methods seqft/joint/zeroshot, buffers, resume."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from device_helpers import DEVICES
from safetensors.torch import load_file
from train_helpers import FAST, assert_same_task_weights, interrupt_then_resume, task_log

from cvl.cli import main
from cvl.errors import CvlError
from cvl.runs import finished_tasks, load_run
from cvl.train.config import resolve
from cvl.train.loop import Trainer
from cvl.train.optim import cosine_schedule


def _train(stream, out, force=False, **kw):
    cfg = resolve(None, {"stream": str(stream), "out": str(out), **FAST, **kw})
    t = Trainer(cfg, force=force, progress=False)
    t.run()
    return t


def _weights(path):
    return load_file(str(path))


def test_seqft_writes_one_checkpoint_per_task(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "r", epochs=2)
    run = load_run(tmp_path / "r")
    assert run["config"]["method"] == "seqft" and run["stream"]["task_order"] == ["t0", "t1", "t2"]
    done = finished_tasks(tmp_path / "r")
    assert [(c.index, c.name) for c in done] == [(0, "t0"), (1, "t1"), (2, "t2")]
    assert (tmp_path / "r" / "init" / "model.safetensors").is_file()
    log = [json.loads(x) for x in (done[0].path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 * (96 // 16) and {"itc", "loss", "lr", "samples_per_s"} <= set(log[0])
    assert log[-1]["itc"] < log[0]["itc"]  # it learns
    w0, w1 = _weights(done[0].model_path), _weights(done[1].model_path)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    assert not (tmp_path / "r" / "last").exists()


def test_joint_and_cumulative(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "j", method="joint")
    done = finished_tasks(tmp_path / "j")
    assert [c.index for c in done] == [2]
    # the items it trained on: the union of the three tasks' 96 (not the last task's own)
    assert json.loads((done[0].path / "task.json").read_text())["train_items"] == 3 * 96
    steps = len((done[0].path / "train_log.jsonl").read_text().splitlines())
    assert steps == 3 * 96 // 16  # trained on the union of the three tasks
    _train(synth_stream, tmp_path / "c", method="joint", method_args={"cumulative": True})
    logs = [
        len((c.path / "train_log.jsonl").read_text().splitlines())
        for c in finished_tasks(tmp_path / "c")
    ]
    assert logs == [6, 12, 18]


def test_zeroshot_saves_initial_weights_everywhere(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "z", method="zeroshot")
    init = _weights(tmp_path / "z" / "init" / "model.safetensors")
    for c in finished_tasks(tmp_path / "z"):
        w = _weights(c.model_path)
        assert all(torch.equal(init[k], w[k]) for k in init)


def test_reservoir_buffer_is_mixed_in_and_saved(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "b", buffer="reservoir", buffer_size=32, max_steps_per_task=2)
    done = finished_tasks(tmp_path / "b")
    from cvl.train.checkpoint import load_state

    items = load_state(done[1].path, "method_state")["buffer"]["items"]  # int64 positions
    assert sum(len(v) for v in items.values()) == 32
    assert set(items) == {"t0", "t1"}
    info = json.loads((done[1].path / "task.json").read_text())
    assert info["buffer_items"] == 32


@pytest.mark.parametrize("device", DEVICES)
def test_resume_mid_task_gives_identical_weights(synth_stream, tmp_path, monkeypatch, device):
    """Run a: loader in the main process; run b: 2 loader workers, interrupted and resumed.

    Same weights and the same log lines (deterministic mode, on the CPU and on CUDA):
    decoding does not depend on the workers, and log lines fall on checkpoint steps too
    (lines at 2 and 4 = checkpoints, 3 = log_every, 5 = end), so a resumed run rewrites the
    lines it drops."""
    from cvl.methods.seqft import SeqFT

    kw = dict(epochs=2, checkpoint_every=2, max_steps_per_task=5, log_every=3, device=device)
    _train(synth_stream, tmp_path / "a", **kw)
    pos = interrupt_then_resume(
        lambda out: _train(synth_stream, out, workers=2, **kw), SeqFT, tmp_path / "b", monkeypatch
    )
    assert pos["step"] == 2
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")
    la, lb = task_log(tmp_path / "a", 1), task_log(tmp_path / "b", 1)
    assert [(r["step"], r["steps"]) for r in la] == [(2, 2), (3, 1), (4, 1), (5, 1)]
    drop = ("samples_per_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in la] == [
        {k: v for k, v in r.items() if k not in drop} for r in lb
    ]


def test_log_lines_average_their_steps(synth_stream, tmp_path):
    """A line every 2 steps holds the step means of what log_every=1 writes line by line."""
    kw = dict(max_steps_per_task=3, grad_clip=1.0)
    _train(synth_stream, tmp_path / "one", **kw)
    _train(synth_stream, tmp_path / "two", log_every=2, **kw)
    l1, l2 = task_log(tmp_path / "one", 0), task_log(tmp_path / "two", 0)
    assert [r["step"] for r in l1] == [1, 2, 3] and [r["step"] for r in l2] == [2, 3]
    assert [r["steps"] for r in l2] == [2, 1]
    for k in ("loss", "itc", "grad_norm"):
        assert l2[0][k] == pytest.approx((l1[0][k] + l1[1][k]) / 2, rel=1e-6), k
        assert l2[1][k] == pytest.approx(l1[2][k], rel=1e-6), k
    assert l2[0]["lr"] == l1[1]["lr"]  # the lr of the line's last step
    assert l2[1]["global_step"] == 3
    # 16 pairs per step of real work: far below a million pairs/s (a reset clock would not be)
    assert all(0 < r["samples_per_s"] < 1e5 for r in l1 + l2)


def test_non_finite_loss_is_named_at_its_step_even_between_log_lines(
    synth_stream, tmp_path, monkeypatch
):
    """A NaN loss at step 2 is found at the next log line (step 3) and named with its step;
    the run stops before that line or the checkpoint that falls on it is written."""
    from cvl.methods.seqft import SeqFT

    real = SeqFT.loss

    def nan_at_step_1(self, batch, out, ctx):
        t = real(self, batch, out, ctx)
        return {k: v * float("nan") for k, v in t.items()} if ctx.step == 1 else t

    monkeypatch.setattr(SeqFT, "loss", nan_at_step_1)
    out = tmp_path / "n"
    with pytest.raises(CvlError, match=r"non-finite loss at task t0 \(index 0\), step 2: itc=nan"):
        _train(synth_stream, out, max_steps_per_task=4, log_every=3, checkpoint_every=3)
    # found at step 3's line (nothing is read per step): neither that line nor its checkpoint
    assert not (out / "last").exists() and not (out / "logs" / "00-t0.jsonl").exists()


def test_log_window_means_and_the_first_nonfinite_step_by_hand():
    """The window keeps each step's values as they are and reduces them once: with
    grad_accum 2, step 1's micro-batches (itc 1, 3; metric m 4 on one of them) and step 2's
    (itc 5, 7, grad norm NaN) give itc (2 + 6) / 2 = 4, m = (4 / 2) / (1 / 2) = 4, and the
    first non-finite step is step 2, by its grad norm (`--grad-clip` computed it)."""
    from cvl.train.logwindow import LogWindow, first_nonfinite

    w = LogWindow(torch.device("cpu"), grad_accum=2)
    batch = {"image": torch.zeros(3, 1), "n_replaced": 1}
    for step, (a, b), g in ((1, (1.0, 3.0), 0.5), (2, (5.0, 7.0), float("nan"))):
        w.begin_step(step, 0.1 * step, [f"id{step}"])
        w.add_micro({"itc": torch.tensor(a)}, {"m": torch.tensor(4.0)} if step == 1 else {}, batch)
        w.add_micro({"itc": torch.tensor(b)}, {}, batch)
        w.add_step(torch.tensor(g))
    assert w.lr == pytest.approx(0.2)
    vals, steps = w.reduce()
    assert vals["t:itc"] == 4.0 and vals["m:m"] == 4.0
    assert (vals["samples"], vals["replaced"]) == (12, 4) and w.steps == 0
    assert [t["itc"] for _, t in steps] == [2.0, 6.0]
    rec, terms = first_nonfinite(steps)
    assert rec.step == 2 and rec.ids == ["id2"] and math.isnan(terms["grad_norm"])


def test_fused_adamw_is_the_cuda_default_and_an_option_elsewhere():
    """torch's fused AdamW where cvl trains on CUDA (unless --no-fused-adamw, or fp16: its
    scaler's skipped steps must stay visible); the CPU keeps the for-loop AdamW (its fused
    kernel rounds differently) unless --fused-adamw; LAMB has none."""
    from cvl.train.optim import adamw_impl, optimizer_with_schedule

    def cfg(**kw):
        return resolve(None, {"stream": "s", "out": "o", **kw})

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto, on, off = (cfg(fused_adamw=v) for v in (None, True, False))
    assert [adamw_impl(c, cuda) for c in (auto, on, off)] == ["fused", "fused", "default"]
    assert [adamw_impl(c, cpu) for c in (auto, on, off)] == ["default", "fused", "default"]
    assert adamw_impl(cfg(optimizer="lamb"), cuda) == "lamb"
    assert adamw_impl(cfg(precision="fp16"), cuda) == "default"  # overflows seen by the loop
    with pytest.raises(CvlError, match="--fused-adamw with --precision fp16"):
        cfg(precision="fp16", fused_adamw=True)
    with pytest.raises(CvlError, match="--fused-adamw is AdamW's; --optimizer is lamb"):
        cfg(optimizer="lamb", fused_adamw=True)
    ps = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert optimizer_with_schedule(ps, on, 4)[0].defaults["fused"] is True
    assert not optimizer_with_schedule(ps, auto, 4)[0].defaults["fused"]


def test_resume_with_fused_adamw_is_bit_identical(synth_stream, tmp_path, monkeypatch):
    """The fused AdamW's state (its step counters on the parameters' device) goes through a
    mid-task checkpoint: an interrupted run ends like an uninterrupted one (here on the CPU;
    on CUDA, where it is the default, the `gpu` case of the resume test above)."""
    from cvl.methods.seqft import SeqFT

    kw = dict(checkpoint_every=2, max_steps_per_task=4, fused_adamw=True, device="cpu")
    _train(synth_stream, tmp_path / "a", **kw)
    pos = interrupt_then_resume(
        lambda out: _train(synth_stream, out, **kw), SeqFT, tmp_path / "b", monkeypatch
    )
    assert pos["step"] == 2
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")
    assert load_run(tmp_path / "b")["runtime"]["optimizer_impl"] == "fused"


def test_changed_config_is_refused_unless_forced(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "r", max_steps_per_task=1)
    with pytest.raises(CvlError, match=r"lr: 0.0005 -> 0.001"):
        _train(synth_stream, tmp_path / "r", max_steps_per_task=1, lr=1e-3)
    _train(synth_stream, tmp_path / "r", max_steps_per_task=1, workers=0, log_every=5)  # same
    _train(synth_stream, tmp_path / "r", max_steps_per_task=1, lr=1e-3, force=True)
    assert load_run(tmp_path / "r")["config"]["lr"] == 5e-4  # finished: nothing trains with it
    shutil.rmtree(tmp_path / "r" / "tasks" / "02-t2")
    _train(synth_stream, tmp_path / "r", max_steps_per_task=1, lr=1e-3, force=True)
    run = load_run(tmp_path / "r")
    assert run["config"]["lr"] == 1e-3 and run["changes"][0]["task_index"] == 2


def test_cosine_schedule():
    f = cosine_schedule(10, 0.2, 1.0, 0.1)
    assert [round(f(s), 4) for s in (0, 1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.1)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5)


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--method", "nope"], "unknown method 'nope'"),
        (["--buffer-size", "10"], "--buffer-size given without --buffer"),
        (["--epochs", "0"], "'--epochs': must be an integer >= 1, got 0"),
        (["--method-arg", "cumulative"], "expected NAME=VALUE"),
        (["--method", "joint", "--method-arg", "alpha=2"], "has no argument 'alpha'"),
        (["--device", "tpu"], "expected auto, cpu, cuda or cuda:N"),
    ],
)
def test_cli_errors(synth_stream, tmp_path, argv, msg, capsys):
    rc = main(
        ["train", "--stream", str(synth_stream), "--out", str(tmp_path / "x"), "--quiet", *argv]
    )
    assert rc == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("kind, config", [("clip", "tiny-vit"), ("fusion", "tiny")])
def test_grad_checkpointing_gives_the_same_gradients(kind, config):
    from cvl.losses import clip_loss
    from cvl.models import build_model

    torch.manual_seed(0)
    model = build_model(kind, config)
    images = torch.randn(4, 3, model.image_size, model.image_size)
    tokens = model.tokenizer(["red circle", "blue square", "a green star", "two dots"])

    def grads():
        model.zero_grad()
        out = model(images, tokens)
        clip_loss(out["image_features"], out["text_features"], out["logit_scale"]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.set_grad_checkpointing(True)
    ckpt = grads()
    assert plain.keys() == ckpt.keys() and len(plain) > 10
    assert all(torch.allclose(plain[k], ckpt[k], atol=1e-6) for k in plain)


@pytest.mark.slow  # dynamo's graph capture: tens of seconds on 2 busy cores
def test_compile_and_grad_checkpointing_train_like_the_plain_loop(
    synth_stream, tmp_path, monkeypatch
):
    """--compile wraps the training forward in torch.compile (here its 'eager' backend: the
    same graph capture without a C++ toolchain), --grad-checkpointing recomputes activations;
    neither changes what is computed."""
    real = torch.compile
    calls = []

    def eager_compile(model, **kw):
        calls.append(type(model).__name__)
        return real(model, backend="eager")

    monkeypatch.setattr(torch, "compile", eager_compile)
    kw = dict(max_steps_per_task=1, model_config="tiny-vit")
    _train(synth_stream, tmp_path / "plain", **kw)
    t = _train(synth_stream, tmp_path / "fast", compile=True, grad_checkpointing=True, **kw)
    assert calls == ["CLIPModel"] and t.model.clip.transformer.grad_checkpointing
    la, lb = task_log(tmp_path / "plain", 2), task_log(tmp_path / "fast", 2)
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], abs=1e-5)
    wa = _weights(finished_tasks(tmp_path / "plain")[-1].model_path)
    wb = _weights(finished_tasks(tmp_path / "fast")[-1].model_path)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
    # the compiled step is counted by a probe on the eager model (cvl.train.cost); with
    # --grad-checkpointing it holds the forward recomputed in backward: up to 1/3 more
    ca, cb = (
        json.loads((tmp_path / r / "tasks/02-t2/task.json").read_text())["cost"]
        for r in ("plain", "fast")
    )
    assert cb["step_counted_on"] == "probe on the eager model (--compile)"
    assert ca["flops_per_step"] < cb["flops_per_step"] <= 1.34 * ca["flops_per_step"]


def test_lamb_optimizer_step_by_hand():
    """`optimizer: lamb` (IncCLIP): step 1 of LAMB on w = [3, 4] (decayed) and b = [2] (not).
    Adam's bias-corrected direction is g/|g| = [1, -1]; + wd·w = [2.5, 1.0]; trust ratio
    ||w|| / ||u|| = 5 / sqrt(7.25); w -= lr · ratio · u. b: no decay, no trust ratio (ratio 1):
    b -= lr · 1. AdamW would give w = [2.75, 3.9]."""
    from types import SimpleNamespace

    from cvl.train.optim import optimizer_with_schedule

    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
    b = torch.nn.Parameter(torch.tensor([2.0]))
    cfg = SimpleNamespace(
        optimizer="lamb",
        lr=0.1,
        min_lr=0.1,
        warmup=0.0,
        weight_decay=0.5,
        beta1=0.9,
        beta2=0.99,
        eps=1e-12,
    )
    opt, _ = optimizer_with_schedule([w, b], cfg, steps=10)
    w.grad = torch.tensor([[1.0, -1.0]])
    b.grad = torch.tensor([0.5])
    opt.step()
    ratio = 5.0 / math.sqrt(2.5**2 + 1.0**2)
    want = torch.tensor([[3.0 - 0.1 * ratio * 2.5, 4.0 - 0.1 * ratio * 1.0]])
    assert torch.allclose(w.detach(), want, atol=1e-6), (w, want)
    assert torch.allclose(b.detach(), torch.tensor([1.9]), atol=1e-6)
    cfg.optimizer = "adamw"
    w2 = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
    opt, _ = optimizer_with_schedule([w2], cfg, steps=10)
    w2.grad = torch.tensor([[1.0, -1.0]])
    opt.step()
    assert torch.allclose(w2.detach(), torch.tensor([[2.75, 3.9]]), atol=1e-6)


def _argv(stream, out, *extra):
    return [
        "train",
        "--stream",
        str(stream),
        "--out",
        str(out),
        "--quiet",
        "--log-with",
        "none",
    ] + [
        *("--model-config", "tiny", "--epochs", "1", "--batch-size", "16", "--workers", "0"),
        *("--max-steps-per-task", "1", *extra),
    ]


def test_device_and_determinism_are_recorded_and_may_change_on_resume(
    synth_stream, tmp_path, capsys
):
    """`--device cpu` trains on the CPU whatever the machine has; run.json records the mode
    and where it came from; switching it on resume needs no --force (the maths is the same),
    is said, and the earlier setting stays recorded."""
    out = tmp_path / "r"
    assert main(_argv(synth_stream, out, "--device", "cpu")) == 0
    run = load_run(out)
    assert run["runtime"] == {
        "device": "cpu",
        "deterministic": True,
        "deterministic_source": "default",
        "optimizer_impl": "default",  # the CPU keeps torch's for-loop AdamW
        "batchnorm_statistics": "one process",  # the tiny ResNet CLIP (--sync-bn)
    }
    assert run["config"]["device"] == "cpu" and run["config"]["deterministic"] is None
    assert run["earlier_runtimes"] == []
    # the same finished run opened again in the other mode: nothing trains, nothing changes
    capsys.readouterr()
    before = (out / "run.json").read_text()
    assert main(_argv(synth_stream, out, "--device", "cpu", "--no-deterministic")) == 0
    assert "continues with" not in capsys.readouterr().out
    assert (out / "run.json").read_text() == before
    # its last task trained again in the other mode: said and recorded
    shutil.rmtree(finished_tasks(out)[-1].path)
    assert main(_argv(synth_stream, out, "--device", "cpu", "--no-deterministic")) == 0
    assert "continues with --no-deterministic" in capsys.readouterr().out
    run = load_run(out)
    assert run["runtime"]["deterministic"] is False
    assert run["runtime"]["deterministic_source"] == "option"
    assert run["earlier_runtimes"] == [
        {
            "device": "cpu",
            "deterministic": True,
            "deterministic_source": "default",
            "optimizer_impl": "default",
            "batchnorm_statistics": "one process",
        }
    ]
    assert not torch.are_deterministic_algorithms_enabled()


def test_op_without_deterministic_kernel_stops_with_one_line(
    synth_stream, tmp_path, monkeypatch, capsys
):
    """A method whose step uses `put_` (no deterministic kernel, on the CPU too) stops a
    deterministic run with one line naming the op; --no-deterministic trains it."""
    from cvl.methods.seqft import SeqFT

    real = SeqFT.loss

    def loss(self, batch, out, ctx):
        terms = real(self, batch, out, ctx)
        z = torch.zeros(4, device=terms["itc"].device)
        z.put_(torch.tensor([0, 0], device=z.device), terms["itc"].detach().expand(2))
        return {**terms, "itc": terms["itc"] + 0 * z.sum()}

    monkeypatch.setattr(SeqFT, "loss", loss)
    assert main(_argv(synth_stream, tmp_path / "a", "--device", "cpu")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("error: put_ has no deterministic implementation on cpu")
    assert "--no-deterministic" in err
    assert main(_argv(synth_stream, tmp_path / "b", "--device", "cpu", "--no-deterministic")) == 0
    assert finished_tasks(tmp_path / "b")


def test_more_processes_than_gpus_stops_before_training(
    synth_stream, tmp_path, monkeypatch, capsys
):
    """2 processes on a node with 1 GPU: one line (use fewer processes or --device cpu), no run
    folder, instead of NCCL's duplicate-GPU failure."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    assert main(_argv(synth_stream, tmp_path / "r")) == 2
    err = capsys.readouterr().err
    assert "launches 2 processes but has 1 GPU" in err and "--device cpu" in err
    assert not (tmp_path / "r").exists()


def test_each_task_frees_the_previous_optimizer_without_a_collection(
    synth_stream, tmp_path, monkeypatch
):
    """Before task k's optimizer is made, task k-1's (and its moments) is gone, freed by
    reference counting alone: with the collector off, none of the earlier optimizers is alive
    then and the accelerator's list is empty (cvl.device.drop_optimizers replaced Accelerate's
    free_memory(), whose gc.collect() cost ~0.4 s a task)."""
    import gc
    import weakref

    import cvl.train.loop as loop

    made, alive_at_drop = [], []
    real_make, real_drop = loop.optimizer_with_schedule, loop.drop_optimizers

    def make(*a, **k):
        opt, sched = real_make(*a, **k)
        made.append(weakref.ref(opt))
        return opt, sched

    def drop(acc):
        real_drop(acc)
        alive_at_drop.append(sum(r() is not None for r in made))
        assert acc._optimizers == []

    monkeypatch.setattr(loop, "optimizer_with_schedule", make)
    monkeypatch.setattr(loop, "drop_optimizers", drop)
    gc.collect()
    gc.disable()
    try:
        _train(synth_stream, tmp_path / "r", max_steps_per_task=1)
    finally:
        gc.enable()
    assert len(made) == 3 and alive_at_drop == [0, 0, 0]
