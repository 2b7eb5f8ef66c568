"""Output folders are safe: `--overwrite` replaces only what cvl wrote (never inputs, runs or
foreign folders), one process at a time writes a run or a stream (a lock naming its holder,
taken over from a dead one), leftovers of killed writers are cleaned and never counted, and
the small faults a user meets give one clear line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from archive_helpers import write_karpathy
from reliability_helpers import build_tiny_stream, env, train_argv

from cvl.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("outputs") / "s")


def _argv(stream: Path, out: Path, steps: int = 1) -> list[str]:
    argv = train_argv(stream, out, "seqft")
    argv[argv.index("--max-steps-per-task") + 1] = str(steps)
    return argv


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """A finished 3-task run (one step per task)."""
    out = tmp_path_factory.mktemp("outputs-run") / "r"
    assert main(_argv(tiny, out)) == 0
    return out


def _synthetic(out: Path, *extra: str) -> list[str]:
    return [
        *("build-stream", "synthetic", "--out", str(out), "--tasks", "2", "--per-task", "4"),
        *("--test-per-task", "2", "--val-per-task", "0", "--query-per-task", "0"),
        *("--gallery-per-task", "0", "--quiet", *extra),
    ]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def _tree(p: Path) -> dict[str, bytes]:
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


# -- --overwrite --------------------------------------------------------------------------------
def test_overwrite_never_deletes_the_inputs_or_a_foreign_folder(tmp_path, capsys):
    data = tmp_path / "D"
    js = write_karpathy(data, "coco", {"train": 4, "test": 2}, filepath=True)
    before = _tree(data)
    build = ["build-stream", "coco", "--json", str(js), "--images", str(data), "--quiet"]
    assert main([*build, "--out", str(data), "--overwrite"]) == 2
    err = _one_line(capsys)
    assert "holds an input of this command" in err
    assert _tree(data) == before  # the JSON and every image are still there
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "todo.txt").write_text("keep me")
    assert main([*build, "--out", str(mine), "--overwrite"]) == 2
    assert "a folder cvl did not write" in _one_line(capsys)
    assert (mine / "notes" / "todo.txt").read_text() == "keep me"
    s = tmp_path / "s"  # a stream cvl wrote is replaced
    assert main([*build, "--out", str(s)]) == 0
    assert main([*build, "--out", str(s), "--max-train", "2", "--overwrite"]) == 0
    assert json.loads((s / "stream.json").read_text())["tasks"]["coco"]["train"]["count"] == 2
    assert json.loads((s / ".cvl-output.json").read_text())["kind"] == "stream"


def test_overwrite_never_replaces_a_run_or_its_tasks(run, tmp_path, capsys):
    before = _tree(run)
    for out, said in [(run, "holds an input"), (run / "tasks", "a part of the cvl run folder")]:
        capsys.readouterr()
        assert main(["export", "--run", str(run), "--out", str(out), "--overwrite"]) == 2
        assert said in _one_line(capsys)
        assert _tree(run) == before
    other = tmp_path / "other-run"  # another run is not an export either
    other.mkdir()
    (other / "run.json").write_text((run / "run.json").read_text())
    assert main(["export", "--run", str(run), "--out", str(other), "--overwrite"]) == 2
    assert "is a cvl run folder, not a cvl export folder" in _one_line(capsys)
    e = tmp_path / "e"
    assert main(["export", "--run", str(run), "--out", str(e)]) == 0
    assert main(["export", "--run", str(run), "--out", str(e), "--task", "0", "--overwrite"]) == 0
    assert json.loads((e / "open_clip_config.json").read_text())["cvl"]["task"]["index"] == 0


def test_compose_refuses_to_overwrite_one_of_its_sources(tiny, tmp_path, capsys):
    s = tmp_path / "s"
    assert main(_synthetic(s)) == 0
    before = _tree(s)
    capsys.readouterr()
    spec = f"a={s}:task=t0"
    rc = main(["build-stream", "compose", "--task", spec, "--out", str(s), "--overwrite"])
    assert rc == 2 and "holds an input of this command" in _one_line(capsys)
    assert _tree(s) == before


# -- locks --------------------------------------------------------------------------------------
def _hold_lock(folder: Path, shown: list[str]) -> int:
    """A forked process that takes `folder`'s lock as `shown` would, then waits to be killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            from cvl.lock import FolderLock, set_command

            set_command(shown)
            lock = FolderLock(folder).acquire()
            os.write(w, b"1")
            assert lock.held
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    return pid


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_second_train_on_a_run_folder_is_refused_naming_the_holder(tiny, tmp_path, capsys):
    out = tmp_path / "r"
    pid = _hold_lock(out, ["cvl", "train", "--out", "runs/a"])
    try:
        assert main(_argv(tiny, out)) == 2
        err = _one_line(capsys)
        assert f"is in use by pid {pid} on {socket.gethostname()}" in err
        assert "`cvl train --out runs/a`, since 20" in err
        assert not (out / "run.json").exists()  # refused before any work
    finally:
        _kill(pid)  # dies holding it: the file and its record stay, the kernel's lock goes
    assert (tmp_path / ".r.lock").is_file()
    assert main(_argv(tiny, out)) == 0
    err = capsys.readouterr().err
    assert f"taking over the lock of pid {pid}" in err and "ended without releasing it" in err
    assert not (tmp_path / ".r.lock").exists()  # released (and removed) at the end


def test_a_killed_holders_surviving_fork_does_not_keep_the_lock(tmp_path):
    """A worker forked by the holder (a DataLoader worker) closes its copy of the lock, so a
    SIGKILLed command's folder is free at once even while such a worker lives on."""
    from cvl.errors import CvlError
    from cvl.lock import FolderLock

    folder = tmp_path / "r"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder
        try:
            lock = FolderLock(folder).acquire()
            worker = os.fork()
            if worker == 0:
                time.sleep(600)
                os._exit(0)
            os.write(w, str(worker).encode() + b"\n")
            time.sleep(600)
            assert lock.held
        finally:
            os._exit(0)
    os.close(w)
    worker = int(os.read(r, 64).decode())
    os.close(r)
    try:
        with pytest.raises(CvlError, match=f"in use by pid {pid}"):
            FolderLock(folder).acquire()
        _kill(pid)
        with FolderLock(folder) as lock:  # the worker is still alive
            os.kill(worker, 0)
            assert lock.held
            with FolderLock(folder):  # re-entrant within a process
                pass
            assert lock.path.is_file()
        assert not lock.path.exists()
    finally:
        os.kill(worker, signal.SIGKILL)  # a grandchild: init reaps it


def test_eval_and_stream_builds_are_locked_too(run, tmp_path, capsys):
    s = tmp_path / "s"
    pid = _hold_lock(s, ["cvl", "build-stream", "synthetic", "--out", "s"])
    try:
        assert main(_synthetic(s)) == 2
        assert f"is in use by pid {pid}" in _one_line(capsys)
        assert not s.exists()
    finally:
        _kill(pid)
    assert main(_synthetic(s)) == 0
    assert "taking over the lock" in capsys.readouterr().err
    pid = _hold_lock(run / "eval", ["cvl", "eval", "--run", str(run)])
    try:
        assert main(["eval", "--run", str(run), "--no-probe", "--no-plots", "--quiet"]) == 2
        assert f"{run / 'eval'} is in use by pid {pid}" in _one_line(capsys)
    finally:
        _kill(pid)
    (run / ".eval.lock").unlink()


@pytest.mark.slow
def test_a_refused_multi_process_run_stops_every_rank(tiny, tmp_path):
    """torchrun, 2 processes (gloo on CPU): rank 0 is refused, rank 1 learns it (no hang)."""
    out = tmp_path / "r"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pid = _hold_lock(out, ["cvl", "train", "--out", "elsewhere"])
    try:
        p = subprocess.run(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"),
                *("--master_port", str(port), "-m", "cvl", *_argv(tiny, out), "--workers", "0"),
            ],
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        _kill(pid)
    assert p.returncode != 0
    assert p.stderr.count(f"is in use by pid {pid}") == 2, p.stderr[-3000:]  # both ranks
    assert not (out / "run.json").exists()


# -- leftovers ----------------------------------------------------------------------------------
def test_leftovers_of_killed_writers_are_cleaned_and_never_counted(run, tmp_path, capsys):
    import shutil

    r = tmp_path / "r"
    shutil.copytree(run, r)
    part = Path(tempfile.mkdtemp(prefix=".02-t2.", suffix=".partial", dir=r / "tasks"))
    shutil.copy(r / "tasks/02-t2/model.safetensors", part)  # killed mid-task-checkpoint write
    (r / ".last.old-999").mkdir()  # killed between the swap and the removal of the old copy
    capsys.readouterr()
    assert main(["info", str(r)]) == 0
    assert "finished tasks: 3/3 " in capsys.readouterr().out
    assert main(_argv(Path(json.loads((r / "run.json").read_text())["stream"]["path"]), r)) == 0
    assert not [p for p in (r / "tasks").iterdir() if p.name.startswith(".")]
    assert not [p for p in r.iterdir() if p.name.startswith(".")]
    s = tmp_path / "s"
    assert main(_synthetic(s)) == 0
    Path(tempfile.mkdtemp(prefix=".s.", suffix=".partial", dir=tmp_path))
    (tmp_path / ".s.old-999").mkdir()
    assert main(_synthetic(s, "--overwrite")) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".s")) == []


# -- one-line errors and small faults ---------------------------------------------------------
def test_out_under_a_regular_file_is_one_line(tiny, tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    capsys.readouterr()
    assert main(_argv(tiny, f / "run")) == 2
    assert "file.txt is a file, not a folder" in _one_line(capsys)
    assert main(_synthetic(f / "s")) == 2
    assert "file.txt is a file, not a folder" in _one_line(capsys)
    assert f.read_text() == "x"


def test_info_on_a_run_stopped_mid_task_says_the_step(run, tmp_path, capsys):
    import shutil

    r = tmp_path / "r"
    shutil.copytree(run, r)
    shutil.rmtree(r / "tasks" / "02-t2")
    (r / "last").mkdir()
    (r / "last" / "position.json").write_text(
        json.dumps({"task_index": 2, "task": "t2", "step": 3, "epoch": 0, "batch": 3})
    )
    capsys.readouterr()
    assert main(["info", str(r)]) == 0
    said = capsys.readouterr().out
    assert "finished tasks: 2/3" in said and "task 2 (t2) stopped at step 3" in said


def test_analyze_compare_names_a_swallowed_option_and_warns_on_the_same_run(run, capsys):
    capsys.readouterr()
    assert main(["analyze", "rotation", "--compare", str(run), "--quiet"]) == 2
    err = _one_line(capsys)
    assert "--compare takes two run folders" in err and "'--quiet'" in err
    assert "not a run folder" not in err
    argv = ["analyze", "rotation", "--compare", str(run), str(run), "--no-plots", "--quiet"]
    assert main([*argv, "--max-samples", "8", "--modality", "vision"]) == 0
    assert "the same run twice" in capsys.readouterr().err


def test_quiet_builds_print_no_summary(tmp_path, capsys):
    capsys.readouterr()
    assert main(_synthetic(tmp_path / "s")) == 0
    data = tmp_path / "D"
    js = write_karpathy(data, "coco", {"train": 3, "test": 1}, filepath=True)
    coco = ["build-stream", "coco", "--json", str(js), "--images", str(data), "--quiet"]
    assert main([*coco, "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


# -- what a user sees is consistent and never stale ---------------------------------------------
def test_compare_never_reuses_metrics_computed_with_other_settings(tiny, tmp_path, capsys):
    """RUN/eval/metrics.json of an evaluation without the linear probe is not reused by a
    comparison that asks for it (its LP column would be '–' without a word): the run is
    evaluated again with the comparison's settings, and a file with the same ones is reused."""
    r = tmp_path / "r"
    assert main(_argv(tiny, r)) == 0
    fast = ["--no-zeroshot", "--no-cumulative", "--no-plots", "--quiet", "--device", "cpu"]
    assert main(["eval", "--run", str(r), "--no-probe", *fast]) == 0
    assert json.loads((r / "eval" / "metrics.json").read_text())["settings"]["probe"] is False
    capsys.readouterr()
    assert main(["eval", "--compare", str(r), *fast, "--out", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "was computed with other settings (probe: False -> True)" in err
    (rec,) = json.loads((tmp_path / "c" / "compare.json").read_text())["runs"]
    assert rec["LP-top1"] is not None
    assert json.loads((r / "eval" / "metrics.json").read_text())["settings"]["probe"] is True
    mtime = (r / "eval" / "metrics.json").stat().st_mtime_ns
    assert main(["eval", "--compare", str(r), *fast, "--out", str(tmp_path / "c")]) == 0
    assert "other settings" not in capsys.readouterr().err
    assert (r / "eval" / "metrics.json").stat().st_mtime_ns == mtime  # same settings: reused


def test_a_run_has_one_colour_in_every_plot_of_a_comparison(tmp_path, monkeypatch):
    """Run `a` has no recorded cost, so the compute plot leaves it out: `b` and `c` keep the
    colours they have in the Rm and TR@1 curves (matplotlib's cycle would shift them)."""
    from matplotlib.axes import Axes
    from matplotlib.colors import to_hex

    import cvl.evaluation.comparison as comparison

    def metrics(name: str, v: float) -> dict:
        mat = [[v, None], [v - 5, v + 5]]
        return {
            **{"run": str(tmp_path / name), "run_name": name, "method_label": "seqft"},
            **{"tasks": ["t0", "t1"], "rows": ["00-t0", "01-t1"], "final": {}},
            **{"matrices": {"Rm": mat, "TR@1": mat}, "benchmarks": {}},
            "continual": {"Rm": {"average_final": v}},
        }

    ms = [metrics("a", 40.0), metrics("b", 50.0), metrics("c", 60.0)]
    cost = {"total_flops": 2e12, "peak_memory_bytes": 1e9, "device_hours": 0.1}
    monkeypatch.setattr(comparison, "run_cost", lambda m: None if m["run_name"] == "a" else cost)
    seen: dict[str, set[str]] = {}
    plot, scatter, annotate = Axes.plot, Axes.scatter, Axes.annotate

    def rec_plot(self, *a, **k):
        lines = plot(self, *a, **k)
        seen.setdefault(k.get("label"), set()).add(to_hex(lines[0].get_color()))
        return lines

    def rec_scatter(self, *a, **k):
        pts = scatter(self, *a, **k)
        self._cvl_last = to_hex(pts.get_facecolor()[0])
        return pts

    def rec_annotate(self, text, *a, **k):
        seen.setdefault(text, set()).add(self._cvl_last)
        return annotate(self, text, *a, **k)

    monkeypatch.setattr(Axes, "plot", rec_plot)
    monkeypatch.setattr(Axes, "scatter", rec_scatter)
    monkeypatch.setattr(Axes, "annotate", rec_annotate)
    files = comparison.write_compare(ms, tmp_path / "cmp")
    assert {p.name for p in files} >= {"compare_Rm.png", "compare_TR1.png"}
    assert (tmp_path / "cmp" / "compare_Rm_vs_compute.png").is_file()
    assert {k: len(v) for k, v in seen.items()} == {"a": 1, "b": 1, "c": 1}
    assert len({next(iter(v)) for v in seen.values()}) == 3


def test_progress_bars_stay_off_when_the_output_is_not_a_terminal(tiny, tmp_path, capsys):
    """Under make, CI or `| tee` a redrawn bar becomes one line per update: without a
    terminal (capsys is none) no bar is redrawn, by any command, even without --quiet (work
    this short prints no progress line either: test_reliability_runs.py)."""
    argv = [a for a in _argv(tiny, tmp_path / "r") if a != "--quiet"]
    capsys.readouterr()
    assert main(argv) == 0
    build = _synthetic(tmp_path / "s")
    assert main([a for a in build if a != "--quiet"]) == 0
    fast = ["--no-zeroshot", "--no-probe", "--no-plots", "--device", "cpu"]
    assert main(["eval", "--run", str(tmp_path / "r"), *fast]) == 0
    cap = capsys.readouterr()
    for text in (cap.out, cap.err):
        assert "\r" not in text and "it/s" not in text and "step/s" not in text, text[-500:]


def test_the_readme_names_make_venv():
    root = Path(__file__).resolve().parent.parent
    assert "\nvenv:" in (root / "Makefile").read_text()
    assert "make venv" in (root / "README.md").read_text()


# -- issue 47: outputs others can read, inputs one cannot read ------------------------------------
def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}


def test_streams_and_runs_honour_the_umask_so_others_can_read_them(tmp_path, run):
    """mkstemp / mkdtemp make 0600 files and 0700 folders, safetensors 0600 files; every
    atomic write (a stream folder, a run's folders, JSON, weights) gets the mode a plain open
    / mkdir gives: 0644 / 0755 under umask 022, 0640 / 0750 under 027; the module's run under
    the tests' own umask."""
    from cvl.io import write_json
    from cvl.writes import umask

    old = os.umask(0o022)
    try:
        assert main(_synthetic(tmp_path / "s")) in (0, None)
        os.umask(0o027)
        write_json(tmp_path / "x" / "a.json", {})
    finally:
        os.umask(old)
    for root, mask in ((tmp_path / "s", 0o022), (run, umask())):
        modes = {
            rel: m
            for rel, m in _modes(root).items()
            if not rel.startswith(".") and "/." not in rel  # lock and temp files of tests
        }
        want = {rel: (0o777 if (root / rel).is_dir() else 0o666) & ~mask for rel in modes}
        assert modes == want, {rel: oct(m) for rel, m in modes.items() if m != want[rel]}
    assert any(rel.endswith("model.safetensors") for rel in _modes(run))
    assert (tmp_path / "x" / "a.json").stat().st_mode & 0o777 == 0o640


def test_an_input_cvl_may_not_read_is_one_line(tiny, monkeypatch, capsys):
    """A stream another user wrote 0600 (tests run as root, whom modes do not stop: the open
    is refused as the kernel would) is one line naming the file, not a PermissionError
    traceback."""
    import builtins
    import io

    target = str(tiny / "stream.json")
    real = io.open

    def refuse(file, *a, **k):
        if os.fspath(file) == target if isinstance(file, (str, os.PathLike)) else False:
            raise PermissionError(13, "Permission denied", target)
        return real(file, *a, **k)

    monkeypatch.setattr(io, "open", refuse)
    monkeypatch.setattr(builtins, "open", refuse)
    assert main(["info", str(tiny)]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"error: {target}: permission denied") and "chmod" in err
    from cvl.writes import permission_message

    worker = PermissionError(
        "Caught PermissionError in DataLoader worker process 0.\n  ...\n"
        "PermissionError: [Errno 13] Permission denied: '/s/000000.tar'"
    )
    assert permission_message(worker).startswith(
        "PermissionError: [Errno 13] Permission denied: '/s/000000.tar'; "
    )
