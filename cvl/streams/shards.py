"""`cvl build-stream shards`: a stream over webdataset shards users already have, in place.

img2dataset's CC12M / CC3M / LAION, DataComp's ``download_upstream.py`` shards (KEY.jpg,
KEY.txt and KEY.json with the ``uid``), any webdataset collection, in a folder or at a URL:
its samples are split into tasks by the rules the other sources use, and nothing is copied
or downloaded. A task is its source shards plus the positions of its samples among theirs
(an integer array file per task beside stream.json: 4 B a training sample; `--copy` writes
ordinary shards instead); evaluation sets are copied (small). See datasets/README.md
(building in place), datasets/tic-datacomp.md and datasets/cc12m.md.

The split, as `table` makes it (the same functions, `cvl.streams.splitcore`, on arrays):

- ``--chunks K`` (with ``--sample N``, ``--val``, ``--test``): IncCLIP's instance split, as
  `cc12m`;
- ``--time-col COL``: one task per period of a date (TiC-CLIP), the options of `table`;
- ``--task-col COL``: each value a task (a category or industry), as `table`.

A column is a field of each sample's KEY.json, or with ``--join FILE`` a column of a table
joined on the sample's id (``--id-col``: a KEY.json field, e.g. DataComp's ``uid``; default
the sample's key): parquet / CSV / JSONL, or TiC's per-year uid ``.npy`` files (the file's
year is the column; `cvl.streams.joins`). With ``--join``, samples whose id is in neither the
table nor ``--eval-ids`` are dropped (``not_in_join``). Everything per sample is an array
(`splitcore`, `shardcols`, `joins`): building from 10 M indexed samples takes minutes
(`benchmarks/bench_shards_build.py`, docs/scaling.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import numpy as np

from cvl.checks import POSITIVE_INT
from cvl.errors import CvlError
from cvl.streams.inplace import (
    SOURCE,
    Collection,
    Drops,
    Split,
    open_collection,
    why,
    write_stream,
)
from cvl.streams.manifest import Manifest, save_manifest
from cvl.streams.options import build_options, finish, split_options
from cvl.streams.pipeline import BuildOptions
from cvl.streams.rows import clean_text
from cvl.streams.splitcore import (
    TRAIN,
    balance_chunks,
    column_split,
    instance_split,
    sample_positions,
)
from cvl.streams.splitrules import check_split_options, resolve_order
from cvl.streams.timesplit import Periods, TimeSplit, time_options, time_spec
from cvl.streams.writer import BuildReport


def build_shards(
    inputs: list[str],
    opts: BuildOptions,
    *,
    index_prefix: str | None = None,
    id_col: str | None = None,
    join: list[str] | None = None,
    join_id_col: str | None = None,
    task_col: str | None = None,
    category_col: str | None = None,
    time: dict[str, Any] | None = None,
    chunks: int = 1,
    sample: int | None = None,
    val: int = 0,
    test: int = 0,
    limit_per_task: int | None = None,
    task_name: str = "chunk",
    copy: bool = False,
) -> Manifest:
    """`cvl build-stream shards`: a stream over a webdataset collection (module doc)."""
    _check_options(time, task_col, chunks, sample, limit_per_task, join, join_id_col)
    from cvl.io import atomic_dir

    c = open_collection(list(inputs), index_prefix, opts.log, opts.progress)
    n = len(c.every)
    report = BuildReport()
    report.read = n + sum(c.left_out.values())
    for reason, k in c.left_out.items():
        report.dropped[reason] += k  # left out when indexed: no image, no or empty caption
    cols = _columns(c, opts, report, id_col, join, join_id_col, time, task_col, category_col)
    ids, keep = cols["id"], cols["keep"]
    drop = Drops(report, keep, ids)
    drop("missing_id", np.flatnonzero(keep & ~cols["has_id"]))
    drop("not_in_join", np.flatnonzero(keep & ~cols["joined"]))
    if time is not None:
        sp = _time_split(cols, time, opts, drop, val, test, limit_per_task)
    elif task_col:
        sp = _column_split(cols, task_col, opts, drop, val, test, limit_per_task)
    else:
        sp = _instance_split(opts, report, drop, chunks, sample, val, test, task_name)
    order = resolve_order(opts.order, sp.names)
    with atomic_dir(
        opts.out, overwrite=opts.overwrite, kind="stream", inputs=_local(inputs)
    ) as tmp:
        m = write_stream(c, tmp, opts, report, drop, sp, order, cols, copy)
        m.source_args = {
            "shards": list(inputs),
            "root": c.root,
            **({"index_prefix": c.index_prefix} if c.index_prefix else {}),
            **({"id_col": id_col} if id_col else {}),
            **({"join": list(join or []), "join_id_col": join_id_col} if join else {}),
            **({"task_col": task_col} if task_col else {}),
            **({"category_col": category_col} if category_col else {}),
            **({"time": {k: v for k, v in time.items() if v is not None}} if time else {}),
            "chunks": chunks,
            "sample": sample,
            "val": val,
            "test": test,
            "limit_per_task": limit_per_task,
            "copy": copy,
            "order": opts.order or "default",
        }
        save_manifest(m, tmp)
        report.save(tmp)
    m.root = Path(opts.out).absolute()
    return m


def _local(inputs: list[str]) -> list[str]:
    """The inputs that are local paths (an --overwrite never deletes a folder holding them)."""
    return [i.split("{")[0] for i in inputs if "://" not in i]


def _check_options(
    time: dict[str, Any] | None,
    task_col: str | None,
    chunks: int,
    sample: int | None,
    limit: int | None,
    join: list[str] | None,
    join_id_col: str | None,
) -> None:
    check_split_options(time is not None, task_col, chunks, sample, limit)
    if join_id_col and not join:
        raise CvlError("--join-id-col names the id column of --join: give --join")
    if join and not (task_col or time):
        raise CvlError("--join gives a column to split on: give --time-col or --task-col with it")


def _columns(
    c: Collection,
    opts: BuildOptions,
    report: BuildReport,
    id_col: str | None,
    join: list[str] | None,
    join_id_col: str | None,
    time: dict[str, Any] | None,
    task_col: str | None,
    category_col: str | None,
) -> dict[str, Any]:
    """The per-sample arrays the split needs: ids, the split's column, categories, held-out
    marks (module doc of `cvl.streams.joins` for joined tables)."""
    import pyarrow.compute as pc

    from cvl.streams.joins import ID, load_eval_json, lookup, read_join, take_text
    from cvl.streams.shardcols import json_fields, sample_keys

    n = len(c.every)
    want = [x for x in ((time or {}).get("column"), task_col, category_col) if x]
    from_json = ([id_col] if id_col else []) + ([] if join else want)
    if from_json:
        opts.log(f"shards: reading {', '.join(from_json)} of {n} samples' KEY.json")
    got = json_fields(c.sids, list(dict.fromkeys(from_json)), opts.download.processes)
    ids = got[id_col] if id_col else sample_keys(c.sids)
    has_id = ~np.asarray(ids.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    out: dict[str, Any] = {"id": ids, "has_id": has_id, "keep": np.ones(n, dtype=bool)}
    joined = np.ones(n, dtype=bool)
    evals = None
    if time and time.get("eval_ids"):
        e_ids, e_periods = load_eval_json(time["eval_ids"])
        e_rows, _ = lookup(ids, e_ids)
        out["held"] = e_rows >= 0
        out["eval_ids"] = set(e_ids.to_pylist())
        evals = (e_rows, e_periods)
    if join:
        key = join_id_col or id_col or "key"
        t = read_join(list(join), key, want)
        opts.log(f"shards: joining {n} samples on {len(t)} rows of {', '.join(join)}")
        rows, repeats = lookup(ids, t.column(ID).combine_chunks())
        joined = rows >= 0
        report.notes["join"] = {
            "rows": len(t),
            "matched": int(joined.sum()),
            "repeated_ids": repeats,
        }
        if repeats:
            report.warn(f"--join: {repeats} rows repeat an id of an earlier row: the first is used")
        for col in want:
            got[col] = take_text(t.column(col), rows)
    if evals is not None and time is not None:  # TiC's eval uids are in no training uid file
        e_rows, e_periods = evals
        col = time["column"]
        dates = take_text(e_periods, e_rows)
        got[col] = pc.coalesce(got[col], dates) if col in got else dates
        joined |= e_rows >= 0
    out["joined"] = joined
    out["values"] = got  # by column name: the split's column, categories
    if category_col:
        out["category"] = got[category_col]
    return out


def _time_split(
    cols: dict[str, Any],
    time: dict[str, Any],
    opts: BuildOptions,
    drop: Drops,
    val: int,
    test: int,
    limit: int | None,
) -> Split:
    """TiC-CLIP's split (`TimeSplit` on arrays): one task per period of a date."""
    from cvl.streams.timesplit import DROPS

    t = dict(time)
    col = t.pop("column")
    rule = TimeSplit(
        col,
        Periods.make(t.pop("unit", "year"), t.pop("cuts", None)),
        eval_ids=cols.get("eval_ids"),
        test=test,
        val=val,
        limit=limit,
        seed=opts.seed,
        **{k: v for k, v in t.items() if k != "eval_ids"},
    )
    uniq, inv = _factorize(cols["values"][col])
    code, keys, details = rule.periods_of(uniq)
    period = np.where(drop.keep, code[inv], -9)
    for i, reason in enumerate(DROPS):
        drop(reason, np.flatnonzero(period == -1 - i), lambda p: details[inv[p]])
    period[period < 0] = -1
    held = cols.get("held")
    if held is not None:
        dated = np.flatnonzero((period >= 0) & held)
        rule.note_eval_ids(set(cols["id"].take(dated).to_pylist()))
    if not (period >= 0).any():
        raise CvlError(f"--time-col {col}: no sample has a usable date ({why(drop)})")
    a = rule.split_periods(period, keys, held)
    labels = [rule.p.label(k) for k in keys]
    return Split(rule, rule.task_names(), a.task, a.split, a.drawn, period, labels)


def _column_split(
    cols: dict[str, Any],
    task_col: str,
    opts: BuildOptions,
    drop: Drops,
    val: int,
    test: int,
    limit: int | None,
) -> Split:
    """One task per value of a column (`ColumnSplit` on arrays), in order of first appearance."""
    from cvl.streams.splitrules import ColumnSplit

    uniq, inv = _factorize(cols["values"][task_col])
    names: list[str] = []
    code_of = []
    for v in uniq:
        name = clean_text(v)
        if name is not None and name not in names:
            names.append(name)
        code_of.append(names.index(name) if name is not None else -1)
    task = np.asarray(code_of, dtype=np.int32)[inv]
    drop("missing_task", np.flatnonzero(drop.keep & (task < 0)))
    task = np.where(drop.keep, task, -1)
    split = np.where(task >= 0, TRAIN, -1).astype(np.int8)
    a = column_split(
        task, split, len(names), val=val, test=test, limit=limit, eval_limit=None, seed=opts.seed
    )
    rule = ColumnSplit(
        f"value of column '{task_col}'", limit=limit, val=val, test=test, seed=opts.seed
    )
    rule._seen, rule.unsampled = list(names), a.unsampled
    return Split(rule, names, a.task, a.split, a.drawn)


def _instance_split(
    opts: BuildOptions,
    report: BuildReport,
    drop: Drops,
    chunks: int,
    sample: int | None,
    val: int,
    test: int,
    task_name: str,
) -> Split:
    """IncCLIP's instance split (`InstanceSplit` on arrays), after --sample's seeded draw; the
    training chunks trimmed (seeded) to equal counts."""
    from cvl.streams.splitrules import InstanceSplit

    usable = np.flatnonzero(drop.keep)
    need = None if sample is None else sample + chunks * (val + test)
    sub = usable if need is None else usable[sample_positions(len(usable), need, opts.seed)]
    if need is not None:
        report.notes["sampled"] = {"usable": len(usable), "asked": need, "taken": len(sub)}
    names = [task_name] if chunks == 1 else [f"{task_name}{i}" for i in range(chunks)]
    rule = InstanceSplit(chunks, train=sample, val=val, test=test, seed=opts.seed, names=names)
    a = instance_split(len(sub), chunks, train=sample, val=val, test=test, seed=opts.seed)
    rule.got, rule.unsampled = dict(a.got), a.unsampled
    n = len(drop.keep)
    task, split, drawn = np.full(n, -1, np.int32), np.full(n, -1, np.int8), np.zeros(n, bool)
    task[sub], split[sub], drawn[sub] = a.task, a.split, a.drawn
    bal = balance_chunks(a.task, a.split, chunks, opts.seed)
    if not bal.all():
        least = min(int(((a.split == TRAIN) & (a.task == k) & bal).sum()) for k in range(chunks))
        drop("chunk_balance", sub[~bal], lambda p: f"trimmed to {least} per chunk")
    return Split(rule, names, task, split, drawn)


def _factorize(arr: Any) -> tuple[list[Any], np.ndarray]:
    """Distinct values of a text array (first appearance order, then null) and each sample's
    index among them: what depends on the value alone is computed once per value."""
    d = arr.dictionary_encode()
    uniq = d.dictionary.to_pylist()
    idx = d.indices.fill_null(len(uniq)).to_numpy(zero_copy_only=False)
    return uniq + [None], np.asarray(idx, dtype=np.int64)


# -- command line ------------------------------------------------------------------------------
_OUT_KEYS = ("out", "name", "order", "seed", "shard_size", "overwrite", "quiet")


def _out_options(f):  # noqa: ANN001, ANN202
    """The output options shared with the other sources (no image or download options: no
    image is fetched, resized or re-encoded here)."""
    from cvl.streams.options import BUILD_KEYS, _option_list

    opts = dict(zip(BUILD_KEYS, _option_list()))
    for k in reversed(_OUT_KEYS):
        f = opts[k](f)
    return f


@click.command(SOURCE)
@click.option(
    "--shards",
    "inputs",
    required=True,
    multiple=True,
    metavar="PATH|PATTERN|URL",
    help="The collection: a folder of .tar shards, a .tar, a glob, a brace pattern as "
    "webdataset writes them (/data/cc12m/{00000..01242}.tar), or any fsspec URL "
    "(https://, s3://, gs://: a .tar, a pattern, or a listable folder). Repeatable.",
)
@click.option(
    "--index-prefix",
    default=None,
    metavar="DIR|URL",
    help="Where the shards' index files are, for a read-only collection (`cvl index "
    "--index-prefix`); missing ones are built there [beside the shards].",
)
@click.option(
    "--id-col",
    default=None,
    help="The field of each sample's KEY.json holding its id (DataComp: uid) [the sample's "
    "webdataset key]. --join and --eval-ids are matched on it.",
)
@click.option(
    "--join",
    multiple=True,
    type=click.Path(exists=True),
    help="A table joined on the id, giving the split's column: parquet / CSV / TSV / JSONL "
    "(.gz ok), or TiC-DataComp's uid .npy files or their folder "
    "(tic-datacomp_training_yearly_noeval/: the file's year is the column). Samples in no "
    "row (nor in --eval-ids) are dropped as not_in_join. Repeatable.",
)
@click.option("--join-id-col", default=None, help="The id column of --join [--id-col, else 'key'].")
@click.option(
    "--task-col",
    default=None,
    help="A KEY.json field (or --join column) naming each sample's task: one task per value "
    "(a category or an industry), in order of first appearance.",
)
@click.option(
    "--category-col",
    default=None,
    help="A KEY.json field (or --join column) with a category label (the tasks' categories, "
    "and the copied evaluation samples' for mAP).",
)
@click.option(
    "--limit-per-task",
    default=None,
    type=POSITIVE_INT,
    help="With --task-col or --time-col: at most N training pairs per task (seeded).",
)
@click.option(
    "--task-name",
    default="chunk",
    show_default=True,
    help="Task name with --chunks (chunk0, chunk1, ...; one chunk: the name itself).",
)
@click.option(
    "--copy",
    is_flag=True,
    help="Write the training sets as ordinary shards too (the selected samples' bytes, "
    "unchanged) instead of reading them in place.",
)
@click.option(
    "--processes",
    default=1,
    show_default=True,
    type=POSITIVE_INT,
    help="Processes that read the samples' KEY.json fields and write the copies (threads for a "
    "collection at a URL). Indexing what is not indexed yet uses every core "
    "(CVL_INDEX_PROCESSES).",
)
@time_options
@split_options(1)
@_out_options
def shards_cmd(inputs: tuple[str, ...], join: tuple[str, ...], **kw: Any) -> None:
    """Webdataset shards you already have, split into tasks in place (nothing downloaded or
    copied but the evaluation sets): img2dataset's CC12M / CC3M / LAION, DataComp's shards.

    \b
    Tasks as the other sources make them: --chunks (with --sample, --val, --test: IncCLIP's
    instance split, as cc12m), --time-col (TiC's periods, as table), --task-col (one task per
    value); the column is a KEY.json field or a --join table's. See datasets/cc12m.md and
    datasets/tic-datacomp.md.
      cvl build-stream shards --shards '/data/cc12m/{00000..01242}.tar' --chunks 5 \\
          --sample 2500000 --test 5000 --out streams/cc12m-5
    TiC-DataComp from DataComp's shards and TiC's uid files (7 yearly steps, 2014-2016 first):
      cvl build-stream shards --shards /data/datacomp/medium/shards --id-col uid \\
          --join tic-datacomp_training_yearly_noeval --time-col year --first-until 2016 \\
          --until 2022 --eval-ids tic-datacomp_retrieval_evals_year2uids.json \\
          --out streams/tic-datacomp
    """
    time = time_spec(kw)
    opts = build_options(kw)  # the output options (and --processes); the rest is the split's
    m = build_shards(list(inputs), opts, join=list(join), time=time, **kw)
    finish(m, str(opts.out), quiet=not opts.progress)
