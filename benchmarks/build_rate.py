"""Build rate of `cvl build-stream table` over local image files, per number of processes.

Writes N small generated JPEGs (48x40 px, a colour per image, a little noise) listed in a CSV
table, then times `build_table` with `--processes P` at the default --image-size 256 (the
images are not enlarged: the resize is img2dataset's decode + re-encode). `measure_build`
returns samples/s (wall, on a busy machine a lower bound), the CPU milliseconds per sample
summed over the builder and its child processes and those of the builder alone (nearly
load-independent), and from them the speedup P free cores allow (Amdahl: the builder's own
CPU time is the part no other process takes).
`benchmarks/bench_scale.py` calls it; run alone it prints JSON for 1 and 2 processes:

    python benchmarks/build_rate.py --samples 4000
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


def write_table(root: Path, n: int, size: tuple[int, int] = (48, 40)) -> Path:
    """N JPEGs in root/img and root/pairs.csv listing them (image, caption); made once."""
    csv = root / "pairs.csv"
    if csv.exists() and csv.read_text(encoding="utf-8").count("\n") == n + 1:
        return csv
    (root / "img").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = ["image,caption"]
    for i in range(n):
        px = rng.integers(0, 256, 3) + rng.integers(-12, 12, (size[1], size[0], 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(px, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        (root / "img" / f"{i:07d}.jpg").write_bytes(buf.getvalue())
        lines.append(f"img/{i:07d}.jpg,a photo number {i}")
    csv.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return csv


def _cpu_s() -> tuple[float, float]:
    """User + system CPU seconds of this process, and of its finished children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, ch.ru_utime + ch.ru_stime


def measure_build(
    n_samples: int, processes: int, workdir: Path, shard_size: int = 500
) -> dict[str, Any]:
    """Time one table build of `n_samples` generated images with `processes` processes.

    The table and images are written once under `workdir` (kept for the next call); the
    stream is written to `workdir/out-P` and removed. Returns samples/s (wall clock) and CPU
    seconds per sample (this process + its children, which a pool's workers are). The first
    build of a process also pays img2dataset's imports (seconds): warm up with a small one."""
    from cvl.streams.download import DownloadOptions
    from cvl.streams.pipeline import BuildOptions
    from cvl.streams.table import build_table

    workdir = Path(workdir)
    csv = write_table(workdir / "table", n_samples)
    out = workdir / f"out-{processes}"
    opts = BuildOptions(
        out=out,
        shard_size=shard_size,
        overwrite=True,
        progress=False,
        download=DownloadOptions(processes=processes),
        log=lambda _msg: None,
    )
    (me0, ch0), t0 = _cpu_s(), time.perf_counter()
    m = build_table([csv], opts, url_col="image", caption_col="caption")
    wall = time.perf_counter() - t0
    me1, ch1 = _cpu_s()
    main_cpu, child_cpu = me1 - me0, ch1 - ch0
    cpu = main_cpu + child_cpu
    n = sum(t.train.count for t in m.tasks.values())
    shutil.rmtree(out)
    serial = main_cpu / cpu if processes > 1 else 1.0  # the share no other process can take
    return {
        "samples": n,
        "processes": processes,
        "shard_size": shard_size,
        "wall_s": round(wall, 3),
        "samples_per_s": round(n / wall, 1),
        "cpu_ms_per_sample": round(1000 * cpu / n, 4),
        "main_cpu_ms_per_sample": round(1000 * main_cpu / n, 4),
        "samples_per_cpu_s": round(n / cpu, 1),
        # Amdahl on CPU time: the speedup P free cores give over the same CPU work in one
        "speedup_bound": round(1 / (serial + (1 - serial) / processes), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        measure_build(200, 1, Path(d) / "warm")  # imports and the resizer, outside the timing
        runs = [measure_build(a.samples, p, Path(d)) for p in a.processes]
    base = runs[0]["samples_per_s"]
    for r in runs:
        r["speedup_vs_first"] = round(r["samples_per_s"] / base, 3)
    print(json.dumps({"benchmark": "table build, local 48x40 JPEGs", "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
