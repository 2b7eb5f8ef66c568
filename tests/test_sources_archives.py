"""Archive sources (coco / flickr30k / rsicd Karpathy JSON, ec MUGE TSVs, iapr) and compose.

Fixtures are tiny real-format datasets written by `archive_helpers` (generated images, Chinese
EC text, ISO-8859-1 IAPR annotations); nothing is downloaded.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import torch
from archive_helpers import (
    COCO,
    FAST,
    captions_of,
    colour_of,
    ec_text,
    iapr_desc,
    write_data_root,
    write_ec,
    write_iapr,
    write_karpathy,
)
from sources_helpers import close_rgb, mean_rgb

from cvl.cli import main
from cvl.data.reader import PairDataset
from cvl.streams.manifest import load_manifest

TINY_TRAIN = [
    "--method",
    "seqft",
    "--model-config",
    "tiny",
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
    "--quiet",
]


def samples(m, split: str, task: str) -> list[dict]:
    """Every sample of a set as {key, caption, captions, meta, rgb}."""
    shards = m.train_shards(task) if split == "train" else m.eval_shards(split, task)
    ds = PairDataset.from_shards(shards)
    out = []
    for i in range(len(ds)):
        img, cap, meta = ds.read_raw(i)
        out.append({"caption": cap, "meta": meta, "rgb": mean_rgb(img)})
    return out


def counts(m) -> dict[str, dict[str, int]]:
    c = {"train": {t: m.tasks[t].train.count for t in m.task_order}}
    for s, es in m.eval_sets.items():
        c[s] = {t: ss.count for t, ss in es.tasks.items()}
    return c


def report(out: Path) -> dict:
    return json.loads((out / "build_report.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """Every archive dataset in the `protocol --data` layout (written once per module)."""
    return write_data_root(tmp_path_factory.mktemp("rawdata"))


# -- Karpathy sources -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def coco_stream(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("coco") / "coco"
    d = data_root / "coco"
    rc = main(
        ["build-stream", "coco", "--json", str(d / "dataset_coco.json"), "--images", str(d)]
        + ["--out", str(out), *FAST]
    )
    assert rc == 0
    return out


def test_coco_counts_captions_and_pixels(coco_stream):
    m = load_manifest(coco_stream)
    assert m.source == "coco" and m.task_order == ["coco"]
    # restval counts as train; val and test keep every image
    assert counts(m) == {
        "train": {"coco": COCO["train"] + COCO["restval"]},
        "val": {"coco": COCO["val"]},
        "test": {"coco": COCO["test"]},
    }
    test = samples(m, "test", "coco")
    for s in test:
        fname = s["meta"]["filename"]
        assert s["meta"]["captions"] == captions_of(fname)  # all 5 captions, in order
        assert s["caption"] == captions_of(fname)[0]
        assert s["meta"]["filepath"] == "val2014"
        assert close_rgb(s["rgb"], colour_of(fname))
    # the test images in file order (ids after train, restval and val)
    first = COCO["train"] + COCO["restval"] + COCO["val"]
    assert [s["meta"]["id"] for s in test] == [f"coco-{100000 + first + i}" for i in range(6)]


def test_coco_sample_caps(data_root, tmp_path):
    d = data_root / "coco"
    base = ["build-stream", "coco", "--json", str(d / "dataset_coco.json"), "--images", str(d)]
    # DHA: draw N training images, the rest become val (Karpathy's val is then unused)
    rc = main(base + ["--out", str(tmp_path / "a"), "--max-train", "10", "--rest-as-val", *FAST])
    assert rc == 0
    m = load_manifest(tmp_path / "a")
    assert counts(m) == {"train": {"coco": 10}, "val": {"coco": 8}, "test": {"coco": 6}}
    ids_a = {s["meta"]["id"] for s in samples(m, "train", "coco")}
    # Mod-X / DKR: restval is validation; first-N test images; one sample per caption
    rc = main(
        base
        + ["--out", str(tmp_path / "b"), "--restval", "val", "--max-test", "3"]
        + ["--train-samples", "caption", *FAST]
    )
    assert rc == 0
    m = load_manifest(tmp_path / "b")
    assert counts(m) == {"train": {"coco": 14 * 5}, "val": {"coco": 9}, "test": {"coco": 3}}
    tr = samples(m, "train", "coco")
    assert all("captions" not in s["meta"] for s in tr)
    assert len({s["caption"] for s in tr}) == 70
    # seeded: the same draw again
    rc = main(base + ["--out", str(tmp_path / "c"), "--max-train", "10", "--rest-as-val", *FAST])
    assert {
        s["meta"]["id"] for s in samples(load_manifest(tmp_path / "c"), "train", "coco")
    } == ids_a


def test_flickr30k_and_rsicd_flat_layout(data_root, tmp_path):
    f = data_root / "flickr30k"
    rc = main(
        ["build-stream", "flickr30k", "--json", str(f / "dataset_flickr30k.json")]
        + ["--images", str(f / "flickr30k-images"), "--out", str(tmp_path / "f"), *FAST]
    )
    assert rc == 0
    assert counts(load_manifest(tmp_path / "f")) == {
        "train": {"flickr30k": 15},
        "val": {"flickr30k": 5},
        "test": {"flickr30k": 5},
    }
    r = data_root / "rsicd"
    rc = main(
        ["build-stream", "rsicd", "--json", str(r / "dataset_rsicd.json"), "--val-to-train"]
        + ["--images", str(r / "RSICD_images"), "--out", str(tmp_path / "r"), *FAST]
    )
    assert rc == 0
    assert counts(load_manifest(tmp_path / "r")) == {"train": {"rsicd": 11}, "test": {"rsicd": 4}}


def test_karpathy_bad_input(tmp_path):
    root = tmp_path / "k"
    jp = write_karpathy(root, "flickr30k", {"train": 6, "test": 3})
    d = json.loads(jp.read_text())
    ims = d["images"]
    (root / ims[0]["filename"]).unlink()  # missing on disk
    ims[1]["sentences"] = [{"raw": "  "}, {"raw": ""}]  # only empty captions
    ims[2]["sentences"][0]["raw"] = ""  # one empty caption: the other 4 stay
    ims[3]["imgid"] = ims[4]["imgid"]  # duplicate id
    ims[5]["split"] = "holdout"  # unknown split
    del ims[6]["split"]  # no split field
    jp.write_text(json.dumps(d))
    before = set(os.listdir(tmp_path))
    out = tmp_path / "s"
    rc = main(
        ["build-stream", "flickr30k", "--json", str(jp), "--images", str(root)]
        + ["--out", str(out), *FAST]
    )
    assert rc == 0
    assert set(os.listdir(tmp_path)) == before | {"s"}  # nothing written beside --out
    rep = report(out)
    assert rep["dropped"] == {
        "missing_file": 1,
        "missing_caption": 1,
        "duplicate_id": 1,
        "unknown_split": 1,
        "missing_split": 1,
    }
    assert rep["empty_captions_dropped"] == 3
    m = load_manifest(out)
    assert counts(m) == {"train": {"flickr30k": 2}, "test": {"flickr30k": 2}}
    caps = {s["meta"]["filename"]: s["meta"]["captions"] for s in samples(m, "train", "flickr30k")}
    assert caps == {
        ims[2]["filename"]: captions_of(ims[2]["filename"])[1:],  # the empty caption left out
        ims[3]["filename"]: captions_of(ims[3]["filename"]),
    }


def test_karpathy_max_captions(tmp_path):
    jp = write_karpathy(tmp_path / "k", "coco", {"train": 2, "test": 1})
    d = json.loads(jp.read_text())
    d["images"][2]["sentences"] += [{"raw": "a sixth caption"}, {"raw": "a seventh caption"}]
    jp.write_text(json.dumps(d))
    base = ["build-stream", "coco", "--json", str(jp), "--images", str(tmp_path / "k"), *FAST]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    (s,) = samples(load_manifest(tmp_path / "a"), "test", "coco")
    assert s["meta"]["captions"] == captions_of(d["images"][2]["filename"])  # the first 5
    assert report(tmp_path / "a")["captions_beyond_max"] == 2
    assert main([*base, "--out", str(tmp_path / "b"), "--max-captions", "0"]) == 0
    (s,) = samples(load_manifest(tmp_path / "b"), "test", "coco")
    assert len(s["meta"]["captions"]) == 7


def test_karpathy_without_split_field_is_one_line_error(tmp_path, capsys):
    jp = write_karpathy(tmp_path / "k", "coco", {"train": 2})
    d = json.loads(jp.read_text())
    for im in d["images"]:
        del im["split"]
    jp.write_text(json.dumps(d))
    rc = main(
        ["build-stream", "coco", "--json", str(jp), "--images", str(tmp_path / "k")]
        + ["--out", str(tmp_path / "s"), *FAST]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "no image has a 'split' field" in err and "\n" not in err
    assert not (tmp_path / "s").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


# -- EC -------------------------------------------------------------------------------------------
def test_ec_chinese_captions_and_base64_images(data_root, tmp_path):
    out = tmp_path / "ec"
    assert (
        main(["build-stream", "ec", "--data", str(data_root / "ec"), "--out", str(out), *FAST]) == 0
    )
    m = load_manifest(out)
    assert counts(m) == {"train": {"ec": 15}, "test": {"ec": 6}}
    for s in samples(m, "test", "ec"):
        i = int(s["meta"]["id"].split("-")[1])
        assert s["caption"] == ec_text(i)
        assert close_rgb(s["rgb"], colour_of(f"ec{i}"))
    out2 = tmp_path / "ec2"
    rc = main(
        ["build-stream", "ec", "--data", str(data_root / "ec"), "--val", "3", "--max-train", "8"]
        + ["--out", str(out2), *FAST]
    )
    assert rc == 0
    assert counts(load_manifest(out2)) == {"train": {"ec": 8}, "val": {"ec": 3}, "test": {"ec": 6}}


def test_ec_bad_input(tmp_path):
    d = write_ec(tmp_path / "ec", 6, 2)
    tt, it = d / "T2I_train.text.tsv", d / "T2I_train.img.tsv"
    lines = tt.read_bytes().splitlines(keepends=True)
    lines[1] = "1\t连衣裙".encode("gbk") + b"\n"  # wrong encoding (GBK, not UTF-8)
    lines[2] = b"2\t   \n"  # empty description
    lines.append(lines[3])  # duplicate id 3
    lines.append("77\t没有图片的文字\n".encode())  # text without an image
    tt.write_bytes(b"".join(lines))
    il = it.read_bytes().splitlines(keepends=True)
    il[4] = b"4\tnot*base64!!\n"  # undecodable base64
    il[5] = b"5\t" + base64.b64encode(b"not an image at all") + b"\n"  # base64 of no image
    it.write_bytes(b"".join(il))
    out = tmp_path / "s"
    assert main(["build-stream", "ec", "--data", str(d), "--out", str(out), *FAST]) == 0
    rep = report(out)
    assert rep["dropped"] == {
        "non_utf8": 1,
        "missing_caption": 3,  # the empty one + images 1 and 2 left without text
        "duplicate_id": 1,
        "missing_image": 1,
        "bad_base64": 1,
        "bad_image": 1,
    }
    m = load_manifest(out)
    assert counts(m) == {"train": {"ec": 2}, "test": {"ec": 2}}
    assert sorted(s["meta"]["id"] for s in samples(m, "train", "ec")) == ["ec-0", "ec-3"]


# -- IAPR -----------------------------------------------------------------------------------------
def test_iapr_iso_8859_1_descriptions(data_root, tmp_path):
    out = tmp_path / "iapr"
    src = data_root / "iapr" / "iaprtc12"
    rc = main(["build-stream", "iapr", "--data", str(src), "--test", "4", "--out", str(out), *FAST])
    assert rc == 0
    m = load_manifest(out)
    assert counts(m) == {"train": {"iapr": 12}, "test": {"iapr": 4}}
    for s in samples(m, "train", "iapr") + samples(m, "test", "iapr"):
        n = int(s["meta"]["id"].split("-")[1])
        assert s["caption"] == iapr_desc(n - 1000)  # accents decoded, trailing ';' removed
        assert close_rgb(s["rgb"], colour_of(f"iapr{n}"))


def test_iapr_bad_input(tmp_path):
    root = write_iapr(tmp_path / "iaprtc12", 8)
    ann = root / "annotations_complete_eng" / "00"
    (ann / "1000.eng").write_bytes(b"<DOC><DESCRIPTION>bad \x85 byte</DESCRIPTION></DOC>")
    (ann / "1001.eng").write_bytes(b"<DOC><TITLE>no description</TITLE></DOC>")
    (ann / "1002.eng").write_bytes(
        "<DOC><DESCRIPTION>a café, utf-8 copy</DESCRIPTION></DOC>".encode()
    )
    (ann / "1003.eng").write_bytes(b"<DOC><DESCRIPTION> ; </DESCRIPTION></DOC>")
    (root / "images" / "00" / "1004.jpg").unlink()
    (root / "annotations_complete_eng" / "01").mkdir()
    (root / "annotations_complete_eng" / "01" / "1005.eng").write_bytes(
        (ann / "1005.eng").read_bytes()
    )  # the same id in another folder
    out = tmp_path / "s"
    rc = main(
        ["build-stream", "iapr", "--data", str(root), "--test", "1", "--out", str(out), *FAST]
    )
    assert rc == 0
    assert report(out)["dropped"] == {
        "bad_encoding": 1,
        "malformed_record": 1,
        "missing_caption": 1,
        "missing_file": 1,
        "duplicate_id": 1,
    }
    m = load_manifest(out)
    caps = {
        s["meta"]["id"]: s["caption"]
        for s in samples(m, "train", "iapr") + samples(m, "test", "iapr")
    }
    assert caps["iapr-1002"] == "a café, utf-8 copy"
    assert set(caps) == {"iapr-1002", "iapr-1005", "iapr-1006", "iapr-1007"}


# -- compose -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def f30k_stream(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("f30k") / "f30k"
    f = data_root / "flickr30k"
    rc = main(
        ["build-stream", "flickr30k", "--json", str(f / "dataset_flickr30k.json")]
        + ["--images", str(f / "flickr30k-images"), "--out", str(out), *FAST]
    )
    assert rc == 0
    return out


def test_compose_references_whole_tasks_and_copies_disjoint_parts(
    coco_stream, f30k_stream, tmp_path
):
    out = tmp_path / "modx"
    argv = ["build-stream", "compose", "--out", str(out), "--task", f"coco={coco_stream}"]
    argv += [f"--task=f30k-{i}={f30k_stream}:part={i}/3" for i in (1, 2, 3)]
    argv += ["--eval", f"f30k-1k={f30k_stream}:set=test"]
    assert main(argv) == 0
    m = load_manifest(out)
    assert m.task_order == ["coco", "f30k-1", "f30k-2", "f30k-3"]
    assert counts(m) == {
        "train": {"coco": 18, "f30k-1": 5, "f30k-2": 5, "f30k-3": 5},
        "val": {"coco": 5, "f30k-1": 2, "f30k-2": 2, "f30k-3": 1},
        "test": {"coco": 6, "f30k-1": 2, "f30k-2": 2, "f30k-3": 1},
    }
    # whole task: the source's shards through the sources/ symlink, nothing copied
    assert m.tasks["coco"].train.shards == ["sources/coco/train/coco/000000.tar"]
    assert (out / "sources" / "coco").is_symlink()
    assert not (out / "train" / "coco").exists()
    assert m.train_shards("coco")[0].resolve() == (coco_stream / "train/coco/000000.tar").resolve()
    # parts: disjoint, together the whole source task; KEY.json names the new task
    src = {s["meta"]["id"] for s in samples(load_manifest(f30k_stream), "train", "flickr30k")}
    parts = [[s["meta"] for s in samples(m, "train", f"f30k-{i}")] for i in (1, 2, 3)]
    ids = [{p["id"] for p in part} for part in parts]
    assert set().union(*ids) == src and sum(map(len, ids)) == len(src)
    assert all(
        p["task"] == f"f30k-{i + 1}" and p["part"] == f"{i + 1}/3"
        for i, part in enumerate(parts)
        for p in part
    )
    assert m.benchmarks["f30k-1k"].shards.count == 5
    assert [r["name"] for r in m.sources] == ["coco", "f30k"]


def test_compose_bad_input(coco_stream, f30k_stream, tmp_path, capsys):
    out = tmp_path / "x"
    rc = main(
        ["build-stream", "compose", "--out", str(out), "--task", f"a={f30k_stream}:part=1/99"]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "99 parts asked but only 15 samples" in err and "\n" not in err
    rc = main(["build-stream", "compose", "--out", str(out), "--task", f"a={f30k_stream}:slice=1"])
    assert rc == 2 and "unknown key 'slice'" in capsys.readouterr().err
    assert not out.exists() and os.listdir(tmp_path) == []


def test_compose_interrupted_leaves_nothing(f30k_stream, tmp_path, monkeypatch):
    import cvl.streams.compose as compose

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(compose, "copy_part", boom)
    out = tmp_path / "x"
    argv = ["build-stream", "compose", "--out", str(out), "--task", f"a={f30k_stream}:part=1/2"]
    assert main(argv) == 130  # interrupted
    assert os.listdir(tmp_path) == []  # no half stream, no .partial folder


def test_compose_detects_a_changed_source(data_root, tmp_path, capsys):
    f = data_root / "flickr30k"
    src = tmp_path / "f30k"
    build = ["build-stream", "flickr30k", "--json", str(f / "dataset_flickr30k.json")]
    build += ["--images", str(f / "flickr30k-images"), "--out", str(src), *FAST]
    assert main(build) == 0
    out = tmp_path / "c"
    assert main(["build-stream", "compose", "--out", str(out), "--task", f"a={src}"]) == 0
    load_manifest(out)
    assert main([*build, "--overwrite", "--max-train", "10"]) == 0
    with pytest.raises(Exception, match="changed since it was composed"):
        load_manifest(out)


# -- 5 captions per image, scored by `cvl eval` -------------------------------------------------
@pytest.mark.slow
def test_five_caption_retrieval_scored_by_cvl_eval(coco_stream, tmp_path):
    from cvl.evaluation.embed import embed_dataset, eval_dataset
    from cvl.models import load_weights, model_from_config

    run = tmp_path / "run"
    assert main(["train", "--stream", str(coco_stream), "--out", str(run), *TINY_TRAIN]) == 0
    rc = main(["eval", "--run", str(run), "--quiet", "--no-plots", "--no-probe", "--no-zeroshot"])
    assert rc == 0
    met = json.loads((run / "eval" / "metrics.json").read_text())
    info = met["details"]["00-coco"]["coco"]["retrieval"]
    assert info == {"n_images": 6, "n_texts": 30}
    # the same numbers by hand: an image is a hit if any of its 5 captions ranks first
    rd = json.loads((run / "run.json").read_text())
    model = model_from_config(rd["model"])
    load_weights(model, run / "tasks" / "00-coco" / "model.safetensors")
    model.eval()
    m = load_manifest(coco_stream)
    e = embed_dataset(model, eval_dataset(model, m.eval_shards("test", "coco")), 64)
    sim = e.image_features @ e.text_features.T
    own = e.text_to_image[None, :] == torch.arange(6)[:, None]
    tr1 = own.gather(1, sim.argmax(1, keepdim=True)).float().mean().item() * 100
    ir1 = (sim.argmax(0) == e.text_to_image).float().mean().item() * 100
    assert met["matrices"]["TR@1"][0][0] == pytest.approx(tr1)
    assert met["matrices"]["IR@1"][0][0] == pytest.approx(ir1)
