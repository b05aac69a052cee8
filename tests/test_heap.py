"""Start-up's objects are frozen out of garbage collection once a server process is ready."""

from __future__ import annotations

import gc

import pytest

from pagerail.common.heap import freeze_startup_heap


@pytest.fixture
def thawed():
    yield
    gc.unfreeze()  # the rest of the test session collects as usual


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector could ever free it


def test_objects_alive_at_freeze_leave_the_collected_generations(thawed):
    before = _Node()
    frozen = freeze_startup_heap()
    after = _Node()
    # Other threads of the test process may free frozen objects meanwhile; nothing can add to them.
    assert 0 < gc.get_freeze_count() <= frozen
    collected = {id(obj) for generation in range(3) for obj in gc.get_objects(generation)}
    assert id(before) not in collected  # a full collection no longer walks it
    assert id(after) in collected  # what serving creates is still collected


def test_garbage_made_before_the_freeze_is_collected_first(thawed):
    import weakref

    node = _Node()
    alive = weakref.ref(node)
    del node  # unreachable, but held by its own cycle until a collection
    freeze_startup_heap()
    assert alive() is None
