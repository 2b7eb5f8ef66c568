"""What `cvl eval` (and `cvl analyze`) can be told, and which of it changes the numbers.

`EvalOptions.key_fields()` are the options that enter the per-checkpoint cache key (they change
a number: the hit rule, the probe's size, the embedding precision ...); where and how fast the
evaluation runs (device, loader workers, batch size, the image store's memory, progress bars)
does not. The click options shared by the model-running commands outside training live here
too (`--device` and `--deterministic` are `cvl.device`'s).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from cvl.checks import WORKERS

PRECISIONS = ("no", "bf16", "fp16")
PRECISION_NOTES = {
    "no": "float32 embedding passes (exact)",
    "bf16": "image and text encoders under bfloat16 autocast; features stored in float32",
    "fp16": "image and text encoders under float16 autocast; features stored in float32",
}
DEFAULT_IMAGE_CACHE_MB = 4096

# Options that do not change a number: left out of the cache key.
NOT_IN_KEY = (
    "tasks",
    "batch_size",
    "force",
    "progress",
    "block_elems",
    "init",
    "stream",
    "image_cache_mb",
    "device",
    "workers",
    "deterministic",
)


@dataclass
class EvalOptions:
    """Everything `cvl eval` can change; `key_fields()` enter the cache key."""

    stream: str | None = None
    tasks: str = "all"
    batch_size: int = 256
    match: str = "auto"  # auto | pair | text
    ties: str = "pessimistic"
    map_feature: str = "auto"  # auto | fusion | image+text | image | text
    zeroshot: bool = True
    zs_templates: str | None = None  # None: synthetic streams -> "synthetic", else "imagenet"
    zs_folders: tuple[str, ...] = ()
    probe: bool = True
    probe_train: int = 500
    init: bool = True
    cumulative: bool = True
    force: bool = False
    progress: bool = True
    block_elems: int | None = None  # scores per retrieval block; None = retrieval.py's default
    image_cache_mb: int = DEFAULT_IMAGE_CACHE_MB
    precision: str = "no"  # no | bf16 | fp16: autocast of the embedding passes
    device: str = "auto"  # auto | cpu | cuda | cuda:N (one process; see cvl.device)
    workers: int = -1  # loader worker processes; -1 = auto (cvl.data.reader.default_workers)
    deterministic: bool | None = None  # None = the device's default (cvl.device)
    extra: dict[str, Any] = field(default_factory=dict)

    def key_fields(self) -> dict[str, Any]:
        d = asdict(self)
        for k in NOT_IN_KEY:
            d.pop(k)
        if d["precision"] == "no":  # caches written before --precision existed stay valid
            d.pop("precision")
        d["zs_folders"] = [str(Path(f).absolute()) for f in self.zs_folders]
        return d

    def report_fields(self) -> dict[str, Any]:
        """The settings a metrics.json's numbers depend on (recorded in it as "settings"): the
        cache key's options and whether the initial weights were evaluated (the zero-shot
        row, FWT). `cvl eval --compare` reuses a run's metrics.json only when they match."""
        return json.loads(json.dumps({**self.key_fields(), "init": self.init}, default=str))


def settings_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """'name: old -> new' for every setting that differs between two `report_fields()`."""
    if old is None:
        return ["settings: not recorded (an older cvl wrote it)"]
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def resolve_workers(workers: int, accelerator: Any = None) -> int:
    """`--workers`: as given when >= 0, else training's auto rule (CPUs per local process)."""
    if workers >= 0:
        return workers
    from cvl.data.reader import default_workers

    procs = accelerator.num_processes if accelerator is not None else 1
    return default_workers(int(os.environ.get("LOCAL_WORLD_SIZE", procs)))


def workers_option(f: Callable) -> Callable:
    """`--workers` for an evaluation command (decoding the eval images)."""
    return click.option(
        "--workers",
        type=WORKERS,
        default=-1,
        show_default=True,
        help="Loader worker processes decoding the eval images: -1 = auto (as cvl train: the "
        "usable CPUs divided by the node's processes, minus one), 0 = in this process.",
    )(f)


def precision_option(f: Callable) -> Callable:
    """`--precision` for an evaluation command's embedding passes."""
    return click.option(
        "--precision",
        type=click.Choice(PRECISIONS),
        default="no",
        show_default=True,
        help="Autocast of the embedding passes: no = float32 (exact), bf16 / fp16 = faster on "
        "GPUs (features kept in float32). Recorded in the outputs.",
    )(f)
