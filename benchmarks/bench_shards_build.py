"""`cvl build-stream shards` at scale: streams built in place over index-only collections of
1 M and 10 M samples, and what they write per training sample.

A collection is one real shard of 10,000 tiny JPEGs (written by cvl's ShardSink) repeated by
symbolic links, each link with index files of its own whose sample keys are unique
(``SSSSSSRRRRR``: shard, row), as a collection of that many shards would have once indexed
(`cvl index`); a parquet table maps every key to a year 2014-2022 (the TiC-style join). Each
build runs in a fresh process (`python -m cvl build-stream shards ...`):

- ``instance``: ``--chunks 5 --test 1000`` (IncCLIP's instance split, 5 tasks);
- ``tic``: ``--join years.parquet --join-id-col key --time-col year --first-until 2016 --test
  1000`` (a key table of as many rows as samples; 7 tasks, 9 yearly retrieval sets).

Printed as JSON per (size, build): ``seconds`` (the command, imports included),
``samples_per_s`` (collection samples / seconds), ``peak_rss_bytes_per_sample`` (the process's
peak resident memory less its resident memory after importing what the build uses, per
collection sample),
``bytes_per_training_sample`` (every byte the build wrote except the copied evaluation sets,
per training sample: rows files, stream.json, build_report.json), ``rows_bytes_per_sample``
and ``eval_bytes`` (the copied held-out samples), and whether any training shard was written.
Once: ``json_field_samples_per_s``, reading one KEY.json field of every sample of 100,000
local samples in one process (what `--id-col uid` costs when no img2dataset parquet lies
beside the shards). The machine's load average is printed with it.

    python benchmarks/bench_shards_build.py [--sizes 1e6,1e7] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_scale import _real_shard  # one real shard of tiny JPEGs, with its index

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
PER_SHARD = 10_000


def _collection(root: Path, real: Path, n_shards: int) -> Path:
    """`n_shards` links to the real tar, each with its own index (unique keys), and the key
    table `years.parquet`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cvl.data.index import index_files, write_index
    from cvl.data.tarfmt import row_dtype as _dtype

    shards = root / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    rows = np.load(index_files(str(real))[0])
    size = real.stat().st_size
    suffix = np.char.mod("%05d", np.arange(len(rows))).astype("S5")
    out = np.zeros(len(rows), _dtype(11))
    for f in ("image", "text", "meta"):
        out[f] = rows[f]
    keys, years = [], []
    rng = np.random.default_rng(1)
    for s in range(n_shards):
        tar = shards / f"{s:06d}.tar"
        if not tar.exists():
            os.symlink(real, tar)
        out["key"] = np.char.add(f"{s:06d}".encode(), suffix)
        write_index(str(tar), out, [], size)
        keys.append(out["key"].copy())
        years.append(rng.integers(2014, 2023, len(rows)))
    table = pa.table(
        {
            "key": pa.array(np.concatenate(keys)).cast(pa.string()),
            "year": pa.array(np.concatenate(years)),
        }
    )
    pq.write_table(table, root / "years.parquet")
    return root


def _bytes(folder: Path) -> dict:
    every = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
    evals = sum(p.stat().st_size for p in every if "eval" in p.relative_to(folder).parts)
    rows = sum(p.stat().st_size for p in every if p.name.endswith(".rows.npy"))
    total = sum(p.stat().st_size for p in every)
    return {"total": total, "eval": evals, "rows": rows}


def child(mode: str, collection: str, out: str) -> dict:
    """One build in this (fresh) process."""
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    t0 = time.perf_counter()
    import pyarrow.compute  # noqa: F401  (what the build imports: measured apart from it)
    import pyarrow.parquet  # noqa: F401
    import webdataset  # noqa: F401

    import cvl.data.reader  # noqa: F401
    import cvl.streams.shards  # noqa: F401
    from cvl.cli import main

    imports = time.perf_counter() - t0
    base = rss()
    argv = ["build-stream", "shards", "--shards", f"{collection}/shards", "--out", out]
    argv += ["--quiet", "--test", "1000"]
    if mode == "instance":
        argv += ["--chunks", "5"]
    else:
        argv += ["--join", f"{collection}/years.parquet", "--join-id-col", "key"]
        argv += ["--time-col", "year", "--first-until", "2016"]
    t = time.perf_counter()
    rc = main(argv)
    secs = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "rc": rc,
        "imports_s": round(imports, 2),
        "build_s": round(secs, 2),
        "peak": peak,
        "base": base,
    }


def _json_rate(real: Path, tmp: Path) -> float:
    """A KEY.json field of 100,000 local samples (10 links of the real shard), one process."""
    from cvl.data.index import Entries, index_files
    from cvl.streams.shardcols import json_fields

    npy, js = index_files(str(real))
    links = []
    (tmp / "json").mkdir(parents=True, exist_ok=True)
    for i in range(10):
        stem = str(tmp / "json" / f"{i:03d}")
        for src, suffix in ((str(real), ".tar"), (npy, ".idx.npy"), (js, ".idx.json")):
            os.symlink(src, stem + suffix)
        links.append(stem + ".tar")
    e = Entries.of_shards(links)
    t = time.perf_counter()
    got = json_fields(e.parts[0][1], ["id"], processes=1)["id"]
    secs = time.perf_counter() - t
    assert len(got) == len(e) and got[1].as_py() == "1"
    return round(len(e) / secs, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1e6,1e7")
    ap.add_argument("--keep", default=None, help="Build the collections here (kept).")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "COLLECTION", "OUT"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    results: dict = {"machine": f"{os.cpu_count()} CPUs", "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(dir=a.keep) as tmp_s:
        tmp = Path(tmp_s)
        real = _real_shard(tmp / "real", PER_SHARD)
        results["json_field_samples_per_s"] = _json_rate(real, tmp)
        for size in (int(float(x)) for x in a.sizes.split(",")):
            col = _collection(tmp / f"c{size}", real, size // PER_SHARD)
            for mode in ("instance", "tic"):
                out = tmp / f"s{size}-{mode}"
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
                t = time.perf_counter()
                r = subprocess.run(
                    [sys.executable, __file__, "--child", mode, str(col), str(out)],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=True,
                )
                wall = time.perf_counter() - t
                got = json.loads(r.stdout.strip().splitlines()[-1])
                rep = json.loads((out / "build_report.json").read_text())
                n_train = sum(rep["counts"]["train"].values())
                b = _bytes(out)
                results[f"{size:.0e}/{mode}"] = {
                    "samples": size,
                    "shards": size // PER_SHARD,
                    "tasks": len(rep["task_order"]),
                    "training_samples": n_train,
                    "seconds": round(wall, 2),
                    "build_s": got["build_s"],
                    "samples_per_s": round(size / got["build_s"], 1),
                    "peak_rss_bytes_per_sample": round((got["peak"] - got["base"]) / size, 1),
                    "bytes_per_training_sample": round((b["total"] - b["eval"]) / n_train, 3),
                    "rows_bytes_per_sample": round(b["rows"] / n_train, 3),
                    "eval_bytes": b["eval"],
                    "training_shards_written": any((out / "train").rglob("*.tar"))
                    if (out / "train").exists()
                    else False,
                }
                print(json.dumps({k: results[k] for k in [f"{size:.0e}/{mode}"]}), file=sys.stderr)
    results["load_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
