"""Bad and hostile data: corrupt shard members, decompression bombs, escaping paths and names,
unsafe YAML and pickles; numeric faults (NaN/Inf losses); config and stream safety."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import resource
import shutil
import struct
import tarfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from reliability_helpers import build_tiny_stream, train_argv

from cvl.cli import main
from cvl.data.reader import PairDataset
from cvl.errors import CvlError
from cvl.train.config import NON_RESULT_KEYS, TrainConfig, config_diff

ROOT = Path(__file__).resolve().parent.parent


# -- bad members -------------------------------------------------------------------------------
def _jpeg(color=(200, 30, 30), size=(32, 32), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _bomb_png(w: int = 20000, h: int = 20000) -> bytes:
    """A PNG header announcing w×h 8-bit grey pixels (+ the start of a zero-filled IDAT)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (w + 1) * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)


def _meta(key: str, task: str) -> bytes:
    return json.dumps({"id": key, "task": task, "category": "circle"}).encode()


# key -> members; expected fate: used, indexed out (reason), or unreadable at load time
def bad_members(task: str) -> dict[str, dict[str, bytes]]:
    good = _jpeg()
    deep = Image.fromarray((np.ones((16, 16)) * 40000).astype(np.uint16))
    return {
        "trunc": {"jpg": good[: len(good) // 2], "txt": b"a red circle"},
        "pngasjpg": {"jpg": _png(Image.new("RGB", (16, 16), (0, 0, 250))), "txt": b"blue"},
        "zero": {"jpg": b"", "txt": b"nothing"},
        "cmyk": {"jpg": _jpeg((0, 255, 255, 0), mode="CMYK"), "txt": b"a cmyk red"},
        "deep": {"png": _png(deep), "txt": b"a 16-bit grey"},
        "emptycap": {"jpg": good, "txt": b""},
        "latin1": {"jpg": good, "txt": "caf\u00e9 cr\u00e8me".encode("latin-1")},
        "nojson": {"jpg": good, "txt": b"no metadata"},
        "notxt": {"jpg": good},
        "bomb": {"png": _bomb_png(), "txt": b"a very large image"},
    }


USED = {"pngasjpg", "cmyk", "deep", "nojson"}
UNREADABLE = {"trunc", "zero", "latin1", "bomb"}
INDEXED_OUT = {"empty_caption": 1, "missing_caption": 1}


def write_tar(path: Path, samples: dict[str, dict[str, bytes]], task: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for key, members in samples.items():
            if key != "nojson" and "json" not in members:
                members = {**members, "json": _meta(key, task)}
            for ext, data in members.items():
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))


def add_shard(stream: Path, where: list[str], rel: str, n: int) -> None:
    """List shard `rel` in stream.json at `where` (e.g. ['tasks', 't1', 'train'])."""
    mp = stream / "stream.json"
    d = json.loads(mp.read_text())
    node = d
    for k in where:
        node = node[k]
    node["shards"].append(rel)
    node["count"] += n
    mp.write_text(json.dumps(d, indent=2))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("rel-data") / "s")


@pytest.fixture(scope="module")
def bad_stream(tiny, tmp_path_factory):
    """The tiny stream with a shard of every kind of bad member added to t1 (train, test)."""
    s = tmp_path_factory.mktemp("bad") / "s"
    shutil.copytree(tiny, s)
    write_tar(s / "train/t1/bad.tar", bad_members("t1"), "t1")
    write_tar(s / "eval/test/t1/bad.tar", bad_members("t1"), "t1")
    add_shard(s, ["tasks", "t1", "train"], "train/t1/bad.tar", 8)
    add_shard(s, ["eval_sets", "test", "tasks", "t1"], "eval/test/t1/bad.tar", 8)
    return s


def test_reader_skips_and_counts_every_bad_kind(tmp_path):
    shard = tmp_path / "bad.tar"
    write_tar(shard, bad_members("t"), "t")
    ds = PairDataset.from_shards([shard], name="task t")
    assert dict(ds.skipped) == INDEXED_OUT
    assert {e.key for e in ds.entries} == USED | UNREADABLE
    ds.drop_unreadable()
    assert {e.key for e in ds.entries} == USED
    assert ds.skipped["unreadable"] == len(UNREADABLE)
    px = {e.key: ds.read_raw(i)[0] for i, e in enumerate(ds.entries)}
    assert all(im.mode == "RGB" for im in px.values())
    assert np.asarray(px["deep"])[0, 0].tolist() == [156, 156, 156]  # 40000 / 256, not white
    assert np.asarray(px["cmyk"])[0, 0, 0] > 200  # CMYK (0, 255, 255, 0) is red
    assert ds.read_raw([e.key for e in ds.entries].index("nojson"))[2] == {}


@pytest.mark.parametrize("side", [20000, 9000])  # PIL's own limit; only cvl's MAX_PIXELS
def test_decompression_bomb_is_refused_before_decoding(tmp_path, side):
    shard = tmp_path / "bomb.tar"
    write_tar(shard, {"bomb": {"png": _bomb_png(side, side), "txt": b"x"}}, "t")
    ds = PairDataset.from_shards([shard])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(Exception, match="exceeds"):
        ds.read_raw(0)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 50  # decoding would need 81-400 MB
    with pytest.raises(CvlError, match="all 1 samples failed to decode"):
        ds[0]


def test_training_skips_and_counts_bad_samples(bad_stream, tmp_path, capsys):
    out = tmp_path / "r"
    argv = train_argv(bad_stream, out, "seqft")
    i = argv.index("--max-steps-per-task")
    argv[i : i + 2] = ["--max-steps-per-task", "0"]  # one full epoch: every sample is visited
    assert main(argv) == 0
    t1 = json.loads((out / "tasks/01-t1/task.json").read_text())
    assert t1["skipped"] == INDEXED_OUT
    assert t1["train_items"] == 32 + len(USED | UNREADABLE)
    assert t1["replaced_samples"] >= len(UNREADABLE)  # each visited once, replaced by the next
    log = [json.loads(x) for x in (out / "tasks/01-t1/train_log.jsonl").read_text().splitlines()]
    assert sum(r["replaced_samples"] for r in log) == t1["replaced_samples"]
    t0 = json.loads((out / "tasks/00-t0/task.json").read_text())
    assert t0["skipped"] == {} and t0["replaced_samples"] == 0
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    said = capsys.readouterr().out
    assert re.search(r"01-t1: empty_caption 1, missing_caption 1, replaced_samples \d+", said)
    assert "00-t0:" not in said


def test_eval_and_analysis_sets_leave_bad_samples_out(bad_stream, capsys):
    from cvl.evaluation.embed import eval_dataset  # also what `cvl analyze` and best-val use
    from cvl.streams.manifest import load_manifest

    m = load_manifest(bad_stream)
    ds = eval_dataset(SimpleNamespace(image_size=32), m.eval_shards("test", "t1"))
    assert len(ds) == 8 + len(USED)  # no bad item, none counted twice
    assert dict(ds.skipped) == {**INDEXED_OUT, "unreadable": len(UNREADABLE)}
    assert "6 sample(s) left out of" in capsys.readouterr().err
    ds[len(ds) - 1]  # every kept item decodes


def test_task_with_only_bad_samples_stops_with_one_line(tiny, tmp_path, capsys):
    s = tmp_path / "s"
    shutil.copytree(tiny, s)
    d = json.loads((s / "stream.json").read_text())
    bad = {k: v for k, v in bad_members("t1").items() if k in UNREADABLE | {"notxt"}}
    write_tar(s / "train/t1/bad.tar", bad, "t1")
    d["tasks"]["t1"]["train"] = {"shards": ["train/t1/bad.tar"], "count": 5}
    (s / "stream.json").write_text(json.dumps(d))
    assert main(train_argv(s, tmp_path / "r", "seqft")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: task t1: all 4 samples failed")
    assert "missing_caption': 1" in err
    # indexing finds nothing usable at all: the same one line, naming the task
    write_tar(s / "train/t1/bad.tar", {"a": {"txt": b"x"}, "b": {"jpg": b"", "txt": b""}}, "t1")
    from cvl.data import reader

    reader.index_shard.cache_clear()
    assert main(train_argv(s, tmp_path / "r2", "seqft")) == 2
    note, err = capsys.readouterr().err.strip().split("\n")  # the tar changed: said, re-indexed
    assert note.startswith("note: re-indexed 1 shard(s) whose index no longer matched the tar")
    assert err.startswith("error: task t1: no usable samples")
    assert "'missing_image': 1" in err and "'empty_caption': 1" in err


# -- hostile names and paths -------------------------------------------------------------------
HOSTILE = ["../../escape", "/abs/path", "a\x00b", "$(touch pwned); `touch pwned2` | x", "..", "."]


def test_hostile_ids_stay_inside_the_shard_folder(tmp_path, monkeypatch):
    from cvl.streams.writer import ShardSink

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "stream"
    sink = ShardSink(root, "train/t0")
    keys = [sink.write(h, _jpeg(), "caption", {"id": h}) for h in HOSTILE]
    sink.close_shard()
    assert len(set(keys)) == len(HOSTILE)
    assert all(re.fullmatch(r"[A-Za-z0-9_\-]+", k) for k in keys)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    shard = root / "train/t0/000000"  # the tar and its index, nothing else anywhere
    assert files == [Path(f"{shard}.{x}") for x in ("idx.json", "idx.npy", "tar")]
    with tarfile.open(files[-1]) as tf:
        assert all("/" not in n and ".." not in n.split(".")[0] for n in tf.getnames())


@pytest.mark.parametrize("name", HOSTILE[:3] + [".hidden", "x\ny"])
def test_hostile_task_names_are_refused(tiny, name):
    from cvl.streams.manifest import manifest_from_json

    d = json.loads((tiny / "stream.json").read_text())
    d["tasks"][name] = d["tasks"].pop("t0")
    d["task_order"] = [name, "t1", "t2"]
    for es in d["eval_sets"].values():
        es["tasks"][name] = es["tasks"].pop("t0")
    with pytest.raises(CvlError, match="cannot be a file name"):
        manifest_from_json(d)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../other/000000.tar", "train/../../x.tar"])
def test_shard_paths_outside_the_stream_are_refused(tiny, tmp_path, shard):
    from cvl.streams.manifest import load_manifest

    s = tmp_path / "s"
    shutil.copytree(tiny, s)
    d = json.loads((s / "stream.json").read_text())
    d["tasks"]["t0"]["train"]["shards"] = [shard]
    (s / "stream.json").write_text(json.dumps(d))
    with pytest.raises(CvlError, match="escapes the stream folder"):
        load_manifest(s)


def test_symlinks_out_of_the_stream_only_through_declared_sources(tiny, tmp_path):
    from cvl.streams.manifest import load_manifest

    s = tmp_path / "s"
    (s / "sources").mkdir(parents=True)
    os.symlink(os.path.relpath(tiny, s / "sources"), s / "sources" / "src")
    d = json.loads((tiny / "stream.json").read_text())
    for t in d["tasks"].values():
        t["train"]["shards"] = [f"sources/src/{x}" for x in t["train"]["shards"]]
    d["eval_sets"] = {}
    d["sources"] = [{"name": "synth", "link": "sources/src"}]
    (s / "stream.json").write_text(json.dumps(d))
    assert load_manifest(s).train_shards("t0")[0].is_file()  # a composed stream's layout
    d["sources"] = []  # the same symlink, undeclared: refused
    (s / "stream.json").write_text(json.dumps(d))
    with pytest.raises(CvlError, match="outside the stream folder"):
        load_manifest(s)
    shutil.rmtree(s / "sources")  # a planted symlink under train/ pointing out: refused
    (s / "train").mkdir()
    os.symlink(tiny / "train" / "t0", s / "train" / "t0")
    for t in d["tasks"].values():
        t["train"]["shards"] = [x.replace("sources/src/", "") for x in t["train"]["shards"]]
    d["tasks"] = {"t0": d["tasks"]["t0"]}
    d["task_order"] = ["t0"]
    (s / "stream.json").write_text(json.dumps(d))
    with pytest.raises(CvlError, match="outside the stream folder"):
        load_manifest(s)


def test_a_stream_composed_of_composed_streams_loads(tiny, tmp_path):
    """compose(compose(S)): the outer stream's shards reach S through the inner stream's own
    declared sources/ link (a protocol preset over composed stand-ins does this)."""
    from cvl.cli import main
    from cvl.streams.manifest import load_manifest

    inner, outer = tmp_path / "inner", tmp_path / "outer"
    assert (
        main(["build-stream", "compose", "--task", f"a={tiny}:task=t0", "--out", str(inner)]) == 0
    )
    argv = ["build-stream", "compose", "--task", f"b={inner}", "--eval", f"bench={inner}"]
    assert main([*argv, "--out", str(outer)]) == 0
    m = load_manifest(outer)
    assert m.train_shards("b")[0].resolve().is_relative_to(tiny.resolve())
    assert m.benchmark_shards("bench")[0].is_file()


def test_yaml_is_loaded_safely(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    evil = '!!python/object/apply:os.system ["touch pwned"]'
    (tmp_path / "r.yaml").write_text(f"lr: {evil}\n")
    argv = ["train", "--stream", "x", "--out", "o", "--config", str(tmp_path / "r.yaml")]
    assert main(argv) == 2
    assert main(["train", "--stream", "x", "--out", "o", "--method-arg", f"a={evil}"]) == 2
    assert not (tmp_path / "pwned").exists()
    assert "could not determine a constructor" in capsys.readouterr().err


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickles_are_never_executed(tmp_path, monkeypatch):
    from cvl.train.checkpoint import load_torch

    monkeypatch.chdir(tmp_path)
    torch.save({"state": _Evil()}, tmp_path / "optimizer.pt")
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        load_torch(tmp_path / "optimizer.pt")
    assert not (tmp_path / "pwned").exists()


def _restricted_unpickler_only(text: str) -> bool:
    """pickle is used only through an Unpickler subclass whose find_class allows a fixed list
    (CIFAR-100's pickles: cvl/streams/cls_layouts.py), never pickle.load / loads directly."""
    direct = re.search(r"pickle\.loads?\(|pickle\.Unpickler\(", text)
    sub = re.search(r"class \w+\(pickle\.Unpickler\)", text)
    return bool(sub) and "def find_class" in text and not direct


def test_source_has_no_unsafe_loaders_or_shells():
    """Every torch.load passes weights_only=True, YAML uses safe_load, no pickle but a restricted
    unpickler (find_class over a fixed list), no shell."""
    bad = []
    for f in sorted((ROOT / "cvl").rglob("*.py")):
        text = f.read_text()
        for m in re.finditer(r"torch\.load\(", text):
            depth, i = 1, m.end()
            while depth:  # the call's arguments, nested parentheses included
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            if "weights_only=True" not in text[m.end() : i]:
                bad.append(f"{f.name}: {text[m.start() : i]}")
        if "import pickle" in text and not _restricted_unpickler_only(text):
            bad.append(f"{f.name}: import pickle")
        for pat in (r"yaml\.load\(", r"yaml\.unsafe_load", r"shell=True"):
            bad += [f"{f.name}: {pat}" for _ in re.finditer(pat, text)]
        bad += [f"{f.name}: os.system" for _ in re.finditer(r"os\.system\(", text)]
    assert bad == []


def test_run_checkpoints_are_safetensors(tiny, tmp_path):
    """Weights and method state are safetensors; only optimizer/scheduler state is a .pt."""
    out = tmp_path / "r"
    argv = train_argv(tiny, out, "seqft")
    i = argv.index("--max-steps-per-task")
    argv[i + 1] = "2"
    assert main(argv) == 0
    for p in out.rglob("*"):
        if p.is_file():
            assert p.suffix in (".safetensors", ".json", ".jsonl"), p


# -- numeric faults -----------------------------------------------------------------------------
def _nan_at(monkeypatch, task: int, step: int, seen: list | None = None):
    """SeqFT's loss becomes NaN at (task index, optimizer step) — step counted from 1."""
    from cvl.methods.seqft import SeqFT

    real = SeqFT.loss

    def loss(self, batch, out, ctx):
        terms = real(self, batch, out, ctx)
        if seen is not None:
            seen.append(
                (
                    ctx.task_index,
                    ctx.step + 1,
                    sum(float(p.detach().sum()) for p in ctx.model.parameters()),
                )
            )
        if (ctx.task_index, ctx.step + 1) == (task, step):
            terms = {**terms, "itc": terms["itc"] * float("nan")}
        return terms

    monkeypatch.setattr(SeqFT, "loss", loss)


def test_nan_loss_stops_with_term_step_ids_and_resumes(tiny, tmp_path, monkeypatch, capsys):
    from reliability_helpers import assert_same_run

    ref, out = tmp_path / "ref", tmp_path / "r"
    assert main(train_argv(tiny, ref, "seqft")) == 0
    _nan_at(monkeypatch, 1, 3)
    capsys.readouterr()
    assert main(train_argv(tiny, out, "seqft")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "non-finite loss at task t1 (index 1), step 3: itc=nan" in err
    ids = re.search(r"sample ids \(rank 0\): (.*?);", err).group(1).split(", ")
    assert len(ids) == 8 and all(i.startswith("t1") for i in ids)
    assert "can resume from last/ (task 1, step 2)" in err
    monkeypatch.undo()  # the data is fixed: the same command resumes and ends like `ref`
    assert main(train_argv(tiny, out, "seqft")) == 0
    assert "resuming" in capsys.readouterr().out
    assert assert_same_run(ref, out) == 3


def test_skip_nonfinite_skips_the_step_and_counts_it(tiny, tmp_path, monkeypatch, capsys):
    seen: list = []
    _nan_at(monkeypatch, 1, 2, seen)
    out = tmp_path / "r"
    assert main([*train_argv(tiny, out, "seqft"), "--skip-nonfinite", "1"]) == 0
    assert "step skipped (1 of --skip-nonfinite 1)" in capsys.readouterr().out
    sums = {(t, s): v for t, s, v in seen}
    assert sums[(1, 3)] == sums[(1, 2)] != sums[(1, 1)]  # no update at step 2
    log = [json.loads(x) for x in (out / "tasks/01-t1/train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert log[1]["nonfinite_skipped"] == 1 and np.isnan(log[1]["itc"])
    assert json.loads((out / "tasks/01-t1/task.json").read_text())["nonfinite_skipped_steps"] == 1
    # a second bad step is past the allowance
    _nan_at(monkeypatch, 2, 1)
    assert main([*train_argv(tiny, tmp_path / "r2", "seqft"), "--skip-nonfinite", "1"]) == 2


# -- config safety -----------------------------------------------------------------------------
def _other_value(v, name):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    if isinstance(v, dict):
        return {"x": 1}
    return f"other-{name}"


def test_every_result_field_is_compared_on_resume():
    base = TrainConfig().to_json()
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    result = [f for f in fields if f not in NON_RESULT_KEYS]
    assert {"method", "model", "model_config", "seed", "lr", "buffer"} <= set(result)
    for f in fields:
        new = {**base, f: _other_value(base[f], f)}
        diff = config_diff(base, new)
        if f in NON_RESULT_KEYS:
            assert diff == [], f
        else:
            assert diff == [f"{f}: {base[f]!r} -> {new[f]!r}"], f


@pytest.mark.parametrize(
    "change, shown",
    [
        (["--method", "ctp"], "method: 'seqft' -> 'ctp'"),
        (["--model-config", "tiny-vit"], "model_config: 'tiny' -> 'tiny-vit'"),
        (["--seed", "3"], "seed: 0 -> 3"),
    ],
)
def test_resume_with_another_config_is_refused_with_a_diff(tiny, tmp_path, capsys, change, shown):
    out = tmp_path / "r"
    argv = train_argv(tiny, out, "seqft")
    argv[argv.index("--max-steps-per-task") + 1] = "1"
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, *change]) == 2
    assert shown in capsys.readouterr().err


def test_rebuilt_stream_is_detected_by_resume_and_eval(tiny, tmp_path, capsys):
    from cvl.evaluation.runner import stream_warnings
    from cvl.runs import load_run
    from cvl.streams.manifest import load_manifest

    s = tmp_path / "s"
    shutil.copytree(tiny, s)
    out = tmp_path / "r"
    argv = train_argv(s, out, "seqft")
    argv[argv.index("--max-steps-per-task") + 1] = "1"
    assert main(argv) == 0
    run_d = load_run(out)
    assert stream_warnings(run_d, load_manifest(s)) == []
    d = json.loads((s / "stream.json").read_text())
    d["created"] = "2030-01-01T00:00:00+00:00"  # rebuilt in place: same content, new file
    (s / "stream.json").write_text(json.dumps(d))
    capsys.readouterr()
    assert main(argv) == 2
    assert "stream.json was rewritten since the run started" in capsys.readouterr().err
    (w,) = stream_warnings(run_d, load_manifest(s))
    assert "rebuilt in place" in w
    d["seed"] = 7  # another stream (fingerprint differs): both fingerprints are shown
    (s / "stream.json").write_text(json.dumps(d))
    (w,) = stream_warnings(run_d, load_manifest(s))
    assert '"seed": 0' in w and '"seed": 7' in w and "different stream" in w
