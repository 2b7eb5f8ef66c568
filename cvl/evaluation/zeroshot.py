"""Zero-shot classification with prompt ensembling (CLIP §3.1.4; IncCLIP's downstream protocol).

Each class gets the mean of the L2-normalised text embeddings of every template filled with
its name, re-normalised; an image is classified by cosine similarity to those class vectors.
Top-k accuracy counts an image as correct when fewer than k *other* classes score >= the true
class (ties pessimistic, as in retrieval). Top-k with k >= the number of classes is reported as
None (it would be 100 by construction).

Class names and templates come from local text files (one per line, `{}` = the class name):
built-in names under `cvl/resources/zeroshot/` (`imagenet`, `simple`, `synthetic`) or a path.
Works on any stream eval set with category labels (class names = the categories) and on a
labelled image folder `DIR/<class>/*.jpg` (class names from `DIR/classnames.txt` when present,
the ImageNet names for the 1,000 WordNet-id folders of ImageNet, else the folder names).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cvl.errors import CvlError
from cvl.progress import progress_bar

RESOURCES = Path(__file__).resolve().parent.parent / "resources" / "zeroshot"
TIE_EPS = 1e-6
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def _read_lines(path: Path) -> list[str]:
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def resource_path(spec: str, kind: str) -> Path:
    """A built-in resource (`imagenet` -> imagenet_<kind>.txt) or a user file path."""
    p = Path(spec)
    if p.is_file():
        return p
    builtin = RESOURCES / f"{spec}_{kind}.txt"
    if builtin.is_file():
        return builtin
    names = sorted(f.name.rsplit("_", 1)[0] for f in RESOURCES.glob(f"*_{kind}.txt"))
    raise CvlError(f"{kind}: '{spec}' is neither a file nor a built-in name ({', '.join(names)})")


def load_templates(spec: str) -> list[str]:
    """Prompt templates; each must contain one `{}`."""
    path = resource_path(spec, "templates")
    t = _read_lines(path)
    bad = [x for x in t if x.count("{}") != 1]
    if not t or bad:
        raise CvlError(
            f"{path}: every template needs exactly one '{{}}' (bad: {bad[:1] or 'empty file'})"
        )
    return t


def load_classnames(spec: str) -> list[str]:
    """Class names, one per line, in class-index order."""
    path = resource_path(spec, "classnames")
    names = _read_lines(path)
    if not names:
        raise CvlError(f"{path}: no class names")
    return names


@torch.no_grad()
def class_embeddings(
    model: Any,
    classnames: Sequence[str],
    templates: Sequence[str],
    batch_size: int = 256,
    precision: str = "no",
) -> torch.Tensor:
    """[C, D] prompt-ensembled, L2-normalised class embeddings (on the model's device;
    `precision` as `embed_dataset`'s; float32 on the CPU)."""
    from cvl.evaluation.embed import autocast

    device = next(model.parameters()).device
    prompts = [t.format(c) for c in classnames for t in templates]
    feats = []
    with autocast(device, precision):
        for s in range(0, len(prompts), batch_size):
            tok = model.tokenizer(prompts[s : s + batch_size]).to(device)
            f = model.encode_text(tok).float()
            feats.append(torch.nn.functional.normalize(f, dim=-1).cpu())
    f = torch.cat(feats).view(len(classnames), len(templates), -1).mean(1)
    return torch.nn.functional.normalize(f, dim=-1)


def grouped_class_embeddings(
    model: Any,
    classnames: Sequence[str],
    templates: Sequence[Sequence[str]],
    batch_size: int = 256,
    precision: str = "no",
) -> torch.Tensor:
    """`class_embeddings` where each class has its own templates (one ensemble per class:
    e.g. each MTIL dataset's): classes sharing a template list are embedded together."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, t in enumerate(templates):
        groups.setdefault(tuple(t), []).append(i)
    out: torch.Tensor | None = None
    for ts, idx in groups.items():
        f = class_embeddings(model, [classnames[i] for i in idx], ts, batch_size, precision)
        if out is None:
            out = f.new_zeros(len(classnames), f.shape[1])
        out[idx] = f
    if out is None:
        raise CvlError("no classes to embed")
    return out


def labels_to_indices(categories: Sequence[Any], classnames: Sequence[str]) -> torch.Tensor:
    """Class index per item (-1 when its category is not among the class names)."""
    idx = {c: i for i, c in enumerate(classnames)}
    return torch.tensor(
        [idx.get(str(c), -1) if c is not None else -1 for c in categories], dtype=torch.long
    )


def topk_accuracy(
    scores: torch.Tensor, labels: torch.Tensor, ks: Sequence[int] = (1, 5)
) -> dict[str, Any]:
    """Top-k accuracy (percent) of [N, C] scores; labels -1 are skipped."""
    keep = labels >= 0
    s, y = scores[keep].float(), labels[keep]
    n, c = s.shape
    out: dict[str, Any] = {"n": int(n), "n_skipped": int((~keep).sum()), "n_classes": int(c)}
    if n == 0:
        for k in ks:
            out[f"top{k}"] = None
        return out
    true = s.gather(1, y[:, None])
    beats = (s >= true - TIE_EPS).sum(1) - 1  # other classes scoring >= the true one
    for k in ks:
        out[f"top{k}"] = 100.0 * float((beats < k).float().mean()) if k < c else None
    return out


def zeroshot_classify(
    image_features: torch.Tensor,
    categories: Sequence[Any],
    class_features: torch.Tensor,
    classnames: Sequence[str],
    ks: Sequence[int] = (1, 5),
) -> dict[str, Any]:
    """Zero-shot top-k of embedded images against class embeddings."""
    labels = labels_to_indices(categories, classnames)
    scores = torch.nn.functional.normalize(image_features.float(), dim=-1) @ class_features.t()
    return topk_accuracy(scores, labels, ks)


# -- labelled image folders ----------------------------------------------------------------
_WNID = re.compile(r"^n\d{8}$")


def scan_image_folder(folder: str | Path) -> tuple[list[Path], list[int], list[str]]:
    """Images and class indices of `folder/<class>/*`, and the class names."""
    root = Path(folder)
    if not root.is_dir():
        raise CvlError(f"{root}: not a folder (expected FOLDER/<class>/<image>)")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise CvlError(f"{root}: no class sub-folders (expected FOLDER/<class>/<image>)")
    paths, labels = [], []
    for ci, c in enumerate(classes):
        for f in sorted((root / c).rglob("*")):
            if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES:
                paths.append(f)
                labels.append(ci)
    if not paths:
        raise CvlError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) in the class folders")
    names_file = root / "classnames.txt"
    if names_file.is_file():
        names = _read_lines(names_file)
        if len(names) != len(classes):
            raise CvlError(f"{names_file}: {len(names)} names for {len(classes)} class folders")
    elif len(classes) == 1000 and all(_WNID.match(c) for c in classes):
        names = load_classnames("imagenet")
    else:
        names = [c.replace("_", " ") for c in classes]
    return paths, labels, names


class _FolderItems(torch.utils.data.Dataset):
    """Image files as uint8 tensors (`to_uint8`); a file that fails comes back with its error."""

    def __init__(self, paths: list[Path], to_uint8: Any) -> None:
        self.paths, self.to_uint8 = paths, to_uint8

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from cvl.data.images import open_image

        try:
            with open_image(self.paths[i]) as im:  # MAX_PIXELS checked from the header
                return {"image": self.to_uint8(im.convert("RGB"))}
        except Exception as e:  # a corrupt file is a user problem worth naming
            return {"image": None, "error": f"{self.paths[i]}: cannot read image ({e})"}


@torch.no_grad()
def embed_images(
    model: Any,
    paths: list[Path],
    batch_size: int = 256,
    accelerator: Any = None,
    progress: bool = False,
    *,
    device: torch.device | None = None,
    num_workers: int = 0,
    precision: str = "no",
    store: Any = None,
) -> torch.Tensor:
    """Image embeddings of files (each rank embeds a contiguous part; gathered in order).

    Decoded like `embed_dataset`'s sets: uint8 in `num_workers` processes, normalised on the
    device, kept in `store` (an `ImageStore`) for the next checkpoint when they fit."""
    from cvl.data.transforms import EvalTransform
    from cvl.evaluation.embed import _gather_rows_var, autocast, placement
    from cvl.evaluation.imagestore import ImageBatches

    rank, world, device, pin = placement(model, accelerator, device)
    tf = EvalTransform(model.image_size)
    key = None
    if store is not None:
        key = store.key("folder", repr(tf.to_uint8), rank, world, [str(p) for p in paths])
    batches = ImageBatches(
        _FolderItems(paths, tf.to_uint8), batch_size, rank, world, num_workers, pin, store, key
    )
    out = []
    with autocast(device, precision):
        for b in progress_bar(batches, desc="images", show=progress and rank == 0, leave=False):
            if b["image"] is not None:
                x = tf.normalize(b["image"].to(device, non_blocking=pin))
                out.append(model.encode_image(x).float())  # on the device until the end
    if batches.errors:
        raise CvlError(batches.errors[0])
    local = torch.cat(out).cpu() if out else torch.zeros(0, model.embed_dim)
    return _gather_rows_var(local, accelerator) if world > 1 else local


def zeroshot_folder(
    model: Any,
    folder: str | Path,
    templates: Sequence[str],
    batch_size: int = 256,
    accelerator: Any = None,
    progress: bool = False,
    **embed_kw: Any,
) -> dict[str, Any]:
    """Zero-shot top-1/top-5 of a model on a labelled image folder (`embed_kw`: `device`,
    `num_workers`, `precision`, `store` of `embed_images`)."""
    paths, labels, names = scan_image_folder(folder)
    feats = embed_images(model, paths, batch_size, accelerator, progress, **embed_kw)
    cls = class_embeddings(model, names, templates, batch_size, embed_kw.get("precision", "no"))
    scores = torch.nn.functional.normalize(feats, dim=-1) @ cls.t()
    return topk_accuracy(scores, torch.tensor(labels), (1, 5))
