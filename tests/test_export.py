"""`cvl export`: a clip run's checkpoint loads in open_clip (`local-dir:`) with identical embeddings."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cvl.errors import CvlError
from cvl.io import write_json
from cvl.models import build_model, save_weights
from cvl.models.cli import CONFIG_NAME, WEIGHTS_NAME, export


def _fake_run(root, model, tasks=("t0",)):
    run = root / "run"
    write_json(
        run / "run.json",
        {
            "schema": "cvl.run/1",
            "config": {"method": "seqft"},
            "model": model.config(),
            "stream": {},
        },
    )
    for i, name in enumerate(tasks):
        save_weights(model, run / "tasks" / f"{i:02d}-{name}" / "model.safetensors")
    return run


def _trained_clip(name):
    torch.manual_seed(0)
    m = build_model("clip", name)
    images = torch.randn(8, 3, 32, 32)
    tokens = m.tokenizer([f"caption number {i}" for i in range(8)])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(2):  # move weights (and BatchNorm statistics) away from the init
        out = m(images, tokens)
        logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(8))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.mark.parametrize("name", ["tiny", "tiny-vit"])
def test_export_round_trip_open_clip_local_dir(tmp_path, name):
    import open_clip

    model = _trained_clip(name)
    run = _fake_run(tmp_path, model)
    out = tmp_path / "exported"
    res = CliRunner().invoke(export, ["--run", str(run), "--out", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert (out / CONFIG_NAME).is_file() and (out / WEIGHTS_NAME).is_file()
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert set(cfg) >= {"model_cfg", "preprocess_cfg"}
    assert cfg["preprocess_cfg"]["size"] == 32
    assert cfg["cvl"]["tokenizer"] == {"type": "hash", "vocab_size": 1024, "context_length": 32}
    assert "HashTokenizer" in (out / "README.md").read_text()

    oc = open_clip.create_model(f"local-dir:{out}").eval()
    images = torch.randn(4, 3, 32, 32)
    tokens = model.tokenizer(["a red circle", "a blue square at the top", "x", "two green stars"])
    with torch.no_grad():
        assert torch.equal(oc.encode_image(images, normalize=True), model.encode_image(images))
        assert torch.equal(oc.encode_text(tokens, normalize=True), model.encode_text(tokens))
        assert torch.equal(oc.logit_scale.exp().clamp(max=100), model.logit_scale())
    # and open_clip's transforms come from preprocess_cfg
    _, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    from PIL import Image

    assert preprocess(Image.new("RGB", (50, 40))).shape == (3, 32, 32)

    # an export can be re-imported as a cvl model config + pretrained file
    back = build_model("clip", str(out / CONFIG_NAME), pretrained=str(out / WEIGHTS_NAME)).eval()
    assert back.config()["tokenizer"]["type"] == "hash"
    with torch.no_grad():
        assert torch.equal(back.encode_text(tokens), model.encode_text(tokens))


def test_export_picks_task_and_refuses_existing_out(tmp_path):
    model = _trained_clip("tiny-vit")
    run = _fake_run(tmp_path, model, tasks=("t0", "t1"))
    out = tmp_path / "exp"
    r = CliRunner().invoke(export, ["--run", str(run), "--task", "t0", "--out", str(out)])
    assert r.exit_code == 0, repr(r.exception)
    assert json.loads((out / CONFIG_NAME).read_text())["cvl"]["task"] == {"index": 0, "name": "t0"}
    r = CliRunner().invoke(export, ["--run", str(run), "--out", str(out)])
    assert isinstance(r.exception, CvlError) and "--overwrite" in str(r.exception)
    r = CliRunner().invoke(export, ["--run", str(run), "--out", str(out), "--overwrite"])
    assert r.exit_code == 0, repr(r.exception)
    assert (
        json.loads((out / CONFIG_NAME).read_text())["cvl"]["task"]["name"] == "t1"
    )  # default: last
    r = CliRunner().invoke(
        export, ["--run", str(run), "--task", "t9", "--out", str(tmp_path / "x")]
    )
    assert isinstance(r.exception, CvlError) and "no finished task" in str(r.exception)
    assert not (tmp_path / "x").exists()


def test_export_refuses_fusion_runs_via_cli_main(tmp_path, capsys):
    from cvl.cli import main

    torch.manual_seed(0)
    run = _fake_run(tmp_path, build_model("fusion", "tiny"))
    rc = main(["export", "--run", str(run), "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "export supports clip runs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    rc = main(["export", "--run", str(tmp_path / "not-a-run"), "--out", str(tmp_path / "out")])
    assert rc == 2 and "not a run folder" in capsys.readouterr().err
