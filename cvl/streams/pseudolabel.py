"""`cvl pseudo-label`: top-1 class of every image of a stream from a transformers classifier.

IncCLIP's class split of CC12M needs an ImageNet-1k class per image, predicted by BEiT; any
`AutoModelForImageClassification` checkpoint (a folder or a hub id) with its image processor
works. Labels are stored *beside* the shards, never by rewriting them::

    STREAM/labels/NAME/
      labels.json                  model, class names, counts per part (written when complete)
      train/<task>.jsonl           one line per sample, in shard order:
      eval/<set>/<task>.jsonl        {"key", "id", "class", "label", "score"}  (class null and
                                     "error" for an image that cannot be decoded)
      .parts/ progress.json        work in progress (removed once merged)

Work is cut into *units*: fixed slices of `unit_size` samples of one shard, in a canonical
order over every part (train tasks, then eval sets). A unit's labels are written atomically
when it is complete, so an interrupted run continues with the units that have no file yet
(at most one unit per process is redone). Each unit is cut into fixed batches, so the labels
do not depend on how many processes ran or where a run was interrupted. With N processes
(`accelerate launch -m cvl pseudo-label ...` or torchrun), rank r takes every N-th unit still to
do; the main process merges the units into the per-part files at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT
from cvl.device import deterministic_option, device_option
from cvl.errors import CvlError
from cvl.io import (
    atomic_write_bytes,
    check_overwrite,
    output_kind,
    read_json,
    write_json,
    write_marker,
)

LABELS_DIR = "labels"
LABELS_SCHEMA = "cvl.labels/1"
INFO_FILE = "labels.json"
PARTS_DIR = ".parts"
PROGRESS_FILE = "progress.json"


# -- what to label ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """One labels file: the training shards of a task or one task of an eval set."""

    rel: str  # "train/<task>" or "eval/<set>/<task>"
    shards: tuple[str, ...]


@dataclass(frozen=True)
class Unit:
    """A fixed slice [start, stop) of the usable samples of one shard of a part."""

    part: str
    shard_no: int
    shard: str
    start: int
    stop: int

    @property
    def file(self) -> str:
        return f"{self.part}/{self.shard_no:06d}-{self.start:09d}.jsonl"


def stream_parts(manifest: Any) -> list[Part]:
    """Every part of a stream in canonical order: train tasks, then eval sets by task."""
    parts = [
        Part(f"train/{t}", tuple(str(p) for p in manifest.train_shards(t)))
        for t in manifest.task_order
    ]
    for s, es in manifest.eval_sets.items():
        for t in es.tasks:
            parts.append(Part(f"eval/{s}/{t}", tuple(str(p) for p in manifest.eval_shards(s, t))))
    return parts


def plan_units(parts: list[Part], unit_size: int) -> tuple[list[Unit], Counter]:
    """All units of the parts (canonical order) and the count of samples left out by index."""
    from cvl.data.reader import index_shard

    units, skipped = [], Counter()
    for p in parts:
        for no, shard in enumerate(p.shards):
            entries, sk = index_shard(str(Path(shard).absolute()))
            skipped.update(f"{reason}" for _, reason in sk)
            for s in range(0, len(entries), unit_size):
                units.append(Unit(p.rel, no, shard, s, min(len(entries), s + unit_size)))
    return units, skipped


def labels_folder(stream: str | os.PathLike, name: str) -> Path:
    return Path(stream) / LABELS_DIR / name


def default_name(model: str) -> str:
    """Labels folder name from a model path or hub id (`microsoft/beit-base` -> `beit-base`)."""
    base = Path(model.rstrip("/")).name or "labels"
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", base)


# -- the classifier -----------------------------------------------------------------------------
def load_classifier(model_id: str) -> tuple[Any, Any, list[str]]:
    """(model in eval mode, image processor, class names by index) or a one-line CvlError."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    where = f"--model {model_id}"
    try:
        AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError) as e:
        raise CvlError(f"{where}: not a transformers model ({str(e).splitlines()[0]})") from None
    try:
        model, info = AutoModelForImageClassification.from_pretrained(
            model_id, output_loading_info=True
        )
    except (OSError, ValueError, KeyError) as e:
        raise CvlError(
            f"{where}: not an image classifier ({str(e).splitlines()[0][:200]})"
        ) from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise CvlError(
            f"{where}: the checkpoint has no trained classifier head (missing {', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); use an image-classification checkpoint "
            "such as microsoft/beit-base-patch16-224"
        )
    try:
        processor = AutoImageProcessor.from_pretrained(model_id)
    except (OSError, ValueError) as e:
        raise CvlError(
            f"{where}: no image processor (preprocessor_config.json) ({str(e).splitlines()[0]})"
        ) from None
    n = int(model.config.num_labels)
    id2label = {int(k): str(v) for k, v in (model.config.id2label or {}).items()}
    if sorted(id2label) != list(range(n)):
        raise CvlError(f"{where}: config.id2label does not name classes 0..{n - 1}")
    model.eval()
    return model, processor, [id2label[i] for i in range(n)]


class _Images:
    """Processed pixels of reader entries; an image that fails to decode gives x = None.

    (A map-style dataset for the DataLoader; torch is imported lazily to keep `cvl` fast.)"""

    def __init__(self, entries: list[Any], processor: Any) -> None:
        self.entries, self.processor = entries, processor

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from cvl.data.images import open_image
        from cvl.data.samples import read_member

        e = self.entries[i]
        sid = e.key
        try:
            if e.meta:
                sid = json.loads(read_member(e, "meta").decode("utf-8")).get("id", e.key)
        except (ValueError, UnicodeDecodeError):
            pass
        data = read_member(e, "image")  # a shard that cannot be read stops (ShardError)
        try:
            img = open_image(data)  # MAX_PIXELS checked first
            img.load()
            x = self.processor(images=img.convert("RGB"), return_tensors="pt")["pixel_values"][0]
            err = None
        except Exception as ex:  # corrupt or truncated image: skipped and counted
            x, err = None, f"unreadable_image: {type(ex).__name__}"
        return {"x": x, "key": e.key, "id": sid, "error": err}


def _collate(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return items


# -- the run ----------------------------------------------------------------------------------
@dataclass
class LabelOptions:
    model: str
    name: str | None = None
    batch_size: int = 64
    unit_size: int = 4096
    num_workers: int = 0
    overwrite: bool = False
    progress: bool = True
    device: str = "auto"  # one process: where the classifier runs (cvl.device); not in the key


def _fingerprint(manifest: Any, opts: LabelOptions, n_classes: int, n_units: int) -> dict:
    return {
        "stream": manifest.fingerprint,
        "model": opts.model,
        "n_classes": n_classes,
        "unit_size": opts.unit_size,
        "batch_size": opts.batch_size,
        "units": n_units,
    }


def _barrier(acc: Any) -> None:
    if acc is not None:
        acc.wait_for_everyone()


def label_stream(stream: str | os.PathLike, opts: LabelOptions, accelerator: Any = None) -> dict:
    """Label every image of `stream` (resuming earlier work); returns labels.json's content.

    The labels folder is locked for the run (rank 0 holds it, `cvl.lock`): two labelling
    processes never write the same folder."""
    from cvl.lock import lock_on_main

    name = opts.name or default_name(opts.model)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", name):
        raise CvlError(f"--name {name!r}: use letters, digits, '_', '-' and '.' (a folder name)")
    lock = lock_on_main(labels_folder(stream, name), accelerator)
    try:
        return _label_stream(stream, opts, accelerator)
    finally:
        if lock is not None:
            lock.release()


def _label_stream(stream: str | os.PathLike, opts: LabelOptions, accelerator: Any) -> dict:
    import torch

    from cvl.data.reader import index_shard
    from cvl.progress import progress_bar
    from cvl.streams.manifest import load_manifest

    manifest = load_manifest(stream)
    acc = accelerator
    rank = acc.process_index if acc is not None else 0
    world = acc.num_processes if acc is not None else 1
    main = rank == 0
    name = opts.name or default_name(opts.model)
    folder = labels_folder(stream, name)
    info_path, parts_dir = folder / INFO_FILE, folder / PARTS_DIR
    if info_path.is_file() and not opts.overwrite:
        info = read_json(info_path)
        if info.get("model") != opts.model:
            raise CvlError(
                f"{folder} holds labels of another model ({info.get('model')}); "
                "pass --name or --overwrite"
            )
        if info.get("stream") != manifest.fingerprint:
            raise CvlError(
                f"{folder}: labels of an earlier version of the stream; pass --overwrite"
            )
        return {**info, "already_complete": True}
    from cvl.device import resolve_device

    model, processor, classes = load_classifier(opts.model)
    device = acc.device if acc is not None else resolve_device(opts.device)
    model.to(device)
    parts = stream_parts(manifest)
    units, left_out = plan_units(parts, opts.unit_size)
    fp = _fingerprint(manifest, opts, len(classes), len(units))
    if main:
        if opts.overwrite and folder.exists():
            check_overwrite(folder, "labels")  # only labels cvl wrote are discarded
            shutil.rmtree(folder)
        prog = parts_dir / PROGRESS_FILE
        if prog.is_file() and read_json(prog) != fp:
            raise CvlError(
                f"{folder}: an unfinished run used other settings (model, stream, --batch-size "
                f"or --unit-size; see {prog}); rerun with those or pass --overwrite"
            )
        write_json(prog, fp)
        if output_kind(folder) is None:
            write_marker(folder, "labels")
    _barrier(acc)
    todo = [u for u in units if not (parts_dir / u.file).is_file()]  # every rank lists ...
    _barrier(acc)  # ... before any rank writes a new unit
    mine = todo[rank::world]
    entries: list[Any] = []
    batches: list[list[int]] = []
    ends: dict[int, Unit] = {}  # batch index -> unit completed by that batch
    for u in mine:
        es = index_shard(str(Path(u.shard).absolute()))[0][u.start : u.stop]
        base = len(entries)
        entries.extend(es)
        for s in range(0, len(es), opts.batch_size):
            batches.append(list(range(base + s, base + min(len(es), s + opts.batch_size))))
        ends[len(batches) - 1] = u
    loader = torch.utils.data.DataLoader(
        _Images(entries, processor),
        batch_sampler=batches,
        collate_fn=_collate,
        num_workers=opts.num_workers,
        pin_memory=device.type == "cuda",
    )
    bar = progress_bar(
        total=len(entries),
        desc=f"labelling ({len(todo)}/{len(units)} units to do"
        + (f", {world} processes" if world > 1 else "")
        + ")",
        unit="img",
        show=opts.progress and main,
    )
    lines: list[str] = []
    t0 = time.perf_counter()
    autocast = acc.autocast() if acc is not None else torch.autocast("cpu", enabled=False)
    with torch.inference_mode(), autocast:
        for b, items in enumerate(loader):
            good = [it for it in items if it["x"] is not None]
            if good:
                x = torch.stack([it["x"] for it in good]).to(device, non_blocking=True)
                logits = model(pixel_values=x).logits.float()
                if logits.shape[-1] != len(classes):
                    raise CvlError(
                        f"--model {opts.model}: {logits.shape[-1]} logits for "
                        f"{len(classes)} classes in config.id2label"
                    )
                score, cls = logits.softmax(-1).max(-1)
                for it, c, s in zip(good, cls.tolist(), score.tolist()):
                    it["class"], it["score"] = c, round(s, 6)
            for it in items:
                rec = {"key": it["key"], "id": it["id"]}
                if it["x"] is None:
                    rec.update({"class": None, "label": None, "score": None, "error": it["error"]})
                else:
                    rec.update(
                        {"class": it["class"], "label": classes[it["class"]], "score": it["score"]}
                    )
                lines.append(json.dumps(rec, ensure_ascii=False))
            if b in ends:
                atomic_write_bytes(parts_dir / ends[b].file, ("\n".join(lines) + "\n").encode())
                lines = []
            bar.update(len(items))
    bar.close()
    _barrier(acc)
    run = {
        "images": sum(u.stop - u.start for u in todo),
        "units": len(todo),
        "processes": world,
        "device": str(device),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "seconds": round(time.perf_counter() - t0, 3),  # loop + waiting for the slowest rank
    }
    info: dict[str, Any] = {}
    if main:
        info = _merge(folder, manifest, parts, units, classes, opts, left_out, run)
    _barrier(acc)
    if not main:
        info = read_json(info_path)
    return info


def _merge(
    folder: Path,
    manifest: Any,
    parts: list[Part],
    units: list[Unit],
    classes: list[str],
    opts: LabelOptions,
    left_out: Counter,
    run: dict[str, Any],
) -> dict[str, Any]:
    """Concatenate unit files into one JSONL per part; write labels.json; drop the parts."""
    import datetime as _dt

    from cvl import __version__

    parts_dir = folder / PARTS_DIR
    counts: dict[str, dict[str, int]] = {}
    by_part: dict[str, list[Unit]] = {}
    for u in units:
        by_part.setdefault(u.part, []).append(u)
    for p in parts:
        c = Counter()
        chunks = []
        for u in by_part.get(p.rel, []):
            f = parts_dir / u.file
            if not f.is_file():
                raise CvlError(f"{f}: a unit is missing after every process finished")
            data = f.read_text(encoding="utf-8")
            for ln in data.splitlines():
                rec = json.loads(ln)
                c["labelled" if rec["class"] is not None else "unreadable"] += 1
            chunks.append(data)
        atomic_write_bytes(folder / f"{p.rel}.jsonl", "".join(chunks).encode("utf-8"))
        counts[p.rel] = {"labelled": c["labelled"], "unreadable": c["unreadable"]}
    info = {
        "schema": LABELS_SCHEMA,
        "model": opts.model,
        "n_classes": len(classes),
        "classes": classes,
        "stream": manifest.fingerprint,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cvl_version": __version__,
        "batch_size": opts.batch_size,
        "unit_size": opts.unit_size,
        "parts": counts,
        "labelled": sum(c["labelled"] for c in counts.values()),
        "unreadable": sum(c["unreadable"] for c in counts.values()),
        "left_out_by_reader": dict(left_out),
        "last_run": run,
        "format": "PART.jsonl: one line per sample in shard order: key, id, class (index), "
        "label (the classifier's id2label name), score (top-1 softmax probability); "
        "class null and error set when the image could not be decoded",
    }
    write_json(folder / INFO_FILE, info)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return info


def read_labels(folder: str | os.PathLike, part: str) -> dict[str, dict[str, Any]]:
    """key -> record of one part ("train/<task>" or "eval/<set>/<task>") of a labels folder."""
    f = Path(folder) / f"{part}.jsonl"
    if not f.is_file():
        raise CvlError(f"{f}: no labels for {part} (was the stream labelled after it changed?)")
    out = {}
    with open(f, encoding="utf-8") as fh:
        for no, ln in enumerate(fh, 1):
            try:
                rec = json.loads(ln)
                out[rec["key"]] = rec
            except (ValueError, KeyError):
                raise CvlError(f"{f}:{no}: not a labels record") from None
    return out


# -- command ----------------------------------------------------------------------------------


@click.command("pseudo-label")
@click.option(
    "--stream",
    required=True,
    type=click.Path(file_okay=False),
    help="Stream folder whose images to label.",
)
@click.option(
    "--model",
    required=True,
    help="transformers image classifier: a folder (save_pretrained, with its image processor) "
    "or a hub id such as microsoft/beit-base-patch16-224.",
)
@click.option(
    "--name", default=None, help="Labels folder STREAM/labels/NAME [model folder or id name]."
)
@click.option("--batch-size", default=64, show_default=True, type=POSITIVE_INT)
@click.option(
    "--unit-size",
    default=4096,
    show_default=True,
    type=POSITIVE_INT,
    help="Samples per resumable work unit (an interrupt loses at most one unit per process).",
)
@click.option(
    "--workers",
    type=NON_NEGATIVE_INT,
    default=0,
    show_default=True,
    help="DataLoader workers decoding JPEGs per process.",
)
@click.option("--overwrite", is_flag=True, help="Discard existing or unfinished labels.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@device_option
@deterministic_option
def pseudo_label(
    stream: str,
    model: str,
    name: str | None,
    batch_size: int,
    unit_size: int,
    workers: int,
    overwrite: bool,
    quiet: bool,
    device: str,
    deterministic: bool | None,
) -> None:
    """Top-1 class, label and confidence of every image of a stream (IncCLIP's BEiT step).

    \b
    Labels go to STREAM/labels/NAME/ (train/<task>.jsonl, eval/<set>/<task>.jsonl, labels.json);
    shards are not rewritten. Resumable: rerun the same command after an interruption. Several
    processes (GPUs) each label a disjoint part, merged at the end:
      cvl pseudo-label --stream streams/cc12m-pool --model microsoft/beit-base-patch16-224
      accelerate launch --multi_gpu --num_processes 8 -m cvl pseudo-label --stream streams/cc12m-pool \\
          --model microsoft/beit-base-patch16-224 --batch-size 256 --workers 8
    Then: cvl build-stream class-split --from STREAM --labels NAME --steps 4 ...
    """
    opts = LabelOptions(
        model=model,
        name=name,
        batch_size=batch_size,
        unit_size=unit_size,
        num_workers=workers,
        overwrite=overwrite,
        progress=not quiet,
        device=device,
    )
    from cvl.device import determinism, model_runner

    acc, dev = model_runner(device)
    click.get_current_context().with_resource(determinism(deterministic, dev))  # until return
    info = label_stream(stream, opts, acc)
    if acc is None or acc.is_main_process:
        folder = labels_folder(stream, opts.name or default_name(model))
        state = "already complete" if info.get("already_complete") else "wrote"
        click.echo(
            f"{state} {folder}: {info['labelled']} images labelled, {info['unreadable']} "
            f"unreadable (skipped), {info['n_classes']} classes"
        )
