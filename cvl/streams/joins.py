"""Tables joined onto a collection's samples by id, as columnar arrays (pyarrow / numpy).

`cvl build-stream shards --join FILE` reads a table of ``id -> value`` (a date, a label, a
task) and looks every sample's id up in it: a hash join in pyarrow's C++ (`pc.index_in`), no
Python object per row or sample. Tables are read as they are published:

- parquet, CSV / TSV, JSONL (``.gz`` too): the id column (`--join-id-col`) and the columns a
  split needs, every value as text (dates are then read by the time split's rules, so a year
  is the same value whether a CSV cell, a JSON number or a parquet int holds it);
- TiC-DataComp's uid files (``tic-datacomp_training_yearly_noeval/2014.npy``, the monthly
  ``201403.npy``; a folder of them): each a sorted array of DataComp uids stored as two
  unsigned 64-bit halves of the 32-hex-digit string (numpy dtype ``u8,u8``, or ``(n, 2)``
  uint64); every column a split asks of such a file is its name (the year or month);
- TiC's ``tic-datacomp_retrieval_evals_year2uids.json`` (`--eval-ids`): ``{period: [uid,
  ...]}``, read as the held-out retrieval uids *and* their periods, since TiC's training uid
  files leave these uids out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from cvl.errors import CvlError

ID = "__id__"  # the id column of a joined table, whatever its name in the file
_HEX = np.array([f"{i:02x}".encode() for i in range(256)], dtype="S2")


def uids_to_hex(a: np.ndarray) -> np.ndarray:
    """DataComp uids stored as two uint64 halves (dtype ``u8,u8`` or ``(n, 2)`` uint64) as
    their 32-hex-digit strings (numpy ``S32``; high half first, as TiC writes them)."""
    if a.dtype.names and len(a.dtype.names) == 2:
        hi, lo = (np.asarray(a[n], dtype=np.uint64) for n in a.dtype.names)
    elif a.ndim == 2 and a.shape[1] == 2 and a.dtype.kind in "iu":
        hi, lo = a[:, 0].astype(np.uint64), a[:, 1].astype(np.uint64)
    else:
        raise CvlError(
            f"not a uid array (want dtype u8,u8 or (n, 2) uint64, got {a.dtype} {a.shape})"
        )
    both = np.stack([hi, lo], axis=1).astype(">u8")
    digits = _HEX[both.view(np.uint8).reshape(len(hi), 16)]
    return np.ascontiguousarray(digits).view("S32").ravel()


def _files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in (".npy", ".parquet"))
            if not found:
                raise CvlError(f"--join {p}: no .npy or .parquet files in it")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise CvlError(f"--join {p}: file not found")
    return out


def read_join(paths: list[str], id_col: str, cols: list[str]) -> Any:
    """The joined table: column `ID` (text) and `cols` (text), from every file of `paths`
    (module doc), in file order."""
    import pyarrow as pa

    parts = [_read_one(f, id_col, cols) for f in _files(paths)]
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _read_one(path: Path, id_col: str, cols: list[str]) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    name = path.name.lower()
    if name.endswith(".npy"):
        try:
            ids = uids_to_hex(np.load(path, allow_pickle=False))
        except (OSError, ValueError, CvlError) as e:
            raise CvlError(f"--join {path}: {e}") from None
        return pa.table(
            {ID: pa.array(ids).cast(pa.string())}
            | {c: pa.array(np.full(len(ids), path.stem, dtype=object), pa.string()) for c in cols}
        )
    want = list(dict.fromkeys([id_col, *cols]))
    try:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            t = pq.read_table(path, columns=want)
        elif name.endswith((".csv", ".csv.gz", ".tsv", ".tsv.gz")):
            from pyarrow import csv

            t = csv.read_csv(
                path,
                parse_options=csv.ParseOptions(delimiter="\t" if ".tsv" in name else ","),
                convert_options=csv.ConvertOptions(
                    include_columns=want, column_types={c: pa.string() for c in want}
                ),
            )
        elif name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
            from pyarrow import json as pj

            t = pj.read_json(path).select(want)
        else:
            raise CvlError(
                f"--join {path}: a .parquet, .csv, .tsv, .jsonl (.gz) table or a TiC .npy uid file"
            )
    except (pa.ArrowInvalid, KeyError, OSError) as e:
        raise CvlError(f"--join {path}: cannot read columns {want} ({e})") from None
    out = {}
    for c, src in zip([ID, *cols], [id_col, *cols]):
        col = t.column(src)
        out[c] = col if col.type == pa.string() else pc.cast(col, pa.string())
    return pa.table(out)


def load_eval_json(path: str) -> tuple[Any, Any]:
    """(ids, periods) of an --eval-ids file: TiC's ``{period: [id, ...]}`` (each id's period
    is its key) or a plain JSON list (periods null), as text arrays."""
    import pyarrow as pa

    p = Path(path)
    if not p.is_file():
        raise CvlError(f"--eval-ids: {p}: file not found")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CvlError(f"--eval-ids {p}: not JSON ({e})") from None
    groups = d.items() if isinstance(d, dict) else [(None, d)]
    ids: list[str] = []
    periods: list[str | None] = []
    for k, v in groups:
        if not isinstance(v, list):
            raise CvlError(f"--eval-ids {p}: expected a list of ids or an object of lists")
        ids += [str(x) for x in v]
        periods += [k] * len(v)
    return pa.array(ids, pa.string()), pa.array(periods, pa.string())


def lookup(ids: Any, table_ids: Any) -> tuple[np.ndarray, int]:
    """Each id's row in `table_ids` (-1: absent; a repeated table id: its first row) and how
    many table rows repeat an earlier id."""
    import pyarrow.compute as pc

    at = pc.index_in(ids, value_set=table_ids)
    rows = np.asarray(at.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
    repeats = len(table_ids) - len(pc.unique(table_ids))
    return rows, repeats


def take_text(col: Any, rows: np.ndarray) -> Any:
    """`col`'s values at `rows` (null where -1), as one text array."""
    import pyarrow as pa

    mask = rows < 0
    got = col.take(pa.array(np.where(mask, 0, rows)))
    if hasattr(got, "combine_chunks"):
        got = got.combine_chunks()
    if mask.any():
        import pyarrow.compute as pc

        got = pc.if_else(pa.array(mask), pa.nulls(len(rows), pa.string()), got)
    return got
