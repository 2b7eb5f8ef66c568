"""DKR (Alg. 1, Eq. 3-11): hand-computed rectified rows and JS, training, resume, 2 procs."""

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

from cvl.losses import js_rows
from cvl.methods.base import TaskContext
from cvl.methods.dkr import DKR, dkr_js, rectify
from cvl.runs import finished_tasks

# Affinities (row-softmaxes; pair i is column i), one row per case of Alg. 1:
#   row 0: old retrieves 0 (0.7 largest)                        → (a) keep old row
#   row 1: old picks 0, new retrieves 1 (0.6 largest)           → (b) Eq. 7 + Eq. 8
#   row 2: old picks 0, new picks 0                             → (c) Eq. 9 + Eq. 10
OLD = [[0.7, 0.2, 0.1], [0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]
NEW = [[0.4, 0.3, 0.3], [0.2, 0.6, 0.2], [0.5, 0.2, 0.3]]
Y = torch.tensor([0, 1, 2])

# (b) off-diagonals × (1 − 0.6)/(1 − 0.3) = 4/7: 0.5·4/7 = 2/7, 0.2·4/7 = 0.8/7; diagonal 1
ROW_B = [2 / 7, 1.0, 0.8 / 7]  # = [0.285714, 1, 0.114286], sums to 2 − 0.6 = 1.4
ROW_B_RNK_STAR = [2 / 7, 0.6, 0.8 / 7]  # diagonal keeps M_new[1, 1]; sums to 1
ROW_B_NORMALIZED = [0.204082, 0.714286, 0.081633]  # ROW_B / 1.4
# (c) diagonal 1, divided by 1 + (0.6 + 0.3) = 1.9
ROW_C = [0.6 / 1.9, 0.3 / 1.9, 1 / 1.9]  # = [0.315789, 0.157895, 0.526316]

# JS(a, b) = KL(a‖m) + KL(b‖m), m = (a + b)/2, KL(x‖y) = Σ x·log(x/y), per row:
JS_ROWS = [0.1038245, 0.0699748, 0.0548528]  # rows (a), (b), (c)
JS_ROW_B_RNK_STAR = 0.0194405
JS_ROW_B_NORMALIZED = 0.0306597


def _js(a, b):
    m = [(x + y) / 2 for x, y in zip(a, b)]
    kl = lambda p, q: sum(x * math.log(x / y) for x, y in zip(p, q) if x > 0)  # noqa: E731
    return kl(a, m) + kl(b, m)


def test_hand_values_follow_the_equations():
    """The JS literals above, recomputed from Eq. 4-5 in plain Python."""
    for got, (a, b) in zip(JS_ROWS, [(OLD[0], NEW[0]), (ROW_B, NEW[1]), (ROW_C, NEW[2])]):
        assert _js(a, b) == pytest.approx(got, abs=1e-7)
    assert _js(ROW_B_RNK_STAR, NEW[1]) == pytest.approx(JS_ROW_B_RNK_STAR, abs=1e-7)
    assert _js(ROW_B_NORMALIZED, NEW[1]) == pytest.approx(JS_ROW_B_NORMALIZED, abs=1e-6)
    assert [x / 1.4 for x in ROW_B] == pytest.approx(ROW_B_NORMALIZED, abs=1e-6)


def test_rectify_three_cases():
    out, case = rectify(torch.tensor(OLD), torch.tensor(NEW), Y)
    assert case.tolist() == [0, 1, 2]
    assert out[0].tolist() == pytest.approx(OLD[0], abs=1e-7)
    assert out[1].tolist() == pytest.approx(ROW_B, abs=1e-6)
    assert out[2].tolist() == pytest.approx(ROW_C, abs=1e-6)
    # as published, row (b) is not a distribution; (a) and (c) are
    assert out.sum(-1).tolist() == pytest.approx([1.0, 1.4, 1.0], abs=1e-6)


def test_old_correct_row_is_kept_whatever_the_new_model_does():
    """Alg. 1 line 2 takes precedence: old right + new wrong is case (a), not (b) or (c)."""
    old = torch.tensor([[0.7, 0.2, 0.1]])
    new = torch.tensor([[0.2, 0.5, 0.3]])  # new retrieves column 1 for row 0: wrong
    out, case = rectify(old, new, torch.tensor([0]))
    assert case.tolist() == [0]
    assert out[0].tolist() == pytest.approx([0.7, 0.2, 0.1], abs=1e-7)


def test_rectify_rnk_star_and_normalize():
    old, new = torch.tensor(OLD), torch.tensor(NEW)
    star, _ = rectify(old, new, Y, rnk_star=True)
    assert star[1].tolist() == pytest.approx(ROW_B_RNK_STAR, abs=1e-6)
    assert torch.equal(star[[0, 2]], rectify(old, new, Y)[0][[0, 2]])
    norm, _ = rectify(old, new, Y, normalize=True)
    assert norm[1].tolist() == pytest.approx(ROW_B_NORMALIZED, abs=1e-6)
    assert norm[2].tolist() == pytest.approx(ROW_C, abs=1e-6)  # (c) already sums to 1
    assert norm.sum(-1).tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)


def test_rectify_uses_global_columns():
    """Rows are this rank's samples; their pair sits at a global column (targets)."""
    old = torch.tensor([[0.1, 0.1, 0.2, 0.6], [0.1, 0.5, 0.3, 0.1]])  # rank 1 of 2, rows 2, 3
    new = torch.tensor([[0.1, 0.1, 0.5, 0.3], [0.1, 0.1, 0.2, 0.6]])
    out, case = rectify(old, new, torch.tensor([2, 3]))
    assert case.tolist() == [1, 1]
    f0, f1 = (1 - 0.5) / (1 - 0.2), (1 - 0.6) / (1 - 0.1)
    assert out[0].tolist() == pytest.approx([0.1 * f0, 0.1 * f0, 1.0, 0.6 * f0], abs=1e-6)
    assert out[1].tolist() == pytest.approx([0.1 * f1, 0.5 * f1, 0.3 * f1, 1.0], abs=1e-6)


def test_js_values_and_options():
    old_logits, new_logits = torch.tensor(OLD).log(), torch.tensor(NEW).log()  # softmax → rows
    rect, _ = rectify(torch.tensor(OLD), torch.tensor(NEW), Y)
    assert js_rows(rect, new_logits).tolist() == pytest.approx(JS_ROWS, abs=1e-6)
    js, case = dkr_js(new_logits, old_logits, Y)
    assert case.tolist() == [0, 1, 2]
    assert float(js) == pytest.approx(sum(JS_ROWS) / 3, abs=1e-6)  # per-row mean (default)
    assert float(dkr_js(new_logits, old_logits, Y, reduction="sum")[0]) == pytest.approx(
        sum(JS_ROWS), abs=1e-6
    )
    star = dkr_js(new_logits, old_logits, Y, rnk_star=True)[0]
    assert float(star) == pytest.approx((JS_ROWS[0] + JS_ROW_B_RNK_STAR + JS_ROWS[2]) / 3, 1e-5)
    norm = dkr_js(new_logits, old_logits, Y, normalize=True)[0]
    assert float(norm) == pytest.approx((JS_ROWS[0] + JS_ROW_B_NORMALIZED + JS_ROWS[2]) / 3, 1e-5)
    # identical distributions: 0; the gradient reaches only the new logits, finitely
    z = torch.tensor(NEW).log().requires_grad_()
    assert float(js_rows(torch.tensor(NEW), z).sum().detach()) == pytest.approx(0.0, abs=1e-7)
    sharp = torch.tensor([[200.0, 0.0, -200.0]], requires_grad=True)  # probabilities underflow
    js_rows(torch.tensor([[0.0, 0.5, 0.5]]), sharp).sum().backward()
    assert torch.isfinite(sharp.grad).all()


class _Enc(torch.nn.Module):
    def __init__(self, v, w, scale):
        super().__init__()
        self.v, self.w, self.s = v, w, torch.tensor(scale)

    def encode_image(self, images):
        return self.v

    def encode_text(self, tokens):
        return self.w

    def logit_scale(self):
        return self.s


def test_dkr_loss_terms_scales_and_metrics():
    g = torch.Generator().manual_seed(0)
    norm = torch.nn.functional.normalize
    v, w = (
        norm(torch.randn(6, 4, generator=g), dim=-1),
        norm(torch.randn(6, 4, generator=g), dim=-1),
    )
    v2 = norm(torch.randn(6, 4, generator=g), dim=-1)
    out = {"image_features": v, "text_features": w, "logit_scale": torch.tensor(10.0)}
    batch = {"image": torch.zeros(6), "text": torch.zeros(6)}
    ctx = TaskContext(model=_Enc(v, w, 10.0), accelerator=None, config=None, manifest=None,
                      run_dir=None)  # fmt: skip
    m = DKR()
    assert m.args == {"lam": 1.0, "rnk_star": False, "normalize": False, "reduction": "mean"}
    assert set(m.loss(batch, out, ctx)) == {"itc"}  # first task: no old model
    m.old = _Enc(v2, w, 5.0)  # the old model's own learned scale (5) for its affinities
    terms = m.loss(batch, out, ctx)
    y = torch.arange(6)
    exp = (
        dkr_js(10 * v @ w.t(), 5 * v2 @ w.t(), y)[0] + dkr_js(10 * w @ v.t(), 5 * w @ v2.t(), y)[0]
    )
    assert float(terms["dkr_js"]) == pytest.approx(float(exp), rel=1e-6)
    shares = [ctx.metrics[k] for k in ("dkr_old_correct", "dkr_new_only", "dkr_neither")]
    assert sum(shares) == pytest.approx(1.0)
    m2 = DKR({"lam": "0.1"})
    m2.old = m.old
    assert float(m2.loss(batch, out, ctx)["dkr_js"]) == pytest.approx(0.1 * float(exp), rel=1e-6)


# -- training ------------------------------------------------------------------------------------
FAST = dict(
    method="dkr",
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


def test_dkr_trains_logs_and_checkpoints(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "r", method_args={"normalize": True})
    done = finished_tasks(tmp_path / "r")
    assert [c.index for c in done] == [0, 1, 2]
    logs = [
        [json.loads(x) for x in (c.path / "train_log.jsonl").read_text().splitlines()] for c in done
    ]
    assert "dkr_js" not in logs[0][0]
    for rec in logs[1] + logs[2]:
        assert rec["loss"] == pytest.approx(rec["itc"] + rec["dkr_js"], rel=1e-5)
        shares = [metric(rec, k) for k in ("dkr_old_correct", "dkr_new_only", "dkr_neither")]
        assert sum(shares) == pytest.approx(1.0)
    # first step of a task: new == old; with normalised rows every case gives JS ≥ 0
    assert logs[1][0]["dkr_js"] >= 0 and logs[1][-1]["dkr_js"] > 0


def test_dkr_resume_mid_task_identical_weights(synth_stream, tmp_path, monkeypatch):
    def train(out):
        _train(synth_stream, out, checkpoint_every=2, max_steps_per_task=4)

    train(tmp_path / "a")
    pos = interrupt_then_resume(train, DKR, tmp_path / "b", monkeypatch)
    assert (pos["task_index"], pos["step"]) == (1, 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")
    key = lambda r: (r["loss"], r["dkr_js"], metric(r, "dkr_neither"))  # noqa: E731
    assert [key(r) for r in task_log(tmp_path / "a", 1)] == [
        key(r) for r in task_log(tmp_path / "b", 1)
    ]


@pytest.mark.slow
@pytest.mark.torchrun_pair("--method", "dkr")
def test_dkr_two_processes_equal_one(pair_runs):
    from distill_helpers import without_key_bias
    from test_distributed import assert_equivalent

    l1, l2, w1, w2 = pair_runs
    assert any("dkr_js" in r for r in l1)
    # weights: measured 1.02e-5 for one out_proj entry with issue 44's batch order (5.6e-6
    # with the earlier order): float32 rounding of the gathered batch's reductions, which a
    # distribution fault (~lr = 5e-4 a step) exceeds by far
    assert_equivalent(
        l1, l2, without_key_bias(w1), without_key_bias(w2), keys=("loss", "itc"), weight_atol=2e-5
    )
    for a, b in zip(l1, l2):
        if a["task_index"] > 0:
            assert abs(a["dkr_js"] - b["dkr_js"]) <= 1e-5, (a, b)
            for k in ("dkr_old_correct", "dkr_new_only", "dkr_neither"):
                assert abs(metric(a, k) - metric(b, k)) <= 1e-6, (k, a, b)


@pytest.mark.slow
def test_dkr_gradients_two_processes_equal_one(tmp_path):
    """One step's loss, metrics and averaged gradients: 2 × 8 rows == 1 × 16 rows."""
    from distill_helpers import assert_same_gradients, two_vs_one

    (v2, g2), (v1, g1) = two_vs_one("dkr", {"normalize": True, "reduction": "sum"}, tmp_path)
    assert {"itc", "dkr_js", "dkr_old_correct", "dkr_new_only", "dkr_neither"} == set(v1)
    for k in v1:
        assert v2[k] == pytest.approx(v1[k], rel=1e-5, abs=1e-7), k
    assert_same_gradients(g1, g2)
