"""EWC, SI, MAS, RWalk, AFEC: hand-computed penalties / importance on a two-parameter model,
first-task behaviour, training with both models, exact resume, 2 processes == 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from train_helpers import assert_same_task_weights, interrupt_then_resume, task_log, train_run

from cvl.methods.afec import AFEC
from cvl.methods.ewc import EWC
from cvl.methods.mas import MAS, mas_objective
from cvl.methods.regularizers import importance_pass, merge_running_mean, quadratic_penalty
from cvl.methods.rwalk import RWalk, rwalk_scores
from cvl.methods.si import SI


class Two(nn.Module):
    """Two parameters: a (starts at 0) and b (starts at 4); loss a − 2b (gradient (1, −2))."""

    def __init__(self, a: float = 0.0, b: float = 4.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))

    def loss(self) -> torch.Tensor:
        return self.a - 2 * self.b


def _ctx(model, task: int = 0, tasks: int = 3):
    from cvl.methods.base import TaskContext

    return TaskContext(
        model=model,
        accelerator=None,
        config=SimpleNamespace(seed=0),
        manifest=SimpleNamespace(task_order=[f"t{i}" for i in range(tasks)]),
        run_dir=None,
        task_index=task,
    )


def _t(*xs):
    return [torch.tensor(float(x)) for x in xs]


def _step(method, ctx, lr: float = 1.0) -> float | None:
    """The loop's order for one step (plain SGD): returns the penalty term's value."""
    method.before_step(ctx)
    value = None if method._value is None else float(method._value)
    for p in ctx.model.parameters():
        p.grad = None
    ctx.model.loss().backward()  # the base loss only: the penalty gradient is added after
    method.after_backward(ctx)
    with torch.no_grad():
        for p in ctx.model.parameters():
            p -= lr * p.grad
    ctx.step += 1
    method.after_step(ctx)
    return value


# -- the shared penalty -------------------------------------------------------------------------


def test_quadratic_penalty_by_hand():
    # Ω = (5, 2.5), θ* = (0, 4), θ = (1, 2): Σ Ω(θ−θ*)² = 5·1 + 2.5·4 = 15; Ω(θ−θ*) = (5, −5)
    v, od = quadratic_penalty(_t(1, 2), _t(0, 4), _t(5, 2.5))
    assert float(v) == pytest.approx(15.0)
    assert [float(x) for x in od] == [5.0, -5.0]
    # signed Ω (SI): (−1)·1 + 2·4 = 7; unsigned summation would give 9
    v, _ = quadratic_penalty(_t(1, 2), _t(0, 4), _t(-1, 2), signed=True)
    assert float(v) == pytest.approx(7.0)
    # matrices: one fused pass over tensors of any shape
    v, _ = quadratic_penalty([torch.ones(2, 3)], [torch.zeros(2, 3)], [torch.full((2, 3), 0.5)])
    assert float(v) == pytest.approx(3.0)


def test_running_mean_merge():
    # F ← t/(t+1)·F_old + 1/(t+1)·F_new: t=0 → new; t=1 → ½(4, 2) + ½(2, 6) = (3, 4);
    # t=2 → ⅔(3, 4) + ⅓(0, 3) = (2, 11/3)
    f = merge_running_mean(None, _t(4, 2), 0)
    f = merge_running_mean(f, _t(2, 6), 1)
    assert [float(x) for x in f] == pytest.approx([3.0, 4.0])
    f = merge_running_mean(f, _t(0, 3), 2)
    assert [float(x) for x in f] == pytest.approx([2.0, 11 / 3])


class _Lin(nn.Module):
    """loss_b = x_b·a + y_b·b: the gradient of batch b is (x_b, y_b)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.3))
        self.b = nn.Parameter(torch.tensor(-0.7))


def test_importance_pass_fisher_and_abs_by_hand():
    m = _Lin()
    batches = [{"x": 1.0, "y": 2.0}, {"x": 3.0, "y": -1.0}]

    def obj(model, b, ctx):
        return b["x"] * model.a + b["y"] * model.b

    ctx = _ctx(m)
    # Fisher: mean of squared batch gradients: a (1 + 9)/2 = 5, b (4 + 1)/2 = 2.5
    f = importance_pass(m, iter(batches), obj, ctx, square=True)
    assert [float(x) for x in f] == pytest.approx([5.0, 2.5])
    # MAS-style: mean |g|: a (1 + 3)/2 = 2, b (2 + 1)/2 = 1.5
    g = importance_pass(m, iter(batches), obj, ctx, square=False)
    assert [float(x) for x in g] == pytest.approx([2.0, 1.5])
    assert m.a.grad is None and m.training  # gradients cleared, mode restored
    assert len(importance_pass(m, iter(batches), obj, ctx, max_batches=1)) == 2


class _Feat(nn.Module):
    """Raw features a·image and b·text: MAS's ∂‖a·x‖/∂a = sign(a)·‖x‖."""

    has_fusion = False

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(2.0))
        self.b = nn.Parameter(torch.tensor(-1.0))

    def forward(self, image, text):
        return {"image_raw": self.a * image, "text_raw": self.b * text}


def test_mas_importance_uses_unnormalised_norms_by_hand():
    # batch 1: images (3,4), (6,8): norms 5, 10 → ∂/∂a mean = 7.5; texts (1,0), (0,2): norms
    # 1, 2, b < 0 → ∂/∂b = −1.5, |·| = 1.5. batch 2: images (0,1), (0,1): 1; texts (0,4),
    # (0,4): 4 → |∂/∂b| = 4. Ω = mean |g| over batches: a (7.5 + 1)/2 = 4.25, b (1.5+4)/2 = 2.75.
    # (Normalised features would give 0; squared gradients (Fisher) a (56.25 + 1)/2.)
    m = _Feat()
    batches = [
        {"image": torch.tensor([[3.0, 4.0], [6.0, 8.0]]), "text": torch.tensor([[1.0, 0], [0, 2]])},
        {"image": torch.tensor([[0.0, 1.0], [0, 1]]), "text": torch.tensor([[0.0, 4.0], [0, 4]])},
    ]
    om = importance_pass(m, iter(batches), mas_objective, _ctx(m), square=False)
    assert [float(x) for x in om] == pytest.approx([4.25, 2.75])


# -- the methods' hooks on the two-parameter model -------------------------------------------


def test_ewc_penalty_half_lambda_and_gradient_after_backward():
    m = EWC({"lam": 2.0})
    model = Two()
    ctx = _ctx(model, task=1)
    m.setup(ctx)
    m.lists["fisher"] = _t(5, 2.5)
    m.before_task(ctx)  # θ* = (0, 4)
    with torch.no_grad():
        model.a.fill_(1.0)
        model.b.fill_(2.0)
    m.before_step(ctx)
    # λ/2·ΣF(θ−θ*)² = 1·(5·1 + 2.5·4) = 15 (without the ½: 30)
    assert float(m._value) == pytest.approx(15.0)
    model.a.grad, model.b.grad = torch.tensor(0.5), torch.tensor(0.5)
    m.after_backward(ctx)
    # + λF(θ−θ*) = 2·(5·1, 2.5·(−2)) = (10, −10)
    assert (float(model.a.grad), float(model.b.grad)) == pytest.approx((10.5, -9.5))


def test_ewc_first_task_has_no_penalty_and_state_round_trips():
    m = EWC()
    model = Two()
    ctx = _ctx(model)
    m.setup(ctx)
    m.before_task(ctx)
    assert _step(m, ctx) is None and m.anchors() == []
    m.lists["fisher"] = _t(1, 2)
    st = m.state_dict()
    assert set(st["fisher"]) == {"a", "b"}
    fresh = EWC()
    fresh.setup(ctx)
    fresh.load_state_dict(st)
    assert [float(x) for x in fresh.get("fisher")] == [1.0, 2.0]


def test_si_uses_the_unregularised_gradient_by_hand():
    # task 0 (two SGD steps, lr 1, base gradient g = (1, −2), start (0, 4)):
    #   Δθ per step (−1, 2); ω = −Σ g·Δθ = 2·(1, 4) = (2, 8); Δθ_task = (−2, 4)
    #   Ω = ω/(Δθ_task² + ξ) = (2/4.1, 8/16.1) = (0.487804878, 0.496894410)
    m = SI({"c": 1.0, "xi": 0.1})
    model = Two()
    ctx = _ctx(model)
    m.setup(ctx)
    m.before_task(ctx)
    assert _step(m, ctx) is None and _step(m, ctx) is None  # no penalty on the first task
    m.after_task(ctx)
    assert [float(x) for x in m.get("omega")] == pytest.approx([0.487804878, 0.496894410])
    # task 1, θ* = (−2, 8). Step 1 at θ*: penalty 0, θ → (−3, 10). Step 2: d = (−1, 2),
    #   penalty c·ΣΩd² = 0.487804878 + 4·0.496894410 = 2.475382518 (no ½);
    #   total gradient (1 − 2·0.487804878, −2 + 4·0.496894410) = (0.024390244, −0.012422360)
    #   → θ = (−3.024390244, 10.012422360).
    #   ω uses g = (1, −2) (unregularised): step 1 (1, 4), step 2 −g·Δθ = (0.024390244,
    #   0.024844720) → ω = (1.024390244, 4.024844720); Δθ_task = (−1.024390244, 2.012422360)
    #   Ω += ω/(Δθ_task² + ξ) → (1.379063094, 1.466773026).
    #   (With the regularised gradient, step 2 would add (0.000594884, 0.000154315) to ω.)
    ctx.task_index, ctx.step = 1, 0
    m.before_task(ctx)
    assert _step(m, ctx) == pytest.approx(0.0)
    assert _step(m, ctx) == pytest.approx(2.475382518)
    assert (model.a.item(), model.b.item()) == pytest.approx((-3.024390244, 10.012422360))
    assert [float(x) for x in m.lists["w"]] == pytest.approx([1.024390244, 4.024844720])
    st = m.state_dict()  # in a task: ω is saved for a mid-task resume
    assert set(st) == {"counters", "omega", "w"}
    m.after_task(ctx)
    assert [float(x) for x in m.get("omega")] == pytest.approx([1.379063094, 1.466773026])
    assert "w" not in m.state_dict()


def test_rwalk_scores_and_penalty_by_hand():
    # ω = (2, 8), F = (0.5, 0.25), θ* = (0, 4), θ_end = (−2, 8): F·Δθ² + ξ = (2.1, 4.1);
    # s = ReLU(ω/…) = (0.952380952, 1.951219512); S from 0: (S + s)/2 = (0.476190476, 0.975609756)
    s = rwalk_scores(None, _t(2, 8), _t(0.5, 0.25), _t(0, 4), _t(-2, 8), 0.1)
    assert [float(x) for x in s] == pytest.approx([0.476190476, 0.975609756])
    # negative ω → 0 (ReLU); S = ((0.476190476, 0.975609756) + (0, 1.951219512))/2
    s = rwalk_scores(s, _t(-2, 8), _t(0.5, 0.25), _t(0, 4), _t(-2, 8), 0.1)
    assert [float(x) for x in s] == pytest.approx([0.238095238, 1.463414634])
    # penalty λ·Σ(F+S)(θ−θ*)² (no ½), λ = 2: F+S = (1.5, 1), θ−θ* = (1, −2) → 2·(1.5 + 4) = 11
    m = RWalk({"lam": 2.0})
    model = Two()
    ctx = _ctx(model, task=1)
    m.setup(ctx)
    m.lists["fisher"], m.lists["scores"] = _t(1, 0.5), _t(0.5, 0.5)
    m.before_task(ctx)
    with torch.no_grad():
        model.a.fill_(1.0)
        model.b.fill_(2.0)
    m.before_step(ctx)
    assert float(m._value) == pytest.approx(11.0)


def test_mas_penalty_has_the_half():
    m = MAS({"lam": 4.0})
    model = Two()
    ctx = _ctx(model, task=1)
    m.setup(ctx)
    m.lists["omega"] = _t(1, 3)
    m.before_task(ctx)
    with torch.no_grad():
        model.b.fill_(6.0)
    m.before_step(ctx)
    assert float(m._value) == pytest.approx(4 / 2 * 3 * 4)  # λ/2·Ω_b·(6−4)² = 24


def test_afec_two_anchors_by_hand():
    # F = (5, 2.5), θ* = (0, 4); F_e = (1, 3), θ_e = (2, 2); θ = (1, 2); λ = 2, λ_e = 4:
    # ewc = λ/2·(5·1 + 2.5·4) = 15; afec = λ_e/2·(1·(1−2)² + 3·0) = 2;
    # gradient λF(θ−θ*) + λ_e F_e(θ−θ_e) = (10, −10) + (−4, 0) = (6, −10)
    m = AFEC({"lam": 2.0, "lam_e": 4.0})
    model = Two()
    ctx = _ctx(model, task=1)
    m.setup(ctx)
    m.lists["fisher"] = _t(5, 2.5)
    EWC.before_task(m, ctx)  # θ* only (no expanded training in this unit test)
    m.expanded, m.exp_opt, m.exp_epoch = Two(2.0, 2.0), object(), ctx.epoch
    m.fisher_e = _t(1, 3)
    with torch.no_grad():
        model.a.fill_(1.0)
        model.b.fill_(2.0)
    m.before_step(ctx)
    assert float(m._value) == pytest.approx(15.0) and float(m._value_e) == pytest.approx(2.0)
    model.a.grad, model.b.grad = torch.tensor(0.0), torch.tensor(0.0)
    m.after_backward(ctx)
    assert (float(model.a.grad), float(model.b.grad)) == pytest.approx((6.0, -10.0))


# -- with the engine ----------------------------------------------------------------------------

FAST = dict(batch_size=16, log_with="none", checkpoint_every=2, max_steps_per_task=3, epochs=1)
# AFEC: 96 pairs / 32 = 3 steps per epoch, so step 4 is in epoch 1 (a second expanded epoch);
# checkpoints every step, the interruption after step 4 resumes at the start of epoch 1 with
# the expanded model, its optimizer and schedule of epoch 0 from the state.
AFEC_RUN = dict(batch_size=32, checkpoint_every=1, max_steps_per_task=4, epochs=2)
TERMS = {"ewc": ["ewc"], "si": ["si"], "mas": ["mas"], "rwalk": ["rwalk"], "afec": ["ewc", "afec"]}
CLS = {"ewc": EWC, "si": SI, "mas": MAS, "rwalk": RWalk, "afec": AFEC}
CAP = {"mas": {"importance_batches": 2}, "si": {}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,model",
    [("ewc", "clip"), ("si", "clip"), ("mas", "fusion"), ("rwalk", "clip"), ("afec", "clip")],
)
def test_trains_and_resumes_exactly(synth_stream, tmp_path, monkeypatch, method, model):
    """Three tasks; the extra terms are absent on task 0 and positive later; a run interrupted
    inside task 1 and resumed saves bit-identical weights for every task (importance passes
    capped at 2 batches to keep the test short)."""
    cfg = "tiny-vit" if model == "clip" else "tiny"
    kw = AFEC_RUN if method == "afec" else {}
    args = CAP.get(method, {"fisher_batches": 2})

    def train(out):
        train_run(
            synth_stream,
            out,
            FAST,
            method=method,
            model=model,
            model_config=cfg,
            method_args=args,
            **kw,
        )

    train(tmp_path / "a")
    logs = [task_log(tmp_path / "a", i) for i in range(3)]
    terms = TERMS[method]
    assert not any(t in r for r in logs[0] for t in terms)
    for log in logs[1:]:
        for t in terms:
            assert all(t in r for r in log)
            assert log[-1][t] > 0
        for r in log:
            parts = sum(v for k, v in r.items() if k in ("itc", "mlm", *terms))
            assert r["loss"] == pytest.approx(parts, rel=1e-5)
    step = 4 if method == "afec" else 3
    pos = interrupt_then_resume(train, CLS[method], tmp_path / "b", monkeypatch, step=step)
    assert (pos["task_index"], pos["step"]) == (1, step - 1 if method == "afec" else 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")
    assert [r["loss"] for r in task_log(tmp_path / "a", 1)] == [
        r["loss"] for r in task_log(tmp_path / "b", 1)
    ]


# -- importance over ranks ----------------------------------------------------------------------


def _importances(rows: slice) -> dict:
    """Fisher and MAS importance of the tiny fusion model (ITC + MLM; fusion CLS) on 2 global
    batches of 16 (the clip model's ITC is the same gathered-matrix arithmetic)."""
    from cvl.methods.ewc import fisher_objective
    from cvl.methods.regularizers import trainable
    from cvl.models import build_model

    res = {}
    for kind, cfg in (("fusion", "tiny"),):
        torch.manual_seed(0)
        model = build_model(kind, cfg, pretrained=None)
        g = torch.Generator().manual_seed(1)
        batches = []
        for b in range(2):
            n = model.image_size
            images = torch.randn(16, 3, n, n, generator=g)
            words = ["red", "blue", "green", "circle", "square", "star", "small", "big"]
            texts = model.tokenizer(
                [f"{words[i % 8]} {words[(i * 3 + b) % 8]} x{i}" for i in range(16)]
            )
            batches.append({"image": images[rows], "text": texts[rows]})
        ctx = _ctx(model)
        names = [n for n, _ in trainable(model)]
        f = importance_pass(model, iter(batches), fisher_objective, ctx, square=True)
        om = importance_pass(model, iter(batches), mas_objective, ctx, square=False)
        res[f"{kind}/fisher"] = dict(zip(names, f))
        res[f"{kind}/mas"] = dict(zip(names, om))
    return res


def _cross_rank(rows: slice) -> dict:
    """Everything with cross-rank state, on this process's rows: the importance passes and one
    LwF (logit variant: similarity matrices over the global batch) loss + backward."""
    from distill_helpers import _step

    return {"importance": _importances(rows), "lwf": _step("lwf", {"variant": "logits"}, rows)}


def _importance_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        res = _cross_rank(slice(rank * 8, (rank + 1) * 8))
        if rank == 0:
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_cross_rank_state_two_processes_equal_one(tmp_path):
    """One shared 2-process run (2 × 8 rows vs 1 × 16 rows): Fisher (ITC + MLM over the global
    batch) and MAS importance of the fusion model — gradients averaged over ranks before
    squaring / abs — and LwF's logit distillation (loss and averaged gradients)."""
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
            _importance_worker, args=(port, out), nprocs=2, start_method=start_method()
        )
    res2, res1 = torch.load(out, weights_only=True), _cross_rank(slice(0, 16))
    two, one = res2["importance"], res1["importance"]
    assert set(two) == set(one) == {"fusion/fisher", "fusion/mas"}
    for key in one:
        assert set(one[key]) == set(two[key])
        assert sum(float(t.sum()) for t in one[key].values()) > 0, key
        for n, a in one[key].items():
            b = two[key][n]
            assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max()) + 1e-12, (key, n)
    (v2, g2), (v1, g1) = res2["lwf"], res1["lwf"]
    assert set(v1) == {"itc", "lwf_kd"} and v1["lwf_kd"] > 0
    for k in v1:
        assert v2[k] == pytest.approx(v1[k], rel=1e-5, abs=1e-7), k
    assert_same_gradients(g1, g2)
