"""Checkpoint files: weights and method state in safetensors, the rest in JSON.

Method state is a nested dict of tensors and JSON values; `save_state` flattens it into
`NAME.safetensors` (tensors, keys joined by '/') + `NAME.json` (everything else), and
`load_state` rebuilds the same nesting. Optimizer/scheduler states are saved with
`torch.save` and always loaded with `weights_only=True` (no pickle execution).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from cvl.io import read_json, write_json

_TENSOR = "__tensor__"


def _split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = prefix or "_"
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        return {
            str(k): _split(v, f"{prefix}/{k}" if prefix else str(k), tensors)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [_split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def save_state(folder: str | os.PathLike, name: str, state: dict[str, Any]) -> None:
    """Write `folder/name.safetensors` + `folder/name.json` (the same state, the same bytes)."""
    from cvl.models.weights import canonical_header

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "", tensors)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    canonical_header(folder / f"{name}.safetensors")
    write_json(folder / f"{name}.json", skeleton)


def load_state(folder: str | os.PathLike, name: str) -> dict[str, Any]:
    """Inverse of `save_state` (empty dict if the files do not exist)."""
    folder = Path(folder)
    if not (folder / f"{name}.json").is_file():
        return {}
    tensors = (
        load_file(str(folder / f"{name}.safetensors"))
        if (folder / f"{name}.safetensors").is_file()
        else {}
    )
    return _join(read_json(folder / f"{name}.json"), tensors)


def state_copy(state: dict[str, Any]) -> dict[str, Any]:
    """What `save_state` then `load_state` would give back, in memory (tensors cloned to the
    CPU, JSON values round-tripped): a snapshot a method can be restored from as on resume."""
    import json

    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.loads(json.dumps(_split(state, "", tensors)))
    return _join(skeleton, tensors)


class _Writer:
    """A file torch.save writes through, keeping the OSError of a failed write: torch's own
    writer reports it only as `RuntimeError: ... unexpected pos N vs M`, which says nothing
    of a full disk (`cvl.io.write_failure` needs the errno)."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_torch(path: str | os.PathLike, obj: Any) -> None:
    """torch.save to `path` (streamed, not built in memory); a write the filesystem refuses
    raises its OSError (ENOSPC, EFBIG, ...), not torch's RuntimeError."""
    with open(path, "wb") as f:
        w = _Writer(f)
        try:
            torch.save(obj, w)
        except RuntimeError:
            if w.error is not None:
                raise w.error from None
            raise


def load_torch(path: str | os.PathLike) -> Any:
    return torch.load(str(path), map_location="cpu", weights_only=True)
