"""celery_mutex.exits (act once a process has exited) and celery_mutex.parent (what the
worker's main process frees for a child), on real processes; the Celery paths themselves
run in test_celery_prefork.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.thread import TaskPool as ThreadPool
from workers import wait_until

from celery_mutex import exits, parent
from celery_mutex.exits import ExitWatch, exit_watch

pytestmark = pytest.mark.integrations


class Holder:
    """A child process that runs until ``end()`` (its stdin closes); not reaped until
    ``reap()``, so it stays a zombie in between, as a dead pool child does until billiard
    reaps it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        self.pid = self.proc.pid

    def end(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def state(self) -> str:
        with open(f"/proc/{self.pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]

    def reap(self) -> None:
        self.end()
        self.proc.wait(10)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for holder in made:
        holder.reap()


@pytest.fixture
def watch() -> Iterator[ExitWatch]:
    made = ExitWatch()
    yield made
    made.drain(timeout=1)


class Ran:
    """An action that records when and in which thread it ran."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, str]] = []

    def __call__(self) -> None:
        self.runs.append((time.monotonic(), threading.current_thread().name))


def test_an_action_waits_for_its_process_and_runs_as_it_ends_unreaped(watch, holders):
    """Nothing runs while the process lives; the action runs once it has ended, while it
    is still a zombie (a dead process runs no code, whether reaped or not)."""
    holders.append(holder := Holder())
    ran = Ran()
    watch.after_exit(holder.pid, "task[1]", ran)
    time.sleep(0.5)
    assert ran.runs == []
    assert watch.pending() == [holder.pid]
    ended = time.monotonic()
    holder.end()
    wait_until(lambda: ran.runs, 10, "the action")
    assert holder.state() == "Z"  # not reaped: the pidfd, not the reaping, told us
    assert ran.runs[0][0] - ended < 5
    assert ran.runs[0][1] == "celery_mutex-exits"
    assert watch.pending() == []


def test_a_process_gone_already_runs_the_action_at_once_in_the_caller(watch):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    ran = Ran()
    watch.after_exit(proc.pid, "task[1]", ran)
    assert ran.runs
    assert ran.runs[0][1] == threading.current_thread().name


def test_a_second_action_of_one_name_while_it_waits_is_dropped(watch, holders):
    """Celery reports a hard time limit twice (from on_failure and on_timeout)."""
    holders.append(holder := Holder())
    ran = Ran()
    watch.after_exit(holder.pid, "task[1]", ran)
    watch.after_exit(holder.pid, "task[1]", ran)
    holder.end()
    wait_until(lambda: ran.runs, 10, "the action")
    time.sleep(0.3)
    assert len(ran.runs) == 1


def test_each_action_runs_when_its_own_process_ends(watch, holders):
    holders.extend([first := Holder(), second := Holder()])
    ran_first, ran_second = Ran(), Ran()
    watch.after_exit(first.pid, "task[1]", ran_first)
    watch.after_exit(second.pid, "task[2]", ran_second)
    second.end()
    wait_until(lambda: ran_second.runs, 10, "the second's action")
    time.sleep(0.3)
    assert ran_first.runs == []
    first.end()
    wait_until(lambda: ran_first.runs, 10, "the first's action")


def test_a_failing_action_does_not_stop_the_others(watch, holders, caplog):
    holders.extend([first := Holder(), second := Holder()])
    ran = Ran()

    def fails() -> None:
        raise RuntimeError("the cache is down")

    watch.after_exit(first.pid, "task[1]", fails)
    watch.after_exit(second.pid, "task[2]", ran)
    with caplog.at_level(logging.ERROR, logger="celery_mutex"):
        first.end()
        wait_until(lambda: "the cache is down" in caplog.text, 10, "the failure logged")
        second.end()
        wait_until(lambda: ran.runs, 10, "the second's action")
    assert "task[1]" in caplog.text


def test_without_pidfds_the_pid_is_polled_until_it_is_reaped(watch, holders, monkeypatch):
    """Where pidfd_open is missing or refused, a zombie still counts as running (its pid
    is not free yet); once reaped, the action runs within the poll period."""

    def refused(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refused)
    holders.append(holder := Holder())
    ran = Ran()
    watch.after_exit(holder.pid, "task[1]", ran)
    holder.end()
    wait_until(lambda: holder.state() == "Z", 10, "the holder to end")
    time.sleep(0.3)
    assert ran.runs == []
    holder.reap()
    wait_until(lambda: ran.runs, 10, "the action")


def test_at_exit_the_gone_run_and_the_living_are_left_to_their_leases(holders, caplog):
    """drain() (atexit in the worker's main process): the action of a process that has
    ended runs; that of one still running does not (it may still act), with a warning."""
    watch = ExitWatch()
    holders.extend([alive := Holder(), dead := Holder()])
    ran_alive, ran_dead = Ran(), Ran()
    watch.after_exit(alive.pid, "task[alive]", ran_alive)
    watch.after_exit(dead.pid, "task[dead]", ran_dead)
    dead.end()
    wait_until(lambda: dead.state() == "Z", 10, "the process to end")
    with caplog.at_level(logging.WARNING, logger="celery_mutex"):
        watch.drain(timeout=5)
    assert ran_dead.runs
    assert ran_alive.runs == []
    assert "task[alive] is left to its lease" in caplog.text
    alive.end()
    time.sleep(0.3)
    assert ran_alive.runs == []


def test_a_forked_child_gets_a_watch_of_its_own():
    """The parent's watch thread does not exist in a forked child (a pool child)."""
    mine = exit_watch()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.write(write, b"fresh" if exit_watch() is not mine else b"same")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"fresh"
    assert exit_watch() is mine


# -- what the worker's main process frees, and when -------------------------------------


class Request:
    """What the parent reads of the worker's Request (kept weakly, as Celery's is)."""

    def __init__(self, worker_pid: int | None, retries: int = 0, task_id: str = "") -> None:
        self.id, self.worker_pid = task_id or f"t{time.monotonic_ns()}", worker_pid
        self.args, self.kwargs, self.request_dict = (), {}, {"retries": retries}


def _received(pool: Any, worker_pid: int | None) -> Request:
    request = Request(worker_pid)
    parent.remember(SimpleNamespace(pool=pool), request)
    return request


def _task() -> Any:
    return SimpleNamespace(name="app.charge")


@pytest.fixture
def freed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int | None]]:
    """The (task id, reason, attempt) of each free() the parent would do."""
    calls: list[tuple[str, str, int | None]] = []

    def free(_task: Any, task_id: str, _args: Any, _kwargs: Any, why: str, request: Any) -> None:
        calls.append((task_id, why, parent.attempt_of(request)))

    monkeypatch.setattr(parent, "free", free)
    return calls


def test_a_prefork_child_s_lock_is_freed_only_once_it_has_exited(freed, holders):
    holders.append(child := Holder())
    request = _received(PreforkPool.__new__(PreforkPool), child.pid)
    parent.free_when_gone(_task(), request, "revoke")
    time.sleep(0.5)
    assert freed == []
    child.end()
    wait_until(lambda: freed, 10, "the parent to free the lock")
    assert freed == [(request.id, "revoke", 0)]


def test_the_attempt_cut_short_is_the_one_freed_not_a_retry_received_since(freed, holders):
    """A retry shares its task id: the parent watches the child of the attempt whose
    failure is reported (its own request), and frees that attempt, never the retry's."""
    holders.append(dead := Holder())
    holders.append(retry_child := Holder())
    pool = PreforkPool.__new__(PreforkPool)
    first = _received(pool, dead.pid)
    retry = Request(retry_child.pid, retries=1, task_id=first.id)
    parent.remember(SimpleNamespace(pool=pool), retry)
    assert parent.request_of(first.id) is retry  # by task id alone: the wrong attempt
    parent.free_when_gone(_task(), first, "TimeLimitExceeded")
    dead.end()
    wait_until(lambda: freed, 10, "the parent to free the dead attempt")
    assert freed == [(first.id, "TimeLimitExceeded", 0)]
    assert retry_child.state() != "Z"  # the retry's child still runs


@pytest.mark.parametrize("why", ["in-process pool", "not received here", "no pid"])
def test_nothing_is_freed_for_a_task_no_child_of_ours_ran(freed, why, caplog):
    """Threads, eventlet, gevent, solo: the task's own thread or greenlet releases as it
    unwinds (a gevent kill is announced before it does); a request this process did not
    receive (a pool child) or whose child is unknown is left to the task and its lease."""
    if why == "in-process pool":
        request = _received(ThreadPool.__new__(ThreadPool), os.getpid())
    elif why == "no pid":
        request = _received(PreforkPool.__new__(PreforkPool), None)
    else:
        request = Request(12345)
    parent.free_when_gone(_task(), request, "TimeLimitExceeded")
    time.sleep(0.3)
    assert freed == []
    assert exits.exit_watch().pending() == []
