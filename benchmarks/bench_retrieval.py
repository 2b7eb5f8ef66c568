"""Cross-modal retrieval over a 50k x 50k random-embedding gallery: time and peak memory.

Compares `cvl.evaluation.retrieval.retrieval_ranks` (both directions, exact ranks, pessimistic
ties) with one plain N x N matmul of the same embeddings in the same process. The plain
matmul is computed block by block with the same block size into one reused buffer: a
single 50k x 50k float32 result would need 10 GB, which is what retrieval must never hold.
Peak memory is the process's resident-set high-water mark (ru_maxrss) above the resident size
once the embeddings exist, measured for the retrieval phase (run first).

    .venv/bin/python benchmarks/bench_retrieval.py [--n 50000] [--dim 256] [--threads 2] [--repeats 2]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000, help="images = captions = N")
    ap.add_argument("--dim", type=int, default=256, help="embedding size (CTP: 256)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument(
        "--block-elems", type=int, default=None, help="scores per block [retrieval default]"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (best of)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from cvl.evaluation.retrieval import (
        DEFAULT_BLOCK_ELEMS,
        MAX_BLOCK_ROWS,
        pair_positives,
        retrieval_ranks,
        summarize,
    )

    block = args.block_elems or DEFAULT_BLOCK_ELEMS
    g = torch.Generator().manual_seed(args.seed)
    n, d = args.n, args.dim
    img = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1)
    # Captions = their image + noise, so recall is neither 0 nor 100.
    txt = torch.nn.functional.normalize(img + 4.0 * torch.randn(n, d, generator=g) / d**0.5, dim=-1)
    pos = pair_positives(torch.arange(n), n)
    base_rss = rss_mb()

    rows = max(1, min(n, MAX_BLOCK_ROWS, block // n))
    txt_t = txt.t().contiguous()
    buf = torch.empty(rows, n)

    def plain_matmul() -> None:
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            torch.mm(img[r0:r1], txt_t, out=buf[: r1 - r0])

    # Interleaved repeats, best of each: the machine is shared, so single timings are noisy.
    t_ret, t_mm, peak_retrieval = [], [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        r_img, r_txt = retrieval_ranks(img, txt, pos, block_elems=block)
        t_ret.append(time.perf_counter() - t0)
        if peak_retrieval is None:
            peak_retrieval = peak_mb()  # before the baseline allocates its buffer
        t0 = time.perf_counter()
        plain_matmul()
        t_mm.append(time.perf_counter() - t0)
    metrics = summarize(r_img, r_txt)
    t_retrieval, t_matmul = min(t_ret), min(t_mm)

    print(
        json.dumps(
            {
                "benchmark": "retrieval",
                "n_images": n,
                "n_texts": n,
                "dim": d,
                "threads": torch.get_num_threads(),
                "block_elems": block,
                "block_rows": rows,
                "retrieval_s": round(t_retrieval, 3),
                "plain_matmul_s": round(t_matmul, 3),
                "retrieval_runs_s": [round(t, 3) for t in t_ret],
                "plain_matmul_runs_s": [round(t, 3) for t in t_mm],
                "retrieval_over_matmul": round(t_retrieval / t_matmul, 3),
                "peak_rss_mb": round(peak_retrieval, 1),
                "rss_with_embeddings_mb": round(base_rss, 1),
                "peak_extra_mb": round(peak_retrieval - base_rss, 1),
                "nxn_float32_mb": round(n * n * 4 / 2**20, 1),
                "held_nxn": bool(peak_retrieval - base_rss >= n * n * 4 / 2**20),
                "TR@1": round(metrics["TR@1"], 2),
                "IR@1": round(metrics["IR@1"], 2),
                "Rm": round(metrics["Rm"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
