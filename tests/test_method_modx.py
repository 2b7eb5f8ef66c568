"""Mod-X (Ni et al. 2023 §4.3): hand-computed spatial-alignment KL, training, resume, 2 procs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from train_helpers import (
    assert_same_task_weights,
    interrupt_then_resume,
    metric,
    task_log,
    train_run,
)

from cvl.methods.base import TaskContext
from cvl.methods.modx import ModX, modx_kl
from cvl.runs import finished_tasks

# Cosine matrices (rows = images, columns = texts; pair i is column i).
# Old row 1 mis-retrieves (argmax 0 ≠ 1): Eq. 3 replaces it with the new row → its KL is 0.
OLD = [[0.9, 0.1, 0.0], [0.8, 0.2, 0.0], [0.0, 0.3, 0.6]]
NEW = [[0.5, 0.4, 0.1], [0.3, 0.6, 0.1], [0.2, 0.2, 0.7]]
Y = torch.tensor([0, 1, 2])

# Eq. 4 with P = softmax(M / τ) per row, rows summed, rows 0 and 2 only:
#   τ = 1:   KL_0 = 0.0485312, KL_2 = 0.0067279              → 0.0552591
#   τ = 0.5: KL_0 = 0.1785188, KL_2 = 0.0223561              → 0.2008748
#   flipped KL(new ‖ old), τ = 1                              → 0.0551763
#   row 1 if it were kept: KL(softmax(old_1) ‖ softmax(new_1)) = 0.0789503
KL_TAU1 = 0.0552591
KL_TAU05 = 0.2008748
KL_FLIPPED = 0.0551763
KL_ROW1 = 0.0789503


def _softmax(row, tau=1.0):
    e = [math.exp(x / tau) for x in row]
    return [x / sum(e) for x in e]


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_hand_values_follow_the_equations():
    """The literals above, recomputed from Eq. 3-4 in plain Python (guards against typos)."""
    rows = (0, 2)
    assert sum(_kl(_softmax(OLD[i]), _softmax(NEW[i])) for i in rows) == pytest.approx(
        KL_TAU1, abs=1e-7
    )
    assert sum(_kl(_softmax(OLD[i], 0.5), _softmax(NEW[i], 0.5)) for i in rows) == pytest.approx(
        KL_TAU05, abs=1e-7
    )
    assert sum(_kl(_softmax(NEW[i]), _softmax(OLD[i])) for i in rows) == pytest.approx(
        KL_FLIPPED, abs=1e-7
    )
    assert _kl(_softmax(OLD[1]), _softmax(NEW[1])) == pytest.approx(KL_ROW1, abs=1e-7)


def test_modx_replaces_exactly_the_misretrieved_row():
    old = torch.tensor(OLD)
    new = torch.tensor(NEW, requires_grad=True)
    kl, ok = modx_kl(new, old, Y, tau=1.0, reduction="sum")
    assert ok.tolist() == [True, False, True]
    assert float(kl.detach()) == pytest.approx(KL_TAU1, abs=1e-6)
    kl.backward()
    # the replaced row contributes neither value nor gradient
    assert torch.count_nonzero(new.grad[1]) == 0
    assert torch.count_nonzero(new.grad[0]) > 0 and torch.count_nonzero(new.grad[2]) > 0
    # any other mis-retrieving old row 1 gives the same loss ...
    other = old.clone()
    other[1] = torch.tensor([0.1, 0.0, 0.5])
    assert float(modx_kl(new.detach(), other, Y)[0]) == pytest.approx(KL_TAU1, abs=1e-6)
    # ... while a correct old row 1 is distilled
    right = old.clone()
    right[1] = torch.tensor([0.2, 0.8, 0.0])
    kl_r, ok_r = modx_kl(new.detach(), right, Y)
    assert ok_r.tolist() == [True, True, True]
    exp = KL_TAU1 + _kl(_softmax([0.2, 0.8, 0.0]), _softmax(NEW[1]))
    assert float(kl_r) == pytest.approx(exp, abs=1e-6)


def test_modx_direction_temperature_and_reduction_matter():
    old, new = torch.tensor(OLD), torch.tensor(NEW)
    kl = float(modx_kl(new, old, Y, tau=1.0)[0])
    assert float(modx_kl(new, old, Y, tau=0.5)[0]) == pytest.approx(KL_TAU05, abs=1e-6)
    assert abs(KL_TAU05 - kl) > 0.1
    assert float(modx_kl(old, old, Y)[0]) == 0.0  # old == new: nothing to distil
    assert float(modx_kl(new, old, Y, reduction="mean")[0]) == pytest.approx(kl / 3, abs=1e-7)


def test_flipped_kl_literal():
    """KL(softmax(new) ‖ softmax(old)) on the distilled rows: the hand value differs from Eq. 4."""
    old, new = torch.tensor(OLD), torch.tensor(NEW)
    from cvl.losses import kl_rows

    rows = torch.tensor([0, 2])
    flipped = kl_rows(new[rows], old[rows], reduction="none").sum()
    assert float(flipped) == pytest.approx(KL_FLIPPED, abs=1e-6)
    assert abs(KL_FLIPPED - KL_TAU1) > 5e-5


class _Enc(torch.nn.Module):
    """A stand-in model whose features are fixed tensors (old-model stub)."""

    def __init__(self, v, w, scale=1.0):
        super().__init__()
        self.v, self.w, self.s = v, w, torch.tensor(scale)

    def encode_image(self, images):
        return self.v

    def encode_text(self, tokens):
        return self.w

    def logit_scale(self):
        return self.s


def _ctx(model):
    return TaskContext(model=model, accelerator=None, config=None, manifest=None, run_dir=None)


def test_modx_loss_terms_and_metrics():
    g = torch.Generator().manual_seed(0)
    v = torch.nn.functional.normalize(torch.randn(6, 4, generator=g), dim=-1)
    w = torch.nn.functional.normalize(torch.randn(6, 4, generator=g), dim=-1)
    out = {"image_features": v, "text_features": w, "logit_scale": torch.tensor(10.0)}
    batch = {"image": torch.zeros(6), "text": torch.zeros(6)}
    m = ModX()
    assert m.args == {"alpha": 20.0, "tau": 1.0, "reduction": "sum"}
    ctx = _ctx(_Enc(v, w))
    assert set(m.loss(batch, out, ctx)) == {"itc"}  # first task: no old model
    m.old = _Enc(v, w)  # old == new: nothing to distil
    terms = m.loss(batch, out, ctx)
    assert set(terms) == {"itc", "modx_kl"} and float(terms["modx_kl"]) == 0.0
    acc = float(((v @ w.t()).argmax(-1) == torch.arange(6)).float().mean())
    assert ctx.metrics["modx_old_correct_i2t"] == pytest.approx(acc)
    v2 = torch.nn.functional.normalize(torch.randn(6, 4, generator=g), dim=-1)
    m.old = _Enc(v2, w)
    terms = m.loss(batch, out, ctx)
    y = torch.arange(6)
    exp = 20 * (modx_kl(v @ w.t(), v2 @ w.t(), y)[0] + modx_kl(w @ v.t(), w @ v2.t(), y)[0]) / 2
    assert float(terms["modx_kl"]) == pytest.approx(float(exp), rel=1e-6)


def test_modx_rejects_bad_args():
    from cvl.errors import CvlError

    with pytest.raises(CvlError, match="tau must be positive"):
        ModX({"tau": 0})
    with pytest.raises(CvlError, match="reduction"):
        ModX({"reduction": "avg"})
    with pytest.raises(CvlError, match="has no argument"):
        ModX({"lam": 1})


# -- training ------------------------------------------------------------------------------------
FAST = dict(
    method="modx",
    epochs=2,
    batch_size=16,
    log_with="none",
    checkpoint_every=0,
    model_config="tiny-vit",  # no BatchNorm: old (eval) and new (train) agree at a task's start
    max_steps_per_task=3,
    log_every=1,
    workers=0,
)


def _train(stream, out, **kw):
    train_run(stream, out, FAST, **kw)


def test_modx_trains_logs_and_checkpoints(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "r")
    done = finished_tasks(tmp_path / "r")
    assert [c.index for c in done] == [0, 1, 2]
    logs = [
        [json.loads(x) for x in (c.path / "train_log.jsonl").read_text().splitlines()] for c in done
    ]
    assert "modx_kl" not in logs[0][0]  # no old model on the first task
    for rec in logs[1] + logs[2]:
        assert {"itc", "modx_kl"} <= set(rec)
        assert rec["loss"] == pytest.approx(rec["itc"] + rec["modx_kl"], rel=1e-5)
        for d in ("i2t", "t2i"):
            assert 0.0 <= metric(rec, f"modx_old_correct_{d}") <= 1.0
    # first step of a task: new model == old model, so the KL is 0
    assert logs[1][0]["modx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert logs[1][-1]["modx_kl"] > 0


def test_modx_resume_mid_task_identical_weights(synth_stream, tmp_path, monkeypatch):
    def train(out):
        _train(synth_stream, out, checkpoint_every=2, max_steps_per_task=4)

    train(tmp_path / "a")
    pos = interrupt_then_resume(train, ModX, tmp_path / "b", monkeypatch)
    assert (pos["task_index"], pos["step"]) == (1, 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")
    key = lambda r: (r["loss"], r["modx_kl"], metric(r, "modx_old_correct_i2t"))  # noqa: E731
    assert [key(r) for r in task_log(tmp_path / "a", 1)] == [
        key(r) for r in task_log(tmp_path / "b", 1)
    ]


@pytest.mark.slow
@pytest.mark.torchrun_pair("--method", "modx", "--method-arg", "reduction=mean")
def test_modx_two_processes_equal_one(pair_runs):
    from distill_helpers import without_key_bias
    from test_distributed import assert_equivalent

    # reduction=mean here: at the start of each task old == new up to float noise (batch 8 vs
    # 16 rounds differently), so the KL gradient is noise, × α·N/2 = 160 with the default sum,
    # which Adam turns into ~2e-5 weight differences after 9 steps. The sum's global-batch
    # arithmetic is checked tightly on one step in test_modx_gradients_two_processes_equal_one.
    l1, l2, w1, w2 = pair_runs
    later = [r for r in l1 if r["task_index"] > 0]
    assert later and all("modx_kl" in r for r in later)
    keys = ("loss", "itc")
    assert_equivalent(l1, l2, without_key_bias(w1), without_key_bias(w2), keys=keys)
    for a, b in zip(l1, l2):
        if a["task_index"] > 0:
            assert abs(a["modx_kl"] - b["modx_kl"]) <= 1e-5, (a, b)
            for k in ("modx_old_correct_i2t", "modx_old_correct_t2i"):
                assert abs(metric(a, k) - metric(b, k)) <= 1e-6, (k, a, b)


@pytest.mark.slow
def test_modx_gradients_two_processes_equal_one(tmp_path):
    """One step's loss, metrics and averaged gradients: 2 × 8 rows == 1 × 16 rows."""
    from distill_helpers import assert_same_gradients, two_vs_one

    (v2, g2), (v1, g1) = two_vs_one("modx", {}, tmp_path)  # reduction=sum: × world size
    assert set(v1) == {"itc", "modx_kl", "modx_old_correct_i2t", "modx_old_correct_t2i"}
    assert 0 < v1["modx_old_correct_i2t"] < 1  # both kinds of rows are present
    assert v1["modx_kl"] > 0
    for k in v1:
        assert v2[k] == pytest.approx(v1[k], rel=1e-5, abs=1e-7), k
    assert_same_gradients(g1, g2)
