"""Per-task model selection on a validation set (`--select`).

DHA's protocol (CITM paper §4.1, Fig. 3, Alg. 1): "after the main model has completed its
training on task T_{t-1}, we find the best main model on the validation set of T_{t-1}", and
that model is both the task's result and the start of the next task. The loop supports it for
every method: with `--select best-val` the model is scored on the task's validation pairs at
the end of every epoch (and at an early stop), the best weights are kept, and at the end of
the task they replace the last ones before `after_task`, the buffer update and the saved
checkpoint. `auto` (default) selects on validation for methods that ask for it (DHA) when the
stream has a `val` set for the task, and keeps the last weights otherwise.

Score: Rm on the validation pairs = the mean of TR@1/5/10 and IR@1/5/10 (R@mean averaged
over both directions), with the same hit rule as `cvl eval`. A tie keeps the earlier epoch.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.errors import CvlError
from cvl.train.fsdp import gathered, state_copy

SELECT_CHOICES = ("auto", "last", "best-val")


def selection_set(manifest: Any, task: str, select: str, method: Any) -> str | None:
    """The eval set to select on for `task`, or None to keep the last weights."""
    if select not in SELECT_CHOICES:
        raise CvlError(f"--select must be one of {', '.join(SELECT_CHOICES)}, got '{select}'")
    if select == "last" or (select == "auto" and not getattr(method, "selects_best_val", False)):
        return None
    es = manifest.eval_sets.get("val")
    has_val = es is not None and es.kind == "pairs" and task in es.tasks
    if select == "best-val" and not has_val:
        raise CvlError(
            f"--select best-val: stream '{manifest.name}' has no 'val' pairs for task '{task}'"
        )
    return "val" if has_val else None


@torch.no_grad()
def val_score(model: Any, manifest: Any, set_name: str, task: str, accelerator: Any) -> float:
    """Rm (%) of `model` on the task's validation pairs; the same value on every rank."""
    from cvl.evaluation.embed import embed_dataset, eval_dataset
    from cvl.evaluation.retrieval import retrieval_metrics
    from cvl.evaluation.runner import match_rule

    was = model.training
    model.eval()
    try:
        ds = eval_dataset(model, manifest.eval_shards(set_name, task))
        with gathered(model):  # --fsdp: ranks may embed different numbers of batches
            e = embed_dataset(model, ds, accelerator=accelerator)
    finally:
        model.train(was)
    r = retrieval_metrics(
        e.image_features, e.text_features, e.text_to_image, e.captions, match_rule(manifest)
    )
    return float(r["Rm"])


class BestKeeper:
    """The best-scoring weights of a task so far (a CPU copy) and where they came from."""

    def __init__(self) -> None:
        self.score: float | None = None
        self.epoch: int | None = None
        self.step: int | None = None
        self.validated: int = -1  # last epoch scored (resume re-scores a missed epoch end)
        self.weights: dict[str, torch.Tensor] | None = None
        self.history: list[dict[str, float]] = []

    def offer(self, model: torch.nn.Module, score: float, epoch: int, step: int) -> bool:
        """Keep the model's weights if `score` beats the best so far; True if kept."""
        self.validated = epoch
        self.history.append({"epoch": epoch, "step": step, "val_Rm": score})
        if self.score is not None and score <= self.score:
            return False
        self.score, self.epoch, self.step = score, epoch, step
        self.weights = state_copy(model)  # CPU copies (local shards under --fsdp)
        return True

    def info(self) -> dict[str, Any]:
        """JSON-able summary (task.json, mid-task position)."""
        return {
            "by": "val_Rm",
            "score": self.score,
            "epoch": self.epoch,
            "step": self.step,
            "validated": self.validated,
            "history": self.history,
        }

    def load_info(self, d: dict[str, Any], weights: dict[str, torch.Tensor] | None) -> None:
        self.score, self.epoch, self.step = d.get("score"), d.get("epoch"), d.get("step")
        self.validated = int(d.get("validated", -1))
        self.history = list(d.get("history", []))
        self.weights = weights
