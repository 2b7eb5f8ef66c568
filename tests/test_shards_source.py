"""`cvl build-stream shards`: streams over webdataset shards cvl did not write, split in place
(rows of the source shards), from DataComp-format fixture shards and TiC's uid files; the
split is the other sources' rule (the same draws as on `Row`s); the in-place stream trains
bit for bit as its `--copy`; `cvl index --part` / `--index-prefix`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from reliability_helpers import cli
from safetensors.torch import load_file
from shards_helpers import EVALS, TIC, fixture_copy, instance_argv, tic_argv

from cvl.data.index import Entries, index_files
from cvl.data.reader import PairDataset
from cvl.data.selection import read_rows, task_dataset
from cvl.errors import CvlError
from cvl.runs import finished_tasks
from cvl.streams.joins import lookup, read_join, uids_to_hex
from cvl.streams.manifest import load_manifest, manifest_from_json
from cvl.streams.rows import Dropper, Row
from cvl.streams.splitrules import InstanceSplit
from cvl.streams.timesplit import Periods, TimeSplit
from cvl.streams.writer import BuildReport


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The fixture copied, and both streams built from it in place."""
    root = tmp_path_factory.mktemp("shards")
    dc = fixture_copy(root / "dc")
    cli(instance_argv(str(dc / "shards"), root / "inst"))
    cli(tic_argv(str(dc / "shards/{00000..00002}.tar"), dc, root / "tic"))
    return root


def _meta(shard: str, e) -> dict:
    with open(shard, "rb") as f:
        f.seek(e.meta[0])
        return json.loads(f.read(e.meta[1]))


def test_tic_uids_are_two_uint64_halves_of_the_hex_string():
    hi, lo = 0x0123456789ABCDEF, 0xFEDCBA9876543210
    pairs = np.array([(hi, lo), (0, 1)], np.dtype("u8,u8"))
    want = [b"0123456789abcdeffedcba9876543210", b"00000000000000000000000000000001"]
    assert uids_to_hex(pairs).tolist() == want
    assert uids_to_hex(np.array([[hi, lo], [0, 1]], np.uint64)).tolist() == want
    assert [f"{h:016x}{lo:016x}".encode() for h, lo in pairs.tolist()] == want  # TiC's rule
    with pytest.raises(CvlError, match="not a uid array"):
        uids_to_hex(np.array([1.5, 2.5]))


def test_joined_tables_are_read_as_text_and_looked_up_on_arrays(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "t.csv").write_text("uid,year\na,2014\nb,2015\na,2016\n")
    (tmp_path / "t.jsonl").write_text('{"uid": "c", "year": 2017}\n')
    pq.write_table(pa.table({"uid": ["d"], "year": [2018]}), tmp_path / "t.parquet")
    np.save(tmp_path / "2019.npy", np.array([(1, 2)], np.dtype("u8,u8")))
    t = read_join(
        [str(tmp_path / f) for f in ("t.csv", "t.jsonl", "t.parquet", "2019.npy")], "uid", ["year"]
    )
    ids = ["a", "b", "c", "d", "0000000000000001" + "0000000000000002"]
    assert t.column("__id__").to_pylist() == ["a", "b", "a", "c", "d", ids[-1]]
    assert t.column("year").to_pylist() == ["2014", "2015", "2016", "2017", "2018", "2019"]
    rows, repeats = lookup(pa.array(["d", "zz", "a", ids[-1]]), t.column("__id__").combine_chunks())
    assert rows.tolist() == [4, -1, 0, 5] and repeats == 1  # a repeated id: its first row
    with pytest.raises(CvlError, match="cannot read columns"):
        read_join([str(tmp_path / "t.csv")], "uid", ["month"])


def test_a_selection_is_checked_against_its_shards(tmp_path):
    np.save(tmp_path / "bad.npy", np.array([3, 1]))
    with pytest.raises(CvlError, match="strictly increasing"):
        read_rows(tmp_path / "bad.npy")
    np.save(tmp_path / "f.npy", np.array([0.5]))
    with pytest.raises(CvlError, match="1-D integer array"):
        read_rows(tmp_path / "f.npy")
    base = {
        "schema": "cvl.stream/1",
        "name": "x",
        "source": "shards",
        "seed": 0,
        "task_order": ["t"],
        "tasks": {"t": {"train": {"shards": ["a.tar"], "count": 2, "rows": "t.rows.npy", "of": 5}}},
    }
    assert manifest_from_json(base).tasks["t"].train.rows == "t.rows.npy"
    for field, value, msg in [
        ("rows", "../t.npy", "relative .npy path"),
        ("rows", "t.txt", "relative .npy path"),
        ("of", 1, "fewer than count"),
    ]:
        d = json.loads(json.dumps(base))
        d["tasks"]["t"]["train"][field] = value
        with pytest.raises(CvlError, match=msg):
            manifest_from_json(d)
    d = json.loads(json.dumps(base))
    d["eval_sets"] = {"test": {"kind": "pairs", "tasks": {"t": d["tasks"]["t"]["train"]}}}
    with pytest.raises(CvlError, match="only a task's train set"):
        manifest_from_json(d)


def test_the_instance_split_in_place_is_the_rule_of_the_other_sources(built):
    m = load_manifest(built / "inst")
    assert m.task_order == [f"chunk{i}" for i in range(5)] and m.source == "shards"
    assert not (built / "inst" / "train").exists()  # no training shard written
    every = Entries.of_shards(sorted(str(p) for p in (built / "dc" / "shards").glob("*.tar")))
    keys = [e.key for e in every]
    assert len(keys) == 59 and "000010007" not in keys  # no caption: left out when indexed
    # the same samples through the Row rule of cc12m / table give the same tasks
    rows = [Row(id=k, caption="c") for k in keys]
    rule = InstanceSplit(5, test=1, seed=0, names=m.task_order)
    out = rule.finalize(rule.assign(rows, Dropper(BuildReport())), Dropper(BuildReport()))
    want = {
        t: sorted(r.id for r in out if r.task == t and r.split == "train") for t in m.task_order
    }
    tests = {
        t: sorted(r.id for r in out if r.task == t and r.split == "test") for t in m.task_order
    }
    for t in m.task_order:
        ds = task_dataset(m, t)
        assert sorted(ds.entries[i].key for i in range(len(ds))) == want[t]
        assert len(ds) == m.tasks[t].train.count == 10  # equal chunks
        ev = Entries.of_shards([str(s) for s in m.eval_shards("test", t)])
        held = [json.loads(json.dumps(_meta(e.shard, e))) for e in ev]
        assert [h["id"] for h in held] == tests[t] and held[0]["task"] == t
        # 4 B a training sample (uint32) after numpy's header, and nothing else per sample
        f = built / "inst" / m.tasks[t].train.rows
        assert read_rows(f).dtype == np.uint32 and f.stat().st_size == 128 + 4 * 10
    with pytest.raises(CvlError, match="selection of rows of shards built in place"):
        m.train_shards("chunk0")  # tools that read whole shards refuse, in one line


def test_the_tic_stream_in_place_follows_tics_uid_files(built):
    m = load_manifest(built / "tic")
    tic = built / "dc"
    assert m.task_order == ["2014-2016", *map(str, range(2017, 2023))]
    year_of = {}
    for f in sorted((tic / TIC).glob("*.npy")):
        for u in uids_to_hex(np.load(f)).tolist():
            year_of[u.decode()] = f.stem
    evals = json.loads((tic / EVALS).read_text())
    for t in m.task_order:
        ds = task_dataset(m, t)
        years = {year_of[_meta(ds.entries[i].shard, ds.entries[i])["uid"]] for i in range(len(ds))}
        assert years == set(m.time["tasks"][t])  # every sample of its task's years
    for y, uids in evals.items():  # TiC's retrieval uids are the yearly benchmarks
        ev = Entries.of_shards([str(s) for s in m.benchmark_shards(f"ret-{y}")])
        got = [_meta(e.shard, e) for e in ev]
        assert [g["uid"] for g in got] == uids and got[0]["period"] == y
    rep = json.loads((built / "tic" / "build_report.json").read_text())
    assert rep["dropped"] == {"missing_caption": 1, "not_in_join": 2, "after_until": 6}
    # the same dated samples through the Row rule of `table --time-col` give the same tasks
    every = Entries.of_shards(sorted(str(p) for p in (tic / "shards").glob("*.tar")))
    rows = []
    for e in every:
        u = _meta(e.shard, e)["uid"]
        y = year_of.get(u) or next((k for k, v in evals.items() if u in v), None)
        if y is not None:
            rows.append(Row(id=u, caption="c", meta={"year": y}))
    rule = TimeSplit(
        "year",
        Periods.make("year", None),
        first_until="2016",
        until="2022",
        eval_ids={u for v in evals.values() for u in v},
    )
    out = rule.assign(rows, Dropper(BuildReport()))
    for t in m.task_order:
        ds = task_dataset(m, t)
        got = sorted(_meta(ds.entries[i].shard, ds.entries[i])["uid"] for i in range(len(ds)))
        assert got == sorted(r.id for r in out if r.task == t and r.split == "train")


def test_a_changed_source_shard_is_refused(built, tmp_path):
    import shutil

    dc = fixture_copy(tmp_path / "dc")
    cli(instance_argv(str(dc / "shards"), tmp_path / "s"))
    m = load_manifest(tmp_path / "s")
    assert len(task_dataset(m, "chunk0")) == 10
    shutil.copy(dc / "shards" / "00001.tar", dc / "shards" / "00002.tar")  # another shard
    from cvl.data import index as idx

    idx.TABLE.__init__()
    with pytest.raises(CvlError, match="now hold 58 usable samples, not the 59"):
        task_dataset(load_manifest(tmp_path / "s"), "chunk0")


def _weights(run: Path) -> dict:
    return load_file(str(finished_tasks(run)[-1].model_path))


def test_a_stream_in_place_trains_as_its_copy(tmp_path):
    """The in-place stream's tasks read the same samples in the same order as the ordinary
    shards `--copy` writes: training on either gives the same weights, bit for bit (so every
    guarantee proven for copied streams holds in place); `cvl info` says what is in place."""
    dc = fixture_copy(tmp_path / "dc")
    order = ["--order", "chunk1,chunk3"]
    cli(instance_argv(str(dc / "shards"), tmp_path / "in", *order))
    cli(instance_argv(str(dc / "shards"), tmp_path / "cp", *order, "--copy"))
    assert not list((tmp_path / "in").rglob("train/*.tar"))
    assert len(list((tmp_path / "cp" / "train").rglob("*.tar"))) == 2
    from reliability_helpers import train_argv

    for s in ("in", "cp"):
        cli(
            train_argv(tmp_path / s, tmp_path / f"run-{s}", "seqft") + ["--max-steps-per-task", "2"]
        )
    a, b = _weights(tmp_path / "run-in"), _weights(tmp_path / "run-cp")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from cvl.data.mixture import pretrain_entries

    pre = [pretrain_entries(tmp_path / s) for s in ("in", "cp")]  # as --pretrain-data
    assert len(pre[0]) == len(pre[1]) == 20
    caps = [[PairDataset(p)[i]["caption"] for i in range(20)] for p in pre]
    assert caps[0] == caps[1]
    from cvl.info import describe_stream

    text = "\n".join(describe_stream(tmp_path / "in"))
    assert "sources/shards -> " in text and "2 task(s) read rows of their source shards" in text
    for f in (dc / "shards").glob("*.idx.*"):
        f.unlink()
    cli(["index", str(tmp_path / "in"), "--quiet"])  # a stream's index: its source shards too
    assert len(list((dc / "shards").glob("*.idx.json"))) == 3


def _refused(argv: list[str], capsys, text: str) -> None:
    """The command fails with one line saying `text`."""
    from cvl.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    assert text in capsys.readouterr().err


def test_index_in_parts_under_a_prefix(tmp_path, capsys):
    """`cvl index --part I/N` indexes disjoint shards; the run without --part merges the parts'
    summaries; --index-prefix keeps every index file out of the collection's folder."""
    dc = fixture_copy(tmp_path / "dc")
    pattern, prefix = str(dc / "shards/{00000..00002}.tar"), tmp_path / "idx"
    for i in (0, 1):
        cli(["index", pattern, "--part", f"{i}/2", "--index-prefix", str(prefix), "--quiet"])
    assert not list((dc / "shards").glob("*.idx.*"))
    assert sorted(p.name for p in prefix.glob("*.idx.json")) == [
        "00000.idx.json",
        "00001.idx.json",
        "00002.idx.json",
    ]
    assert len(list(prefix.glob("cvl-index-part-*.json"))) == 2
    capsys.readouterr()
    cli(["index", str(dc / "shards"), "--index-prefix", str(prefix), "--quiet"])
    assert "59 usable samples, 1 left out; 0 indexed now" in capsys.readouterr().out
    summary = json.loads((prefix / "cvl-index-summary.json").read_text())
    assert summary["samples"] == 59 and sorted(p["part"] for p in summary["parts"]) == [
        "0/2",
        "1/2",
    ]
    assert not list(prefix.glob("cvl-index-part-*.json"))
    _refused(["index", pattern, "--part", "2/2"], capsys, "--part 2/2: give I/N with 0 <= I < N")
    other = fixture_copy(tmp_path / "other")
    _refused(
        ["index", str(other / "shards"), "--index-prefix", str(prefix)],
        capsys,
        "outside the collection",
    )
    # a stream built with the prefix records it; training finds the index there
    cli(instance_argv(pattern, tmp_path / "s", "--index-prefix", str(prefix)))
    m = load_manifest(tmp_path / "s")
    assert m.sources[0]["index"] == str(prefix)
    assert index_files(str(m.selection("chunk0")[0][0]))[1].startswith(str(prefix))
    assert not list((dc / "shards").glob("*.idx.*"))


def test_a_task_column_of_a_joined_table(tmp_path):
    """--task-col / --category-col from a CSV joined on KEY.json's uid: one task per value in
    order of first appearance, ColumnSplit's held-out draw, categories in the manifest and in
    the copied evaluation samples."""
    import hashlib

    from cvl.streams.splitrules import ColumnSplit

    dc = fixture_copy(tmp_path / "dc")
    lines = ["uid,domain,label"]
    for i in range(60):
        uid = hashlib.md5(f"datacomp-fixture-{i}".encode()).hexdigest()  # make_fixture's
        lines.append(f"{uid},{['news', 'shop', 'art'][i % 3]},obj{i % 4}")
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    cli(
        ["build-stream", "shards", "--shards", str(dc / "shards"), "--id-col", "uid"]
        + ["--join", str(tmp_path / "t.csv"), "--task-col", "domain", "--category-col", "label"]
        + ["--test", "1", "--out", str(tmp_path / "s"), "--quiet"]
    )
    m = load_manifest(tmp_path / "s")
    assert m.task_order == ["news", "shop", "art"]
    every = Entries.of_shards(sorted(str(p) for p in (dc / "shards").glob("*.tar")))
    dom = {ln.split(",")[0]: ln.split(",")[1] for ln in lines[1:]}
    rows = [Row(id=_meta(e.shard, e)["uid"], caption="c") for e in every]
    for r in rows:
        r.task = dom[r.id]
    out = ColumnSplit("x", test=1, seed=0).assign(rows, Dropper(BuildReport()))
    for t in m.task_order:
        ds = task_dataset(m, t)
        got = sorted(_meta(ds.entries[i].shard, ds.entries[i])["uid"] for i in range(len(ds)))
        assert got == sorted(r.id for r in out if r.task == t and r.split == "train")
        assert m.tasks[t].categories == ["obj0", "obj1", "obj2", "obj3"]
        (held,) = [_meta(e.shard, e) for e in Entries.of_shards(m.eval_shards("test", t))]
        assert held["task"] == t and held["category"].startswith("obj")
