"""`make test`'s `--dist loadgroup` keeps a test marked `xdist_group` on one worker: its node id
carries `@NAME` (tests/conftest.py restores it where pytest-xdist's own hook no longer can)."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("xdist_groups_check")
def test_a_grouped_test_is_scheduled_by_its_group(request):
    grouped = request.node.nodeid.endswith("@xdist_groups_check")
    assert grouped == bool(getattr(request.config.option, "loadgroup", False))


def test_an_ungrouped_test_keeps_its_plain_id(request):
    assert "@" not in request.node.nodeid
