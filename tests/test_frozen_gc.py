"""`cvl.train.loop.frozen_gc`: the trainer's per-task `gc.collect()` skips what was alive at
the start, and garbage made before or inside the block is still collected."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

from cvl.train.loop import Trainer, frozen_gc


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_frozen_inside_and_released_after():
    kept = _Node()  # noqa: F841 (alive at the start: frozen inside)
    assert gc.get_freeze_count() == 0
    with frozen_gc():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_garbage_before_and_inside_is_collected():
    old = _Node()
    before = weakref.ref(old)
    del old  # cyclic garbage made before the block: the block's first collection frees it
    with frozen_gc():
        assert before() is None
        new = _Node()  # made inside (as a task's optimizer): a full collection frees it
        inside = weakref.ref(new)
        del new
        gc.collect()
        assert inside() is None


def test_leaves_a_callers_freeze_alone():
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        with frozen_gc():
            assert gc.get_freeze_count() == n
        assert gc.get_freeze_count() == n  # not unfrozen by the block
    finally:
        gc.unfreeze()


def test_trainer_run_trains_inside_the_block():
    seen = []
    fake = SimpleNamespace(
        _run=lambda: seen.append(gc.get_freeze_count()),
        cost=SimpleNamespace(abort=lambda: None),
        _release_lock=lambda: None,
    )
    Trainer.run(fake)
    assert seen and seen[0] > 0 and gc.get_freeze_count() == 0
