"""The merging methods on hand-computable weights (a 2-weight linear layer stepped through
tasks by hand), their pieces (EMA, TIES's trim / elect / disjoint mean, Model Stock's ratio),
the `init` choices, and 3-task training under --tune lora with exact resume."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from train_helpers import FAST, assert_same_task_weights, interrupt_then_resume, train_run

from cvl.errors import CvlError
from cvl.methods.ema_merge import EMAMerge
from cvl.methods.ema_step import EMAStep, ema_update_
from cvl.methods.ft_merge import FinetuneMerge
from cvl.methods.merging import floating_state, interpolate_, write_
from cvl.methods.model_stock import ModelStock, mean_pairwise_cos, stock_ratio
from cvl.methods.task_arith import TaskArithmetic
from cvl.methods.ties import TIES, ties_merge, trim_top_k
from cvl.methods.wise import WiSE
from cvl.methods.zs_merge import ZeroShotMerge

T = torch.tensor


class Stream:
    """A 2-weight model (θ_0 = 0) taken through tasks: `train(values)` plays the optimizer."""

    def __init__(self, method, bias: bool = False) -> None:
        self.lin = torch.nn.Linear(2, 1, bias=bias)
        with torch.no_grad():
            for p in self.lin.parameters():
                p.zero_()
        self.m = method
        self.m._initial = {k: v.clone() for k, v in floating_state(self.lin).items()}
        self.t = -1

    def begin(self) -> list[float]:
        self.t += 1
        self.ctx = SimpleNamespace(model=self.lin, first_task=self.t == 0, step=0)
        self.m.before_task(self.ctx)
        return self.weights()

    def step(self, values: list[float], bias: float | None = None) -> None:
        with torch.no_grad():
            self.lin.weight.copy_(T([values]))
            if bias is not None:
                self.lin.bias.fill_(bias)
        self.ctx.step += 1
        self.m.after_step(self.ctx)

    def end(self) -> list[float]:
        self.m.after_task(self.ctx)
        return self.weights()

    def weights(self) -> list[float]:
        return [round(x, 6) for x in self.lin.weight.detach().flatten().tolist()]


def test_wise_from_the_finetuned_weights_merges_consecutive_finetuned_models():
    """cvl's former `ft_merge`: α = 0.5, init=finetuned, anchor=start: task 0 kept;
    θ_1 = ½(θ̂_1 + θ̂_0); task 2 trains from θ̂_1."""
    s = Stream(WiSE({"init": "finetuned", "anchor": "start"}))
    assert s.begin() == [0, 0]
    s.step([2, 0])
    assert s.end() == [2, 0]  # first_task=false: task 0 as trained
    assert s.begin() == [2, 0]
    s.step([2, 4])
    assert s.end() == [2, 2]
    assert s.begin() == [2, 4]  # the fine-tuned θ̂_1, not the deployed θ_1
    s.step([6, 4])
    assert s.end() == [4, 4]  # ½([6, 4] + [2, 4])


def test_wise_interpolates_with_the_previous_deployed_weights():
    s = Stream(WiSE({"first_task": True}))
    s.begin()
    s.step([2, 0])
    assert s.end() == [1, 0]  # ½(θ̂_0 + θ_0)
    assert s.begin() == [1, 0]  # init=merged
    s.step([1, 4])
    assert s.end() == [1, 2]


def test_ema_step_runs_within_and_across_tasks():
    """decay ½: θ̄ = θ_0, then ½θ̄ + ½θ per step; deployed at the task end; the next task
    trains on from θ̂ while θ̄ continues (init=finetuned)."""
    s = Stream(EMAStep({"decay": 0.5}))
    s.begin()
    s.step([2, 0])  # θ̄ = [1, 0]
    s.step([2, 2])  # θ̄ = [1.5, 1]
    assert s.end() == [1.5, 1]
    assert s.begin() == [2, 2]
    s.step([4, 2])  # θ̄ = [2.75, 1.5]
    assert s.end() == [2.75, 1.5]
    avg = {"a": T([1.0, 2.0])}
    ema_update_(avg, {"a": T([3.0, 0.0])}, 0.75)
    assert avg["a"].tolist() == [1.5, 1.5]


# -- FoMo-in-Flux's merges against its code, on a training whose result depends on the start ---
def _fomo(kind: str, theta0: torch.Tensor, train) -> tuple[list, list]:
    """FoMo-in-Flux's checkpoint bookkeeping, transcribed: `checkpoint_storage["running"]`
    starts as [θ_0] (base_continual_learner.py, `__init__`); each task trains from
    `define_training_weights` (zs_paint.py: `prepare_for_training` loads θ_0), `end_task`
    appends θ̂_t, the evaluated weights are `define_evaluation_weights`; `unrolled_merge`:
    ema/zs fold f_merge([θ̂_i, running]) over the list, ft takes f_merge([last, first]);
    f_merge = Interpolation with null coefficients (½, ½). Returns (starts, evaluated)."""

    def f_merge(a, b):
        return a * 0.5 + b * 0.5

    def unrolled(ckpts):
        if kind == "ft":
            return f_merge(ckpts[-1], ckpts[0])
        run = ckpts[0]
        for c in ckpts[1:]:
            run = f_merge(c, run)
        return run

    running, starts, evaluated = [theta0], [], []
    for t in range(len(TARGETS)):
        start = theta0 if kind == "zs" else unrolled(running)
        starts.append(start)
        running.append(train(start, t))
        evaluated.append(unrolled(running))
    return starts, evaluated


TARGETS = [T([4.0, -2.0, 1.0]), T([-3.0, 5.0, 2.0]), T([1.0, 1.0, -6.0]), T([2.0, -4.0, 3.0])]


def _pull(theta, t, steps: int = 3, eta: float = 0.3):
    """`steps` optimizer steps θ ← θ + η·(target_t − θ): where the task ends depends on
    where it started (unlike a fixed additive update, under which FoMo's ZS-merge and an
    FT-merge-like schedule come out the same)."""
    for _ in range(steps):
        theta = theta + eta * (TARGETS[t].double() - theta)
    return theta


def _additive(theta, t):
    return theta + TARGETS[t].double()


def _cvl(method, train) -> tuple[list, list]:
    """The method driven through the same tasks: (weights each task starts from, deployed)."""
    lin = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(T([[0.5, -1.0, 2.0]]))
    method._initial = {k: v.clone() for k, v in floating_state(lin).items()}
    starts, deployed = [], []
    for t in range(len(TARGETS)):
        ctx = SimpleNamespace(model=lin, first_task=t == 0, step=0, task_index=t)
        method.before_task(ctx)
        starts.append(lin.weight.detach()[0].clone())
        with torch.no_grad():
            lin.weight.copy_(train(lin.weight.detach()[0].clone(), t)[None])
        method.after_task(ctx)
        deployed.append(lin.weight.detach()[0].clone())
    return starts, deployed


@pytest.mark.parametrize(
    "kind, cls", [("ema", EMAMerge), ("zs", ZeroShotMerge), ("ft", FinetuneMerge)]
)
def test_fomo_merges_compute_fomo_in_flux_code(kind, cls):
    """Over 4 tasks of a training pulled towards task targets: every start and every
    deployed model equals FoMo-in-Flux's (ema_paint / zs_paint / ft_paint)."""
    theta0 = T([0.5, -1.0, 2.0]).double()
    want_starts, want = _fomo(kind, theta0, _pull)
    starts, got = _cvl(cls(), _pull)
    for t in range(len(TARGETS)):
        assert torch.allclose(starts[t], want_starts[t], atol=1e-12), (kind, "start", t)
        assert torch.allclose(got[t], want[t], atol=1e-12), (kind, "deployed", t)


def test_the_pulled_training_tells_the_schedules_apart():
    """Why the test above pulls towards targets: with a fixed additive update per task, FoMo's
    ZS-merge equals an FT-merge-style schedule (cvl's former `zs_merge`, trained from θ_{t−1},
    merged with θ_0) exactly; pulled towards targets they differ."""
    theta0 = T([0.5, -1.0, 2.0]).double()
    former = lambda: WiSE({"anchor": "initial", "first_task": True})  # noqa: E731
    _, zs_add = _fomo("zs", theta0, _additive)
    _, old_add = _cvl(former(), _additive)
    assert all(torch.allclose(a, b) for a, b in zip(zs_add, old_add))
    _, zs = _fomo("zs", theta0, _pull)
    _, old = _cvl(former(), _pull)
    assert not torch.allclose(zs[-1], old[-1], atol=1e-3)


def test_task_arithmetic_sums_task_vectors_from_the_initial_weights():
    """λ = 0.4, init=base: every task trains from θ_0; θ_t = θ_0 + λ·Σ τ."""
    s = Stream(TaskArithmetic())
    s.begin()
    s.step([2, 0])
    assert s.end() == [0.8, 0]
    assert s.begin() == [0, 0]  # back to θ_0
    s.step([0, 5])
    assert s.end() == [0.8, 2.0]


def test_ties_trim_elect_disjoint_mean_by_hand():
    """k = ½ of 4 entries: the code keeps |x| ≥ the 2nd smallest |x| (int(4·½) + 1 entries)."""
    t0 = {"w": T([3.0, -1.0, 0.5, -2.0])}
    t1 = {"w": T([-1.0, 2.0, 0.2, -4.0])}
    a, b = trim_top_k(t0, 0.5), trim_top_k(t1, 0.5)
    assert a["w"].tolist() == [3.0, -1.0, 0.0, -2.0]
    assert b["w"].tolist() == [-1.0, 2.0, 0.0, -4.0]
    # Σ = [2, 1, 0, −6] → signs +, +, (0 → the majority sign +), −; disjoint means:
    assert ties_merge([a, b])["w"].tolist() == [3.0, 2.0, 0.0, -3.0]
    # trimming is over all tensors of a vector at once (per tensor, y would keep 0.5)
    two = trim_top_k({"x": T([4.0, 1.0]), "y": T([0.5, -3.0])}, 0.5)
    assert two["x"].tolist() == [4.0, 1.0] and two["y"].tolist() == [0.0, -3.0]


def test_ties_trim_threshold_in_the_vectors_own_dtype():
    """float64 entries 1 and 1 + 1e-10 are one float32 value: the threshold found in float32
    would keep both with 5 (three entries); in float64 (the code's kthvalue) it keeps two."""
    tau = {"w": torch.tensor([0.1, 1.0, 1.0 + 1e-10, 5.0], dtype=torch.float64)}
    kept = trim_top_k(tau, 0.25)["w"]  # k = 4 − int(4·¼) = 3rd smallest |x| = 1 + 1e-10
    assert kept.dtype == torch.float64
    assert kept.tolist() == [0.0, 0.0, 1.0 + 1e-10, 5.0]


def test_ties_method_deploys_initial_plus_lambda_merge():
    s = Stream(TIES({"k": 1.0, "lam": 0.5}))
    s.begin()
    s.step([2, -2])
    assert s.end() == [1, -1]
    s.begin()
    s.step([-4, -6])  # signs: [2−4 < 0 → −, −]; means: [−4, (−2−6)/2]
    assert s.end() == [-2, -2]


def test_model_stock_ratio_by_hand():
    """t = k·cos/((k−1)·cos + 1); cos from Σu and Σ‖u‖²; layer-wise and clipped to [0, 1]."""
    c = 1 / math.sqrt(2)
    assert float(stock_ratio(torch.tensor(c), 2)) == pytest.approx(2 * c / (c + 1))
    assert float(stock_ratio(torch.tensor(-0.5), 2)) == 0.0
    u = [T([1.0, 0.0]), T([0.0, 1.0]), T([c, c])]  # pairwise cos 0, c, c
    mean = mean_pairwise_cos(sum(u), sum((x * x).sum() for x in u), 3)
    assert float(mean) == pytest.approx(2 * c / 3)
    s = Stream(ModelStock(), bias=True)
    s.begin()
    s.step([1, 0], bias=1.0)
    assert s.end() == [1, 0]  # k = 1: the fine-tuned model (t = 1)
    assert s.lin.bias.item() == pytest.approx(1.0)
    s.begin()
    s.step([1, 1], bias=-1.0)  # weight: cos(τ0, τ1) = c; bias: cos = −1 → t = 0
    t = 2 * c / (c + 1)
    assert s.end() == [round(t * 1.0, 6), round(t * 0.5, 6)]  # θ_0 + t·mean(τ)
    assert s.lin.bias.item() == pytest.approx(0.0, abs=1e-7)


def test_interpolate_and_write_restrict_to_what_trains():
    lin = torch.nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.fill_(1.0), lin.bias.fill_(2.0)
    lin._cvl_trained_names = frozenset({"bias"})  # as --tune bitfit records it
    assert set(floating_state(lin)) == {"bias"}
    interpolate_(lin, {"bias": T([0.0])}, 0.25)
    assert lin.bias.item() == pytest.approx(0.5) and lin.weight.tolist() == [[1.0, 1.0]]
    with pytest.raises(CvlError, match="do not match"):
        write_(lin, {"weight": T([[0.0, 0.0]])})


def test_merge_arguments_are_checked():
    with pytest.raises(CvlError, match="init must be"):
        TaskArithmetic({"init": "nope"})
    with pytest.raises(CvlError, match="decay"):
        EMAStep({"decay": 1.0})
    with pytest.raises(CvlError, match="anchor must be"):
        EMAMerge({"anchor": "nope"})
    with pytest.raises(CvlError, match="'zs_merge': alpha"):
        ZeroShotMerge({"alpha": 2.0})
    with pytest.raises(CvlError, match="'ties': k"):
        TIES({"k": 0.0})
    with pytest.raises(CvlError, match="cannot be wrapped"):
        TIES({"base": "wise"})
    assert ModelStock({"base": "lwf", "variant": "logits"}).inner.args["variant"] == "logits"


MERGES = {
    "ema_merge": EMAMerge,
    "ema_step": EMAStep,
    "zs_merge": ZeroShotMerge,
    "ft_merge": FinetuneMerge,
    "task_arith": TaskArithmetic,
    "ties": TIES,
    "model_stock": ModelStock,
}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(MERGES))
def test_merges_train_under_lora_and_resume_exactly(synth_stream, tmp_path, monkeypatch, method):
    """Three tasks with LoRA adapters; interrupted at step 3 of task 1, resumed from step 2:
    bit-identical weights of every task (the merge state, θ̂ and the adapters resume)."""
    cfg = {**FAST, "checkpoint_every": 2, "max_steps_per_task": 4}

    def train(out):
        train_run(synth_stream, out, cfg, method=method, tune="lora")

    train(tmp_path / "a")
    pos = interrupt_then_resume(train, MERGES[method], tmp_path / "b", monkeypatch)
    assert (pos["task_index"], pos["step"]) == (1, 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ema_merge", "zs_merge", "ft_merge"])
def test_fomo_merges_in_cvl_train_start_and_deploy_as_fomo(
    synth_stream, tmp_path, monkeypatch, method
):
    """A real 3-task `cvl train` (tiny CLIP, 2 steps per task): the weights each task's first
    step sees and the saved (deployed) weights follow FoMo-in-Flux's schedule, θ_0 = init/."""
    from safetensors.torch import load_file

    from cvl.methods.seqft import SeqFT
    from cvl.runs import finished_tasks

    seen: dict[str, list] = {"start": [], "tuned": []}
    real_step, real_end = SeqFT.before_step, SeqFT.after_task

    def before_step(self, ctx):
        if ctx.step == 0:
            seen["start"].append(clone(ctx.model))
        real_step(self, ctx)

    def after_task(self, ctx):
        real_end(self, ctx)
        seen["tuned"].append(clone(ctx.model))

    def clone(model):
        return {k: v.detach().cpu().clone() for k, v in floating_state(model).items()}

    monkeypatch.setattr(SeqFT, "before_step", before_step)
    monkeypatch.setattr(SeqFT, "after_task", after_task)
    out = tmp_path / method
    train_run(synth_stream, out, FAST, method=method, max_steps_per_task=2)
    theta0 = load_file(str(out / "init" / "model.safetensors"))
    deployed = [load_file(str(c.model_path)) for c in finished_tasks(out)]

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    def half(a, b):
        return {k: a[k] * 0.5 + b[k] * 0.5 for k in a}

    prev = theta0
    for t in range(3):
        start, tuned = seen["start"][t], seen["tuned"][t]
        assert same(start, theta0 if method == "zs_merge" else prev), (method, "start", t)
        want = half(tuned, theta0 if method == "ft_merge" else prev)
        assert same(want, {k: deployed[t][k] for k in want}), (method, "deployed", t)
        prev = deployed[t]
