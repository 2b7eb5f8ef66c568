"""Streams in object stores: start-up, samples/s and requests and bytes per sample over a
loopback HTTP server that honours Range, with an injected latency before each answer (the
object store's time to first byte), and over moto's S3-protocol server.

The bed is issue 50's: foreign webdataset shards (written by plain tarfile, indexed by cvl),
batches of 32 in cvl's own batch order, one process. Printed as JSON:

- ``startup``: from the manifest to every shard's summary known (what `cvl train` does before
  its first batch), for streams of up to 12,800 shards (simulated: the names link to a few
  real shards), with ``shards.idx.json`` (one request) and without it (every shard's summary,
  fetched in parallel);
- ``reads``: after every shard's rows are in the node's index cache (fetched together once,
  ``index_fetch_s``), per order (default, ``--shuffle-block 256``, the shard cache) and latency (0 / 20 /
  50 ms): samples/s, requests per sample and bytes per sample, for the read path alone
  (bytes by the index, every header checked; ``bytes``) and through the dataset (the image
  decoded, no transform; ``decode``); the shard cache is measured cold (each shard fetched
  whole once) over one pass;
- ``workers``: the default order through a DataLoader with 4 loader processes;
- ``s3``: the same read path over moto's S3 server (its own latency, none injected).

Reads and decoding run on this machine's CPUs, which bound the absolute rates; the request
counts are exact (the server counts them).

    python benchmarks/bench_remote.py [--shards 100] [--per-shard 1000] [--samples 3200]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from remote_helpers import RangeServer, s3_server, upload  # noqa: E402

BATCH = 32


def _foreign(root: Path, shards: int, per: int) -> list[Path]:
    """Shards another tool wrote (plain tarfile: jpg, txt, json per sample), indexed by cvl."""
    from PIL import Image

    from cvl.data.shardindex import ensure_indexed
    from cvl.streams.writer import encode_jpeg

    rng = np.random.default_rng(0)
    jpgs = [
        encode_jpeg(Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)))
        for _ in range(64)
    ]
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for s in range(shards):
        p = root / f"{s:05d}.tar"
        with tarfile.open(p, "w") as tf:
            for i in range(per):
                key = f"{s:05d}{i:05d}"
                members = (
                    ("jpg", jpgs[(s * per + i) % 64]),
                    ("txt", f"a photo number {i} of shard {s}".encode()),
                    ("json", json.dumps({"id": key}).encode()),
                )
                for ext, data in members:
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        out.append(p)
    ensure_indexed([str(p) for p in out])
    return out


def _stream(root: Path, shards: list[Path], names: int) -> Path:
    """A one-task stream of `names` shard names (linking to the real shards, in turn) with its
    shards.idx.json."""
    from cvl.data.index import index_files
    from cvl.data.shardindex import read_summary
    from cvl.streams.manifest import Manifest, ShardSet, TaskInfo, save_manifest

    s = root / f"s{names}"
    (s / "train").mkdir(parents=True, exist_ok=True)
    listed = []
    for i in range(names):
        real = shards[i % len(shards)]
        stem = s / "train" / f"{i:05d}"
        for src, dst in (
            (real, Path(str(stem) + ".tar")),
            (Path(index_files(str(real))[0]), Path(str(stem) + ".idx.npy")),
            (Path(index_files(str(real))[1]), Path(str(stem) + ".idx.json")),
        ):
            if not dst.exists():
                os.symlink(src, dst)
        listed.append(f"train/{i:05d}.tar")
    count = sum(int(read_summary(str(shards[i % len(shards)]))["count"]) for i in range(names))
    m = Manifest(
        name=s.name,
        source="bench",
        split_rule="none",
        seed=0,
        task_order=["t0"],
        tasks={"t0": TaskInfo(name="t0", train=ShardSet(shards=listed, count=count))},
    )
    save_manifest(m, s)
    return s


def _fresh(cache: Path) -> None:
    from cvl.data import index as idx
    from cvl.data import samples, shardindex

    idx.TABLE.__init__()
    shardindex._PRELOADED.clear()
    samples._WINDOWS.clear()
    samples._WSTATE["bytes"] = 0
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["CVL_INDEX_CACHE"] = str(cache)


def startup(srv: RangeServer, root: Path, names: int, latency: float, summary: bool) -> dict:
    from cvl.data.index import TABLE
    from cvl.streams.manifest import load_manifest
    from cvl.streams.streamfiles import shard_names

    s = root / f"s{names}"
    hidden = s / "shards.idx.json.off"
    if not summary:
        os.replace(s / "shards.idx.json", hidden)
    try:
        _fresh(root / "cache")
        srv.latency, srv.requests[:] = latency, []
        t = time.perf_counter()
        m = load_manifest(f"{srv.base}/{s.name}")
        TABLE.add([str(m.resolve(n)) for n in shard_names(m)])
        dt = time.perf_counter() - t
    finally:
        if not summary:
            os.replace(hidden, s / "shards.idx.json")
    return {"shards": names, "latency_ms": latency * 1e3, "stream_summary": summary,
            "startup_s": round(dt, 3), "requests": len(srv.requests)}  # fmt: skip


def reads(base: str, stream: str, root: Path, block: int, decode: bool, samples_n: int,
          srv: RangeServer | None = None, latency: float = 0.0, cache: bool = False,
          workers: int = 0) -> dict:  # fmt: skip
    """Read `samples_n` samples of the task's epoch order (batches of BATCH)."""
    from cvl.data.reader import PairDataset, global_batch, make_loader
    from cvl.data.samples import read_ids
    from cvl.streams.manifest import load_manifest

    _fresh(root / "cache")
    if cache:
        os.environ["CVL_SHARD_CACHE"] = str(root / "shards")
        shutil.rmtree(root / "shards", ignore_errors=True)
    else:
        os.environ.pop("CVL_SHARD_CACHE", None)
    m = load_manifest(f"{base}/{stream}")
    ds = PairDataset.from_shards(m.train_shards("t0"), window=block)
    n = len(ds)
    nb = samples_n // BATCH
    plan = [global_batch(n, BATCH, 0, 0, b, block=block) for b in range(nb)]
    from cvl.data.index import _ROW, TABLE

    t = time.perf_counter()  # every shard's rows in the node's cache: once per node, not a read
    TABLE.fetch_rows(np.unique(ds.entries.ids(np.arange(n)) // _ROW).tolist())
    index_s = time.perf_counter() - t
    if srv is not None:
        srv.latency = latency
        srv.reset()
    if workers:  # timed from the first batch on (the workers' start is not the read path)
        it = iter(make_loader(ds, iter(plan), num_workers=workers))
        next(it)
        if srv is not None:
            srv.reset()
        t = time.perf_counter()
        got = sum(len(b["key"]) for b in it)
    else:
        t = time.perf_counter()
        got = 0
        for batch in plan:
            idx = [i for i, _ in batch]
            got += len(ds.__getitems__(batch) if decode else read_ids(ds.entries.ids(idx), block))
    dt = time.perf_counter() - t
    out = {"order": "default" if block == 1 else f"shuffle-block {block}",
           "shard_cache": cache, "latency_ms": latency * 1e3, "path": "decode" if decode else "bytes",
           "samples_per_s": round(got / dt, 1), "index_fetch_s": round(index_s, 3)}  # fmt: skip
    if workers:
        out["workers"] = workers
    if srv is not None:
        tars = [r for p, r in srv.requests if p.endswith(".tar")]
        out["requests_per_sample"] = round(len(tars) / got, 4)
        out["bytes_per_sample"] = round(srv.bytes_sent / got, 1)
    os.environ.pop("CVL_SHARD_CACHE", None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=3200, help="samples read per row")
    ap.add_argument("--startup-shards", default="100,1200,12800")
    ap.add_argument("--latencies", default="0,0.02,0.05")
    ap.add_argument("--no-s3", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(tempfile.mkdtemp(prefix="cvl-bench-remote-"))
    try:
        shards = _foreign(root / "real", a.shards, a.per_shard)
        _stream(root, shards, a.shards)
        for n in map(int, a.startup_shards.split(",")):
            _stream(root, shards, n)
        srv = RangeServer(root)
        out: dict = {"bed": {"shards": a.shards, "per_shard": a.per_shard, "batch": BATCH,
                             "sample_bytes": round(sum(p.stat().st_size for p in shards)
                                                   / (a.shards * a.per_shard), 1)}}  # fmt: skip
        startup(srv, root, a.shards, 0.0, True)  # imports and the first session: not timed
        out["startup"] = [
            startup(srv, root, n, lat, summary)
            for n in map(int, a.startup_shards.split(","))
            for lat in (0.02, 0.05)
            for summary in (True, False)
        ]
        rows = []
        stream = f"s{a.shards}"
        for lat in map(float, a.latencies.split(",")):
            for block, cache in ((1, False), (256, False), (256, True), (1, True)):
                for decode in (False, True):
                    if cache and decode:
                        continue
                    n = a.samples if not cache else min(a.samples, 4 * a.per_shard)
                    rows.append(reads(srv.base, stream, root, block, decode, n, srv, lat, cache))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        out["reads"] = rows
        out["workers"] = [
            reads(srv.base, stream, root, 1, True, a.samples, srv, lat, workers=4)
            for lat in (0.02, 0.05)
        ]
        srv.close()
        if not a.no_s3:
            with s3_server():
                upload(root / stream, f"s3://bench/{stream}")
                out["s3"] = [
                    reads("s3://bench", stream, root, block, False, a.samples) for block in (1, 256)
                ]
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
