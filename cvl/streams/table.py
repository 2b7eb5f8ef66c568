"""Reading tabular sources (CSV / TSV / JSONL / JSON / parquet, plain or .gz) into `Row`s.

The readers never stop at a bad record: a line that is not valid UTF-8, has the wrong number of
fields, is not valid JSON, or lacks a URL or caption is dropped with a reason and the next one
is read. CSV/TSV is parsed strictly: a record with an unterminated quote (or a quote followed
by text) is dropped as malformed and reading goes on at the line after the one it started on,
so it never swallows the records after it; every record must have as many fields as the
header (or, with --no-header, as the first record). `collect` optionally draws a seeded random sample in two passes (pass 1 only notes
which records are usable, pass 2 parses the chosen ones), so a 12M-line CC12M file never sits
in memory as rows.

`build_table` is the generic source ``cvl build-stream table``: any table with an image URL or
path column and a caption column, optional task / category / id / split columns. A webdataset
shard (``.tar``, e.g. img2dataset's output) is a table too: one record per sample with its
KEY.json fields, ``txt`` and the image member (read from the shard, resized like a file), so
downloaded shards are re-split (by a date column: `cvl.streams.timesplit`) without fetching.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import sys
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np

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
from cvl.streams.timesplit import time_options, time_spec
from cvl.streams.writer import BuildReport

FORMATS = ("csv", "tsv", "jsonl", "json", "parquet", "wds")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
_URL = re.compile(r"^https?://", re.I)
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))

Record = tuple[int, Any]  # (record number, fields: list[str] | dict | None if unreadable)


def require_file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise CvlError(f"{what}: {p}: file not found")
    return p


def open_text(path: Path) -> io.TextIOBase:
    """Text of a (possibly gzipped) file; bytes that are not UTF-8 become surrogates."""
    raw = gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # noqa: SIM115
    return io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline="")


def sniff_format(path: Path, fmt: str | None) -> str:
    if fmt:
        return fmt
    name = path.name.lower().removesuffix(".gz")
    for f in FORMATS:
        if name.endswith("." + f):
            return f
    if name.endswith(".tab") or name.endswith(".txt"):
        return "tsv"
    if name.endswith(".tar"):
        return "wds"
    raise CvlError(
        f"{path}: cannot tell the format from the name; pass --format ({'|'.join(FORMATS)})"
    )


def iter_lines(path: Path, delimiter: str = "\t") -> Iterator[Record]:
    """Records of a headerless, unquoted delimited file (CC3M / CC12M TSVs): one per line."""
    with open_text(path) as f:
        for no, line in enumerate(f):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            yield no, line.split(delimiter)


MAX_RECORD_LINES = 100  # a quoted field running over more lines is an unterminated quote


class _Lines:
    """A file's lines for `csv.reader`, remembering those of the record being read, so that a
    malformed record can give back all its lines but the first to be read again."""

    def __init__(self, f: io.TextIOBase) -> None:
        self.f = f
        self.back: list[str] = []  # lines given back, last first
        self.taken: list[str] = []  # lines of the record being read

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        if len(self.taken) >= MAX_RECORD_LINES:
            raise csv.Error(f"a quoted field runs over more than {MAX_RECORD_LINES} lines")
        line = self.back.pop() if self.back else next(self.f)
        self.taken.append(line)
        return line

    def done(self) -> None:
        self.taken.clear()

    def give_back(self) -> None:
        self.back.extend(reversed(self.taken[1:]))
        self.taken.clear()


def iter_csv(path: Path, delimiter: str, header: bool = True) -> Iterator[Record]:
    """Records of a quoted CSV/TSV as dicts (header) or lists; malformed ones as None.

    Strict: an unterminated quote, text after a closing quote or a NUL byte make the record
    malformed, and reading resumes at the line after its first; a record with another number
    of fields than the header (or, without one, the first record) is malformed too."""
    with open_text(path) as f:
        lines = _Lines(f)
        reader = csv.reader(lines, delimiter=delimiter, strict=True)
        names: list[str] | None = None
        width: int | None = None
        no = -1
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error:
                lines.give_back()
                no += 1
                yield no, None
                continue
            lines.done()
            if header and names is None:
                names = [n.strip().lstrip("\ufeff") for n in fields]
                width = len(names)
                continue
            no += 1
            if not fields or (len(fields) == 1 and not fields[0].strip()):
                continue
            if width is None:
                width = len(fields)
            if len(fields) != width:
                yield no, None
            elif names is None:
                yield no, fields
            else:
                yield no, dict(zip(names, fields))


def csv_header(path: Path, delimiter: str) -> list[str]:
    with open_text(path) as f:
        try:
            return [n.strip().lstrip("\ufeff") for n in next(csv.reader(f, delimiter=delimiter))]
        except (StopIteration, csv.Error):
            raise CvlError(f"{path}: empty or unreadable header line") from None


def iter_jsonl(path: Path) -> Iterator[Record]:
    with open_text(path) as f:
        for no, line in enumerate(f):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                yield no, None
                continue
            yield no, obj if isinstance(obj, dict) else None


def load_json(path: Path) -> Any:
    """A whole JSON file; invalid UTF-8 inside strings is kept as surrogates (rows drop later)."""
    try:
        with open_text(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CvlError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise CvlError(f"{path}: cannot read ({e})") from None


def iter_json(path: Path) -> Iterator[Record]:
    data = load_json(path)
    if isinstance(data, dict):  # {id: {...}} -> records with the key as "__key__"
        data = [{"__key__": k, **v} if isinstance(v, dict) else None for k, v in data.items()]
    if not isinstance(data, list):
        raise CvlError(f"{path}: expected a JSON list of objects or an object of objects")
    for no, obj in enumerate(data):
        yield no, obj if isinstance(obj, dict) else None


def iter_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 (pyarrow raises several types)
        raise CvlError(f"{path}: not a readable parquet file ({e})") from None
    no = 0
    for batch in pf.iter_batches(batch_size=8192):
        for rec in batch.to_pylist():
            yield no, rec
            no += 1


def iter_wds(path: Path) -> Iterator[Record]:
    """Samples of a webdataset shard (img2dataset's output too) as records: KEY.json's fields,
    `txt` (KEY.txt), each image member as (shard, offset, size) under its extension (`jpg`, ...)
    and `__key__`; a sample whose KEY.json is not a JSON object is None (malformed_row)."""
    import tarfile

    try:
        tf = tarfile.open(path)  # noqa: SIM115 (closed below)
    except (tarfile.TarError, OSError) as e:
        raise CvlError(f"{path}: not a readable tar shard ({e})") from None
    rec: dict | None = None
    key, no = None, -1
    with tf:
        for ti in tf:
            if not ti.isfile():
                continue
            base = ti.name.rsplit("/", 1)[-1]
            k, _, ext = base.partition(".")
            if k != key:
                if key is not None:
                    yield no, rec
                key, no, rec = k, no + 1, {"__key__": k}
            if rec is None:
                continue
            ext = ext.lower()
            if ext in IMAGE_EXTS:
                rec[ext] = (str(path), ti.offset_data, ti.size)
            elif ext in ("json", "txt"):
                raw = tf.extractfile(ti).read().decode("utf-8", "surrogateescape")
                if ext == "txt":
                    rec["txt"] = raw
                    continue
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError:
                    obj = None
                rec = {**obj, **rec} if isinstance(obj, dict) else None
        if key is not None:
            yield no, rec


def iter_table(path: Path, fmt: str, header: bool = True) -> Iterator[Record]:
    if fmt == "csv":
        return iter_csv(path, ",", header)
    if fmt == "tsv":
        return iter_csv(path, "\t", header)
    if fmt == "jsonl":
        return iter_jsonl(path)
    if fmt == "json":
        return iter_json(path)
    if fmt == "wds":
        return iter_wds(path)
    return iter_parquet(path)


def collect(
    records: Callable[[], Iterator[Record]],
    parse: Callable[[int, Any, Dropper | None], Row | None],
    drop: Dropper,
    report: BuildReport,
    sample: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> list[Row]:
    """Rows of all usable records, or of a seeded random `sample` of them (two passes)."""
    if sample is None:
        rows = []
        for no, rec in _progress(records(), progress):
            report.read += 1
            r = parse(no, rec, drop)
            if r is not None:
                rows.append(r)
        return rows
    usable = array("q")
    for no, rec in _progress(records(), progress):
        report.read += 1
        if parse(no, rec, drop) is not None:
            usable.append(no)
    n = len(usable)
    if n > sample:
        rng = np.random.default_rng([seed, 31337])
        chosen = set(
            np.asarray(usable)[np.sort(rng.choice(n, size=sample, replace=False))].tolist()
        )
    else:
        chosen = set(usable)
    report.notes["sampled"] = {"usable": n, "asked": sample, "taken": len(chosen)}
    out = []
    for no, rec in records():
        if no in chosen:
            r = parse(no, rec, None)
            if r is not None:
                out.append(r)
    return out


def _progress(it: Iterator[Record], on: bool) -> Iterator[Record]:
    from cvl.progress import progress_bar

    return iter(progress_bar(it, desc="reading", unit="rec", show=on, leave=False, mininterval=1.0))


FILE_STRIDE = 10**10  # record numbers of several files: file index * stride + record number


def chained(
    sources: list[
        tuple[Callable[[], Iterator[Record]], Callable[[int, Any, Dropper | None], Row | None]]
    ],
) -> tuple[Callable[[], Iterator[Record]], Callable[[int, Any, Dropper | None], Row | None]]:
    """One (records, parse) pair over several files, so `collect` samples across all of them."""

    def records() -> Iterator[Record]:
        for fi, (mk, _) in enumerate(sources):
            for no, rec in mk():
                yield fi * FILE_STRIDE + no, rec

    def parse(gno: int, rec: Any, d: Dropper | None) -> Row | None:
        fi, no = divmod(gno, FILE_STRIDE)
        return sources[fi][1](no, rec, d)

    return records, parse


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

    if time is not None:
        clash = [o for o, v in (("--task-col", task_col), ("--split-col", split_col)) if v]
        clash += ["--sample"] if sample is not None else []
        clash += ["--chunks"] if chunks != 1 else []
        if clash:
            raise CvlError(f"--time-col makes one task per period: drop {', '.join(clash)}")
    if task_col and (sample is not None or chunks != 1):
        raise CvlError(
            "--task-col gives the tasks: use --limit-per-task instead of --sample/--chunks"
        )
    if not (task_col or time) and limit_per_task is not None:
        raise CvlError("--limit-per-task needs --task-col or --time-col (else use --sample)")
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
        from cvl.streams.timesplit import Periods, TimeSplit, load_eval_ids

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
