"""BatchNorm statistics under the merges (cvl.methods.merging, "Statistics"): the task-vector
merges leave them out of the task vectors and deploy the mean of the task models'; the
interpolation merges combine them like the weights. By hand on a Linear + BatchNorm1d model
whose task models' variances make θ_0 + λ·Σ τ negative, and end to end on the tiny ResNet CLIP."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from train_helpers import FAST, train_run

from cvl.methods.merging import floating_state, statistics_names, write_
from cvl.methods.model_stock import ModelStock
from cvl.methods.opcm import OPCM
from cvl.methods.task_arith import TaskArithmetic
from cvl.methods.ties import TIES
from cvl.methods.wise import WiSE

T = torch.tensor


def net() -> torch.nn.Module:
    """θ_0: weight [[1, 1]], bias [0], BatchNorm running mean 0, variance 1 (PyTorch's init)."""
    m = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.BatchNorm1d(1))
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[0].bias.zero_()
    return m


def tuned(model: torch.nn.Module, weight: list[float], mean: float, var: float, batches: int):
    """A task model: θ_0's other weights, this linear weight and these statistics."""
    w = {k: v.clone() for k, v in floating_state(model).items()}
    w["0.weight"] = T([weight])
    w["1.running_mean"] = T([mean])
    w["1.running_var"] = T([var])
    return w, batches


def drive(method, tasks) -> list[dict[str, torch.Tensor]]:
    """The method through the tasks (training replaced by writing each task model), from
    `net()`; the deployed state dict after each task (integer buffers included)."""
    model = net()
    method._initial = {k: v.clone() for k, v in floating_state(model).items()}
    out = []
    for t, (w, batches) in enumerate(tasks):
        ctx = SimpleNamespace(model=model, first_task=t == 0, step=0, task_index=t)
        method.before_task(ctx)
        write_(model, w)
        model[1].num_batches_tracked.fill_(batches)
        method.after_task(ctx)
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


def test_statistics_are_the_floating_buffers_only():
    assert statistics_names(net()) == {"1.running_mean", "1.running_var"}


def test_task_arithmetic_deploys_the_mean_statistics_not_a_negative_variance():
    """λ = 1: θ_0 + Σ τ of the variances would be 1 + (0.2 − 1) + (0.1 − 1) = −0.7. Deployed:
    the mean of the task models' (0.2, then 0.15; means 2, then 3); the weights by the merge
    (τ_0 = [1, 0], τ_1 = [0, 2]: θ_0 + τ_0 + τ_1 = [2, 3]); the batch counter as trained."""
    model = net()
    tasks = [tuned(model, [2, 1], 2.0, 0.2, 7), tuned(model, [1, 3], 4.0, 0.1, 9)]
    d = drive(TaskArithmetic({"lam": 1.0}), tasks)
    assert d[0]["1.running_var"].item() == pytest.approx(0.2)
    assert d[1]["1.running_var"].item() == pytest.approx(0.15)
    assert d[1]["1.running_mean"].item() == pytest.approx(3.0)
    assert d[1]["0.weight"].tolist() == [[2.0, 3.0]]
    assert d[1]["1.num_batches_tracked"].item() == 9


def test_ties_trim_and_sign_election_ignore_the_statistics():
    """k = 0.2 over the weights alone: τ_0 = [3, 0.5], 0 for the linear bias and BatchNorm's
    weight and bias (5 entries): TIES's code keeps |τ| ≥ the (5 − 1)-th smallest, 0.5, so both.
    With the variance's τ (−0.9) among them (7 entries: ≥ the 6th smallest, 0.9) the 0.5 went."""
    model = net()
    tasks = [tuned(model, [4, 1.5], 0.0, 0.1, 1)]
    d = drive(TIES({"k": 0.2, "lam": 1.0}), tasks)
    assert d[0]["0.weight"].tolist() == [[4.0, 1.5]]
    assert d[0]["1.running_var"].item() == pytest.approx(0.1)


@pytest.mark.parametrize("cls", [OPCM, ModelStock])
def test_the_other_task_vector_merges_deploy_the_mean_statistics(cls):
    model = net()
    tasks = [tuned(model, [2, 1], 2.0, 0.2, 1), tuned(model, [1, 3], 4.0, 0.1, 2)]
    d = drive(cls(), tasks)
    assert d[1]["1.running_var"].item() == pytest.approx(0.15)
    assert d[1]["1.running_mean"].item() == pytest.approx(3.0)


def test_interpolation_merges_still_blend_the_statistics():
    """WiSE α = ½ with the previous deployed weights: a convex combination, as the weights."""
    model = net()
    tasks = [tuned(model, [2, 1], 2.0, 0.2, 1), tuned(model, [1, 3], 4.0, 0.4, 2)]
    d = drive(WiSE({"alpha": 0.5, "first_task": True}), tasks)
    assert d[0]["1.running_var"].item() == pytest.approx(0.6)  # ½·0.2 + ½·1
    assert d[1]["1.running_var"].item() == pytest.approx(0.5)  # ½·0.4 + ½·0.6
    assert d[1]["1.running_mean"].item() == pytest.approx(2.5)  # ½·4 + ½·1


def test_the_statistics_sum_survives_a_resume():
    """The method state after task 0, loaded into a fresh method, gives task 1 the same mean."""
    model = net()
    tasks = [tuned(model, [2, 1], 2.0, 0.2, 1), tuned(model, [1, 3], 4.0, 0.1, 2)]
    a = TaskArithmetic({"lam": 1.0})
    whole = drive(a, tasks)
    b = TaskArithmetic({"lam": 1.0})
    drive(b, tasks[:1])
    c = TaskArithmetic({"lam": 1.0})
    c.load_own_state(b.own_state())
    m = net()
    c._initial = {k: v.clone() for k, v in floating_state(m).items()}
    write_(m, {k: whole[0][k] for k in floating_state(m)})
    ctx = SimpleNamespace(model=m, first_task=False, step=0, task_index=1)
    c.before_task(ctx)
    write_(m, tasks[1][0])
    c.after_task(ctx)
    for k in ("1.running_var", "1.running_mean", "0.weight"):
        assert torch.equal(m.state_dict()[k], whole[1][k])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dare_ties", "tall_masks"])
def test_merges_deploy_valid_batchnorm_variances_on_the_resnet_clip(synth_stream, tmp_path, method):
    """The two merges that drove variances below 0 (λ·Σ τ over 18-step tasks): 3 tasks of the
    tiny ResNet CLIP; every saved running_var is the mean of the task models' (≥ 0)."""
    from safetensors.torch import load_file

    from cvl.runs import finished_tasks

    out = tmp_path / method
    train_run(synth_stream, out, FAST, method=method, max_steps_per_task=4)
    for task in finished_tasks(out):
        w = load_file(str(task.model_path))
        variances = [v for k, v in w.items() if k.endswith("running_var")]
        assert variances and all(bool((v >= 0).all()) for v in variances)
