"""`cvl ARGS` with one more trainable 2-D parameter on the CLIP model that no loss reaches
(as a captioning or ITM head a contrastive step leaves alone), drawn from a fixed seed.

    torchrun --nproc_per_node 2 tests/unused_param_run.py train ...    (or one process;
    in a test's own process: `with unused_param(): ...`)

tests/test_distributed.py checks that AdamW leaves it untouched with 2 processes as with one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from cvl.models.clip import CLIPModel

UNUSED = "unused_head"


def unused_init() -> torch.Tensor:
    """The extra parameter's initial value (the same in every process and in the test)."""
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


_real_init = CLIPModel.__init__


def _init(self: CLIPModel, cfg: dict) -> None:
    _real_init(self, cfg)
    setattr(self, UNUSED, torch.nn.Parameter(unused_init()))


@contextlib.contextmanager
def unused_param() -> Iterator[None]:
    """CLIP models built inside get the extra parameter (the test's own process: restored)."""
    CLIPModel.__init__ = _init
    try:
        yield
    finally:
        CLIPModel.__init__ = _real_init


if __name__ == "__main__":
    from cvl.cli import main

    with unused_param():
        sys.exit(main(sys.argv[1:]))
