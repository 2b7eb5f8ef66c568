#!/usr/bin/env python3
"""FoMo-in-Flux's datasets in cvl's formats (datasets/fomo.md): standard library only.

`table`: the adaptation datasets of a FoMo sequence as one JSONL row per image (path,
caption, task, category, split) for `cvl build-stream table`, with FoMo's tasks: the
sequence file's `DATASET+++classname` entries cut into N consecutive chunks, the first
(len mod N) one entry longer (its utils/sequence_handling.py `update_args`), or one task per
dataset (`--dataset-incremental`). Captions as FoMo trains on them: `default_caption`, else
the first `synthetic_merged_caption` (FoMo draws one of the list per visit), else
`primer_caption`. Train rows from `<NAME>_train.json`, test rows from `<NAME>_test.json`
(iNaturalist2021: `_train_mini` / `_val`; MTSD: `_val` for test); image paths are
DATA/<NAME>/<key>, as FoMo's loader reads them.

    python recipes/fomo_table.py table --info fomo_in_flux/data_lib/00_info --data DIR \
        --sequence fomo_in_flux/stream_construction/random_sequence_1.json --tasks 20 \
        > fomo.jsonl

`folders`: a held-out classification dataset as an image folder for `cvl eval
--zeroshot-folder` (FOLDER/<class index>/<image> symlinks, classnames.txt in class order):

    python recipes/fomo_table.py folders --info ... --data DIR --out heldout IMAGENET GTSRB
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

SPLIT_FILES = {  # dataset -> (train info, test info) where not <NAME>_train / <NAME>_test
    "iNATURALIST2021": ("iNATURALIST2021_train_mini", "iNATURALIST2021_val"),
    "MTSD": ("MTSD_train", "MTSD_val"),
}


def info_file(info: Path, name: str, split: str) -> Path:
    """The info JSON of dataset `name`'s `split` (train / test)."""
    stem = SPLIT_FILES.get(name, (f"{name}_train", f"{name}_test"))[split == "test"]
    return info / f"{stem}.json"


def fomo_tasks(entries: list[str], n_tasks: int, by_dataset: bool) -> list[list[tuple[str, str]]]:
    """FoMo's tasks: lists of (dataset, classname), in sequence order."""
    seq = [tuple(e.split("+++", 1)) for e in entries]
    if by_dataset:
        tasks: list[list[tuple[str, str]]] = []
        for ds, cls in seq:
            if not tasks or tasks[-1][0][0] != ds:
                tasks.append([])
            tasks[-1].append((ds, cls))
        return tasks
    per, extra = divmod(len(seq), n_tasks)
    out, start = [], 0
    for i in range(n_tasks):
        size = per + (1 if i < extra else 0)
        out.append(seq[start : start + size])
        start += size
    return out


def caption(item: dict) -> str:
    """The caption FoMo trains on (module doc)."""
    if item.get("default_caption"):
        c = item["default_caption"]
    else:
        c = item.get("synthetic_merged_caption") or item.get("primer_caption") or ""
    return c[0] if isinstance(c, list) else c


def table_rows(info: Path, data: Path, tasks: list[list[tuple[str, str]]]) -> Iterator[dict]:
    """One row per image of the tasks' classes, train then test per dataset."""
    task_of = {pair: f"t{i:02d}" for i, t in enumerate(tasks) for pair in t}
    datasets = list(dict.fromkeys(ds for t in tasks for ds, _ in t))
    for ds in datasets:
        for split in ("train", "test"):
            items = json.loads(info_file(info, ds, split).read_text(encoding="utf-8"))
            for key, item in items.items():
                task = task_of.get((ds, item["classname"]))
                if task is None:  # a class of the dataset the sequence leaves out
                    continue
                yield {
                    "path": str(data / ds / key),
                    "caption": caption(item),
                    "task": task,
                    "category": f"{ds}/{item['classname']}",
                    "split": split,
                }


def make_folder(info: Path, data: Path, name: str, out: Path) -> int:
    """FOLDER/<class index>/<image> symlinks + classnames.txt of dataset `name`'s test set."""
    items = json.loads(info_file(info, name, "test").read_text(encoding="utf-8"))
    names: dict[int, str] = {}
    for i, (key, item) in enumerate(items.items()):
        t = int(item["target"])
        names[t] = item["classname"]
        d = out / name / f"{t:05d}"
        d.mkdir(parents=True, exist_ok=True)
        link = d / f"{i:07d}{Path(key).suffix.lower() or '.jpg'}"
        if not link.exists():
            link.symlink_to((data / name / key).absolute())
    order = sorted(names)
    (out / name / "classnames.txt").write_text("".join(names[t] + "\n" for t in order))
    return len(items)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="adaptation datasets -> JSONL rows for cvl build-stream table")
    f = sub.add_parser("folders", help="held-out classification sets -> image folders")
    for s in (t, f):
        s.add_argument("--info", type=Path, required=True, help="the fork's data_lib/00_info")
        s.add_argument("--data", type=Path, required=True, help="the downloaded datasets")
    t.add_argument("--sequence", type=Path, required=True, help="stream_construction/*.json")
    t.add_argument("--tasks", type=int, default=20, help="task.num [20]")
    t.add_argument("--dataset-incremental", action="store_true", help="one task per dataset")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("names", nargs="+", help="dataset names (info-file prefixes)")
    a = p.parse_args(argv)
    if a.cmd == "folders":
        for name in a.names:
            print(f"{name}: {make_folder(a.info, a.data, name, a.out)} images", file=sys.stderr)
        return 0
    entries = json.loads(a.sequence.read_text(encoding="utf-8"))
    tasks = fomo_tasks(entries, a.tasks, a.dataset_incremental)
    for row in table_rows(a.info, a.data, tasks):
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
