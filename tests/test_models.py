"""Models: tiny clip / fusion forward+backward, config round trip, weights, MLM masking, BERT folders."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from cvl.errors import CvlError
from cvl.models import (
    MissingFusionError,
    build_model,
    list_configs,
    load_weights,
    model_from_config,
    save_weights,
)
from cvl.models.fusion import IGNORE_INDEX, mlm_distillation

CAPTIONS = [
    "a small red circle in the top left",
    "a big blue square at the bottom right",
    "a green triangle in the middle",
    "two yellow stars on a white background",
    "a purple circle on a grey background",
    "a tiny orange square in the top right",
    "a large black triangle at the bottom left",
    "a pink star in the centre",
]


def _batch(model, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, model.image_size, model.image_size, generator=g)
    tokens = model.tokenizer([CAPTIONS[i % len(CAPTIONS)] for i in range(n)])
    return images, tokens


def _itc(out):
    logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T
    target = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def _bert_folder(root, with_weights: bool = False):
    """A tiny local WordPiece tokenizer folder (+ optionally a tiny BertForMaskedLM)."""
    d = root / "tiny-bert"
    d.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words += sorted({w for c in CAPTIONS for w in c.split()})
    (d / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True}), encoding="utf-8"
    )
    if with_weights:
        from transformers import BertConfig, BertForMaskedLM

        torch.manual_seed(0)
        cfg = BertConfig(
            vocab_size=len(words),
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=40,
        )
        BertForMaskedLM(cfg).eval().save_pretrained(str(d))
    return d, words


# --------------------------------------------------------------------------------------------
# construction, configs, errors
# --------------------------------------------------------------------------------------------


def test_packaged_configs_listed():
    assert {"tiny", "tiny-vit"} <= set(list_configs("clip"))
    assert "tiny" in list_configs("fusion")


@pytest.mark.parametrize(
    "kind, name, max_params",
    [("clip", "tiny", 700_000), ("clip", "tiny-vit", 400_000), ("fusion", "tiny", 500_000)],
)
def test_tiny_models_are_tiny_and_complete(kind, name, max_params):
    torch.manual_seed(0)
    m = build_model(kind, name)
    n = sum(p.numel() for p in m.parameters())
    assert 100_000 < n < max_params
    assert m.kind == kind and m.image_size == 32 and m.embed_dim == 64
    cfg = m.config()
    json.dumps(cfg)  # JSON-able
    for key in ("kind", "tokenizer", "image_size", "embed_dim"):
        assert key in cfg


def test_unknown_config_and_kind_errors(tmp_path):
    with pytest.raises(CvlError, match="tiny-vit"):
        build_model("clip", "no-such-model")
    with pytest.raises(CvlError, match="packaged config"):
        build_model("fusion", "ViT-B-32")
    with pytest.raises(CvlError, match="clip, fusion"):
        build_model("dual", "tiny")
    with pytest.raises(CvlError, match="not found"):
        build_model("clip", str(tmp_path / "missing.json"))
    with pytest.raises(CvlError, match="kind 'fusion'"):
        build_model("clip", {"extends": "tiny", "kind": "fusion"})
    with pytest.raises(CvlError, match="not a cvl model config"):
        model_from_config({"kind": "nope"})
    with pytest.raises(CvlError, match="not found"):
        build_model("clip", "tiny", pretrained=str(tmp_path / "nope.pt"))


def test_config_from_json_file_and_extends(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"extends": "tiny", "model_cfg": {"embed_dim": 32}}), encoding="utf-8")
    m = build_model("clip", str(p))
    assert m.embed_dim == 32 and m.config()["model_cfg"]["text_cfg"]["layers"] == 2
    # a bare open_clip model config works too
    bare = {
        "embed_dim": 16,
        "vision_cfg": {
            "layers": 1,
            "width": 32,
            "head_width": 16,
            "patch_size": 16,
            "image_size": 32,
        },
        "text_cfg": {"context_length": 16, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1},
    }
    m = build_model("clip", bare)
    assert m.config()["tokenizer"] == {"type": "hash", "vocab_size": 64, "context_length": 16}
    assert m.encode_text(m.tokenizer(["a b"])).shape == (1, 16)


def test_named_open_clip_architecture_builds_offline():
    m = build_model("clip", "RN50")
    assert m.config()["arch"] == "RN50" and m.config()["tokenizer"]["type"] == "openclip"
    assert m.image_size == 224 and m.embed_dim == 1024
    assert m.tokenizer(["a photo of a cat"]).shape == (1, 77)


def test_clip_pretrained_from_open_clip_state_dict(tmp_path):
    torch.manual_seed(0)
    src = build_model("clip", "tiny-vit").eval()
    torch.save(src.clip.state_dict(), tmp_path / "w.pt")
    m = build_model("clip", "tiny-vit", pretrained=str(tmp_path / "w.pt")).eval()
    images, tokens = _batch(m, 4)
    with torch.no_grad():
        assert torch.equal(m.encode_image(images), src.encode_image(images))
    assert m.config()["init"]["pretrained"].endswith("w.pt")
    with pytest.raises(CvlError, match="do not fit"):
        build_model("clip", "tiny", pretrained=str(tmp_path / "w.pt"))


# --------------------------------------------------------------------------------------------
# forward / backward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny-vit"])
def test_clip_forward_backward_learns(name):
    torch.manual_seed(0)
    m = build_model("clip", name)
    images, tokens = _batch(m)
    out = m(images, tokens)
    assert out["image_features"].shape == (8, 64) and out["text_features"].shape == (8, 64)
    for k in ("image_features", "text_features"):
        assert torch.allclose(out[k].norm(dim=-1), torch.ones(8), atol=1e-5)
    assert out["logit_scale"].item() == pytest.approx(1 / 0.07, rel=1e-4)
    assert m.clip.logit_scale.requires_grad
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        loss = _itc(m(images, tokens))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert m.clip.logit_scale.grad is not None
    with pytest.raises(MissingFusionError, match="fusion encoder"):
        m.require_fusion("mlm")


def test_clip_logit_scale_is_clamped():
    m = build_model("clip", "tiny-vit")
    with torch.no_grad():
        m.clip.logit_scale.fill_(10.0)
    assert m.logit_scale().item() == pytest.approx(100.0)


def test_fusion_forward_backward_learns():
    torch.manual_seed(0)
    m = build_model("fusion", "tiny")
    m.require_fusion("mlm")  # no error
    images, tokens = _batch(m)
    out = m(images, tokens)
    assert out["image_embeds"].shape == (8, 17, 64) and out["image_atts"].shape == (8, 17)
    assert out["text_hidden"].shape == (8, 32, 64)
    assert out["image_cls"].shape == (8, 64) and out["text_cls"].shape == (8, 64)
    for k in ("image_features", "text_features"):
        assert torch.allclose(out[k].norm(dim=-1), torch.ones(8), atol=1e-5)
    assert out["logit_scale"].item() == pytest.approx(1 / 0.07)
    assert not any("logit" in n for n, _ in m.named_parameters())  # fixed temperature
    assert m.fusion_cls(out["image_embeds"], tokens).shape == (8, 64)

    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    first = last = None
    for step in range(8):
        g = torch.Generator().manual_seed(123)  # same masking every step: a fixed batch
        out = m(images, tokens)
        mlm, logits, labels = m.mlm_loss(out["image_embeds"], tokens, g)
        loss = _itc(out) + mlm
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0:
            first = (loss.item(), mlm.item())
            grads = {
                n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0
            }
            assert any(".crossattention." in n for n in grads)  # fusion layers are trained
            assert any(n.startswith("visual_encoder.") for n in grads)
        last = (loss.item(), mlm.item())
    assert logits.shape == (8, 32, m.vocab_size) and labels.shape == (8, 32)
    assert last[0] < first[0] - 0.1 and last[1] < first[1]


def test_fusion_mlm_same_masking_for_teacher_and_forward_option():
    torch.manual_seed(0)
    m = build_model("fusion", "tiny").eval()
    teacher = build_model("fusion", "tiny").eval()
    images, tokens = _batch(m)
    masked, labels = m.mask_tokens(tokens, torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = m(images, tokens, mlm_ids=masked)
        loss, logits, lab = m.mlm_loss(images, tokens, masked=(masked, labels))
        t_out = teacher(images, tokens)
        t_logits = teacher.mlm_logits(t_out["image_embeds"], t_out["image_atts"], masked)
    assert torch.allclose(out["mlm_logits"], logits, atol=1e-5)
    assert torch.equal(lab, labels)
    assert mlm_distillation(logits, t_logits, labels).item() > 0
    # distilling from oneself: the soft CE equals the entropy, minimal at the teacher
    self_d = mlm_distillation(logits, logits, labels)
    assert self_d <= mlm_distillation(t_logits, logits, labels) + 1e-6
    # nothing masked -> a zero loss, not NaN
    none = torch.full_like(labels, IGNORE_INDEX)
    z, _, _ = m.mlm_loss(out["image_embeds"], tokens, masked=(tokens, none))
    assert z.item() == 0.0


# --------------------------------------------------------------------------------------------
# MLM masking statistics
# --------------------------------------------------------------------------------------------


def test_mask_tokens_statistics_and_determinism():
    m = build_model("fusion", "tiny")
    tok = m.tokenizer
    g = torch.Generator().manual_seed(0)
    # 4000 rows of random words of random length (specials at start/end, padding after)
    lengths = torch.randint(1, 30, (4000,), generator=g)
    tokens = torch.zeros(4000, 32, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, 0] = tok.cls_id
        tokens[i, 1 : 1 + n] = torch.randint(4, tok.vocab_size - 1, (n,), generator=g)
        tokens[i, 1 + n] = tok.sep_id
    masked, labels = m.mask_tokens(tokens, torch.Generator().manual_seed(1))
    masked2, labels2 = m.mask_tokens(tokens, torch.Generator().manual_seed(1))
    assert torch.equal(masked, masked2) and torch.equal(labels, labels2)
    masked3, _ = m.mask_tokens(tokens, torch.Generator().manual_seed(2))
    assert not torch.equal(masked, masked3)

    special = (tokens == tok.pad_id) | (tokens == tok.cls_id) | (tokens == tok.sep_id)
    sel = labels != IGNORE_INDEX
    assert not (sel & special).any()
    assert torch.equal(masked[special], tokens[special])  # specials never touched
    assert torch.equal(masked[~sel], tokens[~sel])  # unselected never touched
    assert torch.equal(labels[sel], tokens[sel])
    n_words = int((~special).sum())
    frac = sel.sum().item() / n_words
    assert abs(frac - 0.15) < 0.01
    n_sel = int(sel.sum())
    to_mask = (masked[sel] == tok.mask_id).sum().item() / n_sel
    kept = (masked[sel] == tokens[sel]).sum().item() / n_sel
    rnd = 1 - to_mask - kept
    assert abs(to_mask - 0.8) < 0.02
    assert abs(kept - 0.1) < 0.015  # (a random word equal to the original counts as kept)
    assert abs(rnd - 0.1) < 0.015
    replaced = masked[sel][(masked[sel] != tok.mask_id) & (masked[sel] != tokens[sel])]
    assert not torch.isin(
        replaced, torch.tensor([tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id])
    ).any()


# --------------------------------------------------------------------------------------------
# config round trip and weights
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, name", [("clip", "tiny"), ("clip", "tiny-vit"), ("fusion", "tiny")])
def test_config_round_trip_and_safetensors(tmp_path, kind, name):
    torch.manual_seed(0)
    m = build_model(kind, name)
    images, tokens = _batch(m)
    # a couple of training steps so BatchNorm statistics / weights differ from a fresh init
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        _itc(m(images, tokens)).backward()
        opt.step()
    m.eval()
    save_weights(m, tmp_path / "model.safetensors")
    cfg = json.loads(json.dumps(m.config()))
    torch.manual_seed(1)
    m2 = model_from_config(cfg)
    load_weights(m2, tmp_path / "model.safetensors")
    m2.eval()
    assert m2.config() == m.config()
    with torch.no_grad():
        a, b = m(images, tokens), m2(images, tokens)
        for k in ("image_features", "text_features", "logit_scale"):
            assert torch.equal(a[k], b[k]), k
        if kind == "fusion":
            assert torch.equal(
                m.fusion_cls(a["image_embeds"], tokens), m2.fusion_cls(b["image_embeds"], tokens)
            )
            dec = m2.text_encoder.cls.predictions.decoder.weight
            assert dec is m2.text_encoder.bert.embeddings.word_embeddings.weight  # still tied


def test_load_weights_mismatch_is_a_clear_error(tmp_path):
    clip = build_model("clip", "tiny")
    save_weights(clip, tmp_path / "clip.safetensors")
    with pytest.raises(CvlError, match="missing"):
        load_weights(build_model("fusion", "tiny"), tmp_path / "clip.safetensors")
    wide = build_model("clip", {"extends": "tiny", "model_cfg": {"embed_dim": 32}})
    with pytest.raises(CvlError, match="do not fit"):
        load_weights(wide, tmp_path / "clip.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CvlError, match="cannot read"):
        load_weights(clip, tmp_path / "junk.safetensors")
    with pytest.raises(CvlError, match="not found"):
        load_weights(clip, tmp_path / "none.safetensors")
    # a cvl file also works as --pretrained
    m = build_model("clip", "tiny", pretrained=str(tmp_path / "clip.safetensors"))
    assert torch.equal(m.clip.text_projection, clip.clip.text_projection)


# --------------------------------------------------------------------------------------------
# fusion with local folders (tokenizer, BERT weights, ViT weights)
# --------------------------------------------------------------------------------------------


def test_fusion_with_local_wordpiece_tokenizer(tmp_path):
    d, words = _bert_folder(tmp_path)
    torch.manual_seed(0)
    m = build_model(
        "fusion", "tiny", tokenizer={"type": "bert", "path": str(d), "context_length": 16}
    )
    assert m.vocab_size == len(words)  # random-init text tower follows the tokenizer
    assert m.mask_id == words.index("[MASK]") and m.pad_id == 0
    images, tokens = _batch(m, 4)
    assert tokens.shape == (4, 16) and tokens[0, 0] == words.index("[CLS]")
    out = m(images, tokens)
    loss, logits, labels = m.mlm_loss(out["image_embeds"], tokens, torch.Generator().manual_seed(0))
    (loss + _itc(out)).backward()
    assert logits.shape == (4, 16, len(words))
    masked, labels = m.mask_tokens(tokens, torch.Generator().manual_seed(0), prob=0.5)
    specials = torch.tensor([words.index(w) for w in ("[PAD]", "[CLS]", "[SEP]")])
    assert not (torch.isin(tokens, specials) & (labels != IGNORE_INDEX)).any()
    # the rebuilt model finds the tokenizer through its config
    m2 = model_from_config(m.config())
    assert torch.equal(m2.tokenizer(["a red circle"]), m.tokenizer(["a red circle"]))


def test_fusion_text_pretrained_bert_folder_matches_transformers(tmp_path):
    from transformers import BertForMaskedLM

    d, words = _bert_folder(tmp_path, with_weights=True)
    m = build_model(
        "fusion", {"extends": "tiny", "text_pretrained": str(d), "tokenizer": None}
    ).eval()
    cfg = m.config()
    assert cfg["tokenizer"]["type"] == "bert" and cfg["text"]["hidden_size"] == 32
    assert (cfg["text_layers"], cfg["fusion_layers"]) == (2, 1)  # 3 layers split
    assert cfg["init"]["text_pretrained"] == str(d)
    hf = BertForMaskedLM.from_pretrained(str(d), local_files_only=True).eval()
    tokens = m.tokenizer(["a small red circle in the top left", "a blue square"])
    with torch.no_grad():
        ref = hf.bert(
            input_ids=tokens, attention_mask=(tokens != 0).long(), output_hidden_states=True
        )
        ours = m.text_hidden(tokens)
        assert torch.allclose(ref.hidden_states[2], ours, atol=1e-5)
        assert torch.allclose(hf.cls(ours), m.text_encoder.cls.predictions(ours), atol=1e-5)
    with pytest.raises(CvlError, match="local BERT folder"):
        build_model("fusion", {"extends": "tiny", "text_pretrained": str(tmp_path / "nope")})


def test_fusion_image_pretrained_timm_file(tmp_path):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(3)
    vit = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10
    )
    torch.save({"model": vit.state_dict()}, tmp_path / "deit.pth")  # DeiT's file layout
    m = build_model("fusion", {"extends": "tiny", "image_pretrained": str(tmp_path / "deit.pth")})
    assert torch.equal(m.visual_encoder.pos_embed, vit.pos_embed)
    assert torch.equal(m.visual_encoder.blocks[1].mlp.fc2.weight, vit.blocks[1].mlp.fc2.weight)
    small = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4)
    torch.save(small.state_dict(), tmp_path / "small.pth")
    with pytest.raises(CvlError, match="not a fitting ViT"):
        build_model("fusion", {"extends": "tiny", "image_pretrained": str(tmp_path / "small.pth")})


def test_fusion_base_needs_a_tokenizer():
    with pytest.raises(CvlError, match="tokenizer"):
        build_model("fusion", "base")


def test_tiny_fusion_cls_features_differ_across_captions_at_init():
    """Guards the tiny config's BERT init (std 0.1): at 0.02 the random model's text [CLS]
    features were nearly identical for different captions (std over a batch ≈ 3e-4) and ITC
    stalled at ln(batch) in training; here they must differ from the start."""
    torch.manual_seed(0)
    m = build_model("fusion", "tiny")
    m.eval()
    caps = [
        f"a {s} {c} {h} at the {p}"
        for s, c, h, p in [
            ("small", "red", "circle", "top left"),
            ("large", "blue", "square", "bottom right"),
            ("small", "green", "star", "centre"),
            ("large", "red", "hexagon", "top right"),
        ]
    ]
    with torch.no_grad():
        w = m.encode_text(m.tokenizer(caps))
    assert float(w.std(0).mean()) > 3e-3
