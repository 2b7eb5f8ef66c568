"""Zero-shot: no training; the initial weights are every task's checkpoint (for eval tables)."""

from __future__ import annotations

from cvl.methods.base import Method
from cvl.methods.registry import register


@register("zeroshot")
class ZeroShot(Method):
    """No training: evaluates the initial (e.g. pretrained) weights on every task."""

    trains = False
