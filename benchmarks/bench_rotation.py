"""Throughput and memory of the chunked SAM computation (the expensive part of `cvl analyze rotation`).

Prints JSON: per N, seconds for K checkpoints' |SAM_i - SAM_j| histograms (consecutive pairs +
first vs last), pairs per second, and the process's peak RSS. Synthetic unit features, D=512.

    .venv/bin/python benchmarks/bench_rotation.py [--n 2000 5000] [--k 3] [--chunk-mb 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from cvl.analysis import rotation as rot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[2000, 5000])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--k", type=int, default=3, help="checkpoints")
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = []
    for n in a.n:
        g = torch.Generator().manual_seed(0)
        base = torch.nn.functional.normalize(torch.randn(n, a.d, generator=g), dim=-1)
        feats = [
            torch.nn.functional.normalize(
                base + 0.05 * k * torch.randn(n, a.d, generator=g), dim=-1
            )
            for k in range(a.k)
        ]
        pairs = rot.checkpoint_pairs(a.k)
        t0 = time.perf_counter()
        counts, _ = rot.sam_counts(feats, pairs, chunk_elems=a.chunk_mb * (1 << 20) // 8)
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i, j in pairs:
            rot.paired_angles(feats[i], feats[j])
        dt_ram = time.perf_counter() - t0
        npairs = n * (n - 1) // 2
        assert int(counts.sum()) == npairs * len(pairs)
        results.append(
            {
                "n": n,
                "d": a.d,
                "checkpoints": a.k,
                "table_rows": len(pairs),
                "sam_seconds": round(dt, 3),
                "sample_pairs_per_second_per_checkpoint": round(npairs * a.k / dt),
                "ram_seconds": round(dt_ram, 4),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "rotation_sam",
                "threads": a.threads,
                "chunk_mb": a.chunk_mb,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
