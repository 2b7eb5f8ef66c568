"""What the synthetic streams draw: the vocabulary (shapes, colours, sizes, positions, styles,
backgrounds, tints), `SynthSpec` (a stream's arguments), each task's domain (`task_domains`),
and one sample planned from a seeded generator and rendered (`plan_sample`, `render_sample`),
with the worker pool that renders them.

Kept apart from the stream builders that use it (synthetic.py: the task stream and its
pretraining set; synthetic_time.py: the dated stream; synthetic_folders.py: class folders) so
that none of them imports another for the drawing. `cvl.streams.synthetic` re-exports every
name.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.pool import Pool

import numpy as np
from PIL import Image, ImageDraw

from cvl.errors import CvlError
from cvl.streams.writer import encode_jpeg

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


def encoded_sample(job: tuple[int, dict]) -> tuple[bytes, str, str]:
    """Render + JPEG-encode one planned sample (runs in a builder process)."""
    img, cap, cat = render_sample(*job)
    return encode_jpeg(img), cap, cat


@contextmanager
def drawing_pool(processes: int) -> Iterator[Pool | None]:
    """A process pool for rendering (None for one process); fork where the OS has it."""
    if processes <= 1:
        yield None
        return
    methods = mp.get_all_start_methods()
    with mp.get_context("fork" if "fork" in methods else "spawn").Pool(processes) as pool:
        yield pool
