"""``Publish.parked_at``: every publish the line decides carries when its entry first
parked (the ``promoted`` event's wait is measured from it), and equality ignores it, so
the line's decisions compare as before."""

from __future__ import annotations

import pytest

from simple_mutex.busy.line import (
    Duplicate,
    Publish,
    arrival,
    end,
    new_line,
    send,
    start,
    sweep,
    take,
)

pytestmark = pytest.mark.fast


def test_end_and_sweep_publish_with_the_entrys_first_park_time() -> None:
    line = new_line("k", "ab" * 8)
    line, first = take(line, 1.0)
    line, _ = start(line, first, 2.0, redelivers=False)
    line, (second, parked) = send(line, 3.0, lambda t: {"n": t.number})
    assert parked
    line, again = arrival(line, second, {"n": 2}, 5.0, lock_free=False)
    assert again == Duplicate(2)  # a redelivered copy: the entry keeps its 3.0
    line, published = end(line, first, 10.0)
    assert published == Publish(2, {"n": 2})
    assert published is not None
    assert published.parked_at == 3.0
    line, swept = sweep(line, 20.0, lock_free=True, promote_grace=5.0, gap_for=5.0,
                        park_for=100.0)  # fmt: skip
    assert [(p.ticket, p.parked_at) for p in swept.publish] == [(2, 3.0)]  # published again
