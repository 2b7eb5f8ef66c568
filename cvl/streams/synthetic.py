"""The built-in synthetic stream: procedurally drawn shapes with compositional captions.

Each task is a "domain" like a P9D industry: its own shapes, drawing style and background
tint, while colours, sizes, positions and background patterns are shared by all tasks.
Captions read "a large red outlined hexagon at the top left on a striped background"; the
category label (for mAP) is the shape. Deterministic: same arguments -> byte-identical shards.

Two layouts:

- ``overlap = K > 0`` (the default benchmark, K = shapes per task - 1 = 3): neighbouring tasks
  share vocabulary, as COCO and Flickr30K or two P9D industries do. Task t keeps the last K
  shapes of task t-1 and adds new ones, and draws its style from {style of task t-1, its own
  style}; so a model trained on task t-1 already understands much of task t, while task 0's
  style leaves the stream after task 1 and its shapes one by one, and sequential fine-tuning
  forgets them. A picture drawn in task t-1's style also takes task t-1's background tint, so
  half of task t looks like task t-1 but for the new shapes. Styles here are never also
  background words (no "dotted" object on a "dotted" background: one word, one attribute).
- ``overlap = 0`` ("disjoint", the earlier stream): every task has shapes and a style never seen
  in another task. The hard case for old-vs-new distillation.

``pretrain = N`` also writes a broad pretraining set as its own one-task stream in
``OUT/pretrain/`` (N pairs, each drawn from a uniformly chosen domain, so it covers the whole
vocabulary at low density): train CLIP_0 on it once and start every method from it with
``cvl train --init-run`` (the papers' regime: every paper starts from a trained model).
"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import click
import numpy as np
from PIL import Image, ImageDraw

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_INT, SEED, Num
from cvl.errors import CvlError
from cvl.io import atomic_dir
from cvl.progress import progress_bar
from cvl.streams.manifest import EvalSet, Manifest, TaskInfo, save_manifest
from cvl.streams.options import echo_summary
from cvl.streams.writer import BuildReport, ShardSink, encode_jpeg

SS = 4  # supersampling factor for drawing


def _regular(n: int, rot: float = 0.0) -> list[tuple[float, float]]:
    return [
        (math.cos(rot + 2 * math.pi * k / n), math.sin(rot + 2 * math.pi * k / n)) for k in range(n)
    ]


def _star(n: int, inner: float) -> list[tuple[float, float]]:
    pts = []
    for k in range(2 * n):
        r = 1.0 if k % 2 == 0 else inner
        a = -math.pi / 2 + math.pi * k / n
        pts.append((r * math.cos(a), r * math.sin(a)))
    return pts


def _circle(n: int = 48, sx: float = 1.0, sy: float = 1.0) -> list[tuple[float, float]]:
    return [(sx * x, sy * y) for x, y in _regular(n)]


# Unit-size outlines (x, y in [-1, 1], y down); distinct enough to tell apart at 32 px.
SHAPES: dict[str, list[tuple[float, float]]] = {
    "circle": _circle(),
    "square": _regular(4, math.pi / 4),
    "triangle": _regular(3, -math.pi / 2),
    "diamond": [(0, -1), (0.65, 0), (0, 1), (-0.65, 0)],
    "cross": [
        (-0.3, -1),
        (0.3, -1),
        (0.3, -0.3),
        (1, -0.3),
        (1, 0.3),
        (0.3, 0.3),
        (0.3, 1),
        (-0.3, 1),
        (-0.3, 0.3),
        (-1, 0.3),
        (-1, -0.3),
        (-0.3, -0.3),
    ],
    "star": _star(5, 0.42),
    "hexagon": _regular(6),
    "heart": [
        (0, 1),
        (-0.95, 0.05),
        (-0.95, -0.5),
        (-0.5, -0.95),
        (0, -0.55),
        (0.5, -0.95),
        (0.95, -0.5),
        (0.95, 0.05),
    ],
    "arrow": [(-1, -0.3), (0.2, -0.3), (0.2, -0.8), (1, 0), (0.2, 0.8), (0.2, 0.3), (-1, 0.3)],
    "crescent": [(math.cos(a), math.sin(a)) for a in np.linspace(0.5 * math.pi, 1.5 * math.pi, 20)]
    + [
        (0.45 * math.cos(a) - 0.1, math.sin(a))
        for a in np.linspace(1.5 * math.pi, 0.5 * math.pi, 20)
    ],
    "bar": [(-1, -0.3), (1, -0.3), (1, 0.3), (-1, 0.3)],
    "column": [(-0.3, -1), (0.3, -1), (0.3, 1), (-0.3, 1)],
    "trapezoid": [(-0.5, -0.7), (0.5, -0.7), (1, 0.7), (-1, 0.7)],
    "semicircle": [
        (math.cos(a), math.sin(a) * 1.0 + 0.3) for a in np.linspace(math.pi, 2 * math.pi, 24)
    ],
    "chevron": [(-1, -0.8), (0, 0.1), (1, -0.8), (1, -0.1), (0, 0.8), (-1, -0.1)],
    "hourglass": [(-0.8, -1), (0.8, -1), (0.1, 0), (0.8, 1), (-0.8, 1), (-0.1, 0)],
    "lshape": [(-0.8, -1), (-0.2, -1), (-0.2, 0.4), (0.8, 0.4), (0.8, 1), (-0.8, 1)],
    "tshape": [
        (-1, -1),
        (1, -1),
        (1, -0.4),
        (0.3, -0.4),
        (0.3, 1),
        (-0.3, 1),
        (-0.3, -0.4),
        (-1, -0.4),
    ],
    "ellipse": _circle(48, 1.0, 0.5),
    "kite": [(0, -1), (0.6, -0.3), (0, 1), (-0.6, -0.3)],
    "octagon": _regular(8, math.pi / 8),
    "parallelogram": [(-0.5, -0.6), (1, -0.6), (0.5, 0.6), (-1, 0.6)],
    "spark": _star(4, 0.25),
    "bowtie": [(-1, -0.8), (0, -0.15), (1, -0.8), (1, 0.8), (0, 0.15), (-1, 0.8)],
    "pentagon": _regular(5, -math.pi / 2),
    "zigzag": [
        (-1, 0.3),
        (-0.5, -0.6),
        (0, 0.3),
        (0.5, -0.6),
        (1, 0.3),
        (1, 0.8),
        (0.5, -0.1),
        (0, 0.8),
        (-0.5, -0.1),
        (-1, 0.8),
    ],
    "flag": [(-0.7, -1), (0.9, -0.6), (-0.4, -0.2), (-0.4, 1), (-0.7, 1)],
    "house": [(0, -1), (0.9, -0.2), (0.9, 1), (-0.9, 1), (-0.9, -0.2)],
}

# Colour words and a style per task: shared colours, per-task style.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (40, 190, 60),
    "blue": (40, 80, 230),
    "yellow": (240, 220, 40),
    "purple": (150, 50, 200),
    "orange": (250, 140, 20),
    "white": (245, 245, 245),
    "cyan": (40, 220, 220),
}
SIZES: dict[str, float] = {"small": 0.13, "medium": 0.18, "large": 0.24}  # radius / image side
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
    "center": (0.5, 0.5),
}
BACKGROUNDS = ("plain", "striped", "checkered", "dotted")
STYLES = (
    "filled",
    "outlined",
    "striped",
    "dotted",
    "two-tone",
    "hollow-dot",
    "thick-outlined",
    "banded",
    "speckled",
)
# Styles of the overlap layout: none of them is also a background word ("striped", "dotted"),
# so a caption never uses one word for two attributes of the picture.
CHAINED_STYLES = tuple(s for s in STYLES if s not in BACKGROUNDS)
TINTS = [
    (70, 60, 60),
    (55, 70, 60),
    (55, 60, 78),
    (72, 68, 50),
    (66, 52, 72),
    (50, 70, 72),
    (74, 58, 48),
    (58, 58, 58),
    (48, 56, 66),
]


@dataclass(frozen=True)
class SynthSpec:
    """Parameters of a synthetic stream (all recorded in the manifest's source_args)."""

    tasks: int = 5
    per_task: int = 2000
    first_task: int | None = None
    test_per_task: int | None = None
    val_per_task: int | None = None
    query_per_task: int | None = None
    gallery_per_task: int | None = None
    image_size: int = 32
    shapes_per_task: int | None = None
    overlap: int | None = None  # shapes task t keeps from t-1 [shapes per task - 1]; 0 = disjoint
    pretrain: int = 0  # pairs of the broad pretraining stream written to OUT/pretrain (0 = none)
    seed: int = 0

    def count(self, split: str, task: int) -> int:
        base = self.per_task
        if split == "train":
            return self.first_task if (task == 0 and self.first_task) else base
        defaults = {
            "test": max(50, base // 5),
            "val": max(20, base // 10),
            "query": max(20, base // 10),
            "gallery": max(50, base // 2),
        }
        v = getattr(self, f"{split}_per_task")
        return defaults[split] if v is None else v

    def n_overlap(self) -> int:
        return self.n_shapes() - 1 if self.overlap is None else self.overlap

    def n_shapes(self) -> int:
        if self.shapes_per_task:
            return self.shapes_per_task
        return max(2, min(4, len(SHAPES) // self.tasks))


def task_domains(spec: SynthSpec) -> list[dict]:
    """Which shapes, styles and tint each task uses.

    With overlap K, task t's shapes are the last K of task t-1's plus k-K new ones, and its
    styles are (task t-1's own style, its own style); with K = 0 tasks share no shape or style.
    """
    k, ov = spec.n_shapes(), spec.n_overlap()
    if not 0 <= ov < k:
        raise CvlError(f"--overlap must be in [0, {k - 1}] with {k} shapes per task (got {ov})")
    need = k + (spec.tasks - 1) * (k - ov)
    if need > len(SHAPES):
        raise CvlError(
            f"--tasks {spec.tasks} with {k} shapes each (overlap {ov}) needs {need} shapes; "
            f"there are {len(SHAPES)}"
        )
    names = list(SHAPES)
    rng = np.random.default_rng([spec.seed, 7])
    perm = [names[i] for i in rng.permutation(len(names))]
    doms: list[dict] = []
    for t in range(spec.tasks):
        if t == 0 or ov == 0:
            shapes = perm[t * k : (t + 1) * k] if ov == 0 else perm[:k]
        else:
            new0 = k + (t - 1) * (k - ov)
            shapes = doms[-1]["shapes"][-ov:] + perm[new0 : new0 + k - ov]
        own = STYLES[t % len(STYLES)] if ov == 0 else CHAINED_STYLES[t % len(CHAINED_STYLES)]
        styles = [own] if (t == 0 or ov == 0) else [doms[-1]["style"], own]
        doms.append(
            {
                "name": f"t{t}",
                "shapes": shapes,
                "style": own,
                "styles": styles,
                "tint": TINTS[t % len(TINTS)],
                # a picture drawn in the previous task's style also takes its background tint
                "tints": [
                    TINTS[(t + 1 - len(styles) + i) % len(TINTS)] for i in range(len(styles))
                ],
            }
        )
    return doms


def _texture(size: int, style: str, colour: tuple[int, int, int], jitter: list) -> Image.Image:
    """Full-canvas texture in the object's colour for a style (masked by the shape later).

    `jitter`: the speckled style's (dx, dy) per dot, drawn in advance (`texture_jitter`)."""
    img = Image.new("RGB", (size, size), colour)
    d = ImageDraw.Draw(img)
    dark = tuple(int(c * 0.35) for c in colour)
    step = max(4, size // 10)
    if style in ("striped", "banded"):
        w = step // 2 if style == "striped" else step
        for x in range(-size, size, step * (1 if style == "striped" else 2)):
            if style == "striped":
                d.line([(x, 0), (x + size, size)], fill=dark, width=w)
            else:
                d.rectangle([0, x + size // 2, size, x + size // 2 + w // 2], fill=dark)
    elif style in ("dotted", "speckled"):
        r = step // 4 if style == "dotted" else step // 6
        dots = iter(jitter)
        for y in range(step // 2, size, step):
            for x in range(step // 2, size, step):
                jx, jy = next(dots) if style == "speckled" else (0, 0)
                d.ellipse([x + jx - r, y + jy - r, x + jx + r, y + jy + r], fill=dark)
    elif style == "two-tone":
        d.rectangle([0, size // 2, size, size], fill=(250, 250, 250))
    return img


def texture_jitter(size: int, style: str, rng: np.random.Generator) -> list[tuple[int, int]]:
    """The speckled style's random dot offsets, in drawing order (empty for other styles)."""
    if style != "speckled":
        return []
    step = max(4, size // 10)
    r = step // 6
    n = len(range(step // 2, size, step)) ** 2
    return [tuple(int(v) for v in rng.integers(-r, r + 1, 2)) for _ in range(n)]


def plan_sample(spec: SynthSpec, dom: dict, rng: np.random.Generator) -> dict:
    """Every random choice of one sample, drawn from `rng` (cheap; drawing is `render_sample`).

    Kept apart so a builder can draw plans in order in one process and render them in many:
    the same rng sequence, hence the same bytes, whatever the number of processes."""
    S = spec.image_size * SS
    shapes = dom["shapes"]
    # time mode: concepts drawn by their popularity in the period (domains: uniformly)
    pick = (
        rng.choice(len(shapes), p=dom["weights"]) if "weights" in dom else rng.integers(len(shapes))
    )
    p: dict = {
        "shape": shapes[pick],
        "colour": list(COLOURS)[rng.integers(len(COLOURS))],
        "size": list(SIZES)[rng.integers(len(SIZES))],
        "pos": list(POSITIONS)[rng.integers(len(POSITIONS))],
        "bg": BACKGROUNDS[rng.integers(len(BACKGROUNDS))],
    }
    # a second style costs one more draw, only where a task has two (disjoint streams unchanged);
    # the style chosen brings its task's background tint
    styles = dom.get("styles", [dom["style"]])
    k = int(rng.integers(len(styles))) if len(styles) > 1 else 0
    p["style"] = styles[k]
    tint = np.array(dom.get("tints", [dom["tint"]])[k])
    p["base"] = tuple(int(v) for v in np.clip(tint + rng.integers(-8, 9, 3), 0, 255))
    cx, cy = POSITIONS[p["pos"]]
    p["cx"] = cx + rng.uniform(-0.04, 0.04)
    p["cy"] = cy + rng.uniform(-0.04, 0.04)
    p["rad"] = SIZES[p["size"]] * rng.uniform(0.9, 1.1) * S
    p["rot"] = rng.uniform(-0.25, 0.25)
    p["jitter"] = texture_jitter(S, p["style"], rng)
    # time mode: a colour or size word may have a newer name in this period (vocabulary drift)
    for w in (p["colour"], p["size"]):
        if w in dom.get("words", {}):
            new, prob = dom["words"][w]
            if prob >= 1 or (prob > 0 and rng.random() < prob):
                p.setdefault("words", {})[w] = new
    return p


def render_sample(image_size: int, p: dict) -> tuple[Image.Image, str, str]:
    """Draw a planned sample: image, caption, category (the shape name). No randomness."""
    S = image_size * SS
    base, style, cx, cy, rad = p["base"], p["style"], p["cx"], p["cy"], p["rad"]
    light = tuple(int(v) for v in np.clip(np.array(base) + 35, 0, 255))
    img = Image.new("RGB", (S, S), base)
    d = ImageDraw.Draw(img)
    step = S // 8
    if p["bg"] == "striped":
        for y in range(0, S, step):
            d.rectangle([0, y, S, y + step // 3], fill=light)
    elif p["bg"] == "checkered":
        for y in range(0, S, step):
            for x in range(0, S, step):
                if (x // step + y // step) % 2 == 0:
                    d.rectangle([x, y, x + step - 1, y + step - 1], fill=light)
    elif p["bg"] == "dotted":
        r = step // 6
        for y in range(step // 2, S, step):
            for x in range(step // 2, S, step):
                d.ellipse([x - r, y - r, x + r, y + r], fill=light)
    c, s = math.cos(p["rot"]), math.sin(p["rot"])
    poly = [
        (cx * S + rad * (x * c - y * s), cy * S + rad * (x * s + y * c))
        for x, y in SHAPES[p["shape"]]
    ]
    mask = Image.new("L", (S, S), 0)
    md = ImageDraw.Draw(mask)
    if style in ("outlined", "thick-outlined"):
        width = max(2, int(rad * (0.22 if style == "outlined" else 0.4)))
        md.polygon(poly, outline=255, width=width)
    elif style == "hollow-dot":
        md.polygon(poly, fill=255)
        r2 = rad * 0.35
        md.ellipse([cx * S - r2, cy * S - r2, cx * S + r2, cy * S + r2], fill=0)
    else:
        md.polygon(poly, fill=255)
    img.paste(_texture(S, style, COLOURS[p["colour"]], p["jitter"]), (0, 0), mask)
    img = img.resize((image_size, image_size), Image.LANCZOS)
    w = p.get("words", {})  # the period's name of a word (time mode), else the word
    size, colour = w.get(p["size"], p["size"]), w.get(p["colour"], p["colour"])
    caption = f"a {size} {colour} {style} {p['shape']} at the {p['pos']} on a {p['bg']} background"
    return img, caption, p["shape"]


def draw_sample(
    spec: SynthSpec, dom: dict, rng: np.random.Generator
) -> tuple[Image.Image, str, str]:
    """One image with its caption and category (the shape name)."""
    return render_sample(spec.image_size, plan_sample(spec, dom, rng))


def _encoded(job: tuple[int, dict]) -> tuple[bytes, str, str]:
    """Render + JPEG-encode one planned sample (runs in a builder process)."""
    img, cap, cat = render_sample(*job)
    return encode_jpeg(img), cap, cat


SPLITS = ("train", "test", "val", "query", "gallery")
SPLIT_KIND = {"test": "pairs", "val": "pairs", "query": "query", "gallery": "gallery"}


def _write_tasks(
    tmp: Path,
    spec: SynthSpec,
    tasks_def: list[tuple[str, list[dict], dict[str, int]]],
    report: BuildReport,
    bar: Any,
    pool: Pool | None = None,
) -> tuple[dict[str, TaskInfo], dict[str, EvalSet]]:
    """Draw and write every split of every task; a task samples from one or several domains.

    Plans (every random draw) are made in order here; with a `pool` its processes render and
    encode them, and the results come back in the same order, so the shards are the same bytes.
    """

    def jobs():
        for t, (_, doms, counts) in enumerate(tasks_def):
            for si, split in enumerate(SPLITS):
                rng = np.random.default_rng(
                    [spec.seed, t, si] if len(doms) == 1 else [spec.seed, 99, si]
                )
                for _ in range(counts.get(split, 0)):
                    dom = doms[0] if len(doms) == 1 else doms[rng.integers(len(doms))]
                    yield spec.image_size, plan_sample(spec, dom, rng)

    results = pool.imap(_encoded, jobs(), chunksize=16) if pool else map(_encoded, jobs())
    tasks: dict[str, TaskInfo] = {}
    evals: dict[str, dict] = {sp: {} for sp in SPLITS[1:]}
    for name, doms, counts in tasks_def:
        for split in SPLITS:
            rel = f"train/{name}" if split == "train" else f"eval/{split}/{name}"
            sink = ShardSink(tmp, rel, maxcount=5000)
            for i in range(counts.get(split, 0)):
                jpg, cap, cat = next(results)
                sid = f"{name}-{split}-{i:06d}"
                meta = {"id": sid, "task": name, "category": cat, "source": "synthetic"}
                sink.write(sid, jpg, cap, meta)
                report.read += 1
                report.keep(split)
                bar.update()
            shards = sink.close()
            if split == "train":
                shapes = list(dict.fromkeys(s for d in doms for s in d["shapes"]))
                styles = list(dict.fromkeys(s for d in doms for s in d["styles"]))
                tasks[name] = TaskInfo(
                    name=name,
                    train=shards,
                    description=f"{'/'.join(styles)} {', '.join(shapes)}",
                    categories=shapes,
                    extra={"style": styles[-1], "styles": styles},
                )
            elif shards.count > 0:
                evals[split][name] = shards
    return tasks, {sp: EvalSet(SPLIT_KIND[sp], ts) for sp, ts in evals.items() if ts}


PRETRAIN_DIR = "pretrain"


@contextmanager
def _pool(processes: int) -> Iterator[Pool | None]:
    """A process pool for rendering (None for one process); fork where the OS has it."""
    if processes <= 1:
        yield None
        return
    methods = mp.get_all_start_methods()
    with mp.get_context("fork" if "fork" in methods else "spawn").Pool(processes) as pool:
        yield pool


def build_synthetic(
    out: str | Path,
    spec: SynthSpec,
    name: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    processes: int = 1,
) -> Manifest:
    """Write a synthetic stream folder (atomically) and return its manifest.

    With `spec.pretrain` > 0 the folder also holds the pretraining stream in `pretrain/`.
    `processes` > 1 renders and encodes the images in that many processes: the same bytes.
    """
    if processes < 1:
        raise CvlError("--processes must be positive")
    for field_name in ("tasks", "per_task", "image_size"):
        if getattr(spec, field_name) <= 0:
            raise CvlError(f"--{field_name.replace('_', '-')} must be positive")
    if spec.image_size < 16:
        raise CvlError("--image-size must be at least 16")
    if spec.pretrain < 0:
        raise CvlError("--pretrain must be >= 0")
    for split in SPLITS[1:]:
        if spec.count(split, 1) < 0:
            raise CvlError(f"--{split}-per-task must be >= 0")
    doms = task_domains(spec)
    out = Path(out)
    defs = [(d["name"], [d], {sp: spec.count(sp, t) for sp in SPLITS}) for t, d in enumerate(doms)]
    pre = {"train": spec.pretrain, "test": min(500, max(50, spec.pretrain // 10))}
    total = sum(sum(c.values()) for *_, c in defs) + (sum(pre.values()) if spec.pretrain else 0)
    report = BuildReport()
    args = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    layout = (
        f"neighbouring tasks share {spec.n_overlap()} shapes and a style with its background tint"
        if spec.n_overlap()
        else "disjoint shapes and style per task; own background tint"
    )
    with atomic_dir(out, overwrite=overwrite, kind="stream") as tmp, _pool(processes) as pool:
        bar = progress_bar(total=total, desc="synthetic", unit="img", show=progress, leave=False)
        tasks, eval_sets = _write_tasks(tmp, spec, defs, report, bar, pool)
        if spec.pretrain:
            ptmp = tmp / PRETRAIN_DIR
            pdef = [("pretrain", doms, pre)]
            ptasks, pevals = _write_tasks(ptmp, spec, pdef, BuildReport(), bar, pool)
            pm = Manifest(
                name=f"{name or out.name}-pretrain",
                source="synthetic",
                split_rule="pretraining set: each pair drawn from a uniformly chosen domain of "
                f"the stream '{name or out.name}' (the whole vocabulary)",
                seed=spec.seed,
                task_order=["pretrain"],
                tasks=ptasks,
                eval_sets=pevals,
                source_args={**args, "pretrain_of": name or out.name},
            )
            save_manifest(pm, ptmp)
        bar.close()
        m = Manifest(
            name=name or out.name,
            source="synthetic",
            split_rule=f"one domain per task ({layout}); "
            "colours, sizes, positions and background patterns shared",
            seed=spec.seed,
            task_order=[d["name"] for d in doms],
            tasks=tasks,
            eval_sets=eval_sets,
            source_args={**args, **({"pretrain_stream": PRETRAIN_DIR} if spec.pretrain else {})},
        )
        save_manifest(m, tmp)
        report.save(tmp)
    m.root = out.absolute()
    return m


# -- command line ------------------------------------------------------------------------------
@click.command("synthetic")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Stream folder to write."
)
@click.option(
    "--tasks", default=5, show_default=True, type=POSITIVE_INT, help="Number of tasks (domains)."
)
@click.option(
    "--per-task",
    default=2000,
    show_default=True,
    type=POSITIVE_INT,
    help="Training pairs per task.",
)
@click.option(
    "--first-task",
    default=None,
    type=POSITIVE_INT,
    help="Training pairs of task 0 if different (a larger first task, as Mod-X's COCO).",
)
@click.option(
    "--test-per-task",
    default=None,
    type=NON_NEGATIVE_INT,
    help="Test pairs per task [max(50, per_task/5)].",
)
@click.option(
    "--val-per-task",
    default=None,
    type=NON_NEGATIVE_INT,
    help="Validation pairs per task [max(20, per_task/10)].",
)
@click.option(
    "--query-per-task",
    default=None,
    type=NON_NEGATIVE_INT,
    help="mAP queries per task [max(20, per_task/10)].",
)
@click.option(
    "--gallery-per-task",
    default=None,
    type=NON_NEGATIVE_INT,
    help="mAP gallery items per task [max(50, per_task/2)].",
)
@click.option(
    "--shapes-per-task",
    default=None,
    type=POSITIVE_INT,
    help="Shapes (categories) per task [min(4, 28/tasks)].",
)
@click.option(
    "--overlap",
    default=None,
    type=NON_NEGATIVE_INT,
    help="Shapes each task keeps from the previous task (it also draws half its pictures in "
    "the previous task's style) [shapes per task - 1]; 0 = the 'disjoint' stream (no shape or "
    "style shared between tasks).",
)
@click.option(
    "--pretrain",
    default=0,
    show_default=True,
    type=NON_NEGATIVE_INT,
    help="Also write a broad pretraining stream of N pairs (all domains) to OUT/pretrain: "
    "train CLIP_0 on it, then start methods from it with `cvl train --init-run`.",
)
@click.option(
    "--image-size", default=32, show_default=True, type=POSITIVE_INT, help="Image side in pixels."
)
@click.option(
    "--seed", type=SEED, default=0, show_default=True, help="Same seed -> byte-identical stream."
)
@click.option(
    "--mode",
    default="domains",
    show_default=True,
    type=click.Choice(["domains", "time"]),
    help="domains: one domain per task (above); time: a drifting, time-ordered stream "
    "(TiC-CLIP's setting): one period (year) per task, shapes entering and fading, colour and "
    "size words taking newer names, per-period retrieval sets (benchmarks ret-YEAR). In time "
    "mode --per-task and --test-per-task count per period, --shapes-per-task are the shapes "
    "live in a period, --val-per-task defaults to 0 and there are no query/gallery sets.",
)
@click.option(
    "--first-periods",
    default=1,
    show_default=True,
    type=POSITIVE_INT,
    help="Time mode: periods merged into the first task (TiC-DataComp's 2014-2016: 3).",
)
@click.option(
    "--start-year",
    default=2014,
    show_default=True,
    type=Num(int),
    help="Time mode: the first period's label.",
)
@click.option("--name", default=None, help="Stream name [folder name].")
@click.option(
    "--processes",
    default=1,
    show_default=True,
    type=POSITIVE_INT,
    help="Processes that draw and encode the images (the same bytes for any number).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def synthetic_cmd(
    out: str,
    name: str | None,
    overwrite: bool,
    quiet: bool,
    processes: int,
    mode: str,
    first_periods: int,
    start_year: int,
    **kw: int | None,
) -> None:
    """Procedurally drawn shapes with compositional captions, one domain per task.

    Runs offline in seconds; the embedded default of `make demo` and the tests. Tasks share
    colours, sizes, positions and background patterns, and differ in shapes (the category
    label used by mAP), drawing style and background tint, so sequential fine-tuning forgets.
    By default neighbouring tasks also share most shapes and a style (--overlap), as COCO and
    Flickr30K share vocabulary; --overlap 0 gives the disjoint stream.

    \b
    The papers' regime (a trained start):
      cvl build-stream synthetic --out streams/s --pretrain 3000
      cvl train --stream streams/s/pretrain --method seqft --out runs/clip0
      cvl train --stream streams/s --init-run runs/clip0 --method modx --out runs/modx
    A drifting time-ordered stream (TiC-CLIP's protocol, recipes/tic.sh):
      cvl build-stream synthetic --mode time --tasks 5 --first-periods 3 --out streams/tic
    """
    if mode == "time":
        from cvl.streams.synthetic_time import build_synthetic_time, time_spec

        m = build_synthetic_time(
            out,
            time_spec(kw, first_periods, start_year),
            name=name,
            overwrite=overwrite,
            progress=not quiet,
            processes=processes,
        )
        echo_summary(m, out, quiet)
        return
    if first_periods != 1:
        raise CvlError("--first-periods: only with --mode time")
    m = build_synthetic(
        out,
        SynthSpec(**kw),
        name=name,
        overwrite=overwrite,
        progress=not quiet,
        processes=processes,
    )
    echo_summary(m, out, quiet)
