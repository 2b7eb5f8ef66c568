"""The `cvl` command line: a thin click group; each area owns its subcommands.

Errors the user can fix (`CvlError`, bad options: click's usage errors too) print one line
`error: ...` and exit with code 2;
nothing prints a traceback unless `CVL_DEBUG=1`.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from cvl import __version__
from cvl.errors import CvlError

# (module, attribute) of every subcommand, in the order `cvl --help` lists them.
SUBCOMMANDS = [
    ("cvl.streams.cli", "build_stream"),
    ("cvl.streams.pseudolabel", "pseudo_label"),
    ("cvl.train.cli", "train"),
    ("cvl.evaluation.cli", "eval_cmd"),
    ("cvl.analysis.cli", "analyze"),
    ("cvl.info", "info"),
    ("cvl.data.cli", "index_cmd"),
    ("cvl.methods.cli", "methods"),
    ("cvl.models.cli", "export"),
]


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


@click.group(
    cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, prog_name="cvl")
def cli() -> None:
    """cvl: continual vision-language pretraining.

    \b
    Typical pipeline:
      cvl build-stream synthetic --out streams/synth      # or p9d, cc12m, coco, ...
      cvl train --stream streams/synth --method seqft --out runs/a
      cvl eval --run runs/a
      cvl analyze rotation --run runs/a

    Each step reads only what the earlier steps wrote; see `cvl COMMAND --help`.
    """


for _mod, _attr in SUBCOMMANDS:
    try:
        cli.add_command(getattr(importlib.import_module(_mod), _attr))
    except ModuleNotFoundError as _e:  # an area not installed in this checkout
        if not (_e.name or "").startswith("cvl"):
            raise


def one_line(text: str) -> str:
    """A message on one line (click wraps some of its own)."""
    return " ".join(str(text).split())


def _help_hint(e: click.ClickException) -> str:
    """Where a usage error's command explains its options: ` (see `cvl train --help`)`."""
    ctx = getattr(e, "ctx", None)
    return f" (see `{ctx.command_path} --help`)" if ctx is not None else ""


# What torch's gloo and NCCL backends say when the other end of a collective is gone.
_PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)


def _peer_lost(e: BaseException) -> bool:
    """A distributed collective failed because another process of the launch is gone."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and any(p in str(e) for p in _PEER_LOST)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    debug = os.environ.get("CVL_DEBUG") == "1"
    from cvl.lock import held_locks, release_all, set_command

    set_command(["cvl", *(sys.argv[1:] if argv is None else argv)])  # named in folder locks
    held = held_locks()
    try:
        rv = cli.main(args=argv, prog_name="cvl", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as e:
        if debug:
            raise
        click.echo(f"error: {one_line(e.format_message())}{_help_hint(e)}", err=True)
        return 2
    except CvlError as e:
        if debug:
            raise
        click.echo(f"error: {e}", err=True)
        return 2
    except OSError as e:  # the filesystem refused a write (full, read-only, ...): one line
        from cvl.io import permission_message, write_failure, write_failure_message

        if not debug and isinstance(e, PermissionError):  # an input others made unreadable
            click.echo(f"error: {permission_message(e)}", err=True)
            return 2
        if debug or not write_failure(e):
            raise
        click.echo(f"error: {write_failure_message(e, e.filename or 'a file', None)}", err=True)
        return 2
    except RuntimeError as e:  # a collective whose peer died (its node lost): one line
        if debug or not _peer_lost(e):
            raise
        click.echo(
            "error: another process of this run stopped (its node died, was killed or lost the "
            f"network: {one_line(str(e).split(']', 1)[-1])[:160]}); once every node is back, "
            "rerun the same command on each to resume from the last checkpoint",
            err=True,
        )
        return 2
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    finally:
        release_all(keep=held)  # the folder locks the command took end with it


if __name__ == "__main__":
    sys.exit(main())
