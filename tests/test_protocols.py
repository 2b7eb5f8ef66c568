"""`cvl build-stream protocol PRESET`: the seven paper protocols from fixture data, one step each.

The archive sources come from the tiny real-format datasets of `archive_helpers`; the URL
sources a preset needs (cc3m, wit, goodnews, cc12m; C-CLIP's six hub tables) are one-task
synthetic streams passed with --stream (the preset takes any stream for them). Expected counts follow from the
fixture sizes and each preset's rules (restval -> val for Mod-X / DKR, DHA's 'rest of the
training draw is val', IAPR 25% test, RSICD val -> train, parts of K).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from archive_helpers import FAST, write_data_root

from cvl.cli import main
from cvl.streams.manifest import load_manifest
from cvl.streams.protocols import CCLIP_TABLES

TINY_TRAIN = ["--method", "seqft", "--model-config", "tiny", "--epochs", "1", "--batch-size"]
TINY_TRAIN += ["4", "--max-steps-per-task", "1", "--log-with", "none", "--checkpoint-every", "0"]
TINY_TRAIN += ["--quiet"]

# fixture sizes (archive_helpers): COCO 14 train + 4 restval / 5 val / 6 test; F30K 15/5/5;
# EC 15 train / 6 test (T2I_val); IAPR 16; RSICD 8/3/4. Synthetic URL-source stand-ins: 20 train,
# 10 test, 10 val.
COCO_MODX = {"train": 14, "val": 9, "test": 6}  # restval -> val: the papers' 80K / 30K / 5K
PARTS5_F30K = {"train": [3] * 5, "val": [1] * 5, "test": [1] * 5}
PARTS5_EC = {"train": [3] * 5, "test": [2, 1, 1, 1, 1]}
SYN = {"train": 20, "val": 10, "test": 10}


def _parts(prefix: str, d: dict[str, list[int]]) -> dict[str, dict[str, int]]:
    return {s: {f"{prefix}-{i + 1}": n for i, n in enumerate(v)} for s, v in d.items()}


def _merge(*ds: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for d in ds:
        for s, per in d.items():
            out.setdefault(s, {}).update(per)
    return out


def _one(task: str, d: dict[str, int]) -> dict[str, dict[str, int]]:
    return {s: {task: n} for s, n in d.items()}


EXPECTED = {
    "modx-coco-f30k": (
        _merge(_one("coco", COCO_MODX), _parts("f30k", PARTS5_F30K)),
        {"coco-5k": 6, "f30k-1k": 5},
    ),
    "modx-ec": (_parts("ec", PARTS5_EC), {"ec-5k": 6, "coco-5k": 6, "f30k-1k": 5}),
    "modx-cc12m": (
        _parts("cc12m", {"train": [2] * 10, "val": [1] * 10, "test": [1] * 10}),
        {"coco-5k": 6, "f30k-1k": 5},
    ),
    "dha-citm": (
        _merge(
            _one("coco", {"train": 10, "val": 8, "test": 6}),  # 10 drawn, the other 8 -> val
            *(_one(t, SYN) for t in ("cc3m", "wit", "goodnews")),
        ),
        {},
    ),
    "dkr-s1": (
        _merge(
            _one("coco", COCO_MODX),
            _one("flickr30k", {"train": 15, "val": 5, "test": 5}),
            _one("iapr", {"train": 12, "test": 4}),  # 15K / 5K of 20K
            _one("ec", {"train": 15, "test": 6}),
            _one("rsicd", {"train": 11, "test": 4}),  # train + val / test
        ),
        {},
    ),
    "dkr-s2": (_parts("ec", PARTS5_EC), {"f30k-1k": 5, "coco-5k": 6, "ec-5k": 6}),
    "cclip": (  # each training caption its own sample (restval -> train): 5 per image
        _merge(
            _one("flickr30k", {"train": 75, "val": 5, "test": 5}),
            _one("coco", {"train": 90, "val": 5, "test": 6}),
            *(_one(t, SYN) for t in CCLIP_TABLES),
        ),
        {},
    ),
}
EXTRA = {"dha-citm": ["--set", "coco.max_train=10"]}  # 100,000 of the fixture's 18 is all


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> dict[str, Path]:
    """Raw archive data + synthetic stand-ins for the URL-source streams."""
    root = tmp_path_factory.mktemp("protocols")
    data = write_data_root(root / "data")
    syn = root / "streams"
    base = ["build-stream", "synthetic", "--tasks", "1", "--per-task", "20", "--quiet"]
    base += ["--test-per-task", "10", "--val-per-task", "10", "--image-size", "24"]
    base += ["--query-per-task", "0", "--gallery-per-task", "0"]
    for i, s in enumerate(("cc3m", "wit", "goodnews", "cc12m", *CCLIP_TABLES)):
        assert main([*base, "--seed", str(i), "--out", str(syn / s)]) == 0
    return {"data": data, "streams": syn, "root": root}


_built: dict[str, Path] = {}


def build(raw: dict[str, Path], preset: str) -> Path:
    """Build a preset once per module (train tests reuse what the count tests built)."""
    if preset not in _built:
        out = raw["root"] / "out" / preset
        argv = ["build-stream", "protocol", preset, "--data", str(raw["data"])]
        argv += ["--streams", str(raw["streams"]), "--out", str(out), *FAST, *EXTRA.get(preset, [])]
        assert main(argv) == 0
        _built[preset] = out
    return _built[preset]


def _counts(m) -> dict[str, dict[str, int]]:
    c = {"train": {t: m.tasks[t].train.count for t in m.task_order}}
    for s, es in m.eval_sets.items():
        per = {t: ss.count for t, ss in es.tasks.items() if ss.count}
        if per:
            c[s] = per
    return c


@pytest.mark.parametrize("preset", list(EXPECTED))
def test_preset_counts_per_task_and_benchmark(raw, preset):
    out = build(raw, preset)
    m = load_manifest(out)
    want, bench = EXPECTED[preset]
    assert m.source == "protocol" and m.source_args["protocol"] == preset
    assert m.task_order == list(want["train"])
    assert _counts(m) == want
    assert {b: bm.shards.count for b, bm in m.benchmarks.items()} == bench
    assert list(m.benchmarks) == list(bench)  # the paper's order
    # archive sources are built inside --out; URL sources are referenced through sources/
    for s in m.sources:
        assert (out / s["link"] / "stream.json").is_file()
    rep = json.loads((out / "build_report.json").read_text())
    assert rep["counts"]["train"] == want["train"]


def test_preset_errors(raw, tmp_path, capsys):
    argv = ["build-stream", "protocol", "dha-citm", "--data", str(raw["data"]), *FAST]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "needs a 'cc3m' stream" in err and "cvl build-stream cc3m" in err
    argv = ["build-stream", "protocol", "dkr-s1", "--data", str(raw["data"]), *FAST]
    assert main([*argv, "--out", str(tmp_path / "b"), "--set", "coco.max_trian=5"]) == 2
    assert "unknown parameter" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "c"), "--set", "iapr.test=99"]) == 2
    assert "leaves no training images" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing half-built


@pytest.mark.parametrize("preset", list(EXPECTED))
def test_preset_trains_one_step(raw, preset, tmp_path):
    stream = build(raw, preset)
    run = tmp_path / "run"
    assert main(["train", "--stream", str(stream), "--out", str(run), *TINY_TRAIN]) == 0
    done = sorted(p.name for p in (run / "tasks").iterdir())
    order = load_manifest(stream).task_order
    assert done == [f"{i:02d}-{t}" for i, t in enumerate(order)]


@pytest.mark.slow
def test_benchmarks_scored_after_every_task(raw, tmp_path):
    stream = build(raw, "dkr-s2")
    run = tmp_path / "run"
    assert main(["train", "--stream", str(stream), "--out", str(run), *TINY_TRAIN]) == 0
    rc = main(["eval", "--run", str(run), "--quiet", "--no-plots", "--no-probe", "--no-zeroshot"])
    assert rc == 0
    met = json.loads((run / "eval" / "metrics.json").read_text())
    b = met["benchmarks"]
    assert list(b) == ["f30k-1k", "coco-5k", "ec-5k"]
    labels = ["init"] + [f"{i:02d}-ec-{i + 1}" for i in range(5)]
    for name, n_img, n_txt in (("f30k-1k", 5, 25), ("coco-5k", 6, 30), ("ec-5k", 6, 6)):
        assert b[name]["rows"] == labels
        assert (b[name]["n_images"], b[name]["n_texts"]) == (n_img, n_txt)
        assert all(v is not None and 0 <= v <= 100 for v in b[name]["metrics"]["TR@1"])
    # benchmarks are not tasks: the R matrices have the five EC parts only
    assert met["tasks"] == [f"ec-{i}" for i in range(1, 6)]
    summary = (run / "eval" / "summary.md").read_text()
    assert "Benchmarks (eval sets of no task)" in summary
