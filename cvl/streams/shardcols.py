"""Per-sample values of a webdataset collection as arrays, in collection order (shard after
shard, index row order): what `cvl build-stream shards` joins and splits on.

- the sample's key: from the index files (nothing read from the tars);
- fields of each sample's KEY.json (DataComp's ``uid``, a date, a category): from
  img2dataset's per-shard parquet (``NAME.parquet`` beside ``NAME.tar``: key, uid, caption,
  url, status, ... of every sample it fetched) when it holds the field for every indexed
  sample, else read from the tar: one read per sample of a local shard, one pass over a shard
  at a URL. Shards are read in `processes` processes (threads for URLs).

Values are text (a JSON number ``2014`` is ``"2014"``: the time split reads both alike), null
where the field is missing. A shard's values are one pyarrow array (4 B offsets + the text
per sample): no Python object per sample outlives its shard.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from cvl.data.index import TABLE, is_remote
from cvl.errors import CvlError


def sample_keys(sids: np.ndarray) -> Any:
    """The keys of every usable sample of the shards `sids` (TABLE ids), as one text array."""
    import pyarrow as pa

    parts = [pa.array(np.asarray(TABLE.rows(int(s))["key"])) for s in sids]
    parts = [p.cast(pa.string()) for p in parts if len(p)]
    return pa.concat_arrays(parts) if parts else pa.array([], pa.string())


def json_fields(sids: np.ndarray, fields: list[str], processes: int = 1) -> dict[str, Any]:
    """`fields` of every usable sample's KEY.json, per field one text array (module doc)."""
    import pyarrow as pa

    from cvl.streams.parallel import ordered_map

    if not fields:
        return {}
    sids = np.asarray(sids)
    remote = bool(len(sids)) and is_remote(TABLE.paths[int(sids[0])])
    if remote and processes > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(processes, 8)) as tx:
            per = list(tx.map(lambda s: _shard_fields(int(s), fields), sids))
    else:
        per = list(ordered_map(lambda i: _shard_fields(int(sids[i]), fields), len(sids), processes))
    return {
        f: pa.concat_arrays([p[j] for p in per]) if per else pa.array([], pa.string())
        for j, f in enumerate(fields)
    }


def _shard_fields(sid: int, fields: list[str]) -> list[Any]:
    got = _from_parquet(sid, fields)
    if got is not None:
        return got
    import pyarrow as pa

    rows = TABLE.rows(sid)
    path = TABLE.paths[sid]
    metas = _remote_metas(path) if is_remote(path) else None
    vals: list[list[str | None]] = [[] for _ in fields]
    fd = None if metas is not None else _open(path)
    try:
        for r in rows:
            if metas is not None:
                raw = metas.get(bytes(r["key"]).decode("utf-8"))
            else:
                off, size = int(r["meta"][0]), int(r["meta"][1])
                raw = _pread(fd, path, size, off) if off >= 0 else None
            d = _parse(raw, path)
            for j, f in enumerate(fields):
                vals[j].append(text(d.get(f)))
    finally:
        if fd is not None:
            import os

            os.close(fd)
    return [pa.array(v, pa.string()) for v in vals]


def text(v: Any) -> str | None:
    """A JSON value as text: strings as they are, numbers as written, others as JSON."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, (bool, dict, list)):
        return json.dumps(v)
    return str(v)


def _parse(raw: bytes | None, path: str) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        d = json.loads(raw)
    except ValueError:
        return {}  # an unreadable KEY.json holds none of the fields (counted as missing)
    return d if isinstance(d, dict) else {}


def _open(path: str) -> int:
    import os

    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CvlError(f"{path}: cannot open the shard ({e.strerror or e})") from None


def _pread(fd: int, path: str, size: int, off: int) -> bytes:
    import os

    data = os.pread(fd, size, off)
    if len(data) != size:
        raise CvlError(f"{path}: short read at {off} (the shard is truncated)")
    return data


def _remote_metas(url: str) -> dict[str, bytes]:
    """Every KEY.json of a shard at a URL, by key: one pass over the tar."""
    import tarfile

    import fsspec

    out: dict[str, bytes] = {}
    try:
        with fsspec.open(url, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tf:
            for ti in tf:
                base = ti.name.rsplit("/", 1)[-1]
                key, _, ext = base.partition(".")  # the index's rule (`MemberLog`)
                if ti.isfile() and ext.lower() == "json":
                    fo = tf.extractfile(ti)
                    if fo is not None:
                        out[ti.name[: len(ti.name) - len(base)] + key] = fo.read()
    except (tarfile.TarError, OSError) as e:
        raise CvlError(f"{url}: not a readable tar shard ({e})") from None
    return out


def _from_parquet(sid: int, fields: list[str]) -> list[Any] | None:
    """The fields from img2dataset's parquet beside the shard, when it has them for every
    indexed sample; None otherwise (then the tar is read)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    path = TABLE.paths[sid]
    pq_path = (path[:-4] if path.endswith(".tar") else path) + ".parquet"
    try:
        import pyarrow.parquet as pq

        if is_remote(pq_path):
            import io

            from cvl.data.remote import read_bytes

            src: Any = io.BytesIO(read_bytes(pq_path))
        else:
            src = pq_path
        t = pq.read_table(src, columns=["key", *fields])
    except Exception:  # noqa: BLE001 - no such file, no such column, not parquet: read the tar
        return None
    keys = pa.array(np.asarray(TABLE.rows(sid)["key"])).cast(pa.string())
    have = t.column("key")
    have = have if have.type == pa.string() else pc.cast(have, pa.string())
    at = pc.index_in(keys, value_set=have)
    if at.null_count:
        return None
    out = []
    for f in fields:
        col = t.column(f)
        col = col if col.type == pa.string() else pc.cast(col, pa.string())
        got = col.take(at)
        out.append(got.combine_chunks() if hasattr(got, "combine_chunks") else got)
    return out
