"""Per-task model selection on validation pairs (`--select`, DHA's best-on-validation protocol)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from device_helpers import DEVICES
from safetensors.torch import load_file

from cvl.errors import CvlError
from cvl.runs import finished_tasks
from cvl.streams.manifest import load_manifest
from cvl.train import loop as loop_mod
from cvl.train.config import resolve
from cvl.train.loop import Trainer
from cvl.train.selection import BestKeeper, selection_set

FAST = dict(
    batch_size=16,
    log_with="none",
    checkpoint_every=0,
    model_config="tiny",
    epochs=3,
    log_every=1,
    workers=0,
    deterministic=True,
)


def _train(stream, out, **kw):
    cfg = resolve(None, {"stream": str(stream), "out": str(out), **{**FAST, **kw}})
    Trainer(cfg, progress=False).run()


def test_selection_set_rules(synth_stream):
    m = load_manifest(synth_stream)
    plain, dha = SimpleNamespace(), SimpleNamespace(selects_best_val=True)
    assert selection_set(m, "t0", "auto", plain) is None
    assert selection_set(m, "t0", "auto", dha) == "val"
    assert selection_set(m, "t0", "last", dha) is None
    assert selection_set(m, "t0", "best-val", plain) == "val"
    del m.eval_sets["val"]
    assert selection_set(m, "t0", "auto", dha) is None  # falls back to the last weights
    with pytest.raises(CvlError, match="no 'val' pairs"):
        selection_set(m, "t0", "best-val", plain)
    with pytest.raises(CvlError, match="--select"):
        selection_set(m, "t0", "best", plain)


def test_keeper_keeps_the_best_and_the_earlier_of_a_tie():
    lin = torch.nn.Linear(2, 1)
    k = BestKeeper()
    for epoch, score in enumerate([3.0, 5.0, 5.0, 4.0]):
        with torch.no_grad():
            lin.weight.fill_(float(epoch))
        k.offer(lin, score, epoch, step=10 * (epoch + 1))
    assert (k.score, k.epoch, k.step, k.validated) == (5.0, 1, 20, 3)
    assert torch.equal(k.weights["weight"], torch.ones(1, 2))  # a copy, not the live tensor
    assert [h["val_Rm"] for h in k.history] == [3.0, 5.0, 5.0, 4.0]


def _scripted_scores(monkeypatch, scores):
    """val_score returns the scripted values in order and snapshots the scored weights."""
    seen = []

    def fake(model, manifest, set_name, task, acc):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return scores[(len(seen) - 1) % len(scores)]

    monkeypatch.setattr(loop_mod, "val_score", fake)
    return seen


def test_task_ends_with_the_best_epoch_and_says_so(synth_stream, tmp_path, monkeypatch):
    seen = _scripted_scores(monkeypatch, [7.0, 9.0, 8.0])  # epoch 2 of 3 is the best
    from cvl.methods.seqft import SeqFT

    starts = []
    monkeypatch.setattr(
        SeqFT,
        "before_task",
        lambda self, ctx: starts.append({k: v.clone() for k, v in ctx.model.state_dict().items()}),
    )
    _train(synth_stream, tmp_path / "r", select="best-val")
    assert len(seen) == 9  # 3 tasks × 3 epoch ends
    done = finished_tasks(tmp_path / "r")
    for i, c in enumerate(done):
        saved = load_file(str(c.model_path))
        best = seen[3 * i + 1]
        assert all(torch.equal(saved[k], best[k]) for k in saved)
        assert not all(torch.equal(saved[k], seen[3 * i + 2][k]) for k in saved)
        sel = json.loads((c.path / "task.json").read_text())["selection"]
        assert (sel["epoch"], sel["score"]) == (1, 9.0) and len(sel["history"]) == 3
    # the next task starts from the selected weights
    for i in (1, 2):
        assert all(torch.equal(starts[i][k], seen[3 * (i - 1) + 1][k]) for k in starts[i])


def test_auto_selects_for_dha_only(synth_stream, tmp_path, monkeypatch):
    seen = _scripted_scores(monkeypatch, [1.0])
    _train(synth_stream, tmp_path / "s", epochs=1)
    assert seen == []
    task = json.loads((finished_tasks(tmp_path / "s")[0].path / "task.json").read_text())
    assert task["selection"] == {"by": "last"}
    _train(synth_stream, tmp_path / "d", epochs=1, method="dha")
    assert len(seen) == 3


def test_real_val_score_is_rm_on_val_pairs(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "v", epochs=2, select="best-val", max_steps_per_task=4)
    for c in finished_tasks(tmp_path / "v"):
        sel = json.loads((c.path / "task.json").read_text())["selection"]
        assert [h["epoch"] for h in sel["history"]] == [0, 1] or len(sel["history"]) == 1
        assert all(0.0 <= h["val_Rm"] <= 100.0 for h in sel["history"])
        assert sel["score"] == max(h["val_Rm"] for h in sel["history"])


@pytest.mark.parametrize("device", DEVICES)
def test_resume_keeps_the_selection_exact(synth_stream, tmp_path, monkeypatch, device):
    """Stopped in epoch 2 of task 1 (epoch 1 scored, best so far in last/): same result."""
    kw = dict(select="best-val", checkpoint_every=2, device=device)
    _scripted_scores(monkeypatch, [9.0, 7.0, 8.0])  # epoch 1 best: must survive the resume
    _train(synth_stream, tmp_path / "a", **kw)
    from cvl.methods.seqft import SeqFT

    def boom(self, ctx):
        if ctx.task_index == 1 and ctx.step == 9:  # 6 steps per epoch: inside epoch 2
            raise KeyboardInterrupt

    monkeypatch.setattr(SeqFT, "after_step", boom)
    with pytest.raises(KeyboardInterrupt):
        _train(synth_stream, tmp_path / "b", **kw)
    pos = json.loads((tmp_path / "b" / "last" / "position.json").read_text())
    assert pos["step"] == 8 and pos["best"]["epoch"] == 0
    assert (tmp_path / "b" / "last" / "best_model.safetensors").is_file()
    monkeypatch.setattr(SeqFT, "after_step", lambda self, ctx: None)
    # resumed: task 1 epochs 2-3 (7, 8: epoch 1's 9 stays best), task 2 as in run a (9, 7, 8)
    seen = _scripted_scores(monkeypatch, [7.0, 8.0, 9.0, 7.0, 8.0])
    _train(synth_stream, tmp_path / "b", **kw)
    assert len(seen) == 5  # task 1: epochs 2 and 3; task 2: 3 epochs
    for ca, cb in zip(finished_tasks(tmp_path / "a"), finished_tasks(tmp_path / "b")):
        a, b = load_file(str(ca.model_path)), load_file(str(cb.model_path))
        assert all(torch.equal(a[k], b[k]) for k in a)
    sa = json.loads((finished_tasks(tmp_path / "a")[1].path / "task.json").read_text())
    sb = json.loads((finished_tasks(tmp_path / "b")[1].path / "task.json").read_text())
    assert sa["selection"] == sb["selection"]


@pytest.mark.parametrize("device", DEVICES)
def test_resume_right_after_an_epoch_end_scores_that_epoch(
    synth_stream, tmp_path, monkeypatch, device
):
    """A checkpoint written at the last step of an epoch precedes that epoch's validation."""
    kw = dict(select="best-val", checkpoint_every=6, device=device)  # 6 steps per epoch
    from cvl.methods.seqft import SeqFT

    def boom(self, ctx):
        if ctx.task_index == 0 and ctx.step == 7:
            raise KeyboardInterrupt

    seen = _scripted_scores(monkeypatch, [5.0])
    monkeypatch.setattr(SeqFT, "after_step", boom)
    with pytest.raises(KeyboardInterrupt):
        _train(synth_stream, tmp_path / "c", **kw)
    assert len(seen) == 1  # epoch 1 was scored, but after its checkpoint at step 6
    pos = json.loads((tmp_path / "c" / "last" / "position.json").read_text())
    assert (pos["step"], pos["epoch"], pos["batch"], pos["best"]["validated"]) == (6, 1, 0, -1)
    monkeypatch.setattr(SeqFT, "after_step", lambda self, ctx: None)
    seen.clear()
    _train(synth_stream, tmp_path / "c", **kw)
    sel = json.loads((finished_tasks(tmp_path / "c")[0].path / "task.json").read_text())
    assert [h["epoch"] for h in sel["selection"]["history"]] == [0, 1, 2]
