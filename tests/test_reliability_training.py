"""Training faults end in one clear line or in a truthful run: `--force` with new optimizer
settings applies them from the resumed step (and run.json records it), a `--force` resume
that cannot load its state leaves run.json as it was, a full disk (also while torch.save
writes the optimizer state), a read-only filesystem or an unreadable mid-task checkpoint says
what to do, and non-finite losses or weights stop a run with a message that promises only
what exists."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_helpers import build_tiny_stream, env, train_argv

from cvl.cli import main
from cvl.train.optim import cosine_schedule


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("training") / "s")


def _nan_at(monkeypatch, when) -> None:
    """SeqFT's loss becomes NaN where `when(task index, optimizer step from 1)` is true."""
    from cvl.methods.seqft import SeqFT

    real = SeqFT.loss

    def loss(self, batch, out, ctx):
        terms = real(self, batch, out, ctx)
        if when(ctx.task_index, ctx.step + 1):
            terms = {**terms, "itc": terms["itc"] * float("nan")}
        return terms

    monkeypatch.setattr(SeqFT, "loss", loss)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def _log(out: Path, task: str) -> list[dict]:
    p = out / "tasks" / task / "train_log.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()]


def _stopped_in_task_1(tiny, out, monkeypatch, capsys) -> list[str]:
    """A run stopped at task 1 step 3 (NaN) with last/ holding step 2; the data is then fixed."""
    argv = train_argv(tiny, out, "seqft")
    _nan_at(monkeypatch, lambda t, s: (t, s) == (1, 3))
    assert main(argv) == 2
    monkeypatch.undo()
    assert json.loads((out / "last" / "position.json").read_text())["step"] == 2
    capsys.readouterr()
    return argv


# -- --force with new settings ----------------------------------------------------------------
def test_force_with_a_new_lr_applies_it_from_the_resumed_step(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    argv = _stopped_in_task_1(tiny, out, monkeypatch, capsys)
    assert main([*argv, "--lr", "1e-3", "--force"]) == 0
    f = cosine_schedule(4, 0.0, 1.0, 0.0)  # 4 steps per task, no warm-up
    lrs = {r["step"]: r["lr"] for r in _log(out, "01-t1")}
    assert lrs == pytest.approx({1: 5e-4 * f(0), 2: 5e-4 * f(1), 3: 1e-3 * f(2), 4: 1e-3 * f(3)})
    assert [r["lr"] for r in _log(out, "02-t2")] == pytest.approx([1e-3 * f(s) for s in range(4)])
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["lr"] == 1e-3
    (ch,) = run["changes"]
    assert (ch["task_index"], ch["task"], ch["step"]) == (1, "t1", 2)
    assert ch["fields"] == {"lr": [5e-4, 1e-3]}
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    assert "changed with --force from task 1 (t1), step 2: lr 0.0005 -> 0.001" in (
        capsys.readouterr().out
    )


def test_force_with_a_change_last_cannot_carry_is_refused_mid_task(
    tiny, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "r"
    argv = _stopped_in_task_1(tiny, out, monkeypatch, capsys)
    before = (out / "run.json").read_text()
    assert main([*argv, "--batch-size", "4", "--force"]) == 2
    err = _one_line(capsys)
    assert "cannot change batch_size in the middle of task t1 (last/ holds step 2)" in err
    assert "delete" in err and "last/ to restart the task" in err
    assert (out / "run.json").read_text() == before  # nothing recorded for a refused change


# -- one-line errors with the next step ---------------------------------------------------------
def _safetensors_full(*_a, **_k):
    from safetensors import SafetensorError

    raise SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
        'space left on device" })'
    )


@pytest.mark.parametrize("writer", ["save_torch", "save_weights"])
def test_disk_full_while_saving_last_is_one_line_and_the_rerun_resumes(
    tiny, tmp_path, monkeypatch, capsys, writer
):
    import cvl.models
    import cvl.train.rundir as rundir

    out = tmp_path / "r"
    argv = train_argv(tiny, out, "seqft")
    calls = {"n": 0}
    real = rundir.save_torch if writer == "save_torch" else cvl.models.save_weights

    def full(*args, **kw):
        path = Path(args[0] if writer == "save_torch" else args[1])
        if path.parent.name.startswith(".last."):  # the second mid-task checkpoint fails
            calls["n"] += 1
            if calls["n"] == 2 and writer == "save_torch":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            if calls["n"] == 2:
                _safetensors_full()
        return real(*args, **kw)

    if writer == "save_torch":
        monkeypatch.setattr(rundir, "save_torch", full)
    else:
        monkeypatch.setattr(cvl.models, "save_weights", full)
    assert main(argv) == 2
    err = _one_line(capsys)
    assert "no space left on device while writing it" in err and "rerun the same command" in err
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]
    monkeypatch.undo()
    assert main(argv) == 0
    assert len(list((out / "tasks").iterdir())) == 3


def test_truncated_last_optimizer_says_delete_last(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    argv = _stopped_in_task_1(tiny, out, monkeypatch, capsys)
    opt = out / "last" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    assert main(argv) == 2
    err = _one_line(capsys)
    assert "the mid-task checkpoint of task t1 cannot be read" in err
    assert f"delete {out / 'last'}/ to restart the task from its beginning" in err


# -- non-finite losses and weights ------------------------------------------------------------
def test_nonfinite_message_before_any_checkpoint_promises_no_resume(
    tiny, tmp_path, monkeypatch, capsys
):
    _nan_at(monkeypatch, lambda t, s: (t, s) == (0, 1))
    assert main(train_argv(tiny, tmp_path / "r", "seqft")) == 2
    err = _one_line(capsys)
    assert "non-finite loss at task t0 (index 0), step 1" in err
    assert "last finished task" not in err
    assert "no checkpoint yet: a rerun starts from the initial weights" in err
    assert "lr 0.0005 at this step, --lr 0.0005: a lower --lr" in err


def test_a_task_that_skips_more_than_its_share_of_steps_stops(tiny, tmp_path, monkeypatch, capsys):
    _nan_at(monkeypatch, lambda t, s: t == 1 and s >= 2)  # every step of task 1 from step 2
    argv = [*train_argv(tiny, tmp_path / "r", "seqft"), "--skip-nonfinite", "100"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "step 3: 2 of the task's 4 steps skipped, more than 10% (at most 1)" in err
    assert "the run can resume from last/ (task 1, step 2)" in err


def test_skipped_steps_are_counted_per_step_not_per_log_line(tiny, tmp_path, monkeypatch, capsys):
    _nan_at(monkeypatch, lambda t, s: t == 1 and s in (2, 3))
    out = tmp_path / "r"
    argv = train_argv(tiny, out, "seqft")
    i = argv.index("--max-steps-per-task")
    argv[i : i + 2] = ["--max-steps-per-task", "0", "--epochs", "5"]  # 20 steps: 2 may skip
    argv += ["--skip-nonfinite", "2", "--checkpoint-every", "0", "--log-every", "20"]
    assert main(argv) == 0
    task = json.loads((out / "tasks/01-t1/task.json").read_text())
    assert task["steps"] == 20 and task["nonfinite_skipped_steps"] == 2


def test_nonfinite_weights_stop_the_run_before_they_are_saved(tiny, tmp_path, monkeypatch, capsys):
    import torch

    from cvl.methods.seqft import SeqFT

    def after_step(self, ctx):
        if (ctx.task_index, ctx.step) == (0, 2):
            with torch.no_grad():
                next(ctx.model.parameters()).view(-1)[0] = float("inf")

    monkeypatch.setattr(SeqFT, "after_step", after_step)
    out = tmp_path / "r"
    assert main(train_argv(tiny, out, "seqft")) == 2
    err = _one_line(capsys)
    assert "non-finite weights at task t0 (index 0), step 2: 1 tensor(s)" in err
    assert "the run can resume from last/ (task 0, step 1)" in err
    assert json.loads((out / "last" / "position.json").read_text())["step"] == 1


# -- a refused or failed change leaves the run as it was ----------------------------------------
def test_a_force_resume_that_cannot_load_its_state_leaves_run_json_as_it_was(
    tiny, tmp_path, capsys
):
    """EWC's Fisher of task 0 was computed for every parameter; `--force --tune lora` would
    train only adapters. The resume fails loading that state: it says so (a state saved for
    other trainable parameters), run.json keeps the config and history the run trained with,
    and the original command still resumes."""
    import shutil

    out = tmp_path / "r"
    argv = train_argv(tiny, out, "ewc")
    argv[argv.index("--checkpoint-every") + 1] = "0"
    assert main(argv) == 0
    for t in ("01-t1", "02-t2"):
        shutil.rmtree(out / "tasks" / t)
    before = (out / "run.json").read_text()
    capsys.readouterr()
    assert main([*argv, "--tune", "lora", "--force"]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert err.count("\n") == 0, err
    assert f"{out / 'tasks' / '00-t0'}: cannot resume from the method state saved there" in err
    assert "its saved 'fisher' was computed for other trainable parameters" in err
    assert "architecture" not in err and "--force: tune changed" not in cap.out
    assert (out / "run.json").read_text() == before  # config and changes not falsified
    assert main(argv) == 0  # the original command is not refused
    assert len(list((out / "tasks").iterdir())) == 3


# -- the filesystem refuses a write: one line -------------------------------------------------
HERE = Path(__file__).resolve().parent


def _faulty(fault: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """`cvl ARGV` in a fresh process with a filesystem fault (tests/fault_run.py)."""
    return subprocess.run(
        [sys.executable, str(HERE / "fault_run.py"), *fault, "--", *argv],
        env={**env(), "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, says",
    [
        (["--fsize", "3000000"], "file too large"),  # the kernel refuses (RLIMIT_FSIZE: EFBIG)
        (["--enospc", "optimizer.pt:4096"], "no space left on device"),
    ],
    ids=["file-size-limit", "enospc"],
)
def test_disk_full_while_torch_save_writes_the_optimizer_state_is_one_line(
    tiny, tmp_path, fault, says
):
    """The weights (2 MB) fit, the optimizer state (4 MB, torch.save) does not: torch reports
    that as `RuntimeError: ... unexpected pos`; cvl says what happened and what to do, and the
    same command resumes once there is room."""
    out = tmp_path / "r"
    argv = train_argv(tiny, out, "seqft")
    r = _faulty(fault, argv)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    assert f"{out / 'last'}: {says}" in err and "rerun the same command" in err
    assert "a run resumes from its last complete checkpoint" in err
    assert main(argv) == 0
    assert len(list((out / "tasks").iterdir())) == 3


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


@pytest.mark.slow
def test_a_run_on_a_read_only_filesystem_writes_nothing_when_finished_else_one_line(tiny, tmp_path):
    """A finished run opened again has nothing to do and writes nothing (not run.json, not a
    lock file, not a log): it works on a read-only filesystem. An unfinished one says in one
    line that it cannot write there."""
    import shutil

    ro = tmp_path / "ro"
    out = ro / "r"
    argv = train_argv(tiny, out, "seqft")
    argv[argv.index("--checkpoint-every") + 1] = "0"
    assert main(argv) == 0
    before = _snapshot(tmp_path)
    r = _faulty(["--readonly", str(ro)], argv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "all 3 tasks already trained; nothing to do" in r.stdout
    assert r.stderr == "" and _snapshot(tmp_path) == before
    shutil.rmtree(out / "tasks" / "02-t2")
    r = _faulty(["--readonly", str(ro)], argv)
    assert r.returncode == 2
    err = r.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    assert "cannot write it (read-only file system)" in err
    assert not (out / "tasks" / "02-t2").exists()
