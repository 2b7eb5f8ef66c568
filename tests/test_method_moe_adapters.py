"""MoE-Adapters4CL: the noisy top-k gates, the mixture in a block, DDAS's selection and its
zero-shot fallback, what trains in task 2, and the deployed model that `cvl eval` rebuilds."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import FAST, assert_same_task_weights, interrupt_then_resume, train_run

from cvl.errors import CvlError
from cvl.methods import moe_layers as ml
from cvl.methods.moe_adapters import MoEAdapters, calibrated_threshold, freeze_most_chosen
from cvl.models import build_model, load_weights, model_from_config
from cvl.runs import MODEL_FILE, finished_tasks

SMALL = {"experts": 3, "bottleneck": 4}


def _model(config: str = "tiny-vit", tasks: int = 2, **args):
    torch.manual_seed(0)
    m = MoEAdapters({**SMALL, **args})
    return m, m.prepare_model(
        build_model("clip", config), SimpleNamespace(task_order=["a"] * tasks)
    )


def test_top_k_gates_by_hand():
    """k = 2 of 3 logits kept, softmax over those two (per row), 0 for the third."""
    clean = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    g = ml.top_k_gates(clean, 2)
    a = math.exp(3) / (math.exp(3) + math.exp(2))
    b = math.exp(5) / (math.exp(5) + 1.0)
    want = torch.tensor([[0.0, a, 1 - a], [1 - b, 0.0, b]])
    assert torch.allclose(g, want, atol=1e-6)
    assert torch.allclose(ml.top_k_gates(clean, 1), torch.tensor([[0.0, 1, 0], [0, 0, 1.0]]))
    # training: noise · std moves the logits before the top k (here expert 0 overtakes)
    noisy = ml.top_k_gates(clean[:1], 1, torch.tensor([[2.0, 1, 1]]), torch.tensor([[1.5, 0, 0]]))
    assert noisy.tolist() == [[1.0, 0.0, 0.0]]


def _moe_by_hand():
    spec = {**MoEAdapters.defaults, **SMALL, "tasks": 2, "experts": 2, "bottleneck": 1}
    spec.update(scale=0.5, dropout=0.0)
    m = ml.MoEAdapter(2, spec).eval()
    with torch.no_grad():
        m.w_gate[1].copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))  # task 1: logits (x0_0, 0)
        for e, ex in enumerate(m.experts):
            ex.down.weight.copy_(torch.tensor([[1.0, 1.0]]))  # h = relu(x_0 + x_1)
            ex.up.weight.copy_(torch.tensor([[1.0], [0.0]]) * (e + 1))  # expert e: (e+1)·h, 0
    return m


def test_mixture_output_by_hand():
    """y = Σ_e g_e(x₀)·s·up_e(relu(down_e(x))), every token of the row, gates from its first
    token; route −1 rows get 0 (the zero-shot block)."""
    m = _moe_by_hand()
    x = torch.tensor([[[math.log(3.0), 0.0], [1.0, 1.0]]])  # one row, two tokens
    m.routes = torch.tensor([1])
    y = m(x)
    g0, g1 = 3 / 4, 1 / 4  # softmax(log 3, 0): over the experts, not over the tokens
    h = torch.tensor([math.log(3.0), 2.0])  # relu(x_0 + x_1) per token
    want0 = 0.5 * (g0 * 1 + g1 * 2) * h
    assert torch.allclose(y[0, :, 0], want0, atol=1e-6)
    assert torch.all(y[0, :, 1] == 0)
    m.routes = torch.tensor([0])  # task 0's router is zero: both experts 1/2
    assert torch.allclose(m(x)[0, :, 0], 0.5 * 1.5 * h, atol=1e-6)
    m.routes = torch.tensor([-1])
    assert torch.all(m(x) == 0)


def test_block_adds_the_mixture_in_parallel_to_the_mlp():
    """x ← x + Attn(LN1 x); x ← x + MLP(LN2 x) + MoE(x): the mixture reads the residual stream
    (not LN2's output) and adds to it; with zero experts the block is the plain one."""
    _, model = _model()
    plain = build_model("clip", "tiny-vit")
    blk, ref = (
        model.clip.visual.transformer.resblocks[0],
        plain.clip.visual.transformer.resblocks[0],
    )
    ref.load_state_dict({k: v for k, v in blk.state_dict().items() if ".moe." not in f".{k}"})
    x = torch.randn(2, 5, blk.ln_2.normalized_shape[0])
    blk.moe.routes = torch.tensor([0, -1])
    assert torch.allclose(blk(x), ref(x), atol=1e-6)  # fresh experts add 0 (up = 0)
    with torch.no_grad():
        for ex in blk.moe.experts:
            ex.up.weight.normal_()
    blk.eval()
    mid = x + ref.ls_1(ref.attention(q_x=ref.ln_1(x)))
    assert torch.allclose(blk(x), ref(x) + blk.moe(mid), atol=1e-5)
    assert not torch.allclose(blk(x)[0], ref(x)[0])
    assert torch.allclose(blk(x)[1], ref(x)[1], atol=1e-6)  # route −1: the plain block


def test_ddas_selects_the_best_task_or_falls_back_to_zero_shot():
    err = torch.tensor([[0.10, 0.05, 0.30], [0.30, 0.40, 0.35], [0.20, 0.21, 0.19]])
    assert ml.select(err, 0.25).tolist() == [1, -1, 2]  # min 0.30 > 0.25: zero-shot
    assert ml.select(err, 0.0).tolist() == [1, 0, 2]  # no threshold: the argmin
    assert ml.select(err, 0.30).tolist() == [1, 0, 2]  # the code's rule: error > threshold
    assert calibrated_threshold(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), 1.0, 0.0) == 5.0
    assert calibrated_threshold(torch.tensor([1.0, 3.0]), 0.5, 7.0) == 7.0  # max over tasks
    assert calibrated_threshold(torch.tensor([1.0, 3.0]), 0.5, 0.0) == 2.0


def test_autoencoder_error_by_hand():
    ae = ml.Autoencoders(dim=4, code=1, tasks=1)
    with torch.no_grad():
        for p in ae.parameters():
            p.zero_()
    u = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # z = σ(√4·u) = (σ(2), ½, ½, ½); ẑ = ½
    want = (torch.sigmoid(torch.tensor(2.0)) - 0.5) ** 2 / 4
    assert ae.error(u, 0).item() == pytest.approx(want.item(), rel=1e-6)


def test_the_most_chosen_experts_freeze():
    counts = torch.tensor([5.0, 1.0, 9.0, 3.0])
    frozen = torch.tensor([False, True, False, False])
    assert freeze_most_chosen(counts, frozen, 2).tolist() == [True, True, True, False]
    assert freeze_most_chosen(counts, frozen, 0).tolist() == frozen.tolist()


def test_what_trains_in_task_two():
    """CLIP frozen; task 1's routers and autoencoders and the unfrozen experts train."""
    m, model = _model()
    layer = model.clip.visual.transformer.resblocks[0].moe
    layer.frozen[1] = True
    m.before_task(SimpleNamespace(model=model, task_index=1, resuming=False))
    train = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(".moe." not in n and not n.startswith("moe_state.") for n in train)
    assert "clip.visual.transformer.resblocks.0.moe.experts.1.up.weight" not in train
    assert "clip.visual.transformer.resblocks.0.moe.experts.0.up.weight" in train
    assert "moe_state.ddas.image.enc.1.weight" in train
    assert "moe_state.ddas.image.enc.0.weight" not in train
    assert "clip.transformer.resblocks.1.moe.w_gate.1" in train
    assert "clip.transformer.resblocks.1.moe.w_noise.1" in train
    assert "clip.transformer.resblocks.1.moe.w_gate.0" not in train
    assert model.moe_state.task == 1


def test_training_uses_the_task_router_and_counts_choices():
    m, model = _model()
    m.before_task(SimpleNamespace(model=model, task_index=1, resuming=False))
    with torch.no_grad():
        for layer in m._layers(model):
            layer.w_gate[0].normal_(std=100.0)  # another task's router: must not be used
    model.train()
    imgs = torch.randn(3, 3, model.image_size, model.image_size)
    model.encode_image(imgs)
    for layer in ml.moe_layers(model, "image"):  # zero router + small noise: k of E per row
        assert layer.pending.sum().item() == 3 * 2
    m.after_step(SimpleNamespace(model=model))
    assert all(layer.counts.sum() == 6 for layer in ml.moe_layers(model, "image"))


def test_deployed_model_routes_per_sample_and_rebuilds_from_config(tmp_path):
    """After task 0: DDAS routes to task 0 (threshold high) or the zero-shot model (threshold
    tiny); `model_from_config(model.config())` rebuilds the same layers and weights."""
    from cvl.models import save_weights

    _, model = _model()
    with torch.no_grad():
        for layer in ml.moe_layers(model, "image"):
            for ex in layer.experts:
                ex.up.weight.normal_()
    plain = build_model("clip", "tiny-vit")
    plain.load_state_dict(
        {k: v for k, v in model.state_dict().items() if ".moe." not in k and "moe_state" not in k}
    )
    model.eval()
    imgs = torch.randn(4, 3, model.image_size, model.image_size)
    st = model.moe_state
    st.done.fill_(1)
    st.ddas["image"].threshold.fill_(1e9)
    with ml.routed(model, "image", torch.zeros(4, dtype=torch.long)):
        routed0 = type(model).__mro__[1].encode_image(model, imgs)
    assert torch.allclose(model.encode_image(imgs), routed0, atol=1e-6)
    assert not torch.allclose(routed0, plain.encode_image(imgs), atol=1e-4)
    st.ddas["image"].threshold.fill_(1e-12)
    assert torch.allclose(model.encode_image(imgs), plain.encode_image(imgs), atol=1e-6)
    save_weights(model, tmp_path / MODEL_FILE)
    cfg = model.config()
    assert cfg[ml.CONFIG_KEY]["experts"] == 3
    again = model_from_config(cfg)
    load_weights(again, tmp_path / MODEL_FILE)
    again.eval()
    assert torch.equal(again.encode_image(imgs), model.encode_image(imgs))


def test_refusals(synth_stream, tmp_path):
    with pytest.raises(CvlError, match="top_k"):
        MoEAdapters({"experts": 2, "top_k": 3})
    with pytest.raises(CvlError, match="towers"):
        MoEAdapters({"towers": "fusion"})
    with pytest.raises(CvlError, match="ResNet"):
        _model("tiny", towers="image")
    with pytest.raises(CvlError, match="grad-checkpointing"):
        _train(synth_stream, tmp_path / "g", 1, model_config="tiny-vit", grad_checkpointing=True)
    with pytest.raises(CvlError, match="--tune full"):
        train_run(synth_stream, tmp_path / "x", FAST, method="moe_adapters", tune="lora")


def _train(stream, run, steps: int, **kw) -> None:
    over = {"method_args": SMALL, **kw}
    train_run(stream, run, {**FAST, "max_steps_per_task": steps}, method="moe_adapters", **over)


def test_trains_and_freezes_through_the_loop(synth_stream, tmp_path):
    """Three tasks on the tiny ViT: CLIP's weights never change, the routers of later tasks
    are still zero after task 0, experts frozen after a task keep their weights."""
    run = tmp_path / "r"
    _train(synth_stream, run, 3, model_config="tiny-vit", method_args={**SMALL, "freeze_top": 1})
    done = finished_tasks(run)
    w = [load_file(str(d.model_path)) for d in done]
    init = load_file(str(run / "init" / MODEL_FILE))
    for k, v in init.items():
        if ".moe." not in k and not k.startswith("moe_state"):
            assert all(torch.equal(v, x[k]) for x in w), k
    gate = "clip.visual.transformer.resblocks.0.moe.w_gate"
    assert w[0][f"{gate}.0"].abs().sum() > 0
    assert all(torch.all(w[0][f"{gate}.{t}"] == 0) for t in (1, 2))
    assert int(w[-1]["moe_state.done"]) == len(done)
    fr = "clip.visual.transformer.resblocks.0.moe.frozen"
    assert int(w[0][fr].sum()) == 1
    e = int(w[0][fr].nonzero()[0, 0])
    up = f"clip.visual.transformer.resblocks.0.moe.experts.{e}.up.weight"
    assert torch.equal(w[0][up], w[-1][up])
    assert all(float(x["moe_state.ddas.image.threshold"]) > 0 for x in w)


def test_finished_routers_do_not_move_under_weight_decay(synth_stream, tmp_path):
    """The code keeps one router per task (`router_list[task_id]`): in task 1 AdamW's decay
    (0.1 here) must leave task 0's router exactly as task 0 left it (a stacked parameter
    shrank it by lr·wd per step), while task 1's own router trains."""
    run = tmp_path / "r"
    _train(synth_stream, run, 2, model_config="tiny-vit", weight_decay=0.1, lr=5e-4)
    w = [load_file(str(d.model_path)) for d in finished_tasks(run)]
    for tower in ("clip.visual.transformer", "clip.transformer"):
        for name in ("w_gate", "w_noise"):
            k = f"{tower}.resblocks.0.moe.{name}"
            assert w[0][f"{k}.0"].abs().sum() > 0
            assert torch.equal(w[1][f"{k}.0"], w[0][f"{k}.0"]), k
            assert torch.equal(w[2][f"{k}.0"], w[0][f"{k}.0"]), k
            assert torch.equal(w[2][f"{k}.1"], w[1][f"{k}.1"]), k
    assert w[1]["clip.transformer.resblocks.0.moe.w_gate.1"].abs().sum() > 0


def test_a_stacked_router_checkpoint_loads_per_task():
    """Weights saved when the routers were one [T, d, E] tensor load row by row."""
    spec = {**MoEAdapters.defaults, **SMALL, "tasks": 2}
    m = ml.MoEAdapter(4, spec)
    old = {k: v for k, v in m.state_dict().items() if not k.startswith("w_")}
    gate, noise = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    m.load_state_dict({**old, "w_gate": gate, "w_noise": noise})
    assert torch.equal(m.w_gate[1], gate[1]) and torch.equal(m.w_noise[0], noise[0])


def test_resume_inside_task_two_is_bitwise_on_both_towers(synth_stream, tmp_path, monkeypatch):
    """Interrupted in step 3 of task 1 (resumed from step 2) (counts, frozen experts, thresholds and routers in
    the checkpoint), the resumed run saves the same weights as an uninterrupted one."""
    kw = dict(
        method="moe_adapters",
        model_config="tiny-vit",
        method_args=SMALL,
        checkpoint_every=1,
        max_steps_per_task=4,
    )

    def train(out):
        train_run(synth_stream, out, FAST, **kw)

    train(tmp_path / "a")
    pos = interrupt_then_resume(train, MoEAdapters, tmp_path / "b", monkeypatch, task=1)
    assert pos["step"] == 2
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")


def test_resnet_tower_keeps_its_batchnorm_statistics(synth_stream, tmp_path):
    """On the ResNet `tiny` (text tower adapted) every CLIP tensor — BatchNorm running
    statistics included — stays the start's, so route −1 is exactly the zero-shot model."""
    run = tmp_path / "r"
    _train(synth_stream, run, 2)
    init = load_file(str(run / "init" / MODEL_FILE))
    last = load_file(str(finished_tasks(run)[-1].model_path))
    assert any("running_mean" in k for k in init)
    for k, v in init.items():
        if ".moe." not in k and not k.startswith("moe_state"):
            assert torch.equal(v, last[k]), k
    assert not any(k.startswith("clip.visual") and ".moe." in k for k in last)


def test_the_fusion_model_is_refused_in_one_line():
    """MoE-Adapters adapts open_clip's blocks; the fusion model (ViT + BERT) has none: one
    line, not an AttributeError from inside prepare_model."""
    from cvl.errors import CvlError
    from cvl.methods.registry import get_method
    from cvl.models import build_model

    with pytest.raises(CvlError, match="use --model clip"):
        get_method("moe_adapters")({}).prepare_model(build_model("fusion", "tiny"), None)
