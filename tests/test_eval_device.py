"""Evaluation at GPU speed (issue 24): the device each command picks, loader workers, the image
store that decodes each set once, each set embedded once per checkpoint, mixed precision, and
the same numbers whichever of these is used (on CUDA too: the `gpu` test)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_eval_e2e import make_run

from cvl.cli import main

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--quiet", "--no-plots", "--probe-train", "24", "--batch-size", "16"]


@pytest.fixture(scope="module")
def run(synth_stream, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("dev-runs") / "a", synth_stream)


def _eval(run: Path, out: Path, *extra: str) -> dict:
    assert main(["eval", "--run", str(run), "--out", str(out), *FAST, *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


def _numbers(m: dict) -> dict:
    return {k: m[k] for k in ("matrices", "cumulative", "zero_shot_row", "final", "continual")}


# -- the device ----------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised by a patched loader once the device it was asked for is known."""


def _pretend_cuda(monkeypatch):
    import cvl.device as dev

    monkeypatch.setattr(dev, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_eval_auto_moves_the_model_to_cuda_when_torch_sees_one(run, tmp_path, monkeypatch):
    from cvl.evaluation import runner

    asked = []

    def load(run_d, path, device, model=None):  # noqa: ANN001, ANN202
        asked.append(device)
        raise _Stop

    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(runner, "_load_model", load)
    with pytest.raises(_Stop):
        main(["eval", "--run", str(run), "--out", str(tmp_path / "e"), "--quiet"])
    assert asked == [torch.device("cuda", 0)]
    asked.clear()
    with pytest.raises(_Stop):
        main(["eval", "--run", str(run), "--out", str(tmp_path / "e"), "--device", "cpu"])
    assert asked == [torch.device("cpu")]


def test_rotation_and_pseudo_label_ask_for_cuda_too(run, synth_stream, monkeypatch):
    from cvl.analysis import rotation
    from cvl.streams import pseudolabel

    asked = []

    def features(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        asked.append(kw["device"])
        raise _Stop

    class Classifier:
        def to(self, device):  # noqa: ANN001, ANN202
            asked.append(device)
            raise _Stop

    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(rotation, "extract_features", features)
    monkeypatch.setattr(pseudolabel, "load_classifier", lambda m: (Classifier(), None, ["a"]))
    with pytest.raises(_Stop):
        main(["analyze", "rotation", "--run", str(run), "--quiet"])
    with pytest.raises(_Stop):
        main(["pseudo-label", "--stream", str(synth_stream), "--model", "m", "--quiet"])
    assert asked == [torch.device("cuda", 0)] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_one_line_error(run, capsys):
    assert main(["eval", "--run", str(run), "--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch sees no CUDA device" in err and "Traceback" not in err


def test_determinism_is_recorded_and_torch_mode_restored(run, tmp_path, capsys):
    before = torch.are_deterministic_algorithms_enabled()
    m = _eval(run, tmp_path / "d", "--tasks", "last", "--device", "cpu", "--deterministic")
    rt = m["runtime"]["01-t1"]
    assert rt["deterministic"] is True and rt["device"] == "cpu" and rt["precision"] == "no"
    assert torch.are_deterministic_algorithms_enabled() == before  # not left on for the caller
    assert "deterministic on" in (tmp_path / "d" / "summary.md").read_text()
    m = _eval(run, tmp_path / "n", "--tasks", "last", "--device", "cpu", "--no-deterministic")
    assert m["runtime"]["01-t1"]["deterministic"] is False
    assert "precision no, deterministic off" in capsys.readouterr().out


# -- the same numbers with workers, with and without the image store -----------------------------
def test_workers_and_image_store_give_identical_metrics(run, tmp_path):
    """Workers 0 / 2 and the store on / off: the same numbers, bit for bit. With the store,
    each eval image is decoded once for all 3 checkpoints; without it, once per checkpoint."""
    plain = _eval(run, tmp_path / "w0", "--workers", "0", "--image-cache-mb", "0")
    stored = _eval(run, tmp_path / "w2", "--workers", "2")
    w2_plain = _eval(run, tmp_path / "w2n", "--workers", "2", "--image-cache-mb", "0")
    assert _numbers(stored) == _numbers(plain) == _numbers(w2_plain)
    assert {r["workers"] for r in stored["runtime"].values()} == {2}
    s, p = stored["timing"]["image_store"], plain["timing"]["image_store"]
    n_ck = 3  # init + 2 tasks
    assert p["images_reused"] == 0 and p["images_decoded"] % n_ck == 0
    once = p["images_decoded"] // n_ck  # every set's images, one checkpoint's worth
    assert s["images_decoded"] == once and s["images_reused"] == (n_ck - 1) * once
    assert s["sets_kept"] > 0 and s["sets_too_big"] == 0
    assert s["embedding_passes"] == p["embedding_passes"]


def test_store_fills_from_worker_batches_and_respects_its_budget(synth_stream):
    """The decode-once store works with workers (their decoded batches reach the main process
    and are kept there), serves the second pass without a loader, and keeps nothing that
    does not fit."""
    from cvl.data.transforms import EvalTransform
    from cvl.evaluation.embed import _PairItems, eval_dataset
    from cvl.evaluation.imagestore import ImageBatches, ImageStore
    from cvl.streams.manifest import load_manifest

    m = load_manifest(synth_stream)
    model = type("M", (), {"image_size": 32})()
    ds = eval_dataset(model, m.eval_shards("test", "t0"), check=False)
    items = _PairItems(ds, EvalTransform(32).to_uint8)
    store = ImageStore(1)
    first = list(ImageBatches(items, 5, num_workers=2, store=store, key="k"))
    assert store.decoded == len(ds) and store.reused == 0
    second = list(ImageBatches(items, 5, num_workers=2, store=store, key="k"))
    assert store.decoded == len(ds) and store.reused == len(ds)
    assert torch.equal(torch.cat([b["image"] for b in first]), store.sets["k"].images)
    assert torch.equal(torch.cat([b["image"] for b in second]), store.sets["k"].images)
    assert [b["id"] for b in first] == [b["id"] for b in second]
    assert store.used == len(ds) * 3 * 32 * 32
    tight = ImageStore(0)
    list(ImageBatches(items, 5, num_workers=2, store=tight, key="k"))
    list(ImageBatches(items, 5, num_workers=2, store=tight, key="k"))
    assert tight.decoded == 2 * len(ds) and not tight.sets and tight.too_big == {"k"}


def test_eval_pass_leaves_unreadable_samples_out_with_workers(tmp_path, capsys):
    """Without the main-process check (`eval_dataset(check=False)`), the embedding pass itself
    leaves the samples that fail to decode out (never replaced by a neighbour), in workers."""
    from test_reliability_data import UNREADABLE, USED, bad_members, write_tar

    from cvl.evaluation.embed import embed_dataset, eval_dataset
    from cvl.models import build_model

    shard = tmp_path / "bad.tar"
    write_tar(shard, bad_members("t"), "t")
    torch.manual_seed(0)
    model = build_model("clip", "tiny-vit").eval()
    checked = embed_dataset(model, eval_dataset(model, [shard]), 4, device=torch.device("cpu"))
    capsys.readouterr()
    ds = eval_dataset(model, [shard], check=False)
    lazy = embed_dataset(model, ds, 4, device=torch.device("cpu"), num_workers=2)
    assert sorted(lazy.ids) == sorted(checked.ids) and len(set(lazy.ids)) == len(USED)
    # the same features (batches hold other samples here, so float rounding may differ)
    torch.testing.assert_close(lazy.image_features, checked.image_features, atol=1e-6, rtol=0)
    assert ds.skipped["unreadable"] == len(UNREADABLE)


# -- each set embedded once per checkpoint -------------------------------------------------------
def test_each_set_is_embedded_once_per_checkpoint(synth_stream, tmp_path, monkeypatch):
    """Two tasks whose test sets are the same shards, a val set equal to the test set and a
    benchmark equal to it: one embedding pass per distinct set and checkpoint (before issue 24
    the shared test set was embedded once per task, the val set again for the probe)."""
    from collections import Counter

    from cvl.evaluation import features

    s = tmp_path / "shared"
    shutil.copytree(synth_stream, s)
    d = json.loads((s / "stream.json").read_text())
    test = d["eval_sets"]["test"]["tasks"]
    test["t1"] = test["t0"]
    d["eval_sets"]["val"]["tasks"]["t0"] = test["t0"]
    d["benchmarks"] = {"bench": {"kind": "pairs", **test["t0"], "description": "t0's test"}}
    (s / "stream.json").write_text(json.dumps(d))
    r = make_run(tmp_path / "r", s, tasks=("t0",), init=False)
    calls: Counter = Counter()
    real = features.embed_dataset

    def counting(model, ds, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls[(id(model), ds.entries[0].shard, len(ds))] += 1
        return real(model, ds, *a, **kw)

    monkeypatch.setattr(features, "embed_dataset", counting)
    _eval(r, tmp_path / "e", "--stream", str(s))
    assert calls and max(calls.values()) == 1
    shards = {k[1] for k in calls}
    assert str(Path(s / test["t0"]["shards"][0]).resolve()) in shards
    m = json.loads((tmp_path / "e" / "metrics.json").read_text())
    R = m["matrices"]["Rm"][0]
    assert R[0] == R[1] == m["benchmarks"]["bench"]["metrics"]["Rm"][0]


# -- precision -------------------------------------------------------------------------------------
def test_bf16_features_within_tolerance_of_float32(synth_stream):
    """bf16 autocast (CPU here) changes the features, but little: every image and caption
    feature within cosine 0.999 and 0.02 per coordinate of its float32 value (measured on the
    tiny models: cosine >= 0.9999, max difference 0.005); float32 results are returned."""
    from cvl.evaluation.embed import embed_dataset, eval_dataset
    from cvl.models import build_model
    from cvl.streams.manifest import load_manifest

    m = load_manifest(synth_stream)
    torch.manual_seed(0)
    model = build_model("clip", "tiny-vit").eval()
    ds = eval_dataset(model, m.eval_shards("test", "t0"), check=False)
    a = embed_dataset(model, ds, 8, device=torch.device("cpu"))
    b = embed_dataset(model, ds, 8, device=torch.device("cpu"), precision="bf16")
    for x, y in ((a.image_features, b.image_features), (a.text_features, b.text_features)):
        assert not x.requires_grad and not y.requires_grad  # embedded without autograd
        assert y.dtype == torch.float32 and not torch.equal(x, y)  # autocast did run
        assert torch.nn.functional.cosine_similarity(x, y).min() >= 0.999
        assert (x - y).abs().max() <= 0.02


def test_precision_is_recorded_and_keys_the_cache(run, tmp_path):
    out = tmp_path / "p"
    f32 = _eval(run, out, "--tasks", "last", "--no-probe")
    assert f32["protocol"]["precision"].startswith("no: float32")
    bf = _eval(run, out, "--tasks", "last", "--no-probe", "--precision", "bf16")
    assert bf["evaluated"] == ["01-t1"]  # not the float32 result from the cache
    assert bf["protocol"]["precision"].startswith("bf16: ") and bf["runtime"]["01-t1"][
        "precision"
    ] == ("bf16")
    assert "embedding precision: bf16" in (out / "summary.md").read_text()
    # (the metrics of this random tiny model are not compared: its scores are near-ties, so
    # the bf16 rounding moves whole items; the tolerance is stated on the features above)


# -- several processes, and CUDA ---------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_give_the_same_metrics_as_one(run, tmp_path):
    """`accelerate launch --num_processes 2 -m cvl eval` (gloo on the CPU; each rank embeds
    its part of every set with a loader worker, the parts are gathered) = one process.
    (torchrun's own parser takes `--run` for its `--run-path` on Python 3.11.)"""
    one = _eval(run, tmp_path / "one", "--device", "cpu", "--workers", "0")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    cmd += ["--num_processes", "2", "--main_process_port", str(_port())]
    cmd += ["-m", "cvl", "eval", "--run", str(run)]
    cmd += ["--out", str(tmp_path / "two"), *FAST, "--device", "cpu", "--workers", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert {rt["processes"] for rt in two["runtime"].values()} == {2}
    a, b = _numbers(one), _numbers(two)
    for k in a["matrices"]:
        np.testing.assert_allclose(
            np.array(a["matrices"][k], dtype=float), np.array(b["matrices"][k], dtype=float)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eval_on_cuda_records_the_device_and_ranks_as_the_cpu(run, tmp_path):
    """`cvl eval --device cuda`: the model, the embedding passes, the similarity blocks and the
    ranking on the GPU; the metrics equal the CPU's up to float32 rounding of near-ties."""
    cpu = _eval(run, tmp_path / "cpu", "--device", "cpu")
    gpu = _eval(run, tmp_path / "gpu", "--device", "cuda", "--workers", "2")
    assert {rt["device"] for rt in gpu["runtime"].values()} == {"cuda:0"}
    for k in cpu["matrices"]:
        a = np.array(cpu["matrices"][k], dtype=float)
        b = np.array(gpu["matrices"][k], dtype=float)
        assert np.nanmax(np.abs(a - b)) <= 5.0, k
    from cvl.evaluation.retrieval import retrieval_metrics

    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(300, 64, generator=g), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(1500, 64, generator=g), dim=-1)
    t2i = torch.arange(1500) // 5
    on_cpu = retrieval_metrics(img, txt, t2i, block_elems=1 << 12)
    assert retrieval_metrics(img, txt, t2i, block_elems=1 << 12, device="cuda") == on_cpu


def test_a_model_with_non_finite_features_is_refused_not_scored(synth_stream):
    """A broken checkpoint (here a NaN in a weight; in practice, e.g., a merged BatchNorm
    running_var < 0) gives NaN scores, and NaN comparisons would count every query as a hit
    (100 %): the embedding pass refuses it in one line instead."""
    from cvl.errors import CvlError
    from cvl.evaluation.embed import embed_dataset, eval_dataset
    from cvl.models import build_model
    from cvl.streams.manifest import load_manifest

    torch.manual_seed(0)
    model = build_model("clip", "tiny")
    m = load_manifest(synth_stream)
    ds = eval_dataset(model, m.eval_shards("test", m.task_order[0]), check=False)
    assert torch.isfinite(embed_dataset(model, ds, 32).image_features).all()
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(CvlError, match="features are not finite"):
        embed_dataset(model, ds, 32)
