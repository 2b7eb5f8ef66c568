"""C-CLIP (CKC on hand-computed tensors, its projector, the α integration of the task's LoRA)
and the per-task LoRA kept separate (FoMo's average of the stored adapters, the task's own)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import FAST, train_run

from cvl.errors import CvlError
from cvl.methods.cclip import CCLIP, Projector, ckc_loss
from cvl.methods.lora_per_task import LoRAPerTask, average_adapters
from cvl.runs import finished_tasks
from cvl.train.checkpoint import load_state

SHORT = {**FAST, "max_steps_per_task": 2}


def _ce(logits: list[float], target: int) -> float:
    return -logits[target] + math.log(sum(math.exp(x) for x in logits))


def test_ckc_concat_by_hand():
    """h_i = n([h_img_i, h_txt_i]), z_i = n([z_img_i, z_txt_i]) (normalised after the
    concatenation), τ = 0.5, ½·(CE(h·zᵀ/τ) + CE(z·hᵀ/τ))."""
    h = (torch.tensor([[3.0], [0.0]]), torch.tensor([[4.0], [1.0]]))  # -> [.6, .8], [0, 1]
    z = (torch.tensor([[1.0], [1.0]]), torch.tensor([[0.0], [1.0]]))  # -> [1, 0], [r, r]
    r = 1 / math.sqrt(2)
    hz = [[0.6, 0.6 * r + 0.8 * r], [0.0, r]]  # h_i · z_j
    tau = 0.5
    h2z = (_ce([x / tau for x in hz[0]], 0) + _ce([x / tau for x in hz[1]], 1)) / 2
    zh = [[hz[0][0], hz[1][0]], [hz[0][1], hz[1][1]]]  # z_i · h_j
    z2h = (_ce([x / tau for x in zh[0]], 0) + _ce([x / tau for x in zh[1]], 1)) / 2
    got = ckc_loss(h, z, n_local=2, temp=tau, layout="concat")
    assert got.item() == pytest.approx((h2z + z2h) / 2, rel=1e-6)
    # each modality normalised before concatenating would weigh them equally: not the same
    hn = tuple(torch.nn.functional.normalize(x, dim=-1) for x in h)
    assert ckc_loss(hn, z, 2, tau).item() != pytest.approx(got.item(), rel=1e-3)


def test_ckc_stack_by_hand():
    """2N rows [images; texts], each normalised, row i's positive is the old model's row i."""
    h = (torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]]))
    z = (torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]]))
    r = 1 / math.sqrt(2)
    hz = [[r, 0.0], [r, 1.0]]  # rows h (image, text), columns z (image, text)
    h2z = (_ce(hz[0], 0) + _ce(hz[1], 1)) / 2
    zh = [[hz[0][0], hz[1][0]], [hz[0][1], hz[1][1]]]
    z2h = (_ce(zh[0], 0) + _ce(zh[1], 1)) / 2
    got = ckc_loss(h, z, n_local=1, temp=1.0, layout="stack")
    assert got.item() == pytest.approx((h2z + z2h) / 2, rel=1e-6)


def test_ckc_gradient_reaches_only_the_current_side():
    h = tuple(torch.randn(4, 3, requires_grad=True) for _ in range(2))
    z = tuple(torch.randn(4, 3, requires_grad=True) for _ in range(2))
    ckc_loss(h, z, 4, 0.07).backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in h)
    assert all(x.grad is None for x in z)


def test_projectors():
    g = torch.Generator().manual_seed(0)
    p = Projector("mlp", 8, 0)
    p.reset(g)
    assert [m.weight.shape for m in p.net if isinstance(m, torch.nn.Linear)] == [
        (16, 8),
        (8, 16),
    ]
    q = Projector("mlp", 8, 0)
    q.reset(torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(p.state_dict().values(), q.state_dict().values()))
    lin = Projector("linear", 4, 0)
    lin.reset(g)
    x = torch.randn(3, 4)
    assert torch.equal(lin(x, "image"), x) and torch.equal(lin(x, "text"), x)
    with pytest.raises(CvlError, match="layout must be"):
        CCLIP({"layout": "rows"})


@pytest.mark.slow
def test_alpha_integrates_half_the_task_delta(synth_stream, tmp_path):
    """θ^0 = θ_init + α·ΔW: the same training with α = 0.5 moves the LoRA-adapted weights half
    as far as with α = 1 (only the merge differs); the embeddings, which C-CLIP trains directly
    (the paper: most trainable parameters are embedding layers), move and are the same in both
    (not scaled by α); the projector is method state, not in the model."""
    for a in (0.5, 1.0):
        train_run(
            synth_stream,
            tmp_path / str(a),
            {**SHORT, "max_steps_per_task": 2},
            method="cclip",
            tune="lora",
            method_args={"alpha": a},
        )
    init = load_file(str(tmp_path / "0.5" / "init" / "model.safetensors"))
    half, full = (
        load_file(str(finished_tasks(tmp_path / str(a))[0].model_path)) for a in (0.5, 1.0)
    )
    emb = {k for k in init if "embedding" in k}  # the tiny ResNet CLIP: its attention pool's
    assert {"clip.token_embedding.weight", "clip.visual.attnpool.positional_embedding"} <= emb
    moved = [k for k in init if not torch.equal(init[k], full[k])]
    assert emb <= set(moved) and set(half) == set(init)
    assert "clip.logit_scale" not in moved  # frozen, as KoyoImai
    for k in emb:
        assert torch.equal(half[k], full[k]), k
    for k in set(moved) - emb:
        assert torch.allclose(half[k] - init[k], 0.5 * (full[k] - init[k]), atol=1e-6), k
    st = load_state(finished_tasks(tmp_path / "0.5")[0].path, "method_state")["method"]
    assert "net.1.running_mean" in st["projector"]  # BatchNorm statistics saved too


def test_cclip_trains_the_embeddings_of_a_vit_beside_its_lora():
    """On a ViT CLIP: token, positional (both towers) and class embeddings train; the logit
    scale and the other plain weights stay frozen (only their adapters train)."""
    from cvl.models import build_model
    from cvl.models.tune import Tuning

    model = build_model("clip", "tiny-vit")
    Tuning("lora").apply(model, 0, CCLIP().tune_also)
    plain = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert plain == {
        "clip.token_embedding.weight",
        "clip.positional_embedding",
        "clip.visual.class_embedding",
        "clip.visual.positional_embedding",
    }


def test_cclip_embeddings_false_trains_the_lora_alone(synth_stream, tmp_path):
    run = tmp_path / "r"
    train_run(
        synth_stream, run, SHORT, method="cclip", tune="lora", method_args={"embeddings": False}
    )
    init = load_file(str(run / "init" / "model.safetensors"))
    w = load_file(str(finished_tasks(run)[0].model_path))
    assert all(torch.equal(w[k], init[k]) for k in w if "embedding" in k)
    assert any(not torch.equal(w[k], init[k]) for k in w)


def test_cclip_logit_scale_option_trains_it_as_koyoimai_now_does(synth_stream, tmp_path):
    """`logit_scale=true` (KoyoImai's code since 2026-03-05): the logit scale trains beside
    the embeddings and the LoRA, directly (θ^0 keeps its trained value, not scaled by α); the
    default keeps it frozen (test_alpha_integrates_half_the_task_delta); a model without a
    logit scale parameter (fusion: fixed 0.07) is refused in one line."""
    from cvl.models import build_model
    from cvl.models.tune import Tuning

    model = build_model("clip", "tiny-vit")
    Tuning("lora").apply(model, 0, CCLIP({"logit_scale": True}).tune_also)
    plain = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert "clip.logit_scale" in plain and "clip.text_projection" not in plain
    run = tmp_path / "r"
    train_run(
        synth_stream, run, SHORT, method="cclip", tune="lora", method_args={"logit_scale": True}
    )
    init = load_file(str(run / "init" / "model.safetensors"))["clip.logit_scale"]
    after = load_file(str(finished_tasks(run)[0].model_path))["clip.logit_scale"]
    assert not torch.equal(init, after)
    with pytest.raises(CvlError, match="logit_scale=true .* has none to train"):
        CCLIP({"logit_scale": True}).setup(
            SimpleNamespace(model=build_model("fusion", "tiny"), config=SimpleNamespace(seed=0))
        )


def test_cclip_needs_an_adapter_mode(synth_stream, tmp_path):
    from cvl.train.config import resolve
    from cvl.train.loop import Trainer

    cfg = resolve(None, {"stream": str(synth_stream), "out": str(tmp_path / "x"), **SHORT})
    cfg.method = "cclip"
    with pytest.raises(CvlError, match="method 'cclip' needs --tune lora or vera"):
        Trainer(cfg, progress=False)
    cfg.method, cfg.method_args = "lora_per_task", {"base": "ewc"}
    with pytest.raises(CvlError, match="method 'lora_per_task' needs --tune lora or dora or vera"):
        Trainer(cfg, progress=False)
    assert LoRAPerTask({"base": "cclip"}).tunes == ("lora", "vera")  # both methods' modes


def test_average_adapters_averages_factors_not_deltas():
    a1 = {"A": torch.tensor([[1.0, 0.0]]), "B": torch.tensor([[2.0]])}
    a2 = {"A": torch.tensor([[0.0, 1.0]]), "B": torch.tensor([[4.0]])}
    avg = average_adapters([a1, a2])
    assert torch.equal(avg["A"], torch.tensor([[0.5, 0.5]])) and torch.equal(
        avg["B"], torch.tensor([[3.0]])
    )
    # B̄·Ā = [[1.5, 1.5]], while the mean of the deltas B_k·A_k is [[1, 2]]
    assert torch.equal(avg["B"] @ avg["A"], torch.tensor([[1.5, 1.5]]))


def _delta(adapters: dict, plain: str, scale: float = 1.0) -> torch.Tensor:
    """s·B·A, or FoMo's `LoRA_MHA`: s·cat_i(B_i·A_i) over the q/k/v row blocks."""
    mod, _, t = plain.rpartition(".")
    pre = f"{mod}.parametrizations.{t}.0."
    a, b = adapters[pre + "lora_A"], adapters[pre + "lora_B"]
    r = b.shape[1]
    p = a.shape[0] // r
    o = b.shape[0] // p
    return scale * torch.cat([b[i * o : (i + 1) * o] @ a[i * r : (i + 1) * r] for i in range(p)])


def test_split_adapter_by_hand():
    """parts = 3, rank 1, W 6×2: ΔW = s·[B_1·A_1; B_2·A_2; B_3·A_3] (FoMo's LoRA_MHA), rank 3."""
    from cvl.models.adapters import Adapter

    w = torch.zeros(6, 2)
    a = Adapter(w, rank=1, alpha=2.0, dora=False, parts=3)
    assert a.lora_A.shape == (3, 2) and a.lora_B.shape == (6, 1)
    with torch.no_grad():
        a.lora_A.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        a.lora_B.copy_(torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]]))
    want = 2.0 * torch.tensor([[1.0, 0], [2, 0], [0, 3], [0, 4], [5, 5], [6, 6]])
    assert torch.equal(a(w), want)
    assert int(torch.linalg.matrix_rank(want)) == 2  # > r = 1 (rows 5–6 ∈ span of the others)


def test_lora_per_task_builds_fomos_lora_structure():
    """structure=fomo (default): in every residual block of both towers, q/k/v get their own
    rank-5 factors (the in-projection delta reaches rank 15 > 5), the MLP's c_proj a rank-5
    LoRA; c_fc and the out-projection get none (FoMo's `_attach_adapters`; config rank 5,
    scale 1, kv_only False). structure=tune keeps cvl's fused factors on every linear weight."""
    from cvl.models import build_model
    from cvl.models.tune import Tuning, adapted, with_defaults

    def build(method, mode="lora"):
        model = build_model("clip", "tiny-vit")
        Tuning(mode, with_defaults(mode, method.tune_defaults, {})).apply(model, 0)
        return model, {n: mod for n, mod, _ in adapted(model)}

    model, ad = build(LoRAPerTask())
    blocks = [n for n, _ in model.named_modules() if n.endswith("resblocks.0")]
    assert len(blocks) == 2  # both towers
    assert all(n.endswith(("attn.in_proj_weight", "mlp.c_proj.weight")) for n in ad), list(ad)
    n_blocks = sum(1 for n, _ in model.named_modules() if re_block(n))
    assert len(ad) == 2 * n_blocks
    name = next(n for n in ad if n.endswith("in_proj_weight"))
    mod = ad[name]
    a = mod.parametrizations.in_proj_weight[0]
    d = mod.in_proj_weight.shape[1]
    assert a.lora_A.shape == (15, d) and a.lora_B.shape == (3 * d, 5) and a.scale == 1.0
    with torch.no_grad():
        a.lora_B.normal_(generator=torch.Generator().manual_seed(0))
    delta = a(torch.zeros_like(mod.parametrizations.in_proj_weight.original))  # ΔW alone
    assert int(torch.linalg.matrix_rank(delta.detach(), rtol=1e-4)) == 15  # float32 products
    _, ad_vera = build(LoRAPerTask(), "vera")  # FoMo's targets; VeRA's own rank (256)
    assert set(ad_vera) == set(ad)
    _, ad_tune = build(LoRAPerTask({"structure": "tune"}))
    assert any(n.endswith("c_fc.weight") for n in ad_tune)
    assert any(n.endswith("out_proj.weight") for n in ad_tune)


def re_block(name: str) -> bool:
    import re

    return re.search(r"resblocks\.\d+$", name) is not None


@pytest.mark.slow
@pytest.mark.parametrize("route", ["average", "task"])
def test_lora_per_task_deploys_the_route_on_the_start(synth_stream, tmp_path, route):
    """Every task trains from θ_0 (not from the deployed weights) and stores its adapter; the
    checkpoint after task t is θ_0 + ΔW(mean of the stored factors) or θ_0 + ΔW_t."""
    run = tmp_path / route
    train_run(
        synth_stream, run, SHORT, method="lora_per_task", tune="lora", method_args={"route": route}
    )
    init = load_file(str(run / "init" / "model.safetensors"))
    tasks = finished_tasks(run)
    st = load_state(tasks[-1].path, "method_state")["method"]["stored"]
    stored = [st[str(i)] for i in range(len(st))]
    assert len(stored) == len(tasks) >= 2
    assert not torch.equal(stored[0][next(iter(stored[0]))], stored[1][next(iter(stored[1]))])
    for t, c in enumerate(tasks):
        w = load_file(str(c.model_path))
        own = average_adapters(stored[: t + 1]) if route == "average" else stored[t]
        names = {
            k.split(".parametrizations.")[0] + "." + k.split(".parametrizations.")[1].split(".")[0]
            for k in own
        }
        for n in names:
            assert torch.allclose(w[n], init[n] + _delta(own, n), atol=1e-6), (t, n)
        assert all(torch.equal(w[k], init[k]) for k in w if k not in names)
