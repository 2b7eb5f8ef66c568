"""`--tune vera`: VeRA's weights by hand, against peft's reference implementation on nn.Linear
layers of different shapes (the shared frozen pair, its slicing, d and b), the integration
coefficient (`scale_adapters_`), merged equals un-merged, and a run that resumes exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from train_helpers import FAST, assert_same_task_weights, interrupt_then_resume, train_run

from cvl.errors import CvlError
from cvl.methods.seqft import SeqFT
from cvl.models import build_model
from cvl.models.tune import (
    Tuning,
    VeraAdapter,
    VeraProjections,
    adapted,
    adapter_tensors,
    load_adapter_tensors,
    merge_adapters,
    plain_copy,
    scale_adapters_,
)


def test_vera_weight_by_hand():
    """W' = W + diag(b)·B·diag(d)·A with the top-left blocks of the shared pair."""
    lin = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    shared = VeraProjections(rank=2, out=3, fan_in=3, seed=0)
    shared.A = torch.tensor([[1.0, 0.0, 9.0], [0.0, 2.0, 9.0]])  # column 2 is outside the block
    shared.B = torch.tensor([[1.0, 1.0], [0.0, -1.0], [9.0, 9.0]])  # row 2 likewise
    a = VeraAdapter(lin.weight, shared, d_initial=0.1)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", a)
    assert torch.equal(lin.weight, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # b = 0: no delta
    with torch.no_grad():
        a.vera_lambda_d.copy_(torch.tensor([2.0, 3.0]))
        a.vera_lambda_b.copy_(torch.tensor([0.5, -1.0]))
    # diag(d)·A = [[2, 0], [0, 6]]; diag(b)·B = [[0.5, 0.5], [0, 1]] -> ΔW = [[1, 3], [0, 6]]
    want = torch.tensor([[2.0, 5.0], [3.0, 10.0]])
    assert torch.allclose(lin.weight, want)
    a.scale_(0.5)  # C-CLIP's α: the delta halves (b halves)
    assert torch.allclose(lin.weight, torch.tensor([[1.5, 3.5], [3.0, 7.0]]))


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 7)
        self.down = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_vera_matches_peft_on_linear_layers():
    """Same frozen A and B as peft (seeded, largest shape, sliced per layer), and with the
    same d and b the same function; peft's merged weight is cvl's parametrised weight."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    ref = _TwoLayers()
    mine = _TwoLayers()
    mine.load_state_dict(ref.state_dict())
    cfg = peft.VeraConfig(r=4, target_modules=["up", "down"], projection_prng_key=3)
    pm = peft.get_peft_model(ref, cfg)
    Tuning("vera", {"rank": 4, "projection_seed": 3}).apply(mine, seed=0)
    shared = next(p.shared for _, m, t in adapted(mine) for p in m.parametrizations[t])
    assert torch.equal(shared.A, pm.base_model.vera_A["default"])
    assert torch.equal(shared.B, pm.base_model.vera_B["default"])
    layers = {"up": pm.base_model.model.up, "down": pm.base_model.model.down}
    x = torch.randn(6, 5)
    assert torch.allclose(pm(x), mine(x), atol=1e-6)  # fresh: b = 0, the base function
    with torch.no_grad():
        for name, layer in layers.items():
            d = torch.randn_like(layer.vera_lambda_d["default"])
            b = torch.randn_like(layer.vera_lambda_b["default"])
            layer.vera_lambda_d["default"].copy_(d)
            layer.vera_lambda_b["default"].copy_(b)
            a = getattr(mine, name).parametrizations.weight[0]
            assert torch.equal(a.vera_lambda_d, torch.full((4,), 0.1))  # peft's d_initial
            a.vera_lambda_d.copy_(d)
            a.vera_lambda_b.copy_(b)
    assert torch.allclose(pm(x), mine(x), atol=1e-5)
    for name, layer in layers.items():
        want = layer.base_layer.weight + layer.get_delta_weight("default")
        assert torch.allclose(getattr(mine, name).weight, want, atol=1e-6)


@pytest.mark.parametrize("config", ["tiny", "tiny-vit"])
def test_vera_merged_equals_unmerged_and_copies_share_one_pair(config):
    torch.manual_seed(0)
    model = build_model("clip", config)
    model.eval()
    base = plain_copy(model)
    x = torch.randn(2, 3, model.image_size, model.image_size)
    t = model.tokenizer(["a red circle", "a blue square"])
    tu = Tuning("vera")
    tu.apply(model, seed=1)
    assert tu.args["rank"] == 256
    assert torch.equal(model(x, t)["image_features"], base(x, t)["image_features"])
    shared = {id(p.shared) for _, m, n in adapted(model) for p in m.parametrizations[n]}
    assert len(shared) == 1
    with torch.no_grad():
        for k, v in adapter_tensors(model).items():
            v.copy_(torch.randn_like(v) * (0.05 if k.endswith("lambda_b") else 1.0))
    out = model(x, t)
    copy = plain_copy(model)(x, t)
    saved = {k: v.clone() for k, v in adapter_tensors(model).items()}
    merge_adapters(model)
    after = model(x, t)
    for k in ("image_features", "text_features"):
        assert not torch.allclose(out[k], base(x, t)[k], atol=1e-4)
        assert torch.allclose(copy[k], out[k], atol=1e-5)
        assert torch.allclose(after[k], out[k], atol=1e-5)
    load_adapter_tensors(model, saved)  # the same delta again, on the merged weights
    scale_adapters_(model, 0.0)
    assert torch.allclose(model(x, t)["image_features"], after["image_features"], atol=1e-6)


def test_vera_options():
    assert Tuning("vera", {"rank": 16}).args["rank"] == 16
    with pytest.raises(CvlError, match="alpha applies to --tune lora or dora, not 'vera'"):
        Tuning("vera", {"alpha": 2})
    with pytest.raises(CvlError, match="d_initial applies to --tune vera, not 'lora'"):
        Tuning("lora", {"d_initial": 0.5})
    s = Tuning("vera").summary()["args"]
    assert s == {
        "rank": 256,
        "targets": "linear",
        "bn_stats": "frozen",
        "d_initial": 0.1,
        "projection_seed": 0,
    }
    assert "alpha" in Tuning("lora").summary()["args"]


@pytest.mark.slow
def test_vera_resume_mid_task_is_exact(synth_stream, tmp_path, monkeypatch):
    """Interrupted at step 3 of task 1, resumed from last/: bit-identical task weights (the
    frozen pair is rebuilt from its seed, d and b come from tune.safetensors)."""
    cfg = {**FAST, "checkpoint_every": 2, "max_steps_per_task": 4}

    def train(out):
        train_run(synth_stream, out, cfg, method="seqft", tune="vera")

    train(tmp_path / "a")
    pos = interrupt_then_resume(train, SeqFT, tmp_path / "b", monkeypatch)
    assert (pos["task_index"], pos["step"]) == (1, 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")
