"""`cvl build-stream synthetic-classes`: a stand-in for classification datasets on disk (the
CPU smoke of `recipes/mtil.sh`, tests), drawn like the synthetic stream.

Writes **data folders, not a stream**: ``OUT/synthK/{train,test}/SHAPE/NNNN.jpg`` for K = 0..D−1,
the image-folder layout `cvl build-stream classification` reads. Dataset K is the synthetic
stream's domain K with ``--overlap 0`` (`synthetic.task_domains`): its own shapes (the classes)
and its own drawing style and background tint, colours and backgrounds drawn at random, so the
datasets share no class, as MTIL's do not. Like the photos of a classification dataset the
pictures are iconic: the shape large and near the centre (``iconic=False``: any size and
position, as the synthetic stream draws them).

``--pretrain N`` also writes ``OUT/pretrain/{train,test}/SHAPE/``: about N training images over
the shapes of *all* datasets, each drawn in a style and tint chosen at random among all the
datasets' (so no dataset's look is new to it, but none is its own either). A CLIP_0 trained on
it (`cvl build-stream classification --datasets pretrain`, then `--base-loss class-ce`) knows
every class name before the sequence starts, as CLIP knows the MTIL classes, and the same
stream is ZSCL's reference set. Same arguments → the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT, SEED
from cvl.errors import CvlError
from cvl.io import atomic_dir
from cvl.streams.synthetic_draw import (
    SIZES,
    SS,
    SynthSpec,
    plan_sample,
    render_sample,
    task_domains,
)
from cvl.streams.writer import encode_jpeg

PRETRAIN = "pretrain"


def _draw(spec: SynthSpec, dom: dict, rng: np.random.Generator, iconic: bool) -> bytes:
    """One JPEG of `dom` (a domain with one shape); iconic: large, near the centre."""
    p = plan_sample(spec, dom, rng)
    if iconic:  # the same jitter as the stream's positions and sizes
        p["size"], p["pos"] = "large", "center"
        p["cx"], p["cy"] = 0.5 + rng.uniform(-0.04, 0.04, 2)
        p["rad"] = SIZES["large"] * rng.uniform(0.9, 1.1) * spec.image_size * SS
    return encode_jpeg(render_sample(spec.image_size, p)[0])


def build_synthetic_folders(
    out: str | Path,
    datasets: int = 3,
    classes: int = 4,
    train_per_class: int = 24,
    test_per_class: int = 12,
    image_size: int = 32,
    pretrain: int = 0,
    seed: int = 0,
    iconic: bool = True,
) -> list[str]:
    """Write the folders (atomically); returns the dataset names in order."""
    for k, v in (("datasets", datasets), ("classes", classes), ("image-size", image_size)):
        if v <= 0:
            raise CvlError(f"--{k} must be positive, got {v}")
    if train_per_class <= 0 or test_per_class <= 0 or pretrain < 0:
        raise CvlError("--train-per-class and --test-per-class must be positive, --pretrain >= 0")
    spec = SynthSpec(
        tasks=datasets,
        image_size=image_size,
        shapes_per_task=classes,
        overlap=0,
        seed=seed,
    )
    doms = task_domains(spec)
    names = [f"synth{t}" for t in range(datasets)]
    with atomic_dir(out, kind="synthetic-classes") as tmp:
        for t, dom in enumerate(doms):
            for c, shape in enumerate(dom["shapes"]):
                one = {**dom, "shapes": [shape]}  # every draw of this class is this shape
                for s_i, (split, n) in enumerate(
                    (("train", train_per_class), ("test", test_per_class))
                ):
                    rng = np.random.default_rng([seed, 31, t, c, s_i])
                    folder = tmp / names[t] / split / shape
                    folder.mkdir(parents=True)
                    for i in range(n):
                        (folder / f"{i:04d}.jpg").write_bytes(_draw(spec, one, rng, iconic))
        if pretrain:
            shapes = [s for d in doms for s in d["shapes"]]
            looks = [(d["style"], d["tint"]) for d in doms]
            per = {"train": max(1, pretrain // len(shapes))}
            per["test"] = max(2, per["train"] // 4)
            for c, shape in enumerate(shapes):
                for s_i, (split, n) in enumerate(per.items()):
                    rng = np.random.default_rng([seed, 37, c, s_i])
                    folder = tmp / PRETRAIN / split / shape
                    folder.mkdir(parents=True)
                    for i in range(n):
                        style, tint = looks[int(rng.integers(len(looks)))]
                        dom = {"shapes": [shape], "style": style, "tint": tint}
                        (folder / f"{i:04d}.jpg").write_bytes(_draw(spec, dom, rng, iconic))
    return names


@click.command("synthetic-classes")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Data folder to write."
)
@click.option("--datasets", default=3, show_default=True, type=POSITIVE_INT, help="Datasets.")
@click.option(
    "--classes", default=4, show_default=True, type=POSITIVE_INT, help="Classes (shapes) each."
)
@click.option("--train-per-class", default=24, show_default=True, type=POSITIVE_INT)
@click.option("--test-per-class", default=12, show_default=True, type=POSITIVE_INT)
@click.option("--image-size", default=32, show_default=True, type=POSITIVE_INT)
@click.option(
    "--pretrain",
    default=0,
    type=NON_NEGATIVE_INT,
    show_default=True,
    help="Training images (about) of OUT/pretrain/: every dataset's shapes in mixed looks (0 = none).",
)
@click.option(
    "--seed", type=SEED, default=0, show_default=True, help="Same seed -> the same bytes."
)
@click.option(
    "--iconic/--any-position",
    default=True,
    show_default=True,
    help="Shapes large and centred (classification-style photos), or drawn as the stream does.",
)
@click.option("--quiet", is_flag=True, help="No summary.")
def synthetic_classes_cmd(
    out: str,
    datasets: int,
    classes: int,
    train_per_class: int,
    test_per_class: int,
    image_size: int,
    pretrain: int,
    seed: int,
    iconic: bool,
    quiet: bool,
) -> None:
    """Stand-in classification datasets as image folders (not a stream): OUT/synthK/{train,
    test}/SHAPE/*.jpg, for `cvl build-stream classification --data OUT` (the MTIL smoke).

    \b
      cvl build-stream synthetic-classes --out data/synth --datasets 3 --pretrain 400
      cvl build-stream classification --data data/synth --datasets synth0,synth1,synth2 \\
          --templates synthetic --out streams/synth-mtil
    """
    names = build_synthetic_folders(
        out, datasets, classes, train_per_class, test_per_class, image_size, pretrain, seed, iconic
    )
    if not quiet:
        click.echo(
            f"wrote {len(names)} datasets to {out}: {', '.join(names)} ({classes} classes, "
            f"{train_per_class} train / {test_per_class} test images each)"
            + (f"; {PRETRAIN}/ (~{pretrain} images over all classes)" if pretrain else "")
        )
