"""IAPR TC-12: 20,000 photos with ISO-8859-1 XML-ish annotations; one task.

Input: the benchmark folder (``iaprtc12/``)::

    images/NN/ID.jpg
    annotations_complete_eng/NN/ID.eng     <DOC> <DOCNO>..</DOCNO> <TITLE>..</TITLE>
                                           <DESCRIPTION>..</DESCRIPTION> ... <IMAGE>images/NN/ID.jpg</IMAGE>

Caption = DESCRIPTION (whitespace collapsed, a trailing ';' removed). Files are ISO-8859-1;
a file that is valid UTF-8 with non-ASCII text is read as UTF-8 (a re-encoded copy), and
text with control characters after decoding is dropped as ``bad_encoding``. The dataset has no
official split: ``--test N`` images are held out at random (seeded; DKR: 15k train / 5k test).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT
from cvl.errors import CvlError
from cvl.streams.manifest import Manifest
from cvl.streams.options import archive_options, build_options, finish
from cvl.streams.pipeline import BuildOptions, ColumnSplit, Dropper, Row, build_stream, clean_text
from cvl.streams.writer import BuildReport

ANN_DIR = "annotations_complete_eng"
_TAG = {t: re.compile(rf"<{t}>(.*?)</{t}>", re.S | re.I) for t in ("DESCRIPTION", "IMAGE", "TITLE")}
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def decode_annotation(data: bytes) -> str:
    """Text of an .eng file: ISO-8859-1, unless it is valid UTF-8 with non-ASCII characters."""
    try:
        s = data.decode("utf-8")
        if not s.isascii():
            return s
    except UnicodeDecodeError:
        pass
    return data.decode("iso-8859-1")


def read_iapr(root: str | Path, drop: Dropper, report: BuildReport) -> list[Row]:
    """One row per annotation file with a description and an existing image."""
    base = Path(root)
    ann = base / ANN_DIR
    if not ann.is_dir():
        raise CvlError(f"--data: {base}: no {ANN_DIR}/ folder (see datasets/iapr.md)")
    rows: list[Row] = []
    seen: set[str] = set()
    for f in sorted(ann.rglob("*.eng")):
        report.read += 1
        where = str(f.relative_to(base))
        text = decode_annotation(f.read_bytes())
        m = _TAG["DESCRIPTION"].search(text)
        if m is None:
            drop("malformed_record", where=where, detail="no <DESCRIPTION>")
            continue
        if _CONTROL.search(m.group(1)):
            drop("bad_encoding", where=where, detail="control characters in the description")
            continue
        cap = clean_text(m.group(1))
        if cap is not None:
            cap = cap.rstrip(";").strip() or None
        if cap is None:
            drop("missing_caption", where=where)
            continue
        rid = f"iapr-{f.stem}"
        if rid in seen:
            drop("duplicate_id", where=where, detail=rid)
            continue
        im = _TAG["IMAGE"].search(text)
        cands = []
        if im is not None and im.group(1).strip():
            rel = im.group(1).strip()
            if ".." not in Path(rel).parts and not Path(rel).is_absolute():
                cands.append(base / rel)
        cands.append(base / "images" / f.parent.name / f"{f.stem}.jpg")
        img = next((c for c in cands if c.is_file()), None)
        if img is None:
            drop("missing_file", where=where, detail=str(cands[-1]))
            continue
        seen.add(rid)
        title = _TAG["TITLE"].search(text)
        meta = {"title": clean_text(title.group(1)) if title else None}
        rows.append(Row(id=rid, caption=cap, path=str(img), meta=meta, root=str(base)))
    return rows


def build_iapr(
    root: str | Path,
    opts: BuildOptions,
    *,
    test: int = 5000,
    val: int = 0,
    max_train: int | None = None,
) -> Manifest:
    """`cvl build-stream iapr`: one task, seeded random test (and val) images held out."""
    report = BuildReport()
    drop = Dropper(report)
    opts.log(f"iapr: reading {root}")
    rows = read_iapr(root, drop, report)
    if test + val >= len(rows):
        raise CvlError(
            f"iapr: --test {test} + --val {val} leaves no training images ({len(rows)} usable)"
        )
    rule = ColumnSplit(
        "dataset", default_task="iapr", limit=max_train, val=val, test=test, seed=opts.seed
    )
    args = {"data": str(Path(root).absolute()), "test": test, "val": val, "max_train": max_train}
    return build_stream(
        rows,
        rule,
        opts,
        source="iapr",
        report=report,
        drop=drop,
        source_args=args,
        descriptions={"iapr": "IAPR TC-12 photos, English descriptions"},
    )


# -- command line ------------------------------------------------------------------------------
@click.command("iapr")
@click.option(
    "--data",
    required=True,
    type=click.Path(file_okay=False),
    help="The iaprtc12/ folder (images/, annotations_complete_eng/).",
)
@click.option(
    "--test",
    default=5000,
    show_default=True,
    type=NON_NEGATIVE_INT,
    help="Images held out as the test set (seeded; DKR: 5000).",
)
@click.option(
    "--val", default=0, show_default=True, type=NON_NEGATIVE_INT, help="Images held out as val."
)
@click.option("--max-train", default=None, type=POSITIVE_INT, help="At most N training images.")
@archive_options
def iapr_cmd(data: str, test: int, val: int, max_train: int | None, **kw: Any) -> None:
    """IAPR TC-12: photos with English DESCRIPTION captions; one task + random test set.

    \b
    Expects --data with images/NN/ID.jpg and annotations_complete_eng/NN/ID.eng
    (ISO-8859-1). Get iaprtc12.tgz from www.imageclef.org/photodata. See datasets/iapr.md.
      cvl build-stream iapr --data data/iaprtc12 --out streams/iapr --test 5000
    """
    opts = build_options(kw)
    m = build_iapr(data, opts, test=test, val=val, max_train=max_train)
    finish(m, str(opts.out), quiet=not opts.progress)
