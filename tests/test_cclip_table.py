"""recipes/cclip_table.py: C-CLIP's hub datasets (parquet with embedded images) as cvl tables and
zero-shot folders, on tiny parquet files written here; the smoke's stream-folder."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from cvl.cli import main
from cvl.evaluation.zeroshot import scan_image_folder
from cvl.streams.manifest import load_manifest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "cclip_table.py"


def _tool():
    spec = importlib.util.spec_from_file_location("cclip_table", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (20 * i % 255, 10, 200)).save(buf, format="PNG")
    return buf.getvalue()


def _write(path: Path, cols: dict, metadata: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    t = pa.table(cols)
    if metadata:
        t = t.replace_schema_metadata({b"huggingface": json.dumps(metadata).encode()})
    pq.write_table(t, path)


def _images(idx: range) -> list[dict]:
    return [{"bytes": _png(i), "path": f"img{i}.png"} for i in idx]


def test_single_split_dataset_is_cut_at_random_and_builds(tmp_path):
    """simpsons (one hub split): 80 % train / 20 % test, seeded; `cvl build-stream table`
    reads the JSONL and the images."""
    hf = tmp_path / "hf"
    caps = [f"a simpsons frame number {i}" for i in range(10)]
    _write(
        hf / "data" / "train-00000-of-00001.parquet", {"image": _images(range(10)), "text": caps}
    )
    tool = _tool()
    tool.main(["table", "simpsons", "--hf", str(hf), "--out", str(tmp_path / "t")])
    rows = [json.loads(x) for x in (tmp_path / "t" / "pairs.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and sum(r["split"] == "test" for r in rows) == 2
    assert all((tmp_path / "t" / r["path"]).is_file() and r["path"].endswith(".png") for r in rows)
    again = tmp_path / "t2"
    tool.main(["table", "simpsons", "--hf", str(hf), "--out", str(again)])
    assert (again / "pairs.jsonl").read_text() == (tmp_path / "t" / "pairs.jsonl").read_text()
    out = tmp_path / "s"
    argv = ["build-stream", "table", "--input", str(tmp_path / "t" / "pairs.jsonl")]
    argv += ["--url-col", "path", "--caption-col", "caption", "--split-col", "split"]
    assert main([*argv, "--task-name", "simpsons", "--out", str(out), "--quiet"]) == 0
    m = load_manifest(out)
    assert m.tasks["simpsons"].train.count == 8
    assert m.eval_sets["test"].tasks["simpsons"].count == 2


def test_hub_splits_and_errors(tmp_path, capsys):
    """pets keeps the hub's train / test files (its caption column: caption_enriched); a row
    without a caption is dropped; a missing column is one clear line."""
    hf = tmp_path / "pets"
    _write(
        hf / "data" / "train-00000-of-00001.parquet",
        {"image": _images(range(3)), "caption_enriched": ["a", None, "c"]},
    )
    _write(
        hf / "data" / "test-00000-of-00001.parquet",
        {"image": _images(range(2)), "caption_enriched": ["d", "e"]},
    )
    tool = _tool()
    tool.main(["table", "pets", "--hf", str(hf), "--out", str(tmp_path / "t")])
    rows = [json.loads(x) for x in (tmp_path / "t" / "pairs.jsonl").read_text().splitlines()]
    assert [r["split"] for r in rows] == ["train"] * 2 + ["test"] * 2
    with pytest.raises(SystemExit):
        tool.main(["table", "lexica", "--hf", str(hf), "--out", str(tmp_path / "x")])
    assert "no column(s) ['prompt']" in capsys.readouterr().err


def test_classification_folder_from_hub_metadata(tmp_path):
    hf = tmp_path / "cifar"
    meta = {"info": {"features": {"label": {"names": ["cat", "dog", "frog"]}}}}
    cols = {"img": _images(range(4)), "label": [2, 0, 2, 1]}
    _write(hf / "plain_text" / "test-00000-of-00001.parquet", cols, meta)
    _tool().main(["folder", "--hf", str(hf), "--image-col", "img", "--out", str(tmp_path / "f")])
    paths, labels, names = scan_image_folder(tmp_path / "f")
    assert names == ["cat", "dog", "frog"] and sorted(labels) == [0, 1, 2, 2]


def test_stream_folder(tmp_path):
    s = tmp_path / "s"
    argv = ["build-stream", "synthetic", "--tasks", "2", "--per-task", "8", "--test-per-task", "6"]
    argv += ["--val-per-task", "0", "--query-per-task", "0", "--gallery-per-task", "0"]
    assert main([*argv, "--out", str(s), "--quiet"]) == 0
    _tool().main(
        ["stream-folder", "--stream", str(s), "--task", "t1", "--out", str(tmp_path / "f")]
    )
    paths, labels, names = scan_image_folder(tmp_path / "f")
    assert len(paths) == 6 and len(names) == len(set(labels)) >= 2
