"""WIT (Wikipedia-based Image Text): the TSV.gz release with its 17 columns.

Rows are kept when ``language`` is one of ``--language`` (default ``en``), the caption column
(default ``caption_reference_description``, the text under the image on the page, as DHA uses)
is not empty and the MIME type is one img2dataset can decode (JPEG / PNG / WebP; SVG, GIF,
TIFF rows are dropped as ``mime_type``). The id is ``wit-<file>-<row>`` (file index in the
order given, 0-based data row). Split: one task (or ``--chunks``) with seeded held-out
``--val``/``--test`` pairs, as `cc.py` (DHA: 130,000 / 13,000 / 5,000).
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
from cvl.streams.table import chained, collect, csv_header, iter_csv, require_file
from cvl.streams.writer import BuildReport

COLUMNS = (
    "language",
    "page_url",
    "image_url",
    "page_title",
    "section_title",
    "hierarchical_section_title",
    "caption_reference_description",
    "caption_attribution_description",
    "caption_alt_text_description",
    "mime_type",
    "original_height",
    "original_width",
    "is_main_image",
    "attribution_passes_lang_id",
    "page_changed_recently",
    "context_page_description",
    "context_section_description",
)
CAPTION_COLUMNS = (
    "caption_reference_description",
    "caption_attribution_description",
    "caption_alt_text_description",
)
DEFAULT_MIME = ("image/jpeg", "image/png", "image/webp")


def parse_wit(fi: int, path: Path, languages: set[str], caption_col: str, mimes: set[str]):  # noqa: ANN201
    def parse(no: int, rec: Any, d: Dropper | None) -> Row | None:
        where = f"{path.name}:{no + 2}"
        if rec is None:
            if d:
                d("malformed_row", where=where, detail=f"not {len(COLUMNS)} tab-separated fields")
            return None
        row = Row(id=f"wit-{fi}-{no:09d}", caption="", url=clean_text(rec.get("image_url")))
        lang = (rec.get("language") or "").strip()
        if lang not in languages:
            if d:
                d("language", row, detail=lang[:20])
            return None
        cap = clean_text(rec.get(caption_col))
        if cap is None:
            if d:
                d("missing_caption", row)
            return None
        row.caption = cap
        mime = (rec.get("mime_type") or "").strip().lower()
        if mimes and mime not in mimes:
            if d:
                d("mime_type", row, detail=mime[:40])
            return None
        if not row.url:
            if d:
                d("missing_url", row)
            return None
        if has_surrogates(cap) or has_surrogates(row.url):
            if d:
                d("non_utf8", row)
            return None
        title = clean_text(rec.get("page_title"))
        row.meta = {
            "page_url": clean_text(rec.get("page_url")),
            "page_title": title if title and not has_surrogates(title) else None,
            "language": lang,
        }
        return row

    return parse


def build_wit(
    tsvs: list[str | Path],
    opts: BuildOptions,
    *,
    languages: tuple[str, ...] = ("en",),
    caption_col: str = "caption_reference_description",
    mime_types: tuple[str, ...] = DEFAULT_MIME,
    chunks: int = 1,
    sample: int | None = None,
    val: int = 0,
    test: int = 0,
) -> Manifest:
    """`cvl build-stream wit`: WIT pairs of the chosen languages, one task (or instance chunks)."""
    if caption_col not in CAPTION_COLUMNS:
        raise CvlError(f"--caption-col must be one of {', '.join(CAPTION_COLUMNS)}")
    paths = [require_file(p, "--tsv") for p in tsvs]
    if not paths:
        raise CvlError("--tsv: give at least one WIT file")
    report = BuildReport()
    drop = Dropper(report)
    need = None if sample is None else sample + chunks * (val + test)
    sources = []
    for fi, path in enumerate(paths):
        header = csv_header(path, "\t")
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise CvlError(f"{path}: not a WIT TSV (missing columns: {', '.join(missing)})")
        sources.append(
            (
                lambda path=path: iter_csv(path, "\t"),
                parse_wit(fi, path, set(languages), caption_col, {m.lower() for m in mime_types}),
            )
        )
    records, parse = chained(sources)
    opts.log(f"wit: reading {', '.join(str(p) for p in paths)}")
    rows = collect(
        records, parse, drop, report, sample=need, seed=opts.seed, progress=opts.progress
    )
    names = ["wit"] if chunks == 1 else [f"wit{i}" for i in range(chunks)]
    rule = InstanceSplit(chunks, train=sample, val=val, test=test, seed=opts.seed, names=names)
    args = {
        "tsv": [str(p) for p in paths],
        "languages": list(languages),
        "caption_col": caption_col,
        "mime_types": list(mime_types),
        "chunks": chunks,
        "sample": sample,
        "val": val,
        "test": test,
    }
    return build_stream(rows, rule, opts, source="wit", report=report, drop=drop, source_args=args)


# -- command line ------------------------------------------------------------------------------
@click.command("wit")
@click.option(
    "--tsv",
    "tsvs",
    required=True,
    multiple=True,
    type=click.Path(dir_okay=False),
    help="WIT TSV(.gz) file(s) with the 17-column header. Repeatable.",
)
@click.option(
    "--language",
    "languages",
    multiple=True,
    default=("en",),
    show_default=True,
    help="Keep rows of these languages. Repeatable.",
)
@click.option(
    "--caption-col",
    default="caption_reference_description",
    show_default=True,
    type=click.Choice(
        [
            "caption_reference_description",
            "caption_attribution_description",
            "caption_alt_text_description",
        ]
    ),
    help="Caption column.",
)
@click.option(
    "--mime-types",
    default="image/jpeg,image/png,image/webp",
    show_default=True,
    help="Comma list of MIME types to keep (others are dropped as mime_type).",
)
@split_options(1)
@common_options
def wit_cmd(
    tsvs: tuple[str, ...],
    languages: tuple[str, ...],
    caption_col: str,
    mime_types: str,
    chunks: int,
    sample: int | None,
    val: int,
    test: int,
    **kw,
) -> None:
    """WIT (Wikipedia image-text): English reference descriptions as captions, one task.

    \b
    DHA's CITM task: --sample 130000 --val 13000 --test 5000. See datasets/wit.md.
      cvl build-stream wit --tsv wit_v1.train.all-00000-of-00010.tsv.gz --out streams/wit \\
          --sample 130000 --val 13000 --test 5000
    """

    opts = build_options(kw)
    mimes = tuple(m.strip() for m in mime_types.split(",") if m.strip())
    m = build_wit(
        list(tsvs),
        opts,
        languages=languages,
        caption_col=caption_col,
        mime_types=mimes,
        chunks=chunks,
        sample=sample,
        val=val,
        test=test,
    )
    finish(m, str(opts.out), quiet=not opts.progress)
