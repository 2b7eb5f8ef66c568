"""The data path at the mission's scale: streams of 1 M, 10 M and 100 M samples, index only.

A few real shards (tiny JPEGs, written by cvl's ShardSink with their index) are repeated by
symbolic links (tar, .idx.npy, .idx.json) to make streams of any size without 100 M images:
every figure below is what cvl does with a real stream of that many shards and samples
except that the page cache holds one real tar.

Printed as JSON, per stream size (each measured in a fresh process):

- ``startup_s``: from nothing to the task's first global batch planned (indexes found, the
  shard table, the epoch's first batch), after imports (``imports_s``);
- ``resident_bytes_per_sample``: the process's resident memory after start-up less before,
  per sample;
- ``plan_ms_per_global_batch``: planning one global batch of 4,096 (median of 50);
- ``worker_private_mb``: private (copy-on-write copied) memory of each of 2 loader workers
  after they read 50,000 samples — flat in the stream's size when nothing per sample is
  shared;

and once: ``random_reads_per_s`` at 1,200 shards (members read by offset, in random order)
with today's LRU of open files and with the reader before this change (all handles closed
when the 65th shard opens); ``scan_us_per_sample``, what indexing a tar by its headers costs
(the start-up the index files replace, per sample and rank); ``build`` (when
benchmarks/build_rate.py is present): build samples/s per process count.

    python benchmarks/bench_scale.py [--sizes 1e6,1e7,1e8] [--per-shard 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _real_shard(root: Path, per_shard: int) -> Path:
    from PIL import Image

    from cvl.streams.writer import ShardSink, encode_jpeg

    sink = ShardSink(root, "real", maxcount=per_shard)
    rng = np.random.default_rng(0)
    jpgs = [
        encode_jpeg(Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)))
        for _ in range(64)
    ]
    for i in range(per_shard):
        sink.write(f"s{i:07d}", jpgs[i % 64], f"a photo number {i}", {"id": i})
    return root / sink.close().shards[0]


def _linked(root: Path, real: Path, n_shards: int) -> list[str]:
    """`n_shards` shard names whose tar and index files link to the real shard's."""
    from cvl.data.index import index_files

    root.mkdir(parents=True, exist_ok=True)
    npy, js = index_files(str(real))
    out = []
    for i in range(n_shards):
        stem = root / f"{i:06d}"
        for src, suffix in ((real, ".tar"), (Path(npy), ".idx.npy"), (Path(js), ".idx.json")):
            dst = Path(str(stem) + suffix)
            if not dst.exists():
                os.symlink(src, dst)
        out.append(str(stem) + ".tar")
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _private(pid: int) -> int:
    """Private (dirty + clean) bytes of a process: what copy-on-write gave it of its own."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Dirty:", "Private_Clean:")):
                total += int(line.split()[1]) * 1024
    return total


def child(shard_list: str, read: int) -> dict:
    """One stream in a fresh process (argv: the file listing its shards)."""
    t0 = time.perf_counter()
    from cvl.data.mixture import plain_data
    from cvl.data.reader import PairDataset, make_loader

    imports = time.perf_counter() - t0
    shards = Path(shard_list).read_text().split("\n")
    rss0 = _rss()
    t0 = time.perf_counter()
    ds = PairDataset.from_shards(shards, name="bench")
    data = plain_data(ds.entries, 4096, seed=0)
    first = data.batch(0, 0)
    startup = time.perf_counter() - t0
    resident = _rss() - rss0
    n = len(ds)
    times = []
    for b in range(1, 51):
        t = time.perf_counter()
        data.batch(0, b)
        times.append(time.perf_counter() - t)
    out = {
        "samples": n,
        "shards": len(shards),
        "imports_s": round(imports, 3),
        "startup_s": round(startup, 3),
        "resident_bytes_per_sample": round(resident / n, 4),
        "plan_ms_per_global_batch": round(float(np.median(times)) * 1e3, 3),
        "first_batch": len(first),
    }
    if read:

        def batches():  # random samples of the epoch's order, 256 at a time
            b = 0
            while True:
                yield data.batch(0, b)[:256]
                b += 1

        loader = make_loader(ds, batches(), num_workers=2)
        it = iter(loader)
        got = 0
        t = time.perf_counter()
        while got < read:
            got += len(next(it)["key"])
        out["read_samples_per_s"] = round(got / (time.perf_counter() - t), 1)
        out["worker_private_mb"] = [round(_private(w.pid) / 2**20, 2) for w in it._workers]
        del it
    return out


def random_reads(shards: list[str], n: int = 20000) -> dict:
    """Members read by offset in random order over the shards: the LRU vs the old policy."""
    from cvl.data.index import Entries
    from cvl.data.remote import Files

    class Old:  # the reader before: every handle closed when the 65th shard opens
        def __init__(self) -> None:
            self.handles: dict = {}

        def read(self, path: str, span: tuple[int, int]) -> bytes:
            f = self.handles.get(path)
            if f is None:
                if len(self.handles) > 64:
                    for h in self.handles.values():
                        h.close()
                    self.handles.clear()
                f = self.handles[path] = open(path, "rb")  # noqa: SIM115
            f.seek(span[0])
            return f.read(span[1])

    e = Entries.of_shards(shards)
    rng = np.random.default_rng(0)
    pos = rng.integers(0, len(e), n)
    spans = [(x.shard, x.image) for x in (e[int(i)] for i in pos)]
    out = {"shards": len(shards)}
    for name, files in (("lru", Files()), ("before", Old())):
        t = time.perf_counter()
        for path, span in spans:
            files.read(path, span)
        out[f"{name}_reads_per_s"] = round(n / (time.perf_counter() - t), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7,1e8")
    ap.add_argument("--per-shard", type=int, default=10000)
    ap.add_argument("--read", type=int, default=50000, help="samples the workers read")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]))))
        return
    from cvl.data.index import scan_tar

    res: dict = {"machine": f"{os.cpu_count()} CPUs", "per_shard": a.per_shard, "streams": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        real = _real_shard(tmp, a.per_shard)
        t = time.perf_counter()
        scan_tar(str(real))
        res["scan_us_per_sample"] = round((time.perf_counter() - t) / a.per_shard * 1e6, 2)
        for size in (int(float(s)) for s in a.sizes.split(",")):
            shards = _linked(tmp / f"n{size}", real, max(1, size // a.per_shard))
            lst = tmp / f"n{size}.txt"
            lst.write_text("\n".join(shards))
            cmd = [sys.executable, __file__, "--child", str(lst), str(a.read)]
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res["streams"].append(json.loads(r.stdout.strip().splitlines()[-1]))
        small = _real_shard(tmp / "small", 200)
        res["random_reads"] = random_reads(_linked(tmp / "r1200", small, 1200))
        try:
            sys.path.insert(0, str(HERE))
            from build_rate import measure_build

            res["build"] = {p: measure_build(4000, p, tmp / f"b{p}") for p in (1, 2)}
        except ImportError:
            res["build"] = "benchmarks/build_rate.py not present"
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
