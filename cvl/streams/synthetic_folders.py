"""`cvl build-stream synthetic-classes`: a stand-in for classification datasets on disk (the
CPU smoke of `recipes/mtil.sh`, tests), drawn like the synthetic stream.

Writes **data folders, not a stream**: ``OUT/synthK/{train,test}/SHAPE/NNNN.jpg`` for K = 0..D−1,
the image-folder layout `cvl build-stream classification` reads. Dataset K is the synthetic
stream's domain K with ``--overlap 0`` (`synthetic.task_domains`): its own shapes (the classes)
and its own drawing style and background tint, colours, sizes, positions and backgrounds drawn
at random, so the datasets share no class, as MTIL's do not. ``--pretrain N`` also writes, in
``OUT/pretrain/``, the synthetic stream's pretraining set over the same domains (captions such
as "a large red outlined hexagon at the top left on a striped background"): a CLIP_0 trained
on it knows every shape, as CLIP knows the MTIL classes before MTIL, and it doubles as ZSCL's
reference set. Same arguments → the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from cvl.errors import CvlError
from cvl.io import atomic_dir
from cvl.streams.options import positive
from cvl.streams.synthetic import (
    SynthSpec,
    build_synthetic,
    plan_sample,
    render_sample,
    task_domains,
)
from cvl.streams.writer import encode_jpeg

PRETRAIN = "pretrain"


def build_synthetic_folders(
    out: str | Path,
    datasets: int = 3,
    classes: int = 4,
    train_per_class: int = 24,
    test_per_class: int = 12,
    image_size: int = 32,
    pretrain: int = 0,
    seed: int = 0,
    progress: bool = False,
) -> list[str]:
    """Write the folders (atomically); returns the dataset names in order."""
    for k, v in (("datasets", datasets), ("classes", classes), ("image-size", image_size)):
        if v <= 0:
            raise CvlError(f"--{k} must be positive, got {v}")
    if train_per_class <= 0 or test_per_class <= 0:
        raise CvlError("--train-per-class and --test-per-class must be positive")
    spec = SynthSpec(
        tasks=datasets,
        per_task=1,
        test_per_task=0,
        val_per_task=0,
        query_per_task=0,
        gallery_per_task=0,
        image_size=image_size,
        shapes_per_task=classes,
        overlap=0,
        pretrain=pretrain,
        seed=seed,
    )
    doms = task_domains(spec)
    names = [f"synth{t}" for t in range(datasets)]
    counts = {"train": train_per_class, "test": test_per_class}
    with atomic_dir(out, kind="synthetic-classes") as tmp:
        for t, dom in enumerate(doms):
            for c, shape in enumerate(dom["shapes"]):
                one = {**dom, "shapes": [shape]}  # every draw of this class is this shape
                for s_i, (split, n) in enumerate(counts.items()):
                    rng = np.random.default_rng([seed, 31, t, c, s_i])
                    folder = tmp / names[t] / split / shape
                    folder.mkdir(parents=True)
                    for i in range(n):
                        img, _, _ = render_sample(image_size, plan_sample(spec, one, rng))
                        (folder / f"{i:04d}.jpg").write_bytes(encode_jpeg(img))
        if pretrain:
            build_synthetic(tmp / "_stream", spec, name=PRETRAIN, progress=progress)
            (tmp / "_stream" / PRETRAIN).rename(tmp / PRETRAIN)
            import shutil

            shutil.rmtree(tmp / "_stream")
    return names


@click.command("synthetic-classes")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Data folder to write."
)
@click.option("--datasets", default=3, show_default=True, callback=positive, help="Datasets.")
@click.option(
    "--classes", default=4, show_default=True, callback=positive, help="Classes (shapes) each."
)
@click.option("--train-per-class", default=24, show_default=True, callback=positive)
@click.option("--test-per-class", default=12, show_default=True, callback=positive)
@click.option("--image-size", default=32, show_default=True, callback=positive)
@click.option(
    "--pretrain",
    default=0,
    show_default=True,
    help="Pairs of a pretraining stream over the same domains, in OUT/pretrain/ (0 = none).",
)
@click.option("--seed", default=0, show_default=True, help="Same seed -> the same bytes.")
@click.option("--quiet", is_flag=True, help="No progress bar or summary.")
def synthetic_classes_cmd(
    out: str,
    datasets: int,
    classes: int,
    train_per_class: int,
    test_per_class: int,
    image_size: int,
    pretrain: int,
    seed: int,
    quiet: bool,
) -> None:
    """Stand-in classification datasets as image folders (not a stream): OUT/synthK/{train,
    test}/SHAPE/*.jpg, for `cvl build-stream classification --data OUT` (the MTIL smoke).

    \b
      cvl build-stream synthetic-classes --out data/synth --datasets 3 --pretrain 400
      cvl build-stream classification --data data/synth --datasets synth0,synth1,synth2 \\
          --templates synthetic --out streams/synth-mtil
    """
    if pretrain < 0:
        raise CvlError("--pretrain must be >= 0")
    names = build_synthetic_folders(
        out,
        datasets,
        classes,
        train_per_class,
        test_per_class,
        image_size,
        pretrain,
        seed,
        progress=not quiet,
    )
    if not quiet:
        click.echo(
            f"wrote {len(names)} datasets to {out}: {', '.join(names)} ({classes} classes, "
            f"{train_per_class} train / {test_per_class} test images each)"
            + (f"; pretraining stream {out}/{PRETRAIN} ({pretrain} pairs)" if pretrain else "")
        )
