"""`cvl pseudo-label` (transformers classifier, resumable, multi-process) and class splits.

The classifier is a tiny random `BeitForImageClassification` (2 layers, 32 px, 1000 labels)
saved with `save_pretrained` beside its `BeitImageProcessor`; nothing is downloaded. Its
classifier weights are drawn with std 1 (not 0.02) so its top-1 classes vary across images.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from pseudolabel_helpers import save_tiny_beit

import cvl.streams.pseudolabel as pl
from cvl.cli import main
from cvl.errors import CvlError
from cvl.streams.classsplit import ClassSplitOptions, build_class_split, partition_classes
from cvl.streams.manifest import load_manifest, manifest_from_json

UNIT, BATCH = 32, 16


@pytest.fixture(scope="module")
def tiny_beit(tmp_path_factory) -> Path:
    return save_tiny_beit(tmp_path_factory.mktemp("models") / "tiny-beit")


@pytest.fixture(scope="module")
def labelled(synth_stream, tiny_beit, tmp_path_factory) -> Path:
    """A copy of the synthetic stream labelled in one uninterrupted run (the reference)."""
    s = tmp_path_factory.mktemp("labelled") / "synth"
    shutil.copytree(synth_stream, s)
    pl.label_stream(s, _opts(tiny_beit))
    return s


def _opts(model: Path, **kw) -> pl.LabelOptions:
    return pl.LabelOptions(
        **{"model": str(model), "batch_size": BATCH, "unit_size": UNIT, "progress": False, **kw}
    )


def _label_files(stream: Path, name: str = "tiny-beit") -> dict[str, bytes]:
    root = stream / "labels" / name
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jsonl"))}


def test_labels_every_image_beside_the_shards(labelled, synth_stream):
    m = load_manifest(labelled)
    root = labelled / "labels" / "tiny-beit"
    info = json.loads((root / "labels.json").read_text())
    assert info["n_classes"] == 1000 and len(info["classes"]) == 1000
    assert info["classes"][7] == "LABEL_7"  # the checkpoint's id2label
    files = _label_files(labelled)
    assert set(files) == {f"train/{t}.jsonl" for t in m.task_order} | {
        f"eval/{s}/{t}.jsonl" for s, es in m.eval_sets.items() for t in es.tasks
    }
    from cvl.data.reader import PairDataset

    ds = PairDataset.from_shards(m.train_shards("t0"))
    recs = [json.loads(x) for x in files["train/t0.jsonl"].decode().splitlines()]
    assert [r["key"] for r in recs] == [e.key for e in ds.entries]  # shard order, every sample
    assert info["labelled"] == sum(m.tasks[t].train.count for t in m.task_order) + sum(
        s.count for es in m.eval_sets.values() for s in es.tasks.values()
    )
    # the stored top-1 is the model's argmax and its softmax probability
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    path = info["model"]
    model = AutoModelForImageClassification.from_pretrained(path).eval()
    proc = AutoImageProcessor.from_pretrained(path)
    img, _, meta = ds.read_raw(3)
    with torch.no_grad():
        p = model(**proc(images=img, return_tensors="pt")).logits.softmax(-1)[0]
    assert recs[3]["class"] == int(p.argmax()) and recs[3]["label"] == f"LABEL_{int(p.argmax())}"
    assert abs(recs[3]["score"] - float(p.max())) < 1e-5 and recs[3]["id"] == meta["id"]
    assert len({r["class"] for r in recs}) > 3  # the tiny model does not predict one class
    # the shards were not touched
    for t in m.task_order:
        for a, b in zip(m.train_shards(t), load_manifest(synth_stream).train_shards(t)):
            assert a.read_bytes() == b.read_bytes()
    # a second run finds the labels complete and does nothing
    assert pl.label_stream(labelled, _opts(Path(path)))["already_complete"]


def test_interrupted_run_resumes_to_identical_labels(
    labelled, synth_stream, tiny_beit, tmp_path, monkeypatch
):
    s = tmp_path / "synth"
    shutil.copytree(synth_stream, s)
    writes = []
    real = pl.atomic_write_bytes

    def crash_after_three(path, data):  # noqa: ANN001
        if len(writes) == 3:
            raise KeyboardInterrupt  # as if the job were stopped mid-run
        writes.append(path)
        real(path, data)

    monkeypatch.setattr(pl, "atomic_write_bytes", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        pl.label_stream(s, _opts(tiny_beit))
    parts = s / "labels" / "tiny-beit" / ".parts"
    assert len(list(parts.rglob("*.jsonl"))) == 3
    assert not (s / "labels" / "tiny-beit" / "labels.json").exists()
    # another model cannot continue this run
    with pytest.raises(CvlError, match="other settings"):
        pl.label_stream(s, _opts(tiny_beit, batch_size=8))
    monkeypatch.setattr(pl, "atomic_write_bytes", real)
    n_units = len(pl.plan_units(pl.stream_parts(load_manifest(s)), UNIT)[0])
    done = []
    monkeypatch.setattr(pl, "atomic_write_bytes", lambda p, d: (done.append(p), real(p, d)))
    info = pl.label_stream(s, _opts(tiny_beit))
    assert len([p for p in done if ".parts" in str(p)]) == n_units - 3  # only what was left
    assert _label_files(s) == _label_files(labelled)
    assert info["labelled"] > 0 and not parts.exists()


def test_bad_models_give_one_line_errors(tmp_path, synth_stream, capsys):
    headless = save_tiny_beit(tmp_path / "beit-no-head", head=False)
    with pytest.raises(CvlError, match="no trained classifier head"):
        pl.load_classifier(str(headless))
    (tmp_path / "empty").mkdir()
    capsys.readouterr()  # transformers >= 5.2x prints "Writing model shards" bars when saving
    rc = main(["pseudo-label", "--stream", str(synth_stream), "--model", str(tmp_path / "empty")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --model") and "not a transformers" in err[0]
    assert not (synth_stream / "labels").exists()


def _write_stream(root: Path, samples: list[tuple[str, bytes, str | None]]) -> Path:
    """A one-task stream written by hand (key, image bytes, category)."""
    from cvl.streams.manifest import Manifest, TaskInfo, save_manifest
    from cvl.streams.writer import ShardSink

    sink = ShardSink(root, "train/a", maxcount=100)
    for k, jpg, cat in samples:
        sink.write(k, jpg, f"caption {k}", {"id": k, "task": "a", "category": cat})
    m = Manifest("hand", "table", "one task", 0, ["a"], {"a": TaskInfo("a", sink.close())})
    save_manifest(m, root)
    return root


def test_unreadable_image_is_skipped_and_counted(tmp_path, tiny_beit):
    from PIL import Image

    from cvl.streams.writer import encode_jpeg

    good = [
        (f"s{i}", encode_jpeg(Image.new("RGB", (40, 30), (20 * i, 90, 200))), None)
        for i in range(5)
    ]
    s = _write_stream(
        tmp_path / "hand", [*good[:2], ("bad", b"\xff\xd8\xff\xe0 not a jpeg", None), *good[2:]]
    )
    info = pl.label_stream(s, _opts(tiny_beit, batch_size=2, unit_size=4))
    assert info["labelled"] == 5 and info["unreadable"] == 1
    recs = pl.read_labels(s / "labels" / "tiny-beit", "train/a")
    assert recs["bad"]["class"] is None and recs["bad"]["error"].startswith("unreadable_image")
    # a class outside the classifier's range in a labels file is refused by the class split
    f = s / "labels" / "tiny-beit" / "train" / "a.jsonl"
    lines = f.read_text().splitlines()
    r = json.loads(lines[0])
    r["class"] = 1003
    f.write_text("\n".join([json.dumps(r), *lines[1:]]) + "\n")
    with pytest.raises(CvlError, match=r"class 1003 is outside the classifier's range 0..999"):
        build_class_split(s, tmp_path / "cs", ClassSplitOptions(steps=2, progress=False))


def test_partition_is_disjoint_covering_seeded_and_balanced():
    order, groups = partition_classes(1000, 4, seed=0)
    assert [len(g) for g in groups] == [250] * 4
    flat = [c for g in groups for c in g]
    assert sorted(flat) == list(range(1000)) and flat == order  # disjoint, covering, in order
    assert partition_classes(1000, 4, seed=0) == (order, groups)
    assert partition_classes(1000, 4, seed=1)[0] != order
    assert order != list(range(1000))
    assert [len(g) for g in partition_classes(1000, 8, seed=0)[1]] == [125] * 8
    assert [len(g) for g in partition_classes(10, 3)[1]] == [4, 3, 3]
    assert partition_classes(6, 2, shuffle=False)[1] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(CvlError, match="more steps than classes"):
        partition_classes(3, 4)


def test_class_split_from_pseudo_labels(labelled, tmp_path):
    out = tmp_path / "cs"
    rc = main(
        [
            "build-stream",
            "class-split",
            "--from",
            str(labelled),
            "--out",
            str(out),
            "--steps",
            "2",
            "--seed",
            "0",
            "--quiet",
        ]
    )
    assert rc == 0
    m = load_manifest(out)
    cm = m.class_map
    assert m.task_order == ["step0", "step1"] and len(cm["names"]) == 1000
    _, groups = partition_classes(1000, 2, seed=0)
    assert cm["order"] == [c for g in groups for c in g]
    assert [cm["task_of"][c] for c in groups[1][:5]] == ["step1"] * 5
    assert cm["prompts"][0] == "tench"  # 1000 classes: CLIP's cleaned ImageNet names
    assert m.tasks["step0"].extra["classes"] == sorted(groups[0])
    # every sample sits in the task of its label; counts match the labels
    src = load_manifest(labelled)
    want = Counter()
    for t in src.task_order:
        for r in pl.read_labels(labelled / "labels" / "tiny-beit", f"train/{t}").values():
            want[cm["task_of"][r["class"]]] += 1
    from cvl.data.reader import PairDataset

    for t in m.task_order:
        ds = PairDataset.from_shards(m.train_shards(t))
        assert len(ds) == m.tasks[t].train.count == want[t] > 0
        for i in range(len(ds)):
            _, _, meta = ds.read_raw(i)
            assert meta["task"] == t and cm["task_of"][meta["class"]] == t
            assert meta["category"] == cm["names"][meta["class"]] and meta["source_task"]
    assert set(m.eval_sets) == set(src.eval_sets)
    # threshold + caps
    scores = sorted(
        r["score"]
        for t in src.task_order
        for r in pl.read_labels(labelled / "labels" / "tiny-beit", f"train/{t}").values()
    )
    thr = scores[len(scores) // 2]
    m2, rep = build_class_split(
        labelled,
        tmp_path / "cs2",
        ClassSplitOptions(steps=2, min_score=thr, per_task=40, progress=False),
    )
    assert all(m2.tasks[t].train.count <= 40 for t in m2.task_order)
    assert rep["dropped"]["below_min_score"] >= len(scores) // 2 - 1
    # an empty chunk is an error naming it
    with pytest.raises(CvlError, match=r"task 'step\d' \(chunk \d: 250 classes"):
        build_class_split(labelled, tmp_path / "cs3", ClassSplitOptions(steps=4, min_score=0.9))


def test_class_split_by_category_and_stream_without_labels(synth_stream, tmp_path):
    m, _ = build_class_split(
        synth_stream,
        tmp_path / "cat",
        ClassSplitOptions(steps=2, labels="category", progress=False),
    )
    cm = m.class_map
    assert cm["prompts"] == cm["names"] and set(cm["task_of"]) == {"step0", "step1"}
    assert set(m.tasks["step0"].categories).isdisjoint(m.tasks["step1"].categories)
    with pytest.raises(CvlError, match="has no labels: run `cvl pseudo-label"):
        build_class_split(synth_stream, tmp_path / "x", ClassSplitOptions(steps=2))


def test_manifest_class_map_is_optional_and_validated(tmp_path, synth_stream):
    d = json.loads((synth_stream / "stream.json").read_text())
    assert manifest_from_json(d).class_map is None  # streams without it read as before
    d["class_map"] = {"names": ["a", "b"], "task_of": ["t0", "nope"]}
    with pytest.raises(CvlError, match=r"class_map.task_of\[1\]: unknown task 'nope'"):
        manifest_from_json(d)
    d["class_map"] = {"names": ["a", "b"], "task_of": ["t0", None], "prompts": ["x", "y"]}
    m = manifest_from_json(d)
    assert m.split_classes() == ["a"] and m.prompt_names(["b", "c"]) == ["y", "c"]
    assert manifest_from_json(m.to_json()).class_map == d["class_map"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_give_the_same_labels(labelled, synth_stream, tiny_beit, tmp_path):
    s = tmp_path / "synth"
    shutil.copytree(synth_stream, s)
    from device_helpers import dist_env

    env = dist_env(2)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        "-m",
        "cvl",
        "pseudo-label",
        "--stream",
        str(s),
        "--model",
        str(tiny_beit),
        "--batch-size",
        str(BATCH),
        "--unit-size",
        str(UNIT),
        "--quiet",
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("images labelled") == 1  # the main process reports
    assert _label_files(s) == _label_files(labelled)


def test_zeroshot_among_task_seen_and_all_classes(monkeypatch):
    """IncCLIP's protocol from the class map, on hand-made embeddings.

    Classes a, b (task t0) and c, d (task t1); prompt vectors pa = (1,0,0), pb = (0,1,0),
    pc = (0,0,1), pd = norm(1, .2, 0). Test images: t0 has x_a = norm(1, .3, 0) of class a
    (cos to pa .958, to pd .996: d wins once d is a candidate) and x_b = (0,1,0); t1 has
    x_c = (0,0,1). Among a task's classes everything is right; among all classes x_a is wrong.
    """
    from cvl.evaluation import checkpoint, runner, zeroshot
    from cvl.evaluation.embed import Embeddings
    from cvl.streams.manifest import EvalSet, Manifest, ShardSet, TaskInfo

    n = torch.nn.functional.normalize
    protos = {
        "pa": [1.0, 0, 0],
        "pb": [0, 1.0, 0],
        "pc": [0, 0, 1.0],
        "pd": n(torch.tensor([1.0, 0.2, 0]), dim=0).tolist(),
    }
    asked = []

    def class_embeddings(model, names, templates, batch_size, precision="no"):  # noqa: ANN001, ANN202
        asked.append(list(names))
        return torch.tensor([protos[x] for x in names])

    def embed(self, shards, desc, **kw):  # noqa: ANN001, ANN202
        feats = {
            "test/t0": (n(torch.tensor([[1.0, 0.3, 0], [0, 1.0, 0]]), dim=-1), ["a", "b"]),
            "test/t1": (torch.tensor([[0, 0, 1.0]]), ["c"]),
        }[desc]
        k = len(feats[1])
        return Embeddings(
            feats[0],
            feats[0],
            torch.arange(k),
            [f"{desc}{i}" for i in range(k)],
            [f"{desc}{i}" for i in range(k)],
            feats[1],
            [desc] * k,
        )

    monkeypatch.setattr(zeroshot, "class_embeddings", class_embeddings)
    monkeypatch.setattr(checkpoint.EvalContext, "embed", embed)
    ss = ShardSet(["x.tar"], 1)
    tasks = {
        "t0": TaskInfo("t0", ss, categories=["a", "b"]),
        "t1": TaskInfo("t1", ss, categories=["c", "d"]),
    }
    m = Manifest(
        "cs",
        "cc12m",
        "class split",
        0,
        ["t0", "t1"],
        tasks,
        eval_sets={"test": EvalSet("pairs", {"t0": ss, "t1": ss})},
        class_map={
            "names": ["a", "b", "c", "d"],
            "prompts": ["pa", "pb", "pc", "pd"],
            "task_of": ["t0", "t0", "t1", "t1"],
        },
    )
    opts = runner.EvalOptions(probe=False, zs_templates="simple", progress=False)
    model = type("M", (), {"has_fusion": False})()
    r = runner.evaluate_checkpoint(model, m, ["t0", "t1"], 2, opts)
    assert sorted(asked[0]) == ["pa", "pb", "pc", "pd"]  # prompts come from the class map
    pt = r["per_task"]
    assert pt["t0"]["ZS-top1"] == 100.0 and pt["t0"]["ZS-all-top1"] == 50.0
    assert pt["t1"]["ZS-top1"] == 100.0 and pt["t1"]["ZS-all-top1"] == 100.0
    assert r["info"]["t0"]["zeroshot"]["n_classes"] == 2
    assert r["info"]["t0"]["zeroshot_all"]["n_classes"] == 4
    assert pt["t1"]["ZS-top5"] is None  # top-5 of 2 classes is not reported
    c0, c1 = r["cumulative"]["0"]["metrics"], r["cumulative"]["1"]["metrics"]
    assert c0["ZS-top1"] == 100.0 and c0["ZS-all-top1"] == 50.0  # seen {a, b} vs all
    assert abs(c1["ZS-top1"] - 200 / 3) < 1e-4 and abs(c1["ZS-all-top1"] - 200 / 3) < 1e-4
