"""Classification datasets on disk: the 11 MTIL datasets in torchvision's download layouts and
any dataset in the plain image-folder layout, read into class lists and labelled image lists.

Two layouts per dataset, looked for under one data folder ``ROOT`` (the ZSCL code passes one
``--data-location`` to every torchvision class):

- **image folders** (any dataset): ``ROOT/NAME/{train,test}/CLASS/*.jpg`` (also .jpeg, .png,
  .webp, .bmp); for Caltech-101, EuroSAT and SUN397, which the code splits itself,
  ``ROOT/NAME/CLASS/*.jpg`` as one pool is accepted too. ``NAME`` is the cvl task name or one
  of its aliases (``Aircraft``, ``fgvc_aircraft``, ...). A class folder is matched to the
  dataset's classes by its key (Caltech-101 / EuroSAT folder names, Flowers' 1-based label,
  MNIST's digit) or its name; for the other MTIL datasets and any unknown dataset the folder
  name *is* the class (``_`` read as a space, as the code's ``process_labels``).
- **torchvision's layout**, as torchvision's dataset classes read it (their source was read,
  torchvision 0.29): ``ROOT/fgvc-aircraft-2013b/``, ``ROOT/caltech101/``,
  ``ROOT/cifar-100-python/``, ``ROOT/dtd/dtd/``, ``ROOT/eurosat/2750/``, ``ROOT/flowers-102/``,
  ``ROOT/food-101/``, ``ROOT/MNIST/raw/``, ``ROOT/oxford-iiit-pet/``, ``ROOT/stanford_cars/``,
  ``ROOT/SUN397/``. The splits are the code's: Aircraft ``train`` / ``test`` (not trainval),
  DTD partition 1 ``train`` / ``test``, Flowers ``train`` / ``test``, Pets ``trainval`` /
  ``test``, Cars, Food, CIFAR-100, MNIST ``train`` / ``test``; Caltech-101, EuroSAT and SUN397
  are one pool split 80 / 20 by ``torch.utils.data.random_split`` with a generator seeded 42
  (`zscl_split`, the same permutation), over torchvision's sample order. SUN397: torchvision
  lists ``rglob("sun_*.jpg")`` unsorted (file-system order), so the code's split is not the same
  on two machines; here the paths are sorted first (reproducible, not bit-equal to a given run).

Nothing is guessed: a listed file that does not exist is a counted ``missing_file``, an image
that does not decode is dropped by the stream builder (``bad_image``), and a class without any
image is a one-line error. CIFAR-100's pickles are read with an unpickler that only builds
dicts, lists, strings, numbers and numpy arrays; MNIST's IDX files are parsed directly;
Flowers' and Cars' ``.mat`` files need scipy (installed with scikit-learn).
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cvl.errors import CvlError

RESOURCES = Path(__file__).resolve().parent.parent / "resources" / "mtil"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
SPLIT_RATIO, SPLIT_SEED = 0.8, 42  # the code's split_dataset(ratio=0.8), manual_seed(42)


@dataclass
class Sample:
    """One labelled image: a file, or encoded bytes (CIFAR / MNIST arrays)."""

    id: str
    label: int
    split: str  # train | test
    path: str | None = None
    data: bytes | None = None


@dataclass
class Listing:
    """A dataset as read: class keys and names in label order, its samples, what was missing."""

    keys: list[str]
    names: list[str]
    samples: list[Sample]
    layout: str
    missing: list[str] = field(default_factory=list)  # listed files that are not there
    split_rule: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """An MTIL dataset: its cvl name, the code's class name, folder aliases, whether the code
    splits it itself, and its torchvision reader."""

    name: str
    title: str
    aliases: tuple[str, ...]
    tv_marker: str  # a path under ROOT that only torchvision's layout has
    pooled: bool = False

    def templates(self) -> list[str]:
        from cvl.evaluation.zeroshot import load_templates

        return load_templates(str(RESOURCES / f"{self.name}_templates.txt"))

    def fixed_classes(self) -> tuple[list[str], list[str]] | None:
        """(keys, names) of the datasets with a class list of their own (`*_classes.tsv`)."""
        p = RESOURCES / f"{self.name}_classes.tsv"
        if not p.is_file():
            return None
        pairs = [ln.split("\t", 1) for ln in p.read_text(encoding="utf-8").splitlines() if ln]
        return [k for k, _ in pairs], [v for _, v in pairs]


SPECS: dict[str, DatasetSpec] = {
    s.name: s
    for s in (
        DatasetSpec("aircraft", "Aircraft", ("fgvc_aircraft",), "fgvc-aircraft-2013b/data"),
        DatasetSpec(
            "caltech101", "Caltech101", ("caltech-101",), "caltech101/101_ObjectCategories", True
        ),
        DatasetSpec("cifar100", "CIFAR100", ("cifar-100",), "cifar-100-python/meta"),
        DatasetSpec("dtd", "DTD", ("describable_textures",), "dtd/dtd/labels"),
        DatasetSpec("eurosat", "EuroSAT", (), "eurosat/2750", True),
        DatasetSpec(
            "flowers", "Flowers", ("flowers102", "oxford_flowers"), "flowers-102/setid.mat"
        ),
        DatasetSpec("food", "Food", ("food101",), "food-101/meta"),
        DatasetSpec("mnist", "MNIST", (), "MNIST/raw"),
        DatasetSpec(
            "oxford_pet", "OxfordPet", ("oxford_pets", "pets"), "oxford-iiit-pet/annotations"
        ),
        DatasetSpec("stanford_cars", "StanfordCars", ("cars",), "stanford_cars/devkit"),
        DatasetSpec("sun397", "SUN397", (), "SUN397/ClassName.txt", True),
    )
}


def spec_of(name: str) -> DatasetSpec | None:
    """The MTIL dataset a name refers to (cvl name, the code's class name or an alias)."""
    n = name.strip().lower().replace("-", "_")
    for s in SPECS.values():
        if n in {s.name, s.title.lower(), *(a.lower().replace("-", "_") for a in s.aliases)}:
            return s
    return None


def underline_to_space(s: str) -> str:
    """The code's `process_labels`."""
    return s.replace("_", " ")


def zscl_split(n: int) -> tuple[list[int], list[int]]:
    """The code's `split_dataset`: `random_split(range(n), [int(0.8 n), rest], Generator(42))`
    (torch draws `randperm(n)` and cuts it): (train indices, test indices) in that order."""
    import torch

    n_train = int(SPLIT_RATIO * n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    return perm[:n_train], perm[n_train:]


def _pool(samples: list[Sample]) -> list[Sample]:
    """Split a pool (in torchvision's order) into the code's train / test."""
    tr, te = zscl_split(len(samples))
    for i in tr:
        samples[i].split = "train"
    for i in te:
        samples[i].split = "test"
    return [samples[i] for i in tr] + [samples[i] for i in te]


def _files(folder: Path) -> list[Path]:
    return sorted(
        f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
    )


def _file(base: Path, rel: str, split: str, label: int, out: Listing, sid: str) -> None:
    """A sample listed by a split file; counted as missing when the file is not there."""
    p = base / rel
    if p.is_file():
        out.samples.append(Sample(sid, label, split, path=str(p)))
    else:
        out.missing.append(str(p))


def _need(p: Path, what: str) -> Path:
    if not p.exists():
        raise CvlError(f"{what}: {p} not found")
    return p


# -- image folders ------------------------------------------------------------------------------
def _match_classes(
    ds: str, folders: list[str], spec: DatasetSpec | None
) -> tuple[list[str], list[str], dict[str, int]]:
    """(keys, names, folder -> label) for class folders; unknown folders are an error."""
    fixed = spec.fixed_classes() if spec else None
    if fixed is None:
        keys = sorted(folders)
        return keys, [underline_to_space(k) for k in keys], {k: i for i, k in enumerate(keys)}
    keys, names = fixed
    norm = lambda s: " ".join(s.replace("_", " ").split()).lower()  # noqa: E731
    lookup = {k: i for i, k in enumerate(keys)}
    for i, n in enumerate(names):
        lookup.setdefault(n, i)
        lookup.setdefault(norm(n), i)
    where = {}
    for f in folders:
        i = lookup.get(f, lookup.get(norm(f)))
        if i is None:
            raise CvlError(
                f"{ds}: class folder '{f}' is not one of its {len(keys)} classes "
                f"(folder = key such as '{keys[0]}' or name such as '{names[0]}')"
            )
        where[f] = i
    return keys, names, where


def read_image_folders(folder: Path, ds: str, spec: DatasetSpec | None) -> Listing:
    """``folder/{train,test}/CLASS/*`` (or ``folder/CLASS/*`` as the code's pool)."""
    splits = [s for s in ("train", "test") if (folder / s).is_dir()]
    if splits and splits != ["train", "test"]:
        raise CvlError(
            f"{ds}: {folder} has {splits[0]}/ but no {'test' if splits[0] == 'train' else 'train'}/"
        )
    pooled = not splits
    if pooled and not (spec and spec.pooled):
        raise CvlError(f"{ds}: expected {folder}/train/CLASS/ and {folder}/test/CLASS/ folders")
    roots = {"pool": folder} if pooled else {s: folder / s for s in splits}
    per = {
        s: sorted(d.name for d in r.iterdir() if d.is_dir() and not d.name.startswith("."))
        for s, r in roots.items()
    }
    folders = sorted(set().union(*per.values()))
    if not folders:
        raise CvlError(f"{ds}: no class folders in {folder}")
    keys, names, label_of = _match_classes(ds, folders, spec)
    out = Listing(keys, names, [], "image-folder")
    for s, r in roots.items():
        for f in per[s]:
            for p in _files(r / f):
                sid = f"{ds}-{s}-{len(out.samples):07d}"
                out.samples.append(Sample(sid, label_of[f], "train" if s == "pool" else s, str(p)))
    if pooled:
        out.samples = _pool(out.samples)
        out.split_rule = "the code's 80/20 random_split (seed 42) of the class folders"
    return out


# -- torchvision layouts -----------------------------------------------------------------------
def tv_aircraft(root: Path) -> Listing:
    d = _need(root / "fgvc-aircraft-2013b" / "data", "aircraft")
    keys = [ln.strip() for ln in (d / "variants.txt").read_text().splitlines() if ln.strip()]
    idx = {k: i for i, k in enumerate(keys)}
    out = Listing(keys, [underline_to_space(k) for k in keys], [], "torchvision")
    for split in ("train", "test"):
        for ln in _need(d / f"images_variant_{split}.txt", "aircraft").read_text().splitlines():
            if ln.strip():
                image, label = ln.strip().split(" ", 1)
                _file(d / "images", f"{image}.jpg", split, idx[label], out, f"aircraft-{image}")
    return out


def tv_caltech101(root: Path) -> Listing:
    d = _need(root / "caltech101" / "101_ObjectCategories", "caltech101")
    cats = sorted(p.name for p in d.iterdir() if p.is_dir() and p.name != "BACKGROUND_Google")
    keys, names = SPECS["caltech101"].fixed_classes()  # type: ignore[misc]
    if cats != keys:
        extra = sorted(set(cats) - set(keys)) or sorted(set(keys) - set(cats))
        raise CvlError(f"caltech101: {d} does not hold the 101 categories (differs: {extra[:3]})")
    out = Listing(keys, names, [], "torchvision")
    for i, c in enumerate(cats):
        for p in sorted(f for f in (d / c).iterdir() if f.is_file()):
            out.samples.append(Sample(f"caltech101-{c}-{p.stem}", i, "train", str(p)))
    out.samples = _pool(out.samples)
    out.split_rule = "the code's 80/20 random_split (seed 42)"
    return out


class _ArrayUnpickler(pickle.Unpickler):
    """Builds only plain containers, strings, numbers and numpy arrays (CIFAR's pickles)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name} in a CIFAR pickle")
        return super().find_class(module, name)


def _unpickle(p: Path) -> dict:
    with open(p, "rb") as f:
        try:
            return _ArrayUnpickler(f, encoding="latin1").load()
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise CvlError(f"{p}: not a CIFAR python pickle ({e})") from None


def _png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def tv_cifar100(root: Path) -> Listing:
    d = _need(root / "cifar-100-python", "cifar100")
    keys = list(_unpickle(d / "meta")["fine_label_names"])
    out = Listing(keys, [underline_to_space(k) for k in keys], [], "torchvision")
    for split in ("train", "test"):
        e = _unpickle(_need(d / split, "cifar100"))
        data = np.asarray(e["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        for i, (img, y) in enumerate(zip(data, e["fine_labels"])):
            out.samples.append(Sample(f"cifar100-{split}-{i:05d}", int(y), split, data=_png(img)))
    return out


def tv_dtd(root: Path) -> Listing:
    d = _need(root / "dtd" / "dtd", "dtd")
    rows = {}
    for split in ("train", "test"):
        lines = _need(d / "labels" / f"{split}1.txt", "dtd").read_text().splitlines()
        rows[split] = [ln.strip().split("/") for ln in lines if ln.strip()]
    keys = sorted({c for c, _ in rows["train"]})  # torchvision: the split's own classes
    idx = {k: i for i, k in enumerate(keys)}
    out = Listing(keys, [underline_to_space(k) for k in keys], [], "torchvision")
    for split, rs in rows.items():
        for c, name in rs:
            if c not in idx:
                raise CvlError(f"dtd: class '{c}' of {split}1.txt is not in train1.txt")
            _file(d / "images", f"{c}/{name}", split, idx[c], out, f"dtd-{Path(name).stem}")
    return out


def tv_eurosat(root: Path) -> Listing:
    d = _need(root / "eurosat" / "2750", "eurosat")
    keys, names = SPECS["eurosat"].fixed_classes()  # type: ignore[misc]
    out = Listing(keys, names, [], "torchvision")
    for i, k in enumerate(keys):  # ImageFolder: sorted classes, sorted files
        if not (d / k).is_dir():
            raise CvlError(f"eurosat: class folder {d / k} not found")
        for p in _files(d / k):
            out.samples.append(Sample(f"eurosat-{p.stem}", i, "train", str(p)))
    out.samples = _pool(out.samples)
    out.split_rule = "the code's 80/20 random_split (seed 42)"
    return out


def _loadmat(p: Path) -> dict:
    try:
        from scipy.io import loadmat
    except ImportError:
        raise CvlError(f"{p}: reading .mat files needs scipy (pip install scipy)") from None
    try:
        return loadmat(_need(p, "annotation file"), squeeze_me=True)
    except (ValueError, OSError, TypeError) as e:
        raise CvlError(f"{p}: not a readable .mat file ({e})") from None


def tv_flowers(root: Path) -> Listing:
    d = _need(root / "flowers-102", "flowers")
    keys, names = SPECS["flowers"].fixed_classes()  # type: ignore[misc]
    setid = _loadmat(d / "setid.mat")
    labels = np.atleast_1d(_loadmat(d / "imagelabels.mat")["labels"]).tolist()
    out = Listing(keys, names, [], "torchvision")
    for split, field_ in (("train", "trnid"), ("test", "tstid")):
        for image_id in np.atleast_1d(setid[field_]).tolist():
            y = int(labels[int(image_id) - 1]) - 1
            rel = f"image_{int(image_id):05d}.jpg"
            _file(d / "jpg", rel, split, y, out, f"flowers-{int(image_id):05d}")
    return out


def tv_food(root: Path) -> Listing:
    d = _need(root / "food-101", "food")
    meta = {
        s: json.loads(_need(d / "meta" / f"{s}.json", "food").read_text())
        for s in ("train", "test")
    }
    keys = sorted(meta["train"])
    idx = {k: i for i, k in enumerate(keys)}
    out = Listing(keys, [underline_to_space(k) for k in keys], [], "torchvision")
    for split, m in meta.items():
        for c, rels in m.items():
            for rel in rels:
                sid = "food-" + rel.replace("/", "-")
                _file(d / "images", f"{rel}.jpg", split, idx[c], out, sid)
    return out


def _idx(p: Path, ndim: int) -> np.ndarray:
    """An MNIST IDX file (big-endian dims after a magic number; uint8 data)."""
    raw = _need(p, "mnist").read_bytes()
    if len(raw) < 4 + 4 * ndim or raw[2] != 0x08 or raw[3] != ndim:
        raise CvlError(f"{p}: not an IDX file of uint8 with {ndim} dimension(s)")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise CvlError(f"{p}: {body.size} bytes of data for dimensions {dims} (truncated?)")
    return body.reshape(dims)


def tv_mnist(root: Path) -> Listing:
    d = _need(root / "MNIST" / "raw", "mnist")
    keys, names = SPECS["mnist"].fixed_classes()  # type: ignore[misc]
    out = Listing(keys, names, [], "torchvision")
    for split, pre in (("train", "train"), ("test", "t10k")):
        imgs = _idx(d / f"{pre}-images-idx3-ubyte", 3)
        ys = _idx(d / f"{pre}-labels-idx1-ubyte", 1)
        for i, (img, y) in enumerate(zip(imgs, ys)):
            out.samples.append(Sample(f"mnist-{split}-{i:05d}", int(y), split, data=_png(img)))
    return out


def tv_oxford_pet(root: Path) -> Listing:
    d = _need(root / "oxford-iiit-pet", "oxford_pet")
    rows = {}
    for split in ("trainval", "test"):
        lines = _need(d / "annotations" / f"{split}.txt", "oxford_pet").read_text().splitlines()
        rows[split] = [ln.split()[:2] for ln in lines if ln.strip() and not ln.startswith("#")]
    by_label = {int(y) - 1: iid.rsplit("_", 1)[0] for iid, y in rows["trainval"]}
    keys = [by_label[i] for i in sorted(by_label)]
    names = [" ".join(p.title() for p in k.split("_")) for k in keys]  # torchvision's classes
    out = Listing(keys, names, [], "torchvision")
    for split, rs in rows.items():
        s = "train" if split == "trainval" else "test"
        for iid, y in rs:
            _file(d / "images", f"{iid}.jpg", s, int(y) - 1, out, f"pet-{iid}")
    return out


def tv_stanford_cars(root: Path) -> Listing:
    d = _need(root / "stanford_cars", "stanford_cars")
    keys = [str(c) for c in np.atleast_1d(_loadmat(d / "devkit" / "cars_meta.mat")["class_names"])]
    out = Listing(keys, [underline_to_space(k) for k in keys], [], "torchvision")
    for split, ann, folder in (
        ("train", d / "devkit" / "cars_train_annos.mat", "cars_train"),
        ("test", d / "cars_test_annos_withlabels.mat", "cars_test"),
    ):
        for a in np.atleast_1d(_loadmat(ann)["annotations"]):
            fname = str(a["fname"])
            _file(
                d / folder,
                fname,
                split,
                int(a["class"]) - 1,
                out,
                f"cars-{split}-{Path(fname).stem}",
            )
    return out


def tv_sun397(root: Path) -> Listing:
    d = _need(root / "SUN397", "sun397")
    lines = _need(d / "ClassName.txt", "sun397").read_text().splitlines()
    keys = [c[3:].strip() for c in lines if c.strip()]
    idx = {k: i for i, k in enumerate(keys)}
    out = Listing(keys, [underline_to_space(k) for k in keys], [], "torchvision")
    for p in sorted(d.rglob("sun_*.jpg")):
        c = "/".join(p.relative_to(d).parts[1:-1])
        if c not in idx:
            raise CvlError(f"sun397: {p} is in no class of ClassName.txt ('{c}')")
        out.samples.append(
            Sample(f"sun397-{c.replace('/', '-')}-{p.stem}", idx[c], "train", str(p))
        )
    out.samples = _pool(out.samples)
    out.split_rule = "the code's 80/20 random_split (seed 42) of the sorted file list"
    return out


TORCHVISION: dict[str, Callable[[Path], Listing]] = {
    "aircraft": tv_aircraft,
    "caltech101": tv_caltech101,
    "cifar100": tv_cifar100,
    "dtd": tv_dtd,
    "eurosat": tv_eurosat,
    "flowers": tv_flowers,
    "food": tv_food,
    "mnist": tv_mnist,
    "oxford_pet": tv_oxford_pet,
    "stanford_cars": tv_stanford_cars,
    "sun397": tv_sun397,
}


def read_dataset(root: str | Path, name: str) -> tuple[str, Listing]:
    """(task name, listing) of dataset `name` under `root`: torchvision's layout when its files
    are there (``ROOT/MNIST/raw/``, ...), else the image folders ``ROOT/NAME/`` (any alias)."""
    root = Path(root)
    if name in (".", "..") or any(c in name for c in "/\\\0") or name.startswith("~"):
        raise CvlError(
            f"--datasets {name!r}: a dataset is a name (a folder directly under --data, or an "
            "MTIL name), not a path: no '/', '\\', '..' or '~'"
        )
    spec = spec_of(name)
    task = spec.name if spec else re.sub(r"[^\w\-]+", "_", name).strip("_")
    if not task:
        raise CvlError(f"dataset name {name!r} is empty")
    if spec and (root / spec.tv_marker).exists():
        return task, TORCHVISION[spec.name](root)
    names = [name] + ([spec.name, spec.title, *spec.aliases] if spec else [])
    for n in dict.fromkeys(names):
        for cand in dict.fromkeys((root / n, root / n.lower())):
            if cand.is_dir():
                return task, read_image_folders(cand, task, spec)
    where = f"{root}/{name}/{{train,test}}/CLASS/"
    if spec:
        where += f" or torchvision's {root}/{spec.tv_marker}"
    raise CvlError(f"{task}: not found (looked for {where}; see datasets/mtil.md)")
