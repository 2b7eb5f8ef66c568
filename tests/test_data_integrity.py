"""Nothing silently wrong in the data path (issue 52): an index proves it belongs to its tar
(a tar replaced by one of the same size, rewritten in place, an ``.idx.npy`` copied over: each
re-indexed or refused, never another sample's bytes); a shard that vanished, a 404 or a short
read stops in one line naming the shard; `cvl index` repairs what is broken and says so; a
foreign tar's odd members are counted and named."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from remote_helpers import RangeServer

from cvl.cli import main
from cvl.data import index as idx
from cvl.data import samples
from cvl.data.index import index_files
from cvl.data.reader import PairDataset
from cvl.data.samples import ShardError
from cvl.errors import CvlError
from cvl.streams.writer import encode_jpeg


def _jpg(v: int) -> bytes:
    return encode_jpeg(Image.new("RGB", (8, 8), (v, v, v)))


def _tar(path: Path, members: list[tuple[str, bytes]], kind: dict[str, str] | None = None) -> Path:
    """A tar another tool wrote: `members` as (name, data) in this order; `kind` makes some
    names symlinks or hard links."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            k = (kind or {}).get(name)
            if k == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, "elsewhere.jpg"
                tf.addfile(ti)
                continue
            if k == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, members[0][0]
                tf.addfile(ti)
                continue
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def _samples(prefix: str, n: int, cap: str = "c") -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        out += [(f"{prefix}{i}.jpg", _jpg(i)), (f"{prefix}{i}.txt", f"{cap}{prefix}{i}".encode())]
    return out


def _fresh() -> None:
    """As a new process: nothing met, no open descriptors."""
    idx.TABLE.__init__()
    samples._FILES.close()


def _captions(ds: PairDataset) -> list[str]:
    return [ds.read_raw(i)[1] for i in range(len(ds))]


# -- 1. an index trusted after its tar changed ------------------------------------------------
def test_a_tar_replaced_by_one_of_the_same_size_is_reindexed(tmp_path, capsys):
    a = _tar(tmp_path / "s" / "000.tar", _samples("a", 8))
    b = _tar(tmp_path / "other" / "000.tar", _samples("b", 8))  # other keys, same sizes
    assert a.stat().st_size == b.stat().st_size
    _fresh()
    assert _captions(PairDataset.from_shards([a]))[:2] == ["ca0", "ca1"]
    os.replace(b, a)  # another tar of the same size under the same name
    _fresh()
    ds = PairDataset.from_shards([a])
    assert _captions(ds) == [f"cb{i}" for i in range(8)]
    assert "re-indexed 1 shard(s)" in capsys.readouterr().err


def test_a_tar_rewritten_in_place_with_longer_captions_is_reindexed(tmp_path):
    a = _tar(tmp_path / "000.tar", _samples("k", 6, cap="c"))
    _fresh()
    assert _captions(PairDataset.from_shards([a]))[0] == "ck0"
    size = a.stat().st_size
    with open(a, "r+b") as f:  # the same file (inode), other content, the same padded size
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
            for name, data in _samples("k", 6, cap="longer-"):
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
        f.write(buf.getvalue())
        f.truncate()
    assert a.stat().st_size == size
    _fresh()
    assert _captions(PairDataset.from_shards([a])) == [f"longer-k{i}" for i in range(6)]


def test_another_shards_rows_file_copied_over_is_reindexed(tmp_path):
    a = _tar(tmp_path / "000.tar", _samples("a", 8))
    b = _tar(tmp_path / "001.tar", _samples("b", 8))
    _fresh()
    PairDataset.from_shards([a, b])
    shutil.copyfile(index_files(str(b))[0], index_files(str(a))[0])
    _fresh()
    assert _captions(PairDataset.from_shards([a]))[:3] == ["ca0", "ca1", "ca2"]


def test_a_change_the_times_do_not_show_is_caught_at_the_read(tmp_path):
    """Same size and modification time (the worst case: nothing to see at start): the read's
    header check stops it in one line naming the shard and the repair."""
    a = _tar(tmp_path / "000.tar", _samples("a", 8))
    _fresh()
    PairDataset.from_shards([a])
    st = a.stat()
    _tar(tmp_path / "x" / "000.tar", _samples("b", 8))
    os.replace(tmp_path / "x" / "000.tar", a)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    _fresh()
    ds = PairDataset.from_shards([a])
    with pytest.raises(ShardError, match=r"changed since it was indexed.*cvl index --force"):
        ds[0]
    with pytest.raises(ShardError):  # the evaluation path too: never a left-out sample
        ds.drop_unreadable()


# -- 2. a shard that vanished -----------------------------------------------------------------
def test_a_local_shard_deleted_is_one_line_not_another_sample(tmp_path):
    a = _tar(tmp_path / "000.tar", _samples("a", 4))
    b = _tar(tmp_path / "001.tar", _samples("b", 4))
    _fresh()
    ds = PairDataset.from_shards([a, b])
    b.unlink()
    samples._FILES.close()
    assert ds[0]["caption"] == "ca0"
    with pytest.raises(ShardError, match=r"001\.tar: cannot open the shard"):
        ds[5]


def test_a_truncated_shard_is_a_short_read_not_a_bad_sample(tmp_path):
    a = _tar(tmp_path / "000.tar", _samples("a", 8))
    _fresh()
    ds = PairDataset.from_shards([a])
    with open(a, "r+b") as f:
        f.truncate(2048)
    samples._FILES.close()
    with pytest.raises(ShardError, match=r"short read .*shorter than its index"):
        ds[7]


def test_a_404_shard_in_a_task_of_several_is_one_line(tmp_path, monkeypatch):
    from cvl.data import remote

    monkeypatch.setattr(remote, "BACKOFF_S", 0.0)
    root = tmp_path / "srv"
    shards = [_tar(root / f"{i:03d}.tar", _samples(f"s{i}", 4)) for i in range(3)]
    _fresh()
    PairDataset.from_shards(shards)  # indexes beside them
    srv = RangeServer(root)
    try:
        ds = PairDataset.from_shards([f"{srv.base}/{s.name}" for s in shards])
        (root / "001.tar").unlink()
        assert ds[0]["caption"] == "cs00"
        with pytest.raises(ShardError, match=r"001\.tar: not found \(404\)"):
            ds.__getitems__([0, 5, 9])
        assert len([p for p, _ in srv.tar_requests() if p.endswith("001.tar")]) == 1  # no retry
    finally:
        srv.close()


def test_a_shard_deleted_mid_run_stops_training_in_one_line(tmp_path, capsys, monkeypatch):
    """Deleted after the run started (task t0 trained): the loader worker's read fails and
    the run stops in one line naming the shard (the checkpoints so far are kept)."""
    from reliability_helpers import build_tiny_stream, train_argv

    from cvl.train.loop import Trainer

    s = build_tiny_stream(tmp_path / "s")
    t1 = json.loads((s / "stream.json").read_text())["tasks"]["t1"]["train"]["shards"][0]
    real = Trainer._finish_task

    def finish(self, ti, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        real(self, ti, *a, **kw)
        if ti == 0:
            (s / t1).unlink()

    monkeypatch.setattr(Trainer, "_finish_task", finish)
    argv = train_argv(s, tmp_path / "run", "seqft") + ["--workers", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and t1 in err and "not found" in err, err
    assert (tmp_path / "run" / "tasks" / "00-t0").is_dir()


# -- 3. `cvl index` repairs -------------------------------------------------------------------
def test_cvl_index_rebuilds_what_is_broken_and_says_so(tmp_path, capsys):
    shards = [_tar(tmp_path / f"{i:03d}.tar", _samples(f"s{i}", 5)) for i in range(3)]
    assert main(["index", str(tmp_path)]) in (0, None)
    assert "3 new" in capsys.readouterr().out
    npy0 = Path(index_files(str(shards[0]))[0])
    npy0.write_bytes(npy0.read_bytes()[:100])  # truncated rows
    js1 = Path(index_files(str(shards[1]))[1])
    d = json.loads(js1.read_text())
    js1.write_text(json.dumps({**d, "count": 4}))  # an edited summary
    assert main(["index", str(tmp_path)]) in (0, None)
    out = capsys.readouterr().out
    assert f"rebuilt {shards[0]}" in out and f"rebuilt {shards[1]}" in out
    assert "1 kept (proved), 2 rebuilt, 0 new" in out
    assert np.load(npy0).shape == (5,) and json.loads(js1.read_text())["count"] == 5
    assert main(["index", "--force", str(tmp_path)]) in (0, None)
    assert "0 kept (proved), 3 rebuilt" in capsys.readouterr().out
    npy0.write_bytes(npy0.read_bytes()[:100])  # broken again: a reader repairs it, and says so
    _fresh()
    assert len(PairDataset.from_shards(shards)) == 15
    assert "re-indexed 1 shard(s)" in capsys.readouterr().err
    rows = np.load(npy0)
    np.save(npy0, rows[:3])  # changed under a process that holds the shard: refused, named
    idx.TABLE.maps.clear()
    with pytest.raises(CvlError, match=r"changed while in use.*cvl index --force"):
        idx.TABLE.rows(0)


def test_cvl_index_on_a_stream_writes_its_summary(tmp_path, capsys):
    from reliability_helpers import build_tiny_stream

    s = build_tiny_stream(tmp_path / "s")
    (s / "shards.idx.json").unlink()
    assert main(["index", str(s)]) in (0, None)
    d = json.loads((s / "shards.idx.json").read_text())
    listed = json.loads((s / "stream.json").read_text())["tasks"]["t0"]["train"]["shards"]
    assert d["schema"] == "cvl.stream-index/1" and d["shards"][listed[0]]["count"] > 0


# -- 4. foreign tars: nothing dropped without a count ------------------------------------------
def test_repeated_keys_links_gifs_and_extras_are_counted_and_named(tmp_path):
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    members = [
        ("a.jpg", _jpg(1)),
        ("a.txt", b"first a"),
        ("b.jpg", _jpg(2)),
        ("b.txt", b"b"),
        ("b.cls", b"3"),
        ("a.jpg", _jpg(3)),  # the key again, not next to its first sample: a second sample
        ("a.txt", b"second a"),
        ("g.gif", gif.getvalue()),
        ("g.txt", b"a gif"),
        ("l.jpg", b""),
        ("l.txt", b"a link"),
        ("h.jpg", b""),
        ("h.txt", b"a hard link"),
    ]
    t = _tar(tmp_path / "000.tar", members, kind={"l.jpg": "symlink", "h.jpg": "hardlink"})
    _fresh()
    ds = PairDataset.from_shards([t])
    assert _captions(ds) == ["first a", "b", "second a"]  # webdataset yields both a's
    d = json.loads(Path(index_files(str(t))[1]).read_text())
    assert d["duplicate_keys"] == 1
    assert dict(map(tuple, d["skipped"])) == {
        "g": "unsupported_image:gif",
        "l": "link_member:symlink",
        "h": "link_member:hardlink",
    }
    assert d["unused_members"] == {"cls": 1, "gif": 1, "jpg": 2, "txt": 3}


def test_a_compressed_shard_says_so(tmp_path):
    t = _tar(tmp_path / "x.tar", _samples("a", 2))
    gz = tmp_path / "z" / "000.tar"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(t.read_bytes()))
    _fresh()
    with pytest.raises(CvlError, match=r"gzip-compressed tar.*decompress"):
        PairDataset.from_shards([gz])


def test_a_shard_error_from_a_loader_worker_is_cut_back_to_one_line():
    wrapped = (
        "Caught ShardError in DataLoader worker process 0.\nOriginal Traceback (most recent "
        'call last):\n  File "x.py", line 1, in f\ncvl.data.samples.ShardError: /s/001.tar: '
        "cannot open the shard (No such file or directory)\n"
    )
    assert (
        str(ShardError(wrapped)) == "/s/001.tar: cannot open the shard (No such file or directory)"
    )
