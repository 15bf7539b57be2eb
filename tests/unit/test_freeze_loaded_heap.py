"""freeze_loaded_heap: what a serving process holds after its load leaves the collector's scans."""

from __future__ import annotations

import gc

from tokenmill.engine.loader import freeze_loaded_heap


def test_objects_alive_at_the_call_are_frozen_and_later_garbage_is_not() -> None:
    held = [{"table": i} for i in range(1000)]  # what a load leaves: containers that live on
    try:
        frozen = freeze_loaded_heap()
        assert frozen >= len(held) and gc.get_freeze_count() > 0  # (frozen objects that die leave the count)
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in held)  # no collection walks them any more
        later = [[i] for i in range(10)]
        assert all(gc.is_tracked(o) and id(o) in {id(x) for x in gc.get_objects()} for o in later)
    finally:
        gc.unfreeze()
