"""LwF, iCaRL, LUCIR: hand-computed distillation terms, cosine projections, training with both
models, exact resume, 2 processes == 1."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from train_helpers import assert_same_task_weights, interrupt_then_resume, task_log, train_run

from cvl.errors import CvlError
from cvl.losses import cosine_distance
from cvl.methods.icarl import ICaRL
from cvl.methods.lucir import LUCIR, make_cosine_projections, store_normalized
from cvl.methods.lwf import LwF, feature_kd, logit_kd

# Feature variant: 3 items × 3 embedding dimensions (unnormalised projected features).
NEW_I = [[1.0, 0.0, 0.5], [0.2, 0.8, 0.0], [0.0, 0.3, 0.9]]
OLD_I = [[0.9, 0.1, 0.4], [0.5, 0.5, 0.0], [0.1, 0.1, 1.0]]
NEW_T = [[0.3, 0.6, 0.1], [0.0, 0.2, 0.7], [0.5, 0.5, 0.5]]
OLD_T = [[0.4, 0.4, 0.2], [0.1, 0.1, 0.6], [0.6, 0.3, 0.5]]
# ½·[mean_i KL(softmax(old_i/τ) ‖ softmax(new_i/τ)) over images + the same over texts]:
FEAT_TAU05 = 0.0434868827  # τ = 0.5
FEAT_TAU1 = 0.0112756677  # τ = 1
FEAT_FLIPPED = 0.0421000489  # KL(new ‖ old), τ = 0.5
# Logit variant: a 3×3 similarity matrix S (i2t; t2i = Sᵀ), new scale 2, old scale 3:
S_NEW = [[0.5, 0.4, 0.1], [0.3, 0.6, 0.1], [0.2, 0.2, 0.7]]
S_OLD = [[0.9, 0.1, 0.0], [0.8, 0.2, 0.0], [0.0, 0.3, 0.6]]
LOGIT_2_3 = 0.2207952466  # ½·[mean KL rows of softmax(3·S_old) ‖ softmax(2·S_new), + transposed]
LOGIT_2_2 = 0.1185978902  # the same with the new model's scale for both


def _softmax(row, t=1.0):
    e = [math.exp(x / t) for x in row]
    return [x / sum(e) for x in e]


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def _rows(old, new, t):
    return sum(_kl(_softmax(o, t), _softmax(n, t)) for o, n in zip(old, new)) / len(old)


def test_hand_values_follow_the_equations():
    """The literals, recomputed in plain Python from the definitions (guards against typos)."""
    assert (_rows(OLD_I, NEW_I, 0.5) + _rows(OLD_T, NEW_T, 0.5)) / 2 == pytest.approx(FEAT_TAU05)
    assert (_rows(NEW_I, OLD_I, 0.5) + _rows(NEW_T, OLD_T, 0.5)) / 2 == pytest.approx(FEAT_FLIPPED)

    def sc(m, s):
        return [[x * s for x in r] for r in m]

    def tr(m):
        return [list(c) for c in zip(*m)]

    lk = (_rows(sc(S_OLD, 3), sc(S_NEW, 2), 1) + _rows(sc(tr(S_OLD), 3), sc(tr(S_NEW), 2), 1)) / 2
    assert lk == pytest.approx(LOGIT_2_3)


def test_feature_kd_direction_and_temperature():
    t = torch.tensor
    args = (t(NEW_I), t(NEW_T), t(OLD_I), t(OLD_T))
    assert float(feature_kd(*args, 0.5)) == pytest.approx(FEAT_TAU05, abs=1e-7)
    assert float(feature_kd(*args, 1.0)) == pytest.approx(FEAT_TAU1, abs=1e-7)
    assert abs(FEAT_TAU05 - FEAT_FLIPPED) > 1e-3  # the KL direction is visible
    new_i = t(NEW_I, requires_grad=True)
    feature_kd(new_i, t(NEW_T), t(OLD_I), t(OLD_T), 0.5).backward()
    assert new_i.grad.abs().sum() > 0
    assert float(feature_kd(t(OLD_I), t(OLD_T), t(OLD_I), t(OLD_T), 0.5)) == pytest.approx(0.0)


def test_logit_kd_uses_each_models_scale():
    # v = I and w_j = column j of S make v·wᵀ = S (i2t) and w·vᵀ = Sᵀ (t2i)
    eye = torch.eye(3)
    w_new, w_old = torch.tensor(S_NEW).t(), torch.tensor(S_OLD).t()
    assert float(logit_kd(eye, w_new, eye, w_old, 2.0, 3.0)) == pytest.approx(LOGIT_2_3, abs=1e-6)
    assert float(logit_kd(eye, w_new, eye, w_old, 2.0, 2.0)) == pytest.approx(LOGIT_2_2, abs=1e-6)


class _Old(torch.nn.Module):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, image, text, mlm_ids=None):
        return self.out


def test_lwf_loss_terms_first_task_and_variants():
    t = torch.tensor
    out = {
        "image_features": F.normalize(t(NEW_I), dim=-1),
        "text_features": F.normalize(t(NEW_T), dim=-1),
        "image_raw": t(NEW_I),
        "text_raw": t(NEW_T),
        "logit_scale": torch.tensor(2.0),
    }
    old = {
        "image_features": F.normalize(t(OLD_I), dim=-1),
        "text_features": F.normalize(t(OLD_T), dim=-1),
        "image_raw": t(OLD_I),
        "text_raw": t(OLD_T),
        "logit_scale": torch.tensor(3.0),
    }
    ctx = SimpleNamespace(model=SimpleNamespace(has_fusion=False), metrics={})
    batch = {"image": torch.zeros(3), "text": torch.zeros(3)}
    m = LwF({"temp": 0.5, "weight": 2.0})
    assert set(m.loss(batch, out, ctx)) == {"itc"}  # first task: no old model
    m.old = _Old(old)
    terms = m.loss(batch, out, ctx)
    assert set(terms) == {"itc", "lwf_kd"}
    assert float(terms["lwf_kd"]) == pytest.approx(2 * FEAT_TAU05, abs=1e-6)
    lg = LwF({"variant": "logits"})
    lg.old = _Old(old)
    v, w, ov, ow = (
        out["image_features"],
        out["text_features"],
        old["image_features"],
        old["text_features"],
    )
    exp = logit_kd(v, w, ov, ow, 2.0, 3.0)
    assert float(lg.loss(batch, out, ctx)["lwf_kd"]) == pytest.approx(float(exp), abs=1e-6)
    with pytest.raises(CvlError, match="variant"):
        LwF({"variant": "soft"})


def test_cosine_distance_by_hand():
    # rows (1,0)·(0,1): cos 0 → 1; (1,1)·(2,2): cos 1 → 0; mean 0.5 (any leading shape)
    x = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])
    y = torch.tensor([[[0.0, 1.0], [2.0, 2.0]]])
    assert float(cosine_distance(x, y)) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kind,config", [("fusion", "tiny"), ("clip", "tiny"), ("clip", "tiny-vit")]
)
def test_cosine_projections(kind, config):
    from cvl.models import build_model

    torch.manual_seed(0)
    model = build_model(kind, config, pretrained=None)
    keys = set(model.state_dict())
    make_cosine_projections(model)
    make_cosine_projections(model)  # idempotent
    assert set(model.state_dict()) == keys  # the architecture's keys are unchanged
    model.eval()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(3, 3, model.image_size, model.image_size, generator=g)
    texts = model.tokenizer(["a red circle", "two blue squares", "a green star"])
    out = model(images, texts)
    if kind == "fusion":  # the projection is exactly normalize(W)·x, without bias
        w = model.vision_proj._parameters["weight"]
        cls = out["image_cls"]
        assert torch.allclose(out["image_raw"], cls @ F.normalize(w, dim=1).t(), atol=1e-6)
        assert float(model.vision_proj.bias.abs().sum()) == 0
        assert not model.vision_proj.bias.requires_grad
    # the gradient reaches the raw weights through the normalisation: no radial component
    out["image_features"].sum().backward()
    from cvl.methods.lucir import projection_slots

    mod, attr, dim = projection_slots(model)[0][0]
    raw = mod._parameters[attr]
    radial = (raw.grad * raw.detach()).sum(dim=dim)
    assert radial.abs().max() < 1e-5 * raw.grad.abs().max() + 1e-9
    # stored normalised, the plain architecture computes the same features (cvl eval)
    store_normalized(model)
    plain = build_model(kind, config, pretrained=None)
    plain.load_state_dict(model.state_dict())
    plain.eval()
    with torch.no_grad():
        a, b = model(images, texts), plain(images, texts)
    assert torch.allclose(a["image_features"], b["image_features"], atol=1e-6)
    assert torch.allclose(a["text_features"], b["text_features"], atol=1e-6)


def test_icarl_and_lucir_need_the_mof_buffer():
    ctx = SimpleNamespace(config=SimpleNamespace(buffer="reservoir"), model=None)
    for cls in (ICaRL, LUCIR):
        with pytest.raises(CvlError, match="--buffer mof"):
            cls().setup(ctx)
    assert ICaRL.needs_buffer and LUCIR.needs_buffer and ICaRL.buffer_hint == "mof"


# -- with the engine ----------------------------------------------------------------------------

FAST = dict(batch_size=16, log_with="none", checkpoint_every=2, max_steps_per_task=3, epochs=1)
RUNS = {
    ("lwf", "clip"): ({}, ["lwf_kd"]),
    ("lwf", "fusion"): ({"method_args": {"variant": "logits"}}, ["lwf_kd", "lwf_mlm"]),
    ("icarl", "clip"): ({"buffer": "mof", "buffer_size": 16}, ["icarl_kd"]),
    ("lucir", "fusion"): ({"buffer": "mof", "buffer_size": 16}, ["lucir_feat", "lucir_mlm"]),
}
CLS = {"lwf": LwF, "icarl": ICaRL, "lucir": LUCIR}


@pytest.mark.slow
@pytest.mark.parametrize("method,model", list(RUNS))
def test_trains_and_resumes_exactly(synth_stream, tmp_path, monkeypatch, method, model):
    """Three tasks; distillation absent on task 0 and positive later; interrupted at step 3
    of task 1, resumed from step 2: bit-identical weights for every task."""
    extra, terms = RUNS[(method, model)]
    cfg = "tiny-vit" if model == "clip" else "tiny"

    def train(out):
        train_run(synth_stream, out, FAST, method=method, model=model, model_config=cfg, **extra)

    train(tmp_path / "a")
    logs = [task_log(tmp_path / "a", i) for i in range(3)]
    assert not any(t in r for r in logs[0] for t in terms)
    for log in logs[1:]:
        for t in terms:
            assert all(t in r for r in log) and log[-1][t] > 0
        for r in log:
            parts = sum(v for k, v in r.items() if k in ("itc", "mlm", *terms))
            assert r["loss"] == pytest.approx(parts, rel=1e-5)
    pos = interrupt_then_resume(train, CLS[method], tmp_path / "b", monkeypatch)
    assert (pos["task_index"], pos["step"]) == (1, 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")


# 2 processes × 8 == 1 × 16 for the logit variant (global matrices): one shared 2-process run
# with the importance passes, tests/test_method_regularizers.py::test_cross_rank_state_...
