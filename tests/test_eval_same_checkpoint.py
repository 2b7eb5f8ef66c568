"""`cvl eval --compare`: a checkpoint whose bytes another run of the command already had is
scored once (`runner.evaluate_run(same=...)`), with the same numbers as a pass of its own."""

from __future__ import annotations

import json
import shutil

import torch
from test_eval_e2e import make_run

from cvl.cli import main
from cvl.evaluation import runner


def test_identical_checkpoints_are_evaluated_once(synth_stream, tmp_path, monkeypatch):
    a = make_run(tmp_path / "a", synth_stream)
    b = tmp_path / "b"
    shutil.copytree(a, b)  # same init and first task; its last task trains on
    from cvl.models import load_weights, model_from_config, save_weights

    last = b / "tasks" / "01-t1" / "model.safetensors"
    model = model_from_config(json.loads((b / "run.json").read_text())["model"])
    load_weights(model, last)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    save_weights(model, last)
    passes = []
    real = runner.evaluate_checkpoint
    monkeypatch.setattr(
        runner,
        "evaluate_checkpoint",
        lambda model, m, cols, n_seen, *r: (
            passes.append(n_seen) or real(model, m, cols, n_seen, *r)
        ),
    )
    cmd = ["eval", "--quiet", "--no-probe", "--compare", str(a), str(b), "--out", str(tmp_path)]
    assert main(cmd) == 0
    assert passes == [0, 1, 2, 2]  # a: init, t0, t1; b: only its own t1
    cache = {
        c: json.loads((b / "eval" / "cache" / f"{c}.json").read_text())["result"]
        for c in ("init", "00-t0", "01-t1")
    }
    assert cache["init"]["same_as"] == f"{a}:init" and cache["00-t0"]["same_as"] == f"{a}:00-t0"
    assert cache["01-t1"]["same_as"] == f"{b}:01-t1"
    # the shared numbers are the ones b's own pass gives
    shutil.rmtree(b / "eval")
    passes.clear()
    assert main(["eval", "--quiet", "--no-probe", "--run", str(b)]) == 0
    assert passes == [0, 1, 2]
    for c in ("init", "00-t0"):
        own = json.loads((b / "eval" / "cache" / f"{c}.json").read_text())["result"]
        assert own["per_task"] == cache[c]["per_task"]
        assert own["cumulative"] == cache[c]["cumulative"]
