"""The CPU one item costs through the training dataset, as a loader worker pays it for every
sample: `PairDataset[i]` (bytes read by the index, headers checked, the image decoded, caption
and metadata parsed; no transform, no tokenizer) and a worker's batch of 32
(`__getitems__`), on a local stream of tiny images (so the read path, not the JPEG decoder,
dominates), in random order. CPU seconds (`time.process_time`), medians of 5 passes.

`--compare REV [REV ...]`: the same measurement with the cvl of git revisions REV (checked out
into temporary worktrees, run in a subprocess), e.g. the reader before the on-disk index
(8fbfe80) and the one it replaced. Printed as JSON.

`--instructions N`: instructions per item instead of CPU time (steadier on a shared machine):
each measure runs under valgrind's callgrind reading N items after 100 warm ones, minus the
same run reading none (`PairDataset[i]`, and batches of 32 where the revision has them).
Minutes per revision.

    python benchmarks/bench_item.py [--items 4000] [--compare 8fbfe80 743696d]
    python benchmarks/bench_item.py --samples 4000 --instructions 2000 --compare 8fbfe80
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def build(root: Path, n: int) -> list[str]:
    import numpy as np
    from PIL import Image

    from cvl.streams.writer import ShardSink, encode_jpeg

    rng = np.random.default_rng(0)
    jpgs = [
        encode_jpeg(Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)))
        for _ in range(64)
    ]
    sink = ShardSink(root, "t", maxcount=1000)
    for i in range(n):
        sink.write(f"s{i:07d}", jpgs[i % 64], f"a photo number {i}", {"id": i})
    return [str(root / s) for s in sink.close().shards]


def measure(shards: list[str], items: int) -> dict:
    from cvl.data.reader import PairDataset

    ds = PairDataset.from_shards(shards)
    order = list(range(len(ds)))
    random.Random(0).shuffle(order)
    order = order[:items]
    for i in order[:200]:  # warm: maps, descriptors, page cache
        ds[i]
    one, batch = [], []
    has_batch = hasattr(ds, "__getitems__")
    for _ in range(5):
        t = time.process_time()
        for i in order:
            ds[i]
        one.append((time.process_time() - t) / len(order))
        if has_batch:
            t = time.process_time()
            for s in range(0, len(order), 32):
                ds.__getitems__(order[s : s + 32])
            batch.append((time.process_time() - t) / len(order))
    out = {"us_per_item": round(statistics.median(one) * 1e6, 1)}
    if has_batch:
        out["us_per_item_in_batches_of_32"] = round(statistics.median(batch) * 1e6, 1)
    return out


def reads(shards: list[str], n: int, batched: bool) -> None:
    """Read `n` items in random order after 100 warm ones (what callgrind counts)."""
    from cvl.data.reader import PairDataset

    ds = PairDataset.from_shards(shards)
    order = list(range(len(ds)))
    random.Random(0).shuffle(order)
    for i in order[:100]:
        ds[i]
    sel = order[100 : 100 + n]
    if batched:
        for s in range(0, len(sel), 32):
            ds.__getitems__(sel[s : s + 32])
    else:
        for i in sel:
            ds[i]


def instructions(listing: Path, n: int, env: dict, cwd: Path, tmp: Path) -> dict:
    """Instructions per item of one revision's reads (callgrind, N items minus none)."""
    import re

    me = [sys.executable, str(Path(__file__).resolve()), "--child", str(listing)]
    subprocess.run(me + ["--reads", "0"], env=env, cwd=cwd, check=True)  # indexed as it does
    out = {}
    for batched in (False, True):
        counts = []
        for count in (0, n):
            argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", *me,
                    "--reads", str(count)] + (["--batched"] if batched else [])  # fmt: skip
            r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
            if batched and "__getitems__" in r.stderr:  # a revision without batches
                break
            m = re.search(r"Collected : (\d+)", r.stderr)
            if r.returncode or m is None:
                raise SystemExit(f"callgrind failed: {r.stderr[-2000:]}")
            counts.append(int(m.group(1)))
        if len(counts) == 2:
            key = "instructions_per_item_in_batches_of_32" if batched else "instructions_per_item"
            out[key] = round((counts[1] - counts[0]) / n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=4000)
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--compare", nargs="*", default=[])
    ap.add_argument("--instructions", type=int, default=0, metavar="N")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--reads", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--batched", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child and a.reads >= 0:  # what callgrind counts
        reads(Path(a.child).read_text().split("\n"), a.reads, a.batched)
        return
    if a.child:  # a revision's cvl on the shards listed in the file
        print(json.dumps(measure(Path(a.child).read_text().split("\n"), a.items)))
        return
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="cvl-bench-item-") as tmp:
        shards = build(Path(tmp) / "s", a.samples)
        listing = Path(tmp) / "shards.txt"
        listing.write_text("\n".join(shards))
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        if a.instructions:
            out = {"this": instructions(listing, a.instructions, env, REPO, Path(tmp))}
        else:
            out = {"this": measure(shards, a.items)}
        for rev in a.compare:
            wt = Path(tmp) / f"wt-{rev}"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(wt), rev], check=True)  # fmt: skip
            try:
                for f in Path(tmp, "s").rglob("*.idx.*"):  # each revision indexes as it does
                    f.unlink()
                env = {**os.environ, "PYTHONPATH": str(wt), "OMP_NUM_THREADS": "1"}
                if a.instructions:
                    out[rev] = instructions(listing, a.instructions, env, wt, Path(tmp))
                    continue
                argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(listing)]
                r = subprocess.run(argv + ["--items", str(a.items)], env=env, cwd=wt,
                                   capture_output=True, text=True, check=True)  # fmt: skip
                out[rev] = json.loads(r.stdout.strip().splitlines()[-1])
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], check=True)  # fmt: skip
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
