"""Tiny fake trees of the 11 MTIL datasets in torchvision's download layouts (written the way
torchvision's dataset classes read them), and image-folder trees, for the builder tests."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

RNG = np.random.default_rng(0)


def image(path: Path, size: int = 12) -> Path:
    """A small random RGB JPEG at `path` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(RNG.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(path)
    return path


def corrupt(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\xff\xd8 not really a jpeg")
    return path


def image_folders(root: Path, name: str, classes: dict[str, tuple[int, int]]) -> Path:
    """``root/name/{train,test}/CLASS/i.jpg``; `classes`: class -> (n train, n test)."""
    for c, (n_tr, n_te) in classes.items():
        for split, n in (("train", n_tr), ("test", n_te)):
            (root / name / split).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                image(root / name / split / c / f"{i}.jpg")
    return root / name


def _idx(path: Path, arr: np.ndarray) -> None:
    hdr = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    path.write_bytes(hdr + arr.astype(np.uint8).tobytes())


def tv_tree(root: Path, name: str) -> dict:
    """Write dataset `name` in torchvision's layout under `root`; returns what to expect:
    {"classes": [names in label order], "train": n, "test": n (after the code's split)}."""
    from scipy.io import savemat

    if name == "aircraft":
        d = root / "fgvc-aircraft-2013b" / "data"
        (d).mkdir(parents=True)
        (d / "variants.txt").write_text("707-320\nF/A-18\nA300B4\n")
        rows = {
            "train": [("1", "707-320"), ("2", "F/A-18"), ("3", "A300B4")],
            "test": [("4", "F/A-18")],
        }
        for split, rs in rows.items():
            for i, _ in rs:
                image(d / "images" / f"{i}.jpg")
            (d / f"images_variant_{split}.txt").write_text("".join(f"{i} {c}\n" for i, c in rs))
        return {"classes": ["707-320", "F/A-18", "A300B4"], "train": 3, "test": 1}
    if name == "caltech101":
        from cvl.streams.cls_layouts import SPECS

        keys, names = SPECS["caltech101"].fixed_classes()
        d = root / "caltech101" / "101_ObjectCategories"
        image(d / "BACKGROUND_Google" / "image_0001.jpg")
        for k in keys:
            for i in (1, 2):
                image(d / k / f"image_{i:04d}.jpg")
        return {"classes": names, "train": int(0.8 * 202), "test": 202 - int(0.8 * 202)}
    if name == "cifar100":
        d = root / "cifar-100-python"
        d.mkdir(parents=True)
        with open(d / "meta", "wb") as f:
            pickle.dump({"fine_label_names": ["apple", "aquarium_fish"]}, f)
        for split, n in (("train", 4), ("test", 2)):
            data = RNG.integers(0, 255, (n, 3072)).astype(np.uint8)
            with open(d / split, "wb") as f:
                pickle.dump({"data": data, "fine_labels": [i % 2 for i in range(n)]}, f)
        return {"classes": ["apple", "aquarium fish"], "train": 4, "test": 2}
    if name == "dtd":
        d = root / "dtd" / "dtd"
        for split, rows in (
            ("train", ["banded/banded_1.jpg", "bumpy/bumpy_1.jpg"]),
            ("test", ["bumpy/bumpy_2.jpg"]),
        ):
            for r in rows:
                image(d / "images" / r)
            (d / "labels").mkdir(parents=True, exist_ok=True)
            (d / "labels" / f"{split}1.txt").write_text("\n".join(rows) + "\n")
        return {"classes": ["banded", "bumpy"], "train": 2, "test": 1}
    if name == "eurosat":
        from cvl.streams.cls_layouts import SPECS

        keys, names = SPECS["eurosat"].fixed_classes()
        for k in keys:
            for i in range(2):
                image(root / "eurosat" / "2750" / k / f"{k}_{i}.jpg")
        return {"classes": names, "train": 16, "test": 4}
    if name == "flowers":
        from cvl.streams.cls_layouts import SPECS

        d = root / "flowers-102"
        for i in range(1, 5):
            image(d / "jpg" / f"image_{i:05d}.jpg")
        savemat(d / "imagelabels.mat", {"labels": np.array([[1, 2, 102, 1]])})
        savemat(
            d / "setid.mat",
            {"trnid": np.array([[1, 2, 3]]), "tstid": np.array([[4]]), "valid": np.array([[4]])},
        )
        return {"classes": SPECS["flowers"].fixed_classes()[1], "train": 3, "test": 1}
    if name == "food":
        d = root / "food-101"
        for split, m in (
            ("train", {"apple_pie": ["apple_pie/1"], "ramen": ["ramen/2"]}),
            ("test", {"apple_pie": ["apple_pie/3"], "ramen": []}),
        ):
            for rels in m.values():
                for r in rels:
                    image(d / "images" / f"{r}.jpg")
            (d / "meta").mkdir(parents=True, exist_ok=True)
            (d / "meta" / f"{split}.json").write_text(json.dumps(m))
        return {"classes": ["apple pie", "ramen"], "train": 2, "test": 1}
    if name == "mnist":
        d = root / "MNIST" / "raw"
        d.mkdir(parents=True)
        for pre, n in (("train", 12), ("t10k", 4)):
            _idx(d / f"{pre}-images-idx3-ubyte", RNG.integers(0, 255, (n, 28, 28)))
            _idx(d / f"{pre}-labels-idx1-ubyte", np.arange(n) % 10)
        names = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five"]
        return {
            "classes": [*names, "6 - six", "7 - seven", "8 - eight", "9 - nine"],
            "train": 12,
            "test": 4,
        }
    if name == "oxford_pet":
        d = root / "oxford-iiit-pet"
        rows = {
            "trainval": ["Abyssinian_1 1 1 1", "american_bulldog_2 2 2 1"],
            "test": ["Abyssinian_3 1 1 1"],
        }
        for split, rs in rows.items():
            for r in rs:
                image(d / "images" / f"{r.split()[0]}.jpg")
            (d / "annotations").mkdir(parents=True, exist_ok=True)
            (d / "annotations" / f"{split}.txt").write_text("\n".join(rs) + "\n")
        return {"classes": ["Abyssinian", "American Bulldog"], "train": 2, "test": 1}
    if name == "stanford_cars":
        d = root / "stanford_cars"
        (d / "devkit").mkdir(parents=True)
        savemat(
            d / "devkit" / "cars_meta.mat",
            {
                "class_names": np.array(
                    ["AM General Hummer SUV 2000", "Acura RL Sedan 2012"], dtype=object
                )
            },
        )
        tr = np.array(
            [("00001.jpg", 1), ("00002.jpg", 2)], dtype=[("fname", object), ("class", object)]
        )
        te = np.array([("00001.jpg", 2)], dtype=[("fname", object), ("class", object)])
        savemat(d / "devkit" / "cars_train_annos.mat", {"annotations": tr})
        savemat(d / "cars_test_annos_withlabels.mat", {"annotations": te})
        for f in ("00001.jpg", "00002.jpg"):
            image(d / "cars_train" / f)
        image(d / "cars_test" / "00001.jpg")
        return {
            "classes": ["AM General Hummer SUV 2000", "Acura RL Sedan 2012"],
            "train": 2,
            "test": 1,
        }
    if name == "sun397":
        d = root / "SUN397"
        d.mkdir(parents=True)
        (d / "ClassName.txt").write_text("/a/abbey\n/a/apse/indoor\n")
        for i in range(3):
            image(d / "a" / "abbey" / f"sun_a{i}.jpg")
            image(d / "a" / "apse" / "indoor" / f"sun_b{i}.jpg")
        return {"classes": ["abbey", "apse/indoor"], "train": 4, "test": 2}
    raise ValueError(name)
