"""Naming a webdataset collection: folders, brace patterns, globs and URLs -> the shard list.

`cvl index` and `cvl build-stream shards` take a collection as its users already name it:

- a local folder (every ``*.tar`` under it, sorted), a ``.tar`` file, a glob (``/data/*.tar``);
- a brace pattern as webdataset and img2dataset write them (``/data/cc12m/{00000..01242}.tar``,
  also ``{a,b}``), every name of which must exist;
- any fsspec URL (``https://``, ``s3://``, ``gs://``): a ``.tar``, a brace pattern, or a folder
  the filesystem can list (object stores; an HTTP server's directory page).

The order is the order given, each folder or glob sorted, each pattern in its own order: it
defines the positions a stream's row selection counts in. The collection's *root* is the
deepest folder (or URL prefix) holding every shard: the name under which `--index-prefix`
keeps each shard's index.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from cvl.data.index import is_remote
from cvl.errors import CvlError

PREFIX_FILE = "cvl-index.json"  # in an index prefix: the collection root it indexes


def list_shards(inputs: list[str] | tuple[str, ...]) -> list[str]:
    """The shards the inputs name (module doc), absolute paths or URLs, each once, in order."""
    out: dict[str, None] = {}
    for raw in inputs:
        for s in _expand(str(raw)):
            out.setdefault(s, None)
    if not out:
        raise CvlError("no shards given")
    return list(out)


def _expand(text: str) -> list[str]:
    from braceexpand import braceexpand

    names = list(braceexpand(text)) if "{" in text else [text]
    if is_remote(text):
        if len(names) > 1 or text.endswith(".tar"):
            return names
        return _remote_folder(text)
    if len(names) > 1:
        missing = [n for n in names if not os.path.isfile(n)]
        if missing:
            raise CvlError(
                f"{text}: {len(missing)} of {len(names)} shards are missing (e.g. {missing[0]})"
            )
        return [os.path.abspath(n) for n in names]
    p = Path(text)
    if any(c in text for c in "*?["):
        found = sorted(glob.glob(text, recursive=True))
        tars = [os.path.abspath(f) for f in found if f.endswith(".tar") and os.path.isfile(f)]
        if not tars:
            raise CvlError(f"{text}: matches no .tar shard")
        return tars
    if p.is_file():
        if p.suffix != ".tar":
            raise CvlError(f"{p}: not a .tar shard")
        return [os.path.abspath(p)]
    if p.is_dir():
        found = sorted(str(f.absolute()) for f in p.rglob("*.tar"))
        if not found:
            raise CvlError(f"{p}: no .tar shards in it")
        return found
    raise CvlError(f"{p}: no such file or folder")


def _remote_folder(url: str) -> list[str]:
    from cvl.data.remote import fs_of

    fs, path = fs_of(url)
    proto = url.split("://", 1)[0]
    try:
        found = fs.find(path) if proto not in ("http", "https") else fs.ls(path, detail=False)
    except Exception as e:  # noqa: BLE001 - any listing failure is the same one-line error
        raise CvlError(f"{url}: cannot list it ({type(e).__name__}: {e})") from None
    tars = sorted(str(f) for f in found if str(f).endswith(".tar"))
    tars = [f if "://" in f else f"{proto}://{f}" for f in tars]
    if not tars:
        raise CvlError(
            f"{url}: lists no .tar shard (name them with a pattern: {url.rstrip('/')}/"
            "{00000..00099}.tar)"
        )
    return tars


def collection_root(shards: list[str]) -> str:
    """The deepest folder or URL prefix holding every shard (module doc)."""
    remote = {is_remote(s) for s in shards}
    if len(remote) > 1:
        raise CvlError("the shards mix local paths and URLs: give one collection at a time")
    if remote.pop():
        parts = [s.split("/")[:-1] for s in shards]
        common = parts[0]
        for p in parts[1:]:
            n = 0
            while n < min(len(common), len(p)) and common[n] == p[n]:
                n += 1
            common = common[:n]
        if len(common) < 3:  # scheme:, '', host
            raise CvlError("the shard URLs share no host: give one collection at a time")
        return "/".join(common)
    return os.path.commonpath([os.path.dirname(s) for s in shards])


def claim_prefix(prefix: str, root: str) -> None:
    """Record in `prefix` the collection root it indexes (`PREFIX_FILE`), or check that it is
    that root's: two collections never share a prefix."""
    have = prefix_root(prefix)
    if have is not None and have != root:
        raise CvlError(
            f"--index-prefix {prefix} holds the index of {have}, not of {root} (name the "
            "collection as before, or give another prefix)"
        )
    if have is None:
        _write(
            f"{prefix.rstrip('/')}/{PREFIX_FILE}", {"schema": "cvl.index-prefix/1", "root": root}
        )


def prefix_root(prefix: str) -> str | None:
    """The collection root an index prefix holds (None: a new prefix)."""
    path = f"{prefix.rstrip('/')}/{PREFIX_FILE}"
    try:
        if is_remote(path):
            from cvl.data.remote import read_bytes

            d = json.loads(read_bytes(path))
        else:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
    except FileNotFoundError:
        return None
    except CvlError as e:
        if "not found" in str(e):
            return None
        raise
    except (OSError, ValueError) as e:
        raise CvlError(f"{path}: not an index prefix's record ({e})") from None
    return str(d.get("root")) if isinstance(d, dict) and d.get("root") else None


def _write(path: str, d: dict) -> None:
    data = json.dumps(d, indent=1)
    if is_remote(path):
        import fsspec

        with fsspec.open(path, "w") as f:
            f.write(data)
        return
    from cvl.io import write_json

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_json(Path(path), d)


def use_prefix(prefix: str, shards: list[str]) -> str:
    """Read the index of `shards` under `prefix` (`cvl.data.index.use_index_prefix`), rooted at
    the root recorded there, else at the shards' own root (recorded now). Returns the root."""
    from cvl.data.index import use_index_prefix

    prefix = prefix if is_remote(prefix) else os.path.abspath(prefix)
    root = prefix_root(prefix) or collection_root(shards)
    outside = [s for s in shards if not s.startswith(root.rstrip("/") + "/")]
    if outside:
        raise CvlError(
            f"{outside[0]}: outside the collection {root} that --index-prefix {prefix} indexes"
        )
    claim_prefix(prefix, root)
    use_index_prefix(root, prefix)
    return root
