"""`cvl eval`: evaluate a run folder (R matrices, continual metrics, reports) or compare runs."""

from __future__ import annotations

from pathlib import Path

import click

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT
from cvl.device import deterministic_option, device_option
from cvl.errors import CvlError
from cvl.evaluation.options import (
    DEFAULT_IMAGE_CACHE_MB,
    EvalOptions,
    precision_option,
    settings_diff,
    workers_option,
)


def _lock_eval(run: str, out: str | None, acc):  # noqa: ANN202 (FolderLock | None)
    """The lock of the folder an evaluation writes (OUT, or RUN/eval): one writer at a time
    (`cvl.lock`); RUN is checked first, so a wrong path creates nothing."""
    from cvl.lock import lock_on_main
    from cvl.runs import load_run

    load_run(run)
    return lock_on_main(Path(out) if out else Path(run) / "eval", acc)


def _existing_metrics(run: Path, opts: EvalOptions, say: bool = True) -> dict | None:
    """RUN/eval/metrics.json when it covers every finished task checkpoint and was computed
    with the settings asked for now (`EvalOptions.report_fields`), else None: the run is
    then evaluated again (its per-checkpoint cache serves what it holds for these settings),
    so a comparison never mixes results computed under other settings."""
    from cvl.io import read_json
    from cvl.runs import finished_tasks

    mfile = run / "eval" / "metrics.json"
    if not mfile.is_file():
        return None
    m = read_json(mfile)
    labels = [f"{c.index:02d}-{c.name}" for c in finished_tasks(run)]
    if m.get("rows") != labels:
        return None
    diff = settings_diff(m.get("settings"), opts.report_fields())
    if diff and say:  # (the main process says it)
        click.echo(
            f"note: {mfile} was computed with other settings ({'; '.join(diff)}): "
            "evaluating the run again with these",
            err=True,
        )
    return None if diff else m


@click.command("eval")
@click.option(
    "--run", "run", type=click.Path(), default=None, help="Run folder (written by `cvl train`)."
)
@click.option("--stream", type=click.Path(), default=None, help="Stream folder [the run's stream].")
@click.option(
    "--tasks",
    default="all",
    show_default=True,
    help="Checkpoints to evaluate: all, last, or a comma list of task names/indices (and 'init').",
)
@click.option(
    "--batch-size", default=256, show_default=True, type=POSITIVE_INT, help="Embedding batch size."
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder [RUN/eval]; with --compare: where to write compare.md/csv.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Re-evaluate checkpoints already evaluated (ignore the per-checkpoint cache).",
)
@click.option(
    "--match",
    type=click.Choice(["auto", "pair", "text"]),
    default="auto",
    show_default=True,
    help="Retrieval hits: pair = the caption written for the image; text = any caption with identical text (auto: text for synthetic streams).",
)
@click.option(
    "--ties",
    type=click.Choice(["pessimistic", "optimistic"]),
    default="pessimistic",
    show_default=True,
    help="Where negatives scoring equal to the positive rank.",
)
@click.option(
    "--map-feature",
    type=click.Choice(["auto", "fusion", "image+text", "image", "text"]),
    default="auto",
    show_default=True,
    help="Item feature for mAP (auto: fusion [CLS] if the model has one, else normalised image+text sum).",
)
@click.option(
    "--zs-templates",
    default=None,
    help="Zero-shot prompt templates: built-in name (imagenet, simple, synthetic) or a file [synthetic for synthetic streams, else imagenet].",
)
@click.option(
    "--zeroshot-folder",
    "zs_folders",
    multiple=True,
    type=click.Path(),
    help="Also classify a labelled image folder DIR/<class>/*.jpg zero-shot (repeatable). Class "
    "names: DIR/classnames.txt, the ImageNet names for 1,000 WordNet-id folders, else the folder "
    "names; templates: --zs-templates [imagenet].",
)
@click.option(
    "--no-zeroshot",
    is_flag=True,
    help="Skip zero-shot classification of the stream's labelled test sets.",
)
@click.option("--no-probe", is_flag=True, help="Skip the linear probe.")
@click.option(
    "--probe-train",
    default=500,
    show_default=True,
    type=POSITIVE_INT,
    help="Training images per task for the linear probe (evenly subsampled).",
)
@click.option(
    "--no-init",
    is_flag=True,
    help="Do not evaluate the initial weights (init/), even when present.",
)
@click.option("--no-cumulative", is_flag=True, help="Skip the CTP merged-test-set protocol.")
@click.option(
    "--no-plots",
    is_flag=True,
    help="Write no PNG plots (with --compare: no comparison curves compare_*.png).",
)
@click.option(
    "--image-cache-mb",
    type=NON_NEGATIVE_INT,
    default=DEFAULT_IMAGE_CACHE_MB,
    show_default=True,
    help="Memory for decoded eval images (uint8, after resize + crop) kept across checkpoints "
    "and compared runs: a set that fits is decoded once per command (0 = decode every pass).",
)
@device_option
@workers_option
@precision_option
@deterministic_option
@click.option(
    "--compare",
    is_flag=True,
    help="Compare the RUNS given as arguments side by side (evaluating any not yet evaluated; "
    "each run's tables go to RUN/eval, the comparison and its plots to --out).",
)
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.argument("runs", nargs=-1, type=click.Path())
def eval_cmd(
    run,
    stream,
    tasks,
    batch_size,
    out,
    force,
    match,
    ties,
    map_feature,
    zs_templates,
    zs_folders,
    no_zeroshot,
    no_probe,
    probe_train,
    no_init,
    no_cumulative,
    no_plots,
    image_cache_mb,
    device,
    workers,
    precision,
    deterministic,
    compare,
    quiet,
    runs,
) -> None:
    """Evaluate every task checkpoint of a run on every task: R matrices and continual metrics.

    \b
    For the model after each task i and each task j of the stream (R[i][j]):
      cross-modal retrieval TR@1/5/10, IR@1/5/10, Rm, R@mean per direction (test set);
      multi-modal mAP@1/5/10 (query vs gallery, same category = positive, query excluded);
      zero-shot top-1/top-5 (prompt ensembling) and a linear probe where labels exist.
    Plus the CTP protocol (each model on the merged test set of the tasks seen so far), and
    from the matrices: average, BWT (IncCLIP and standard), forgetting, DHA forgetting rate,
    FWT (when the trainer saved init/ weights). Writes RUN/eval/metrics.json, summary.md,
    CSV tables, plots/*.png; prints the paper-style tables. Checkpoints already evaluated
    with the same options are read from RUN/eval/cache/ (use --force to redo them).

    Runs on the GPU when there is one (--device), in one process; the eval images are decoded
    by --workers loader processes once per command and kept (--image-cache-mb); --precision
    bf16 autocasts the embedding passes (recorded in metrics.json; a separate cache entry).

    \b
      cvl eval --run runs/a
      cvl eval --run runs/a --tasks last --zeroshot-folder ~/data/imagenet-val
      cvl eval --run runs/a --device cuda --workers 8 --precision bf16 --batch-size 512
      cvl eval --compare runs/seqft runs/er runs/ctp
    """
    from cvl.device import determinism, model_runner
    from cvl.evaluation.comparison import render_compare, write_compare
    from cvl.evaluation.imagestore import ImageStore
    from cvl.evaluation.report import render_markdown, write_outputs
    from cvl.evaluation.runner import evaluate_run

    opts = EvalOptions(
        stream=stream,
        tasks=tasks,
        batch_size=batch_size,
        match=match,
        ties=ties,
        map_feature=map_feature,
        zeroshot=not no_zeroshot,
        zs_templates=zs_templates,
        zs_folders=tuple(zs_folders),
        probe=not no_probe,
        probe_train=probe_train,
        init=not no_init,
        cumulative=not no_cumulative,
        force=force,
        progress=not quiet,
        image_cache_mb=image_cache_mb,
        precision=precision,
        device=device,
        workers=workers,
        deterministic=deterministic,
    )
    acc, dev = model_runner(device)
    click.get_current_context().with_resource(determinism(deterministic, dev))  # until return
    store = ImageStore(image_cache_mb)  # one for every run of a --compare (same stream)
    main = acc is None or acc.is_main_process
    if compare:
        targets = list(runs) + ([run] if run else [])
        if len(targets) < 1:
            raise CvlError("--compare needs run folders: cvl eval --compare RUN1 RUN2 ...")
        ms, same = [], {}  # same: results by checkpoint content, shared by the runs
        for r in targets:
            m = _existing_metrics(Path(r), opts, main) if not force and stream is None else None
            if m is not None:
                ms.append({**m, "run": str(r)})  # the folder as named now (its cost is read there)
                continue
            lock = _lock_eval(r, None, acc)
            m = evaluate_run(r, opts, acc, store=store, same=same)
            if main:  # tables only: `cvl eval --run R` writes the run's own plots (from cache)
                write_outputs(m, Path(r) / "eval", plots=False)
            if lock is not None:
                lock.release()
            ms.append(m)
        if main:
            click.echo(render_compare(ms))
            if out:
                for p in write_compare(ms, out, plots=not no_plots):
                    click.echo(f"wrote {p}")
        return
    if runs:
        raise CvlError(
            f"unexpected argument(s) {' '.join(runs)}: use --run RUN (or --compare RUN1 RUN2 ...)"
        )
    if not run:
        raise CvlError("Missing option '--run' (the run folder to evaluate)")
    lock = _lock_eval(run, out, acc)  # noqa: F841 (held until the command ends)
    m = evaluate_run(run, opts, acc, out, store=store)
    if not main:
        return
    out_dir = Path(out) if out else Path(run) / "eval"
    files = write_outputs(m, out_dir, plots=not no_plots)
    ev, re_ = m["evaluated"], m["reused_from_cache"]
    click.echo(
        f"evaluated {len(ev)} checkpoint(s)"
        + (f", reused {len(re_)} from cache ({', '.join(re_)})" if re_ else "")
        + f"; wrote {len(files)} files to {out_dir}"
    )
    rt = m["runtime"].get(ev[0]) if ev else None
    if rt:
        click.echo(
            f"on {rt['device']} ({rt['processes']} process(es), {rt['workers']} loader "
            f"worker(s)), precision {rt['precision']}, deterministic "
            f"{'on' if rt['deterministic'] else 'off'}"
        )
    click.echo(f"retrieval rule: {m['protocol']['retrieval_rule']}")
    click.echo(f"mAP feature: {m['protocol']['map_feature']}\n")
    click.echo(render_markdown(m, full=False))
