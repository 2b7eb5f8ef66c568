"""ECommerce-T2I (MUGE): Chinese product descriptions with base64 images, one task.

Input folder with the MUGE release files (headerless TSVs, UTF-8)::

    T2I_train.text.tsv   <id> TAB <description>      (90k lines)
    T2I_train.img.tsv    <id> TAB <base64 image>
    T2I_val.text.tsv     the same for the 5k images the papers test on
    T2I_val.img.tsv      (the official test split has no images released)

Images are decoded from the TSV at write time (the file is indexed by byte offset, never
held in memory) and resized like every other source. Train = ``T2I_train``; the ``test``
eval set = ``T2I_val`` (the papers' "5K testing images"); ``--val N`` holds N training
pairs out as a val set (seeded). ``--max-train`` / ``--max-test`` draw seeded subsets.
Bad input is counted in build_report.json: undecodable base64 (``bad_base64``), text that
is not UTF-8 (``non_utf8``), empty descriptions, duplicate ids, ids with no image or no text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT
from cvl.errors import CvlError
from cvl.streams.manifest import Manifest
from cvl.streams.options import archive_options, build_options, finish
from cvl.streams.pipeline import BuildOptions, ColumnSplit, Dropper, Row, build_stream, clean_text
from cvl.streams.writer import BuildReport

FILES = {"train": "T2I_train", "test": "T2I_val"}


def _lines(path: Path):  # noqa: ANN202
    """(line number, byte offset, raw line without newline) of a file, read in binary."""
    off = 0
    with open(path, "rb") as f:
        for no, line in enumerate(f):
            yield no, off, line.rstrip(b"\r\n")
            off += len(line)


def read_texts(path: Path, drop: Dropper) -> dict[str, str]:
    """id -> description of a `*.text.tsv`; bad lines dropped with a reason."""
    out: dict[str, str] = {}
    for no, _, line in _lines(path):
        where = f"{path.name}:{no + 1}"
        if not line.strip():
            continue
        parts = line.split(b"\t")
        if len(parts) < 2:
            drop("malformed_row", where=where, detail=f"{len(parts)} field(s), want 2")
            continue
        try:
            rid = parts[0].decode("utf-8").strip()
            text = b"\t".join(parts[1:]).decode("utf-8")
        except UnicodeDecodeError:
            drop("non_utf8", where=where, detail="text is not UTF-8")
            continue
        if no == 0 and rid.lower() in ("id", "img_id", "image_id", "query_id"):
            continue  # a header line
        cap = clean_text(text)
        if not rid:
            drop("missing_id", where=where)
        elif cap is None:
            drop("missing_caption", where=where, detail=rid)
        elif rid in out:
            drop("duplicate_id", where=where, detail=rid)
        else:
            out[rid] = cap
    return out


def read_images(path: Path, drop: Dropper) -> dict[str, tuple[str, int, int]]:
    """id -> (file, offset, length) of each base64 image of a `*.img.tsv` (not decoded here)."""
    out: dict[str, tuple[str, int, int]] = {}
    for no, off, line in _lines(path):
        where = f"{path.name}:{no + 1}"
        if not line.strip():
            continue
        tab = line.find(b"\t")
        if tab <= 0:
            drop("malformed_row", where=where, detail="no <id> TAB <base64> fields")
            continue
        try:
            rid = line[:tab].decode("utf-8").strip()
        except UnicodeDecodeError:
            drop("non_utf8", where=where, detail="id is not UTF-8")
            continue
        if no == 0 and rid.lower() in ("id", "img_id", "image_id"):
            continue
        if rid in out:
            drop("duplicate_id", where=where, detail=rid)
            continue
        out[rid] = (str(path.absolute()), off + tab + 1, len(line) - tab - 1)
    return out


def read_ec(folder: str | Path, drop: Dropper, report: BuildReport) -> list[Row]:
    """Rows of the train (-> train) and val (-> test) files, matched by id."""
    root = Path(folder)
    if not root.is_dir():
        raise CvlError(f"--data: {root}: not a folder")
    rows: list[Row] = []
    for split, stem in FILES.items():
        tpath, ipath = root / f"{stem}.text.tsv", root / f"{stem}.img.tsv"
        missing = [p.name for p in (tpath, ipath) if not p.is_file()]
        if missing:
            if split == "test":
                report.notes.setdefault("warnings", []).append(
                    f"no {' / '.join(missing)}: the stream has no test set"
                )
                continue
            raise CvlError(f"--data: {root}: missing {', '.join(missing)} (see datasets/ec.md)")
        texts = read_texts(tpath, drop)
        images = read_images(ipath, drop)
        report.read += len(texts)
        for rid, cap in texts.items():
            blob = images.get(rid)
            if blob is None:
                drop(
                    "missing_image", where=f"{tpath.name}", detail=f"id {rid}: not in {ipath.name}"
                )
                continue
            rows.append(Row(id=f"ec-{rid}", caption=cap, blob=blob, split=split))
        for rid in images.keys() - texts.keys():
            drop("missing_caption", where=ipath.name, detail=f"id {rid}: image without text")
    return rows


def build_ec(
    folder: str | Path,
    opts: BuildOptions,
    *,
    max_train: int | None = None,
    max_test: int | None = None,
    val: int = 0,
) -> Manifest:
    """`cvl build-stream ec`: one task (train), test = T2I_val, optional held-out val."""
    report = BuildReport()
    drop = Dropper(report)
    opts.log(f"ec: reading {folder}")
    rows = read_ec(folder, drop, report)
    rule = ColumnSplit(
        "dataset", default_task="ec", limit=max_train, eval_limit=max_test, val=val, seed=opts.seed
    )
    args = {
        "data": str(Path(folder).absolute()),
        "max_train": max_train,
        "max_test": max_test,
        "val": val,
    }
    return build_stream(
        rows,
        rule,
        opts,
        source="ec",
        report=report,
        drop=drop,
        source_args=args,
        descriptions={"ec": "ECommerce-T2I (MUGE) product descriptions, Chinese"},
    )


# -- command line ------------------------------------------------------------------------------
@click.command("ec")
@click.option(
    "--data",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder with T2I_train.{text,img}.tsv and T2I_val.{text,img}.tsv.",
)
@click.option(
    "--max-train",
    default=None,
    type=POSITIVE_INT,
    help="At most N training pairs (seeded random draw) [all 90k].",
)
@click.option(
    "--max-test",
    default=None,
    type=POSITIVE_INT,
    help="At most N test pairs (seeded random draw) [all 5k].",
)
@click.option(
    "--val",
    default=0,
    show_default=True,
    type=NON_NEGATIVE_INT,
    help="Training pairs held out as a val set (seeded).",
)
@archive_options
def ec_cmd(data: str, max_train: int | None, max_test: int | None, val: int, **kw: Any) -> None:
    """ECommerce-T2I (MUGE): Chinese captions, base64 images in TSVs; one task + test set.

    \b
    Expects --data with T2I_train.text.tsv (id TAB text), T2I_train.img.tsv (id TAB base64)
    and the same for T2I_val (used as the test set: the papers' 5k). Get them from the MUGE
    challenge (tianchi.aliyun.com/dataset/107332). See datasets/ec.md.
      cvl build-stream ec --data data/ec --out streams/ec
    """
    opts = build_options(kw)
    m = build_ec(data, opts, max_train=max_train, max_test=max_test, val=val)
    finish(m, str(opts.out), quiet=not opts.progress)
