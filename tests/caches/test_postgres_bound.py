"""The bound after which a PostgreSQL face cancels a statement still in flight (a commit
waiting for a synchronous standby that is gone): the session's statement_timeout, read as
the server reads it, and a 0.5 s grace. A misread bound either lets a call hang past it
or cancels a statement the server would still let run."""

from __future__ import annotations

import pytest

from simple_mutex.caches.postgres.statements import commit_bound

pytestmark = pytest.mark.fast

URL = "postgresql://u@127.0.0.1/db?options="


@pytest.mark.parametrize(
    ("options", "bound"),
    [
        ("", 10.5),  # ours: 10 s
        ("-c%20statement_timeout%3D1000", 1.5),  # no unit: milliseconds
        ("-c%20statement_timeout%3D2s", 2.5),
        ("-c%20statement_timeout%3D1000000us", 1.5),
        ("-c%20statement_timeout%3D1min", 60.5),
        ("-c%20statement_timeout%3D5s%20-c%20statement_timeout%3D1s", 1.5),  # the last one
        ("-c%20statement_timeout%3D1%5C%20s", 1.5),  # "1\\ s": an escaped space
        ("-c%20statement_timeout%3D0", 10.5),  # none: ours bounds the cancel
    ],
)
def test_the_bound_is_the_servers_reading_of_statement_timeout(options: str, bound: float) -> None:
    assert commit_bound(URL + options) == pytest.approx(bound)


def test_pgoptions_counts_when_the_conninfo_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGOPTIONS", "-c statement_timeout=3s")
    assert commit_bound("postgresql://u@127.0.0.1/db") == pytest.approx(3.5)
    assert commit_bound(URL + "-c%20statement_timeout%3D1s") == pytest.approx(1.5)
