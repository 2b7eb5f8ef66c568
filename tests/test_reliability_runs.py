"""What a new run does with every documented setting (issue 47): every value of every choice
option of `cvl train` trains a new run end to end; what the command line and the stream's
manifest can refuse is refused before the run folder exists, and a folder that never
trained a step does not block the corrected command; a schedule that cannot train a task is
refused; the same tensors give the same checkpoint bytes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import click
import pytest
from reliability_helpers import build_tiny_stream, train_argv

from cvl.cli import cli, main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("runs") / "s")


def _train_command() -> click.Command:
    return cli.get_command(click.Context(cli), "train")


# One tiny new run per row; together they hold every value of every choice option of
# `cvl train` (checked against click's choices by the test below, so a new value needs a
# run). --buffer's None is no buffer. Values no run can take here: CPU_REFUSED. --sync-bn
# acts with several processes only: tests/test_batchnorm_sync.py trains 2 processes with it.
RUNS = [
    {"model": "fusion", "optimizer": "adamw", "lr_schedule": "cosine", "precision": "no",
     "augment": "openclip", "buffer": "reservoir", "tune": "full", "log_with": "none",
     "base_loss": "itc", "select": "auto", "sync_bn": "on"},
    {"model": "clip", "optimizer": "lamb", "lr_schedule": "stream-cosine", "precision": "bf16",
     "augment": "ctp", "buffer": "ring", "tune": "lora", "log_with": "auto",
     "base_loss": "class-ce", "select": "last", "sync_bn": "off"},
    {"model": "clip", "optimizer": "adamw", "lr_schedule": "cosine-fomo", "precision": "no",
     "augment": "none", "buffer": "kmeans", "tune": "dora", "log_with": "none",
     "base_loss": "itc", "select": "best-val", "sync_bn": "auto"},
    {"model": "clip", "optimizer": "lamb", "lr_schedule": "cosine-ar", "precision": "no",
     "augment": "openclip", "buffer": "mof", "tune": "vera", "log_with": "wandb",
     "base_loss": "class-ce", "select": "auto"},
    {"model": "clip", "optimizer": "adamw", "lr_schedule": "cosine-dyn", "precision": "bf16",
     "augment": "ctp", "buffer": "cumulative-all", "tune": "bitfit", "log_with": "none",
     "base_loss": "itc", "select": "last"},
    {"model": "clip", "optimizer": "adamw", "lr_schedule": "rsqrt", "precision": "no",
     "augment": "none", "buffer": "cumulative-equal", "tune": "lnfit", "log_with": "none",
     "base_loss": "class-ce", "select": "best-val"},
    {"model": "clip", "optimizer": "lamb", "lr_schedule": "rsqrt-ar", "precision": "no",
     "augment": "openclip", "buffer": "cumulative-exp", "tune": "locked-image",
     "log_with": "none", "base_loss": "itc", "select": "auto"},
    {"model": "clip", "optimizer": "adamw", "lr_schedule": "rsqrt-cont", "precision": "no",
     "augment": "ctp", "buffer": None, "tune": "locked-text", "log_with": "none",
     "base_loss": "class-ce", "select": "last"},
]  # fmt: skip
# float16 autocast needs a GPU: one line on the CPU; tensorboard: trains where installed,
# else one line (both in the test after the runs)
# --accum-mode: plain is every run's default; cached trains in tests/test_accum.py (it refuses
# buffers, the fusion model and most methods, which these rows use)
ELSEWHERE = {
    ("precision", "fp16"),
    ("log_with", "tensorboard"),
    ("accum_mode", "plain"),
    ("accum_mode", "cached"),
}


def test_every_value_of_every_train_choice_option_has_a_run():
    """The meta-test: no documented value of `cvl train` goes untried on a new run."""
    missing = []
    for p in _train_command().params:
        if isinstance(p, click.Option) and isinstance(p.type, click.Choice):
            ran = {r.get(p.name) for r in RUNS} | {v for o, v in ELSEWHERE if o == p.name}
            missing += [f"--{p.name.replace('_', '-')} {v}" for v in p.type.choices if v not in ran]
    assert not missing, missing


def _argv(run: dict, stream: Path, out: Path) -> list[str]:
    argv = train_argv(stream, out, "seqft")
    argv[argv.index("--max-steps-per-task") + 1] = "3"  # cosine-ar: a peak > 0 needs 2 decay steps
    argv += ["--checkpoint-every", "0", "--workers", "0", "--warmup", "1"]
    for k, v in run.items():
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", v]
    if run.get("buffer") not in (None, "cumulative-all"):
        argv += ["--buffer-size", "8"]
    return argv


@pytest.mark.parametrize("run", RUNS, ids=[r["lr_schedule"] for r in RUNS])
def test_every_train_choice_value_trains_a_new_run(tiny, tmp_path, monkeypatch, capsys, run):
    """A new run of each row trains every task its 3 steps (the --lr-schedule stream-cosine
    of a new run without --budget was an AttributeError before its first step)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")  # wandb's own no-op mode: no account, no net
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    out = tmp_path / "r"
    assert main(_argv(run, tiny, out)) == 0, capsys.readouterr().err
    cfg = json.loads((out / "run.json").read_text())["config"]
    assert {k: cfg[k] for k in run} == run
    for t in ("00-t0", "01-t1", "02-t2"):
        assert json.loads((out / "tasks" / t / "task.json").read_text())["steps"] == 3
    _wandb_teardown()


def _wandb_teardown() -> None:
    """End wandb's process-wide session, if a test started one."""
    import sys

    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def test_fp16_on_the_cpu_and_a_tracker_that_cannot_start_are_one_line(
    tiny, tmp_path, monkeypatch, capsys
):
    """--precision fp16 on the CPU is refused before anything is written, and so is
    --log-with tensorboard where tensorboard is not installed (Accelerate only warned and
    logged nothing); wandb without an account (no API key, not offline) was a traceback from
    inside Accelerate."""
    from importlib.util import find_spec

    out = tmp_path / "runs" / "r"
    assert main([*train_argv(tiny, out, "seqft"), "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--precision fp16 needs a GPU" in err
    assert not (tmp_path / "runs").exists()
    tb = [*train_argv(tiny, out, "seqft"), "--log-with", "tensorboard"]
    if find_spec("tensorboard"):
        assert main([*tb, "--max-steps-per-task", "1", "--workers", "0"]) == 0
        assert any((out / "logs").rglob("events.out.tfevents.*"))
        shutil.rmtree(tmp_path / "runs")
    else:
        assert main(tb) == 2
        err = capsys.readouterr().err
        assert "--log-with tensorboard: the tensorboard package is not installed" in err
        assert err.count("\n") == 1 and not (tmp_path / "runs").exists()
    _wandb_teardown()  # a session an earlier test started keeps its settings
    for k in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    for k in ("HOME", "WANDB_CONFIG_DIR", "WANDB_DIR"):
        monkeypatch.setenv(k, str(tmp_path))
    assert main([*train_argv(tiny, out, "seqft"), "--log-with", "wandb"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --log-with wandb: the tracker did not start (")
    assert err.count("\n") == 1 and "Traceback" not in err


def _no_classes(stream: Path, to: Path) -> Path:
    """A copy of `stream` whose tasks list no classes (as a caption stream's)."""
    shutil.copytree(stream, to)
    m = json.loads((to / "stream.json").read_text())
    for info in m["tasks"].values():
        info.pop("categories", None)
    (to / "stream.json").write_text(json.dumps(m))
    return to


REFUSED_FROM_THE_STREAM = [  # (extra arguments, what the line says)
    (["--base-loss", "class-ce"], "lists no classes (categories): --base-loss class-ce needs"),
    (["--base-loss", "class-ce", "--base-loss-arg", "template=3"], "task 't0' has 1 template"),
    # FoMo's rsqrt: a cool-down of 9 steps cannot end a task of 2
    (["--lr-schedule", "rsqrt", "--warmup", "1", "--cooldown", "9"], "a cool-down of 9 steps is"),
    # FoMo's cosine reaches the floor at a task's last step: a 1-step task trains at 0
    (["--lr-schedule", "cosine-fomo", "--max-steps-per-task", "1"], "all its 1 step(s) at a lea"),
    # a method's own setup (here iCaRL's buffer rule) runs before run.json and init/ are written
    (["--method", "icarl", "--buffer", "reservoir", "--buffer-size", "8"], "by herding: use --bu"),
]


@pytest.mark.parametrize(
    "extra, says",
    REFUSED_FROM_THE_STREAM,
    ids=[
        "class-ce-no-classes",
        "class-ce-template",
        "rsqrt-cooldown",
        "cosine-fomo-1-step",
        "setup",
    ],
)
def test_settings_the_stream_refuses_are_refused_before_the_run_folder_exists(
    tiny, tmp_path, capsys, extra, says
):
    """These were refused only at the first training step, after run.json and init/ were
    written (and the rsqrt / cosine-fomo ones not at all: the task trained at rate 0 or its
    cool-down started mid-way)."""
    stream = _no_classes(tiny, tmp_path / "s") if extra == ["--base-loss", "class-ce"] else tiny
    out = tmp_path / "runs" / "r"
    argv = train_argv(stream, out, "seqft")
    argv[argv.index("--max-steps-per-task") + 1] = "2"
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert says in err, err
    assert not (tmp_path / "runs").exists()


def test_a_run_folder_that_never_trained_a_step_does_not_block_a_corrected_command(
    tiny, tmp_path, monkeypatch, capsys
):
    """A run that failed before its first checkpoint left run.json and init/; the corrected
    command (here another seed) was refused as "another config". It now starts the run
    again: its config, and init/ of its own seed."""
    from cvl.errors import CvlError
    from cvl.train.loop import Trainer

    def fail(self, *a):
        raise CvlError("simulated failure before the first step")

    out = tmp_path / "r"
    argv = train_argv(tiny, out, "seqft")
    argv[argv.index("--max-steps-per-task") + 1] = "1"
    with monkeypatch.context() as m:
        m.setattr(Trainer, "_train_task", fail)
        assert main([*argv, "--seed", "3"]) == 2
    init3 = hashlib.sha256((out / "init" / "model.safetensors").read_bytes()).hexdigest()
    capsys.readouterr()
    assert main([*argv, "--seed", "4"]) == 0, capsys.readouterr().err
    assert json.loads((out / "run.json").read_text())["config"]["seed"] == 4
    init4 = hashlib.sha256((out / "init" / "model.safetensors").read_bytes()).hexdigest()
    assert init4 != init3  # init/ is the new seed's
    assert len(list((out / "tasks").iterdir())) == 3
    # a run that trained is still protected
    assert main([*argv, "--seed", "5"]) == 2
    assert "holds a run with another config (seed: 4 -> 5)" in capsys.readouterr().err


def test_the_same_tensors_give_the_same_checkpoint_bytes(tmp_path):
    """safetensors kept the metadata (format, cvl_kind, tied names) in a map whose order
    changes from one save to the next: the same weights gave other bytes (checksums and the
    evaluation's same-bytes reuse missed). 8 saves of one model: one set of bytes, metadata
    sorted."""
    import struct

    import torch

    from cvl.models import build_model, save_weights
    from cvl.train.checkpoint import save_state

    torch.manual_seed(0)
    model = build_model("clip", "tiny")
    digests = set()
    for i in range(8):
        save_weights(model, tmp_path / f"m{i}.safetensors")
        digests.add(hashlib.sha256((tmp_path / f"m{i}.safetensors").read_bytes()).hexdigest())
        save_state(tmp_path / f"s{i}", "state", {"b": torch.ones(2), "a": {"x": torch.zeros(3)}})
    assert len(digests) == 1
    states = {(tmp_path / f"s{i}" / "state.safetensors").read_bytes() for i in range(8)}
    assert len(states) == 1
    raw = (tmp_path / "m0.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    assert list(meta) == sorted(meta) and meta["cvl_kind"] == "clip"


def test_long_work_prints_a_progress_line_at_a_bounded_rate_without_a_terminal(monkeypatch, capsys):
    """Without a terminal (capsys: make, CI, `| tee`) a bar printed nothing at all, so an
    11-minute evaluation said nothing. Now: plain lines (no carriage returns), none for
    work shorter than the interval, then at most one per interval (30 s; 0.05 s here),
    a new loss (set_postfix) waiting for the next one."""
    import time

    import cvl.progress as progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.05)
    for _ in progress.progress_bar(range(5), desc="short"):
        pass
    assert capsys.readouterr().err == ""
    t0 = time.monotonic()
    bar = progress.progress_bar(total=12, desc="task 1/3 t0", unit="step", dynamic_ncols=True)
    for _ in range(12):
        time.sleep(0.02)
        bar.update(1)
        bar.set_postfix(loss="0.5")
    bar.close()
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and err.endswith("\n")
    assert 2 <= len(lines) <= elapsed / 0.05 + 2, lines
    assert all(x.startswith("task 1/3 t0: ") for x in lines)
    assert "12/12" in lines[-1] and "loss=0.5" in lines[-1]


def test_joint_variants_are_told_apart_in_tables():
    """The comparison table and the report called plain joint training, TiC-CLIP's
    Cumulative-All and its Oracle all "joint"."""
    from cvl.evaluation.assemble import method_label

    def label(args: dict, **cfg) -> str:
        return method_label({"method": "joint", "method_args": args, **cfg}, Path("r"))

    assert label({}) == "joint"
    assert label({"cumulative": True}) == "joint (cumulative)"
    assert label({"cumulative": True, "restart": True}) == "joint (Oracle)"
    assert (
        label({"cumulative": "true"}, buffer="ring", buffer_size=8) == "joint (cumulative)+ring(8)"
    )


def test_records_count_what_a_task_trained_on_and_eval_says_a_run_is_unfinished(
    tiny, tmp_path, capsys
):
    """task.json: a joint run's one task trained on the 3 × 32 pairs of the union (it said
    32, its own task's); the buffer before the task (what it replayed) and after. `cvl eval`
    of a run whose last task has no checkpoint yet says its last checkpoint is not the
    final model (stderr, metrics.json, summary.md)."""
    joint = tmp_path / "j"
    argv = train_argv(tiny, joint, "joint")
    argv[argv.index("--max-steps-per-task") + 1] = "1"
    assert main([*argv, "--workers", "0"]) == 0
    t = json.loads((joint / "tasks" / "02-t2" / "task.json").read_text())
    assert (t["train_items"], t["buffer_items_before"], t["buffer_items"]) == (96, 0, 0)
    run = tmp_path / "r"
    argv = train_argv(tiny, run, "seqft")
    argv[argv.index("--max-steps-per-task") + 1] = "1"
    assert main([*argv, "--workers", "0", "--buffer", "reservoir", "--buffer-size", "8"]) == 0
    counts = [json.loads((run / "tasks" / d / "task.json").read_text()) for d in ("00-t0", "01-t1")]
    assert [(c["train_items"], c["buffer_items_before"], c["buffer_items"]) for c in counts] == [
        (32, 0, 8),
        (32, 8, 8),
    ]
    shutil.rmtree(run / "tasks" / "02-t2")  # as if stopped (or still training) in task 3
    capsys.readouterr()
    fast = ["--no-zeroshot", "--no-probe", "--no-plots", "--no-cumulative", "--device", "cpu"]
    assert main(["eval", "--run", str(run), "--quiet", *fast]) == 0
    err = capsys.readouterr().err
    says = "its last checkpoint, 01-t1, is not the final model (that of task 02-t2)"
    assert f"warning: {run} is not finished" in err and says in err
    assert says in json.loads((run / "eval" / "metrics.json").read_text())["unfinished"]
    assert "**not the final model**" in (run / "eval" / "summary.md").read_text()
