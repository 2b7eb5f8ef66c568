"""The data path at scale: the on-disk index (written with the tar, built once for foreign
shards), samples as integers, per-batch epoch orders, the LRU of open files, and streams
served over HTTP (a loopback server with byte ranges)."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from reliability_helpers import build_tiny_stream, cli, train_argv
from remote_helpers import RangeServer

from cvl.data import index as idx
from cvl.data import shardindex
from cvl.data.index import Entries, index_files, scan_tar
from cvl.data.mixture import mixed_batch, mixed_epoch, stream_items
from cvl.data.order import permute
from cvl.data.reader import PairDataset, global_batch, global_batches
from cvl.data.remote import Files
from cvl.errors import CvlError
from cvl.streams.writer import ShardSink, encode_jpeg


def _img(v: int) -> bytes:
    return encode_jpeg(Image.new("RGB", (8, 8), (v, v, v)))


def _sink(root: Path, n: int, maxcount: int = 4, long: bool = False) -> list[Path]:
    sink = ShardSink(root, "x", maxcount=maxcount)
    for i in range(n):
        key = f"k{i}" + ("_" * 120 if long and i % 2 else "")  # > 100 chars: GNU long names
        sink.write(key, _img(i), "" if i == 5 else f"caption {i}", {"id": i})
    return [root / s for s in sink.close().shards]


def test_the_writer_records_what_a_scan_of_the_tar_finds(tmp_path):
    shards = _sink(tmp_path, 11, long=True)
    for s in shards:
        rows = np.load(index_files(str(s))[0])
        want, skipped, _, _ = scan_tar(str(s))
        assert rows.tobytes() == want.tobytes() and rows.dtype == want.dtype
        summary = json.loads(Path(index_files(str(s))[1]).read_text())
        assert summary["count"] == len(want) and summary["skipped"] == [list(x) for x in skipped]
        assert summary["tar_bytes"] == s.stat().st_size
    ds = PairDataset.from_shards(shards)
    assert len(ds) == 10 and ds.skipped == {"empty_caption": 1}
    # every member read by the recorded offsets is the sample written
    for i in range(len(ds)):
        e = ds.entries[i]
        n = int(e.key.split("_")[0][1:])
        assert ds.read_raw(i)[1] == f"caption {n}"


def _foreign(root: Path, n_shards: int, per: int) -> list[Path]:
    """Shards another tool wrote (plain tarfile, no index)."""
    out = []
    root.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        p = root / f"{s:05d}.tar"
        with tarfile.open(p, "w") as tf:
            for i in range(per):
                for ext, data in (("jpg", _img(i)), ("txt", f"c{s}-{i}".encode())):
                    ti = tarfile.TarInfo(f"s{s}_{i}.{ext}")
                    ti.size = len(data)
                    import io

                    tf.addfile(ti, io.BytesIO(data))
        out.append(p)
    return out


def test_foreign_shards_are_indexed_once_in_parallel_and_reused(tmp_path, monkeypatch):
    shards = _foreign(tmp_path / "f", 6, 3)
    calls = []
    real = shardindex.index_one
    monkeypatch.setattr(shardindex, "index_one", lambda s: calls.append(s) or real(s))
    monkeypatch.setenv("CVL_INDEX_PROCESSES", "1")
    ds = PairDataset.from_shards(shards)
    assert len(ds) == 18 and sorted(calls) == sorted(map(str, shards))
    assert all(Path(index_files(str(s))[1]).is_file() for s in shards)
    idx.TABLE.__init__()  # a new process: the files are reused, nothing re-indexed
    calls.clear()
    assert len(PairDataset.from_shards(shards)) == 18 and calls == []
    # a tar rewritten (another size) is indexed again
    _foreign(tmp_path / "f", 1, 5)
    assert len(PairDataset.from_shards(shards)) == 20 and calls == [str(shards[0])]
    # in parallel (a process pool) the same files result
    monkeypatch.setattr(shardindex, "index_one", real)
    for s in shards:
        os.unlink(index_files(str(s))[1])
    monkeypatch.setenv("CVL_INDEX_PROCESSES", "2")
    idx.TABLE.__init__()
    assert [e.key for e in PairDataset.from_shards(shards).entries][:3] == ["s0_0", "s0_1", "s0_2"]


def test_an_unwritable_folder_indexes_into_the_cache(tmp_path, monkeypatch):
    shards = _foreign(tmp_path / "ro", 1, 2)
    monkeypatch.setenv("CVL_INDEX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(idx.os, "access", lambda p, mode: False)
    assert len(PairDataset.from_shards(shards)) == 2
    assert not list((tmp_path / "ro").glob("*.idx.*"))
    assert len(list((tmp_path / "cache").glob("*.idx.npy"))) == 1


def test_entries_are_integers_that_compose(tmp_path):
    a, b = _sink(tmp_path / "a", 9), _sink(tmp_path / "b", 4)
    ea, eb = Entries.of_shards(a), Entries.of_shards(b)
    both = ea + eb.take([3, 0])
    assert len(both) == len(ea) + 2
    keys = [e.key for e in both]
    assert keys[: len(ea)] == [e.key for e in ea] and keys[len(ea) :] == ["k3", "k0"]
    assert [e.key for e in ea[2:4]] == [ea[2].key, ea[3].key]
    assert ea.shard_paths() == [str(p) for p in a]
    with pytest.raises(IndexError):
        ea[len(ea)]


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 4099])
@pytest.mark.parametrize("block", [1, 3, 16])
def test_every_epoch_order_is_a_permutation(n, block):
    got = permute(n, 42, np.arange(n), block)
    assert sorted(got.tolist()) == list(range(n))
    assert permute(n, 42, np.arange(n), block).tolist() == got.tolist()  # (n, key) only


def test_block_order_keeps_neighbours_together():
    """The fixed blocks of runs begun before re-cutting (the re-cut order: test_remote.py)."""
    n, k = 1000, 10
    got = permute(n, 7, np.arange(n), block=-k)
    blocks = got.reshape(-1, k) // k
    assert (blocks == blocks[:, :1]).all()  # each run of 10 positions reads one block
    assert sorted(blocks[:, 0].tolist()) == list(range(100))
    assert got.tolist() != sorted(got.tolist())


def test_a_batch_computed_alone_is_the_batch_of_the_epoch():
    n, gb = 103, 8
    whole = global_batches(n, gb, seed=3, epoch=2)
    assert len(whole) == n // gb
    assert all(global_batch(n, gb, 3, 2, b) == whole[b] for b in range(len(whole)))
    seen = [i for bt in whole for i, _ in bt]
    assert len(set(seen)) == len(seen) == (n // gb) * gb  # each sample at most once
    counts, sizes = (
        {"task": 50, "buffer": 7, "pretrain": 30},
        {"task": 6, "buffer": 3, "pretrain": 3},
    )
    ep = mixed_epoch(counts, sizes, 8, seed=5, epoch=1)
    assert all(mixed_batch(counts, sizes, 8, 5, 1, b) == ep[b] for b in range(8))
    # a source reshuffled at each pass: positions c·n .. (c+1)·n - 1 cover it exactly once
    s = stream_items(7, 11, np.arange(21))
    assert all(sorted(s[c * 7 : (c + 1) * 7].tolist()) == list(range(7)) for c in range(3))


def test_open_files_are_an_lru(tmp_path):
    paths = []
    for i in range(5):
        p = tmp_path / f"{i}.bin"
        p.write_bytes(bytes([i]) * 10)
        paths.append(str(p))
    f = Files(limit=3)
    for p in paths[:3]:
        f.read(p, (0, 1))
    f.read(paths[0], (0, 1))  # most recent now
    f.read(paths[3], (0, 1))  # evicts paths[1] only
    assert list(f.fds) == [paths[2], paths[0], paths[3]] and f.opened == 4
    assert f.read(paths[0], (2, 3)) == bytes([0]) * 3 and f.opened == 4


# -- streams served over HTTP -----------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    build_tiny_stream(root / "s")
    srv = RangeServer(root)
    yield srv, root
    srv.close()


def test_train_and_eval_a_stream_served_over_http(served, tmp_path):
    srv, root = served
    url = f"{srv.base}/s"
    run = tmp_path / "run"
    argv = train_argv(root / "s", run, "seqft")
    argv[argv.index("--stream") + 1] = url
    cli(argv + ["--max-steps-per-task", "2", "--workers", "0"])
    rj = json.loads((run / "run.json").read_text())
    assert rj["stream"]["path"] == url
    assert (run / "tasks").is_dir() and len(list((run / "tasks").iterdir())) == 3
    tars = [(p, r) for p, r in srv.requests if p.endswith(".tar")]
    assert tars and all(r and r.startswith("bytes=") for _, r in tars)  # byte ranges only
    cli(["eval", "--run", str(run), "--no-probe", "--no-zeroshot"])
    assert (run / "eval").is_dir()


def test_an_unreachable_shard_is_one_line(served, tmp_path, monkeypatch):
    srv, root = served
    from cvl.data import remote

    monkeypatch.setattr(remote, "BACKOFF_S", 0.0)
    bad = RangeServer(root, fail={".tar"})
    try:
        ds = PairDataset.from_shards([f"{bad.base}/s/train/t0/000000.tar"])
        with pytest.raises(CvlError, match=r"unreachable after 5 tries"):
            ds[0]
        with pytest.raises(CvlError, match="no index beside the shard"):
            PairDataset.from_shards([f"{bad.base}/s/train/t0/nothere.tar"])
    finally:
        bad.close()


def test_a_stream_built_before_indexes_still_trains(tmp_path, capsys):
    s = build_tiny_stream(tmp_path / "old")
    for f in list(s.rglob("*.idx.*")):
        f.unlink()  # as a stream built by an earlier cvl
    idx.TABLE.__init__()
    cli(
        train_argv(s, tmp_path / "run", "seqft")
        + ["--max-steps-per-task", "1", "--shuffle-block", "4"]
    )
    rj = json.loads((tmp_path / "run" / "run.json").read_text())
    assert rj["config"]["shuffle_block"] == 4  # the order is part of what a run computed
    train = s / "train"  # what training read: each indexed once
    assert len(list(train.rglob("*.idx.npy"))) == len(list(train.rglob("*.tar")))
    shutil.rmtree(tmp_path / "run")
    for f in list(s.rglob("*.idx.*")):
        f.unlink()
    cli(["index", str(s)])  # ahead of time: every shard, train and eval
    assert "indexed" in capsys.readouterr().out
    shard_summaries = [p for p in s.rglob("*.idx.json") if p.name != "shards.idx.json"]
    assert len(shard_summaries) == len(list(s.rglob("*.tar")))
    assert (s / "shards.idx.json").is_file()  # the stream's summary, for a served copy
