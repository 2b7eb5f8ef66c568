"""P9D (CTP, ICCV'23): about one million product image-title pairs from nine industries.

Annotation files (from github.com/KevinLight831/P9D), all UTF-8 JSON:

- ``train.json``: ``{industry: {item_id: {"title", "cate_name", "image_link" | "oss_url", ...}}}``
  (a flat ``{item_id: {..., "industry_name"}}`` is read too)
- ``test.json`` (cross-modal retrieval), ``query.json`` and ``gallery.json`` (multi-modal
  retrieval, mAP): ``{item_id: {"title", "cate_name", "industry_name", "image_link"}}``

One task per industry; the Chinese industry names map to the paper's English task names in its
default order (`INDUSTRIES`). The caption is the title, the category (for mAP) ``cate_name``.
Images: ``--images DIR`` (repeatable) is searched for ``{item_id}.jpg`` directly and in
``train_images/`` and ``gallery_images/`` (the layout of the P9D download scripts); without it
the links are downloaded (img2dataset, cached). Items whose local file is missing are dropped
(``image_missing``) unless ``--download-missing``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cvl.checks import POSITIVE_INT
from cvl.errors import CvlError
from cvl.streams.manifest import Manifest
from cvl.streams.options import build_options, common_options, finish
from cvl.streams.pipeline import (
    BuildOptions,
    ColumnSplit,
    Dropper,
    Row,
    build_stream,
    clean_text,
)
from cvl.streams.table import load_json, require_file
from cvl.streams.writer import BuildReport

# (Chinese key in the annotation files, English task name), in the paper's default order.
INDUSTRIES = (
    ("家居用品", "Household"),
    ("家装家饰", "Furnishings"),
    ("食品/保健", "Food"),
    ("美容护理", "Beauty"),
    ("服饰鞋包", "Clothing"),
    ("车品配件", "Auto"),
    ("母婴", "Parenting"),
    ("运动/户外", "Outdoor"),
    ("3C数码", "Electronics"),
)
TASKS = [en for _, en in INDUSTRIES]
ALIASES = {cn: en for cn, en in INDUSTRIES}
EVAL_FILES = (("test", "test.json"), ("query", "query.json"), ("gallery", "gallery.json"))
IMAGE_SUBDIRS = ("", "train_images", "gallery_images")
COUNTS = {"train": 1_014_599, "test": 2_846, "query": 4_615, "gallery": 46_855}


def industry_task(name: Any) -> str | None:
    """English task name of an industry given in Chinese or English (None if unknown)."""
    s = clean_text(name)
    if s is None:
        return None
    if s in ALIASES:
        return ALIASES[s]
    low = {t.lower(): t for t in TASKS}
    return low.get(s.lower())


class ImageFinder:
    """Finds ``{item_id}.jpg`` in the --images folders (listing each folder once)."""

    def __init__(self, folders: list[Path]) -> None:
        self.index: dict[str, str] = {}
        self.root: dict[str, str] = {}  # the --images folder a file was found under
        for f in folders:
            for sub in IMAGE_SUBDIRS:
                d = f / sub if sub else f
                if not d.is_dir():
                    continue
                for p in d.iterdir():
                    if p.suffix.lower() in (".jpg", ".jpeg") and p.stem not in self.index:
                        self.index[p.stem] = str(p)
                        self.root[p.stem] = str(f)

    def find(self, item_id: str) -> str | None:
        return self.index.get(item_id)


def _row(
    item_id: Any,
    info: Any,
    split: str,
    industry: Any,
    finder: ImageFinder | None,
    download_missing: bool,
    drop: Dropper,
    where: str,
) -> Row | None:
    if not isinstance(info, dict):
        drop("malformed_row", where=f"{where}: item {str(item_id)[:40]}", detail="not an object")
        return None
    rid = str(item_id)
    task = industry_task(industry if industry is not None else info.get("industry_name"))
    url = clean_text(info.get("image_link")) or clean_text(info.get("oss_url"))
    row = Row(
        id=rid,
        caption=clean_text(info.get("title")) or "",
        url=url,
        split=split,
        task=task,
        category=clean_text(info.get("cate_name")),
    )
    ind_raw = industry if industry is not None else info.get("industry_name")
    if task is None:
        drop("unknown_industry", row, detail=str(ind_raw)[:40])
        return None
    row.meta = {"industry": str(clean_text(ind_raw))}
    if finder is not None:
        p = finder.find(rid)
        if p is not None:
            row.path, row.root = p, finder.root[rid]
        elif not download_missing:
            drop("image_missing", row, detail=f"no {rid}.jpg in --images")
            return None
    return row


def read_p9d(
    annotations: Path,
    images: list[Path],
    download_missing: bool,
    drop: Dropper,
    report: BuildReport,
) -> tuple[list[Row], list[str]]:
    """Rows of train.json and of whichever eval files exist; returns (rows, missing eval files)."""
    finder = ImageFinder(images) if images else None
    rows: list[Row] = []
    train_path = require_file(annotations / "train.json", "--annotations")
    train = load_json(train_path)
    if not isinstance(train, dict):
        raise CvlError(f"{train_path}: expected an object {{industry: {{item_id: {{...}}}}}}")
    nested = any(
        isinstance(v, dict)
        and v
        and all(isinstance(x, dict) for x in v.values())
        and "title" not in v
        for v in train.values()
    )
    if nested:
        for industry, items in train.items():
            if not isinstance(items, dict):
                report.read += 1
                drop(
                    "malformed_row",
                    where=f"train.json: {str(industry)[:40]}",
                    detail="not an object",
                )
                continue
            for item_id, info in items.items():
                report.read += 1
                r = _row(
                    item_id, info, "train", industry, finder, download_missing, drop, "train.json"
                )
                if r is not None:
                    rows.append(r)
    else:
        for item_id, info in train.items():
            report.read += 1
            r = _row(item_id, info, "train", None, finder, download_missing, drop, "train.json")
            if r is not None:
                rows.append(r)
    missing = []
    for split, fname in EVAL_FILES:
        p = annotations / fname
        if not p.is_file():
            missing.append(fname)
            continue
        data = load_json(p)
        if not isinstance(data, dict):
            raise CvlError(f"{p}: expected an object {{item_id: {{...}}}}")
        for item_id, info in data.items():
            report.read += 1
            r = _row(item_id, info, split, None, finder, download_missing, drop, fname)
            if r is not None:
                rows.append(r)
    return rows, missing


def build_p9d(
    annotations: str | Path,
    opts: BuildOptions,
    *,
    images: list[str | Path] | tuple = (),
    limit_per_task: int | None = None,
    eval_limit_per_task: int | None = None,
    download_missing: bool = False,
) -> Manifest:
    """`cvl build-stream p9d`: the nine-industry stream with test / query / gallery eval sets."""
    ann = Path(annotations)
    if not ann.is_dir():
        raise CvlError(f"--annotations: {ann}: not a folder (expected train.json, test.json, ...)")
    folders = [Path(p) for p in images]
    for f in folders:
        if not f.is_dir():
            raise CvlError(f"--images: {f}: not a folder")
    report = BuildReport()
    drop = Dropper(report)
    opts.log(
        f"p9d: reading {ann}" + (f", images in {', '.join(map(str, folders))}" if folders else "")
    )
    rows, missing = read_p9d(ann, folders, download_missing, drop, report)
    if missing:
        msg = f"no {', '.join(missing)} in {ann}: those eval sets are left out"
        report.notes.setdefault("warnings", []).append(msg)
        opts.log(f"p9d: warning: {msg}")
    rule = ColumnSplit(
        "P9D industry (task names in the CTP paper's default order)",
        tasks=TASKS,
        limit=limit_per_task,
        eval_limit=eval_limit_per_task,
        seed=opts.seed,
    )
    args = {
        "annotations": str(ann),
        "images": [str(f) for f in folders],
        "limit_per_task": limit_per_task,
        "eval_limit_per_task": eval_limit_per_task,
        "download_missing": download_missing,
    }
    extra = {en: {"industry": cn} for cn, en in INDUSTRIES}
    return build_stream(
        rows,
        rule,
        opts,
        source="p9d",
        report=report,
        drop=drop,
        source_args=args,
        aliases=ALIASES,
        task_extra=extra,
        descriptions={en: f"P9D industry {cn}" for cn, en in INDUSTRIES},
    )


# -- command line ------------------------------------------------------------------------------
@click.command("p9d")
@click.option(
    "--annotations",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder with train.json (required) and test.json / query.json / gallery.json.",
)
@click.option(
    "--images",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Folder(s) of {item_id}.jpg (also searched: train_images/, gallery_images/). "
    "Given: no downloads. Repeatable.",
)
@click.option(
    "--download-missing",
    is_flag=True,
    help="With --images: download the links of items whose file is missing.",
)
@click.option(
    "--limit-per-task",
    default=None,
    type=POSITIVE_INT,
    help="At most N training pairs per industry (seeded random subset).",
)
@click.option(
    "--eval-limit-per-task",
    default=None,
    type=POSITIVE_INT,
    help="At most N pairs per industry in each eval set (test, query, gallery).",
)
@common_options
def p9d_cmd(
    annotations: str,
    images: tuple[str, ...],
    download_missing: bool,
    limit_per_task: int | None,
    eval_limit_per_task: int | None,
    **kw,
) -> None:
    """P9D (CTP): nine industries as tasks; test, query and gallery eval sets with categories.

    \b
    Tasks in the paper's default order: Household, Furnishings, Food, Beauty, Clothing, Auto,
    Parenting, Outdoor, Electronics (--order reversed, or e.g. "Food,Beauty,Auto"; Chinese
    industry names work too). Caption = product title, category = cate_name. Licence:
    CC BY-NC-SA 4.0 (non-commercial). See datasets/p9d.md.

    \b
      cvl build-stream p9d --annotations P9D/json --images P9D --out streams/p9d
      cvl build-stream p9d --annotations P9D/json --out streams/p9d-small --limit-per-task 2000
    """

    opts = build_options(kw)
    m = build_p9d(
        annotations,
        opts,
        images=list(images),
        limit_per_task=limit_per_task,
        eval_limit_per_task=eval_limit_per_task,
        download_missing=download_missing,
    )
    finish(m, str(opts.out), quiet=not opts.progress)
