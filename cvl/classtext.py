"""Class texts: a task's label space (class names, prompt templates) from the stream manifest,
and the text embeddings of its classes, for training (`--base-loss class-ce`) and evaluation.

A classification stream (`cvl build-stream classification`, `protocol mtil*`) stores, per task,
its ``categories`` in class-index order (``TASK/CLASS`` strings, the samples' KEY.json
``category``) and ``templates`` (the dataset's prompt templates; the first one is the training
caption's), and a ``class_map`` whose ``prompts`` are the class names put into the templates.
Any stream whose task lists ``categories`` works too (the class name is then the category, or
its class-map prompt; the template defaults to ``a photo of a {}.``).

Kept apart from the loss and from evaluation so that other methods (MoE-Adapters' routers,
prompt learners) can reuse the same label spaces and class-text features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cvl.errors import CvlError

DEFAULT_TEMPLATE = "a photo of a {}."


@dataclass(frozen=True)
class LabelSpace:
    """Classes in label order: their category strings, prompt names and templates."""

    categories: tuple[str, ...]
    names: tuple[str, ...]
    templates: tuple[str, ...]

    def prompts(self, template: int | None = 0) -> list[str]:
        """One prompt per class with template `template`, or (None) every template per class,
        class-major (class 0's templates first)."""
        ts = self.templates if template is None else (self.templates[template],)
        return [t.format(n) for n in self.names for t in ts]

    def labels(self, categories: Sequence[Any], device: torch.device | None = None) -> torch.Tensor:
        """Class index of each item's category, -1 for items of no class of this space."""
        idx = {c: i for i, c in enumerate(self.categories)}
        ys = [idx.get(str(c), -1) if c is not None else -1 for c in categories]
        return torch.tensor(ys, dtype=torch.long, device=device)


def task_label_space(manifest: Any, task: str) -> LabelSpace:
    """The label space of one task of a stream (a clear error when it has none)."""
    info = manifest.tasks.get(task)
    if info is None:
        raise CvlError(f"stream '{manifest.name}' has no task '{task}'")
    cats = info.categories
    if not cats:
        raise CvlError(
            f"task '{task}' of stream '{manifest.name}' lists no classes (categories): "
            "--base-loss class-ce needs a classification stream (cvl build-stream classification)"
        )
    templates = info.extra.get("templates") or [DEFAULT_TEMPLATE]
    return LabelSpace(tuple(cats), tuple(manifest.prompt_names(list(cats))), tuple(templates))


_TOKENS: dict[tuple, torch.Tensor] = {}


def prompt_tokens(model: Any, prompts: Sequence[str]) -> torch.Tensor:
    """The model's tokens of `prompts` (cached on the CPU: a task's prompts are tokenized once)."""
    key = (id(model.tokenizer), tuple(prompts))
    tok = _TOKENS.get(key)
    if tok is None:
        if len(_TOKENS) > 64:
            _TOKENS.clear()
        tok = _TOKENS[key] = model.tokenizer(list(prompts))
    return tok


def class_text_features(model: Any, space: LabelSpace, template: int = 0) -> torch.Tensor:
    """[C, D] normalised text embeddings of the classes' prompts with one template, through
    the model as it is (with gradient when enabled: the training loss backpropagates into the
    text tower, as the ZSCL code's ``model(None, texts)`` does each iteration)."""
    device = next(model.parameters()).device
    tok = prompt_tokens(model, space.prompts(template)).to(device, non_blocking=True)
    return model.encode_text(tok)


def category_templates(
    manifest: Any, categories: Sequence[str], default: Sequence[str]
) -> list[tuple[str, ...]]:
    """Each category's prompt templates: those of the task that lists it (a classification
    stream's per-dataset ensembles), else `default`."""
    of: dict[str, tuple[str, ...]] = {}
    for info in manifest.tasks.values():
        tm = info.extra.get("templates")
        if tm:
            for c in info.categories or []:
                of.setdefault(c, tuple(tm))
    return [of.get(c, tuple(default)) for c in categories]


def union_templates(manifest: Any) -> list[str] | None:
    """Templates for classifying over every class of the stream at once (X-TAIL: RAIL's
    ``a photo of a {}.``), when the stream fixes them; None: each class keeps its own."""
    return ((manifest.class_map or {}).get("union_templates")) or None


def has_task_templates(manifest: Any) -> bool:
    """Whether the stream's tasks carry their own prompt templates."""
    return any(info.extra.get("templates") for info in manifest.tasks.values())


def same_prompt(
    categories: Sequence[str], names: Sequence[str], templates: Sequence[Sequence[str]]
) -> dict[str, str]:
    """Classes whose prompts (`names[i]` in each of `templates[i]`) are those of an earlier
    class, each mapped to that first class. Over the classes of several datasets (MTIL's and
    X-TAIL's all-classes label space: Caltech-101's and Flowers-102's ``sunflower`` under
    ``a photo of a {}.``) such classes have one text embedding: the same class to the model,
    so the all-classes classifier keeps one of them and either is a right answer."""
    first: dict[tuple[str, ...], str] = {}
    out: dict[str, str] = {}
    for c, n, ts in zip(categories, names, templates):
        f = first.setdefault(tuple(t.format(n) for t in ts), c)
        if f != c:
            out[c] = f
    return out
