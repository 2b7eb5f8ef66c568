"""The download layer (cache, watchdog, child failures) and the split rules, without img2dataset.

A fake img2dataset child (a small script given as the child command) writes shards in
img2dataset's layout, so the watchdog and the cache index are tested in milliseconds.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import time
from pathlib import Path

import pytest
from sources_helpers import jpeg_bytes

from cvl.errors import CvlError
from cvl.streams.download import DownloadCache, DownloadOptions, ImageOptions
from cvl.streams.pipeline import (
    ClassSplit,
    ColumnSplit,
    Dropper,
    InstanceSplit,
    Row,
    resolve_order,
    task_folders,
    validate_rows,
)
from cvl.streams.writer import BuildReport

FAKE = r"""
import io, json, sys, tarfile, time
import pyarrow as pa, pyarrow.parquet as pq
mode = sys.argv[1]
cfg = json.load(open(sys.argv[2]))
out = cfg["output_folder"]
import os; os.makedirs(out, exist_ok=True)
urls = pq.read_table(cfg["url_list"]).column("url").to_pylist()
if mode == "crash":
    print("Traceback: something broke badly", flush=True)
    sys.exit(3)
if mode == "stall":
    time.sleep(60)
jpg = open(sys.argv[3], "rb").read()
keys = [f"{i:09d}" for i in range(len(urls))]
with tarfile.open(f"{out}/00000.tar", "w") as tf:
    for k, u in zip(keys, urls):
        if "bad" in u:
            continue
        ti = tarfile.TarInfo(f"{k}.jpg"); ti.size = len(jpg); tf.addfile(ti, io.BytesIO(jpg))
status = ["failed_to_download" if "bad" in u else "success" for u in urls]
errs = ["HTTP Error 404: Not Found" if "bad" in u else None for u in urls]
pq.write_table(pa.table({"url": urls, "key": keys, "status": status, "error_message": errs}),
               f"{out}/00000.parquet")
# a second shard that never finishes (no _stats.json): must be ignored and cleaned up
open(f"{out}/00001.tar", "wb").write(b"partial")
json.dump({"count": len(urls), "successes": status.count("success"),
           "failed_to_download": status.count("failed_to_download"), "failed_to_resize": 0,
           "start_time": 1.0, "end_time": 2.0, "status_dict": {"success": 1}},
          open(f"{out}/00000_stats.json", "w"))
if mode == "hang":
    time.sleep(60)  # img2dataset's known hang after the last shard
"""


@pytest.fixture()
def fake(tmp_path):
    script = tmp_path / "fake_img2dataset.py"
    script.write_text(FAKE)
    jpg = tmp_path / "x.jpg"
    jpg.write_bytes(jpeg_bytes("fake"))

    def command(mode: str) -> list[str]:
        # the config path is appended by run_img2dataset; the fake takes it second
        return [
            sys.executable,
            "-c",
            "import runpy, sys; sys.argv = [sys.argv[0], sys.argv[1], sys.argv[3], sys.argv[2]];"
            f" runpy.run_path({str(script)!r}, run_name='__main__')",
            mode,
            str(jpg),
        ]

    return command


def quiet(msg: str) -> None:
    pass


def test_watchdog_kills_a_hanging_child_and_keeps_its_shards(tmp_path, fake):
    cache = DownloadCache(tmp_path / "dl", ImageOptions())
    opts = DownloadOptions(exit_grace=0.5, stall_timeout=30)
    urls = {"http://127.0.0.1:9/a.jpg": {"id": "a"}, "http://127.0.0.1:9/bad.jpg": {"id": "b"}}
    t0 = time.monotonic()
    recs, stats = cache.fetch(urls, opts, log=quiet, progress=False, command=fake("hang"))
    assert time.monotonic() - t0 < 20
    run = stats.runs[0]
    assert run["watchdog"].startswith("killed: all 1 shard(s) done")
    assert (
        recs["http://127.0.0.1:9/a.jpg"].ok
        and recs["http://127.0.0.1:9/bad.jpg"].status == "failed_to_download"
    )
    assert recs["http://127.0.0.1:9/bad.jpg"].error == "HTTP Error 404: Not Found"
    tar, off, size = cache.locate(recs["http://127.0.0.1:9/a.jpg"])
    with open(tar, "rb") as f:
        f.seek(off)
        assert f.read(size) == jpeg_bytes("fake")
    batch = tmp_path / "dl" / "batches" / "00000"
    assert not (batch / "00001.tar").exists()  # unfinished shard removed
    assert stats.status == {"success": 1, "failed_to_download": 1}
    # a rerun without retrying failures starts no child at all
    recs2, stats2 = cache.fetch(
        urls, DownloadOptions(retry_failed=False), log=quiet, progress=False, command=fake("crash")
    )
    assert stats2.runs == [] and stats2.cached == 2 and recs2["http://127.0.0.1:9/a.jpg"].ok
    # ... and with retries only the failed URL goes to the child (which crashes here)
    with pytest.raises(CvlError, match="something broke badly"):
        cache.fetch(urls, opts, log=quiet, progress=False, command=fake("crash"))
    inp = sorted((tmp_path / "dl" / "inputs").glob("*.parquet"))[-1]
    import pyarrow.parquet as pq

    assert pq.read_table(inp).column("url").to_pylist() == ["http://127.0.0.1:9/bad.jpg"]
    assert pq.read_table(inp).column("id").to_pylist() == ["b"]


def test_watchdog_kills_a_stalled_child(tmp_path, fake):
    cache = DownloadCache(tmp_path / "dl", ImageOptions())
    opts = DownloadOptions(exit_grace=0.5, stall_timeout=1.0)
    recs, stats = cache.fetch(
        {"http://127.0.0.1:9/a.jpg": {}}, opts, log=quiet, progress=False, command=fake("stall")
    )
    assert stats.runs[0]["watchdog"] == "killed: no progress for 1s"
    assert recs["http://127.0.0.1:9/a.jpg"].status == "not_downloaded"


def test_cache_refuses_other_image_options(tmp_path):
    DownloadCache(tmp_path / "dl", ImageOptions(image_size=256))
    DownloadCache(tmp_path / "dl", ImageOptions(image_size=256))
    with pytest.raises(CvlError, match="image_size=256"):
        DownloadCache(tmp_path / "dl", ImageOptions(image_size=384))


def test_options_validation():
    with pytest.raises(CvlError):
        ImageOptions(resize_mode="stretch")
    with pytest.raises(CvlError):
        DownloadOptions(distributor="dask")
    with pytest.raises(CvlError):
        DownloadOptions(threads=0)


def _rows(n: int, **kw) -> list[Row]:
    return [
        Row(id=f"r{i}", caption=f"c{i}", url=f"http://127.0.0.1:9/{i}.jpg", **kw) for i in range(n)
    ]


def test_validate_rows_reasons(tmp_path):
    rep = BuildReport()
    drop = Dropper(rep)
    rows = [
        Row(id="ok", caption="fine", url="http://127.0.0.1:9/1.jpg"),
        Row(id="../x", caption="c", url="http://127.0.0.1:9/2.jpg"),
        Row(id="a/b", caption="c", url="http://127.0.0.1:9/3.jpg"),
        Row(id="", caption="c", url="http://127.0.0.1:9/4.jpg"),
        Row(id="nocap", caption="  ", url="http://127.0.0.1:9/5.jpg"),
        Row(id="noimg", caption="c"),
        Row(id="ftp", caption="c", url="ftp://h/6.jpg"),
        Row(id="bad", caption="caf\udce9", url="http://127.0.0.1:9/7.jpg"),
        Row(id="ok", caption="again", url="http://127.0.0.1:9/8.jpg"),
        Row(id="ok", caption="other split", url="http://127.0.0.1:9/9.jpg", split="test"),
    ]
    kept = validate_rows(rows, drop)
    assert [r.id for r in kept] == ["ok", "ok"]
    assert dict(rep.dropped) == {
        "unsafe_id": 2,
        "missing_id": 1,
        "missing_caption": 1,
        "missing_image": 1,
        "bad_url": 1,
        "non_utf8": 1,
        "duplicate_id": 1,
    }
    assert len(drop.rows) == 8
    # text that was not UTF-8 is written as U+FFFD, not a crash
    drop(
        "odd", Row(id="z\udcff", caption="c", url="http://127.0.0.1:9/\udce9.jpg"), detail="d\udcff"
    )
    rep.save(tmp_path)
    assert "z\ufffd: d\ufffd" in (tmp_path / "build_report.json").read_text(encoding="utf-8")
    assert drop.rows[-1]["src"] == "http://127.0.0.1:9/\ufffd.jpg"
    json.dumps(drop.rows, ensure_ascii=False).encode("utf-8")


def test_instance_split_is_seeded_equal_and_held_out():
    rep = BuildReport()
    a = InstanceSplit(chunks=4, train=20, val=1, test=2, seed=5).assign(_rows(40), Dropper(rep))
    b = InstanceSplit(chunks=4, train=20, val=1, test=2, seed=5).assign(_rows(40), Dropper(rep))
    c = InstanceSplit(chunks=4, train=20, val=1, test=2, seed=6).assign(_rows(40), Dropper(rep))
    key = [(r.id, r.split, r.task) for r in a]
    assert key == [(r.id, r.split, r.task) for r in b]
    assert key != [(r.id, r.split, r.task) for r in c]
    from collections import Counter

    cnt = Counter((r.split, r.task) for r in a)
    for t in ("chunk0", "chunk1", "chunk2", "chunk3"):
        assert cnt[("train", t)] == 5 and cnt[("test", t)] == 2 and cnt[("val", t)] == 1
    assert len({r.id for r in a}) == len(a) == 32
    # failed downloads: training chunks trimmed back to equal size
    rule = InstanceSplit(chunks=2, seed=0)
    rows = rule.assign(_rows(10), Dropper(rep))
    lost = [r for r in rows if r.task == "chunk0"][:2]
    kept = rule.finalize([r for r in rows if r not in lost], Dropper(rep))
    assert Counter(r.task for r in kept) == {"chunk0": 3, "chunk1": 3}
    assert rep.dropped["chunk_balance"] == 2


def test_column_split_order_limits_and_held_out():
    rep = BuildReport()
    rows = _rows(6, task="b") + [
        Row(id=f"x{i}", caption="c", url="http://127.0.0.1:9/x", task="a") for i in range(3)
    ]
    rows.append(Row(id="z", caption="c", url="http://127.0.0.1:9/z", task="zzz"))
    rule = ColumnSplit("test", tasks=["a", "b"], limit=2, test=1, seed=0)
    out = rule.assign(rows, Dropper(rep))
    assert rule.task_names() == ["a", "b"]
    from collections import Counter

    assert Counter((r.task, r.split) for r in out) == {
        ("a", "train"): 2,
        ("a", "test"): 1,
        ("b", "train"): 2,
        ("b", "test"): 1,
    }
    assert rep.dropped == {"unknown_task": 1}
    free = ColumnSplit("col")
    free.assign(_rows(2, task="q") + _rows(1, task="p"), Dropper(rep))
    assert free.task_names() == ["q", "p"]  # order of first appearance


def test_class_split_plugs_in_labels():
    rep = BuildReport()
    rows = _rows(12)
    labels = {f"r{i}": i % 10 for i in range(11)}  # r11 has no label
    rule = ClassSplit(lambda r: labels.get(r.id), n_classes=10, chunks=2, test=1, seed=0)
    out = rule.assign(rows, Dropper(rep))
    assert rule.groups == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert {r.task for r in out if labels[r.id] < 5} == {"chunk0"}
    assert sum(r.split == "test" for r in out) == 2 and rep.dropped == {"no_label": 1}
    assert "class split: 10 classes in 2 groups" in rule.describe()


def test_resolve_order_and_folders():
    tasks = ["Household", "Food", "Beauty"]
    assert resolve_order(None, tasks) == tasks
    assert resolve_order("reversed", tasks) == ["Beauty", "Food", "Household"]
    assert resolve_order("food, 美容护理", tasks, {"美容护理": "Beauty"}) == ["Food", "Beauty"]
    for bad in ("Food,Food", "Toys", " , "):
        with pytest.raises(CvlError):
            resolve_order(bad, tasks)
    f = task_folders(["a/b", "a_b", "..", "食品/保健", "A_B"])
    assert len(set(v.lower() for v in f.values())) == 5
    assert all("/" not in v and v not in (".", "..") for v in f.values())


def test_tar_reader_of_cache_ignores_non_images(tmp_path):
    cache = DownloadCache(tmp_path / "dl", ImageOptions())
    tar = tmp_path / "s.tar"
    with tarfile.open(tar, "w") as tf:
        for name, data in (("k1.json", b"{}"), ("k1.jpg", b"JPG")):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    from cvl.streams.download import Record

    loc = cache.locate(Record("success", None, str(tar), "k1"))
    assert loc is not None and loc[2] == 3
    assert cache.locate(Record("success", None, str(tar), "nope")) is None
    assert json.loads((tmp_path / "dl" / "cache.json").read_text())["schema"] == "cvl.downloads/1"
    assert Path(cache.root).is_dir()


@pytest.mark.slow
def test_network_faults_are_bounded_and_a_rerun_fetches_only_what_failed(tmp_path):
    """Real img2dataset against a server that drops connections mid-body, answers 500 once,
    or never answers: the fetch ends within its timeouts, every URL is accounted for, and a
    rerun tries only the failed URLs (the 500s then succeed)."""
    from sources_helpers import ImageServer

    srv = ImageServer(hang_seconds=30.0)
    try:
        kinds = {"img": 2, "drop": 2, "flaky": 2, "hang": 1}
        urls = {srv.url(f"{k}/{k}{i}.jpg"): {} for k, n in kinds.items() for i in range(n)}
        cache = DownloadCache(tmp_path / "dl", ImageOptions())
        opts = DownloadOptions(threads=8, timeout=1.5, exit_grace=5)
        t0 = time.monotonic()
        recs, st = cache.fetch(urls, opts, log=lambda m: None, progress=False)
        assert time.monotonic() - t0 < 120  # bounded by the timeouts, not the server
        ok = {u for u, r in recs.items() if r.ok}
        assert ok == {u for u in urls if "/img/" in u}
        rep = st.to_json()
        assert rep["urls"] == len(urls) == sum(rep["status"].values())
        assert rep["from_cache"] + rep["fetched_now"] == len(urls) and rep["from_cache"] == 0
        assert rep["status"]["success"] == 2 and sum(rep["errors"].values()) == 5
        srv.reset()
        recs2, st2 = cache.fetch(urls, opts, log=lambda m: None, progress=False)
        rep2 = st2.to_json()
        assert srv.total("/img/") == 0 and srv.total() == 5  # only the failed URLs again
        assert rep2["from_cache"] == 2 and rep2["fetched_now"] == 5
        assert {u for u, r in recs2.items() if r.ok} == ok | {u for u in urls if "/flaky/" in u}
        assert rep2["status"]["success"] == 4 and sum(rep2["status"].values()) == len(urls)
        img = recs2[srv.url("flaky/flaky0.jpg")]
        with tarfile.open(img.tar) as tf:  # the retried image is complete
            data = tf.extractfile(f"{img.key}.jpg").read()
        assert data[:2] == b"\xff\xd8"
    finally:
        srv.close()
