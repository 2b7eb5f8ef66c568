"""A model's weights on disk: `save_weights` / `load_weights` (safetensors; the merged weights
under their plain names for a `--tune lora/dora` model) and `is_cvl_checkpoint`.

Kept out of the factory (`cvl.models`) so that the architectures (clip.py, fusion.py), which
load a cvl model file as their `pretrained`, need not import the package that builds them.
`cvl.models` re-exports `save_weights` and `load_weights`; callers look them up there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from cvl.errors import CvlError
from cvl.writes import honour_umask

if TYPE_CHECKING:  # torch is imported lazily so that `cvl --help` stays fast
    import torch

    from cvl.models.base import VLModel


def save_weights(
    model: VLModel, path: str | os.PathLike, state: dict[str, torch.Tensor] | None = None
) -> None:
    """Write the model's weights (safetensors, shared/tied tensors once), atomically.

    `state`: the whole weights of a sharded model (`cvl.train.fsdp.full_state`, tied tensors
    already dropped), written under the same names and metadata as the model's own."""
    import tempfile

    from safetensors.torch import save_file, save_model

    from cvl.models.tune import dedupe_shared, effective_state, has_adapters

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    meta = {"format": "pt", "cvl_kind": str(getattr(model, "kind", ""))}
    try:
        if state is not None:  # a sharded model's, gathered
            from cvl.models.sharded import tied_names

            dropped = {k: v for k, v in tied_names(model).items() if k not in state}
            save_file(state, tmp, metadata={**dropped, **meta})
        elif has_adapters(model):  # --tune lora/dora: the merged weights under their plain names
            sd, dropped = dedupe_shared(effective_state(model))
            save_file({k: v.cpu() for k, v in sd.items()}, tmp, metadata={**dropped, **meta})
        else:
            save_model(model, tmp, metadata=meta)
        canonical_header(tmp)  # sorted metadata: the same tensors give the same bytes
        honour_umask(tmp)  # safetensors writes 0600 whatever the umask
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def canonical_header(path: str | os.PathLike) -> None:
    """Rewrite a safetensors file's JSON header with its keys sorted, in place.

    safetensors keeps `__metadata__` in a Rust HashMap whose order changes from one map to
    the next, so the same tensors and metadata gave other bytes on every save; sorted, the
    same tensors give the same bytes (checksums and the evaluation's same-bytes reuse hold).
    The header is padded with spaces to its old length (the same keys and values, only
    reordered, never take more room), so the tensor data is not rewritten."""
    import json
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        raw = text.encode("utf-8")
        if len(raw) > n:  # never for a file safetensors wrote (same content, compact)
            raise ValueError(f"{path}: sorted safetensors header is longer than the original")
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))


def load_weights(model: VLModel, path: str | os.PathLike) -> None:
    """Load weights written by `save_weights`; every key must match (clear error otherwise)."""
    from safetensors.torch import load_model

    path = Path(path)
    if not path.is_file():
        raise CvlError(f"{path}: weights file not found")
    from cvl.models.tune import assign_, has_adapters

    try:
        from cvl.models.sharded import is_sharded, load_state_

        if is_sharded(model):  # --fsdp: each process takes its slice of every tensor
            from safetensors.torch import load_file

            missing, unexpected = load_state_(model, load_file(str(path)))
        elif has_adapters(model):  # --tune lora/dora: the weights become the adapted ones' base
            from safetensors.torch import load_file

            missing, unexpected = assign_(model, load_file(str(path)))
        else:
            missing, unexpected = load_model(model, str(path), strict=False)
    except RuntimeError as e:  # shape mismatch
        lines = [ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln]
        detail = lines[0] if lines else str(e).splitlines()[0]
        raise CvlError(f"{path}: weights do not fit this model ({detail[:300]})") from None
    except Exception as e:  # not a safetensors file
        raise CvlError(
            f"{path}: cannot read weights ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(sorted(missing)[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(sorted(unexpected)[:3])})")
        raise CvlError(f"{path}: weights do not match this model: {'; '.join(parts)}")


def is_cvl_checkpoint(path: Path) -> bool:
    """A safetensors file written by `save_weights`."""
    if path.suffix != ".safetensors" or not path.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return bool((f.metadata() or {}).get("cvl_kind"))
    except Exception:
        return False
