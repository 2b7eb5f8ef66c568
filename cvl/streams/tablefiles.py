"""Reading a table file's records: CSV / TSV / JSONL / JSON / parquet (plain or .gz) and
webdataset shards, and `collect`, which draws a seeded random sample of them in two passes.

The readers never stop at a bad record: a line that is not valid UTF-8, has the wrong number of
fields or is not valid JSON comes back unreadable, with its record number, and the next one is
read; `collect` runs the source's parser over the records, which drops bad ones with a reason.
Kept apart from the `table` source (table.py: records -> `Row`s, ``cvl build-stream table``) so
that other modules (timesplit.py's id lists) read files by the same rules without importing the
source. `cvl.streams.table` re-exports every name.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import sys
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cvl.errors import CvlError
from cvl.streams.rows import Dropper, Row
from cvl.streams.splitcore import sample_positions
from cvl.streams.writer import BuildReport

FORMATS = ("csv", "tsv", "jsonl", "json", "parquet", "wds")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
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
    chosen = set(np.asarray(usable)[sample_positions(n, sample, seed)].tolist())
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
