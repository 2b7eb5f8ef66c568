"""Settings that would make training a no-op or wrong are refused before anything runs, in
one line, with nothing written: NaN / inf anywhere, negative rates and decay, a floor above
the peak rate, accumulation that leaves a task without an optimizer step, a switch that is
not a boolean, a batch BatchNorm cannot train on, a value the optimizer would reject. Every
numeric option of every command has a rule (`cvl.checks.Num`). Where a task still ends up
without a step (it is smaller than its config promised), task.json and the console say so."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from reliability_helpers import build_tiny_stream, train_argv

from cvl.checks import Num
from cvl.cli import cli, main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("settings") / "s")


def _commands(cmd: click.Command, path: tuple[str, ...] = ()):
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(click.Context(cmd)):
            yield from _commands(cmd.get_command(click.Context(cmd), name), (*path, name))
    else:
        yield path, cmd


def test_every_numeric_option_of_every_command_has_a_rule():
    """No number reaches cvl unchecked: an int / float option must be a `Num` (bounds, and
    NaN / inf refused: click's own float type accepts 'nan')."""
    unchecked, seen = [], 0
    for path, cmd in _commands(cli):
        for p in cmd.params:
            if isinstance(p, click.Option) and p.is_flag:
                continue
            seen += isinstance(p.type, Num)
            if isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType)):
                unchecked.append(f"cvl {' '.join(path)} --{p.name.replace('_', '-')}")
    assert seen > 100 and not unchecked, unchecked


def _yaml(tmp: Path, *lines: str) -> list[str]:
    f = tmp / "c.yaml"
    f.write_text("".join(x + "\n" for x in lines))
    return ["--config", str(f)]


REFUSED = [  # (extra cvl train arguments, what the line says)
    (["--lr", "nan"], "'--lr': must be a finite number > 0, got nan"),
    (["--lr", "inf"], "'--lr': must be a finite number > 0, got inf"),
    (["--min-lr", "-1e-5"], "'--min-lr': must be a finite number >= 0"),
    (["--min-lr", "1e-3"], "--min-lr 0.001 is above --lr 0.0005"),
    (["--weight-decay", "-0.1"], "'--weight-decay': must be a finite number >= 0"),
    (["--warmup", "nan"], "'--warmup': must be a finite number >= 0"),
    (["--grad-clip", "-1"], "'--grad-clip': must be a finite number >= 0"),
    (["--seed", "-1"], "'--seed': must be an integer >= 0"),
    (["--max-steps-per-task", "-1"], "'--max-steps-per-task': must be an integer >= 0"),
    (["--checkpoint-every", "-5"], "'--checkpoint-every': must be an integer >= 0"),
    (["--grad-accum", "8"], "no optimizer step would be taken: 32 training pairs make 4 global"),
    (["--budget", "tflops=inf"], "--budget 'tflops=inf': expected"),
    (["--budget", "samples=12"], "task t0's share, 4 samples, is less than one optimizer step"),
    (["--method", "dkr", "--method-arg", "rnk_star=maybe"], "rnk_star must be true or false"),
    (["--method", "ewc", "--method-arg", "lam=.nan"], "lam must be a finite number, got nan"),
    (["--method", "ewc", "--method-arg", "fisher_batches=2.5"], "must be an integer, got 2.5"),
    (["--method", "ctp", "--method-arg", "momentum=1.5"], "momentum must be a finite number in"),
    (["--tune", "lora", "--tune-arg", "alpha=nan"], "--tune-arg alpha must be a finite number > 0"),
    (["--tune", "lora", "--tune-arg", "rank=2.5"], "--tune-arg rank must be an integer >= 1"),
    # a --config YAML (explicit options win over it, so these keys are not on the command line)
    (["yaml:beta1: 1.5"], "beta1 (--config) must be a finite number in [0, 1), got 1.5"),
    (["yaml:eps: .nan"], "eps (--config) must be a finite number > 0, got nan"),
    (["yaml:log_every: 2.5"], "--log-every must be an integer >= 1, got 2.5"),
    (["yaml:compile: 'no way'"], "--compile must be true or false, got 'no way'"),
    (["--method", "joint", "yaml:method_args: {cumulative: maybe}"], "cumulative must be true"),
]


@pytest.mark.parametrize("extra, says", REFUSED, ids=[" ".join(x[0])[-40:] for x in REFUSED])
def test_settings_that_train_nothing_or_wrongly_are_refused_before_anything_is_written(
    tiny, tmp_path, capsys, extra, says
):
    out = tmp_path / "runs" / "r"
    yaml = [x[5:] for x in extra if x.startswith("yaml:")]
    extra = [x for x in extra if not x.startswith("yaml:")] + (
        _yaml(tmp_path, *yaml) if yaml else []
    )
    assert main([*train_argv(tiny, out, "seqft"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert says in err, err
    assert not (tmp_path / "runs").exists()  # no run folder, no lock file beside it


def test_an_empty_budget_is_no_budget(tiny, tmp_path, capsys):
    out = tmp_path / "r"
    argv = train_argv(tiny, out, "seqft")
    assert main([*argv, "--budget", ""]) == 0
    assert json.loads((out / "run.json").read_text())["config"]["budget"] is None
    assert "budget" not in json.loads((out / "tasks" / "00-t0" / "task.json").read_text())
    assert main(argv) == 0  # the same run: not "another config (budget: '' -> None)"


def test_a_batch_batchnorm_cannot_train_on_is_one_line_before_anything_is_written(
    tiny, tmp_path, capsys
):
    """The tiny RN CLIP's last BatchNorm sees a 1×1 map: one pair per process cannot train."""
    out = tmp_path / "runs" / "r"
    argv = train_argv(tiny, out, "seqft")
    argv[argv.index("--batch-size") + 1] = "1"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "task t0: a batch of 1 pair(s) per process is too small for the model's BatchNorm" in err
    assert not (tmp_path / "runs").exists()


def test_a_task_left_without_an_optimizer_step_says_so_instead_of_saved(tmp_path, capsys):
    """Task t0 has 32 pairs (2 steps of 2 accumulated batches of 8), t1 and t2 only 4: with
    the 8 replayed pairs, 12 pairs are one batch, fewer than --grad-accum 2. The loop learns it
    only then (a buffer's size is not known in advance): the task keeps its start weights and
    its task.json and the console say why, rather than 'saved' as if it trained."""
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    stream = tmp_path / "s"
    spec = SynthSpec(tasks=3, per_task=4, first_task=32, test_per_task=4, val_per_task=0)
    build_synthetic(stream, spec, progress=False)
    out = tmp_path / "r"
    argv = train_argv(stream, out, "seqft")
    argv += ["--grad-accum", "2", "--buffer", "reservoir", "--buffer-size", "8"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    t0, t1 = (json.loads((out / "tasks" / t / "task.json").read_text()) for t in ("00-t0", "01-t1"))
    assert t0["steps"] == 2 and "no_optimizer_step" not in t0
    assert t1["steps"] == 0
    assert t1["no_optimizer_step"] == (
        "12 training pairs make 1 global batch(es) of 8 per epoch (--batch-size 8 × 1 "
        "process(es)), fewer than the --grad-accum 2 of one optimizer step"
    )
    assert "task 1/3 t0: saved" in said and "task 2/3 t1: saved" not in said
    assert "task 2/3 t1: no optimizer step (12 training pairs make 1 global batch" in said
    assert "keeps its start weights" in said


def test_a_value_the_optimizer_rejects_is_one_line():
    """The rules refuse what AdamW / LAMB would; should a value get past them (an API caller,
    a new optimizer check), the optimizer's ValueError is still one line, not a traceback."""
    import torch

    from cvl.errors import CvlError
    from cvl.train.config import TrainConfig
    from cvl.train.optim import optimizer_with_schedule

    cfg = TrainConfig(stream="s", out="o")
    cfg.beta1 = 1.5  # set after validation, as a caller could
    with pytest.raises(CvlError, match=r"the optimizer refuses the settings \(Invalid beta"):
        optimizer_with_schedule([torch.nn.Parameter(torch.zeros(2, 2))], cfg, 4)
