"""The merge operators of issue 38 (MagMax, DARE, DARE-TIES, Breadcrumbs, SLERP, TALL masks,
LiNeS, OPCM; TIME's preset): each on hand-computable tensors where a wrong sign, threshold,
mask, drop rate or normalisation fails, each against its public code's formula transcribed
literally here on seeded random state dicts, and each through a short `cvl train`."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_merging import Stream
from train_helpers import FAST, assert_same_task_weights, interrupt_then_resume, train_run

from cvl.errors import CvlError
from cvl.methods import merge_ops
from cvl.methods.breadcrumbs import Breadcrumbs
from cvl.methods.dare import Dare, DareTies
from cvl.methods.ema_merge import BestInTime, EMAMerge
from cvl.methods.magmax import MagMax
from cvl.methods.merging import floating_state, merge_operator
from cvl.methods.opcm import OPCM, linear_weights
from cvl.methods.registry import all_methods
from cvl.methods.slerp import Slerp
from cvl.methods.tall_masks import TallMasks
from cvl.methods.task_arith import TaskArithmetic

T = torch.tensor
NEW = ["magmax", "dare", "dare_ties", "breadcrumbs", "slerp", "tall_masks", "opcm", "best_in_time"]


def rand_state(seed: int, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


SHAPES = {"a.weight": (5, 4), "a.bias": (5,), "b.weight": (3, 5), "scale": ()}


def test_new_merges_are_registered():
    assert set(NEW) <= set(all_methods())


# -- MagMax ------------------------------------------------------------------------------------
def test_max_abs_by_hand_sign_kept_tie_to_the_later():
    a, b = {"w": T([3.0, -1.0, 2.0, 0.0])}, {"w": T([-4.0, 1.0, 0.5, -0.0])}
    assert merge_ops.max_abs([a, b])["w"].tolist() == [-4.0, 1.0, 2.0, 0.0]
    assert merge_ops.max_abs([b, a])["w"].tolist() == [-4.0, -1.0, 2.0, 0.0]


def test_magmax_method_by_hand():
    """λ = 0.5, sequential fine-tuning (task 1 starts from θ̂_0), vectors against θ_0 = 0."""
    s = Stream(MagMax())
    s.begin()
    s.step([2, -1])
    assert s.end() == [1.0, -0.5]
    assert s.begin() == [2, -1]  # init=finetuned
    s.step([1, -3])  # τ_1 = [1, −3] against θ_0 (not θ̂_0): max |·| = [2, −3]
    assert s.end() == [1.0, -1.5]


def test_magmax_against_its_code():
    """danielm1405/magmax `merge_max_abs` and FoMo-in-Flux `MagMax.merge` (argmax over the
    stacked flat vectors), transcribed, on random state dicts."""
    zs = rand_state(0, SHAPES)
    fts = [rand_state(i + 1, SHAPES) for i in range(4)]
    taus = [{k: f[k] - zs[k] for k in zs} for f in fts]
    want = {}
    for key in taus[0]:  # merge_max_abs
        m = taus[0][key]
        for tv in taus[1:]:
            m = torch.where(tv[key].abs() >= m.abs(), tv[key], m)
        want[key] = zs[key] + 0.5 * m
    got = merge_operator("magmax")(fts[::-1], zs)  # the operator takes the newest first
    assert all(torch.equal(got[k], want[k]) for k in zs)
    flat = torch.vstack([torch.cat([t[k].reshape(-1) for k in zs]) for t in taus])  # FoMo
    sel = flat[flat.abs().argmax(0), torch.arange(flat.shape[1])]
    assert torch.equal(
        torch.cat([got[k].reshape(-1) for k in zs]),
        torch.cat([zs[k].reshape(-1) for k in zs]) + 0.5 * sel,
    )


def test_magmax_operator_breaks_a_tie_towards_the_newer_task():
    """|τ| tie in entry 0: merge_max_abs (`>=`, task order) and the method keep the later task's
    −1; the operator takes its models newest first and must agree (λ = 0.5)."""
    zs = {"w": T([0.0, 0.0])}
    new, old = {"w": T([-1.0, 2.0])}, {"w": T([1.0, 1.0])}
    assert merge_operator("magmax")([new, old], zs)["w"].tolist() == [-0.5, 1.0]


# -- DARE --------------------------------------------------------------------------------------
def test_dare_drop_rate_and_rescale():
    tau = {"w": torch.ones(20000, dtype=torch.float64)}
    out = merge_ops.dare(tau, 0.25, torch.Generator().manual_seed(0))["w"]
    kept = out != 0
    assert set(out[kept].tolist()) == {4 / 3}  # 1/(1 − p), not 1/p
    assert abs(kept.double().mean().item() - 0.75) < 0.01  # p is the dropped fraction
    assert merge_ops.dare(tau, 0.0, torch.Generator())["w"].equal(tau["w"])


def test_dare_against_fusion_bench():
    """`param_random_drop_`: mask = rand > p; x·mask/(1 − p); the same draws in name order."""
    tau = rand_state(3, SHAPES)
    g = torch.Generator().manual_seed(7)
    want = {}
    for k in sorted(tau):  # the draws in name order (the docstring), not the dict's
        mask = torch.rand(tau[k].shape, generator=g) > 0.5
        want[k] = tau[k] * mask / (1 - 0.5)
    got = merge_ops.dare(tau, 0.5, torch.Generator().manual_seed(7))
    assert all(torch.equal(got[k], want[k]) for k in tau)
    backwards = {k: tau[k] for k in reversed(tau)}
    again = merge_ops.dare(backwards, 0.5, torch.Generator().manual_seed(7))
    assert all(torch.equal(again[k], want[k]) for k in tau)


def test_dare_operator_is_the_method_merge():
    """merge_operator("dare") on [θ̂_1, θ̂_0] (newest first): θ_0 + 0.3·(τ̃_0 + τ̃_1) with τ̃_i's
    mask drawn from seed + i (the method's task index), tensors in name order; the dicts' key
    order does not matter."""
    zs = rand_state(0, SHAPES)
    fts = [rand_state(i + 20, SHAPES) for i in range(2)]
    want = {k: v.clone() for k, v in zs.items()}
    for i, f in enumerate(fts):
        g = torch.Generator().manual_seed(5 + i)
        for k in sorted(zs):
            want[k] += 0.3 * (f[k] - zs[k]) * (torch.rand(zs[k].shape, generator=g) > 0.5) / 0.5
    op = merge_operator("dare", seed=5)
    got = op(fts[::-1], zs)
    assert all(torch.allclose(got[k], want[k], atol=1e-12) for k in zs)
    flip = [{k: m[k] for k in reversed(m)} for m in (fts[1], fts[0], zs)]
    again = op(flip[:2], flip[2])
    assert all(torch.equal(again[k], got[k]) for k in zs)


def test_dare_method_is_task_arithmetic_of_dropped_vectors_seeded_per_task():
    s = Stream(Dare({"p": 0.5, "lam": 1.0, "seed": 3}))
    s.begin()
    s.ctx.task_index = 0
    s.step([2, -4])
    u = torch.rand(2, generator=torch.Generator().manual_seed(3))  # task 0: seed + 0
    want = (T([2.0, -4.0]) * (u > 0.5) * 2).tolist()
    assert s.end() == want
    assert s.begin() == [0, 0]  # init=base


def test_dare_ties_against_fusion_bench():
    """DareTiesMerging.run: drop, then ties_merging(reset_thresh=20, merge_func='sum'):
    topk_values_mask over each flat vector, signs by mass (zeros: the majority sign), sum of
    the agreeing entries; θ_0 + 0.5·τ_m."""
    zs = rand_state(0, SHAPES)
    fts = [rand_state(i + 10, SHAPES) for i in range(3)]
    flat_taus = []
    for i, f in enumerate(fts):
        g = torch.Generator().manual_seed(i)  # seed 0 + task index
        tv = {k: f[k] - zs[k] for k in zs}
        for k in sorted(tv):  # name order
            tv[k] = tv[k] * (torch.rand(tv[k].shape, generator=g) > 0.5) / 0.5
        flat_taus.append(torch.cat([tv[k].reshape(-1) for k in zs]))
    m = torch.vstack(flat_taus)
    d = m.shape[1]
    kth = m.abs().kthvalue(d - int(d * 0.2), dim=1, keepdim=True).values
    m = m * (m.abs() >= kth)
    sign = torch.sign(m.sum(0))
    sign[sign == 0] = torch.sign(sign.sum())
    keep = torch.where(sign.unsqueeze(0) > 0, m > 0, m < 0)
    want = torch.cat([zs[k].reshape(-1) for k in zs]) + 0.5 * (m * keep).sum(0)

    model = torch.nn.Module()
    for k, v in zs.items():
        model.register_parameter(k.replace(".", "_"), torch.nn.Parameter(v.clone()))
    got = _drive(DareTies(), model, [{k.replace(".", "_"): f[k] for k in zs} for f in fts])[-1]
    flat_got = torch.cat([got[k.replace(".", "_")].reshape(-1) for k in zs])
    assert torch.allclose(flat_got, want, atol=1e-12)


# -- Breadcrumbs -------------------------------------------------------------------------------
def test_breadcrumbs_by_hand_per_row():
    row = [1.0, -5.0, 3.0, 0.5, -2.0, 4.0, 0.1, 2.5, -0.2, 0.3]
    out = merge_ops.breadcrumbs({"w": T([row, [-x for x in row]]), "s": T(2.0)}, 0.3, 0.1)
    # top 10 % (|−5|) removed, then the top 30 % (3 entries) of what is left kept
    assert out["w"][0].tolist() == [0, 0, 3.0, 0, 0, 4.0, 0, 2.5, 0, 0]
    assert out["w"][1].tolist() == [-0.0, 0, -3.0, -0, 0, -4.0, -0, -2.5, 0, -0]
    assert out["s"].item() == 2.0


def _middle_keep(tensor, keep, remove):
    """rezazzr/breadcrumbs TaskVectorMiddleKeep (remove_first=True), transcribed."""
    if len(tensor.shape) == 0:
        return tensor
    k = int(tensor.shape[-1] * remove)
    _, idx = torch.topk(torch.abs(tensor), k)
    mask = torch.ones(tensor.shape, dtype=tensor.dtype)
    mask.scatter_(len(tensor.shape) - 1, idx, 0.0)
    tensor = mask * tensor
    k = int(tensor.shape[-1] * keep)
    _, idx = torch.topk(torch.abs(tensor), k)
    mask = torch.zeros(tensor.shape, dtype=tensor.dtype)
    mask.scatter_(len(tensor.shape) - 1, idx, 1)
    return mask * tensor


def test_breadcrumbs_against_its_code():
    zs = rand_state(0, {**SHAPES, "wide": (4, 40)})
    fts = [rand_state(i + 20, {**SHAPES, "wide": (4, 40)}) for i in range(3)]
    want = {k: zs[k] + 0.4 * sum(_middle_keep(f[k] - zs[k], 0.2, 0.1) for f in fts) for k in zs}
    got = merge_operator("breadcrumbs")(fts, zs)
    assert all(torch.allclose(got[k], want[k], atol=1e-12) for k in zs)


# -- SLERP -------------------------------------------------------------------------------------
def test_slerp_by_hand():
    new, old = T([1.0, 0.0]), T([0.0, 1.0])  # ω = π/2
    c = math.sqrt(0.5)
    assert merge_ops.slerp(new, old, 0.5).tolist() == pytest.approx([c, c])  # lerp: ½, ½
    got = merge_ops.slerp(new, old, 0.25)  # weight ¼ on the new model
    assert got.tolist() == pytest.approx([math.sin(math.pi / 8), math.sin(3 * math.pi / 8)])
    par = merge_ops.slerp(T([1.0, 1.0]), T([2.0, 2.0]), 0.25)  # |cos| > 0.9995: linear
    assert par.tolist() == pytest.approx([1.75, 1.75])
    near = T([1.0, 0.02], dtype=torch.float64)  # cos ≈ 0.9998 > 0.9995: still linear
    got = merge_ops.slerp(T([1.0, 0.0], dtype=torch.float64), near, 0.25)
    assert got.tolist() == pytest.approx([1.0, 0.015], abs=1e-12)  # slerp: off by ~1e-6


def _fomo_slerp(v0, v1, w, threshold=0.9995, eps=1e-8):
    """FoMo-in-Flux `SLERP.slerp` (weight_coefficients[0] = w), transcribed."""
    a = v0 / v0.norm() if v0.norm() > eps else v0
    b = v1 / v1.norm() if v1.norm() > eps else v1
    dot = (a * b).sum().item()
    if np.abs(dot) > threshold:
        return (1 - w) * v0 + w * v1
    omega = np.arccos(dot)
    return (
        float(np.sin(omega * (1 - w)) / np.sin(omega)) * v0
        + float(np.sin(omega * w) / np.sin(omega)) * v1
    )


def test_slerp_against_fomo_in_flux():
    new, old = rand_state(1, SHAPES), rand_state(2, SHAPES)
    old["b.weight"] = new["b.weight"] * 2 + 1e-6  # a near-parallel pair: the linear branch
    for alpha in (0.5, 0.3):
        got = merge_operator("slerp", coefficients=(alpha, 1 - alpha))([new, old], None)
        for k in new:
            want = _fomo_slerp(new[k], old[k], 1 - alpha)  # FoMo's w weights its 2nd model
            assert torch.allclose(got[k], want, atol=1e-10), (k, alpha)


def test_slerp_method_merges_every_task_with_the_previous():
    s = Stream(Slerp())
    s.begin()
    s.step([2, 0])  # θ_0 = 0: norm ≤ eps, cos = 0 → slerp with ω = π/2
    want = math.sin(math.pi / 4) * 2
    assert s.end() == [round(want, 6), 0]


# -- TALL masks --------------------------------------------------------------------------------
def test_tall_masks_and_consensus_by_hand():
    t0 = {"w": T([1.0, 0.1, -1.0, 0.4])}
    t1 = {"w": T([1.0, -2.0, 0.5, 1.0])}
    m0, m1 = merge_ops.tall_masks([t0, t1], 0.4)
    assert m0["w"].tolist() == [True, False, True, False]  # 0.4 > 0.4·1.0 is false: strict
    assert m1["w"].tolist() == [True, True, True, True]
    assert merge_ops.consensus([t0, t1], 0.4, 2)["w"].tolist() == [2.0, 0.0, -0.5, 0.0]
    assert merge_ops.consensus([t0, t1], 0.4, 1)["w"].tolist() == pytest.approx(
        [2, -1.9, -0.5, 1.4]
    )


def test_tall_masks_against_fomo_in_flux():
    """FoMo-in-Flux `TallMasks.merge` (flattened, consensus ≥ k), transcribed."""
    zs = rand_state(0, SHAPES)
    fts = [rand_state(i + 30, SHAPES) for i in range(4)]
    ft = torch.vstack([torch.cat([f[k].reshape(-1) for k in zs]) for f in fts])
    z = torch.cat([zs[k].reshape(-1) for k in zs])
    multi = z + (ft - z).sum(0)
    masks = (z - ft).abs() > (multi - ft).abs() * 0.4
    want = z + 1.0 * (ft - z).sum(0) * (masks.float().sum(0) >= 2)
    got = merge_operator("tall_masks")(fts, zs)
    assert torch.allclose(torch.cat([got[k].reshape(-1) for k in zs]), want, atol=1e-12)


def test_tall_masks_method_deploys_initial_until_two_tasks_agree():
    s = Stream(TallMasks())
    s.begin()
    s.step([2, -1])
    assert s.end() == [0, 0]  # one mask: no entry kept by k = 2 tasks
    s.begin()
    s.step([1, 3])  # m0 = [2 > .4, 1 > 1.2] = [T, F]; m1 = [1 > .8, 3 > .4] = [T, T]
    assert s.end() == [3.0, 0]


# -- LiNeS -------------------------------------------------------------------------------------
def test_lines_scales_by_depth():
    names = [
        "clip.transformer.resblocks.0.mlp.c_fc.weight",
        "clip.transformer.resblocks.1.attn.in_proj_weight",
        "clip.transformer.resblocks.2.ln_1.bias",
        "clip.visual.transformer.resblocks.0.ln_2.weight",
        "clip.token_embedding.weight",
    ]
    got = merge_ops.lines_scales(names, 0.2, 0.6)  # α + β·ℓ/(L − 1), L = 3
    assert [got[n] for n in names] == pytest.approx([0.2, 0.5, 0.8, 0.2, 0.2])


def _fomo_lines(state, alpha, beta):
    """FoMo-in-Flux `BaseLinesMerge._infer_depth` + `_get_lines_weights` ("linear"), transcribed."""
    template, depth = "transformer.resblocks.", -1
    for key in state:
        if template in key:
            a = key.index(template) + len(template)
            depth = max(depth, int(key[a : key.index(".", a)]))
    depth += 1
    out = {}
    for key in state:
        for layer, block in enumerate([f".resblocks.{i}." for i in range(depth)]):
            if block in key:
                out[key] = alpha + beta * (layer / (depth - 1))
                break
    return {k: out.get(k, alpha) for k in state}


def test_lines_against_fomo_and_as_an_option_of_task_arithmetic():
    shapes = {f"clip.transformer.resblocks.{i}.w": (3,) for i in range(4)}
    shapes |= {"clip.visual.transformer.resblocks.1.w": (3,), "clip.ln_final.weight": (3,)}
    zs, tau = rand_state(0, shapes), rand_state(1, shapes)
    scales = _fomo_lines(zs, 0.3, 0.9)
    assert merge_ops.lines_scales(zs, 0.3, 0.9) == pytest.approx(scales)
    assert re.search(r"resblocks\.3", max(scales, key=scales.get))
    ta = TaskArithmetic({"lines": True, "lines_alpha": 0.3, "lines_beta": 0.9})
    got = ta.apply(zs, tau)
    assert all(torch.allclose(got[k], zs[k] + scales[k] * tau[k]) for k in zs)
    plain = TaskArithmetic().apply(zs, tau)  # lines off: λ = 0.4
    assert all(torch.allclose(plain[k], zs[k] + 0.4 * tau[k]) for k in zs)


# -- OPCM --------------------------------------------------------------------------------------
def test_opcm_projection_by_hand():
    prev = torch.diag(T([3.0, 2.0, 1.0], dtype=torch.float64))  # cumsum(s)/Σs = ½, ⅚, 1
    tau = torch.arange(1.0, 10.0, dtype=torch.float64).reshape(3, 3)
    # α = ½: the first ratio > ½ is at 1 (½ is not > ½) → only the diagonal goes
    got = merge_ops.opcm_project(prev, tau, 0.5)
    assert torch.allclose(got, T([[0, 2, 3], [4, 0, 6], [7, 8, 0.0]], dtype=torch.float64))
    got = merge_ops.opcm_project(prev, tau, 0.9)  # split 2: the top-left 2 × 2 block goes
    assert torch.allclose(got, T([[0, 0, 3], [0, 0, 6], [7, 8, 0.0]], dtype=torch.float64))
    prev = torch.diag(T([5.0, 4.0, 3.0], dtype=torch.float64))  # ratios 5/12, 0.75, 1
    got = merge_ops.opcm_project(prev, tau, 0.75)  # 0.75 is not > 0.75: split 2, not 1
    assert torch.allclose(got, T([[0, 0, 3], [0, 0, 6], [7, 8, 0.0]], dtype=torch.float64))


def test_opcm_method_by_hand():
    """Stream's 1 × 2 linear weight: τ̄_0 = [2, 0] deployed as θ̂_0; τ_1 = [1, 3] loses its
    component along τ̄_0 → S = [2, 3]; λ = ‖S‖/mean(‖τ_0‖, ‖τ_1‖); θ_1 = S/λ."""
    s = Stream(OPCM())
    s.begin()
    s.step([2, 0])
    assert s.end() == [2, 0]
    assert s.begin() == [0, 0]
    s.step([1, 3])
    lam = math.sqrt(13) / ((2 + math.sqrt(10)) / 2)
    assert s.end() == pytest.approx([2 / lam, 3 / lam], abs=1e-6)


def _fusion_bench_opcm(pretrained: torch.nn.Module, models: list, alpha: float) -> list:
    """fusion_bench `OPCMForCLIP.run` (no shuffle), `merge_linear_weights`,
    `merge_other_parameters`, transcribed: the merged state after each model."""
    import copy

    def tv_norm(m):
        sd, p = m.state_dict(), pretrained.state_dict()
        return torch.linalg.norm(torch.cat([(sd[k] - p[k]).reshape(-1) for k in sd]))

    merged = copy.deepcopy(models[0])
    out = [copy.deepcopy(merged.state_dict())]
    norms = [tv_norm(merged)]
    prev_lambda = 1
    for task in models[1:]:
        norms.append(tv_norm(task))
        avg = np.mean(norms)
        lam = 1
        for name, mod in merged.named_modules():
            if list(mod.children()):
                continue
            pw, tw = pretrained.get_submodule(name), task.get_submodule(name)
            for pn, param in mod.named_parameters():
                prev_tv = param - pw.get_parameter(pn)
                task_tv = tw.get_parameter(pn) - pw.get_parameter(pn)
                if isinstance(mod, torch.nn.Linear) and pn == "weight":
                    u, s, vh = torch.linalg.svd(prev_tv, full_matrices=True)
                    v = vh.T
                    split = (s.cumsum(dim=0) / s.sum() > alpha).float().argmax().item()
                    proj = u.T @ task_tv @ v
                    proj.diagonal().fill_(0)
                    proj[:split, :split] = 0
                    task_tv = u @ proj @ v.T
                param.data = pw.get_parameter(pn) + (prev_lambda * prev_tv + task_tv) / lam
        n = tv_norm(merged)
        lam *= n / avg
        for pn, param in merged.named_parameters():
            p0 = pretrained.get_parameter(pn)
            param.data = p0 + (param - p0) * (avg / n)
        prev_lambda = lam
        out.append(copy.deepcopy(merged.state_dict()))
    return out


def _drive(method, model, tuned_list):
    """The method through len(tuned_list) tasks on `model` (θ_0 = its weights): each task's
    training replaced by writing its fine-tuned weights; returns the deployed weights."""
    from cvl.methods.merging import write_

    method._initial = {k: v.clone() for k, v in floating_state(model).items()}
    deployed = []
    for t, tuned in enumerate(tuned_list):
        ctx = SimpleNamespace(model=model, first_task=t == 0, step=0, task_index=t)
        method.before_task(ctx)
        write_(model, tuned)
        method.after_task(ctx)
        deployed.append({k: v.detach().clone() for k, v in floating_state(model).items()})
    return deployed


def test_opcm_against_fusion_bench():
    torch.manual_seed(0)

    def net():
        return torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3)
        ).double()

    pre = net()
    models = []
    for _ in range(4):
        m = net()
        m.load_state_dict(pre.state_dict())
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        models.append(m)
    want = _fusion_bench_opcm(pre, models, 0.5)
    model = net()
    model.load_state_dict(pre.state_dict())
    assert linear_weights(model) == {"0.weight": 1, "2.weight": 1}
    got = _drive(OPCM(), model, [dict(m.state_dict()) for m in models])
    for t in range(4):
        for k in want[t]:
            assert torch.allclose(got[t][k], want[t][k], atol=1e-10), (t, k)


def test_opcm_splits_a_fused_qkv_projection():
    mha = torch.nn.MultiheadAttention(4, 2)
    assert linear_weights(mha) == {"in_proj_weight": 3, "out_proj.weight": 1}


# -- TIME's preset -----------------------------------------------------------------------------
def test_best_in_time_is_the_ema_merge():
    assert BestInTime.defaults == EMAMerge.defaults
    a, b = Stream(BestInTime()), Stream(EMAMerge())
    for s in (a, b):
        s.begin()
        s.step([2, 0])
        s.end()
        s.begin()
        s.step([4, 2])
    assert a.end() == b.end() == [2.5, 1.0]


def test_new_merge_arguments_are_checked():
    with pytest.raises(CvlError, match="'dare': p"):
        Dare({"p": 1.0})
    with pytest.raises(CvlError, match="'dare_ties': k"):
        DareTies({"k": 0.0})
    with pytest.raises(CvlError, match="agg must be"):
        DareTies({"agg": "max"})
    with pytest.raises(CvlError, match="breadcrumbs"):
        Breadcrumbs({"keep": 0.95, "remove": 0.1})
    with pytest.raises(CvlError, match="'opcm': alpha"):
        OPCM({"alpha": 2.0})
    with pytest.raises(CvlError, match="unknown merge operator"):
        merge_operator("nope")


# -- end to end --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("method", NEW)
def test_new_merges_train(synth_stream, tmp_path, method):
    """A 3-task `cvl train` of each (2 steps per task): finite weights saved for every task."""
    from safetensors.torch import load_file

    from cvl.runs import finished_tasks

    out = tmp_path / method
    train_run(synth_stream, out, FAST, method=method, max_steps_per_task=2)
    tasks = finished_tasks(out)
    assert len(tasks) == 3
    w = load_file(str(tasks[-1].model_path))
    assert all(torch.isfinite(v).all() for v in w.values() if v.is_floating_point())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["opcm", "magmax"])
def test_stateful_merges_resume_exactly_under_lora(synth_stream, tmp_path, monkeypatch, method):
    """Interrupted at step 3 of task 1 under `--tune lora`, resumed from step 2: every task's
    weights bit-identical to an uninterrupted run (OPCM's τ̄, λ and norms; MagMax's τ_max)."""
    cls = {"opcm": OPCM, "magmax": MagMax}[method]
    cfg = {**FAST, "checkpoint_every": 2, "max_steps_per_task": 4}

    def train(out):
        train_run(synth_stream, out, cfg, method=method, tune="lora")

    train(tmp_path / "a")
    pos = interrupt_then_resume(train, cls, tmp_path / "b", monkeypatch)
    assert (pos["task_index"], pos["step"]) == (1, 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")


@pytest.mark.slow
def test_lines_option_trains_with_ties(synth_stream, tmp_path):
    out = tmp_path / "ties-lines"
    train_run(
        synth_stream,
        out,
        FAST,
        method="ties",
        max_steps_per_task=2,
        method_args={"lines": True},
    )
