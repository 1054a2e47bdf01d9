"""The busy policy Celery and RQ share (simple_mutex.busy)."""

from __future__ import annotations

import pytest

from simple_mutex import ConstraintError
from simple_mutex.busy import check_on_busy, retry_policy


def test_retry_delays_grow_by_backoff_and_stop_at_the_cap():
    """countdown * backoff**n, capped; without jitter exactly that."""
    policy = retry_policy("t", {"countdown": 1, "backoff": 2, "cap": 5, "jitter": False})
    assert [policy.delay(n, 0.0) for n in range(5)] == [1, 2, 4, 5, 5]


def test_jitter_keeps_each_delay_within_half_to_one_and_a_half():
    """With jitter a delay lies in [0.5, 1.5) of the unjittered one."""
    policy = retry_policy("t", {"countdown": 2, "backoff": 1})
    assert policy.delay(0, 0.0) == 1.0
    assert policy.delay(0, 0.999) == pytest.approx(2.998)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"delay": 1}, "unknown retry field"),
        ({"backoff": 0.5}, "backoff must be a number >= 1"),
        ({"jitter": "yes"}, "jitter must be True or False"),
        ({"max": -1}, "max must be None or an int >= 0"),
        ("often", "retry must be a dict"),
    ],
)
def test_bad_retry_settings_name_the_fix(value, fragment):
    """Each bad retry setting is refused with a message naming what is expected."""
    with pytest.raises(ConstraintError, match=fragment):
        retry_policy("t", value)


def test_on_busy_accepts_only_the_four_policies():
    """skip, retry, wait and raise pass; anything else names them."""
    for name in ("skip", "retry", "wait", "raise"):
        assert check_on_busy("t", name) == name
    with pytest.raises(ConstraintError, match="skip, retry, wait, raise"):
        check_on_busy("t", "ignore")
