"""The suite's four tiers, and the guard that keeps the fast one fast.

Every test belongs to exactly one tier, named by a marker: the closest one wins, so a
module's ``pytestmark`` sets its tests' tier and a class or a test may say otherwise.

=============  ==========================================================================
``fast``       no socket, no subprocess, no fork: pure decisions, in-process caches and
               files. Runs first and alone in under two minutes.
``backends``   one cache or store against its real server (Redis, PostgreSQL, etcd,
               SecantusDB, SeaweedFS), and the processes that share a DiskCache.
``integrations``  real ``celery worker``, ``celery beat``, ``rq worker`` and ``rq cron``
               processes, and the in-process Celery worker.
``system``     the whole machine at once: the nemesis, failovers, the docs' examples, the
               browser, the CLI as a user runs it.
=============  ==========================================================================

``pytest --tier fast`` (or ``--tier backends,integrations``) runs only those tiers;
``scripts/test.sh`` runs them in the order above. A test with no tier fails collection,
and a fast test that opens a socket or starts a process fails, naming what it did: the
guard records the attempt before it raises, so code under test that swallows the error
(a client that retries, a ``suppress(OSError)``) still fails the test.
"""

from __future__ import annotations

import _posixsubprocess  # type: ignore[import-not-found]
import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

TIERS = ("fast", "backends", "integrations", "system")
TIER = pytest.StashKey[str]()
VIOLATIONS = pytest.StashKey[list[str]]()

DESCRIPTIONS = {
    "fast": "no socket, no subprocess, no fork (checked): decisions, in-process caches, files",
    "backends": "a cache or store against its real server, or processes sharing a DiskCache",
    "integrations": "real celery worker / beat, rq worker / cron processes",
    "system": "the nemesis, failovers, the docs' examples, the browser, the CLI",
}


def tier_of(item: pytest.Item) -> str | None:
    """The closest tier marker of ``item`` (a test's own, then its class's, then its
    module's), or None."""
    for marker in item.iter_markers():
        if marker.name in TIERS:
            return marker.name
    return None


def addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        action="store",
        default="",
        help=f"run only these tiers, comma-separated ({', '.join(TIERS)})",
    )


def configure(config: pytest.Config) -> None:
    for name, description in DESCRIPTIONS.items():
        config.addinivalue_line("markers", f"{name}: tier: {description}")


def modify_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each item its tier (none is an error) and keep those ``--tier`` asks for."""
    wanted = [t for t in config.getoption("--tier").split(",") if t]
    unknown = sorted(set(wanted) - set(TIERS))
    if unknown:
        raise pytest.UsageError(f"--tier: unknown {unknown}; the tiers are {', '.join(TIERS)}")
    untiered = []
    probe = bool(os.environ.get("SIMPLE_MUTEX_TIER_PROBE"))  # which tests could be fast?
    for item in items:
        tier = "fast" if probe else tier_of(item)
        if tier is None:
            untiered.append(item.nodeid)
        else:
            item.stash[TIER] = tier
    if untiered:
        listed = "\n  ".join(untiered[:20])
        raise pytest.UsageError(
            f"{len(untiered)} tests have no tier marker ({', '.join(TIERS)}); give the "
            f"module a pytestmark (tests/tiers.py says which is which):\n  {listed}"
        )
    if wanted:
        keep = [item for item in items if item.stash[TIER] in wanted]
        dropped = [item for item in items if item.stash[TIER] not in wanted]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep


# -- the fast tier's guard -------------------------------------------------------------
#
# Python's audit events see every socket connect / bind / sendto and every fork, exec,
# spawn and Popen that goes through the interpreter, whatever the module; the guard adds
# the two doors the events miss: multiprocessing's spawn (it calls _posixsubprocess
# directly) and libpq (psycopg's C client opens its own socket).

FORBIDDEN = {
    "socket.connect": "connect a socket",
    "socket.bind": "bind a socket",
    "socket.sendto": "send a datagram",
    "os.fork": "fork",
    "os.forkpty": "fork",
    "os.posix_spawn": "start a process",
    "os.system": "start a process",
    "os.exec": "exec",
    "subprocess.Popen": "start a process",
}


# Modules that probe the machine once, as they are first imported: urllib3 binds a socket
# to ::1 to learn whether IPv6 works, croniter runs `file` on the interpreter (through
# platform.architecture). Imported before the guard is armed, so a fast test is not
# failed for being the first of its worker to import one (which test that is depends on
# how xdist hands them out).
PROBE_ON_IMPORT = ("urllib3.util.connection", "croniter")


class TierViolation(OSError):
    """What a fast test gets when it opens a socket or starts a process. An ``OSError`` so
    that code under test fails the way it would on a machine with no network; the test
    fails anyway (the guard recorded it)."""


class _Guard:
    """The one audit hook (hooks cannot be removed), armed while a fast test runs.

    Only the threads of the test count: those alive before it (a keeper thread an earlier
    test of another tier left renewing, say) may use the network as they please."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.others: frozenset[int] = frozenset()
        for name in PROBE_ON_IMPORT:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        what = FORBIDDEN.get(event)
        if what is not None and self.item is not None:
            self.refuse(what, args[1] if event.startswith("socket.") else args[:1])

    def refuse(self, what: str, detail: object) -> None:
        item = self.item
        if item is None or threading.get_ident() in self.others:
            return
        message = f"a fast-tier test may not {what} ({str(detail)[:100]}); give it another tier"
        item.stash[VIOLATIONS].append(message)
        raise TierViolation(message)

    @contextlib.contextmanager
    def armed(self, item: pytest.Item) -> Iterator[None]:
        me = threading.get_ident()
        self.others = frozenset(t.ident for t in threading.enumerate() if t.ident != me)
        patches = list(self._doors())
        self.item = item
        try:
            yield
        finally:
            self.item = None
            for owner, name, original in patches:
                setattr(owner, name, original)

    def _doors(self) -> Iterator[tuple[Any, str, Any]]:
        """Patch the doors the audit events miss; yields what to put back."""

        def door(what: str) -> Any:
            def refuse(*args: Any, **kwargs: Any) -> Any:
                self.refuse(what, args[1] if len(args) > 1 else "")
                raise AssertionError("unreachable")  # refuse raised, or the thread is not ours

            return refuse

        yield _posixsubprocess, "fork_exec", _posixsubprocess.fork_exec
        _posixsubprocess.fork_exec = door("start a process")
        try:  # libpq's socket is its own: refuse the step every psycopg connect takes
            from psycopg import generators
        except ImportError:
            return
        yield generators, "connect", generators.connect
        generators.connect = door("connect to PostgreSQL")


GUARD: _Guard | None = None


@pytest.hookimpl(wrapper=True)
def guarded(item: pytest.Item) -> Iterator[None]:
    """Run a phase of a fast test (setup, call, teardown) with the guard armed, and fail it
    when it tried anything the tier forbids, even if the error was swallowed."""
    global GUARD
    if item.stash.get(TIER, None) != "fast":
        return (yield)
    if GUARD is None:
        GUARD = _Guard()
    found: list[str] = []
    item.stash[VIOLATIONS] = found
    with GUARD.armed(item):
        result = yield
    if found:  # the phase swallowed the error it was given: it fails all the same
        pytest.fail("\n".join(dict.fromkeys(found)), pytrace=False)
    return result
