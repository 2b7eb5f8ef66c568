"""`cvl index`: write, check or repair the sample index of a stream's shards (or of any
webdataset collection) once, ahead of training: e.g. before a stream is copied to an object
store, whose readers cannot write beside the shards; at a collection's scale split over
machines (`--part`). It is also the repair every error about an index names."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

PART_FILE = "cvl-index-part-{i}-of-{n}.json"
SUMMARY_FILE = "cvl-index-summary.json"


def _part(text: str | None) -> tuple[int, int] | None:
    from cvl.errors import CvlError

    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise CvlError(
            f"--part {text}: give I/N with 0 <= I < N (e.g. $SLURM_PROCID/$SLURM_NTASKS)"
        )
    return i, n


@click.command("index")
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--part",
    default=None,
    metavar="I/N",
    help="Index only part I of N (0 <= I < N) of the shards: every N-th shard in path order, "
    "from the I-th; one part per machine (e.g. --part $SLURM_PROCID/$SLURM_NTASKS). Each part "
    "writes its summary (cvl-index-part-I-of-N.json); a last `cvl index PATHS` without --part "
    "merges them into cvl-index-summary.json (and indexes any shard a part left out).",
)
@click.option(
    "--index-prefix",
    default=None,
    metavar="DIR|URL",
    help="Write the index files under this folder or URL instead of beside the shards, at each "
    "shard's path relative to the collection's root (recorded in DIR/cvl-index.json): for "
    "read-only folders and buckets. Give the same prefix to `cvl build-stream shards`.",
)
@click.option("--force", is_flag=True, help="Rebuild every index, even those that prove sound.")
@click.option("--quiet", is_flag=True, help="No progress bar (the summary line still prints).")
def index_cmd(
    paths: tuple[str, ...], part: str | None, index_prefix: str | None, force: bool, quiet: bool
) -> None:
    """Index every shard of PATHS: stream folders, folders of .tar shards, .tar files, globs,
    brace patterns (/data/cc12m/{00000..01242}.tar) or URLs (https://, s3://, gs://; a shard
    at a URL is read through once). An index that exists is kept only once it proves it
    belongs to its tar (its rows file's SHA-1 and the tar headers of rows spread over the
    shard); a missing, broken or stale one is rebuilt, and the shards rebuilt are named;
    --force rebuilds all. The others are indexed in parallel, with progress and rate. For a
    stream folder it also writes STREAM/shards.idx.json (every shard's summary), with which a
    copy of the stream served from HTTP(S), S3 or GCS starts with one request. Training and
    evaluation index local shards by themselves; this does it ahead of time, e.g. before a
    stream is served from a URL, where the `.idx.npy` / `.idx.json` files must lie beside the
    shards or under --index-prefix."""
    from cvl.data.index import ensure_indexed, is_remote
    from cvl.data.shardindex import REBUILT
    from cvl.data.shardlist import collection_root, list_shards, use_prefix
    from cvl.errors import CvlError
    from cvl.progress import progress_bar
    from cvl.streams.manifest import MANIFEST

    shards = list_shards([s for p in paths for s in _stream_shards(p)])
    streams = [p for p in paths if os.path.isfile(os.path.join(p, MANIFEST))]
    if index_prefix:  # where the summaries go: the prefix, the stream, the collection's root
        use_prefix(index_prefix, shards)
        where = index_prefix if is_remote(index_prefix) else os.path.abspath(index_prefix)
    else:
        where = os.path.abspath(streams[0]) if streams else collection_root(shards)
    if is_remote(where) and where.split("://", 1)[0] in ("http", "https"):
        raise CvlError(
            f"{where}: an HTTP server takes no index files: give --index-prefix DIR (a folder, "
            "or an s3:// / gs:// prefix) and the same prefix to the commands that read them"
        )
    pn = _part(part)
    mine = sorted(shards)[pn[0] :: pn[1]] if pn else shards
    bar = progress_bar(total=len(mine), unit="shard", desc="indexing", show=not quiet)
    counted = {"shards": 0, "samples": 0}

    def done(d: dict[str, Any]) -> None:
        counted["shards"] += 1
        counted["samples"] += int(d["count"])
        bar.update(1)
        dt = max(time.monotonic() - t0, 1e-9)
        bar.set_postfix_str(f"{counted['samples'] / dt:,.0f} samples/s")

    t0 = time.monotonic()
    REBUILT.clear()
    summaries = ensure_indexed(mine, full=True, force=force, remote=True, done=done)
    bar.update(len(mine) - bar.n)
    bar.close()
    secs = time.monotonic() - t0
    stats = _stats(summaries)
    stats.update(
        shards=len(mine),
        indexed_now=counted["shards"],
        seconds=round(secs, 3),
        indexed_samples_per_s=round(counted["samples"] / secs, 1) if secs > 0 else None,
    )
    if pn:
        stats["part"] = f"{pn[0]}/{pn[1]}"
        _write(f"{where}/{PART_FILE.format(i=pn[0], n=pn[1])}", stats)
    else:  # the parts' summaries, when machines indexed in parts, merged into one file
        stats["parts"] = _merge(where)
        if stats["parts"]:
            _write(f"{where}/{SUMMARY_FILE}", stats)
    for s in mine:
        if s in REBUILT:
            click.echo(f"rebuilt {s}: {REBUILT[s]}")
    rebuilt = len(mine) if force else len([s for s in mine if s in REBUILT])
    click.echo(
        f"indexed {len(mine)} shard(s)"
        + (f" (part {part})" if pn else "")
        + f": {len(mine) - counted['shards']} kept (proved), {rebuilt} rebuilt, "
        f"{counted['shards'] - rebuilt} new; {stats['samples']} usable samples, "
        f"{stats['left_out']} left out; {counted['shards']} indexed now in {secs:.1f} s"
        + (
            f" ({counted['shards'] / secs:.2f} shards/s, {counted['samples'] / secs:,.0f} samples/s)"
            if counted["shards"] and secs > 0
            else ""
        )
    )
    if not pn:
        from cvl.streams.manifest import load_manifest
        from cvl.streams.streamfiles import write_index_summary

        for p in streams:
            out = write_index_summary(load_manifest(p), p)
            if out is not None:
                click.echo(f"wrote {out}")


def _stream_shards(path: str) -> list[str]:
    """A stream folder's shards by its manifest (a task built in place: its source shards, which
    a walk of the folder would not reach), else the path as given."""
    from cvl.streams.manifest import MANIFEST, load_manifest
    from cvl.streams.streamfiles import task_files

    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return [path]
    m = load_manifest(path)
    out = [str(s) for t in m.task_order for s in task_files(m, t) if str(s).endswith(".tar")]
    out += [str(s) for n, e in m.eval_sets.items() for t in e.tasks for s in m.eval_shards(n, t)]
    out += [str(s) for b in m.benchmarks for s in m.benchmark_shards(b)]
    return out


def _stats(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    from collections import Counter

    left: Counter = Counter(r for d in summaries for _, r in d.get("skipped", ()))
    return {
        "samples": sum(int(d["count"]) for d in summaries),
        "left_out": sum(left.values()),
        "left_out_by_reason": dict(left),
        "tar_bytes": sum(int(d.get("tar_bytes") or 0) for d in summaries),
    }


def _merge(where: str) -> list[dict[str, Any]]:
    """The parts' summaries found in `where` (their files removed: merged into the summary)."""
    from cvl.data.index import is_remote

    if is_remote(where):
        from cvl.data.remote import fs_of

        fs, path = fs_of(where)
        names = [str(f).rsplit("/", 1)[-1] for f in fs.ls(path, detail=False)]
    else:
        names = os.listdir(where) if os.path.isdir(where) else []
    parts = []
    for name in sorted(names):
        if name.startswith("cvl-index-part-") and name.endswith(".json"):
            f = f"{where}/{name}"
            parts.append(json.loads(_read(f)))
            _remove(f)
    return parts


def _read(path: str) -> str:
    from cvl.data.index import is_remote

    if is_remote(path):
        from cvl.data.remote import read_bytes

        return read_bytes(path).decode("utf-8")
    return Path(path).read_text(encoding="utf-8")


def _remove(path: str) -> None:
    from cvl.data.index import is_remote

    if is_remote(path):
        from cvl.data.remote import fs_of

        fs, p = fs_of(path)
        fs.rm(p)
    else:
        os.unlink(path)


def _write(path: str, d: dict[str, Any]) -> None:
    """Write a summary, unless its folder is a local one this process cannot write (a
    read-only collection indexed into the cache: the printed line is the summary)."""
    from cvl.data.index import is_remote
    from cvl.data.shardlist import _write as write

    if is_remote(path) or os.access(os.path.dirname(path), os.W_OK):
        write(path, d)
