"""`cvl build-stream p9d` against a loopback image server, from real-format fixture JSONs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sources_helpers import (  # noqa: F401  (image_server is a fixture)
    close_rgb,
    copy_fixture,
    expected_rgb,
    fast_args,
    image_server,
    jpeg_bytes,
    mean_rgb,
)

from cvl.cli import main
from cvl.data.reader import PairDataset
from cvl.streams.manifest import load_manifest
from cvl.streams.p9d import TASKS

TRAIN = {
    "Household": 3,
    "Furnishings": 2,
    "Food": 2,
    "Beauty": 2,
    "Clothing": 2,
    "Auto": 2,
    "Parenting": 2,
    "Outdoor": 2,
    "Electronics": 2,
}
FAILED = {
    "/404/1004.jpg",
    "/corrupt/2003.jpg",
    "/slow/3003.jpg",
    "/noai/4003.jpg",
    "/html/7003.jpg",
}


def run(*args: str) -> int:
    return main(["build-stream", *args])


@pytest.fixture(scope="module")
def p9d_build(tmp_path_factory, image_server):  # noqa: F811
    root = tmp_path_factory.mktemp("p9d")
    ann = copy_fixture("p9d", root / "ann", image_server.base)
    out = root / "streams" / "p9d"
    image_server.reset()
    rc = run("p9d", "--annotations", str(ann), "--out", str(out), *fast_args(root / "dl"))
    assert rc == 0
    hits = dict(image_server.hits)
    return root, ann, out, hits


def test_default_order_counts_eval_sets_and_report(p9d_build):
    root, _, out, hits = p9d_build
    m = load_manifest(out)
    assert m.source == "p9d" and m.task_order == TASKS
    assert {t: m.tasks[t].train.count for t in TASKS} == TRAIN
    assert set(m.eval_sets) == {"test", "query", "gallery"}
    kinds = {s: e.kind for s, e in m.eval_sets.items()}
    assert kinds == {"test": "pairs", "query": "query", "gallery": "gallery"}
    for t in TASKS:
        assert m.eval_sets["test"].tasks[t].count == 1
        assert m.eval_sets["query"].tasks[t].count == 1
        assert m.eval_sets["gallery"].tasks[t].count == 2
    assert m.tasks["Household"].categories == ["收纳盒", "浴巾", "马克杯"]
    assert m.tasks["Food"].extra["industry"] == "食品/保健"
    # every URL was requested exactly once (the slow one maybe once more by no one)
    assert all(n == 1 for n in hits.values()), hits

    rep = json.loads((out / "build_report.json").read_text())
    assert rep["dropped"] == {
        "unknown_industry": 2,  # 宠物用品 in train.json, 图书音像 in test.json
        "unsafe_id": 1,  # ../5003
        "missing_caption": 1,  # 6003 has no title
        "duplicate_id": 1,  # 8001 listed under two industries
        "failed_to_download": 3,  # 404, slow (timeout), X-Robots-Tag: noai
        "failed_to_resize": 2,  # corrupt bytes, an HTML page
    }
    errors = rep["download"]["errors"]
    assert errors["failed_to_download: HTTP Error 404: Not Found"] == 1
    assert errors["failed_to_download: timed out"] == 1
    assert errors["failed_to_download: Use of image disallowed by X-Robots-Tag directive"] == 1
    assert errors["failed_to_resize: Image decoding error"] == 2
    assert rep["download"]["status"]["success"] == 55
    run0 = rep["download"]["img2dataset_runs"][0]
    assert run0["count"] == 60 and run0["successes"] == 55 and run0["watchdog"] is None
    dropped = [json.loads(x) for x in (out / "dropped.jsonl").read_text().splitlines()]
    assert len(dropped) == rep["dropped_total"] == 10
    assert {d["id"] for d in dropped if d["reason"] == "failed_to_resize"} == {"2003", "7003"}


def test_read_back_with_reader(p9d_build):
    _, _, out, _ = p9d_build
    m = load_manifest(out)
    ds = PairDataset.from_shards(m.train_shards("Household"))
    assert len(ds) == 3
    for i in range(len(ds)):
        img, cap, meta = ds.read_raw(i)
        assert meta["task"] == "Household" and meta["source"] == "p9d"
        assert meta["category"] and meta["industry"] == "家居用品"
        # the image in the shard is the one served for this item's URL
        name = meta["url"].rsplit("/", 1)[-1]
        assert close_rgb(mean_rgb(img), expected_rgb(name))
        assert cap and not cap.startswith("http")
    g = PairDataset.from_shards(m.eval_shards("gallery", "Food"))
    cats = {g.read_raw(i)[2]["category"] for i in range(len(g))}
    assert cats == {"坚果"}


def test_rebuild_fetches_only_failed_then_nothing(p9d_build, image_server):  # noqa: F811
    root, ann, out, _ = p9d_build
    image_server.reset()
    out2 = root / "streams" / "p9d-again"
    assert run("p9d", "--annotations", str(ann), "--out", str(out2), *fast_args(root / "dl")) == 0
    # successes come from the cache; only the 5 failed URLs were tried again
    assert set(image_server.hits) == FAILED
    rep = json.loads((out2 / "build_report.json").read_text())
    assert rep["download"]["from_cache"] == 55 and rep["download"]["fetched_now"] == 5
    assert load_manifest(out2).fingerprint["counts"] == TRAIN
    # shards are identical whatever run fetched the images
    a = (out / "train" / "Outdoor" / "000000.tar").read_bytes()
    assert a == (out2 / "train" / "Outdoor" / "000000.tar").read_bytes()

    image_server.reset()
    out3 = root / "streams" / "p9d-reversed"
    args = fast_args(root / "dl") + ["--order", "reversed", "--no-retry-failed"]
    assert run("p9d", "--annotations", str(ann), "--out", str(out3), *args) == 0
    assert image_server.total() == 0  # a different order downloads nothing
    m = load_manifest(out3)
    assert m.task_order == list(reversed(TASKS))
    assert m.source_args["order"] == "reversed"
    assert {t: m.tasks[t].train.count for t in TASKS} == TRAIN


def test_custom_order_subset_limits_and_overwrite(p9d_build, image_server):  # noqa: F811
    root, ann, _, _ = p9d_build
    image_server.reset()
    args = fast_args(root / "dl") + ["--no-retry-failed", "--limit-per-task", "1"]
    order = "Food,美容护理,household"
    out = root / "streams" / "p9d-custom"
    out.mkdir()
    (out / "keep.txt").write_text("an existing folder is not replaced without --overwrite")
    assert run("p9d", "--annotations", str(ann), "--out", str(out), "--order", order, *args) == 2
    assert (out / "keep.txt").is_file()
    rc = run("p9d", "--annotations", str(ann), "--out", str(out), "--overwrite", *args)
    assert rc == 2 and (out / "keep.txt").is_file()  # cvl did not write it: never deleted
    (out / "keep.txt").unlink()
    out.rmdir()
    assert run("p9d", "--annotations", str(ann), "--out", str(out), "--order", "Food", *args) == 0
    assert load_manifest(out).task_order == ["Food"]
    assert (  # a stream cvl wrote is replaced
        run(
            "p9d",
            "--annotations",
            str(ann),
            "--out",
            str(out),
            "--order",
            order,
            "--overwrite",
            *args,
        )
        == 0
    )
    m = load_manifest(out)
    assert m.task_order == ["Food", "Beauty", "Household"]
    assert {t: m.tasks[t].train.count for t in m.task_order} == {
        "Food": 1,
        "Beauty": 1,
        "Household": 1,
    }
    assert set(m.eval_sets["gallery"].tasks) == {"Food", "Beauty", "Household"}
    assert image_server.total() == 0
    assert (
        run(
            "p9d",
            "--annotations",
            str(ann),
            "--out",
            str(root / "x"),
            "--order",
            "Food,Toys",
            *args,
        )
        == 2
    )
    assert not (root / "x").exists()


def test_local_images_skip_downloads_and_bad_text(tmp_path, image_server, capsys):  # noqa: F811
    ann = copy_fixture("p9d", tmp_path / "ann", image_server.base)
    # one title that is not UTF-8 (Latin-1 bytes inside the JSON string)
    raw = (ann / "train.json").read_bytes()
    (ann / "train.json").write_bytes(raw.replace("瑜伽垫 加厚防滑".encode(), b"yoga mat \xe9\xff"))
    img = tmp_path / "P9D"
    (img / "train_images").mkdir(parents=True)
    (img / "gallery_images").mkdir()
    for iid in ("1001", "1002", "8001", "8002", "2001"):
        (img / "train_images" / f"{iid}.jpg").write_bytes(jpeg_bytes(f"local-{iid}", (300, 200)))
    (img / "train_images" / "2002.jpg").write_bytes(b"not a jpeg at all")
    for iid in ("11000", "12000", "13000", "13001"):  # Household test / query / gallery
        (img / "gallery_images" / f"{iid}.jpg").write_bytes(jpeg_bytes(f"local-{iid}"))
    image_server.reset()
    out = tmp_path / "p9d-local"
    rc = run(
        "p9d",
        "--annotations",
        str(ann),
        "--images",
        str(img),
        "--out",
        str(out),
        "--image-size",
        "64",
        *fast_args(tmp_path / "dl"),
    )
    assert rc == 0
    assert image_server.total() == 0
    assert not (tmp_path / "dl").exists()  # nothing to download: no cache made
    m = load_manifest(out)
    assert m.task_order == ["Household", "Furnishings", "Outdoor"]  # others have no train image
    assert {t: m.tasks[t].train.count for t in m.task_order} == {
        "Household": 2,
        "Furnishings": 1,
        "Outdoor": 1,
    }
    rep = json.loads((out / "build_report.json").read_text())
    assert rep["dropped"]["non_utf8"] == 1  # 8002's title
    assert rep["dropped"]["bad_image"] == 1  # 2002.jpg is not an image
    assert rep["dropped"]["image_missing"] > 20
    assert any("no usable training pairs" in w for w in rep["warnings"])
    ds = PairDataset.from_shards(m.train_shards("Household"))
    im, _, meta = ds.read_raw(0)
    assert im.size == (96, 64)  # shorter side resized to --image-size, ratio kept
    assert meta["file"] == "1001.jpg" and meta["url"].endswith("/img/1001.jpg")
    assert close_rgb(mean_rgb(im), expected_rgb("local-1001"))
    assert m.eval_sets["gallery"].tasks["Household"].count == 2


def test_p9d_errors(tmp_path):
    assert run("p9d", "--annotations", str(tmp_path), "--out", str(tmp_path / "o"), "--quiet") == 2
    (tmp_path / "train.json").write_text('{"家居用品": {"1": {"title": "x"', encoding="utf-8")
    assert run("p9d", "--annotations", str(tmp_path), "--out", str(tmp_path / "o"), "--quiet") == 2
    # nothing usable left: a clear error, no stream folder
    (tmp_path / "train.json").write_text(
        json.dumps(
            {
                "玩具": {
                    "1": {"title": "a", "cate_name": "b", "image_link": "http://127.0.0.1:9/1.jpg"}
                }
            }
        ),
        encoding="utf-8",
    )
    assert run("p9d", "--annotations", str(tmp_path), "--out", str(tmp_path / "o"), "--quiet") == 2
    assert not (tmp_path / "o").exists()


def test_help_texts(capsys):
    for cmd in ("p9d", "cc12m", "cc3m", "wit", "goodnews", "table"):
        assert main(["build-stream", cmd, "--help"]) == 0
        text = capsys.readouterr().out
        assert "--out" in text and "--downloads" in text and "--distributor" in text
    assert main(["build-stream", "p9d", "--help"]) == 0
    text = capsys.readouterr().out
    assert "Household" in text and "CC BY-NC-SA" in text and "--limit-per-task" in text


def test_manifest_paths_stay_inside(p9d_build):
    _, _, out, _ = p9d_build
    d = json.loads((out / "stream.json").read_text())
    for t in d["tasks"].values():
        for s in t["train"]["shards"]:
            assert not Path(s).is_absolute() and ".." not in Path(s).parts


def test_built_stream_trains_one_step(p9d_build, tmp_path):
    """The engine reads the built stream: one step per task with the tiny model."""
    _, _, out, _ = p9d_build
    rc = main(
        [
            "train",
            "--stream",
            str(out),
            "--out",
            str(tmp_path / "run"),
            "--epochs",
            "1",
            "--batch-size",
            "4",
            "--max-steps-per-task",
            "1",
            "--log-with",
            "none",
            "--checkpoint-every",
            "0",
            "--model-config",
            "tiny",
            "--quiet",
        ]
    )
    assert rc == 0
    done = sorted(p.name for p in (tmp_path / "run" / "tasks").iterdir())
    assert done == [f"{i:02d}-{t}" for i, t in enumerate(TASKS)]
