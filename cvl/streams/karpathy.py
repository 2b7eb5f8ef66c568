"""Karpathy-split caption datasets on disk: COCO, Flickr30K and RSICD (one task each).

Input: Karpathy's ``dataset_{coco,flickr30k,rsicd}.json``::

    {"images": [{"filepath": "val2014", "filename": "COCO_val2014_000000391895.jpg",
                 "split": "train|restval|val|test", "cocoid": 391895, "imgid": 0,
                 "sentences": [{"raw": "A man with a red helmet ...", ...}, ...]}, ...]}

plus the image root (``ROOT/filepath/filename``, or ``ROOT/filename`` when there is no
filepath, as in Flickr30K and RSICD). Images are converted straight to shards (resized with
the same resizer as downloads; nothing is fetched).

One sample per image with all its captions (``KEY.json["captions"]``; KEY.txt is the first):
evaluation embeds every caption, so an image is a retrieval hit if any of its captions is
retrieved (the papers' 1k/5k protocol); training draws one caption per visit. With
``--train-samples caption`` each training caption becomes its own sample instead (the
per-caption epochs of ALBEF-style loaders; 5x the shard size).

Splits: ``restval`` counts as train unless ``--restval val|drop``; ``val`` and ``test`` keep
every image. ``--max-train N`` draws N training images (seeded); with ``--rest-as-val`` the
training images not drawn become the val set in place of Karpathy's (DHA's COCO:
100,000 / 13,287 / 5,000). ``--max-test`` / ``--max-val`` keep the first N images in file
order (COCO 1k = the first 1,000 of the 5k test images).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import numpy as np

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT
from cvl.errors import CvlError
from cvl.streams.manifest import Manifest
from cvl.streams.options import archive_options, build_options, finish
from cvl.streams.pipeline import (
    BuildOptions,
    ColumnSplit,
    Dropper,
    Row,
    build_stream,
    clean_text,
    has_surrogates,
)
from cvl.streams.table import load_json, require_file
from cvl.streams.writer import BuildReport

# source -> (JSON file name, image folder names tried under --images, where to get it)
DATASETS = {
    "coco": (
        "dataset_coco.json",
        "train2014/ and val2014/ of MS-COCO 2014 (cocodataset.org); the JSON is in\n"
        "Karpathy's caption_datasets.zip (cs.stanford.edu/people/karpathy/deepimagesent)",
    ),
    "flickr30k": (
        "dataset_flickr30k.json",
        "the flickr30k-images (shannon.cs.illinois.edu/DenotationGraph, by request);\n"
        "the JSON is in Karpathy's caption_datasets.zip",
    ),
    "rsicd": (
        "dataset_rsicd.json",
        "RSICD_images/; both from github.com/201528014227051/RSICD_optimal",
    ),
}
SPLIT_MAP = {"train": "train", "val": "val", "test": "test", "restval": "restval"}


def _image_id(im: dict[str, Any], i: int) -> Any:
    for k in ("cocoid", "imgid", "id"):
        if im.get(k) is not None and not isinstance(im.get(k), (dict, list, bool)):
            return im[k]
    fn = im.get("filename")
    return Path(str(fn)).stem if fn else None


def read_karpathy(
    source: str,
    json_path: str | Path,
    images: str | Path,
    drop: Dropper,
    report: BuildReport,
    *,
    restval: str = "train",
    val_to_train: bool = False,
    max_captions: int | None = 5,
) -> list[Row]:
    """Rows (one per image, all captions) of a Karpathy JSON; bad entries dropped with reasons."""
    path = require_file(json_path, "--json")
    root = Path(images)
    if not root.is_dir():
        raise CvlError(f"--images: {root}: not a folder")
    d = load_json(path)
    ims = d.get("images") if isinstance(d, dict) else None
    if not isinstance(ims, list):
        raise CvlError(f"{path}: not a Karpathy split file (no 'images' list at the top level)")
    if ims and not any(isinstance(im, dict) and "split" in im for im in ims):
        raise CvlError(
            f"{path}: no image has a 'split' field: not a Karpathy split file "
            f"(use {DATASETS[source][0]} from caption_datasets.zip)"
        )
    rows: list[Row] = []
    seen: set[str] = set()
    empty_caps = extra_caps = 0
    for i, im in enumerate(ims):
        report.read += 1
        where = f"{path.name}: images[{i}]"
        if not isinstance(im, dict):
            drop("malformed_record", where=where, detail="not an object")
            continue
        rid = _image_id(im, i)
        if rid is None:
            drop("missing_id", where=where)
            continue
        rid = f"{source}-{rid}"
        split = im.get("split")
        fname = im.get("filename")
        fpath = im.get("filepath") or ""
        if not isinstance(fname, str) or not fname:
            drop("missing_image", where=where, detail="no filename")
            continue
        if split not in SPLIT_MAP:
            drop(
                "missing_split" if split is None else "unknown_split",
                where=where,
                detail=str(split),
            )
            continue
        if split == "restval":
            if restval == "drop":
                drop("restval_dropped", where=where)
                continue
            split = restval
        if split == "val" and val_to_train and im.get("split") == "val":
            split = "train"
        if rid in seen:
            drop("duplicate_id", where=where, detail=rid)
            continue
        seen.add(rid)
        sents = im.get("sentences")
        caps: list[str] = []
        for s in sents if isinstance(sents, list) else []:
            raw = s.get("raw") if isinstance(s, dict) else None
            if raw is None and isinstance(s, dict) and isinstance(s.get("tokens"), list):
                raw = " ".join(map(str, s["tokens"]))
            c = clean_text(raw)
            if c is None:
                empty_caps += 1
            else:
                caps.append(c)
        if not caps:
            drop("missing_caption", where=where, detail=rid)
            continue
        if max_captions and len(caps) > max_captions:
            extra_caps += len(caps) - max_captions
            caps = caps[:max_captions]
        if any(has_surrogates(c) for c in caps):
            drop("non_utf8", where=where, detail=rid)
            continue
        cands = [root / fpath / fname, root / fname] if fpath else [root / fname]
        img = next((c for c in cands if c.is_file()), None)
        if img is None:
            drop("missing_file", where=where, detail=str(cands[0]))
            continue
        meta = {"filename": fname}
        if fpath:
            meta["filepath"] = fpath
        rows.append(
            Row(
                id=rid,
                caption=caps[0],
                path=str(img),
                split=split,
                captions=caps,
                meta=meta,
                root=str(root),
            )
        )
    report.notes["empty_captions_dropped"] = empty_caps
    report.notes["captions_beyond_max"] = extra_caps
    return rows


def select_rows(
    rows: list[Row],
    drop: Dropper,
    report: BuildReport,
    *,
    seed: int,
    max_train: int | None = None,
    rest_as_val: bool = False,
    max_val: int | None = None,
    max_test: int | None = None,
    train_samples: str = "image",
) -> list[Row]:
    """Apply the sample caps: seeded --max-train (rest -> val), first-N val/test, expansion."""
    train = [r for r in rows if r.split == "train"]
    others = [r for r in rows if r.split != "train"]
    unsampled = 0
    if rest_as_val and max_train is None:
        raise CvlError("--rest-as-val needs --max-train (the images not drawn become val)")
    if max_train is not None and len(train) > max_train:
        rng = np.random.default_rng([seed, 2024])
        keep = set(rng.choice(len(train), size=max_train, replace=False).tolist())
        rest = [r for i, r in enumerate(train) if i not in keep]
        train = [r for i, r in enumerate(train) if i in keep]
        if rest_as_val:
            unsampled += sum(1 for r in others if r.split == "val")
            others = [r for r in others if r.split != "val"]
            for r in rest:
                r.split = "val"
            others = rest + others
        else:
            unsampled += len(rest)
    elif max_train is not None and rest_as_val:
        raise CvlError(
            f"--rest-as-val: only {len(train)} training images, not more than --max-train "
            f"{max_train}: no images would be left for val"
        )
    out: list[Row] = []
    for split, cap in (("val", max_val), ("test", max_test)):
        rs = [r for r in others if r.split == split]
        if cap is not None and len(rs) > cap:
            unsampled += len(rs) - cap
            rs = rs[:cap]
        out.extend(rs)
    if train_samples == "caption":
        exp = []
        for r in train:
            for k, c in enumerate(r.captions or [r.caption]):
                exp.append(
                    Row(
                        id=f"{r.id}_{k}",
                        caption=c,
                        path=r.path,
                        root=r.root,
                        split="train",
                        meta={**r.meta, "image_id": r.id},
                    )
                )
        train = exp
    report.notes["unsampled_images"] = unsampled
    return train + out


def build_karpathy(
    source: str,
    json_path: str | Path,
    images: str | Path,
    opts: BuildOptions,
    *,
    restval: str = "train",
    val_to_train: bool = False,
    max_captions: int | None = 5,
    max_train: int | None = None,
    rest_as_val: bool = False,
    max_val: int | None = None,
    max_test: int | None = None,
    train_samples: str = "image",
) -> Manifest:
    """`cvl build-stream coco|flickr30k|rsicd`: one task with its Karpathy val/test sets."""
    if source not in DATASETS:
        raise CvlError(f"unknown Karpathy source '{source}'")
    if restval not in ("train", "val", "drop"):
        raise CvlError("--restval must be train, val or drop")
    if train_samples not in ("image", "caption"):
        raise CvlError("--train-samples must be image or caption")
    report = BuildReport()
    drop = Dropper(report)
    opts.log(f"{source}: reading {json_path}")
    rows = read_karpathy(
        source,
        json_path,
        images,
        drop,
        report,
        restval=restval,
        val_to_train=val_to_train,
        max_captions=max_captions,
    )
    rows = select_rows(
        rows,
        drop,
        report,
        seed=opts.seed,
        max_train=max_train,
        rest_as_val=rest_as_val,
        max_val=max_val,
        max_test=max_test,
        train_samples=train_samples,
    )
    rule = ColumnSplit("dataset", default_task=source)
    args = {
        "json": str(Path(json_path).absolute()),
        "images": str(Path(images).absolute()),
        "restval": restval,
        "val_to_train": val_to_train,
        "max_captions": max_captions,
        "max_train": max_train,
        "rest_as_val": rest_as_val,
        "max_val": max_val,
        "max_test": max_test,
        "train_samples": train_samples,
    }
    return build_stream(
        rows,
        rule,
        opts,
        source=source,
        report=report,
        drop=drop,
        source_args=args,
        descriptions={source: f"{source} (Karpathy splits)"},
    )


# -- command line ------------------------------------------------------------------------------
def karpathy_options(f):  # noqa: ANN001, ANN202
    """Options of the Karpathy sources (also used by the protocol presets' docs)."""
    opts = [
        click.option(
            "--restval",
            default="train",
            show_default=True,
            type=click.Choice(["train", "val", "drop"]),
            help="Where Karpathy's 'restval' images go.",
        ),
        click.option(
            "--val-to-train",
            is_flag=True,
            help="Karpathy's val images train too (DKR's RSICD: 9,828 train / 1,093 test).",
        ),
        click.option(
            "--max-captions",
            default=5,
            show_default=True,
            type=NON_NEGATIVE_INT,
            help="Keep the first N captions of an image (COCO has 5-7; the 5k test set of the "
            "papers has 25,000 captions); 0 keeps all.",
        ),
        click.option(
            "--max-train",
            default=None,
            type=POSITIVE_INT,
            help="At most N training images (seeded random draw) [all].",
        ),
        click.option(
            "--rest-as-val",
            is_flag=True,
            help="With --max-train: the training images not drawn become the val set "
            "(DHA's COCO 100k/13,287/5k).",
        ),
        click.option("--max-val", default=None, type=POSITIVE_INT, help="First N val images."),
        click.option(
            "--max-test",
            default=None,
            type=POSITIVE_INT,
            help="First N test images (COCO 1k: 1000) [all: COCO 5k, Flickr30K 1k].",
        ),
        click.option(
            "--train-samples",
            default="image",
            show_default=True,
            type=click.Choice(["image", "caption"]),
            help="image: one sample per image, a random caption per visit; caption: one "
            "sample per caption.",
        ),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _command(source: str, example: str) -> click.Command:
    json_name, where = DATASETS[source]
    doc = (
        f"{source.upper() if source != 'flickr30k' else 'Flickr30K'} from Karpathy's "
        f"{json_name} + its images: one task, val and test sets with all captions.\n\n"
        f"\b\nExpects --json {json_name} and --images, the folder with\n{where}.\n"
        f"See datasets/{source}.md.\n  {example}"
    )

    @click.command(source, help=doc)
    @click.option(
        "--json",
        "json_path",
        required=True,
        type=click.Path(dir_okay=False),
        help=f"Karpathy's {json_name} (images[].filepath/filename/split/sentences[].raw).",
    )
    @click.option(
        "--images",
        required=True,
        type=click.Path(file_okay=False),
        help="Image root: ROOT/filepath/filename (or ROOT/filename).",
    )
    @karpathy_options
    @archive_options
    def cmd(json_path: str, images: str, **kw: Any) -> None:
        sel = {
            k: kw.pop(k)
            for k in (
                "restval",
                "val_to_train",
                "max_captions",
                "max_train",
                "rest_as_val",
                "max_val",
                "max_test",
                "train_samples",
            )
        }
        opts = build_options(kw)
        m = build_karpathy(source, json_path, images, opts, **sel)
        finish(m, str(opts.out), quiet=not opts.progress)

    return cmd


coco_cmd = _command(
    "coco",
    "cvl build-stream coco --json data/coco/dataset_coco.json --images data/coco --out streams/coco",
)
flickr30k_cmd = _command(
    "flickr30k",
    "cvl build-stream flickr30k --json data/flickr30k/dataset_flickr30k.json \\\n"
    "      --images data/flickr30k/flickr30k-images --out streams/f30k",
)
rsicd_cmd = _command(
    "rsicd",
    "cvl build-stream rsicd --json data/rsicd/dataset_rsicd.json \\\n"
    "      --images data/rsicd/RSICD_images --out streams/rsicd --restval train",
)
