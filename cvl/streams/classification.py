"""`cvl build-stream classification`: labelled image datasets as a stream, one task per dataset
(MTIL, MTIL-FS and X-TAIL; ZSCL, MoE-Adapters4CL, RAIL).

Each dataset (read by `cls_layouts.read_dataset`: torchvision's download layout, or image
folders ``ROOT/NAME/{train,test}/CLASS/``) becomes a task. A training pair is an image and its
class's **training caption**, the dataset's first template filled with the class name (the
ZSCL code trains with ``dataset.template`` = ``templates[0]``); every sample keeps its label:
KEY.json ``category`` = ``TASK/CLASS NAME`` (unique across datasets), ``label`` (the class
index) and ``class``. The test sets are the eval set ``test`` (kind pairs, same captions).

The manifest carries the label space: each task's ``categories`` (in class-index order) and
``templates`` (all of the dataset's: the zero-shot ensemble), and a ``class_map`` over all the
tasks' classes (``prompts`` = the class names; ``union_templates`` when a protocol classifies
over the union with other templates, X-TAIL). `cvl eval` scores every checkpoint's zero-shot
top-1 on each test set among that dataset's classes (ZS-top1: the MTIL matrix) and among all
classes of all tasks (ZS-all-top1: X-TAIL), `cvl train --base-loss class-ce` trains on the
current task's class texts.

Protocols (``--protocol``, or `cvl build-stream protocol NAME`):

- ``mtil``: ZSCL's order I, Aircraft → Caltech101 → CIFAR100 → DTD → EuroSAT → Flowers → Food →
  MNIST → OxfordPet → StanfordCars → SUN397 (``scripts/*.sh``), full training splits;
- ``mtil-order2``: ZSCL's order II, StanfordCars → Food → MNIST → OxfordPet → Flowers → SUN397 →
  Aircraft → Caltech101 → DTD → EuroSAT → CIFAR100 (its results notebook's permutation);
- ``mtil-fs``: MoE-Adapters4CL's few-shot MTIL: order I, 5 training images per class (its
  ``--few_shot=5``: the first 5 of each class in a seeded shuffle of the training split);
- ``x-tail``: RAIL's X-TAIL: order I without CIFAR100 (10 domains), 16 training images per class,
  every test image classified among the classes of all 10 domains with the template
  ``a photo of a {}.`` (RAIL's `primal_RAIL.py`), no domain hint.

Few-shot selection (``--shots K``): per class, the first K of a seeded permutation of its
training images (stream ``--seed``), i.e. a uniform random K-subset; neither MoE-Adapters'
(its loader's torch shuffle) nor RAIL's (CoOp's ``random.sample``) draw can be replayed
bit-exactly outside their code. A class with fewer than K images keeps all of them (RAIL's
CoOp code would repeat images to reach K); the build report counts such classes.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from cvl.checks import POSITIVE_INT
from cvl.errors import CvlError
from cvl.streams.cls_layouts import SPECS, Listing, read_dataset
from cvl.streams.manifest import Manifest
from cvl.streams.options import archive_options, build_options, finish
from cvl.streams.pipeline import BuildOptions, ColumnSplit, Dropper, Row, build_stream
from cvl.streams.writer import BuildReport

ORDER_I = [
    "aircraft",
    "caltech101",
    "cifar100",
    "dtd",
    "eurosat",
    "flowers",
    "food",
    "mnist",
    "oxford_pet",
    "stanford_cars",
    "sun397",
]
ORDER_II = [ORDER_I[i] for i in (9, 6, 7, 8, 5, 10, 0, 1, 3, 4, 2)]
DEFAULT_TEMPLATE = "a photo of a {}."


@dataclass(frozen=True)
class ClsProtocol:
    """A classification benchmark: datasets in order, training shots, union-space templates."""

    doc: str
    datasets: tuple[str, ...]
    shots: int | None = None
    union_templates: tuple[str, ...] | None = None


PROTOCOLS: dict[str, ClsProtocol] = {
    "mtil": ClsProtocol("MTIL order I (ZSCL)", tuple(ORDER_I)),
    "mtil-order2": ClsProtocol("MTIL order II (ZSCL)", tuple(ORDER_II)),
    "mtil-fs": ClsProtocol("MTIL few-shot (MoE-Adapters4CL): 5 shots per class", tuple(ORDER_I), 5),
    "x-tail": ClsProtocol(
        "X-TAIL (RAIL): order I without CIFAR100, 16 shots, union label space",
        tuple(d for d in ORDER_I if d != "cifar100"),
        16,
        (DEFAULT_TEMPLATE,),
    ),
}


def few_shot(listing: Listing, shots: int, seed: int, task: str) -> tuple[int, int]:
    """Keep `shots` training samples per class: the first of a seeded permutation of each
    class's training samples (test samples untouched). Returns (samples left out, classes
    with fewer than `shots` images)."""
    by_class: dict[int, list[int]] = {}
    for i, s in enumerate(listing.samples):
        if s.split == "train":
            by_class.setdefault(s.label, []).append(i)
    keep: set[int] = set()
    short = 0
    for y in sorted(by_class):
        idx = by_class[y]
        rng = np.random.default_rng([seed, 5, zlib.crc32(task.encode()), y])
        keep.update(idx[j] for j in rng.permutation(len(idx))[:shots])
        short += len(idx) < shots
    before = len(listing.samples)
    listing.samples = [s for i, s in enumerate(listing.samples) if s.split != "train" or i in keep]
    return before - len(listing.samples), short


def resolve_template(spec: str | None) -> list[str]:
    """`--templates`: a built-in name, a file (one per line) or one literal template with {}."""
    from cvl.evaluation.zeroshot import load_templates

    if not spec:
        return [DEFAULT_TEMPLATE]
    if "{}" in spec and not Path(spec).is_file():
        return [spec]
    return load_templates(spec)


def check_classes(task: str, listing: Listing) -> None:
    """A one-line error for a class with no training image (empty or missing folder)."""
    have = Counter(s.label for s in listing.samples if s.split == "train")
    for y, name in enumerate(listing.names):
        if not have[y]:
            miss = f"; {len(listing.missing)} listed files are missing" if listing.missing else ""
            raise CvlError(
                f"{task}: class '{name}' (key '{listing.keys[y]}') has no training image{miss}"
            )


def build_classification(
    data: str | Path,
    datasets: list[str],
    opts: BuildOptions,
    *,
    shots: int | None = None,
    templates: str | None = None,
    union_templates: list[str] | None = None,
    protocol: str | None = None,
) -> Manifest:
    """Read each dataset, write one task per dataset (see the module docstring)."""
    if not datasets:
        raise CvlError("no datasets given (--datasets A,B,... or --protocol)")
    if shots is not None and shots <= 0:
        raise CvlError(f"--shots must be positive, got {shots}")
    report = BuildReport()
    drop = Dropper(report)
    generic = resolve_template(templates)
    rows: list[Row] = []
    info: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for name in datasets:
        task, lst = read_dataset(data, name)
        if task in info:
            raise CvlError(f"--datasets lists '{task}' twice")
        spec = SPECS.get(task)
        tmpl = spec.templates() if spec else generic
        note: dict[str, Any] = {"layout": lst.layout, "classes": len(lst.names)}
        if lst.split_rule:
            note["split"] = lst.split_rule
        for path in lst.missing:
            drop("missing_file", where=path, detail=f"{task}: {path} is listed, not on disk")
        report.read += len(lst.samples) + len(lst.missing)
        if shots:
            left, short = few_shot(lst, shots, opts.seed, task)
            note.update(shots=shots, not_sampled=left, classes_with_fewer_images=short)
        check_classes(task, lst)
        for s in lst.samples:
            name_ = lst.names[s.label]
            rows.append(
                Row(
                    id=s.id,
                    caption=tmpl[0].format(name_),
                    path=s.path,
                    data=s.data,
                    task=task,
                    split=s.split,
                    category=f"{task}/{name_}",
                    meta={"label": s.label, "class": name_},
                )
            )
        info[task] = {"names": lst.names, "templates": tmpl, "note": note, "listing": lst}
        order.append(task)
    report.notes["datasets"] = {t: v["note"] for t, v in info.items()}

    def complete(m: Manifest, rep: BuildReport) -> None:
        from cvl.classtext import same_prompt  # here: it imports torch

        lost = Counter((r.get("task"), r.get("id")) for r in drop.rows if r.get("split") == "train")
        for t in order:
            lst = info[t]["listing"]
            kept = Counter(
                s.label for s in lst.samples if s.split == "train" and not lost[(t, s.id)]
            )
            for y, n in enumerate(lst.names):
                if not kept[y]:
                    raise CvlError(f"{t}: class '{n}' has no readable training image left")
        names, prompts, task_of, tms = [], [], [], []
        for t in m.task_order:
            cats = [f"{t}/{n}" for n in info[t]["names"]]
            m.tasks[t].categories = cats
            names += cats
            prompts += info[t]["names"]
            task_of += [t] * len(cats)
            tms += [tuple(union_templates or info[t]["templates"])] * len(cats)
        same = same_prompt(names, prompts, tms)
        m.class_map = {
            "names": names,
            "prompts": prompts,
            "task_of": task_of,
            "labels": "each dataset's own classes (one task per dataset)",
            **({"union_templates": list(union_templates)} if union_templates else {}),
            **({"same_prompt": same} if same else {}),
        }
        if same:
            eg = ", ".join(f"{c} = {f}" for c, f in list(same.items())[:4])
            rep.notes.setdefault("warnings", []).append(
                f"{len(same)} classes have the all-classes prompts of a class of an earlier task "
                f"({eg}{', ...' if len(same) > 4 else ''}): one class to the model, so ZS-all "
                "counts either as right for both (class_map.same_prompt)"
            )

    rule = ColumnSplit("dataset", tasks=order)
    src_args = {
        "data": str(Path(data).absolute()),
        "datasets": order,
        "shots": shots,
        "protocol": protocol,
        "templates": templates,
    }
    return build_stream(
        rows,
        rule,
        opts,
        source="classification",
        report=report,
        drop=drop,
        source_args=src_args,
        descriptions={t: f"{t}: {len(info[t]['names'])} classes" for t in order},
        task_extra={t: {"templates": info[t]["templates"]} for t in order},
        complete=complete,
    )


def build_protocol_stream(preset: str, data: str | Path, opts: BuildOptions) -> Manifest:
    """`cvl build-stream protocol mtil|mtil-order2|mtil-fs|x-tail`."""
    p = PROTOCOLS[preset]
    return build_classification(
        data,
        list(p.datasets),
        opts,
        shots=p.shots,
        union_templates=list(p.union_templates) if p.union_templates else None,
        protocol=preset,
    )


@click.command("classification")
@click.option(
    "--data",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Folder holding the datasets (torchvision layouts and/or NAME/{train,test}/CLASS/).",
)
@click.option(
    "--protocol",
    type=click.Choice(list(PROTOCOLS)),
    default=None,
    help="A benchmark preset: its datasets, order, shots and label space.",
)
@click.option(
    "--datasets",
    default=None,
    help="Comma list of datasets, in training order (MTIL names: " + ", ".join(ORDER_I) + "; "
    "any other name is a folder DATA/NAME/{train,test}/CLASS/). Default: the protocol's.",
)
@click.option(
    "--shots", type=POSITIVE_INT, default=None, help="Training images per class (seeded) [all]."
)
@click.option(
    "--templates",
    default=None,
    help="Templates of datasets that are not MTIL's: a built-in name (simple, imagenet, "
    f"synthetic), a file, or one template with {{}} [{DEFAULT_TEMPLATE!r}].",
)
@click.option(
    "--union-template",
    "union_template",
    multiple=True,
    help="Template(s) for the classification over all tasks' classes (ZS-all) [each "
    "class's own templates; x-tail: 'a photo of a {}.'].",
)
@archive_options
def classification_cmd(
    data: str,
    protocol: str | None,
    datasets: str | None,
    shots: int | None,
    templates: str | None,
    union_template: tuple[str, ...],
    **kw: Any,
) -> None:
    """Image classification datasets as tasks (MTIL, MTIL-FS, X-TAIL); see datasets/mtil.md.

    \b
      cvl build-stream classification --data data --protocol mtil --out streams/mtil
      cvl build-stream classification --data data --datasets dtd,eurosat --shots 16 --out s
      cvl build-stream protocol x-tail --data data --out streams/x-tail
    """
    p = PROTOCOLS.get(protocol or "")
    names = [d.strip() for d in datasets.split(",") if d.strip()] if datasets else None
    if names is None:
        if p is None:
            raise CvlError("give --protocol NAME or --datasets A,B,...")
        names = list(p.datasets)
    opts = build_options(kw)
    unions = list(union_template) or (list(p.union_templates) if p and p.union_templates else None)
    for t in unions or []:
        if t.count("{}") != 1:
            raise CvlError(f"--union-template {t!r}: needs exactly one {{}}")
    m = build_classification(
        data,
        names,
        opts,
        shots=shots if shots is not None else (p.shots if p else None),
        templates=templates,
        union_templates=unions,
        protocol=protocol,
    )
    finish(m, str(opts.out), quiet=not opts.progress)
