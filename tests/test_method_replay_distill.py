"""DER/DER++, Co2L, GeoDL, ERL, AFC, WiSE, ZSCL: hand-computed loss terms, the buffer's
per-item payload, first-task behaviour, 3-task training with exact resume, 2 processes == 1."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distill_helpers import buffer_holding
from train_helpers import assert_same_task_weights, interrupt_then_resume, task_log, train_run

from cvl.errors import CvlError
from cvl.losses import masked_clip_loss
from cvl.methods.afc import AFC, weighted_drift
from cvl.methods.buffers import Buffer
from cvl.methods.co2l import Co2L, ird
from cvl.methods.der import DER, IMAGE, TEXT
from cvl.methods.erl import ERL, relation_mse
from cvl.methods.geodl import GeoDL, flow_kernel, geodesic_distance
from cvl.methods.registry import all_methods
from cvl.methods.wise import WiSE, interpolate_
from cvl.methods.zscl import ZSCL
from cvl.train.checkpoint import load_state

T = torch.tensor
# Three pairs, 2-d unit embeddings, scale 2; row 2 is a replayed (buffer) pair.
V = [[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]
W = [[0.8, 0.6], [0.0, 1.0], [1.0, 0.0]]
CUR = T([True, True, False])
ITC_CURRENT_ONLY = 0.2987361676  # DER: anchors = candidates = rows 0, 1
ITC_ASYM = 0.7891310472  # Co2L: anchors rows 0, 1; all three columns
ITC_FULL = 0.9885335332  # every row an anchor (plain ITC)
# Relation distillation: new / old embeddings of 3 items.
X = [[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]]
XO = [[0.8, 0.6], [0.6, 0.8], [-0.8, 0.6]]
IRD_02_001 = 0.4599996557  # KL(p_old(τ=0.01) ‖ p_new(τ=0.2)) off-diagonal rows, mean
IRD_SWAPPED_T = 11.7414119941  # τ_new = 0.01, τ_old = 0.2
IRD_FLIPPED = 25.2342942846  # KL(p_new ‖ p_old)
ERL_XX = 0.0392  # exemplars {0, 2}: mean (x_i·x_j − x'_i·x'_j)²
ERL_XV = 0.6696  # x against V, x' against W
# GeoDL: lines at angle θ = 0.7 in the plane.
TH = 0.7
Q_07 = [[0.8519463321, 0.2964403061], [0.2964403061, 0.1480536679]]
GEO_07 = 0.0211700221  # 1 − cos_Q((1, 0), (0.6, 0.8)); the plain cosine distance is 0.4


def _sm(r):
    e = [math.exp(x - max(r)) for x in r]
    return [x / sum(e) for x in e]


def _dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def test_hand_values_follow_the_equations():
    """The literals, recomputed in plain Python from the definitions."""

    def itc(anchors, cands):
        tot = []
        for i in anchors:
            r1 = _sm([2 * _dot(V[i], W[j]) for j in cands])
            r2 = _sm([2 * _dot(W[i], V[j]) for j in cands])
            k = cands.index(i)
            tot.append(-(math.log(r1[k]) + math.log(r2[k])) / 2)
        return sum(tot) / len(tot)

    assert itc([0, 1], [0, 1]) == pytest.approx(ITC_CURRENT_ONLY)
    assert itc([0, 1], [0, 1, 2]) == pytest.approx(ITC_ASYM)
    assert itc([0, 1, 2], [0, 1, 2]) == pytest.approx(ITC_FULL)

    def kl(p, q):
        return sum(a * math.log(a / b) for a, b in zip(p, q))

    def rows(new, old, tn, to, flip=False):
        out = 0.0
        for i in range(3):
            js = [j for j in range(3) if j != i]
            pn = _sm([_dot(new[i], new[j]) / tn for j in js])
            po = _sm([_dot(old[i], old[j]) / to for j in js])
            out += kl(pn, po) if flip else kl(po, pn)
        return out / 3

    assert rows(X, XO, 0.2, 0.01) == pytest.approx(IRD_02_001)
    assert rows(X, XO, 0.01, 0.2) == pytest.approx(IRD_SWAPPED_T)
    assert rows(X, XO, 0.2, 0.01, flip=True) == pytest.approx(IRD_FLIPPED)
    ex = [0, 2]

    def rel(x, y, ox, oy):
        return sum((_dot(x[i], y[j]) - _dot(ox[i], oy[j])) ** 2 for i in ex for j in ex) / 4

    assert rel(X, X, XO, XO) == pytest.approx(ERL_XX)
    assert rel(X, V, XO, W) == pytest.approx(ERL_XV)
    # Q = ∫₀¹ u(ν)u(ν)ᵀ dν, u(ν) = (cos νθ, sin νθ): by quadrature.
    n = 20000
    q = [[0.0, 0.0], [0.0, 0.0]]
    for k in range(n):
        u = (math.cos((k + 0.5) / n * TH), math.sin((k + 0.5) / n * TH))
        for a in range(2):
            for b in range(2):
                q[a][b] += u[a] * u[b] / n
    assert q == [pytest.approx(r, abs=1e-8) for r in Q_07]

    def qd(a, b):
        return sum(a[i] * Q_07[i][j] * b[j] for i in range(2) for j in range(2))

    o, m = [1.0, 0.0], [0.6, 0.8]
    assert 1 - qd(o, m) / math.sqrt(qd(o, o) * qd(m, m)) == pytest.approx(GEO_07)


def test_masked_clip_loss_anchor_and_candidate_sets():
    v, w = T(V), T(W)
    assert float(masked_clip_loss(v, w, 2.0, CUR, CUR)) == pytest.approx(ITC_CURRENT_ONLY)
    assert float(masked_clip_loss(v, w, 2.0, CUR)) == pytest.approx(ITC_ASYM)
    everything = torch.ones(3, dtype=torch.bool)
    assert float(masked_clip_loss(v, w, 2.0, everything)) == pytest.approx(ITC_FULL)
    # Anchors flipped (buffer rows as anchors) is another number.
    assert float(masked_clip_loss(v, w, 2.0, ~CUR)) != pytest.approx(ITC_ASYM, rel=1e-3)


def _buffer(payload: dict | None = None) -> Buffer:
    """Items: positions 2 and 9 of task t0 (a batch row's `sid` is its position in t0)."""
    b = buffer_holding([2, 9], 8)
    if payload:
        b.set_payload(
            list(payload),
            **{k: torch.stack([p[k] for p in payload.values()]) for k in (IMAGE, TEXT)},
        )
    return b


def _payload_keys(state: dict, name: str) -> list[tuple[str, int]]:
    """The (task, position) of the items a saved buffer state holds payload `name` for."""
    p = state["payload"][name]
    return sorted(zip([p["tasks"][i] for i in p["task"].tolist()], p["pos"].tolist()))


def _ctx(buffer, first=False, fusion=False):
    return SimpleNamespace(
        buffer=buffer,
        model=SimpleNamespace(has_fusion=fusion),
        first_task=first,
        metrics={},
    )


def test_der_mse_uses_each_items_own_stored_target():
    """The batch holds the buffer item 2 in row 2 (item 9 is not in it); its stored embeddings
    are looked up by the row's sample id, not by the row's index."""
    v_star, w_star = T([0.0, 1.0]), T([0.6, 0.8])
    other = {IMAGE: T([1.0, 0.0]), TEXT: T([1.0, 0.0])}
    buf = _buffer({("t0", 9): other, ("t0", 2): {IMAGE: v_star, TEXT: w_star}})
    batch = {"sid": [0, 1, 2]}
    out = {"image_features": T(V), "text_features": T(W), "logit_scale": T(2.0)}
    m = DER({"alpha": 0.3})
    terms = m.loss(batch, out, _ctx(buf))
    # row 2: v = (0.6, 0.8) vs (0, 1): mean sq = (0.36 + 0.04)/2 = 0.2; w = (1, 0) vs (0.6, 0.8):
    # (0.16 + 0.64)/2 = 0.4; α·½(0.2 + 0.4) = 0.09.
    assert float(terms["der_mse"]) == pytest.approx(0.09)
    assert float(terms["itc"]) == pytest.approx(ITC_CURRENT_ONLY)
    assert "der_replay" not in terms
    pp = DER({"alpha": 0.3, "derpp": True, "beta": 0.5}).loss(batch, out, _ctx(buf))
    # DER++ replay: row 2 anchors against all columns (i2t: s·(0.6·0.8+0.8·0.6, 0.8, 0.6); t2i ...)
    i2t = [2 * _dot(V[2], w) for w in W]
    t2i = [2 * _dot(W[2], v) for v in V]
    rep = -(math.log(_sm(i2t)[2]) + math.log(_sm(t2i)[2])) / 2
    assert float(pp["der_replay"]) == pytest.approx(0.5 * rep)
    first = DER().loss(batch, out, _ctx(_buffer(), first=True))
    assert set(first) == {"itc"}


def test_buffer_payload_state_roundtrip_and_pruning(tmp_path):
    from cvl.train.checkpoint import save_state

    buf = _buffer({("t0", 2): {IMAGE: T([0.0, 1.0]), TEXT: T([0.6, 0.8])}})
    assert buf.keys_without(IMAGE) == [("t0", 9)]
    save_state(tmp_path, "st", {"buffer": buf.state_dict()})
    b2 = Buffer(8)
    b2.load_state_dict(load_state(tmp_path, "st")["buffer"])
    assert torch.equal(b2.payload[("t0", 2)][TEXT], T([0.6, 0.8]))
    b2.select = lambda task, entries, feats: {"t0": np.array([9])}
    b2.update("t1", [], None)
    assert b2.payload == {}  # k2 left the buffer: its stored output goes with it


def test_co2l_ird_direction_and_temperatures():
    x, xo = T(X), T(XO)
    assert float(ird(x, xo, 0.2, 0.01)) == pytest.approx(IRD_02_001, rel=1e-5)
    assert float(ird(x, xo, 0.01, 0.2)) == pytest.approx(IRD_SWAPPED_T, rel=1e-5)
    m = Co2L()
    assert (m.args["tau_new"], m.args["tau_old"]) == (0.2, 0.01)


class _Old:
    def __init__(self, v, w):
        self.v, self.w = v, w

    def encode_image(self, images, normalize=True):
        return self.v

    def encode_text(self, tokens, normalize=True):
        return self.w


def test_co2l_loss_anchors_current_items_only():
    buf = _buffer()
    batch = {
        "sid": [0, 1, 2],
        "image": 0,
        "text": 0,
    }
    out = {"image_features": T(X), "text_features": T(X), "logit_scale": T(2.0)}
    m = Co2L()
    t0 = m.loss(batch, {**out, "image_features": T(V), "text_features": T(W)}, _ctx(buf))
    assert set(t0) == {"itc"} and float(t0["itc"]) == pytest.approx(ITC_ASYM)
    m.old = _Old(T(XO), T(XO))
    t1 = m.loss(batch, out, _ctx(buf))
    assert float(t1["co2l_ird"]) == pytest.approx(IRD_02_001, rel=1e-5)


def test_erl_relations_among_exemplars():
    ex = T([True, False, True])
    assert float(relation_mse(T(X), T(X), T(XO), T(XO), ex)) == pytest.approx(ERL_XX)
    assert float(relation_mse(T(X), T(V), T(XO), T(W), ex)) == pytest.approx(ERL_XV)
    buf = _buffer()
    batch = {
        "sid": [2, 1, 9],
        "image": 0,
        "text": 0,
    }
    m = ERL({"weight": 3.0})
    m.old = _Old(T(XO), T(W))
    out = {"image_features": T(X), "text_features": T(V), "logit_scale": T(2.0)}
    terms = m.loss(batch, out, _ctx(buf))
    ww = float(relation_mse(T(V), T(V), T(W), T(W), ex))
    assert float(terms["erl"]) == pytest.approx(ERL_XX + ww + ERL_XV)  # 3·(sum)/3


def test_geodl_flow_kernel_and_distance():
    p1 = T([[1.0], [0.0]], dtype=torch.float64)
    p2 = T([[math.cos(TH)], [math.sin(TH)]], dtype=torch.float64)
    q = flow_kernel(p1, p2)
    assert torch.allclose(q, T(Q_07, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(flow_kernel(p2, p1), q, atol=1e-9)  # the same path backwards
    new, old = T([[0.6, 0.8]]), T([[1.0, 0.0]])
    assert float(geodesic_distance(new, old, q)) == pytest.approx(GEO_07, rel=1e-6)
    assert float(geodesic_distance(new, old, torch.eye(2))) == pytest.approx(0.4)
    # Identical subspaces: Q is the projector onto them.
    assert torch.allclose(flow_kernel(p1, p1), p1 @ p1.t(), atol=1e-9)


def test_afc_weighted_drift_by_hand():
    new, old = T([[1.0, 2.0], [3.0, 0.0]]), T([[0.0, 2.0], [1.0, 1.0]])
    imp = T([0.5, 1.5])
    # channel 0: mean((1)², (2)²) = 2.5; channel 1: mean(0, 1) = 0.5 → 0.5·2.5 + 1.5·0.5 = 2.0
    assert float(weighted_drift(new, old, imp)) == pytest.approx(2.0)
    assert float(weighted_drift(old, new, imp)) == pytest.approx(2.0)
    assert float(weighted_drift(new, old, imp.flip(0))) == pytest.approx(4.0)


def test_wise_interpolates_and_passes_arguments_to_the_base():
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        a.weight.fill_(1.0), a.bias.fill_(2.0), b.weight.fill_(3.0), b.bias.fill_(0.0)
    interpolate_(a, b, 0.25)  # 0.25·a + 0.75·b
    assert torch.equal(a.weight, torch.full((1, 2), 2.5)) and float(
        a.bias.detach()
    ) == pytest.approx(0.5)
    m = WiSE({"base": "lwf", "alpha": 0.7, "variant": "logits"})
    assert m.args == {
        "base": "lwf",
        "alpha": 0.7,
        "anchor": "previous",
        "init": "merged",
        "first_task": False,
    }
    assert m.inner.args["variant"] == "logits"
    assert WiSE({"base": "icarl"}).needs_buffer
    with pytest.raises(CvlError, match="no argument 'nope'"):
        WiSE({"base": "lwf", "nope": 1})
    with pytest.raises(CvlError, match="cannot be wrapped"):
        WiSE({"base": "zscl"})
    with pytest.raises(CvlError, match="alpha"):
        WiSE({"alpha": 1.5})


@pytest.mark.parametrize(
    "steps, we_last, want, n",
    [
        # the code: averaged after steps 1 and 3 only (its iterations 0 and 2), never step 4
        (4, False, (0 + 3 + 6) / 3, 3),
        (5, False, (0 + 3 + 6 + 12) / 4, 4),  # step 5 (iteration 4) is a multiple: averaged
        (4, True, (0 + 3 + 6 + 9) / 4, 4),  # we_last: the final weights join at the task's end
        (5, True, (0 + 3 + 6 + 12) / 4, 4),  # ... once
    ],
)
def test_zscl_weight_ensemble_follows_the_code_schedule(steps, we_last, want, n):
    """we_every = 2: θ̂ starts at the task's start θ₀ and averages in the weights after steps
    1, 3, 5, … (the code's `iteration % avg_freq == 0` over iterations 0, 1, …): the last
    step's weights only when it is one of them, unless `we_last`."""
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(0.0)
    args = {"ref_stream": "unused", "we_every": 2, "teacher": "previous", "l2": 0}
    m = ZSCL({**args, "we_last": we_last})
    ctx = SimpleNamespace(model=lin, previous_model=lambda: None, step=0, steps_in_task=steps)
    m.before_task(ctx)  # θ̂ = θ₀ = 0
    for step, val in list(((1, 3.0), (2, 100.0), (3, 6.0), (4, 9.0), (5, 12.0)))[:steps]:
        with torch.no_grad():
            lin.weight.fill_(val)
        ctx.step = step
        m.after_step(ctx)
    m.after_task(ctx)
    assert float(lin.weight.detach()) == pytest.approx(want)
    assert m.own_state()["we_n"] == n


# ZSCL's distillation on 3 reference pairs (2-d unit features), teacher scale 2, student 3:
ZV = [[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]]  # the student's image features
ZW = [[0.8, 0.6], [0.0, 1.0], [1.0, 0.0]]  # the student's text features
ZVT = [[0.8, 0.6], [0.0, 1.0], [0.6, 0.8]]  # the teacher's image features
ZWT = [[1.0, 0.0], [0.6, 0.8], [0.8, 0.6]]  # the teacher's text features
# T²·[mean_i KL(softmax(2·v'_i·w'ᵀ/T) ‖ softmax(2·v_i·w'ᵀ/T)) + the same with texts as rows],
# T = 2 (the code: student images against the teacher's texts, the teacher's scale):
ZSCL_CODE = 0.2994697471
ZSCL_T1 = 0.2561942239  # T = 1
ZSCL_NO_T2 = 0.0748674368  # without the T² factor
ZSCL_MEAN = 0.1497348735  # the two directions averaged (cvl's earlier reading)
ZSCL_IMAGE = 0.0672505484  # the image → text term only
ZSCL_STUDENT = 0.7307880552  # the student's own texts in its logits (the paper's pairing)
ZSCL_OWN = 0.5280645912  # the student's logits with its own scale (3)


class _Encoders:
    """A stand-in model / teacher returning fixed features."""

    has_fusion = False

    def __init__(self, image, text, scale):
        self.image, self.text, self.scale = T(image), T(text), scale

    def encode_image(self, _):
        return self.image

    def encode_text(self, _):
        return self.text

    def logit_scale(self):
        return torch.tensor(self.scale)


def test_zscl_distillation_by_hand():
    """The loss term through ZSCL.loss, so T, the T² factor, the pairing, the scale and sum vs
    mean are each checked: every variant moves the value."""

    def _rows(old, new, t):
        def sm(r):
            e = [math.exp(x / t) for x in r]
            return [x / sum(e) for x in e]

        return sum(
            sum(a * math.log(a / b) for a, b in zip(sm(o), sm(n))) for o, n in zip(old, new)
        ) / len(old)

    def mm(a, b, s):
        return [[s * sum(x * y for x, y in zip(r, c)) for c in b] for r in a]

    direct = _rows(mm(ZVT, ZWT, 2), mm(ZV, ZWT, 2), 2) + _rows(mm(ZWT, ZVT, 2), mm(ZWT, ZV, 2), 2)
    assert 4 * direct == pytest.approx(ZSCL_CODE)  # the literal, from the definition

    def term(**args):
        m = ZSCL({"ref_stream": "unused", **args})
        m.teacher = _Encoders(ZVT, ZWT, 2.0)
        m.ref_batch = lambda ctx: {"image": None, "text": None}
        ctx = SimpleNamespace(model=_Encoders(ZV, ZW, 3.0))
        out = {"image_features": T(ZV), "text_features": T(ZW), "logit_scale": torch.tensor(3.0)}
        terms = m.loss({}, out, ctx)
        assert set(terms) == {"itc", "zscl_ref"}
        return float(terms["zscl_ref"])

    assert term() == pytest.approx(ZSCL_CODE, rel=2e-5)
    assert term(temp=1.0) == pytest.approx(ZSCL_T1, rel=2e-5)
    assert term(temp_squared=False) == pytest.approx(ZSCL_NO_T2, rel=2e-5)
    assert term(directions="mean") == pytest.approx(ZSCL_MEAN, rel=2e-5)
    assert term(directions="image") == pytest.approx(ZSCL_IMAGE, rel=2e-5)
    assert term(pairing="student") == pytest.approx(ZSCL_STUDENT, rel=2e-5)
    assert term(scale="own") == pytest.approx(ZSCL_OWN, rel=2e-5)
    assert term(weight=2.0) == pytest.approx(2 * ZSCL_CODE, rel=2e-5)
    with pytest.raises(CvlError, match="pairing"):
        ZSCL({"pairing": "nope"})


def test_zscl_l2_to_the_task_start_by_hand():
    """l2·Σ(θ − θ*)² (value logged) and 2·l2·(θ − θ*) added to the gradient, θ* = the
    weights at the task's start, over the trainable parameters only."""
    lin = torch.nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.copy_(T([[1.0, 2.0]]))
        lin.bias.fill_(0.5)
    lin.bias.requires_grad_(False)  # frozen (as under --tune): not pulled
    m = ZSCL({"ref_stream": "unused", "l2": 0.5, "we_every": 0, "teacher": "previous"})
    ctx = SimpleNamespace(model=lin, previous_model=lambda: None)
    m.before_task(ctx)
    with torch.no_grad():
        lin.weight.copy_(T([[2.0, 0.0]]))  # θ − θ* = (1, −2)
        lin.bias.fill_(9.0)
    m.before_step(ctx)
    assert float(m._l2_value) == pytest.approx(0.5 * (1 + 4))
    lin.weight.grad = T([[0.25, 0.25]])
    m.after_backward(ctx)
    assert lin.weight.grad.tolist() == [[0.25 + 1.0, 0.25 - 2.0]]
    assert lin.bias.grad is None


def test_registered_and_clear_errors(synth_stream, tmp_path):
    names = set(all_methods())
    assert {"der", "co2l", "geodl", "erl", "afc", "wise", "zscl"} <= names
    with pytest.raises(CvlError, match="needs a replay buffer"):
        train_run(synth_stream, tmp_path / "x", FAST, method="der")
    with pytest.raises(CvlError, match="ref_stream"):
        train_run(synth_stream, tmp_path / "y", FAST, method="zscl")


FAST = dict(batch_size=16, log_with="none", checkpoint_every=2, max_steps_per_task=3, epochs=1)
BUF = {"buffer": "reservoir", "buffer_size": 16}
RUNS = {
    "der": ({**BUF, "method_args": {"derpp": True}}, ["der_mse", "der_replay"]),
    "co2l": ({"buffer": "ring", "buffer_size": 16}, ["co2l_ird"]),
    "geodl": ({}, ["geodl"]),
    "erl": (BUF, ["erl"]),
    "afc": ({}, ["afc"]),
    "wise": ({"method_args": {"base": "lwf", "alpha": 0.5}}, ["lwf_kd"]),
    "zscl": ({"method_args": {"we_every": 2, "ref_batch": 8}}, ["zscl_ref"]),
}
CLS = {"der": DER, "co2l": Co2L, "geodl": GeoDL, "erl": ERL, "afc": AFC, "wise": WiSE, "zscl": ZSCL}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(RUNS))
def test_trains_and_resumes_exactly(synth_stream, tmp_path, monkeypatch, method):
    """Three tasks of the tiny CLIP; the method's terms absent on task 0 (zscl: present, its
    teacher is the initial model) and present later; interrupted at step 3 of task 1, resumed
    from step 2: bit-identical weights for every task (DER: and stored targets)."""
    extra, terms = RUNS[method]
    if method == "zscl":
        extra = {"method_args": {**extra["method_args"], "ref_stream": str(synth_stream)}}

    def train(out):
        train_run(synth_stream, out, FAST, method=method, model_config="tiny", **extra)

    train(tmp_path / "a")
    logs = [task_log(tmp_path / "a", i) for i in range(3)]
    for t in terms:
        assert (t in logs[0][-1]) == (method == "zscl")
        assert all(t in r for log in logs[1:] for r in log)
        assert max(r[t] for r in logs[2]) > 0  # active in task 2 (a window may hold no item)
    pos = interrupt_then_resume(train, CLS[method], tmp_path / "b", monkeypatch)
    assert (pos["task_index"], pos["step"]) == (1, 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")
    if method == "der":
        from cvl.runs import finished_tasks

        pa = load_state(finished_tasks(tmp_path / "a")[2].path, "method_state")["buffer"]
        pb = load_state(finished_tasks(tmp_path / "b")[2].path, "method_state")["buffer"]
        assert _payload_keys(pa, IMAGE) == _payload_keys(pb, IMAGE)
        # every item stored after tasks 0 and 1 carries its target (task 2's items would get
        # theirs before a fourth task)
        items = [(t, p) for t in ("t0", "t1") for p in pa["items"].get(t, T([])).tolist()]
        assert _payload_keys(pa, IMAGE) == sorted(items) and len(items) > 0
        assert torch.equal(pa["payload"][IMAGE]["rows"], pb["payload"][IMAGE]["rows"])


@pytest.mark.slow
def test_wise_alpha_zero_keeps_the_first_tasks_weights(synth_stream, tmp_path):
    """α = 0: every later task ends with task 0's weights (the interpolation really runs;
    integer BatchNorm counters are not weights and are not interpolated)."""
    from safetensors.torch import load_file

    from cvl.runs import finished_tasks

    train_run(
        synth_stream,
        tmp_path / "w",
        FAST,
        method="wise",
        model_config="tiny",
        method_args={"alpha": 0.0},
        checkpoint_every=0,
    )
    ws = [load_file(str(c.model_path)) for c in finished_tasks(tmp_path / "w")]
    floats = [k for k in ws[0] if ws[0][k].is_floating_point()]
    assert all(torch.equal(ws[0][k], w[k]) for w in ws[1:] for k in floats)


# -- 2 processes × 8 rows == 1 process × 16 rows: one shared spawn for every cross-rank term ----

EXEMPLARS = (1, 5, 6, 11, 12)  # 3 buffer rows on rank 0, 2 on rank 1


def _cross_rank(rows: slice, world: int, rank: int, stream: str) -> dict:
    """On this process's rows: DER's stored targets (embedding in parts + gather), one loss +
    backward of der / der++ / co2l / erl / geodl, and AFC's feature importance."""
    from distill_helpers import _setup

    from cvl.data.reader import PairDataset
    from cvl.dist import all_reduce_mean, average_gradients, gather_no_grad
    from cvl.methods.afc import feature_importance
    from cvl.methods.der import embed_pairs
    from cvl.streams.manifest import load_manifest

    res: dict = {}
    model, *_ = _setup("seqft", {})
    entries = PairDataset.from_shards(load_manifest(stream).train_shards("t0")).entries[:9]
    acc = None
    if world > 1:
        acc = SimpleNamespace(
            process_index=rank,
            num_processes=world,
            device=torch.device("cpu"),
            gather=gather_no_grad,
        )
    res["stored"] = torch.cat(embed_pairs(model, entries, acc), 1)
    g = torch.Generator().manual_seed(5)
    buf = buffer_holding(EXEMPLARS)
    buf.set_payload(
        [("t0", i) for i in EXEMPLARS],
        **{
            IMAGE: F.normalize(torch.randn(5, model.embed_dim, generator=g), dim=-1),
            TEXT: F.normalize(torch.randn(5, model.embed_dim, generator=g), dim=-1),
        },
    )
    for name, method, args in (
        ("der", "der", {}),
        ("derpp", "der", {"derpp": True}),
        ("co2l", "co2l", {}),
        ("erl", "erl", {}),
        ("geodl", "geodl", {"dim": 4}),
    ):
        model, m, ctx, images, texts = _setup(method, args)
        ctx.task_index, ctx.buffer = 1, buf
        batch = {"image": images[rows], "text": texts[rows], "sid": list(range(16))[rows]}
        out = model(batch["image"], batch["text"])
        terms = m.loss(batch, out, ctx)
        sum(terms.values()).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        average_gradients(params)
        vals = {k: float(all_reduce_mean(v.detach())) for k, v in terms.items()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        res[name] = (vals, grads)
    model, m, ctx, images, texts = _setup("afc", {})
    ctx.task_index = 0
    res["afc"] = feature_importance(model, [{"image": images[rows], "text": texts[rows]}], ctx)
    return res


def _worker(rank: int, port: int, out: str, stream: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        res = _cross_rank(slice(rank * 8, (rank + 1) * 8), 2, rank, stream)
        if rank == 0:
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_cross_rank_state_two_processes_equal_one(synth_stream, tmp_path):
    """DER's stored targets are the same rows whichever process embedded an item (9 items:
    5 + 4 per process); der, der++, co2l (anchor rows differ per rank), erl (exemplar counts
    differ per rank), geodl (subspaces of the global batch): loss and averaged gradients;
    AFC's importance (gradients of the global ITC)."""
    import socket

    import torch.multiprocessing as mp
    from device_helpers import spawn_env, start_method
    from distill_helpers import assert_same_gradients

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "two.pt")
    with spawn_env(2):
        mp.start_processes(
            _worker, args=(port, out, str(synth_stream)), nprocs=2, start_method=start_method()
        )
    two, one = (
        torch.load(out, weights_only=True),
        _cross_rank(slice(0, 16), 1, 0, str(synth_stream)),
    )
    assert one["stored"].shape[0] == 9
    assert torch.allclose(two["stored"], one["stored"], atol=1e-6)
    for name in ("der", "derpp", "co2l", "erl", "geodl"):
        (v2, g2), (v1, g1) = two[name], one[name]
        assert set(v1) == set(v2)
        assert all(v1[k] > 0 for k in v1), (name, v1)
        for k in v1:
            assert v2[k] == pytest.approx(v1[k], rel=1e-5, abs=1e-7), (name, k)
        assert_same_gradients(g1, g2, rel=1e-4)
    for k in ("image", "text"):
        assert torch.allclose(two["afc"][k], one["afc"][k], rtol=1e-4, atol=1e-6), k
        assert float(one["afc"][k].mean()) == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.torchrun_pair(
    *("--method", "der", "--method-arg", "derpp=true", "--buffer", "reservoir"),
    *("--buffer-size", "16"),
)
def test_der_torchrun_two_processes_store_the_same_targets(pair_runs, tmp_path):
    """The whole loop under torchrun ×2 (batch 8 each) vs 1 process (batch 16), DER++ with a
    reservoir: the stored targets of every buffer item (embedded in parts by both ranks with
    the real Accelerate gather) and every logged term match."""
    from cvl.runs import finished_tasks

    l1, l2, _, _ = pair_runs
    assert len(l1) == len(l2) > 0
    for a, b in zip(l1, l2):
        assert set(a) == set(b)
        for k in ("loss", "itc", "der_mse", "der_replay"):
            if k in a:
                assert abs(a[k] - b[k]) <= 1e-5, (k, a, b)
    assert any("der_mse" in r for r in l1)
    for i in (1, 2):
        p1, p2 = (
            load_state(finished_tasks(tmp_path / r)[i].path, "method_state")["buffer"]["payload"]
            for r in ("one", "two")
        )
        for name in (IMAGE, TEXT):
            k1, k2 = _payload_keys({"payload": p1}, name), _payload_keys({"payload": p2}, name)
            assert k1 == k2 and len(k1) > 0
            assert torch.allclose(p1[name]["rows"], p2[name]["rows"], atol=1e-5)
