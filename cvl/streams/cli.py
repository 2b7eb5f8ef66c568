"""`cvl build-stream SOURCE ...`: one subcommand per source, all writing the same format.

Each source module owns its command (options, help, call of its builder); this module only
lists them. Adding a source = one file defining a click command + one line in `SOURCES`.
Commands are imported on first use, so `cvl build-stream coco` does not import the URL
downloader and `cvl --help` stays fast.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import click

from cvl.streams.options import echo_summary  # noqa: F401  (kept importable from here)

# (command name, module, attribute) in the order `cvl build-stream --help` lists them.
SOURCES: list[tuple[str, str, str]] = [
    ("synthetic", "cvl.streams.synthetic", "synthetic_cmd"),
    ("p9d", "cvl.streams.p9d", "p9d_cmd"),
    ("cc12m", "cvl.streams.cc", "cc12m_cmd"),
    ("cc3m", "cvl.streams.cc", "cc3m_cmd"),
    ("wit", "cvl.streams.wit", "wit_cmd"),
    ("goodnews", "cvl.streams.goodnews", "goodnews_cmd"),
    ("table", "cvl.streams.table", "table_cmd"),
    ("shards", "cvl.streams.shards", "shards_cmd"),
    ("coco", "cvl.streams.karpathy", "coco_cmd"),
    ("flickr30k", "cvl.streams.karpathy", "flickr30k_cmd"),
    ("rsicd", "cvl.streams.karpathy", "rsicd_cmd"),
    ("ec", "cvl.streams.ec", "ec_cmd"),
    ("iapr", "cvl.streams.iapr", "iapr_cmd"),
    ("compose", "cvl.streams.compose", "compose_cmd"),
    ("protocol", "cvl.streams.protocols", "protocol_cmd"),
    ("class-split", "cvl.streams.classsplit", "class_split_cmd"),
    ("classification", "cvl.streams.classification", "classification_cmd"),
    ("synthetic-classes", "cvl.streams.synthetic_folders", "synthetic_classes_cmd"),
]


class _SourceGroup(click.Group):
    """Lists `SOURCES` in order and imports a source's module only when it is needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name, _, _ in SOURCES]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        for cname, mod, attr in SOURCES:
            if cname == name:
                cmd = getattr(importlib.import_module(mod), attr)
                cmd.name = cname
                return guarded(cmd)
        return None


def guarded(cmd: click.Command) -> click.Command:
    """A source command that, before any work, locks its --out (one build per stream folder at
    a time, `cvl.lock`) and refuses an existing --out unless --overwrite may replace it: cvl
    wrote it as a stream and it holds none of the command's path arguments (`check_overwrite`).
    """
    if getattr(cmd, "_cvl_guarded", False) or cmd.callback is None:
        return cmd
    inner = cmd.callback
    paths = [p.name for p in cmd.params if isinstance(p.type, click.Path) and p.name != "out"]

    @functools.wraps(inner)
    def run(*args: Any, **kw: Any) -> Any:
        from cvl.errors import CvlError
        from cvl.io import check_overwrite
        from cvl.lock import FolderLock

        out = kw.get("out")
        if not out:
            return inner(*args, **kw)
        with FolderLock(out):
            if Path(out).exists():
                if not kw.get("overwrite"):
                    raise CvlError(
                        f"{Path(out).absolute()} exists (pass --overwrite to replace it)"
                    )
                inputs = []
                for n in paths:
                    v = kw.get(n)
                    inputs += list(v) if isinstance(v, (list, tuple)) else [v]
                check_overwrite(out, "stream", inputs)
            return inner(*args, **kw)

    cmd.callback = run
    cmd._cvl_guarded = True  # type: ignore[attr-defined]
    return cmd


@click.group("build-stream", cls=_SourceGroup)
def build_stream() -> None:
    """Build a stream folder (stream.json + webdataset shards) from a source.

    Every source writes the same manifest format (`cvl.stream/1`, see datasets/README.md),
    into a temporary folder renamed into place when complete: an interrupted build leaves
    nothing half-written. An existing output folder is refused unless --overwrite.

    \b
    URL/file lists: p9d, cc12m, cc3m, wit, goodnews, table (downloads through img2dataset).
    Webdataset shards you already have, split in place (nothing copied): shards.
    Archives on disk: coco, flickr30k, rsicd (Karpathy JSON), ec (MUGE TSVs), iapr.
    Several streams as one: compose; a paper's benchmark in one command: protocol.
    Class-incremental tasks from labels (`cvl pseudo-label` or categories): class-split.
    Labelled image datasets as tasks (MTIL, X-TAIL): classification (stand-in image
    folders to try it on: synthetic-classes).
    """
