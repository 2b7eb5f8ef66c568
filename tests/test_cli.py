"""The CLI: every command has --help; bad input gives one line and exit code 2."""

from __future__ import annotations

import pytest

from cvl.cli import cli, main


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("build-stream", "info"):
        assert cmd in out


@pytest.mark.parametrize("name", list(cli.commands))
def test_every_command_has_help(name, capsys):
    assert main([name, "--help"]) == 0
    assert "Usage:" in capsys.readouterr().out


def test_build_and_info(tmp_path, capsys):
    out = tmp_path / "s"
    rc = main(
        [
            "build-stream",
            "synthetic",
            "--out",
            str(out),
            "--tasks",
            "2",
            "--per-task",
            "10",
            "--quiet",
        ]
    )
    assert rc == 0
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "t0" in text and "train" in text and "gallery" in text


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["build-stream", "synthetic", "--out", "X", "--tasks", "0"], "must be an integer >= 1"),
        (["build-stream", "synthetic"], "Missing option '--out'"),
        (["info", "/no/such/path"], "no such file"),
        (["nonsense"], "No such command"),
    ],
)
def test_errors_are_one_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # usage errors too


def test_existing_output_refused(tmp_path, capsys):
    (tmp_path / "s").mkdir()
    assert main(["build-stream", "synthetic", "--out", str(tmp_path / "s"), "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err
