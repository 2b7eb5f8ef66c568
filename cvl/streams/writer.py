"""Writing webdataset shards (real tars: KEY.jpg, KEY.txt, KEY.json) and the build report."""

from __future__ import annotations

import io
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from cvl.io import write_json
from cvl.streams.manifest import BUILD_REPORT, ShardSet

if TYPE_CHECKING:
    import webdataset as wds

_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-]")


def safe_key(raw: str) -> str:
    """A webdataset key from any id: no dots (they split extensions), no path separators."""
    key = _KEY_BAD.sub("_", str(raw))
    return key or "_"


def unique_key(raw: str, used: set[str]) -> str:
    """`safe_key(raw)`, with `_1`, `_2`, ... appended while it is in `used` (then added)."""
    key = base = safe_key(raw)
    n = 1
    while key in used:
        key, n = f"{base}_{n}", n + 1
    used.add(key)
    return key


def encode_jpeg(img: Image.Image, quality: int = 95) -> bytes:
    """Encode a PIL image as RGB JPEG bytes (deterministic for the same pixels)."""
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


class ShardSink:
    """Writes samples into `root/rel/000000.tar, 000001.tar, ...` with at most `maxcount` each.

    Tar headers carry a fixed mtime and owner so the same samples give the same bytes. Each
    shard's index (`cvl.data.index`: member offsets, as tarfile reports them while writing)
    is written beside it when the shard closes, so no reader ever scans the tar. `first`
    numbers the first shard (a worker writing shard k of a set: `cvl.streams.parallel`).
    """

    def __init__(self, root: Path, rel: str, maxcount: int = 10000, first: int = 0) -> None:
        self.root = Path(root)
        self.rel = rel.strip("/")
        self.maxcount = maxcount
        self.first = first
        self.count = 0
        self.shards: list[str] = []
        self._writer: wds.TarWriter | None = None
        self._in_shard = 0
        self._keys: set[str] = set()

    def _open(self) -> None:
        rel = f"{self.rel}/{self.first + len(self.shards):06d}.tar"
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        import webdataset as wds  # here: it imports torch (seconds), which a stream that
        # writes no shard of its own (`build-stream compose`) never needs

        self._writer = wds.TarWriter(str(path), mtime=0.0, user="cvl", group="cvl", encoder=False)
        self._log = _record_members(self._writer.tarstream)
        self._path = path
        self.shards.append(rel)
        self._in_shard = 0

    def write(self, key: str, jpg: bytes, caption: str, meta: dict[str, Any]) -> str:
        """Add one sample; returns the (unique within this sink) key actually used."""
        key = unique_key(key, self._keys)
        if self._writer is None or self._in_shard >= self.maxcount:
            self.close_shard()
            self._open()
        assert self._writer is not None
        try:
            self._writer.write(
                {
                    "__key__": key,
                    "jpg": jpg,
                    "txt": caption.encode("utf-8"),
                    "json": json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8"),
                }
            )
        except BaseException:
            self.abandon()
            raise
        self._in_shard += 1
        self.count += 1
        return key

    def close_shard(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
                from cvl.data.index import write_index

                rows, skipped, unused = self._log.index()
                size = self._path.stat().st_size
                write_index(str(self._path), rows, skipped, size, unused, self._log.duplicate_keys)
            except BaseException:
                self.abandon()
                raise
            self._writer = None

    def abandon(self) -> None:
        """Drop the open shard after a failed write (a full disk): its file is closed without
        flushing what is buffered, so the tar stream's finaliser does not try the write again
        at garbage collection (a second traceback after the one-line error). The build's
        temporary folder, the shard with it, is removed by `atomic_dir`."""
        w, self._writer = self._writer, None
        if w is None:
            return
        stream = getattr(w.tarstream, "fileobj", None)  # tarfile's _Stream ("w|" mode)
        for obj in (w.tarstream, stream):
            if obj is not None and hasattr(obj, "closed"):
                obj.closed = True  # nothing left to finish: the shard is discarded
        raw = w.own_fileobj
        if raw is not None:
            try:
                os.close(raw.fileno())  # the descriptor, not the buffered file (no flush)
            except (OSError, ValueError):
                pass
            w.own_fileobj = None

    def close(self) -> ShardSet:
        """Finish the last shard and describe what was written."""
        self.close_shard()
        return ShardSet(shards=list(self.shards), count=self.count)


def _record_members(tf: Any) -> Any:
    """A `MemberLog` fed by tarfile `tf` as it writes: the data offset of each member is the
    stream offset after it, less its padded size (tarfile's own bookkeeping)."""
    from cvl.data.index import MemberLog

    log, add = MemberLog(), tf.addfile

    def addfile(ti: Any, fileobj: Any = None, *a: Any, **kw: Any) -> None:
        add(ti, fileobj, *a, **kw)
        if ti.isfile():
            log.add(ti.name, tf.offset - -(-ti.size // 512) * 512, ti.size)

    tf.addfile = addfile
    return log


class BuildReport:
    """Counts of what a builder read, kept and dropped (with reasons and a few examples)."""

    def __init__(self, max_examples: int = 20) -> None:
        self.read = 0
        self.kept: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}
        self.max_examples = max_examples
        self.notes: dict[str, Any] = {}

    def keep(self, split: str) -> None:
        self.kept[split] += 1

    def warn(self, message: str) -> None:
        """A warning the build prints and keeps (`warnings`)."""
        self.notes.setdefault("warnings", []).append(message)

    def drop(self, reason: str, example: str = "") -> None:
        self.dropped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if example and len(ex) < self.max_examples:
            ex.append(example)

    def to_json(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "kept": dict(self.kept),
            "kept_total": sum(self.kept.values()),
            "dropped": dict(self.dropped),
            "dropped_total": sum(self.dropped.values()),
            "dropped_examples": self.examples,
            **self.notes,
        }

    def save(self, folder: Path) -> None:
        write_json(Path(folder) / BUILD_REPORT, self.to_json())
