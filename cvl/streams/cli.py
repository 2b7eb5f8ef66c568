"""`cvl build-stream SOURCE ...`: one subcommand per source, all writing the same format."""

from __future__ import annotations

import click

from cvl.streams.manifest import Manifest


def echo_summary(m: Manifest, out: str) -> None:
    """Print what a builder wrote (tasks, counts, eval sets)."""
    click.echo(f"wrote stream '{m.name}' to {out} ({len(m.task_order)} tasks)")
    for t in m.task_order:
        evals = ", ".join(
            f"{s} {es.tasks[t].count}" for s, es in m.eval_sets.items() if t in es.tasks
        )
        click.echo(
            f"  {t:>12}: train {m.tasks[t].train.count:>7}" + (f" | {evals}" if evals else "")
        )


@click.group("build-stream")
def build_stream() -> None:
    """Build a stream folder (stream.json + webdataset shards) from a source.

    Every source writes the same manifest format (`cvl.stream/1`, see datasets/README.md),
    into a temporary folder renamed into place when complete: an interrupted build leaves
    nothing half-written. An existing output folder is refused unless --overwrite.
    """


def _positive(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value <= 0:
        raise click.BadParameter(f"must be a positive integer, got {value}")
    return value


def _non_negative(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 0:
        raise click.BadParameter(f"must be >= 0, got {value}")
    return value


@build_stream.command("synthetic")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Stream folder to write."
)
@click.option(
    "--tasks", default=5, show_default=True, callback=_positive, help="Number of tasks (domains)."
)
@click.option(
    "--per-task",
    default=2000,
    show_default=True,
    callback=_positive,
    help="Training pairs per task.",
)
@click.option(
    "--first-task",
    type=int,
    default=None,
    callback=_positive,
    help="Training pairs of task 0 if different (a larger first task, as Mod-X's COCO).",
)
@click.option(
    "--test-per-task",
    type=int,
    default=None,
    callback=_non_negative,
    help="Test pairs per task [max(50, per_task/5)].",
)
@click.option(
    "--val-per-task",
    type=int,
    default=None,
    callback=_non_negative,
    help="Validation pairs per task [max(20, per_task/10)].",
)
@click.option(
    "--query-per-task",
    type=int,
    default=None,
    callback=_non_negative,
    help="mAP queries per task [max(20, per_task/10)].",
)
@click.option(
    "--gallery-per-task",
    type=int,
    default=None,
    callback=_non_negative,
    help="mAP gallery items per task [max(50, per_task/2)].",
)
@click.option(
    "--shapes-per-task",
    type=int,
    default=None,
    callback=_positive,
    help="Shapes (categories) per task [min(4, 28/tasks)].",
)
@click.option(
    "--image-size", default=32, show_default=True, callback=_positive, help="Image side in pixels."
)
@click.option("--seed", default=0, show_default=True, help="Same seed -> byte-identical stream.")
@click.option("--name", default=None, help="Stream name [folder name].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def synthetic_cmd(
    out: str, name: str | None, overwrite: bool, quiet: bool, **kw: int | None
) -> None:
    """Procedurally drawn shapes with compositional captions, one domain per task.

    Runs offline in seconds; the embedded default of `make demo` and the tests. Tasks share
    colours, sizes, positions and background patterns, and differ in shapes (the category
    label used by mAP), drawing style and background tint, so sequential fine-tuning forgets.
    """
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    m = build_synthetic(out, SynthSpec(**kw), name=name, overwrite=overwrite, progress=not quiet)
    echo_summary(m, out)
