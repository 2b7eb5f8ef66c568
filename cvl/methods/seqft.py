"""SeqF: fine-tune on each task in turn with the base loss (the lower bound)."""

from __future__ import annotations

from cvl.methods.base import Method
from cvl.methods.registry import register


@register("seqft")
class SeqFT(Method):
    """Sequential fine-tuning with the base loss (ITC, + MLM for fusion); lower bound."""
