"""`cvl analyze ...`: analyses of a run's checkpoints (currently: rotation)."""

from __future__ import annotations

from pathlib import Path

import click

from cvl.checks import POSITIVE_INT
from cvl.device import deterministic_option, device_option
from cvl.errors import CvlError
from cvl.evaluation.options import precision_option, workers_option


@click.group("analyze")
def analyze() -> None:
    """Analyse a run's checkpoints (writes into RUN/analysis/)."""


def _check_compare(compare: tuple[str, str] | None) -> None:
    """--compare takes two run folders: an option swallowed as the second is named as such,
    and the same run twice is worth a warning (the two tables are the same)."""
    if compare is None:
        return
    opt = [v for v in compare if v.startswith("-")]
    if opt:
        raise CvlError(
            f"--compare takes two run folders (R1 R2), got {compare[0]!r} and the option "
            f"{opt[-1]!r}: give both runs right after --compare"
        )
    a, b = (Path(p).resolve() for p in compare)
    if a == b:
        click.echo(
            f"warning: --compare names the same run twice ({compare[0]}): both sides are equal",
            err=True,
        )


def _lock(run: str | Path, dest: Path):  # noqa: ANN202 (FolderLock)
    """The lock of the folder the analysis writes (one writer at a time, `cvl.lock`); the run
    is checked first, so a wrong path creates nothing."""
    from cvl.lock import FolderLock
    from cvl.runs import load_run

    load_run(run)
    return FolderLock(dest).acquire()


@analyze.command("rotation")
@click.option("--run", "run_dir", type=click.Path(file_okay=False), help="Run folder to analyse.")
@click.option(
    "--compare",
    nargs=2,
    type=click.Path(file_okay=False),
    default=None,
    metavar="R1 R2",
    help="Analyse two runs (e.g. seqft and modx) and show their tables side by side.",
)
@click.option(
    "--stream", type=click.Path(), default=None, help="Stream folder [the one in run.json]."
)
@click.option("--split", default="test", show_default=True, help="Eval set of the stream.")
@click.option(
    "--eval-task", default=None, help="Task whose eval set is embedded [the run's first task]."
)
@click.option(
    "--tasks",
    default="all",
    show_default=True,
    help="Checkpoints: 'all' (every finished task, after the initial weights when they are "
    "pretrained) or e.g. 'init,0,2' (indices or names).",
)
@click.option(
    "--modality",
    type=click.Choice(["vision", "text", "both"]),
    default="both",
    show_default=True,
    help="SAM/RAM for these encoders; ImAV needs both.",
)
@click.option(
    "--max-samples",
    default=None,
    type=POSITIVE_INT,
    help="Use the first N samples of the eval set.",
)
@click.option(
    "--batch-size", default=256, show_default=True, type=POSITIVE_INT, help="Embedding batch size."
)
@click.option(
    "--chunk-mb",
    default=64,
    show_default=True,
    type=POSITIVE_INT,
    help="Memory for one block of the pairwise SAM computation (float64).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder [RUN/analysis; with --compare: R1/analysis/compare-<R2 name>].",
)
@click.option("--no-plots", is_flag=True, help="Skip the PNG charts.")
@click.option("--quiet", is_flag=True, help="No progress bars; print only the output paths.")
@device_option
@workers_option
@precision_option
@deterministic_option
def rotation_cmd(
    run_dir: str | None,
    compare: tuple[str, str] | None,
    stream: str | None,
    split: str,
    eval_task: str | None,
    tasks: str,
    modality: str,
    max_samples: int | None,
    batch_size: int,
    chunk_mb: int,
    out: str | None,
    no_plots: bool,
    quiet: bool,
    device: str,
    workers: int,
    precision: str,
    deterministic: bool | None,
) -> None:
    """Mod-X spatial-disorder analysis: SAM, RAM and ImAV angle-change distributions.

    Embeds a fixed eval set (default: the first task's test set) with every checkpoint and
    prints, per modality, the distribution of |SAM_i - SAM_j| (angle change of every sample
    pair a<b, counted once, diagonal excluded) and of the rotation angle RAM of each sample,
    for consecutive checkpoints and first vs last; plus ImAV: the change of the image-text
    angle of the samples the earlier checkpoint retrieves correctly (image->text top-1 within
    the set; a retrieved caption with identical text counts). Writes rotation.md/.json,
    one CSV per table and PNG charts.

    \b
    Examples:
      cvl analyze rotation --run runs/seqft
      cvl analyze rotation --run runs/seqft --modality vision --max-samples 1000
      cvl analyze rotation --compare runs/seqft runs/modx
    """
    from cvl.analysis import rotation as rot
    from cvl.device import determinism, resolve_device
    from cvl.evaluation.imagestore import ImageStore
    from cvl.evaluation.options import DEFAULT_IMAGE_CACHE_MB

    if (run_dir is None) == (compare is None):
        raise CvlError("give exactly one of --run RUN or --compare R1 R2")
    _check_compare(compare)
    dev = resolve_device(device)
    click.get_current_context().with_resource(determinism(deterministic, dev))  # until return
    kw = dict(
        stream=stream,
        split=split,
        eval_task=eval_task,
        tasks=tasks,
        modality=modality,
        max_samples=max_samples,
        batch_size=batch_size,
        chunk_elems=max(1, chunk_mb * (1 << 20) // 8),
        progress=not quiet,  # drawn on a terminal only (cvl.progress)
        device=dev,
        workers=workers,
        precision=precision,
        store=ImageStore(DEFAULT_IMAGE_CACHE_MB),  # the eval set decoded once, for both runs
    )
    if run_dir is not None:
        dest = Path(out) if out else Path(run_dir) / "analysis"
        lock = _lock(run_dir, dest)  # noqa: F841 (held until the command ends)
        res = rot.analyze_run(run_dir, **kw)
        written = rot.write_result(res, dest, plots=not no_plots)
        if not quiet:
            click.echo(rot.result_markdown(res))
    else:
        assert compare is not None
        r1, r2 = (Path(p) for p in compare)
        n1, n2 = r1.absolute().name, r2.absolute().name
        if n1 == n2:
            n1, n2 = f"{n1}-A", f"{n2}-B"
        dest = Path(out) if out else r1 / "analysis" / f"compare-{n2}"
        lock = _lock(r1, dest)  # noqa: F841
        res1 = rot.analyze_run(r1, **kw)
        res2 = rot.analyze_run(r2, **kw)
        written = rot.write_result(res1, dest / n1, plots=not no_plots)
        written += rot.write_result(res2, dest / n2, plots=not no_plots)
        md = rot.compare_markdown(res1, res2, n1, n2)
        from cvl.io import atomic_write_bytes

        atomic_write_bytes(dest / "compare.md", md.encode("utf-8"))
        written.append(dest / "compare.md")
        if not no_plots:
            written += rot.plot_compare(res1, res2, n1, n2, dest)
        if not quiet:
            click.echo(md)
    click.echo(f"wrote {len(written)} files to {dest}")
