"""Reading tabular sources (CSV / TSV / JSONL / JSON / parquet, plain or .gz) into `Row`s.

The readers never stop at a bad record: a line that is not valid UTF-8, has the wrong number of
fields, is not valid JSON, or lacks a URL or caption is dropped with a reason and the next one
is read. CSV/TSV is parsed strictly: a record with an unterminated quote (or a quote followed
by text) is dropped as malformed and reading goes on at the line after the one it started on,
so it never swallows the records after it; every record must have as many fields as the
header (or, with --no-header, as the first record). `collect` optionally draws a seeded random
sample in two passes (pass 1 only notes which records are usable, pass 2 parses the chosen
ones), so a 12M-line CC12M file never sits in memory as rows. The file readers and `collect`
live in `tablefiles.py` (their names stay importable from here); this module turns records
into rows.

`build_table` is the generic source ``cvl build-stream table``: any table with an image URL or
path column and a caption column, optional task / category / id / split columns. A webdataset
shard (``.tar``, e.g. img2dataset's output) is a table too: one record per sample with its
KEY.json fields, ``txt`` and the image member (read from the shard, resized like a file), so
downloaded shards are re-split (by a date column: `cvl.streams.timesplit`) without fetching.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from cvl.checks import POSITIVE_INT
from cvl.errors import CvlError
from cvl.streams.manifest import Manifest
from cvl.streams.options import build_options, common_options, finish, split_options
from cvl.streams.pipeline import (
    SPLITS,
    BuildOptions,
    ColumnSplit,
    Dropper,
    InstanceSplit,
    Row,
    SplitRule,
    build_stream,
    clean_text,
    has_surrogates,
)
from cvl.streams.splitrules import check_split_options
from cvl.streams.tablefiles import (  # noqa: F401  (re-exported: their home was this module)
    FILE_STRIDE,
    FORMATS,
    IMAGE_EXTS,
    MAX_RECORD_LINES,
    Record,
    chained,
    collect,
    csv_header,
    iter_csv,
    iter_json,
    iter_jsonl,
    iter_lines,
    iter_parquet,
    iter_table,
    iter_wds,
    load_json,
    open_text,
    require_file,
    sniff_format,
)
from cvl.streams.timesplit import Periods, TimeSplit, load_eval_ids, time_options, time_spec
from cvl.streams.writer import BuildReport

_URL = re.compile(r"^https?://", re.I)


def image_ref(value: Any, root: Path) -> tuple[str | None, str | None]:
    """(url, path) from a path-or-URL cell; relative paths start at `root`."""
    s = clean_text(value)
    if s is None:
        return None, None
    if _URL.match(s):
        return s, None
    if s.lower().startswith("file://"):
        s = s[7:]
    p = Path(s)
    return None, str(p if p.is_absolute() else root / p)


def json_safe(v: Any) -> Any:
    """A cell as a JSON value for KEY.json (dates from parquet as ISO strings)."""
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    iso = getattr(v, "isoformat", None)
    return iso() if callable(iso) else str(v)


def parse_split(v: Any) -> str | None:
    s = (clean_text(v) or "").lower()
    aliases = {"validation": "val", "valid": "val", "dev": "val", "training": "train"}
    s = aliases.get(s, s)
    return s if s in SPLITS else None


def build_table(
    inputs: list[str | Path],
    opts: BuildOptions,
    *,
    url_col: str,
    caption_col: str,
    task_col: str | None = None,
    category_col: str | None = None,
    id_col: str | None = None,
    split_col: str | None = None,
    fmt: str | None = None,
    no_header: bool = False,
    images_root: str | Path | None = None,
    chunks: int = 1,
    sample: int | None = None,
    val: int = 0,
    test: int = 0,
    limit_per_task: int | None = None,
    task_name: str = "all",
    source: str = "table",
    time: dict[str, Any] | None = None,
) -> Manifest:
    """`cvl build-stream table`: a stream from any image-text table (see the module docstring).

    `time` (keys of `TimeSplit`, with `column`): one task per period of a date column
    (`cvl.streams.timesplit`), instead of a task column or chunks."""
    paths = [require_file(p, "--input") for p in inputs]
    if not paths:
        raise CvlError("--input: give at least one file")
    report = BuildReport()
    drop = Dropper(report)
    cols = {
        "url": url_col,
        "caption": caption_col,
        "task": task_col,
        "category": category_col,
        "id": id_col,
        "split": split_col,
        "time": (time or {}).get("column"),
    }
    multi = len(paths) > 1

    def make_parse(fi: int, path: Path):  # noqa: ANN202
        root = Path(images_root) if images_root else path.parent

        def get(rec: Any, col: str | None) -> Any:
            if col is None:
                return None
            if isinstance(rec, dict):
                return rec.get(col)
            try:
                return rec[int(col)]
            except (ValueError, IndexError):
                return None

        def parse(no: int, rec: Any, d: Dropper | None) -> Row | None:
            where = f"{path.name}:{no + 1}"
            if rec is None:
                if d:
                    d("malformed_row", where=where)
                return None
            caption = clean_text(get(rec, cols["caption"]))
            img = get(rec, cols["url"])
            member = img if isinstance(img, tuple) else None  # an image inside a shard
            url, p = (None, None) if member else image_ref(img, root)
            rid = get(rec, cols["id"]) if id_col else f"{fi}-{no}" if multi else str(no)
            row = Row(
                id=str(rid) if rid is not None else "",
                caption=caption or "",
                url=url,
                path=p,
                root=str(root),
                member=member,
            )
            if caption is None:
                if d:
                    d("missing_caption", row, where=where)
                return None
            if url is None and p is None and member is None:
                if d:
                    d("missing_image", row, where=where)
                return None
            if has_surrogates(caption):
                if d:
                    d("non_utf8", row, where=where)
                return None
            if task_col:
                row.task = clean_text(get(rec, task_col))
            if category_col:
                row.category = clean_text(get(rec, category_col))
            if cols["time"]:  # the raw date; the time split reads (and counts) it
                row.meta[cols["time"]] = json_safe(get(rec, cols["time"]))
            if split_col:
                s = parse_split(get(rec, split_col))
                if s is None:
                    if d:
                        d("unknown_split", row, detail=str(get(rec, split_col)))
                    return None
                row.split = s
            return row

        return parse

    more = ("--split-col",) if split_col else ()
    check_split_options(time is not None, task_col, chunks, sample, limit_per_task, more)
    if no_header:
        for c in (url_col, caption_col, task_col, category_col, id_col, split_col):
            if c is not None and not str(c).isdigit():
                raise CvlError(f"--no-header: columns are numbers (0, 1, ...), got '{c}'")
    presplit = split_col is not None
    # a seeded sample at read time only where the split rule takes exactly that many rows
    need = (
        None if (task_col or time or presplit or sample is None) else sample + chunks * (val + test)
    )
    sources = []
    for fi, path in enumerate(paths):
        f = sniff_format(path, fmt)
        if f in ("csv", "tsv") and not no_header:
            header = csv_header(path, "," if f == "csv" else "\t")
            missing = [c for c in cols.values() if c is not None and c not in header]
            if missing:
                raise CvlError(f"{path}: no column(s) {missing} (columns: {', '.join(header)})")
        sources.append(
            (lambda path=path, f=f: iter_table(path, f, header=not no_header), make_parse(fi, path))
        )
    records, parse = chained(sources)
    opts.log(f"{source}: reading {', '.join(str(p) for p in paths)}")
    rows = collect(
        records, parse, drop, report, sample=need, seed=opts.seed, progress=opts.progress
    )
    rule: SplitRule
    if time is not None:
        t = dict(time)
        rule = TimeSplit(
            t.pop("column"),
            Periods.make(t.pop("unit", "year"), t.pop("cuts", None)),
            eval_ids=load_eval_ids(t.pop("eval_ids")) if t.get("eval_ids") else None,
            test=test,
            val=val,
            limit=limit_per_task,
            seed=opts.seed,
            **{k: v for k, v in t.items() if k != "eval_ids"},
        )
    elif task_col:
        rule = ColumnSplit(
            f"value of column '{task_col}'",
            limit=limit_per_task,
            val=val,
            test=test,
            seed=opts.seed,
        )
    else:
        names = [task_name] if chunks == 1 else [f"{task_name}{i}" for i in range(chunks)]
        rule = InstanceSplit(
            chunks, train=sample, val=val, test=test, seed=opts.seed, names=names, presplit=presplit
        )
    args = {
        "input": [str(p) for p in paths],
        **{f"{k}_col": v for k, v in cols.items() if v is not None},
        "chunks": chunks,
        "sample": sample,
        "val": val,
        "test": test,
        "limit_per_task": limit_per_task,
        **({"time": {k: v for k, v in time.items() if v is not None}} if time else {}),
    }
    return build_stream(rows, rule, opts, source=source, report=report, drop=drop, source_args=args)


# -- command line ------------------------------------------------------------------------------
@click.command("table")
@click.option(
    "--input",
    "inputs",
    required=True,
    multiple=True,
    type=click.Path(dir_okay=False),
    help="CSV / TSV / JSONL / JSON / parquet file (.gz ok), or a webdataset .tar shard "
    "(img2dataset's output: KEY.json's fields, txt, and the image as --url-col jpg). Repeatable.",
)
@click.option(
    "--format",
    "fmt",
    default=None,
    type=click.Choice(list(FORMATS)),
    help="File format [from the extension].",
)
@click.option("--url-col", required=True, help="Column with an image URL or a local path.")
@click.option("--caption-col", required=True, help="Column with the caption.")
@click.option(
    "--task-col", default=None, help="Column naming each pair's task [one task, or --chunks]."
)
@click.option("--category-col", default=None, help="Column with a category label (for mAP).")
@click.option("--id-col", default=None, help="Column with a unique id [row number].")
@click.option(
    "--split-col",
    default=None,
    help="Column with train / val / test / query / gallery [held out with --val/--test].",
)
@click.option(
    "--images-root",
    type=click.Path(file_okay=False),
    default=None,
    help="Where relative image paths start; every image path must resolve inside it (else "
    "dropped as outside_root; / allows any) [the input file's folder].",
)
@click.option("--no-header", is_flag=True, help="CSV/TSV without a header: columns are 0, 1, ...")
@click.option("--task-name", default="all", show_default=True, help="Task name without --task-col.")
@click.option(
    "--limit-per-task",
    default=None,
    type=POSITIVE_INT,
    help="With --task-col: at most N training pairs per task (seeded).",
)
@time_options
@split_options(1)
@common_options
def table_cmd(
    inputs: tuple[str, ...],
    fmt: str | None,
    url_col: str,
    caption_col: str,
    task_col: str | None,
    category_col: str | None,
    id_col: str | None,
    split_col: str | None,
    images_root: str | None,
    no_header: bool,
    task_name: str,
    limit_per_task: int | None,
    chunks: int,
    sample: int | None,
    val: int,
    test: int,
    **kw,
) -> None:
    """Any image-text table: URL or path + caption (+ task, category, id, split columns).

    \b
    Your own data: one row per pair. URLs are downloaded (img2dataset, cached), paths are read
    from disk. With --task-col each value is a task (order of first appearance; --order to
    change); without it --chunks seeded random chunks. See datasets/README.md.
      cvl build-stream table --input pairs.csv --url-col image --caption-col text \\
          --task-col domain --test 500 --out streams/mine
    Time-ordered (TiC-CLIP): one task per year, 2014-2016 merged, 1000 retrieval pairs a year:
      cvl build-stream table --input meta.parquet --id-col uid --url-col url \\
          --caption-col caption --time-col timestamp --first-until 2016 --until 2022 \\
          --test 1000 --out streams/tic
    """
    time = time_spec(kw)

    opts = build_options(kw)
    m = build_table(
        list(inputs),
        opts,
        url_col=url_col,
        caption_col=caption_col,
        task_col=task_col,
        category_col=category_col,
        id_col=id_col,
        split_col=split_col,
        fmt=fmt,
        no_header=no_header,
        images_root=images_root,
        chunks=chunks,
        sample=sample,
        val=val,
        test=test,
        limit_per_task=limit_per_task,
        task_name=task_name,
        time=time,
    )
    finish(m, str(opts.out), quiet=not opts.progress)
