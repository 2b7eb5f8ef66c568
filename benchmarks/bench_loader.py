"""A loader worker's CPU cost per training sample, today's path vs the split one (JSON).

Image sets: the synthetic stream at each of `--sizes` (images as large as the model's
input), and `--photos` photo-like 640×480 JPEGs (1/f noise, ~110 KB at quality 95, like
real photos of that size: 80-145 KB) trained at 224 px. Per set, in one process, CPU
seconds of this process (one torch thread: robust to other processes on a busy machine),
the fastest of `--repeats`, as samples/s:

- `raw`: the JPEG bytes already in memory, `Image.open(...).convert("RGB")`: decoding only;
- `raw_transform`: the same plus open_clip's training transform (RandomResizedCrop 0.9-1,
  bicubic, ToTensor, Normalize): **the baseline**, what a worker of a plain open_clip-style
  loader does per sample;
- `cvl_compose`: `PairDataset[(index, seed)]` with that transform run per sample, plus the
  batch's collate (shard read, caption, metadata, tokenisation): cvl before the split;
- `worker_resize`: the split transform's worker part with the resize in the worker (the
  CPU-run path: decode, crop + resize in uint8; no float), plus collate;
- `device_resize`: its worker part with the resize on the device (the GPU-run path: decode
  at a reduced DCT scale where the crop allows, crop; uint8 out), plus collate;
- `finish_cpu_*`: the batched part of each (float conversion, normalisation, and for
  `device_resize` the resize) run on this CPU, per sample: what the device does instead.

`speedup` = CPU seconds per sample of `raw_transform` / of `device_resize` (the issue's
target: ≥ 3 at 224 px). `worker_*_per_s` is what one worker delivers on one core.
`--workers` adds the real DataLoader (`device_resize`'s worker part, N workers, wall time
over `--epochs` passes, start-up included).

    python benchmarks/bench_loader.py [--sizes 32,224] [--photos 256] [--n 512] [--workers 0]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def best_time(fn, repeats: int, cpu: bool = True) -> float:
    """Seconds of the fastest of `repeats` runs of fn()."""
    clock = time.process_time if cpu else time.perf_counter
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def photo_jpeg(rng: np.random.Generator, w: int = 640, h: int = 480) -> bytes:
    """A photo-like JPEG: 1/f^1.5 luminance (natural images' spectrum), weaker chroma."""
    from PIL import Image

    def field(beta: float) -> np.ndarray:
        fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
        f = np.sqrt(fx**2 + fy**2)
        f[0, 0] = 1
        spec = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f**beta
        x = np.fft.irfft2(spec, s=(h, w))
        return (x - x.mean()) / x.std()

    lum = field(1.5)
    x = np.stack([lum + 0.25 * field(1.8) for _ in range(3)], -1)
    x = x * rng.uniform(40, 60) + rng.uniform(80, 170, 3)
    buf = io.BytesIO()
    Image.fromarray(np.uint8(np.clip(x, 0, 255))).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def photo_shards(root: Path, n: int, seed: int = 0) -> list[Path]:
    from cvl.streams.writer import ShardSink

    rng = np.random.default_rng(seed)
    sink = ShardSink(root, "photos", maxcount=n)
    for k in range(n):
        sink.write(f"p{k:06d}", photo_jpeg(rng), f"a photo number {k}", {"id": k})
    return [root / s for s in sink.close().shards]


def measure(shards: list[Path], size: int, args, tok) -> dict:
    """The timings above for one image set trained at `size` px."""
    from PIL import Image

    from cvl.data.augment import split_transform
    from cvl.data.reader import _FILES, PairDataset, collate, global_batches, make_loader
    from cvl.data.transforms import image_transform

    compose = image_transform(size, train=True)
    split = {
        "worker_resize": split_transform(compose, resize_on_device=False),
        "device_resize": split_transform(compose, resize_on_device=True),
    }
    base = PairDataset.from_shards(shards, transform=compose, tokenize=tok)
    blobs = [_FILES.read(e.shard, e.image) for e in base.entries]
    first = Image.open(io.BytesIO(blobs[0]))
    r: dict = {"image": f"{first.format} {first.width}x{first.height}", "images": len(blobs)}
    n = len(blobs)

    def raw():
        for b in blobs:
            Image.open(io.BytesIO(b)).convert("RGB")

    def raw_transform():
        for b in blobs:
            compose(Image.open(io.BytesIO(b)).convert("RGB"))

    batches = global_batches(n, args.batch, 0, 0, drop_last=False)

    def items(ds):
        def run():
            for b in batches:
                collate([ds[it] for it in b])

        return run

    t_raw = best_time(raw, args.repeats) / n
    t_base = best_time(raw_transform, args.repeats) / n
    r["raw_per_s"] = round(1 / t_raw)
    r["raw_transform_per_s"] = round(1 / t_base)
    r["cvl_compose_per_s"] = round(n / best_time(items(base), args.repeats))
    for name, st in split.items():
        ds = base.with_entries(base.entries)
        ds.transform = st
        t = best_time(items(ds), args.repeats) / n
        r[f"worker_{name}_per_s"] = round(1 / t)
        r[f"{name}_over_raw_transform"] = round(t / t_base, 3)
        made = [collate([ds[it] for it in b]) for b in batches]

        def finish(made=made, st=st):
            for b in made:
                st.finish(dict(b), torch.device("cpu"))

        r[f"finish_cpu_{name}_per_s"] = round(n / best_time(finish, args.repeats))
        if name == "device_resize":
            r["speedup"] = round(t_base / t, 2)
            for w in [int(x) for x in args.workers.split(",") if x]:
                plan = [b for e in range(args.epochs) for b in global_batches(n, args.batch, 0, e)]

                def loader(w=w, plan=plan, ds=ds):
                    for _ in make_loader(ds, plan, num_workers=w):
                        pass

                wall = best_time(loader, args.repeats, cpu=w == 0)
                r[f"loader_w{w}_per_s"] = round(sum(len(b) for b in plan) / wall)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,224", help="synthetic stream image sizes")
    ap.add_argument("--photos", type=int, default=256, help="photo-like 640x480 JPEGs (0: none)")
    ap.add_argument("--photo-size", type=int, default=224, help="model input for the photos")
    ap.add_argument("--n", type=int, default=512, help="synthetic images per size")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", default="", help="DataLoader worker counts to time, e.g. 0,2")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from cvl.data.reader import default_workers
    from cvl.data.tokenizers import build_tokenizer
    from cvl.streams.manifest import load_manifest
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    tok = build_tokenizer({"type": "hash", "vocab_size": 1024, "context_length": 32})
    out: dict = {"batch": args.batch, "default_workers": default_workers()}
    with tempfile.TemporaryDirectory() as tmp:
        for size in [int(s) for s in args.sizes.split(",") if s]:
            root = Path(tmp) / f"s{size}"
            spec = SynthSpec(tasks=1, per_task=args.n, image_size=size, test_per_task=8)
            build_synthetic(root, spec, progress=False)
            m = load_manifest(root)
            shards = [Path(s) for s in m.train_shards(m.task_order[0])]
            out[f"synthetic_{size}px"] = measure(shards, size, args, tok)
        if args.photos:
            shards = photo_shards(Path(tmp) / "photos", args.photos)
            out[f"photos_{args.photo_size}px"] = measure(shards, args.photo_size, args, tok)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
