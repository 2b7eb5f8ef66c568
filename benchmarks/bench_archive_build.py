"""Build throughput of the archive sources (images/s): Karpathy JSON + files, EC base64 TSVs.

Writes N photo-like JPEGs (default 640x480, COCO's typical size; smooth gradients plus noise so
they compress like photos) as a Karpathy dataset and as MUGE TSVs, then times
`cvl build-stream coco` (1 and 2 processes) and `cvl build-stream ec` at the default
--image-size 256. Prints one JSON object: images/s of each build, and the ratios EC / COCO and
2 processes / 1 (ratios inside one process survive a busy machine better than absolute numbers).

    python benchmarks/bench_archive_build.py --images 600
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


def photo(i: int, w: int, h: int) -> bytes:
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = rng.uniform(0, 255, 3)
    img = np.stack(
        [base[c] * 0.5 + 60 * np.sin(x / (17 + 5 * c) + i) + 60 * np.cos(y / 23) for c in range(3)],
        -1,
    )
    img += rng.normal(0, 12, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write(root: Path, n: int, w: int, h: int) -> None:
    (root / "coco" / "val2014").mkdir(parents=True)
    (root / "ec").mkdir()
    images = []
    with (
        open(root / "ec" / "T2I_train.text.tsv", "w", encoding="utf-8") as t,
        open(root / "ec" / "T2I_train.img.tsv", "w", encoding="ascii") as im,
    ):
        for i in range(n):
            data = photo(i, w, h)
            name = f"COCO_val2014_{i:012d}.jpg"
            (root / "coco" / "val2014" / name).write_bytes(data)
            caps = [f"a photo number {i} caption {k}" for k in range(5)]
            images.append(
                {
                    "filepath": "val2014",
                    "filename": name,
                    "cocoid": i,
                    "split": "train",
                    "sentences": [{"raw": c} for c in caps],
                }
            )
            t.write(f"{i}\t商品 {i} 的描述\n")
            im.write(f"{i}\t{base64.b64encode(data).decode()}\n")
    (root / "coco" / "dataset_coco.json").write_text(json.dumps({"images": images}))


def timed(argv: list[str]) -> float:
    from cvl.cli import main

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # keep stdout one JSON object
        rc = main(argv)
    if rc != 0:
        sys.exit(f"build failed: {argv}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=480)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        write(root, a.images, a.width, a.height)
        mb = sum(p.stat().st_size for p in (root / "coco" / "val2014").iterdir()) / 2**20
        coco = ["build-stream", "coco", "--json", str(root / "coco" / "dataset_coco.json")]
        coco += ["--images", str(root / "coco"), "--quiet"]
        timed([*coco, "--out", str(root / "warm"), "--max-train", "20"])  # imports, caches
        t1 = timed([*coco, "--out", str(root / "c1")])
        t2 = timed([*coco, "--out", str(root / "c2"), "--processes", "2"])
        ec = ["build-stream", "ec", "--data", str(root / "ec"), "--quiet"]
        te = timed([*ec, "--out", str(root / "e")])
    n = a.images
    print(
        json.dumps(
            {
                "images": n,
                "source_size": f"{a.width}x{a.height}",
                "source_mb": round(mb, 1),
                "image_size": 256,
                "coco_images_per_s_1proc": round(n / t1, 1),
                "coco_images_per_s_2proc": round(n / t2, 1),
                "ec_images_per_s_1proc": round(n / te, 1),
                "ratio_ec_vs_coco": round(t1 / te, 3),
                "ratio_2proc_vs_1proc": round(t1 / t2, 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
