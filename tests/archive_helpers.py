"""Tiny real-format archive datasets written by the tests (generated images, no downloads).

- `write_karpathy`: Karpathy-style ``dataset_<name>.json`` + images (``filepath/filename``
  for COCO, flat for Flickr30K / RSICD), 5 distinct captions per image;
- `write_ec`: MUGE ``T2I_{train,val}.{text,img}.tsv`` with Chinese descriptions and base64 JPEGs;
- `write_iapr`: ``images/NN/ID.jpg`` + ``annotations_complete_eng/NN/ID.eng`` in ISO-8859-1.

Each image has its own colour (`colour_of`), so a test can check a sample's pixels came from
the right file. `write_data_root` writes them all in the layout the protocol presets read.
"""

from __future__ import annotations

import base64
import io
import json
import zlib
from pathlib import Path

from PIL import Image

SIZE = (40, 32)
WORDS = ["red", "green", "blue", "small", "large", "round", "square", "dog", "cat", "boat"]


def colour_of(name: str) -> tuple[int, int, int]:
    h = zlib.crc32(name.encode())
    return (30 + h % 190, 30 + (h >> 8) % 190, 30 + (h >> 16) % 190)


def jpeg(name: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", SIZE, colour_of(name)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def captions_of(key: str, n: int = 5) -> list[str]:
    """n distinct captions for image `key` (the key is in each, so they never repeat)."""
    h = zlib.crc32(key.encode())
    return [
        f"a {WORDS[(h + k) % 10]} {WORDS[(h // 7 + 3 * k) % 10]} photo {key} number {k}"
        for k in range(n)
    ]


def write_karpathy(
    root: Path, name: str, splits: dict[str, int], *, filepath: bool = False, start: int = 0
) -> Path:
    """`root/dataset_<name>.json` + images; returns the JSON path. ids start at `start`."""
    root.mkdir(parents=True, exist_ok=True)
    images = []
    i = start
    for split, n in splits.items():
        for _ in range(n):
            sub = ("train2014" if split == "train" else "val2014") if filepath else ""
            fname = f"{name}_{i:06d}.jpg"
            (root / sub).mkdir(parents=True, exist_ok=True)
            (root / sub / fname).write_bytes(jpeg(fname))
            rec = {
                "filename": fname,
                "imgid": i,
                "split": split,
                "sentences": [
                    {"raw": c, "tokens": c.split(), "imgid": i, "sentid": 5 * i + k}
                    for k, c in enumerate(captions_of(fname))
                ],
            }
            if filepath:
                rec["filepath"] = sub
                rec["cocoid"] = 100000 + i
            images.append(rec)
            i += 1
    path = root / f"dataset_{name}.json"
    path.write_text(json.dumps({"images": images, "dataset": name}), encoding="utf-8")
    return path


EC_WORDS = ["连衣裙", "运动鞋", "手机壳", "保温杯", "双肩包", "口红", "台灯", "毛衣"]


def ec_text(i: int) -> str:
    return f"{EC_WORDS[i % len(EC_WORDS)]}女款{i}号 新款 时尚"


def write_ec(root: Path, n_train: int, n_val: int) -> Path:
    """MUGE ECommerce-T2I TSVs (headerless; id TAB text / id TAB base64 JPEG)."""
    root.mkdir(parents=True, exist_ok=True)
    for stem, n, off in (("T2I_train", n_train, 0), ("T2I_val", n_val, 100000)):
        with (
            open(root / f"{stem}.text.tsv", "w", encoding="utf-8") as t,
            open(root / f"{stem}.img.tsv", "w", encoding="ascii") as im,
        ):
            for i in range(off, off + n):
                t.write(f"{i}\t{ec_text(i)}\n")
                im.write(f"{i}\t{base64.b64encode(jpeg(f'ec{i}')).decode()}\n")
    return root


IAPR_WORDS = ["café", "señora", "plaza", "montaña", "niño", "façade", "église", "río"]


def iapr_desc(i: int) -> str:
    a, b = IAPR_WORDS[i % 8], IAPR_WORDS[(i * 3 + 1) % 8]
    return f"a {a} near the {b} in picture {i}; people walking"


def write_iapr(root: Path, n: int, per_folder: int = 10) -> Path:
    """IAPR TC-12 layout, annotations in ISO-8859-1 (accents are single bytes)."""
    for i in range(n):
        nn = f"{i // per_folder:02d}"
        (root / "images" / nn).mkdir(parents=True, exist_ok=True)
        (root / "annotations_complete_eng" / nn).mkdir(parents=True, exist_ok=True)
        (root / "images" / nn / f"{1000 + i}.jpg").write_bytes(jpeg(f"iapr{1000 + i}"))
        doc = (
            f"<DOC>\n<DOCNO>annotations/{nn}/{1000 + i}.eng</DOCNO>\n<TITLE>Title {i}</TITLE>\n"
            f"<DESCRIPTION>{iapr_desc(i)};</DESCRIPTION>\n<NOTES></NOTES>\n"
            f"<LOCATION>Cusco, Perú</LOCATION>\n<DATE>March 2002</DATE>\n"
            f"<IMAGE>images/{nn}/{1000 + i}.jpg</IMAGE>\n"
            f"<THUMBNAIL>thumbnails/{nn}/{1000 + i}.jpg</THUMBNAIL>\n</DOC>\n"
        )
        (root / "annotations_complete_eng" / nn / f"{1000 + i}.eng").write_bytes(
            doc.encode("iso-8859-1")
        )
    return root


# Sizes of the shared raw-data fixture (what the protocol presets read).
COCO = {"train": 14, "restval": 4, "val": 5, "test": 6}
F30K = {"train": 15, "val": 5, "test": 5}
RSICD = {"train": 8, "val": 3, "test": 4}
EC_N = (15, 6)
IAPR_N = 16


def write_data_root(root: Path) -> Path:
    """The --data layout of `cvl build-stream protocol` with every archive source."""
    write_karpathy(root / "coco", "coco", COCO, filepath=True)
    write_karpathy(root / "flickr30k" / "flickr30k-images", "flickr30k", F30K, start=5000)
    (root / "flickr30k" / "flickr30k-images" / "dataset_flickr30k.json").rename(
        root / "flickr30k" / "dataset_flickr30k.json"
    )
    write_karpathy(root / "rsicd" / "RSICD_images", "rsicd", RSICD, start=9000)
    (root / "rsicd" / "RSICD_images" / "dataset_rsicd.json").rename(
        root / "rsicd" / "dataset_rsicd.json"
    )
    write_ec(root / "ec", *EC_N)
    write_iapr(root / "iapr" / "iaprtc12", IAPR_N)
    return root


FAST = ["--image-size", "32", "--quiet"]
