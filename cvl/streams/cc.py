"""Conceptual Captions sources: CC12M (`url<TAB>caption`) and CC3M (`caption<TAB>url`).

Both files are headerless TSVs, one pair per line, no quoting. A pair's id is the source name
and its 0-based line number (``cc12m-000001234``), stable across samples and reruns.

Split: IncCLIP's *instance* split: ``--sample N`` training pairs drawn at random (seeded) and cut
into ``--chunks K`` equal chunks, plus ``--test``/``--val`` pairs per chunk held out from the
same draw. DHA's CITM task is the same with one chunk (``--chunks 1 --sample 130000 --val 13000
--test 5000``). IncCLIP's class split (BEiT pseudo-labels) needs the images: build a pool with
one chunk, then `cvl pseudo-label` and `cvl build-stream class-split` (see datasets/cc12m.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cvl.errors import CvlError
from cvl.streams.manifest import Manifest
from cvl.streams.options import build_options, common_options, finish, split_options
from cvl.streams.pipeline import BuildOptions, Dropper, InstanceSplit, Row, build_stream, clean_text
from cvl.streams.table import collect, iter_lines, require_file
from cvl.streams.writer import BuildReport

LAYOUTS = {"cc12m": ("url", "caption"), "cc3m": ("caption", "url")}
SPLITS_AVAILABLE = ("instance",)


def parse_cc(source: str, path: Path):  # noqa: ANN201
    """A parser of one CC line (fields) into a Row, dropping bad lines with a reason."""
    iu, ic = (0, 1) if LAYOUTS[source][0] == "url" else (1, 0)

    def parse(no: int, fields: Any, d: Dropper | None) -> Row | None:
        where = f"{path.name}:{no + 1}"
        if fields is None or len(fields) != 2:
            if d:
                d(
                    "malformed_row",
                    where=where,
                    detail=f"{0 if fields is None else len(fields)} field(s), want 2",
                )
            return None
        url, cap = fields[iu].strip(), clean_text(fields[ic])
        row = Row(id=f"{source}-{no:09d}", caption=cap or "", url=url or None)
        if no == 0 and url.lower() == "url":  # a header line some mirrors add
            return None
        if not url.lower().startswith(("http://", "https://")):
            if d:
                d("bad_url" if url else "missing_url", row, detail=url[:200])
            return None
        if cap is None:
            if d:
                d("missing_caption", row)
            return None
        try:
            cap.encode("utf-8")
            url.encode("utf-8")
        except UnicodeEncodeError:
            if d:
                d("non_utf8", row)
            return None
        return row

    return parse


def build_cc(
    source: str,
    tsv: str | Path,
    opts: BuildOptions,
    *,
    split: str = "instance",
    chunks: int = 4,
    sample: int | None = None,
    val: int = 0,
    test: int = 0,
) -> Manifest:
    """`cvl build-stream cc12m|cc3m`: an instance-split stream from the TSV."""
    if source not in LAYOUTS:
        raise CvlError(f"unknown CC source '{source}'")
    if split not in SPLITS_AVAILABLE:
        raise CvlError(f"--split {split}: only {', '.join(SPLITS_AVAILABLE)} is available here")
    path = require_file(tsv, "--tsv")
    report = BuildReport()
    drop = Dropper(report)
    need = None if sample is None else sample + chunks * (val + test)
    opts.log(
        f"{source}: reading {path}" + (f" (sampling {need} pairs, two passes)" if need else "")
    )
    rows = collect(
        lambda: iter_lines(path),
        parse_cc(source, path),
        drop,
        report,
        sample=need,
        seed=opts.seed,
        progress=opts.progress,
    )
    names = [source] if chunks == 1 else [f"chunk{i}" for i in range(chunks)]
    rule = InstanceSplit(chunks, train=sample, val=val, test=test, seed=opts.seed, names=names)
    args = {
        "tsv": str(path),
        "layout": "\\t".join(LAYOUTS[source]),
        "split": split,
        "chunks": chunks,
        "sample": sample,
        "val": val,
        "test": test,
    }
    return build_stream(rows, rule, opts, source=source, report=report, drop=drop, source_args=args)


# -- command line ------------------------------------------------------------------------------
def _cc_command(source: str, layout: str, paper: str, example: str):  # noqa: ANN202
    doc = (
        f"{source.upper()}: instance split into seeded random equal chunks ({paper}).\n\n"
        f"\b\n{layout} per line; ids are {source}-<line>; --test/--val pairs per task are held\n"
        f"out from the same seeded draw. See datasets/{source}.md.\n  {example}"
    )

    @click.command(source, help=doc)
    @click.option(
        "--tsv",
        required=True,
        type=click.Path(dir_okay=False),
        help=f"The {source.upper()} TSV (headerless, {layout} per line).",
    )
    @click.option(
        "--split",
        default="instance",
        show_default=True,
        type=click.Choice(["instance"]),
        help="Split rule (the BEiT class split plugs in as pipeline.ClassSplit).",
    )
    @split_options(4 if source == "cc12m" else 1)
    @common_options
    def cmd(
        tsv: str, split: str, chunks: int, sample: int | None, val: int, test: int, **kw
    ) -> None:

        opts = build_options(kw)
        m = build_cc(
            source, tsv, opts, split=split, chunks=chunks, sample=sample, val=val, test=test
        )
        finish(m, str(opts.out), quiet=not opts.progress)

    return cmd


cc12m_cmd = _cc_command(
    "cc12m",
    "url<TAB>caption",
    "IncCLIP: 2M pairs in 4 chunks of 0.5M",
    "cvl build-stream cc12m --tsv cc12m.tsv --out streams/cc2m --chunks 4 \\\n"
    "      --sample 2000000 --test 5000 --processes 16 --threads 64",
)
cc3m_cmd = _cc_command(
    "cc3m",
    "caption<TAB>url",
    "DHA's CITM task: one chunk, 130k/13k/5k",
    "cvl build-stream cc3m --tsv Train_GCC-training.tsv --out streams/cc3m \\\n"
    "      --sample 130000 --val 13000 --test 5000",
)
