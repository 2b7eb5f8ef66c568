#!/usr/bin/env python3
"""C-CLIP's datasets in cvl's formats (datasets/cclip.md); pyarrow for the parquet files.

`table NAME`: one of C-CLIP's six caption datasets from the Hugging Face hub (a local copy of
the dataset repository: `huggingface-cli download --repo-type dataset REPO --local-dir DIR`)
as image files and one JSONL row per pair (path, caption, split) for `cvl build-stream
table`. The hub repository, image and caption columns, and the split (the hub's own train /
test files, or a seeded random share of its only split) are those of the public C-CLIP
re-implementation KoyoImai/C-CLIP (`c_clip/dataset.py` `_HF_CONFIG`):

    python recipes/cclip_table.py table pets --hf hf/oxford-iiit-pet-vl-enriched --out tables/pets
    cvl build-stream table --input tables/pets/pairs.jsonl --url-col path --caption-col caption \\
        --split-col split --out streams/pets

`folder`: a classification dataset (hub parquet with an image and a label column) as an image
folder for `cvl eval --zeroshot-folder` (FOLDER/<class index>/<image>, classnames.txt in
class order; the names from the parquet's Hugging Face features, else --classnames FILE):

    python recipes/cclip_table.py folder --hf hf/cifar10 --split test --image-col img \\
        --label-col label --out heldout/cifar10

`stream-folder`: the labelled images of a cvl stream's eval set (one task) as such a folder
(the recipe's smoke mode: a synthetic domain never trained on stands in for a classification
set):

    python recipes/cclip_table.py stream-folder --stream S --set test --task t8 --out heldout/t8
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

# name -> (hub repository, image column, caption column, train share of a single split or None
# for the hub's own train/test files)
SPECS: dict[str, tuple[str, str, str, float | None]] = {
    "pets": ("visual-layer/oxford-iiit-pet-vl-enriched", "image", "caption_enriched", None),
    "lexica": ("vera365/lexica_dataset", "image", "prompt", None),
    "simpsons": ("Norod78/simpsons-blip-captions", "image", "text", 0.8),
    "wikiart": ("fusing/wikiart_captions", "image", "text", 0.8),
    "kream": ("hahminlew/kream-product-blip-captions", "image", "text", 0.5),
    "sketch": ("zoheb/sketch-scene", "image", "text", 0.8),
}
SPLIT_NAMES = {"train": "train", "test": "test", "validation": "val", "val": "val"}


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def parquet_files(root: Path) -> dict[str, list[Path]]:
    """The repository's parquet files by split, from their names (`train-00000-of-00002...`)."""
    out: dict[str, list[Path]] = {}
    for f in sorted(root.rglob("*.parquet")):
        m = re.match(r"([a-z]+)", f.name)
        split = SPLIT_NAMES.get(m.group(1) if m else "", None)
        if split is None and f.parent.name in SPLIT_NAMES:
            split = SPLIT_NAMES[f.parent.name]
        if split is not None:
            out.setdefault(split, []).append(f)
    if not out:
        fail(f"{root}: no train/test/validation parquet files (a hub dataset repository)")
    return out


def image_bytes(value: object) -> tuple[bytes, str] | None:
    """(bytes, suffix) of a hub Image value ({'bytes', 'path'}) or raw bytes; None if empty."""
    data, path = (value.get("bytes"), value.get("path")) if isinstance(value, dict) else (value, "")
    if not data:
        return None
    suffix = Path(path or "").suffix.lower()
    if suffix not in (".jpg", ".jpeg", ".png", ".webp", ".bmp"):
        suffix = ".png" if data[:8] == b"\x89PNG\r\n\x1a\n" else ".jpg"
    return bytes(data), suffix


def rows(files: list[Path], columns: list[str]) -> Iterator[dict]:
    import pyarrow.parquet as pq

    for f in files:
        pf = pq.ParquetFile(f)
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            fail(f"{f}: no column(s) {missing} (columns: {', '.join(pf.schema_arrow.names)})")
        for batch in pf.iter_batches(batch_size=256, columns=columns):
            yield from batch.to_pylist()


def n_rows(files: list[Path]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def table(args: argparse.Namespace) -> None:
    repo, img_col, cap_col, share = SPECS[args.name]
    img_col, cap_col = args.image_col or img_col, args.caption_col or cap_col
    files = parquet_files(Path(args.hf))
    if share is None:
        if "train" not in files or "test" not in files:
            fail(f"{args.hf}: {args.name} ({repo}) needs its train and test files")
        plan = [(s, files[s]) for s in ("train", "test")]
        assign = None
    else:  # one split, cut at random (seeded) into a train share and the test rest
        only = files.get("train") or next(iter(files.values()))
        plan = [("train", only)]
        n = n_rows(only)
        order = list(range(n))
        random.Random(args.seed).shuffle(order)
        test = set(order[round(n * share) :])
        assign = lambda i: "test" if i in test else "train"  # noqa: E731
    out = Path(args.out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    i = 0
    with open(out / "pairs.jsonl", "w", encoding="utf-8") as f:
        for split, fs in plan:
            for r in rows(fs, [img_col, cap_col]):
                cap, img = r[cap_col], image_bytes(r[img_col])
                s = assign(i) if assign else split
                i += 1
                if not isinstance(cap, str) or img is None:
                    counts["dropped"] = counts.get("dropped", 0) + 1
                    continue
                path = f"images/{i - 1:07d}{img[1]}"
                (out / path).write_bytes(img[0])
                rec = {"id": f"{args.name}-{i - 1:07d}", "path": path, "caption": cap, "split": s}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                counts[s] = counts.get(s, 0) + 1
    print(json.dumps({"dataset": args.name, "repo": repo, **counts}))


def class_names(path: Path, label_col: str) -> list[str] | None:
    """ClassLabel names of `label_col` from a hub parquet's features metadata, if present."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).schema_arrow.metadata or {}
    try:
        feats = json.loads(meta[b"huggingface"])["info"]["features"]
        return list(feats[label_col]["names"])
    except (KeyError, TypeError, ValueError):
        return None


def folder(args: argparse.Namespace) -> None:
    files = parquet_files(Path(args.hf)).get(args.split)
    if not files:
        fail(f"{args.hf}: no '{args.split}' parquet files")
    names = (
        Path(args.classnames).read_text(encoding="utf-8").splitlines()
        if args.classnames
        else class_names(files[0], args.label_col)
    )
    if not names:
        fail(f"{files[0]}: no class names in its metadata: pass --classnames FILE")
    out = Path(args.out)
    n = 0
    for i, r in enumerate(rows(files, [args.image_col, args.label_col])):
        img = image_bytes(r[args.image_col])
        if img is None:
            continue
        d = out / f"{int(r[args.label_col]):04d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:07d}{img[1]}").write_bytes(img[0])
        n += 1
    write_names(out, names)
    print(json.dumps({"folder": str(out), "images": n, "classes": len(names)}))


def write_names(out: Path, names: list[str]) -> None:
    """classnames.txt for the class folders present, in their (sorted) order."""
    present = sorted(d.name for d in out.iterdir() if d.is_dir())
    (out / "classnames.txt").write_text("\n".join(names[int(c)] for c in present) + "\n")


def stream_folder(args: argparse.Namespace) -> None:
    stream = Path(args.stream)
    m = json.loads((stream / "stream.json").read_text())
    try:
        shards = m["eval_sets"][args.set]["tasks"][args.task]["shards"]
    except KeyError:
        fail(f"{stream}: no eval set '{args.set}' for task '{args.task}'")
    files = shards["files"] if isinstance(shards, dict) else shards
    samples: dict[str, dict] = {}
    for s in files:
        with tarfile.open(stream / s) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.rpartition(".")
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    names = sorted({json.loads(v["json"]).get("category") for v in samples.values()} - {None})
    out = Path(args.out)
    for key, v in sorted(samples.items()):
        cat = json.loads(v["json"]).get("category")
        ext = next((e for e in ("jpg", "png", "jpeg", "webp") if e in v), None)
        if cat is None or ext is None:
            continue
        d = out / f"{names.index(cat):04d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{Path(key).name}.{ext}").write_bytes(v[ext])
    write_names(out, names)
    print(json.dumps({"folder": str(out), "images": len(samples), "classes": len(names)}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="a caption dataset as images + pairs.jsonl")
    t.add_argument("name", choices=sorted(SPECS))
    t.add_argument("--hf", required=True, help="local copy of the hub dataset repository")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0, help="the random train/test cut [0]")
    t.add_argument("--image-col", default=None)
    t.add_argument("--caption-col", default=None, help="e.g. a BLIP-2 caption column")
    f = sub.add_parser("folder", help="a classification dataset as a zero-shot folder")
    f.add_argument("--hf", required=True)
    f.add_argument("--split", default="test")
    f.add_argument("--image-col", default="image")
    f.add_argument("--label-col", default="label")
    f.add_argument("--classnames", default=None, help="one class name per line, label order")
    f.add_argument("--out", required=True)
    s = sub.add_parser("stream-folder", help="a stream's labelled eval images as a folder")
    s.add_argument("--stream", required=True)
    s.add_argument("--set", default="test")
    s.add_argument("--task", required=True)
    s.add_argument("--out", required=True)
    a = p.parse_args(argv)
    {"table": table, "folder": folder, "stream-folder": stream_folder}[a.cmd](a)


if __name__ == "__main__":
    main()
