"""`cvl index`: write, check or repair the sample index of a stream's shards (or of any
webdataset tars) ahead of training: e.g. before a stream is copied to an object store, whose
readers cannot write beside the shards."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("index")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--force", is_flag=True, help="Rebuild every index, even those that prove sound.")
def index_cmd(paths: tuple[str, ...], force: bool) -> None:
    """Index every shard of the streams, folders or .tar files PATHS (in parallel).

    An index that exists is kept only once it proves it belongs to its tar (its rows file's
    SHA-1 and the tar headers of rows spread over the shard); a missing, broken or stale one
    is rebuilt, and the shards rebuilt are named. `--force` rebuilds all. For a stream folder
    it also writes STREAM/shards.idx.json (every shard's summary), with which a copy of the
    stream served from HTTP(S), S3 or GCS starts with one request. Training and evaluation
    index what is missing by themselves; this does it ahead of time, and is the repair every
    error about an index names."""
    from cvl.data.shardindex import REBUILT, ensure_indexed, index_files
    from cvl.errors import CvlError
    from cvl.streams.manifest import MANIFEST, load_manifest, write_index_summary

    shards: list[str] = []
    streams = []
    for p in map(Path, paths):
        if p.is_file() and p.suffix == ".tar":
            shards.append(str(p.absolute()))
        elif p.is_dir():
            found = sorted(p.rglob("*.tar"))
            if not found:
                raise CvlError(f"{p}: no .tar shards in it")
            shards += [str(s.absolute()) for s in found]
            if (p / MANIFEST).is_file():
                streams.append(p)
        else:
            raise CvlError(f"{p}: not a stream folder ({MANIFEST}), a folder or a .tar shard")
    shards = list(dict.fromkeys(shards))
    before = {s for s in shards if Path(index_files(s)[1]).exists()}
    REBUILT.clear()
    summaries = ensure_indexed(shards, full=True, force=force)
    for s in shards:
        if s in REBUILT:
            click.echo(f"rebuilt {s}: {REBUILT[s]}")
    n = sum(int(d["count"]) for d in summaries)
    left = sum(len(d.get("skipped", ())) for d in summaries)
    rebuilt = len(shards) if force else len(REBUILT)
    new = len([s for s in shards if s not in before and s not in REBUILT]) if not force else 0
    kept = len(shards) - rebuilt - new
    click.echo(
        f"indexed {len(shards)} shard(s): {kept} kept (proved), {rebuilt} rebuilt, {new} new; "
        f"{n} usable samples, {left} left out"
    )
    for p in streams:
        out = write_index_summary(load_manifest(p), p)
        if out is not None:
            click.echo(f"wrote {out}")
