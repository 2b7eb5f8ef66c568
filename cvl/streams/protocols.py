"""The papers' benchmark streams, one command each: `cvl build-stream protocol NAME`.

A preset names its sources, how each is built, its tasks (whole sources or random parts)
and its benchmarks (eval sets of no task). Archive sources (coco, flickr30k, rsicd, ec, iapr)
are built from the raw files under ``--data`` into ``OUT/sources/<source>``; sources that
come from URL lists (cc3m, wit, goodnews, cc12m) are streams built beforehand with their own
command and passed with ``--stream NAME=PATH`` (or found as ``--streams DIR/NAME``), which
also works for an archive source built already. Then `compose` writes the protocol stream:
whole sources are referenced, parts copied. Everything is written inside ``--out``,
atomically.

Presets (see /work/shared/METHODS.md "Protocol facts" and the papers):

- ``modx-coco-f30k`` Mod-X: COCO (CLIP_0's task; 80K train / 30K val as in the paper:
  Karpathy restval -> val) then Flickr30K in 5 random parts; benchmarks COCO(5K),
  Flickr30K(1K).
- ``modx-ec`` Mod-X: EC in 5 random parts; benchmarks EC(5K), COCO(5K), Flickr30K(1K).
- ``modx-cc12m`` Mod-X appendix B.7: CC12M in 10 random parts; benchmarks COCO(5K),
  Flickr30K(1K).
- ``dha-citm`` DHA: COCO (100,000 / 13,287 / 5,000: train+restval drawn, the rest = val) ->
  CC3M -> WIT -> GoodNews (130k/13k/5k streams), each with its val and test sets.
- ``dkr-s1`` DKR Setting-1: COCO (80K train / 5K test) -> Flickr30K -> IAPR TC-12
  (15K / 5K random) -> EC -> RSICD (train+val 9,828 / test 1,093).
- ``dkr-s2`` DKR Setting-2: EC in 5 random parts; benchmarks Flickr30K(1K), COCO(5K), EC(5K).
- ``mtil``, ``mtil-order2``, ``mtil-fs``, ``x-tail``: classification datasets as tasks (ZSCL's
  MTIL orders I and II, MoE-Adapters4CL's 5-shot MTIL, RAIL's X-TAIL), built from ``--data``
  by `cvl.streams.classification` (one stream, no composition; see datasets/mtil.md).
- ``cclip`` C-CLIP (ICLR 2025): Flickr30K -> COCO -> Pets -> Lexica -> Simpsons -> WikiArt ->
  Kream -> Sketch, each caption a training sample (Karpathy splits for the first two; the six
  others are tables built with `recipes/cclip_table.py` + `cvl build-stream table`,
  datasets/cclip.md); zero-shot retention on classification sets is `cvl eval
  --zeroshot-folder`.

Each part's own test set is the same random part of its source's test set; the full test
sets are the benchmarks.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from cvl.errors import CvlError
from cvl.io import atomic_dir
from cvl.streams.compose import EvalSpec, TaskSpec, compose
from cvl.streams.manifest import MANIFEST, Manifest
from cvl.streams.options import archive_options, build_options, echo_summary
from cvl.streams.pipeline import BuildOptions

URL_SOURCES = {
    "cc3m": "cvl build-stream cc3m --tsv Train_GCC-training.tsv --out streams/cc3m "
    "--sample 130000 --val 13000 --test 5000",
    "wit": "cvl build-stream wit --tsv wit_v1.train.all-00000-of-00010.tsv.gz --out streams/wit "
    "--sample 130000 --val 13000 --test 5000",
    "goodnews": "cvl build-stream goodnews --captions captioning_dataset.json --urls "
    "img_urls.json --out streams/goodnews --sample 130000 --val 13000 --test 5000",
    "cc12m": "cvl build-stream cc12m --tsv cc12m.tsv --out streams/cc12m --chunks 1 "
    "--sample 10000000",
}
# C-CLIP's six caption datasets from the Hugging Face hub (datasets/cclip.md)
CCLIP_TABLES = ("pets", "lexica", "simpsons", "wikiart", "kream", "sketch")
for _s in CCLIP_TABLES:
    URL_SOURCES[_s] = (
        f"python recipes/cclip_table.py table {_s} --hf DIR --out tables/{_s} && cvl "
        f"build-stream table --input tables/{_s}/pairs.jsonl --url-col path --caption-col "
        f"caption --split-col split --out streams/{_s}"
    )
CARDS = {s: "cclip" for s in CCLIP_TABLES}  # sources documented in another card


@dataclass
class Preset:
    """A paper's protocol: sources (with build parameters), tasks and benchmarks."""

    doc: str
    sources: dict[str, dict[str, Any]]
    tasks: list[tuple[str, str, tuple[int, int] | None]]  # (task name, source, part)
    benchmarks: list[tuple[str, str]] = field(default_factory=list)  # (name, source)


def _parts(prefix: str, source: str, k: int) -> list[tuple[str, str, tuple[int, int] | None]]:
    return [(f"{prefix}-{i}", source, (i, k)) for i in range(1, k + 1)]


PRESETS: dict[str, Preset] = {
    "modx-coco-f30k": Preset(
        "Mod-X: COCO, then Flickr30K in 5 random parts",
        {"coco": {"restval": "val"}, "flickr30k": {}},
        [("coco", "coco", None), *_parts("f30k", "flickr30k", 5)],
        [("coco-5k", "coco"), ("f30k-1k", "flickr30k")],
    ),
    "modx-ec": Preset(
        "Mod-X: EC in 5 random parts (from OpenAI ViT-B/32)",
        {"ec": {}, "coco": {"restval": "val"}, "flickr30k": {}},
        _parts("ec", "ec", 5),
        [("ec-5k", "ec"), ("coco-5k", "coco"), ("f30k-1k", "flickr30k")],
    ),
    "modx-cc12m": Preset(
        "Mod-X B.7: CC12M in 10 random parts of ~1M",
        {"cc12m": {}, "coco": {"restval": "val"}, "flickr30k": {}},
        _parts("cc12m", "cc12m", 10),
        [("coco-5k", "coco"), ("f30k-1k", "flickr30k")],
    ),
    "dha-citm": Preset(
        "DHA CITM: COCO (100k/13,287/5k) -> CC3M -> WIT -> GoodNews (130k/13k/5k)",
        {
            "coco": {"max_train": 100000, "rest_as_val": True},
            "cc3m": {},
            "wit": {},
            "goodnews": {},
        },
        [("coco", "coco", None), ("cc3m", "cc3m", None), ("wit", "wit", None)]
        + [("goodnews", "goodnews", None)],
    ),
    "dkr-s1": Preset(
        "DKR Setting-1: COCO -> Flickr30K -> IAPR TC-12 -> EC -> RSICD",
        {
            "coco": {"restval": "val"},
            "flickr30k": {},
            "iapr": {"test_fraction": 0.25},
            "ec": {},
            "rsicd": {"val_to_train": True},
        },
        [(s, s, None) for s in ("coco", "flickr30k", "iapr", "ec", "rsicd")],
    ),
    "dkr-s2": Preset(
        "DKR Setting-2: EC in 5 random parts, tested on Flickr30K, COCO and EC",
        {"ec": {}, "coco": {"restval": "val"}, "flickr30k": {}},
        _parts("ec", "ec", 5),
        [("f30k-1k", "flickr30k"), ("coco-5k", "coco"), ("ec-5k", "ec")],
    ),
    "cclip": Preset(
        "C-CLIP: Flickr30K -> COCO -> Pets -> Lexica -> Simpsons -> WikiArt -> Kream -> Sketch",
        {
            "flickr30k": {"train_samples": "caption"},
            "coco": {"train_samples": "caption"},
            **{s: {} for s in CCLIP_TABLES},
        },
        [(s, s, None) for s in ("flickr30k", "coco", *CCLIP_TABLES)],
    ),
}


# -- raw data layout under --data ----------------------------------------------------------------
def _first(cands: list[Path], what: str, is_dir: bool = False) -> Path:
    for c in cands:
        if c.is_dir() if is_dir else c.is_file():
            return c
    raise CvlError(f"{what} not found (looked for {', '.join(str(c) for c in cands)})")


def _karpathy(source: str, sub: str, folders: tuple[str, ...]) -> Callable:
    def build(data: Path, opts: BuildOptions, **kw: Any) -> Manifest:
        from cvl.streams.karpathy import DATASETS, build_karpathy

        jname = DATASETS[source][0]
        j = _first([data / sub / jname, data / jname], f"{source}: {jname}")
        imgs = _first([data / sub / f for f in folders] + [data / sub], f"{source} images", True)
        return build_karpathy(source, j, imgs, opts, **kw)

    return build


def _ec(data: Path, opts: BuildOptions, **kw: Any) -> Manifest:
    from cvl.streams.ec import build_ec

    return build_ec(_first([data / "ec", data / "ECommerce-T2I"], "ec: folder", True), opts, **kw)


def _iapr(
    data: Path, opts: BuildOptions, test_fraction: float | None = None, **kw: Any
) -> Manifest:
    from cvl.streams.iapr import ANN_DIR, build_iapr, read_iapr

    root = _first(
        [data / "iapr" / "iaprtc12", data / "iaprtc12", data / "iapr"], "iapr: folder", True
    )
    if not (root / ANN_DIR).is_dir():
        raise CvlError(f"iapr: {root} has no {ANN_DIR}/ (see datasets/iapr.md)")
    if test_fraction is not None and "test" not in kw:
        from cvl.streams.pipeline import Dropper
        from cvl.streams.writer import BuildReport

        n = len(read_iapr(root, Dropper(BuildReport()), BuildReport()))
        kw["test"] = int(round(n * test_fraction))
    return build_iapr(root, opts, **kw)


ARCHIVES: dict[str, tuple[Callable, str]] = {
    "coco": (
        _karpathy("coco", "coco", ("images",)),
        "coco/dataset_coco.json + coco/{train2014,val2014}/",
    ),
    "flickr30k": (
        _karpathy("flickr30k", "flickr30k", ("flickr30k-images", "images")),
        "flickr30k/dataset_flickr30k.json + flickr30k/flickr30k-images/",
    ),
    "rsicd": (
        _karpathy("rsicd", "rsicd", ("RSICD_images", "images")),
        "rsicd/dataset_rsicd.json + rsicd/RSICD_images/",
    ),
    "ec": (_ec, "ec/T2I_{train,val}.{text,img}.tsv"),
    "iapr": (_iapr, "iapr/iaprtc12/{images,annotations_complete_eng}/"),
}


def parse_sets(items: tuple[str, ...] | list[str]) -> dict[str, dict[str, Any]]:
    """``SOURCE.param=value`` overrides of a preset's build parameters."""
    out: dict[str, dict[str, Any]] = {}
    for it in items:
        if "=" not in it or "." not in it.split("=", 1)[0]:
            raise CvlError(f"--set '{it}': expected SOURCE.PARAM=VALUE, e.g. coco.max_train=1000")
        k, v = it.split("=", 1)
        src, param = k.split(".", 1)
        val: Any = v
        if v.lower() in ("true", "false"):
            val = v.lower() == "true"
        elif v.lower() in ("none", "null"):
            val = None
        else:
            for typ in (int, float):
                try:
                    val = typ(v)
                    break
                except ValueError:
                    pass
        out.setdefault(src, {})[param.replace("-", "_")] = val
    return out


def _check_params(source: str, params: dict[str, Any]) -> None:
    """Refuse an override the source's builder does not take (a typo would be silently lost)."""
    from cvl.streams.ec import build_ec
    from cvl.streams.iapr import build_iapr
    from cvl.streams.karpathy import build_karpathy

    fn = {"ec": build_ec, "iapr": build_iapr}.get(source, build_karpathy)
    known = set(inspect.signature(fn).parameters) - {"source", "json_path", "images", "opts"}
    if source == "iapr":
        known.add("test_fraction")
    bad = sorted(set(params) - known)
    if bad:
        raise CvlError(
            f"--set {source}.{bad[0]}: unknown parameter (known: {', '.join(sorted(known))})"
        )


def build_protocol(
    preset: str,
    out: str | Path,
    opts: BuildOptions,
    *,
    data: str | Path | None = None,
    streams: dict[str, str] | None = None,
    streams_dir: str | Path | None = None,
    sets: dict[str, dict[str, Any]] | None = None,
) -> Manifest:
    """Build the sources a preset needs (or take given streams) and compose them, atomically."""
    from cvl.streams.classification import PROTOCOLS, build_protocol_stream

    if preset in PROTOCOLS:
        if streams or sets:
            raise CvlError(f"protocol {preset} reads --data only (no --stream / --set)")
        if data is None:
            raise CvlError(f"protocol {preset}: pass --data DIR (see datasets/mtil.md)")
        return build_protocol_stream(preset, data, dataclasses.replace(opts, out=Path(out)))
    if preset not in PRESETS:
        names = [*PRESETS, *PROTOCOLS]
        raise CvlError(f"unknown protocol '{preset}' (presets: {', '.join(names)})")
    p = PRESETS[preset]
    streams = dict(streams or {})
    sets = dict(sets or {})
    for s in list(streams) + list(sets):
        if s not in p.sources:
            raise CvlError(
                f"protocol {preset} has no source '{s}' (its sources: {', '.join(p.sources)})"
            )
    given: dict[str, Path] = {}
    for src in p.sources:
        if src in streams:
            given[src] = Path(streams[src])
        elif streams_dir is not None and (Path(streams_dir) / src / MANIFEST).is_file():
            given[src] = Path(streams_dir) / src
    missing = [s for s in p.sources if s not in given and s not in ARCHIVES]
    if missing:
        s = missing[0]
        raise CvlError(
            f"protocol {preset} needs a '{s}' stream: build it first ({URL_SOURCES[s]}) "
            f"and pass --stream {s}=PATH (see datasets/{CARDS.get(s, s)}.md)"
        )
    to_build = [s for s in p.sources if s not in given]
    if to_build and data is None:
        raise CvlError(
            f"protocol {preset}: pass --data DIR with {', '.join(ARCHIVES[s][1] for s in to_build)}"
        )
    for src, params in sets.items():
        if src in given:
            raise CvlError(f"--set {src}.*: '{src}' is a given stream, not built here")
        _check_params(src, params)
    out = Path(out)
    if out.exists() and not opts.overwrite:
        raise CvlError(f"{out.absolute()} exists (pass --overwrite to replace it)")
    with atomic_dir(
        out, overwrite=opts.overwrite, kind="stream", inputs=[*given.values(), data]
    ) as tmp:
        paths: dict[str, Path] = dict(given)
        for src in to_build:
            params = {**p.sources[src], **sets.get(src, {})}
            sub = BuildOptions(
                out=tmp / "sources" / src,
                name=src,
                seed=opts.seed,
                image=opts.image,
                download=opts.download,
                shard_size=opts.shard_size,
                progress=opts.progress,
                log=opts.log,
            )
            opts.log(f"protocol {preset}: building source '{src}'")
            ARCHIVES[src][0](Path(data), sub, **params)  # type: ignore[arg-type]
            paths[src] = tmp / "sources" / src
        m = compose(
            [TaskSpec(t, paths[s], None, part) for t, s, part in p.tasks],
            [EvalSpec(b, paths[s]) for b, s in p.benchmarks],
            out,
            name=opts.name or out.name,
            seed=opts.seed,
            shard_size=opts.shard_size,
            split_rule=f"protocol {preset}: {p.doc}",
            source="protocol",
            extra_args={
                "protocol": preset,
                "built": {s: {**p.sources[s], **sets.get(s, {})} for s in to_build},
                "given": {s: str(given[s].absolute()) for s in given},
            },
            tmp=tmp,
            processes=opts.download.processes,
        )
    m.root = out.absolute()
    return m


# -- command line ------------------------------------------------------------------------------
def _preset_names() -> list[str]:
    from cvl.streams.classification import PROTOCOLS

    return [*PRESETS, *PROTOCOLS]


@click.command("protocol")
@click.argument("preset", type=click.Choice(_preset_names()))
@click.option(
    "--data",
    type=click.Path(file_okay=False),
    default=None,
    help="Raw datasets folder: coco/, flickr30k/, rsicd/, ec/, iapr/, the MTIL datasets "
    "(layout above).",
)
@click.option(
    "--stream",
    "stream_specs",
    multiple=True,
    help="SOURCE=PATH: use this built stream for a source (needed for cc3m, wit, goodnews, "
    "cc12m). Repeatable.",
)
@click.option(
    "--streams",
    "streams_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder of built streams named by source (DIR/cc3m, DIR/coco, ...).",
)
@click.option(
    "--set",
    "set_specs",
    multiple=True,
    help="SOURCE.PARAM=VALUE: change a source's build parameter (e.g. coco.max_train=1000, "
    "iapr.test=500). Repeatable.",
)
@archive_options
def protocol_cmd(
    preset: str,
    data: str | None,
    stream_specs: tuple[str, ...],
    streams_dir: str | None,
    set_specs: tuple[str, ...],
    **kw: Any,
) -> None:
    """A paper's benchmark stream in one command (Mod-X, DHA, DKR, MTIL / X-TAIL, C-CLIP presets).

    \b
    Presets:
      modx-coco-f30k  COCO -> Flickr30K in 5 parts; benchmarks COCO(5K), Flickr30K(1K)
      modx-ec         EC in 5 parts; benchmarks EC(5K), COCO(5K), Flickr30K(1K)
      modx-cc12m      CC12M (--stream cc12m=...) in 10 parts; benchmarks COCO(5K), F30K(1K)
      dha-citm        COCO 100k/13,287/5k -> CC3M -> WIT -> GoodNews (--stream each)
      dkr-s1          COCO -> Flickr30K -> IAPR TC-12 -> EC -> RSICD
      dkr-s2          EC in 5 parts; benchmarks Flickr30K(1K), COCO(5K), EC(5K)
      mtil            ZSCL's MTIL order I: 11 classification datasets, one task each
      mtil-order2     ZSCL's MTIL order II
      mtil-fs         MoE-Adapters4CL's few-shot MTIL (5 images per class)
      x-tail          RAIL's X-TAIL: 10 domains, 16 shots, union label space
      cclip           Flickr30K -> COCO -> Pets -> Lexica -> Simpsons -> WikiArt -> Kream ->
                      Sketch (--stream each of the last six: datasets/cclip.md)
    \b
    --data layout (only the sources a preset uses):
      coco/dataset_coco.json  coco/train2014/  coco/val2014/
      flickr30k/dataset_flickr30k.json  flickr30k/flickr30k-images/
      rsicd/dataset_rsicd.json  rsicd/RSICD_images/
      ec/T2I_train.text.tsv  ec/T2I_train.img.tsv  ec/T2I_val.text.tsv  ec/T2I_val.img.tsv
      iapr/iaprtc12/images/  iapr/iaprtc12/annotations_complete_eng/
      MTIL: torchvision's layouts (fgvc-aircraft-2013b/, caltech101/, ...) or
            NAME/{train,test}/CLASS/*.jpg per dataset (datasets/mtil.md)
    \b
      cvl build-stream protocol dkr-s1 --data data --out streams/dkr-s1
      cvl build-stream protocol dha-citm --data data --stream cc3m=streams/cc3m \\
          --stream wit=streams/wit --stream goodnews=streams/goodnews --out streams/citm
    """
    streams: dict[str, str] = {}
    for s in stream_specs:
        if "=" not in s:
            raise CvlError(f"--stream '{s}': expected SOURCE=PATH")
        k, v = s.split("=", 1)
        streams[k.strip()] = v
    opts = build_options(kw)
    m = build_protocol(
        preset,
        opts.out,
        opts,
        data=data,
        streams=streams,
        streams_dir=streams_dir,
        sets=parse_sets(set_specs),
    )
    echo_summary(m, str(opts.out), quiet=not opts.progress)
    for b, bm in m.benchmarks.items():
        click.echo(f"  benchmark {b}: {bm.shards.count} pairs ({bm.description})")
