"""`cvl train --init-run`: start a stream from another run's weights (CLIP_0, the papers' regime)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cvl.cli import main
from cvl.errors import CvlError
from cvl.runs import finished_tasks, load_run
from cvl.train.config import resolve
from cvl.train.loop import Trainer

FAST = dict(epochs=1, batch_size=16, log_with="none", checkpoint_every=0, model_config="tiny")


def _train(stream, out, **kw):
    cfg = resolve(None, {"stream": str(stream), "out": str(out), **FAST, **kw})
    Trainer(cfg, progress=False).run()


def _same(a, b) -> bool:
    wa, wb = load_file(str(a)), load_file(str(b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_init_run_starts_from_the_last_task_or_a_task_folder(synth_stream, tmp_path):
    _train(synth_stream, tmp_path / "clip0", max_steps_per_task=2)
    last, first = finished_tasks(tmp_path / "clip0")[-1], finished_tasks(tmp_path / "clip0")[0]
    _train(synth_stream, tmp_path / "a", method="zeroshot", init_run=str(tmp_path / "clip0"))
    assert _same(tmp_path / "a" / "init" / "model.safetensors", last.model_path)
    assert not _same(tmp_path / "a" / "init" / "model.safetensors", first.model_path)
    # zero-shot keeps the start on every task: its task checkpoints are CLIP_0 itself
    assert all(_same(c.model_path, last.model_path) for c in finished_tasks(tmp_path / "a"))
    _train(synth_stream, tmp_path / "b", method="zeroshot", init_run=str(first.path))
    assert _same(tmp_path / "b" / "init" / "model.safetensors", first.model_path)
    assert load_run(tmp_path / "b")["config"]["init_run"] == str(first.path)


def test_init_run_errors(synth_stream, tmp_path, capsys):
    with pytest.raises(CvlError, match="not both"):
        resolve(None, {"stream": "s", "out": "o", "pretrained": "x", "init_run": "y"})
    with pytest.raises(CvlError, match="not a run folder"):
        _train(synth_stream, tmp_path / "r", init_run=str(tmp_path))
    _train(synth_stream, tmp_path / "vit", model_config="tiny-vit", max_steps_per_task=1)
    code = main(
        ["train", "--stream", str(synth_stream), "--out", str(tmp_path / "x"), "--quiet",
         "--init-run", str(tmp_path / "vit"), "--log-with", "none"]
    )  # fmt: skip
    assert code == 2 and "do not" in capsys.readouterr().err  # another model config: one line
