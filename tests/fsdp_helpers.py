"""Pieces of the `--fsdp` tests run inside torchrun launches (tests/dist_many.py contexts).

`sharded_ops_checked`: before its command, the sharded arithmetic of `cvl.train.fsdp` and
`cvl.methods.merge_dist` and every merge operator that reduces over a tensor (TIES's trim
threshold and sign election, Breadcrumbs, DARE's masks, SLERP, the task-vector norm, Model
Stock's angles, OPCM's projection), the gradient norm and clipping, the whole-model files
(gathered and resliced) and the optimizer state, each on a tiny model sharded over the
launch's processes, against the same function of the whole tensors in the same process.
Outside a multi-process launch it checks nothing (one process shards nothing).

`crash_after_checkpoint`: the command dies (an exception on every rank) right after its
first mid-task checkpoint of task index 1, so the next command (the same argv) resumes it.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist


class Crash(Exception):
    """The simulated death of a training process (after a checkpoint was written)."""


@contextlib.contextmanager
def crash_after_checkpoint():
    from cvl.train.rundir import RunFolder

    real = RunFolder._save_last

    def dying(self, ctx, opt, sched, where):
        real(self, ctx, opt, sched, where)
        if ctx.task_index == 1:
            raise Crash(f"killed after the checkpoint of step {ctx.step}")

    RunFolder._save_last = dying
    try:
        yield
    finally:
        RunFolder._save_last = real


@contextlib.contextmanager
def sharded_ops_checked():
    if dist.is_initialized() and dist.get_world_size() > 1:
        check_sharded_ops()
    yield


def _models():
    """The tiny ViT CLIP whole and sharded over the launch (the same weights); weights
    moved off their initial values so that every tensor is generic."""
    from cvl.models import build_model
    from cvl.train import fsdp

    torch.manual_seed(0)
    whole = build_model("clip", "tiny-vit")
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    sharded = copy.deepcopy(whole)
    fsdp.shard_(sharded, torch.device("cpu"))
    return whole, sharded


def _same(sharded: dict, whole: dict, what: str, atol: float = 0.0, rtol: float = 0.0) -> None:
    from cvl.train.fsdp import full

    assert sharded.keys() == whole.keys(), what
    for k, v in sharded.items():
        got, want = full(v), whole[k]
        if atol == 0.0 and rtol == 0.0:
            assert torch.equal(got, want), (what, k, float((got - want).abs().max()))
        else:
            ok = torch.allclose(got, want, atol=atol, rtol=rtol)
            assert ok, (what, k, float((got - want).abs().max()))


def check_sharded_ops() -> None:  # noqa: PLR0915 (one list of checks)
    from cvl.losses import clip_loss
    from cvl.methods import merge_ops
    from cvl.methods.merge_dist import global_kthvalue
    from cvl.methods.merging import floating_state
    from cvl.methods.model_stock import ModelStock
    from cvl.methods.opcm import linear_weights, opcm_step
    from cvl.methods.ties import ties_merge, trim_top_k
    from cvl.train import fsdp

    whole, sharded = _models()
    assert any(fsdp.is_dtensor(p) for p in sharded.parameters())
    w, s = floating_state(whole), floating_state(sharded)  # θ, sharded alike
    _same(s, w, "floating_state")
    g = torch.Generator().manual_seed(1)
    tw = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in w.items()}  # a task vector
    tw["clip.visual.ln_pre.bias"][:3] = 0.0  # exact zeros and ties in the ranking
    ts = {k: fsdp.reshard_like(v, s[k]) for k, v in tw.items()}
    _same(ts, tw, "reshard_like")
    # the global k-th value (TIES's threshold): every k class, zeros and a 0-d tensor included
    absw, abss = [v.abs() for v in tw.values()], [v.abs() for v in ts.values()]
    flat = torch.cat([v.flatten() for v in absw])
    for k in (1, 2, 7, flat.numel() // 3, flat.numel() - 1, flat.numel()):
        assert torch.equal(global_kthvalue(abss, k), flat.kthvalue(k).values), k
    _same(trim_top_k(ts, 0.2), trim_top_k(tw, 0.2), "trim_top_k")
    tw2 = {k: v.flip(0) if v.dim() else -v for k, v in tw.items()}
    ts2 = {k: fsdp.reshard_like(v, s[k]) for k, v in tw2.items()}
    _same(ties_merge([ts, ts2]), ties_merge([tw, tw2]), "ties_merge")
    _same(merge_ops.breadcrumbs(ts, 0.2, 0.1), merge_ops.breadcrumbs(tw, 0.2, 0.1), "breadcrumbs")
    ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    _same(merge_ops.dare(ts, 0.5, ga), merge_ops.dare(tw, 0.5, gb), "dare")
    _same(merge_ops.max_abs([ts, ts2]), merge_ops.max_abs([tw, tw2]), "max_abs")
    _same(merge_ops.consensus([ts, ts2], 0.4, 2), merge_ops.consensus([tw, tw2], 0.4, 2), "tall")
    for k in ("clip.visual.conv1.weight", "clip.logit_scale", "clip.ln_final.bias"):
        got = fsdp.full(merge_ops.slerp(s[k] + ts[k], s[k], 0.3))
        want = merge_ops.slerp(w[k] + tw[k], w[k], 0.3)
        assert torch.allclose(got, want, atol=1e-7, rtol=0), ("slerp", k)
    assert abs(float(merge_ops.vector_norm(ts)) - float(merge_ops.vector_norm(tw))) < 1e-9
    ms_s, ms_w = ModelStock({}), ModelStock({})
    for m, taus in ((ms_s, (ts, ts2)), (ms_w, (tw, tw2))):
        for t in taus:
            m.add(t)
    # the angles are sums over shards in another order: float32 rounding, 2 ulps of entries ~1
    _same(ms_s.merged(s), ms_w.merged(w), "model_stock", atol=1e-7, rtol=2.5e-7)
    lin = linear_weights(whole)
    _same(opcm_step(ts, ts2, 1.3, 0.5, lin), opcm_step(tw, tw2, 1.3, 0.5, lin), "opcm", 1e-6)
    # gradients: the norm and the clipping, over sharded and whole (the logit scale) tensors
    imgs, toks = torch.randn(4, 3, 32, 32), whole.tokenizer([f"item {i}" for i in range(4)])
    r, n = dist.get_rank(), dist.get_world_size()
    for m in (whole, sharded):
        o = m(imgs, toks)
        loss = clip_loss(o["image_features"], o["text_features"], o["logit_scale"])
        loss.backward()
    # FSDP averaged the shards' gradients over the ranks (the same batch on every rank: the
    # same gradient); the whole model's are this rank's own, equal to that average
    ps, pw = list(sharded.parameters()), list(whole.parameters())
    for a, b in zip(ps, pw):
        assert torch.allclose(fsdp.full(a.grad), b.grad, atol=1e-6, rtol=0)
    norms = fsdp.tensor_norms([p.grad for p in ps])
    want = torch.stack(torch._foreach_norm([p.grad for p in pw]))
    assert torch.allclose(norms, want, rtol=1e-5)
    total = fsdp.clip_grad_norm_(ps, 0.5)
    total_w = torch.nn.utils.clip_grad_norm_(pw, 0.5)
    assert torch.allclose(total, total_w, rtol=1e-5)
    for a, b in zip(ps, pw):
        assert torch.allclose(fsdp.full(a.grad), b.grad, atol=1e-6, rtol=0)
    # a reduction's value is `plain`'s (a DTensor's float() would be this rank's part)
    x = s["clip.visual.conv1.weight"]
    assert abs(float(fsdp.plain(x.sum())) - float(w["clip.visual.conv1.weight"].sum())) < 1e-4
    # the optimizer state leaves whole and comes back in slices; the weights likewise
    opt = torch.optim.AdamW(ps, lr=1e-3)
    opt.step()
    written = fsdp.optimizer_state_out(opt)  # the main process's, to write
    out = {"state": fsdp.to_full(opt.state_dict()["state"]), "param_groups": []}  # as read
    out["param_groups"] = written["param_groups"]
    opt_w = torch.optim.AdamW(pw, lr=1e-3)
    opt_w.step()
    for i, st in opt_w.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(out["state"][i][key], st[key], atol=1e-7, rtol=0), (i, key)
            if r == 0:
                assert torch.equal(written["state"][i][key], out["state"][i][key])
    dropped_here = any(v is None for st in written["state"].values() for v in st.values())
    assert dropped_here == (r != 0)  # only the main process holds the whole moments
    back = torch.optim.AdamW(ps, lr=1e-3)
    back.load_state_dict(fsdp.optimizer_state_in(back, out))
    for i, st in back.state_dict()["state"].items():
        assert torch.equal(fsdp.full(st["exp_avg"]), out["state"][i]["exp_avg"])
    state = fsdp.full_state(sharded)  # rank 0's
    dropped = set(fsdp.tied_names(sharded))
    if r == 0:
        assert set(state) == set(whole.state_dict()) - dropped
    with torch.no_grad():
        for p in sharded.parameters():
            fsdp.local(p).zero_()
    whole_sd = {k: v for k, v in whole.state_dict().items() if k not in dropped}
    assert fsdp.load_state_(sharded, whole_sd) == ([], [])
    _same(floating_state(sharded), floating_state(whole), "load_state_")
    nested = fsdp.reshard_state({"fisher": {k: v.clone() for k, v in tw.items()}, "n": 3}, sharded)
    _same(nested["fisher"], tw, "reshard_state")
    assert nested["n"] == 3 and n > 1
