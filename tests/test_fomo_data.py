"""recipes/fomo_table.py: FoMo-in-Flux's info files and sequences in cvl's formats (FoMo's
task chunks, its caption choice), read back by `cvl build-stream table` and by the
zero-shot image-folder scanner."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from PIL import Image
from reliability_helpers import cli

from cvl.evaluation.zeroshot import scan_image_folder
from cvl.streams.manifest import load_manifest

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _module():
    spec = importlib.util.spec_from_file_location("fomo_table", RECIPES / "fomo_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_fomo(root: Path) -> tuple[Path, Path]:
    """Two datasets (A: classes a0..a3, B: b0..b2), 2 train + 1 test image per class."""
    info, data = root / "info", root / "data"
    info.mkdir(parents=True)
    for ds, n in (("A", 4), ("B", 3)):
        for split, per in (("train", 2), ("test", 1)):
            items = {}
            for c in range(n):
                for k in range(per):
                    key = f"{ds.lower()}/{split}/{c}_{k}.png"
                    p = data / ds / key
                    p.parent.mkdir(parents=True, exist_ok=True)
                    Image.new("RGB", (8, 8), (40 * c, 20 * k, 9)).save(p)
                    items[key] = {
                        "classname": f"{ds.lower()}{c}",
                        "target": c,
                        "default_caption": None,
                        "primer_caption": f"A photo of a {ds.lower()}{c}.",
                        "synthetic_merged_caption": [f"{ds} picture {c} {k}", "other"],
                    }
            (info / f"{ds}_{split}.json").write_text(json.dumps(items))
    return info, data


def test_fomo_tasks_and_rows(tmp_path):
    m = _module()
    info, data = _fake_fomo(tmp_path)
    seq = ["A+++a0", "A+++a1", "B+++b0", "A+++a2", "B+++b1", "B+++b2", "A+++a3"]
    tasks = m.fomo_tasks(seq, 3, False)  # 7 entries in 3 tasks: 3, 2, 2 (FoMo's chunks)
    assert [len(t) for t in tasks] == [3, 2, 2]
    assert tasks[1] == [("A", "a2"), ("B", "b1")]
    by_ds = m.fomo_tasks(seq, 3, True)  # dataset-incremental: one task per run of a dataset
    assert [t[0][0] for t in by_ds] == ["A", "B", "A", "B", "A"]
    rows = list(m.table_rows(info, data, tasks))
    assert len(rows) == 7 * 3  # 2 train + 1 test per class
    r = next(x for x in rows if x["category"] == "A/a2" and x["split"] == "train")
    assert r["task"] == "t01" and r["caption"] == "A picture 2 0"  # the first merged caption
    assert Path(r["path"]).is_file()
    assert m.caption({"default_caption": "d", "synthetic_merged_caption": ["s"]}) == "d"
    assert m.caption({"default_caption": None, "primer_caption": "p"}) == "p"
    # cvl's table builder reads the rows: 3 tasks, their test sets, the categories
    table = tmp_path / "fomo.jsonl"
    table.write_text("".join(json.dumps(x) + "\n" for x in rows))
    out = tmp_path / "stream"
    cli(
        ["build-stream", "table", "--input", str(table), "--url-col", "path"]
        + ["--caption-col", "caption", "--task-col", "task", "--category-col", "category"]
        + ["--split-col", "split", "--images-root", "/", "--out", str(out), "--quiet"]
    )
    man = load_manifest(out)
    assert list(man.task_order) == ["t00", "t01", "t02"]
    assert [man.tasks[t].train.count for t in man.task_order] == [6, 4, 4]


def test_held_out_folders_for_zeroshot(tmp_path):
    m = _module()
    info, data = _fake_fomo(tmp_path)
    assert (
        m.main(
            ["folders", "--info", str(info), "--data", str(data), "--out", str(tmp_path / "h"), "B"]
        )
        == 0
    )
    paths, labels, names = scan_image_folder(tmp_path / "h" / "B")
    assert names == ["b0", "b1", "b2"] and sorted(labels) == [0, 1, 2]
    assert all(p.resolve().is_file() for p in paths)
