"""GoodNews (New York Times news images with journalists' captions).

Files of the official release (github.com/furkanbiten/GoodNews):

- ``captioning_dataset.json`` (a.k.a. ``article+caption.json``):
  ``{article_id: {"images": {"0": caption, ...}, "headline": {...}, "article_url": ...,
  "article": ...}}``
- ``img_urls.json``: ``{article_id: {"0": image_url, ...}}``
- ``img_splits.json`` (optional): ``{"<article_id>_<index>": "train" | "val" | "test"}``

One pair per image: id ``<article_id>_<index>`` (the official image file name without
``.jpg``), caption = the image's caption. Images come from ``--images DIR``
(``<article_id>_<index>.jpg``, as the official downloader writes them) when given, else from
the URLs. With ``--splits`` the official splits are kept (``--sample``/``--val``/``--test``
draw seeded subsets of them, DHA: 130,000 / 13,000 / 5,000); without, val/test are held out
at random.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cvl.errors import CvlError
from cvl.streams.manifest import Manifest
from cvl.streams.options import build_options, common_options, finish, split_options
from cvl.streams.pipeline import (
    BuildOptions,
    Dropper,
    InstanceSplit,
    Row,
    build_stream,
    clean_text,
    has_surrogates,
)
from cvl.streams.table import load_json, parse_split, require_file
from cvl.streams.writer import BuildReport


def _headline(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("main") or v.get("print_headline")
    s = clean_text(v)
    return s if s and not has_surrogates(s) else None


def read_goodnews(
    captions: Path,
    urls: Path | None,
    splits: Path | None,
    images: Path | None,
    drop: Dropper,
    report: BuildReport,
) -> list[Row]:
    data = load_json(captions)
    if not isinstance(data, dict):
        raise CvlError(f"{captions}: expected an object {{article_id: {{'images': ...}}}}")
    url_map = load_json(urls) if urls else {}
    if not isinstance(url_map, dict):
        raise CvlError(f"{urls}: expected an object {{article_id: {{index: url}}}}")
    split_map = load_json(splits) if splits else {}
    if not isinstance(split_map, dict):
        raise CvlError(f"{splits}: expected an object {{'<article>_<index>': split}}")
    rows: list[Row] = []
    for art, info in data.items():
        if not isinstance(info, dict) or not isinstance(info.get("images"), dict):
            report.read += 1
            drop(
                "malformed_row",
                where=f"{captions.name}: article {str(art)[:40]}",
                detail="no 'images' object",
            )
            continue
        head = _headline(info.get("headline"))
        art_urls = url_map.get(art) if isinstance(url_map.get(art), dict) else {}
        for idx, cap in info["images"].items():
            report.read += 1
            rid = f"{art}_{idx}"
            row = Row(id=rid, caption=clean_text(cap) or "")
            if images is not None:
                p = images / f"{rid}.jpg"
                if p.is_file():
                    row.path, row.root = str(p), str(images)
            if row.path is None:
                row.url = clean_text(art_urls.get(str(idx)))
            if splits is not None:
                s = parse_split(split_map.get(rid))
                if s is None:
                    drop("no_split", row, detail="not in --splits")
                    continue
                row.split = s
            row.meta = {"article_id": str(art), "image_index": str(idx)}
            if head:
                row.meta["headline"] = head
            if info.get("article_url"):
                row.meta["article_url"] = clean_text(info.get("article_url"))
            if row.path is None and row.url is None:
                drop("missing_image", row, detail="no local file and no URL in --urls")
                continue
            rows.append(row)
    return rows


def build_goodnews(
    captions: str | Path,
    opts: BuildOptions,
    *,
    urls: str | Path | None = None,
    splits: str | Path | None = None,
    images: str | Path | None = None,
    chunks: int = 1,
    sample: int | None = None,
    val: int = 0,
    test: int = 0,
) -> Manifest:
    """`cvl build-stream goodnews`: one task (or instance chunks) of news image-caption pairs."""
    cap_path = require_file(captions, "--captions")
    url_path = require_file(urls, "--urls") if urls else None
    split_path = require_file(splits, "--splits") if splits else None
    img_dir = Path(images) if images else None
    if img_dir is not None and not img_dir.is_dir():
        raise CvlError(f"--images: {img_dir}: not a folder")
    if url_path is None and img_dir is None:
        raise CvlError("goodnews needs --urls (img_urls.json) or --images (a folder of <id>.jpg)")
    report = BuildReport()
    drop = Dropper(report)
    opts.log(f"goodnews: reading {cap_path}")
    rows = read_goodnews(cap_path, url_path, split_path, img_dir, drop, report)
    names = ["goodnews"] if chunks == 1 else [f"goodnews{i}" for i in range(chunks)]
    rule = InstanceSplit(
        chunks,
        train=sample,
        val=val,
        test=test,
        seed=opts.seed,
        names=names,
        presplit=split_path is not None,
    )
    args = {
        "captions": str(cap_path),
        "urls": str(url_path) if url_path else None,
        "splits": str(split_path) if split_path else None,
        "images": str(img_dir) if img_dir else None,
        "chunks": chunks,
        "sample": sample,
        "val": val,
        "test": test,
    }
    return build_stream(
        rows, rule, opts, source="goodnews", report=report, drop=drop, source_args=args
    )


# -- command line ------------------------------------------------------------------------------
@click.command("goodnews")
@click.option(
    "--captions",
    required=True,
    type=click.Path(dir_okay=False),
    help="captioning_dataset.json (article+caption.json).",
)
@click.option("--urls", type=click.Path(dir_okay=False), default=None, help="img_urls.json.")
@click.option(
    "--splits",
    type=click.Path(dir_okay=False),
    default=None,
    help="img_splits.json (official train/val/test); else val/test are drawn at random.",
)
@click.option(
    "--images",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder of <article>_<index>.jpg; used before URLs.",
)
@split_options(1)
@common_options
def goodnews_cmd(
    captions: str,
    urls: str | None,
    splits: str | None,
    images: str | None,
    chunks: int,
    sample: int | None,
    val: int,
    test: int,
    **kw,
) -> None:
    """GoodNews (NYT images, journalists' captions): one task, official or random splits.

    \b
    DHA's CITM task: --sample 130000 --val 13000 --test 5000. See datasets/goodnews.md.
      cvl build-stream goodnews --captions captioning_dataset.json --urls img_urls.json \\
          --splits img_splits.json --out streams/goodnews --sample 130000 --val 13000 --test 5000
    """

    opts = build_options(kw)
    m = build_goodnews(
        captions,
        opts,
        urls=urls,
        splits=splits,
        images=images,
        chunks=chunks,
        sample=sample,
        val=val,
        test=test,
    )
    finish(m, str(opts.out), quiet=not opts.progress)
