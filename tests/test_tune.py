"""`--tune`: which parameters train (counted on the saved weights), LoRA / DoRA by hand, merged
equals un-merged, plain checkpoints, exact resume, what methods and the optimizer see."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from train_helpers import FAST, assert_same_task_weights, interrupt_then_resume, train_run

from cvl.errors import CvlError
from cvl.methods.seqft import SeqFT
from cvl.models import build_model, load_weights, model_from_config, save_weights
from cvl.models.tune import (
    Adapter,
    Tuning,
    adapted,
    effective_state,
    has_adapters,
    merge_adapters,
    plain_copy,
)
from cvl.runs import finished_tasks

SHORT = {**FAST, "max_steps_per_task": 2}


def _init_and_task0(run):
    init = load_file(str(run / "init" / "model.safetensors"))
    t0 = load_file(str(finished_tasks(run)[0].model_path))
    return init, t0


def _changed(a: dict, b: dict) -> set[str]:
    assert a.keys() == b.keys()
    return {k: None for k in a if not torch.equal(a[k], b[k])}.keys()


def _expected(model: nn.Module, mode: str) -> set[str]:
    """Names a mode may change, written out from its definition (not from cvl.models.tune)."""
    norms = (nn.LayerNorm, nn.BatchNorm2d)
    out = set()
    for mn, m in model.named_modules():
        pre = f"{mn}." if mn else ""
        for pn, _ in m.named_parameters(recurse=False):
            n = pre + pn
            if (
                (mode == "bitfit" and pn.endswith("bias"))
                or (mode == "lnfit" and isinstance(m, norms))
                or (mode == "locked-image" and not n.startswith("clip.visual."))
                or (mode == "locked-text" and n.startswith(("clip.visual.", "clip.logit_scale")))
            ):
                out.add(n)
        if isinstance(m, nn.BatchNorm2d):  # statistics update with the layer's own parameters
            if (
                mode in ("bitfit", "lnfit")
                or (mode == "locked-text" and pre.startswith("clip.visual."))
                or (mode == "locked-image" and not pre.startswith("clip.visual."))
            ):
                out |= {pre + "running_mean", pre + "running_var", pre + "num_batches_tracked"}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bitfit", "lnfit", "locked-image", "locked-text", "lora", "dora"])
def test_each_mode_trains_only_what_it_names(synth_stream, tmp_path, mode):
    """After a task, the changed tensors of the saved (plain) weights are the mode's, and the
    mode does train (ResNet tower: frozen BatchNorm layers keep their statistics)."""
    run = tmp_path / mode
    train_run(synth_stream, run, SHORT, method="seqft", tune=mode)
    init, t0 = _init_and_task0(run)
    changed = set(_changed(init, t0))
    model = build_model("clip", "tiny")
    if mode in ("lora", "dora"):  # the adapted weights: every nn.Linear / in-projection
        lin = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        lin |= {n for n, _ in model.named_parameters() if n.endswith("in_proj_weight")}
        assert changed == lin
    else:
        expected = _expected(model, mode)
        assert changed and changed <= expected, sorted(changed - expected)[:5]
    if mode in ("bitfit", "lnfit"):  # nothing else moved: not the logit scale, not a weight
        assert "clip.logit_scale" not in changed
    rj = json.loads((run / "run.json").read_text())
    tj = json.loads((finished_tasks(run)[0].path / "task.json").read_text())
    assert rj["tuning"]["mode"] == mode
    assert tj["trainable_params"] == rj["tuning"]["trainable_params"]
    assert 0 < rj["tuning"]["trainable_share"] < 1


def test_full_changes_every_weight_and_counts_all(synth_stream, tmp_path):
    train_run(synth_stream, tmp_path / "f", SHORT, method="seqft")
    init, t0 = _init_and_task0(tmp_path / "f")
    params = {n for n, _ in build_model("clip", "tiny").named_parameters()}
    assert params <= set(_changed(init, t0))
    rj = json.loads((tmp_path / "f" / "run.json").read_text())
    assert rj["tuning"]["trainable_params"] == rj["tuning"]["total_params"]


def _hand_linear() -> nn.Linear:
    lin = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 4.0]]))
    return lin


def test_lora_and_dora_weights_by_hand():
    """rank 1, α = 2 (scale 2): W' = W + 2·B·A; DoRA: W' = m ⊙ V/‖V‖ per output row."""
    for dora in (False, True):
        lin = _hand_linear()
        a = Adapter(lin.weight, rank=1, alpha=2.0, dora=dora)
        torch.nn.utils.parametrize.register_parametrization(lin, "weight", a)
        with torch.no_grad():
            a.lora_A.copy_(torch.tensor([[1.0, 1.0, 0.0]]))
            a.lora_B.copy_(torch.tensor([[0.5], [-1.0]]))
        # V = W + 2·[[0.5, 0.5, 0], [-1, -1, 0]] = [[2, 1, 2], [-2, 1, 4]]
        v = torch.tensor([[2.0, 1.0, 2.0], [-2.0, 1.0, 4.0]])
        if not dora:
            assert torch.equal(lin.weight, v)
        else:
            # m = ‖W rows‖ = (√5, 5); ‖V rows‖ = (3, √21)
            assert a.magnitude.tolist() == pytest.approx([math.sqrt(5), 5.0])
            want = torch.stack([v[0] * math.sqrt(5) / 3, v[1] * 5 / math.sqrt(21)])
            assert torch.allclose(lin.weight, want, atol=1e-6)
            with torch.no_grad():
                a.magnitude.copy_(torch.tensor([3.0, 1.0]))
            want = torch.stack([v[0], v[1] / math.sqrt(21)])
            assert torch.allclose(lin.weight, want, atol=1e-6)
        x = torch.tensor([[1.0, 2.0, 3.0]])
        y = lin(x)
        merge_adapters(lin)
        assert torch.allclose(lin.weight, lin.parametrizations.weight.original, atol=0)
        assert torch.allclose(lin(x), y, atol=1e-6)  # merged computes the same


@pytest.mark.parametrize("config", ["tiny", "tiny-vit"])
@pytest.mark.parametrize("mode", ["lora", "dora"])
def test_merged_equals_unmerged_forward(config, mode):
    """A trained-looking adapter (random A, B, m): the adapted model, its plain merged copy and
    the model after merging compute the same; a fresh adapter computes the weights exactly."""
    torch.manual_seed(0)
    model = build_model("clip", config)
    model.eval()
    base = plain_copy(model)
    x = torch.randn(3, 3, model.image_size, model.image_size)
    t = model.tokenizer(["a red circle", "a blue square", "small green star"])
    Tuning(mode).apply(model, seed=1)
    # gradients on: nn.MultiheadAttention's inference fast path (taken or not depending on
    # which weights require gradients) would differ in the last bits
    want = base(x, t)
    fresh = model(x, t)
    assert torch.equal(fresh["image_features"], want["image_features"])
    assert torch.equal(fresh["text_features"], want["text_features"])
    with torch.no_grad():
        for _, m, name in adapted(model):
            for a in m.parametrizations[name]:
                a.lora_B.normal_(0, 0.05)
                if a.dora:
                    a.magnitude.mul_(1.1)
    adapted_out = model(x, t)
    merged_copy = plain_copy(model)(x, t)
    merge_adapters(model)
    after = model(x, t)
    for k in ("image_features", "text_features"):
        assert not torch.allclose(adapted_out[k], fresh[k], atol=1e-4)  # the adapter acts
        assert torch.allclose(merged_copy[k], adapted_out[k], atol=1e-5)
        assert torch.allclose(after[k], adapted_out[k], atol=1e-5)


def test_adapters_reach_fused_and_directly_read_weights():
    """open_clip's fused in_proj_weight (ViT, text) and the ResNet attention pool's q/k/v,
    which it passes to F.multi_head_attention_forward itself (peft misses the latter:
    tests/test_tune_peft.py)."""
    model = build_model("clip", "tiny")
    Tuning("lora").apply(model, seed=0)
    names = {n for n, _, _ in adapted(model)}
    assert "clip.transformer.resblocks.0.attn.in_proj_weight" in names
    assert "clip.visual.attnpool.q_proj.weight" in names
    for _, m, name in adapted(model):
        for a in m.parametrizations[name]:
            with torch.no_grad():
                a.lora_B.fill_(0.1)
    img = torch.randn(2, 3, model.image_size, model.image_size)
    before = plain_copy(model)
    merge_adapters(model)  # no-op check below: the forward already used the adapters
    with torch.no_grad():
        assert torch.allclose(model.encode_image(img), before.encode_image(img), atol=1e-5)


def test_fusion_model_towers_and_tied_decoder():
    model = build_model("fusion", "tiny")
    Tuning("lora").apply(model, seed=0)
    names = {n for n, _, _ in adapted(model)}
    assert "visual_encoder.blocks.0.attn.qkv.weight" in names
    assert "text_encoder.bert.encoder.layer.0.attention.self.query.weight" in names
    assert "text_encoder.cls.predictions.decoder.weight" not in names  # tied to the embeddings
    m2 = build_model("fusion", "tiny")
    Tuning("locked-text").apply(m2, seed=0)
    train = {n for n, p in m2.named_parameters() if p.requires_grad}
    assert any(n.startswith("visual_encoder.") for n in train)
    assert not any(n.startswith("text_encoder.bert.embeddings.") for n in train)
    fusion_layer = f"text_encoder.bert.encoder.layer.{m2.text_layers}."
    assert any(n.startswith(fusion_layer) for n in train)  # the fusion layers still train


def test_saved_weights_are_plain_and_load_back(tmp_path):
    """An adapted model saves its merged weights under the plain keys; a plain model loads
    them; loading into an adapted model makes it compute them (zero delta)."""
    torch.manual_seed(0)
    model = build_model("fusion", "tiny")  # has a tied pair
    Tuning("dora").apply(model, seed=0)
    for _, m, name in adapted(model):
        for a in m.parametrizations[name]:
            with torch.no_grad():
                a.lora_B.normal_(0, 0.05)
    save_weights(model, tmp_path / "m.safetensors")
    sd = load_file(str(tmp_path / "m.safetensors"))
    plain = model_from_config(model.config())
    assert set(sd) | {"text_encoder.cls.predictions.decoder.weight"} == set(plain.state_dict())
    load_weights(plain, tmp_path / "m.safetensors")
    eff = effective_state(model)
    assert all(torch.equal(plain.state_dict()[k], eff[k]) for k in sd)
    other = build_model("fusion", "tiny")
    Tuning("dora").apply(other, seed=3)
    load_weights(other, tmp_path / "m.safetensors")
    assert all(torch.equal(effective_state(other)[k], eff[k]) for k in sd)
    assert has_adapters(other)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "bitfit"])
def test_resume_mid_task_is_exact(synth_stream, tmp_path, monkeypatch, mode):
    """Interrupted at step 3 of task 1, resumed from last/ (step 2: weights + adapters):
    bit-identical task weights; last/ holds the plain model plus tune.safetensors."""
    cfg = {**FAST, "checkpoint_every": 2, "max_steps_per_task": 4}

    def train(out):
        train_run(synth_stream, out, cfg, method="seqft", tune=mode)

    train(tmp_path / "a")
    pos = interrupt_then_resume(train, SeqFT, tmp_path / "b", monkeypatch)
    assert (pos["task_index"], pos["step"]) == (1, 2)
    assert_same_task_weights(tmp_path / "a", tmp_path / "b")


def test_last_checkpoint_is_plain_with_adapter_state(synth_stream, tmp_path, monkeypatch):
    cfg = {**FAST, "checkpoint_every": 2, "max_steps_per_task": 4}
    real = SeqFT.after_step

    def boom(self, ctx):
        real(self, ctx)
        if ctx.task_index == 1 and ctx.step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(SeqFT, "after_step", boom)
    with pytest.raises(KeyboardInterrupt):
        train_run(synth_stream, tmp_path / "r", cfg, method="seqft", tune="lora")
    last = tmp_path / "r" / "last"
    plain = set(build_model("clip", "tiny").state_dict())
    assert set(load_file(str(last / "model.safetensors"))) == plain
    tune = load_file(str(last / "tune.safetensors"))
    assert any(k.endswith("lora_B") for k in tune) and any(k.endswith(".original") for k in tune)


def test_methods_and_optimizer_see_only_trained_parameters(synth_stream, tmp_path):
    """EWC's Fisher (method state) covers the biases under bitfit, the adapters under lora;
    the loop's optimizer holds exactly the trainable parameters."""
    from cvl.train.checkpoint import load_state
    from cvl.train.config import resolve
    from cvl.train.loop import Trainer

    for mode, suffix in (("bitfit", "bias"), ("lora", "lora_")):
        run = tmp_path / mode
        train_run(synth_stream, run, SHORT, method="ewc", tune=mode)
        st = load_state(finished_tasks(run)[0].path, "method_state")["method"]
        names = set(st["fisher"])
        assert names and all(suffix in n for n in names)
    cfg = resolve(None, {"stream": str(synth_stream), "out": str(tmp_path / "o"), **SHORT})
    cfg.tune = "lora"
    tr = Trainer(cfg, progress=False)
    params = tr._params()
    assert sum(p.numel() for p in params) == tr.tuning.trainable
    assert all("lora_" in n for n, p in tr.model.named_parameters() if p.requires_grad)


def test_options_and_errors(tmp_path, capsys):
    from cvl.cli import main
    from cvl.train.config import resolve

    with pytest.raises(CvlError, match="--tune must be one of"):
        Tuning("qlora")
    with pytest.raises(CvlError, match="unknown"):
        Tuning("lora", {"dropout": 0.1})
    with pytest.raises(CvlError, match="applies to --tune lora or dora or vera"):
        Tuning("bitfit", {"rank": 4})
    with pytest.raises(CvlError, match="matches no weight"):
        Tuning("lora", {"targets": "*nothing*"}).apply(build_model("clip", "tiny"), 0)
    y = tmp_path / "r.yaml"
    y.write_text("tune: lora\ntune_args: {rank: 4, alpha: 16}\n")
    cfg = resolve(str(y), {"stream": "s", "out": "o", "tune_args": {"rank": "2"}})
    assert cfg.tune == "lora" and cfg.tune_args == {"rank": 2, "alpha": 16.0}
    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--tune [full|lora|dora|vera|bitfit|lnfit|locked-image|locked-text]" in out
    assert "LoRA / DoRA / VeRA adapters" in out and "rank (8), alpha (8)" in out
    assert main(["train", "--stream", "s", "--out", "o", "--tune-arg", "x"]) == 2
    assert "--tune-arg 'x': expected NAME=VALUE" in capsys.readouterr().err


def test_info_shows_trainable_parameters(synth_stream, tmp_path):
    from cvl.info import describe_run

    train_run(synth_stream, tmp_path / "i", SHORT, method="seqft", tune="bitfit")
    lines = "\n".join(describe_run(tmp_path / "i"))
    assert "tune bitfit (bn_stats frozen): 3,520 of 513,885 parameters train (0.68 %)" in lines
