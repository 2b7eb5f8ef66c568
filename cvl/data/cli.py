"""`cvl index`: write the sample index of a stream's shards (or of any webdataset tars) once,
ahead of training: e.g. before a stream is copied to an object store, whose readers cannot
write beside the shards."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("index")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
def index_cmd(paths: tuple[str, ...]) -> None:
    """Index every shard of the streams, folders or .tar files PATHS (in parallel; shards
    already indexed are kept). Training and evaluation index what is missing by themselves;
    this does it ahead of time, e.g. before a stream is served from HTTP(S), S3 or GCS, where
    the shards' `.idx.npy` / `.idx.json` files must lie beside them."""
    from cvl.data.index import ensure_indexed
    from cvl.errors import CvlError
    from cvl.streams.manifest import MANIFEST

    shards: list[str] = []
    for p in map(Path, paths):
        if p.is_file() and p.suffix == ".tar":
            shards.append(str(p.absolute()))
        elif p.is_dir():
            found = sorted(p.rglob("*.tar"))
            if not found:
                raise CvlError(f"{p}: no .tar shards in it")
            shards += [str(s.absolute()) for s in found]
        else:
            raise CvlError(f"{p}: not a stream folder ({MANIFEST}), a folder or a .tar shard")
    summaries = ensure_indexed(shards)
    n = sum(int(d["count"]) for d in summaries)
    left = sum(len(d.get("skipped", ())) for d in summaries)
    click.echo(f"indexed {len(shards)} shard(s): {n} usable samples, {left} left out")
