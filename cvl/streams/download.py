"""Images for URL sources: img2dataset in a watched subprocess, a persistent download cache.

`DownloadCache` keeps everything img2dataset ever fetched for a source in one folder (by default
``streams/downloads/<source>/``, beside the stream folders, so a rebuild with another order,
limit or split, or another stream from the same source, downloads nothing twice)::

    cache.json              the image options the cache was made with (size, resize mode, ...)
    inputs/00003.parquet    the URLs handed to img2dataset run 3 (url, id, task, category)
    logs/00003.log          img2dataset's output for run 3
    batches/00003/          img2dataset's webdataset output of run 3: 00000.tar, 00000.parquet,
                            00000_stats.json, ... (one tar/parquet/stats triple per shard)

Only shards with a ``_stats.json`` count as done (img2dataset writes it last), so a run that was
killed or crashed leaves URLs that are simply fetched again next time. Every shard's parquet
gives the per-URL status (``success``, ``failed_to_download``, ``failed_to_resize``) and error
message. `fetch` runs img2dataset only on URLs that are not in the cache yet, or that failed
before (unless ``retry_failed`` is off), each run in a new batch folder.

img2dataset runs in a child process (``python -m cvl.streams.download CONFIG``) under a
watchdog: it is known to hang after the last shard on some systems, so once every expected
shard is done the child gets ``exit_grace`` seconds to exit and is then killed (its process
group: the pool workers too); a child that makes no progress for ``stall_timeout`` seconds is
killed as well. With ``processes=1`` and the multiprocessing distributor, shards run inside the
child itself instead of in a one-process spawn pool (same img2dataset code, one interpreter
start less).

Local images (sources whose files are already on disk) skip img2dataset but go through the same
img2dataset `Resizer`, so a stream gets the same image processing whatever the origin.

Where the parts live: the image options and the local resizer in `resize.py`, the watched
img2dataset child in `img2dataset_run.py` (both re-exported here); this module is the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import sys
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cvl.errors import CvlError
from cvl.io import read_json, write_json
from cvl.streams.img2dataset_run import (  # noqa: F401  (re-exported: their home was this module)
    DISTRIBUTORS,
    DownloadOptions,
    child_main,
    done_shards,
    run_img2dataset,
)
from cvl.streams.resize import (  # noqa: F401  (re-exported: their home was this module)
    CHILD_ENV,
    RESIZE_MODES,
    TOO_LARGE,
    ImageOptions,
    process_bytes,
    process_local,
    short_error,
)

STATUSES = ("success", "failed_to_download", "failed_to_resize")


@dataclass(frozen=True)
class Record:
    """What the cache knows about one URL."""

    status: str  # success | failed_to_download | failed_to_resize | not_downloaded
    error: str | None = None
    tar: str | None = None  # absolute path of the img2dataset shard holding the image
    key: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "success"


@dataclass
class FetchStats:
    """What one `fetch` did, for build_report.json."""

    urls: int = 0
    cached: int = 0
    fetched: int = 0
    status: Counter = field(default_factory=Counter)  # over all requested URLs
    errors: Counter = field(default_factory=Counter)  # error message -> count (requested URLs)
    runs: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "urls": self.urls,
            "from_cache": self.cached,
            "fetched_now": self.fetched,
            "status": dict(self.status),
            "errors": dict(self.errors.most_common(50)),
            "img2dataset_runs": self.runs,
        }


# -- the cache ---------------------------------------------------------------------------------
class DownloadCache:
    """A folder of img2dataset batches, indexed by URL (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, image: ImageOptions) -> None:
        self.root = Path(root).absolute()
        self.image = image
        self._tar_index: dict[str, dict[str, tuple[int, int]]] = {}
        self._check_options()

    def _check_options(self) -> None:
        cfg_path = self.root / "cache.json"
        want = self.image.to_json()
        if cfg_path.is_file():
            have = read_json(cfg_path).get("image_options")
            if have != want:
                diff = ", ".join(
                    f"{k}={have.get(k)!r} (now {want[k]!r})"
                    for k in want
                    if isinstance(have, dict) and have.get(k) != want[k]
                )
                raise CvlError(
                    f"download cache {self.root} was made with other image options ({diff}); "
                    "use the same options or another --downloads folder"
                )
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            write_json(cfg_path, {"schema": "cvl.downloads/1", "image_options": want})

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive use of the cache (two builds sharing it run one after the other)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another build using {self.root} ...", file=sys.stderr)
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def batches(self) -> list[Path]:
        d = self.root / "batches"
        return sorted(p for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    @staticmethod
    def done_shards(batch: Path) -> list[str]:
        """Shard names (e.g. '00000') of a batch whose _stats.json exists."""
        return done_shards(batch)

    def index(self, batches: list[Path] | None = None) -> dict[str, Record]:
        """URL -> Record over all done shards; a success is never replaced by a later failure."""
        import pyarrow.parquet as pq

        idx: dict[str, Record] = {}
        for batch in self.batches() if batches is None else batches:
            for shard in self.done_shards(batch):
                pq_path = batch / f"{shard}.parquet"
                if not pq_path.is_file() or not (batch / f"{shard}.tar").is_file():
                    continue  # a shard someone deleted: its URLs count as never fetched
                try:
                    t = pq.read_table(pq_path, columns=["url", "key", "status", "error_message"])
                except Exception:  # noqa: BLE001 (a damaged parquet: fetch its URLs again)
                    continue
                d = t.to_pydict()
                tar = str(batch / f"{shard}.tar")
                for url, key, status, err in zip(
                    d["url"], d["key"], d["status"], d["error_message"]
                ):
                    old = idx.get(url)
                    if old is not None and old.ok:
                        continue
                    if status == "success":
                        idx[url] = Record("success", None, tar, key)
                    else:
                        idx[url] = Record(status or "failed_to_download", short_error(err))
        return idx

    def shard_stats(self, batch: Path) -> dict[str, Any]:
        """Sum of a batch's _stats.json files (count, successes, failures, duration, messages)."""
        tot: dict[str, Any] = {
            "shards": 0,
            "count": 0,
            "successes": 0,
            "failed_to_download": 0,
            "failed_to_resize": 0,
            "start": None,
            "end": None,
        }
        msgs: Counter = Counter()
        for shard in self.done_shards(batch):
            try:
                s = json.loads((batch / f"{shard}_stats.json").read_text())
            except (OSError, json.JSONDecodeError):
                continue
            tot["shards"] += 1
            for k in ("count", "successes", "failed_to_download", "failed_to_resize"):
                tot[k] += int(s.get(k, 0))
            st, en = s.get("start_time"), s.get("end_time")
            if st is not None:
                tot["start"] = st if tot["start"] is None else min(tot["start"], st)
            if en is not None:
                tot["end"] = en if tot["end"] is None else max(tot["end"], en)
            for m, c in (s.get("status_dict") or {}).items():
                if m != "success":
                    msgs[short_error(m)] += int(c)
        tot["status_messages"] = dict(msgs.most_common(20))
        return tot

    # -- reading images back ---------------------------------------------------------------
    def locate(self, rec: Record) -> tuple[str, int, int] | None:
        """(tar path, offset, size) of a successful record's image, or None if it is gone."""
        if not rec.ok or rec.tar is None:
            return None
        members = self._tar_index.get(rec.tar)
        if members is None:
            members = {}
            try:
                with tarfile.open(rec.tar, mode="r:") as tf:
                    for ti in tf:
                        if ti.isfile() and "." in ti.name:
                            k, ext = ti.name.rsplit("/", 1)[-1].split(".", 1)
                            if ext.lower() in ("jpg", "jpeg", "png", "webp"):
                                members[k] = (ti.offset_data, ti.size)
            except (tarfile.TarError, OSError):
                members = {}
            self._tar_index[rec.tar] = members
        span = members.get(rec.key or "")
        return None if span is None else (rec.tar, span[0], span[1])

    # -- fetching ----------------------------------------------------------------------------
    def fetch(
        self,
        urls: dict[str, dict[str, Any]],
        opts: DownloadOptions,
        log: Callable[[str], None] = print,
        progress: bool = True,
        command: list[str] | None = None,
    ) -> tuple[dict[str, Record], FetchStats]:
        """Make sure every URL was tried; returns URL -> Record and what was done.

        `urls` maps each URL to the extra columns img2dataset saves with it (id, task,
        category: provenance for whoever inspects the cache). `command` replaces the child
        command before its config-file argument (tests).
        """
        stats = FetchStats(urls=len(urls))
        with self.locked():
            idx = self.index()
            todo = [u for u in urls if u not in idx or (opts.retry_failed and not idx[u].ok)]
            stats.cached = len(urls) - len(todo)
            if not todo:
                log(f"download: all {len(urls)} urls already in the cache {self.root}")
            if todo:
                done = [int(b.name) for b in self.batches() if b.name.isdigit()]
                name = f"{max(done, default=-1) + 1:05d}"
                log(
                    f"download: {len(urls)} urls, {stats.cached} in cache, fetching {len(todo)} "
                    f"with img2dataset ({opts.processes} process(es) x {opts.threads} threads, "
                    f"{opts.distributor}) into {self.root}"
                )
                batch = self.root / "batches" / name
                run = self._run_batch(batch, name, todo, urls, opts, progress, command)
                new = self.index([batch])
                for u, r in new.items():
                    if u in todo and (u not in idx or not idx[u].ok):
                        idx[u] = r
                tot = self.shard_stats(batch)
                run.update(
                    {
                        k: tot[k]
                        for k in (
                            "shards",
                            "count",
                            "successes",
                            "failed_to_download",
                            "failed_to_resize",
                        )
                    }
                )
                run["status_messages"] = tot["status_messages"]
                secs = run["seconds"]
                busy = (tot["end"] - tot["start"]) if tot["start"] is not None else None
                run["shard_seconds"] = round(busy, 2) if busy is not None else None
                run["urls_per_second"] = round(tot["count"] / busy, 1) if busy else None
                stats.runs.append(run)
                stats.fetched = sum(1 for u in todo if u in new)
                log(
                    f"download: run {name}: {tot['successes']} ok, {tot['failed_to_download']} "
                    f"failed to download, {tot['failed_to_resize']} failed to resize "
                    f"in {secs:.1f}s" + (f" ({run['watchdog']})" if run.get("watchdog") else "")
                )
            out: dict[str, Record] = {}
            for u in urls:
                r = idx.get(u) or Record(
                    "not_downloaded", "img2dataset did not finish this URL's shard (rerun to retry)"
                )
                out[u] = r
                stats.status[r.status] += 1
                if not r.ok:
                    stats.errors[f"{r.status}: {r.error}"] += 1
        return out, stats

    def _run_batch(
        self,
        batch: Path,
        name: str,
        todo: list[str],
        urls: dict[str, dict[str, Any]],
        opts: DownloadOptions,
        progress: bool,
        command: list[str] | None,
    ) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        (self.root / "inputs").mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        extra_cols = ("id", "task", "category")
        cols: dict[str, list] = {"url": list(todo)}
        for c in extra_cols:
            cols[c] = [_str_or_none(urls[u].get(c)) for u in todo]
        inp = self.root / "inputs" / f"{name}.parquet"
        pq.write_table(pa.table(cols), inp)
        config = {
            "url_list": str(inp),
            "output_folder": str(batch),
            "input_format": "parquet",
            "url_col": "url",
            "output_format": "webdataset",
            "save_additional_columns": list(extra_cols),
            "processes_count": opts.processes,
            "thread_count": opts.threads,
            "timeout": opts.timeout,
            "retries": opts.retries,
            "distributor": opts.distributor,
            "number_sample_per_shard": opts.shard_size,
            "user_agent_token": opts.user_agent_token,
            "extract_exif": False,
            "compute_hash": None,
            "enable_wandb": False,
            "incremental_mode": "incremental",
            **self.image.img2dataset_kwargs(),
        }
        if math.isinf(config["max_aspect_ratio"]):
            del config["max_aspect_ratio"]
        cfg_path = self.root / "inputs" / f"{name}.config.json"
        cfg_path.write_text(json.dumps(config, indent=2))
        expected = max(1, math.ceil(len(todo) / opts.shard_size))
        result = run_img2dataset(
            cfg_path,
            batch,
            self.root / "logs" / f"{name}.log",
            expected_shards=expected,
            opts=opts,
            progress=progress,
            command=command,
        )
        _remove_unfinished(batch)
        return {"batch": name, "urls": len(todo), **result}


def _str_or_none(v: Any) -> str | None:
    return None if v is None else str(v)


def _remove_unfinished(batch: Path) -> None:
    """Delete shard files without _stats.json (a killed run) and img2dataset's _tmp folder."""
    if not batch.is_dir():
        return
    done = set(done_shards(batch))
    for p in batch.iterdir():
        if p.is_file() and p.suffix in (".tar", ".parquet") and p.stem not in done:
            with contextlib.suppress(OSError):
                p.unlink()
    tmp = batch / "_tmp"
    if tmp.is_dir():
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
