"""Stream builders read hostile inputs safely: decompression bombs are refused from the header
(counted `too_large`, memory flat), image paths that resolve outside the image root are
counted `outside_root`, CSV/TSV rows with an unterminated quote or the wrong number of
fields are counted, never merged into their neighbours, and a build that runs out of space
says so in one line."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from archive_helpers import captions_of, jpeg, write_karpathy

from cvl.cli import main
from cvl.data.reader import MAX_PIXELS


def _png_1bit(w: int, h: int) -> bytes:
    """A complete, valid 1-bit PNG of w×h black pixels: a few KB on disk, w·h bytes decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    row = b"\0" * (1 + (w + 7) // 8)
    c = zlib.compressobj(9)
    idat = b"".join(c.compress(row) for _ in range(h)) + c.flush()
    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _header_png(w: int, h: int) -> bytes:
    """Only a PNG header announcing w×h RGB pixels (what a 32000×32000 bomb starts with)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 99))


def _report(out: Path) -> dict:
    return json.loads((out / "build_report.json").read_text())


def _coco(tmp_path: Path) -> tuple[Path, Path, dict]:
    data = tmp_path / "D"
    js = write_karpathy(data, "coco", {"train": 6, "test": 2}, filepath=True)
    return data, js, json.loads(js.read_text())


def _build_coco(data: Path, js: Path, out: Path) -> int:
    return main(
        ["build-stream", "coco", "--json", str(js), "--images", str(data)]
        + [*("--out", str(out), "--quiet")]
    )


def test_bomb_images_are_counted_too_large_before_decoding(tmp_path):
    data, js, d = _coco(tmp_path)
    assert _build_coco(data, js, tmp_path / "warm") == 0  # imports (OpenCV, ...) paid first
    assert 9000 * 9000 > MAX_PIXELS
    ims = d["images"]
    small = _png_1bit(9000, 9000)  # 81 Mpx: ~81 MB once decoded by OpenCV, 10 KB here
    assert len(small) < 20_000
    (data / ims[0]["filepath"] / ims[0]["filename"]).write_bytes(small)
    (data / ims[1]["filepath"] / ims[1]["filename"]).write_bytes(_header_png(32000, 32000))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    assert _build_coco(data, js, tmp_path / "s") == 0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    rep = _report(tmp_path / "s")
    assert rep["dropped"] == {"too_large": 2}
    assert rep["kept_total"] == 6
    assert all("exceeds MAX_PIXELS" in e for e in rep["dropped_examples"]["too_large"])
    assert grown_mb < 60


def test_image_paths_outside_the_image_root_are_counted(tmp_path):
    data, js, d = _coco(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.jpg").write_bytes(jpeg("o.jpg"))
    os.symlink(outside / "o.jpg", data / "train2014" / "link.jpg")
    (data / "train2014" / "inner.jpg").symlink_to(data / "train2014" / d["images"][0]["filename"])

    def rec(i: int, **kw: str) -> dict:
        caps = captions_of(f"x{i}")
        return {"imgid": 900 + i, "split": "train", "sentences": [{"raw": c} for c in caps], **kw}

    d["images"] += [
        rec(0, filepath="../outside", filename="o.jpg"),  # `..`
        rec(1, filepath="train2014", filename=str(outside / "o.jpg")),  # absolute
        rec(2, filepath="train2014", filename="link.jpg"),  # a symlink leading out
        rec(3, filepath="train2014", filename="inner.jpg"),  # a symlink inside: fine
    ]
    js.write_text(json.dumps(d))
    assert _build_coco(data, js, tmp_path / "s") == 0
    rep = _report(tmp_path / "s")
    assert rep["dropped"] == {"outside_root": 3}
    assert rep["kept_total"] == 8 + 1
    csv = tmp_path / "pairs" / "pairs.csv"  # the table source, same rule
    (tmp_path / "pairs" / "img").mkdir(parents=True)
    (tmp_path / "pairs" / "img" / "a.jpg").write_bytes(jpeg("a"))
    os.symlink(outside / "o.jpg", tmp_path / "pairs" / "img" / "out.jpg")
    csv.write_text(
        "image,caption\nimg/a.jpg,a good one\n../outside/o.jpg,up and out\n"
        f"{outside / 'o.jpg'},absolute\nimg/out.jpg,through a link\n"
    )
    table = ["build-stream", "table", "--input", str(csv), "--url-col", "image"]
    assert main([*table, "--caption-col", "caption", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    rep = _report(tmp_path / "t")
    assert rep["dropped"] == {"outside_root": 3} and rep["kept_total"] == 1


@pytest.fixture
def table_dir(tmp_path):
    d = tmp_path / "pairs"
    (d / "img").mkdir(parents=True)
    for n in ("good1", "good2", "bad", "five", "z"):
        (d / "img" / f"{n}.jpg").write_bytes(jpeg(n))
    return d


def _table(csv: Path, out: Path, *extra: str) -> dict:
    argv = ["build-stream", "table", "--input", str(csv), "--out", str(out), "--quiet"]
    assert main([*argv, *extra]) == 0
    samples = []
    from cvl.data.reader import PairDataset
    from cvl.streams.manifest import load_manifest

    m = load_manifest(out)
    ds = PairDataset.from_shards(m.train_shards(m.task_order[0]))
    samples = [ds.read_raw(i)[1] for i in range(len(ds))]
    return {**_report(out), "captions": sorted(samples)}


def test_csv_unterminated_quote_is_counted_not_merged(table_dir, tmp_path):
    csv = table_dir / "pairs.csv"
    csv.write_text('image,caption\nimg/good1.jpg,one\nimg/bad.jpg,"unterminated\nimg/good2.jpg,c\n')
    r = _table(csv, tmp_path / "s", "--url-col", "image", "--caption-col", "caption")
    assert (r["read"], r["kept_total"], r["dropped"]) == (3, 2, {"malformed_row": 1})
    assert r["captions"] == ["c", "one"]
    csv.write_text(  # a quote followed by text, and a record quoted over two lines (fine)
        'image,caption\nimg/good1.jpg,"one"x\nimg/good2.jpg,"two\nlines"\nimg/z.jpg,z\n'
    )
    r = _table(csv, tmp_path / "s2", "--url-col", "image", "--caption-col", "caption")
    assert (r["read"], r["kept_total"], r["dropped"]) == (3, 2, {"malformed_row": 1})
    assert r["captions"] == ["two lines", "z"]


@pytest.mark.parametrize("header", [True, False])
def test_csv_rows_with_the_wrong_number_of_fields_are_dropped_in_both_modes(
    table_dir, tmp_path, header
):
    rows = "img/good1.jpg,one\nimg/five.jpg,a,b,c,d\nimg/good2.jpg,two\nimg/z.jpg\n"
    csv = table_dir / "pairs.csv"
    csv.write_text(("image,caption\n" if header else "") + rows)
    cols = ["--url-col", "image", "--caption-col", "caption"]
    if not header:
        cols = ["--url-col", "0", "--caption-col", "1", "--no-header"]
    r = _table(csv, tmp_path / "s", *cols)
    assert (r["read"], r["kept_total"], r["dropped"]) == (4, 2, {"malformed_row": 2})
    assert r["captions"] == ["one", "two"]


# -- the disk fills up during a build ------------------------------------------------------------
HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    "fault, says",
    [
        (["--fsize", "60000"], "file too large"),  # the kernel refuses (RLIMIT_FSIZE: EFBIG)
        (["--enospc", "000000.tar:60000"], "no space left on device"),
    ],
    ids=["file-size-limit", "enospc"],
)
def test_a_build_that_runs_out_of_space_says_so_in_one_line_about_the_build(tmp_path, fault, says):
    """The shard writer's tar stream fails mid-write: one line that talks of the build (not of
    a run's checkpoints), no second traceback from the abandoned tar stream's finaliser, and
    nothing left at --out."""
    out = tmp_path / "s"
    argv = ["build-stream", "synthetic", "--out", str(out), "--tasks", "2", "--per-task", "400"]
    r = subprocess.run(
        [sys.executable, str(HERE / "fault_run.py"), *fault, "--", *argv, "--quiet"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert f"{out}: {says}" in r.stderr and "while writing it" in r.stderr
    assert "a stream is built in a temporary folder and renamed only when complete" in r.stderr
    assert "a run resumes" not in r.stderr and "checkpoint" not in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".s.*"))


# -- builds on every core: the output does not depend on --processes ------------------------------
def _tree(out: Path) -> dict[str, object]:
    """Every file of a stream folder; stream.json without its creation time, and not the
    output marker (it records the command line, --processes included)."""
    files: dict[str, object] = {}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if p.is_file() and rel != ".cvl-output.json":
            files[rel] = p.read_bytes()
    files["stream.json"] = {
        k: v for k, v in json.loads(files["stream.json"]).items() if k != "created"
    }
    for rel in list(files):  # index summaries: without the files' own times (their identity)
        if rel.endswith("idx.json"):
            files[rel] = _timeless(json.loads(files[rel]))
    return files


def _timeless(d: object) -> object:
    if isinstance(d, dict):
        return {k: _timeless(v) for k, v in d.items() if not k.endswith("_mtime_ns")}
    return d


def test_a_table_build_writes_the_same_bytes_with_1_and_3_processes(tmp_path, monkeypatch):
    """--processes 3 writes whole shards in 3 processes: shard k of a set holds the kept rows
    of input positions 4k..4k+3 (--shard-size 4; a failed image leaves its shard short), keys
    are unique over the set before any shard is written (a failed row keeps its key), and every
    file equals the one-process build's, byte for byte."""
    import cvl.streams.pipeline as pipeline
    from cvl.data.reader import index_shard

    img = tmp_path / "pairs" / "img"
    img.mkdir(parents=True)
    lines = ["id,image,caption,task,split,cat"]
    for i in range(30):
        rid = {2: "x.1", 3: "x_1"}.get(i, f"s{i}")  # the same key once made safe: x_1
        (img / f"{i}.jpg").write_bytes(b"\xff\xd8 not a jpeg" if i == 2 else jpeg(f"n{i}"))
        split = "test" if i in (15, 29) else "train"
        lines.append(f"{rid},img/{i}.jpg,photo {i},{'a' if i < 16 else 'b'},{split},c{i % 3}")
    csv = tmp_path / "pairs" / "pairs.csv"
    csv.write_text("\n".join(lines) + "\n")
    cols = ["--url-col", "image", "--caption-col", "caption", "--id-col", "id"]
    cols += ["--task-col", "task", "--split-col", "split", "--category-col", "cat"]
    cols += ["--shard-size", "4", "--name", "s", "--image-size", "16"]
    maps = []
    real = pipeline.map_shards
    monkeypatch.setattr(pipeline, "map_shards", lambda *a: maps.append(a[1:]) or real(*a))
    trees = []
    for n in (1, 3):
        out = tmp_path / f"p{n}"
        assert main(["build-stream", "table", "--input", str(csv), "--out", str(out), *cols,
                     "--processes", str(n), "--quiet"]) == 0  # fmt: skip
        trees.append(_tree(out))
    assert maps == [(10, 3)]  # 10 shard jobs (4 + 1 + 4 + 1) in 3 processes
    one, three = trees
    assert one.keys() == three.keys()
    assert [k for k in one if one[k] != three[k]] == []
    counts = {}
    for rel in one:
        if rel.endswith(".tar"):
            entries, _ = index_shard(str(tmp_path / "p3" / rel))
            counts[rel] = [e.key for e in entries]
    assert counts == {
        "eval/test/a/000000.tar": ["s15"],
        "eval/test/b/000000.tar": ["s29"],
        "train/a/000000.tar": ["s0", "s1", "x_1_1"],  # row 2 failed: 3 of input rows 0-3
        "train/a/000001.tar": ["s4", "s5", "s6", "s7"],
        "train/a/000002.tar": ["s8", "s9", "s10", "s11"],
        "train/a/000003.tar": ["s12", "s13", "s14"],
        "train/b/000000.tar": ["s16", "s17", "s18", "s19"],
        "train/b/000001.tar": ["s20", "s21", "s22", "s23"],
        "train/b/000002.tar": ["s24", "s25", "s26", "s27"],
        "train/b/000003.tar": ["s28"],
    }
    rep = json.loads(one["build_report.json"])
    assert rep["dropped"] == {"bad_image": 1} and rep["kept_total"] == 29


def test_compose_parts_and_class_splits_write_the_same_bytes_with_1_and_3_processes(
    synth_stream, tmp_path
):
    """Copied parts (compose) and class splits write whole shards per process too: shards of
    --shard-size 10 in input order (a 48-sample part: 10, 10, 10, 10, 8), the same files."""
    from cvl.streams.manifest import load_manifest

    trees = {}
    for n in (1, 3):
        comp = ["build-stream", "compose", "--out", str(tmp_path / f"c{n}"), "--name", "c"]
        comp += [
            f"--task=a={synth_stream}:task=t0:part=1/2:test=full",
            f"--task=b={synth_stream}:task=t1",
        ]
        split = ["build-stream", "class-split", "--from", str(synth_stream), "--name", "s"]
        split += ["--out", str(tmp_path / f"s{n}"), "--labels", "category", "--steps", "2"]
        for argv in (comp, split):
            assert main([*argv, "--shard-size", "10", "--processes", str(n)]) == 0
        trees[n] = (_tree(tmp_path / f"c{n}"), _tree(tmp_path / f"s{n}"))
    for one, three in zip(trees[1], trees[3]):
        assert one.keys() == three.keys()
        assert [k for k in one if one[k] != three[k]] == []
    m = load_manifest(tmp_path / "c3")
    assert m.tasks["a"].train.shards == [f"train/a/{k:06d}.tar" for k in range(5)]
    sizes = [len(index_shard_keys(s)) for s in m.train_shards("a")]
    assert sizes == [10, 10, 10, 10, 8]
    assert len(trees[1][1]) > 10  # the class split wrote several shards


def index_shard_keys(path: Path) -> list[str]:
    from cvl.data.reader import index_shard

    return [e.key for e in index_shard(str(path))[0]]
