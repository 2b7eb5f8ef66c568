"""cc12m / cc3m instance splits, wit, goodnews and table sources against the loopback server.

The images were fetched from the loopback server by img2dataset in one run for all fixtures
(`prefetched`, to save ~5 s of img2dataset start-up per source); every build asserts it
needed nothing beyond that cache (``fetched_now == 0``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from sources_helpers import (  # noqa: F401  (image_server, prefetched are fixtures)
    close_rgb,
    copy_fixture,
    expected_rgb,
    fast_args,
    image_server,
    jpeg_bytes,
    mean_rgb,
    prefetched,
)

from cvl.cli import main
from cvl.data.reader import PairDataset
from cvl.streams.manifest import load_manifest


def run(*args: str) -> int:
    return main(["build-stream", *args])


def report(out: Path) -> dict:
    rep = json.loads((out / "build_report.json").read_text())
    if "download" in rep:
        assert rep["download"]["fetched_now"] == 0, "a source asked for a URL not in its fixture"
    return rep


def cached(downloads: Path) -> list[str]:
    return fast_args(downloads) + ["--no-retry-failed"]


def all_samples(m, split: str = "train") -> list[dict]:  # noqa: ANN001
    out = []
    for t in m.task_order:
        if split == "train":
            shards = m.train_shards(t)
        elif t in m.eval_sets.get(split, type("E", (), {"tasks": {}})).tasks:
            shards = m.eval_shards(split, t)
        else:
            continue
        ds = PairDataset.from_shards(shards)
        for i in range(len(ds)):
            img, cap, meta = ds.read_raw(i)
            out.append({"img": img, "caption": cap, **meta})
    return out


def check_images(samples: list[dict]) -> None:
    """Each sample's image is the one the server paints for its URL."""
    for s in samples:
        assert close_rgb(mean_rgb(s["img"]), expected_rgb(s["url"].rsplit("/", 1)[-1])), s["id"]


def test_cc12m_instance_split_sample_and_determinism(tmp_path, image_server, prefetched):  # noqa: F811
    tsv = copy_fixture("cc12m.tsv", tmp_path, image_server.base)
    with open(tsv, "ab") as f:  # a line that is not UTF-8
        f.write(image_server.base.encode() + b"/img/cc12m-z.jpg\tcaf\xe9 au lait \xff\n")
    out = tmp_path / "cc"
    args = ["--tsv", str(tsv), "--chunks", "2", "--sample", "6", "--test", "1", "--seed", "3"]
    assert run("cc12m", *args, "--out", str(out), *cached(prefetched)) == 0
    m = load_manifest(out)
    assert m.task_order == ["chunk0", "chunk1"] and m.source == "cc12m"
    train = [m.tasks[t].train.count for t in m.task_order]
    test = [
        m.eval_sets["test"].tasks[t].count
        if "test" in m.eval_sets and t in m.eval_sets["test"].tasks
        else 0
        for t in m.task_order
    ]
    assert train[0] == train[1] and train[0] in (2, 3)  # 3 each, minus the 404 if drawn
    assert sum(test) + 2 * train[0] + report(out)["dropped"].get("chunk_balance", 0) == 7
    rep = report(out)
    assert rep["sampled"] == {"usable": 10, "asked": 8, "taken": 8}
    assert rep["dropped"]["malformed_row"] == 1
    assert rep["dropped"]["missing_caption"] == 1
    assert rep["dropped"]["non_utf8"] == 1
    assert "instance split: 2 seeded random equal chunk(s)" in m.split_rule
    samples = all_samples(m) + all_samples(m, "test")
    check_images(samples)
    assert all(s["id"].startswith("cc12m-") and s["source"] == "cc12m" for s in samples)
    assert len({s["id"] for s in samples}) == len(samples)

    # same seed -> byte-identical shards (images from the cache, nothing downloaded)
    image_server.reset()
    out2 = tmp_path / "cc-again"
    fa = cached(prefetched)
    assert run("cc12m", *args, "--out", str(out2), *fa) == 0
    assert image_server.total() == 0
    for t in m.task_order:
        a = (out / "train" / t / "000000.tar").read_bytes()
        assert a == (out2 / "train" / t / "000000.tar").read_bytes()


def test_cc3m_single_task_with_val_and_test(tmp_path, image_server, prefetched):  # noqa: F811
    tsv = copy_fixture("cc3m.tsv", tmp_path, image_server.base)
    out = tmp_path / "cc3m"
    args = ["--tsv", str(tsv), "--val", "1", "--test", "1"]
    assert run("cc3m", *args, "--out", str(out), *cached(prefetched)) == 0
    m = load_manifest(out)
    assert m.task_order == ["cc3m"]
    rep = report(out)
    assert rep["kept_total"] == 6  # 7 usable lines, one corrupt image
    assert rep["dropped"] == {"bad_url": 1, "failed_to_resize": 1}
    samples = all_samples(m)
    check_images(samples)
    by_id = {s["id"]: s for s in samples}
    if "cc3m-000000000" in by_id:  # caption first, url second
        assert by_id["cc3m-000000000"]["caption"] == "actor attends the premiere of the film"
    assert sum(rep["kept"].values()) == 6 and set(rep["kept"]) <= {"train", "val", "test"}


def test_wit_english_reference_descriptions(tmp_path, image_server, prefetched):  # noqa: F811
    gz = copy_fixture("wit_v1.sample.tsv.gz", tmp_path, image_server.base)
    out = tmp_path / "wit"
    assert run("wit", "--tsv", str(gz), "--test", "1", "--out", str(out), *cached(prefetched)) == 0
    m = load_manifest(out)
    assert m.task_order == ["wit"]
    rep = report(out)
    assert rep["read"] == 10
    assert rep["dropped"] == {
        "language": 1,
        "mime_type": 1,
        "missing_caption": 1,
        "failed_to_download": 1,
    }
    assert rep["kept_total"] == 6 and set(rep["kept"]) <= {"train", "test"}
    assert rep["split"]["selected"]["test"] == 1  # one held out (it may be the 404 one)
    samples = {s["id"]: s for s in all_samples(m) + all_samples(m, "test")}
    check_images(list(samples.values()))
    a = samples["wit-0-000000000"]
    assert a["caption"] == "The tower seen from the Champ de Mars"
    assert a["page_title"] == "Eiffel Tower" and a["language"] == "en"
    assert "wit-0-000000002" in samples  # the row with tabs/quotes/newline in a quoted field


def test_goodnews_official_splits(tmp_path, image_server, prefetched):  # noqa: F811
    d = copy_fixture("goodnews", tmp_path / "gn", image_server.base)
    out = tmp_path / "goodnews"
    args = [
        "--captions",
        str(d / "captioning_dataset.json"),
        "--urls",
        str(d / "img_urls.json"),
        "--splits",
        str(d / "img_splits.json"),
    ]
    assert run("goodnews", *args, "--out", str(out), *cached(prefetched)) == 0
    m = load_manifest(out)
    assert m.task_order == ["goodnews"]
    assert m.tasks["goodnews"].train.count == 4  # 5 official train images, one URL 404s
    assert m.eval_sets["val"].tasks["goodnews"].count == 1
    assert m.eval_sets["test"].tasks["goodnews"].count == 2
    rep = report(out)
    assert rep["dropped"] == {"malformed_row": 1, "failed_to_download": 1}
    tests = {s["id"]: s for s in all_samples(m, "test")}
    assert set(tests) == {"5a1b2c3d95d0e0246f21a002_1", "5a1b2c3d95d0e0246f21a004_0"}
    s = tests["5a1b2c3d95d0e0246f21a002_1"]
    assert s["caption"] == "Residents were evacuated from the building."
    assert s["article_id"] == "5a1b2c3d95d0e0246f21a002" and s["headline"] == "Headline of 002"
    check_images(list(tests.values()))


def test_table_csv_task_and_category_columns(tmp_path, image_server, prefetched):  # noqa: F811
    csv_path = copy_fixture("table/pairs.csv", tmp_path, image_server.base)
    out = tmp_path / "tab"
    args = [
        "--input",
        str(csv_path),
        "--url-col",
        "image",
        "--caption-col",
        "text",
        "--task-col",
        "domain",
        "--category-col",
        "label",
        "--id-col",
        "uid",
        "--test",
        "1",
    ]
    assert (
        run(
            "table",
            *args,
            "--out",
            str(out),
            "--order",
            "food,birds,cars",
            *cached(prefetched),
        )
        == 0
    )
    m = load_manifest(out)
    assert m.task_order == ["food", "birds", "cars"]
    rep = report(out)
    assert rep["dropped"] == {"missing_image": 1, "duplicate_id": 1, "failed_to_download": 1}
    counts = {
        t: m.tasks[t].train.count + m.eval_sets["test"].tasks.get(t, _Z).count for t in m.task_order
    }
    assert counts == {"food": 3, "birds": 3, "cars": 3}
    assert m.tasks["birds"].categories == ["eagle", "owl", "sparrow"]
    samples = all_samples(m)
    check_images(samples)
    assert {s["category"] for s in samples if s["task"] == "cars"} <= {"sedan", "truck", "van"}


class _Z:
    count = 0


def test_table_local_paths_parquet_jsonl_split_col(tmp_path, image_server, prefetched):  # noqa: F811
    import pyarrow as pa
    import pyarrow.parquet as pq

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    names = [f"p{i}" for i in range(8)]
    for n in names:
        (imgs / f"{n}.jpg").write_bytes(jpeg_bytes(n))
    splits = ["train", "train", "train", "test", "query", "gallery", "gallery", "bogus"]
    pq.write_table(
        pa.table(
            {
                "path": [f"{n}.jpg" for n in names] + ["missing.jpg"],
                "caption": [f"picture {n}" for n in names] + ["gone"],
                "split": splits + ["train"],
            }
        ),
        tmp_path / "t.parquet",
    )
    out = tmp_path / "local"
    image_server.reset()
    assert (
        run(
            "table",
            "--input",
            str(tmp_path / "t.parquet"),
            "--url-col",
            "path",
            "--caption-col",
            "caption",
            "--split-col",
            "split",
            "--images-root",
            str(imgs),
            "--task-name",
            "mine",
            "--out",
            str(out),
            *cached(prefetched),
        )
        == 0
    )
    assert image_server.total() == 0
    m = load_manifest(out)
    assert m.task_order == ["mine"] and m.tasks["mine"].train.count == 3
    assert {s: e.tasks["mine"].count for s, e in m.eval_sets.items()} == {
        "test": 1,
        "query": 1,
        "gallery": 2,
    }
    rep = report(out)
    assert rep["dropped"] == {"unknown_split": 1, "bad_image": 1}
    check = all_samples(m)
    for s in check:
        assert close_rgb(mean_rgb(s["img"]), expected_rgb(Path(s["file"]).stem))

    # JSONL with a malformed line, mixed URL and path, seeded chunks
    lines = [
        json.dumps({"u": image_server.url(f"img/tab-{n}.jpg"), "c": f"url pair {n}"})
        for n in ("sparrow", "eagle", "owl", "dup")
    ]
    lines += [json.dumps({"u": str(imgs / f"p{i}.jpg"), "c": f"file pair {i}"}) for i in range(4)]
    lines.insert(3, "{not json")
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    out2 = tmp_path / "mixed"
    assert (
        run(
            "table",
            "--input",
            str(tmp_path / "t.jsonl"),
            "--url-col",
            "u",
            "--caption-col",
            "c",
            "--chunks",
            "2",
            "--out",
            str(out2),
            *cached(prefetched),
        )
        == 0
    )
    m2 = load_manifest(out2)
    assert m2.task_order == ["all0", "all1"]
    assert [m2.tasks[t].train.count for t in m2.task_order] == [4, 4]
    assert report(out2)["dropped"] == {"malformed_row": 1}
    kinds = Counter("url" if "file" not in s else "file" for s in all_samples(m2))
    assert kinds == {"url": 4, "file": 4}


def test_table_errors(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\nhttp://127.0.0.1:9/1.jpg,cap\n")
    base = ["table", "--input", str(p), "--out", str(tmp_path / "o"), "--quiet"]
    assert run(*base, "--url-col", "url", "--caption-col", "b") == 2  # no such column
    assert (
        run(*base, "--url-col", "a", "--caption-col", "b", "--task-col", "b", "--sample", "3") == 2
    )
    assert (
        run(
            "table",
            "--input",
            str(tmp_path / "nope.csv"),
            "--url-col",
            "a",
            "--caption-col",
            "b",
            "--out",
            str(tmp_path / "o"),
        )
        == 2
    )
    assert not (tmp_path / "o").exists()
    # the download cache may not live inside the stream folder
    bad = ["--url-col", "a", "--caption-col", "b", "--downloads", str(tmp_path / "o" / "dl")]
    assert run(*base, *bad) == 2
    assert not (tmp_path / "o").exists()


def test_tic_datacomp_metadata_time_split(tmp_path, image_server, prefetched):  # noqa: F811
    """TiC-DataComp's real format (uid, url, caption, timestamp; TiC's year -> retrieval uids
    JSON): 2014-2016 merged, one task a year to 2022 = 7 training tasks against 9 yearly
    retrieval sets (the uids of the JSON); 2023, a missing and an unreadable date dropped."""
    src = copy_fixture("tic-datacomp", tmp_path / "fx", image_server.base)
    out = tmp_path / "tic"
    argv = ["table", "--input", str(src / "metadata.csv"), "--id-col", "uid", "--url-col", "url"]
    argv += ["--caption-col", "caption", "--time-col", "timestamp", "--first-until", "2016"]
    argv += ["--until", "2022", "--eval-ids", str(src / "retrieval_evals_year2uids.json")]
    assert run(*argv, "--out", str(out), *cached(prefetched)) == 0
    m = load_manifest(out)
    years = [str(y) for y in range(2014, 2023)]
    assert m.task_order == ["2014-2016", *years[3:]] and len(m.task_order) == 7
    assert m.time["periods"] == years and list(m.benchmarks) == [f"ret-{y}" for y in years]
    assert [m.tasks[t].train.count for t in m.task_order] == [9, 3, 3, 3, 3, 3, 3]
    evals = json.loads((src / "retrieval_evals_year2uids.json").read_text())
    for y in years:
        (s,) = all_samples_of(m.benchmark_shards(f"ret-{y}"))
        assert s["id"] == evals[y][0] and s["period"] == y
    rep = report(out)
    assert rep["dropped"] == {"after_until": 1, "missing_date": 1, "bad_date": 1}
    assert rep["time"]["periods"]["2015"] == {"task": "2014-2016", "train": 3, "val": 0, "test": 1}


def all_samples_of(shards: list) -> list[dict]:
    import webdataset as wds

    return [
        json.loads(x["json"]) for sh in shards for x in wds.WebDataset(str(sh), shardshuffle=False)
    ]


@pytest.mark.parametrize("src", ["cc12m", "cc3m"])
def test_cc_missing_file(tmp_path, src):
    assert run(src, "--tsv", str(tmp_path / "none.tsv"), "--out", str(tmp_path / "o")) == 2


@pytest.mark.slow
def test_url_source_to_class_split_trains_and_evaluates(tmp_path, image_server, prefetched):  # noqa: F811
    """CC12M fixture (loopback URLs) -> pseudo-label -> class split -> 1 training step -> eval."""
    from pseudolabel_helpers import save_tiny_beit

    tiny_beit = save_tiny_beit(tmp_path / "tiny-beit")
    tsv = copy_fixture("cc12m.tsv", tmp_path, image_server.base)
    pool = tmp_path / "pool"
    args = ["--tsv", str(tsv), "--chunks", "1", "--test", "3"]
    assert (
        main(
            [
                "build-stream",
                "cc12m",
                *args,
                "--out",
                str(pool),
                *fast_args(prefetched),
                "--no-retry-failed",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "pseudo-label",
                "--stream",
                str(pool),
                "--model",
                str(tiny_beit),
                "--quiet",
                "--batch-size",
                "4",
            ]
        )
        == 0
    )
    out = tmp_path / "cs"
    assert (
        main(
            [
                "build-stream",
                "class-split",
                "--from",
                str(pool),
                "--out",
                str(out),
                "--steps",
                "2",
                "--seed",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    m = load_manifest(out)
    assert m.source == "cc12m" and all(m.tasks[t].train.count > 0 for t in m.task_order)
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--stream",
                str(out),
                "--method",
                "seqft",
                "--model-config",
                "tiny-vit",  # no BatchNorm: a task may hold a single pair
                "--epochs",
                "1",
                "--max-steps-per-task",
                "1",
                "--batch-size",
                "4",
                "--log-with",
                "none",
                "--quiet",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    tmpl = tmp_path / "one_template.txt"  # 1000 classes x CLIP's 80 templates: minutes on CPU
    tmpl.write_text("a photo of a {}.\n")
    ev = ["eval", "--run", str(run), "--quiet", "--no-probe", "--no-init", "--no-plots"]
    ev += ["--tasks", "last", "--zs-templates", str(tmpl)]
    assert main(ev) == 0
    met = json.loads((run / "eval" / "metrics.json").read_text())
    assert "ZS-top1" in met["metrics"] and "ZS-all-top1" in met["metrics"]
    last = met["rows"][-1]
    infos = met["details"][last]
    for t in m.task_order:
        if "zeroshot" in infos[t]:  # a task with test images: its 500 classes vs all 1000
            assert infos[t]["zeroshot"]["n_classes"] == 500
            assert infos[t]["zeroshot_all"]["n_classes"] == 1000
    assert any("zeroshot" in infos[t] for t in m.task_order)
