"""Kill and resume: a real `python -m cvl train` SIGKILLed from outside at a seeded random
step inside task 2, for every registered method, reruns to the same bits as an uninterrupted
run (deterministic mode; on the CPU, and on CUDA where present); a process dying inside a
checkpoint write resumes from the previous complete one; a killed `cvl eval` reuses its cache
and ends with the same numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
from pathlib import Path

import pytest
from device_helpers import DEVICES
from reliability_helpers import (
    STEPS,
    assert_same_run,
    build_tiny_stream,
    cli,
    kill_when,
    log_lines,
    method_args,
    train_argv,
    trained_methods,
)

from cvl.methods.registry import all_methods


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("reliability") / "s")


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """One uninterrupted run per method (in this process), shared by the tests."""
    root = tmp_path_factory.mktemp("reference")
    done: dict[tuple[str, str], Path] = {}

    def get(method: str, device: str = "cpu") -> Path:
        if (method, device) not in done:
            cli(train_argv(tiny, root / device / method, method, device))
            done[(method, device)] = root / device / method
        return done[(method, device)]

    return get


def kill_task(method: str) -> tuple[int, str]:
    """The task the kill lands in: task 2 (index 1), or the only task a joint run trains."""
    m = all_methods()[method]({})
    order = ["t0", "t1", "t2"]
    i = len(order) - 1 if getattr(m, "single_task", False) else 1
    return i, order[i]


def test_method_table_covers_buffers():
    """Every method that needs a buffer gets one (an entry in METHOD_EXTRA or the default)."""
    for name, cls in all_methods().items():
        if getattr(cls, "needs_buffer", False):
            assert "--buffer" in method_args(name), name


def _kill_and_resume(
    method: str, tiny: Path, ref: Path, out: Path, fork: bool, device: str = "cpu"
) -> None:
    ti, name = kill_task(method)
    k = random.Random(f"kill/{method}").randint(1, STEPS - 1)  # steps logged before the kill
    log = out / "logs" / f"{ti:02d}-{name}.jsonl"
    argv = train_argv(tiny, out, method, device)
    kill_when(argv, lambda: log_lines(log) >= k, fork=fork)
    assert not (out / "tasks" / f"{ti:02d}-{name}").exists()  # killed inside the task
    pos = out / "last" / "position.json"
    at = json.loads(pos.read_text())["step"] if pos.is_file() else 0
    assert k - 1 <= at <= k + 1
    cli(argv)  # the same command again
    assert assert_same_run(ref, out) == (1 if ti == 2 else 3)


@pytest.mark.slow
def test_sigkill_python_m_cvl_train_resumes_bitwise(tiny, reference, tmp_path):
    """The whole entry point: a fresh `python -m cvl train` interpreter, SIGKILLed."""
    _kill_and_resume("seqft", tiny, reference("seqft"), tmp_path / "run", fork=False)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", trained_methods())
def test_sigkill_inside_task_resumes_bitwise(method, device, tiny, reference, tmp_path):
    """Every registered method, deterministic, on the CPU and (where present) on CUDA: a
    training process killed from outside (forked on the CPU; on CUDA a fresh `python -m cvl`,
    since a forked child cannot use the CUDA context of its parent)."""
    ref = reference(method, device)
    _kill_and_resume(method, tiny, ref, tmp_path / "run", fork=device == "cpu", device=device)


def _dying_atomic_dir(real, crash_at: int, phase: str):
    """`atomic_dir` that, on the `crash_at`-th write of last/, writes the checkpoint to its
    temp folder and then dies like a SIGKILL (no cleanup): before the first rename, or
    between renaming the old last/ away and the new one in."""
    calls = {"n": 0}

    @contextlib.contextmanager
    def dying(out, overwrite=False, **kw):
        out = Path(out)
        if out.name == "last":
            calls["n"] += 1
        if out.name != "last" or calls["n"] < crash_at:
            with real(out, overwrite=overwrite, **kw) as tmp:
                yield tmp
            return
        tmp = Path(tempfile.mkdtemp(prefix=".last.", suffix=".partial", dir=out.parent))
        yield tmp
        if phase == "between_renames":
            os.replace(out, out.with_name(f".last.old-{os.getpid()}"))
        os._exit(137)

    return dying


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["before_rename", "between_renames"])
def test_kill_inside_checkpoint_write_resumes_from_previous(
    phase, tiny, reference, tmp_path, capsys
):
    ref = reference("seqft")
    out = tmp_path / "run"
    argv = train_argv(tiny, out, "seqft")
    crash_at = STEPS - 1 + 2  # saves at steps 1..3 of each task: task 2's second save
    pid = os.fork()
    if pid == 0:  # the child: the real loop, with a write that dies half-way
        try:
            import cvl.train.rundir as rundir

            rundir.atomic_dir = _dying_atomic_dir(rundir.atomic_dir, crash_at, phase)
            cli(argv)
        finally:
            os._exit(1)  # reached only if the injected death did not happen
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 137
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".last.")]
    assert hidden  # the half-finished write is on disk, as after a real kill
    if phase == "before_rename":
        assert json.loads((out / "last" / "position.json").read_text())["step"] == 1
    else:
        assert not (out / "last").exists()
    capsys.readouterr()
    cli(argv)
    said = capsys.readouterr().out
    assert "resuming" in said and "task 1 (t1), step 1" in said  # the previous checkpoint
    assert assert_same_run(ref, out) == 3
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_sigkill_during_eval_reuses_cache_and_matches(reference, tmp_path):
    run = reference("seqft")
    common = ["eval", "--run", str(run), "--no-probe", "--no-plots", "--quiet"]
    cli([*common, "--out", str(tmp_path / "a")])
    b = tmp_path / "b"
    kill_when(
        [*common, "--out", str(b)],
        lambda: len(list((b / "cache").glob("*.json"))) >= 1,
        fork=True,
    )
    cached = sorted(p.stem for p in (b / "cache").glob("*.json"))
    assert 1 <= len(cached) < 4  # init + 3 tasks
    cli([*common, "--out", str(b)])
    ma = json.loads((tmp_path / "a" / "metrics.json").read_text())
    mb = json.loads((b / "metrics.json").read_text())
    assert sorted(mb["reused_from_cache"]) == cached
    skip = {"evaluated", "reused_from_cache", "created", "timing"}
    assert {k: v for k, v in ma.items() if k not in skip} == {
        k: v for k, v in mb.items() if k not in skip
    }


@pytest.mark.slow
def test_sigkill_during_pseudo_label_resumes_to_identical_labels(tiny, tmp_path):
    """`cvl pseudo-label` SIGKILLed after some units: the rerun labels only what is left and
    writes the same label files as an uninterrupted run."""
    import shutil

    from pseudolabel_helpers import save_tiny_beit

    model = save_tiny_beit(tmp_path / "tiny-beit")

    def argv(s: Path) -> list[str]:
        return ["pseudo-label", "--stream", str(s), "--model", str(model)] + [
            *("--batch-size", "4", "--unit-size", "8", "--quiet")
        ]

    def files(s: Path) -> dict[str, bytes]:
        root = s / "labels" / "tiny-beit"
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jsonl"))}

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny, a)
    shutil.copytree(tiny, b)
    cli(argv(a))
    parts = b / "labels" / "tiny-beit" / ".parts"
    kill_when(argv(b), lambda: len(list(parts.rglob("*.jsonl"))) >= 2)
    assert not (b / "labels" / "tiny-beit" / "labels.json").exists()
    cli(argv(b))
    assert files(b) == files(a) and len(files(a)) > 0
