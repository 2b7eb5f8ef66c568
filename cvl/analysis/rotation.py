"""Mod-X spatial-disorder analysis: SAM, RAM and ImAV angle-change distributions.

Definitions (Mod-X §3.2, appendices A.2 and B.2), for a fixed evaluation set of N samples
embedded by checkpoints 0..K-1 (L2-normalised features; angles in degrees):

- **SAM** (self-angle matrix) of checkpoint k in one modality: SAM_k[a, b] = arccos<V_k^a, V_k^b>.
  The table row SAM_{i-j} is the distribution of |SAM_i[a, b] - SAM_j[a, b]| over the sample
  pairs a < b: every unordered pair is counted once and the diagonal (a == b, always 0) is left
  out, so a row holds N(N-1)/2 values. Computed in row blocks of the upper triangle, float64,
  with histogram counts accumulated per block: the N x N matrix never exists at once.
- **RAM** (rotation angle) between checkpoints i and j: RAM_(i,j)[a] = arccos<V_i^a, V_j^a>,
  one value per sample, reported for vision and text side by side (Mod-X Fig. 3).
- **ImAV** (inter-modal angle variation, Mod-X B.2) between checkpoints i < j: over the samples
  that checkpoint i *retrieves correctly*, |angle(V_j^a, L_j^a) - angle(V_i^a, L_i^a)|, where
  L is the text embedding of the sample's (first) caption. "Retrieves correctly" = image->text
  top-1 within the evaluation set: the caption with the highest cosine to image a under
  checkpoint i is a's own caption, or a caption with identical text (captions repeat in
  generated and real test sets; a retrieved duplicate is a hit).

Rows compare consecutive checkpoints (i, i+1) and the first with the last (0, K-1), as in the
papers' tables. Numerics: features re-normalised in float64, cosines clamped to [-1, 1] before
arccos. Bins are right-closed exactly as the papers write them: [0,5], (5,10], ..., so an angle
of exactly 5 deg falls in the first bin (a 1e-9 deg tolerance absorbs float64 round-off).

Where the parts live: the angle maths in `angles.py`, the result (tables, rotation.json,
Markdown, CSV) in `rotation_results.py`, the plots in `rotation_plots.py`; this module writes a
result folder and runs the analysis on a run folder's checkpoints. Every name stays importable
from here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cvl.analysis.angles import (  # noqa: F401  (re-exported: their home was this module)
    DEFAULT_CHUNK_ELEMS,
    EDGE_TOL,
    RAM_EDGES,
    SAM_EDGES,
    bin_labels,
    check_feats,
    checkpoint_pairs,
    cos_to_deg,
    histogram,
    imav_angles,
    paired_angles,
    retrieval_correct,
    sam_counts,
    sam_counts_dense,
)
from cvl.analysis.rotation_plots import (  # noqa: F401  (re-exported: their home was this module)
    plot_compare,
    plot_result,
)
from cvl.analysis.rotation_results import (  # noqa: F401  (re-exported: their home was this module)
    DEFINITIONS,
    MODALITIES,
    SCHEMA,
    SYMBOLS,
    TITLES,
    RotationResult,
    Row,
    Table,
    analyze_features,
    compare_markdown,
    legend_markdown,
    result_markdown,
    round_percentages,
    table_csv,
    table_markdown,
)
from cvl.errors import CvlError
from cvl.io import atomic_write_bytes, write_json
from cvl.progress import progress_bar


def write_result(res: RotationResult, out: str | os.PathLike, plots: bool = True) -> list[Path]:
    """rotation.json, rotation.md, rotation_<analysis>_<modality>.csv and PNG charts in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "rotation.json", res.to_json())
    atomic_write_bytes(out / "rotation.md", result_markdown(res).encode("utf-8"))
    written = [out / "rotation.json", out / "rotation.md"]
    for t in res.tables:
        p = out / f"rotation_{t.key}.csv"
        atomic_write_bytes(p, table_csv(t).encode("utf-8"))
        written.append(p)
    if plots:
        written += plot_result(res, out)
    return written


# -- from a run folder -----------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """A set of weights of a run: the initial ones ('init') or those after task `index`."""

    label: str
    name: str
    index: int | None
    path: Path

    @property
    def description(self) -> str:
        if self.index is None:
            return "initial weights (init/)"
        return f"after task {self.name} (tasks/{self.index:02d}-{self.name})"

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "task": self.name if self.index is not None else None,
            "index": self.index,
            "path": str(self.path),
            "description": self.description,
        }


def run_checkpoints(
    run: str | os.PathLike, tasks: str | Sequence[str] | None = "all"
) -> list[Checkpoint]:
    """The run's checkpoints in training order: init (when present) then every finished task.

    `tasks`: "all" (default) or a list / comma-separated string of task indices or names,
    and/or "init"; the selection is returned in training order. "all" leaves out initial
    weights that are a random initialisation (run.json: no `pretrained`), whose angles to a
    trained model say nothing (Mod-X's first checkpoint is a trained CLIP_0); name "init"
    to include them anyway.
    """
    from cvl.runs import MODEL_FILE, finished_tasks

    run = Path(run)
    avail: list[Checkpoint] = []
    if (run / "init" / MODEL_FILE).is_file():
        avail.append(Checkpoint("init", "init", None, run / "init" / MODEL_FILE))
    avail += [Checkpoint(str(c.index), c.name, c.index, c.model_path) for c in finished_tasks(run)]
    if tasks is None or tasks == "all" or (not isinstance(tasks, str) and list(tasks) == ["all"]):
        sel = [c for c in avail if c.index is not None or not _random_init(run)]
    else:
        tokens = (
            [t.strip() for t in tasks.split(",")]
            if isinstance(tasks, str)
            else [str(t).strip() for t in tasks]
        )
        tokens = [t for t in tokens if t]
        picked = set()
        for tok in tokens:
            match = [
                c
                for c in avail
                if tok in (c.label, c.name)
                or (c.index is not None and tok == f"{c.index:02d}-{c.name}")
            ]
            if not match:
                have = ", ".join(
                    c.label if c.index is None else f"{c.index} ({c.name})" for c in avail
                )
                raise CvlError(f"{run}: no checkpoint '{tok}' (have: {have or 'none'})")
            if match[0].label in picked:
                raise CvlError(f"--tasks lists checkpoint '{tok}' twice")
            picked.add(match[0].label)
        sel = [c for c in avail if c.label in picked]
    if len(sel) < 2:
        raise CvlError(
            f"{run}: the rotation analysis needs at least two checkpoints, found "
            f"{len(sel)} ({', '.join(c.label for c in sel) or 'none'})"
        )
    return sel


def _random_init(run: Path) -> bool:
    """True when run.json says the run started from random weights (`pretrained` unset)."""
    try:
        cfg = json.loads((run / "run.json").read_text(encoding="utf-8")).get("config", {})
    except (OSError, ValueError):
        return False
    return "pretrained" in cfg and not cfg["pretrained"]


def resolve_stream(run: Path, run_json: dict[str, Any], stream: str | os.PathLike | None):
    """The stream manifest: --stream when given, else the path recorded in run.json."""
    from cvl.streams.manifest import MANIFEST, load_manifest

    if stream is not None:
        return load_manifest(stream, check_files=False)
    p = (run_json.get("stream") or {}).get("path")
    if not p:
        raise CvlError(f"{run}: run.json records no stream path; pass --stream PATH")
    cands = [Path(p)] if Path(p).is_absolute() else [Path(p), run / p]
    for c in cands:
        if (c / MANIFEST).is_file():
            return load_manifest(c, check_files=False)
    raise CvlError(f"{run}: its stream {p} was not found (moved?); pass --stream PATH")


@dataclass
class EvalFeatures:
    """Features of one fixed eval set under every selected checkpoint."""

    checkpoints: list[Checkpoint]
    vision: list[torch.Tensor]
    text: list[torch.Tensor]
    captions: list[str]
    ids: list[str]
    eval: dict[str, Any]


def extract_features(
    run: str | os.PathLike,
    stream: str | os.PathLike | None = None,
    split: str = "test",
    eval_task: str | None = None,
    tasks: str | Sequence[str] | None = "all",
    max_samples: int | None = None,
    batch_size: int = 256,
    progress: bool = False,
    *,
    device: str | torch.device = "auto",
    workers: int = -1,
    precision: str = "no",
    store: Any = None,
) -> EvalFeatures:
    """Embed the eval set (default: the run's first task's test set) with every checkpoint.

    On `device` (`cvl.device.resolve_device`: auto = CUDA when available), decoded by `workers`
    loader processes (-1 = auto) once: later checkpoints reuse the decoded images from `store`
    (an `ImageStore`; a new one unless given). `precision` as `cvl eval`'s."""
    from cvl.device import resolve_device
    from cvl.evaluation.embed import embed_dataset, eval_dataset
    from cvl.evaluation.imagestore import ImageStore
    from cvl.evaluation.options import DEFAULT_IMAGE_CACHE_MB, resolve_workers
    from cvl.models import load_weights, model_from_config
    from cvl.runs import load_run

    run = Path(run)
    run_json = load_run(run)
    cks = run_checkpoints(run, tasks)
    m = resolve_stream(run, run_json, stream)
    if eval_task is None:
        order = (run_json.get("stream") or {}).get("task_order") or m.task_order
        eval_task = order[0]
    shards = m.eval_shards(split, eval_task)
    for s in shards:
        if not Path(s).is_file():
            raise CvlError(
                f"stream '{m.name}': eval set '{split}', task '{eval_task}': missing shard {s}"
            )
    if max_samples is not None and max_samples < 2:
        raise CvlError(f"--max-samples must be at least 2, got {max_samples}")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    n_workers = resolve_workers(workers)
    store = store if store is not None else ImageStore(DEFAULT_IMAGE_CACHE_MB)
    vision, text = [], []
    captions: list[str] = []
    ids: list[str] = []
    ds = None
    for ck in progress_bar(cks, desc="checkpoints", show=progress, leave=False):
        model = model_from_config(run_json["model"])
        load_weights(model, ck.path)
        model.eval().to(dev)
        if ds is None:
            ds = eval_dataset(model, shards, check=False)  # unreadable samples: left out below
            if max_samples is not None and len(ds) > max_samples:
                ds = ds.with_entries(ds.entries[:max_samples])
        emb = embed_dataset(
            model,
            ds,
            batch_size=batch_size,
            progress=progress,
            all_captions=False,
            desc=f"embed {ck.label}",
            device=dev,
            num_workers=n_workers,
            precision=precision,
            store=store,
        )
        if emb.text_features.shape[0] != emb.image_features.shape[0]:
            raise CvlError("expected one caption per sample from embed_dataset(all_captions=False)")
        vision.append(emb.image_features)
        text.append(emb.text_features)
        if not captions:
            captions, ids = list(emb.captions), list(emb.ids)
        del model
    assert ds is not None
    if len(ids) < 2:
        raise CvlError(
            f"eval set '{split}' of task '{eval_task}' has {len(ids)} readable sample(s); "
            "need at least 2"
        )
    info = {
        "stream": m.name,
        "stream_path": str(m.root),
        "split": split,
        "task": eval_task,
        "n_samples": len(ids),
        "device": str(dev),
        "workers": n_workers,
        "precision": precision,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    return EvalFeatures(cks, vision, text, captions, ids, info)


def analyze_run(
    run: str | os.PathLike,
    stream: str | os.PathLike | None = None,
    split: str = "test",
    eval_task: str | None = None,
    tasks: str | Sequence[str] | None = "all",
    modality: str = "both",
    max_samples: int | None = None,
    batch_size: int = 256,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    progress: bool = False,
    **embed_kw: Any,
) -> RotationResult:
    """Extract features of every selected checkpoint and compute all tables.

    modality: vision | text | both; ImAV (which needs both) is computed only with "both".
    `embed_kw`: `device`, `workers`, `precision`, `store` of `extract_features`.
    """
    if modality not in ("vision", "text", "both"):
        raise CvlError(f"--modality must be vision, text or both, got {modality!r}")
    f = extract_features(
        run, stream, split, eval_task, tasks, max_samples, batch_size, progress, **embed_kw
    )
    mods = MODALITIES if modality == "both" else (modality,)
    tables = analyze_features(
        [c.label for c in f.checkpoints],
        vision=f.vision if "vision" in mods else None,
        text=f.text if "text" in mods else None,
        captions=f.captions,
        modalities=mods,
        chunk_elems=chunk_elems,
        progress=progress,
    )
    meta = {"run": str(run), "eval": f.eval, "modality": modality}
    return RotationResult([c.to_json() for c in f.checkpoints], tables, meta)
