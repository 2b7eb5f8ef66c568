"""cvl's training loader vs raw PIL decoding of the same images (JSON on stdout).

For each image size (synthetic stream, JPEG shards), in one process:

- `raw`: the JPEG bytes already in memory, `Image.open(...).convert("RGB")` with `load()`:
  decoding only, the floor of any loader;
- `raw_transform`: the same plus open_clip's training transform: the least any loader that
  decodes and augments like cvl must do (the target: cvl's sample costs ≤ 1/0.9 of this);
- `cvl_item`: `PairDataset[(index, seed)]`: shard read + decode + open_clip's training
  transform (RandomResizedCrop, ToTensor, Normalize) + tokenisation, one sample at a time in
  this process;
- `cvl_loader_wN`: the training DataLoader (`make_loader`, N workers, batches of `--batch`),
  samples/s over `--epochs` passes, worker start-up included.

Ratios are samples/s of cvl over samples/s of `raw_transform` / `raw`. In-process timings
are CPU seconds of this process (one torch thread: robust to other processes on a busy
machine); loaders with workers are timed in wall seconds. Each timing is the fastest of
`--repeats` (load from other processes only slows things down).

    python benchmarks/bench_loader.py [--sizes 32,224] [--n 512] [--workers 0,1,2]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import torch


def best_rate(fn, n: int, repeats: int, cpu: bool = True) -> float:
    """Samples/s of the fastest of `repeats` runs of fn() (which handles n samples)."""
    clock = time.process_time if cpu else time.perf_counter
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return n / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,224")
    ap.add_argument("--n", type=int, default=512, help="images per size")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from PIL import Image

    from cvl.data.reader import _FILES, PairDataset, default_workers, global_batches, make_loader
    from cvl.data.tokenizers import build_tokenizer
    from cvl.data.transforms import image_transform
    from cvl.streams.manifest import load_manifest
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    tok = build_tokenizer({"type": "hash", "vocab_size": 1024, "context_length": 32})
    out: dict = {"n": args.n, "batch": args.batch, "default_workers": default_workers()}
    with tempfile.TemporaryDirectory() as tmp:
        for size in [int(s) for s in args.sizes.split(",")]:
            root = Path(tmp) / f"s{size}"
            spec = SynthSpec(tasks=1, per_task=args.n, image_size=size, test_per_task=8)
            build_synthetic(root, spec, progress=False)
            m = load_manifest(root)
            ds = PairDataset.from_shards(
                m.train_shards(m.task_order[0]),
                transform=image_transform(size, train=True),
                tokenize=tok,
            )
            blobs = [_FILES.read(e.shard, e.image) for e in ds.entries]
            fmt = Image.open(io.BytesIO(blobs[0])).format

            def raw(blobs=blobs):
                for b in blobs:
                    im = Image.open(io.BytesIO(b))
                    im.load()
                    im.convert("RGB")

            tr = image_transform(size, train=True)

            def raw_transform(blobs=blobs, tr=tr):
                for b in blobs:
                    im = Image.open(io.BytesIO(b))
                    im.load()
                    tr(im.convert("RGB"))

            items = [it for b in global_batches(len(ds), args.batch, 0, 0) for it in b]

            def item(items=items, ds=ds):
                for it in items:
                    ds[it]

            r = {"format": fmt, "raw_per_s": round(best_rate(raw, len(blobs), args.repeats))}
            rt = best_rate(raw_transform, len(blobs), args.repeats)
            r["raw_transform_per_s"] = round(rt)
            r["cvl_item_per_s"] = round(best_rate(item, len(items), args.repeats))
            r["cvl_item_over_raw_transform"] = round(r["cvl_item_per_s"] / rt, 3)
            r["cvl_item_over_raw"] = round(r["cvl_item_per_s"] / r["raw_per_s"], 3)
            for w in [int(x) for x in args.workers.split(",")]:
                batches = [b for e in range(2) for b in global_batches(len(ds), args.batch, 0, e)]

                def loader(w=w, batches=batches, ds=ds):
                    for _ in make_loader(ds, batches, num_workers=w):
                        pass

                n = sum(len(b) for b in batches)
                rate = best_rate(loader, n, args.repeats, cpu=w == 0)
                r[f"cvl_loader_w{w}_per_s"] = round(rate)
                r[f"cvl_loader_w{w}_over_raw_transform"] = round(rate / rt, 3)
            out[f"{size}px"] = r
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
