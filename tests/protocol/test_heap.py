"""``postrl.protocol.heap``: the run's startup objects are kept off the cyclic collector and
handed back at the end (nothing leaks)."""

from __future__ import annotations

import gc
import weakref

import pytest

from postrl.protocol.heap import frozen_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_heap_keeps_startup_cycles_until_the_block_ends_then_frees_them():
    assert gc.get_freeze_count() == 0
    node = _Node()
    ref = weakref.ref(node)
    with frozen_heap() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        del node
        gc.collect()  # a full collection does not walk the frozen objects: the cycle survives
        assert ref() is not None
    assert gc.get_freeze_count() == 0  # back to the collector
    gc.collect()
    assert ref() is None  # and freed: a process that trains again does not leak


def test_nested_blocks_unfreeze_only_when_the_last_one_leaves():
    with frozen_heap():
        outer = gc.get_freeze_count()
        late = [_Node() for _ in range(10)]
        with frozen_heap() as inner:
            assert inner >= outer + len(late)
        assert gc.get_freeze_count() >= outer  # the outer block still holds its freeze
    assert gc.get_freeze_count() == 0


def test_disabled_freezes_nothing():
    with frozen_heap(False) as frozen:
        assert frozen == 0 and gc.get_freeze_count() == 0


def test_an_error_in_the_block_still_unfreezes():
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0
