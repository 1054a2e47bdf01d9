"""The ``simple-mutex`` command, run as users run it: a subprocess (the installed console
script, or ``python -m simple_mutex``) against real Redis, PostgreSQL and disk caches,
while other OS processes (``cli_holder.py``) hold a mutex and both permits of a
semaphore. And ``celery -A proj mutex ...`` against a real Celery app."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_acl import lock_user, url_as
from servers import TESTS
from workers import wait_until

from simple_mutex.caches import RedisCache

HERE = TESTS  # cli_holder.py
BIN = Path(sys.executable).parent
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")

pytestmark = pytest.mark.system


class Holders:
    """Holder processes of one test, under one unique prefix, reporting in ``folder``."""

    def __init__(self, url: str, folder: Path) -> None:
        self.url = url
        self.folder = folder
        self.prefix = f"clitest.{uuid.uuid4().hex[:10]}."
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def hold(
        self, name: str, key: str, *, permits: int = 1, lease: float = 6, renew: bool = True,
        wait: float | None = None, started: bool = True,
    ) -> dict[str, Any]:  # fmt: skip
        """Start a holder; its held report once it holds (``started``), else {}. A renewed
        6 s lease: a freed holder learns it at its next renewal, within 2 s (at 30 s, each
        test that waits for that took 10 s)."""
        argv = [
            sys.executable, str(HERE / "cli_holder.py"), self.url, self.prefix, str(permits),
            key, str(lease), "renew" if renew else "fixed", str(self.folder), name,
        ]  # fmt: skip
        if wait is not None:
            argv.append(str(wait))
        self.procs[name] = subprocess.Popen(argv)
        return self.held(name) if started else {}

    def held(self, name: str) -> dict[str, Any]:
        path = self.folder / f"{name}.held.json"
        wait_until(lambda: path.exists() or self.procs[name].poll() is not None, 30, name)
        assert path.exists(), f"holder {name} exited with {self.procs[name].returncode}"
        return dict(json.loads(path.read_text()))

    def stop(self, name: str) -> None:
        (self.folder / f"{name}.stop").touch()

    def outcome(self, name: str, timeout: float = 20) -> str:
        return str(self.done(name, timeout)["outcome"])

    def done(self, name: str, timeout: float = 20) -> dict[str, Any]:
        """The holder's ending: ``outcome``, and the error's ``message`` when it lost."""
        path = self.folder / f"{name}.done.json"
        wait_until(path.exists, timeout, f"{name} to finish")
        return dict(json.loads(path.read_text()))

    def close(self) -> None:
        for name in self.procs:
            self.stop(name)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def cli(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, to its end."""
    return subprocess.run(
        [str(BIN / "simple-mutex"), *args], input=stdin, capture_output=True, text=True,
        timeout=60, env={**os.environ, **env},
    )  # fmt: skip


@pytest.fixture(params=["redis", "redis-lock-user", "postgres", "disk"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "redis":
        yield REDIS_URL
        return
    if request.param == "redis-lock-user":
        # list, show and release as a user made from RedisCache.acl_rules() alone
        admin = redis.Redis.from_url(REDIS_URL)
        with lock_user(admin, RedisCache.acl_rules(prefixes=("clitest.",))) as (user, password):
            yield url_as(REDIS_URL, user, password)
        admin.close()
        return
    if request.param == "postgres":
        yield POSTGRES_URL
        return
    yield f"file://{tmp_path / 'locks'}"


@pytest.fixture
def holders(url: str, tmp_path: Path) -> Iterator[Holders]:
    found = Holders(url, tmp_path)
    yield found
    found.close()


@pytest.fixture
def three(holders: Holders) -> dict[str, dict[str, Any]]:
    """A mutex ``report.daily`` and both permits of a semaphore ``pool``, in three
    processes; each one's held report."""
    return {
        "daily": holders.hold("daily", "report.daily"),
        "pool-a": holders.hold("pool-a", "pool", permits=2),
        "pool-b": holders.hold("pool-b", "pool", permits=2),
    }


def test_list_json_shows_exactly_the_held_locks(holders: Holders, three: dict[str, Any]) -> None:
    """--json lists exactly the three permits held by the three processes, with exactly
    the documented fields; semaphore slots are separate holders of one key."""
    done = cli("list", holders.url, "--prefix", holders.prefix, "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    fields = {"key", "host", "pid", "label", "acquired_at", "expires_at", "fence", "slot"}
    assert all(set(row) == fields for row in rows)
    seen = {(row["key"], row["pid"], row["slot"], row["fence"], row["label"]) for row in rows}
    assert seen == {
        ("report.daily", three["daily"]["pid"], 0, three["daily"]["fence"], "daily"),
        ("pool", three["pool-a"]["pid"], three["pool-a"]["slot"], three["pool-a"]["fence"],
         "pool-a"),
        ("pool", three["pool-b"]["pid"], three["pool-b"]["slot"], three["pool-b"]["fence"],
         "pool-b"),
    }  # fmt: skip
    assert len(rows) == 3
    assert_no_token(three, done.stdout, done.stderr)


def assert_no_token(held: dict[str, dict[str, Any]], *outputs: str) -> None:
    """No holder's secret token appears in what the command printed or logged."""
    for info in held.values():
        for text in outputs:
            assert info["token"] not in text


def test_list_table_and_show(holders: Holders, three: dict[str, Any]) -> None:
    """The table names each key, slot, holder pid and fence; show prints both permits of
    the semaphore in full; a free key's show exits 1."""
    done = cli("list", holders.url, "--prefix", holders.prefix)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["KEY", "SLOT", "HOLDER"]
    assert len(lines) == 4
    for info in three.values():
        assert any(f"pid {info['pid']}" in line and str(info["fence"]) in line for line in lines)

    shown = subprocess.run(
        [sys.executable, "-m", "simple_mutex", "show", holders.url, "pool", "--prefix",
         holders.prefix],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("key:         pool\n") == 2
    for name in ("pool-a", "pool-b"):
        assert f"pid:         {three[name]['pid']}\n" in shown.stdout
        assert f"fence:       {three[name]['fence']}\n" in shown.stdout
    assert_no_token(three, done.stdout, shown.stdout)
    free = cli("show", holders.url, "report.weekly", "--prefix", holders.prefix)
    assert free.returncode == 1
    assert "is free" in free.stdout


def test_release_frees_exactly_that_holder_which_then_loses_its_lease(
    holders: Holders, three: dict[str, Any]
) -> None:
    """release --yes frees the mutex's holder: it prints and logs what it freed, the
    holder's next renewal finds the lease gone (it is interrupted, with an error that
    names an operator's release among the causes), and the semaphore's holders are
    untouched."""
    done = cli("release", holders.url, "report.daily", "--prefix", holders.prefix, "--yes")
    assert done.returncode == 0, done.stderr
    assert f"pid {three['daily']['pid']}" in done.stdout
    assert done.stdout.startswith("freed 'report.daily' slot 0")
    assert "freed lock 'report.daily'" in done.stderr  # the log record
    assert_no_token(three, done.stdout, done.stderr)
    ended = holders.done("daily")
    assert ended["outcome"] == "lost"
    # The holder's error tells it what happened, not to raise a lease it renewed in time.
    assert "freed or taken while it still had time" in ended["message"]
    assert "simple-mutex release" in ended["message"]
    assert "renew=True" not in ended["message"]
    left = json.loads(cli("list", holders.url, "--prefix", holders.prefix, "--json").stdout)
    assert sorted(row["pid"] for row in left) == sorted(
        [three["pool-a"]["pid"], three["pool-b"]["pid"]]
    )


def test_release_of_a_semaphore_needs_a_slot_and_frees_only_that_one(
    holders: Holders, three: dict[str, Any]
) -> None:
    """With two holders, release names them and refuses until --slot chooses one."""
    refused = cli("release", holders.url, "pool", "--prefix", holders.prefix, "--yes")
    assert refused.returncode == 1
    assert "pass --slot" in refused.stdout
    slot = three["pool-b"]["slot"]
    done = cli(
        "release", holders.url, "pool", "--prefix", holders.prefix, "--slot", str(slot), "--yes"
    )
    assert done.returncode == 0, done.stderr
    assert holders.outcome("pool-b") == "lost"
    left = json.loads(cli("list", holders.url, "--prefix", holders.prefix, "--json").stdout)
    assert {(row["key"], row["pid"]) for row in left} == {
        ("report.daily", three["daily"]["pid"]),
        ("pool", three["pool-a"]["pid"]),
    }


def test_release_asks_and_a_no_frees_nothing(holders: Holders) -> None:
    """Without --yes it asks; any answer but yes leaves the holder alone."""
    info = holders.hold("asked", "asked")
    done = cli("release", holders.url, "asked", "--prefix", holders.prefix, stdin="n\n")
    assert done.returncode == 1
    assert "? [y/N]" in done.stdout
    assert "not freed" in done.stdout
    rows = json.loads(cli("list", holders.url, "--prefix", holders.prefix, "--json").stdout)
    assert [row["pid"] for row in rows] == [info["pid"]]


def test_release_refuses_when_the_holder_changed_after_it_was_read(holders: Holders) -> None:
    """The holder is read, then (while the command asks) it releases and another process
    takes the key: the yes that follows frees nothing, says so, and exits 1."""
    first = holders.hold("first", "swap")
    proc = subprocess.Popen(
        [str(BIN / "simple-mutex"), "release", holders.url, "swap", "--prefix", holders.prefix],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        prompt = ""
        while not prompt.endswith("[y/N] "):
            char = proc.stdout.read(1)
            assert char, f"no prompt; stderr: {proc.stderr.read() if proc.stderr else ''}"
            prompt += char
        assert f"pid {first['pid']}" in prompt
        holders.stop("first")
        assert holders.outcome("first") == "released"
        second = holders.hold("second", "swap")
        out, err = proc.communicate("y\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "refused" in out
    assert "nothing freed" in out
    rows = json.loads(cli("list", holders.url, "--prefix", holders.prefix, "--json").stdout)
    assert [(row["pid"], row["fence"]) for row in rows] == [(second["pid"], second["fence"])]


def test_watch_shows_a_takeover_and_ends_cleanly_on_sigint(holders: Holders) -> None:
    """A holder's fixed lease lapses and a waiting process takes the key over: the
    watching command shows the waiter, reports the takeover, and Ctrl-C (SIGINT) ends it
    with status 0. A refresh every second; on a loaded machine the waiter's wake-up at
    the lapse can lag past a refresh, which sees the key free: still a takeover (the
    lease ran out, it was not freed)."""
    old = holders.hold("old", "turn", lease=5, renew=False)
    watch = subprocess.Popen(
        [str(BIN / "simple-mutex"), "watch", holders.url, "--prefix", holders.prefix,
         "--interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    assert watch.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any(f"pid {old['pid']}" in line for line in lines), 30, "a frame")
        holders.hold("new", "turn", wait=20, started=False)  # waits for the lease to lapse
        new = holders.held("new")
        assert new["fence"] > old["fence"]
        wait_until(lambda: any("takeover of" in line for line in lines), 10, "the takeover")
        watch.send_signal(signal.SIGINT)
        watch.wait(timeout=30)
        reader.join(10)
        err = watch.stderr.read() if watch.stderr else ""
    finally:
        if watch.poll() is None:
            watch.kill()
    out = "".join(lines)
    assert watch.returncode == 0, err
    assert "Traceback" not in err
    assert "takeover of 'turn' slot 0" in out
    assert f"pid {old['pid']}" in out
    assert f"pid {new['pid']}" in out
    assert f"(fence {new['fence']})" in out
    # While the second process waited, the rows of the first said so where the cache can
    # tell (Redis's waiter mark, the disk store's marked rows); PostgreSQL cannot.
    told = "?" if holders.url.startswith("postgresql") else "yes"
    assert any(f"pid {old['pid']}" in line and line.rstrip().endswith(f" {told}") for line in lines)


def test_watch_in_a_terminal_redraws_and_ctrl_c_ends_it(tmp_path: Path) -> None:
    """In a terminal (a pty) the table is redrawn in place, and the terminal's Ctrl-C
    (the byte 0x03, turned into SIGINT by the line discipline) ends it with status 0."""
    holders = Holders(f"file://{tmp_path / 'locks'}", tmp_path)
    try:
        info = holders.hold("held", "in.a.terminal")
        argv = [str(BIN / "simple-mutex"), "watch", holders.url, "--prefix", holders.prefix,
                "--interval", "0.2"]  # fmt: skip
        pid, master = pty.fork()
        if pid == 0:  # the child: the pty is its controlling terminal
            os.execv(argv[0], argv)
        seen = b""
        deadline = time.monotonic() + 30
        while f"pid {info['pid']}".encode() not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                seen += os.read(master, 65536)
        os.write(master, b"\x03")
        end = time.monotonic() + 30
        status = None
        while status is None and time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                with contextlib.suppress(OSError):  # EIO once the child is gone
                    seen += os.read(master, 65536)
            done, code = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(code) if done else None
        os.close(master)
    finally:
        holders.close()
    assert status == 0, seen.decode(errors="replace")
    assert b"\x1b[H\x1b[2J" in seen  # redrawn in place
    assert f"pid {info['pid']}".encode() in seen
    assert b"Traceback" not in seen


# -- faults: exit status 2, one line naming the fix -----------------------------------


def assert_one_line_fault(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0]


def test_a_bad_url_is_one_line_and_status_2() -> None:
    """An unknown scheme names the schemes that work."""
    assert_one_line_fault(cli("list", "nosuch://host/x"), "unknown cache URL scheme", "redis://")


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis://127.0.0.1:1/0?socket_connect_timeout=2", "is Redis up and reachable"),
        ("postgresql://postgres@127.0.0.1:1/test?connect_timeout=2", "postgres"),
    ],
)
def test_an_unreachable_server_is_one_line_and_status_2(url: str, needle: str) -> None:
    """A refused port names the backend and the address problem, in one line; watch
    too ends at once instead of watching a server that never answered."""
    assert_one_line_fault(cli("list", url), needle)
    assert_one_line_fault(cli("watch", url, "--interval", "0.2"), needle)


def test_a_missing_driver_names_the_extra_to_install(tmp_path: Path) -> None:
    """Without redis-py importable, the one line says which extra brings it."""
    shadow = tmp_path / "shadow" / "redis"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('redis is not installed here')\n")
    done = cli("list", REDIS_URL, PYTHONPATH=str(shadow.parent))
    assert_one_line_fault(done, "pip install 'simple-mutex[redis]'")


def test_timeline_delegates_to_the_timeline_module(tmp_path: Path) -> None:
    """``simple-mutex timeline DIR -o OUT`` draws a journal written by a process (here, by
    ``journal.start``) into the page; a missing path is status 2 in one line."""
    from simple_mutex import InMemoryCache, Mutex, journal

    stop = journal.start(tmp_path / "journal")
    try:
        with Mutex(InMemoryCache()).acquire("drawn"):
            pass
    finally:
        stop()
    page = tmp_path / "t.html"
    done = cli("timeline", str(tmp_path / "journal"), "-o", str(page))
    assert done.returncode == 0, done.stderr
    assert str(page) in done.stdout
    assert page.read_text().count('class="hold"') == 1
    assert_one_line_fault(cli("timeline", str(tmp_path / "nowhere"), "-o", str(page)), "nowhere")


def test_timeline_without_its_module_is_one_line_and_status_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The subcommand imports simple_mutex.journal.timeline only when run: where it is
    missing, one line and status 2 (the other commands never needed it)."""
    import simple_mutex.journal
    from simple_mutex.admin import cli as command

    monkeypatch.setitem(sys.modules, "simple_mutex.journal.timeline", None)  # import fails
    monkeypatch.delattr(simple_mutex.journal, "timeline", raising=False)  # even once imported
    assert command.main(["timeline", "somewhere", "-o", "out.html"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "timeline command is not available" in err


# -- celery -A proj mutex ... ----------------------------------------------------------


def _celery_project(where: Path, holders: Holders) -> None:
    """``proj.py`` in ``where``: a Celery app whose lock cache is the holders'."""
    (where / "proj.py").write_text(
        "from celery import Celery\n"
        "app = Celery('proj', broker='memory://')\n"
        f"app.conf.mutex_cache = {holders.url!r}\n"
        f"app.conf.mutex_prefix = {holders.prefix!r}\n"
    )


def test_celery_mutex_command_lists_shows_and_releases(holders: Holders, tmp_path: Path) -> None:
    """``celery -A proj mutex`` reads the app's mutex_cache and mutex_prefix: list --json
    shows the holder, show prints it, release --yes frees it and the holder loses it."""
    info = holders.hold("task", "tasks.report.42")
    _celery_project(tmp_path, holders)

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "celery"), "-A", "proj", "mutex", *args], capture_output=True,
            text=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
        )  # fmt: skip

    listed = celery("list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(row["key"], row["pid"], row["fence"]) for row in rows] == [
        ("tasks.report.42", info["pid"], info["fence"])
    ]
    shown = celery("show", "tasks.report.42")
    assert shown.returncode == 0, shown.stderr
    assert f"pid:         {info['pid']}\n" in shown.stdout
    freed = celery("release", "tasks.report.42", "--yes")
    assert freed.returncode == 0, freed.stderr
    assert freed.stdout.startswith("freed 'tasks.report.42' slot 0")
    assert holders.outcome("task") == "lost"
    assert json.loads(celery("list", "--json").stdout) == []


def test_celery_mutex_command_without_a_cache_setting_is_one_line(tmp_path: Path) -> None:
    """An app without mutex_cache: status 2 and the setting to add."""
    (tmp_path / "bare.py").write_text("from celery import Celery\napp = Celery('bare')\n")
    done = subprocess.run(
        [str(BIN / "celery"), "-A", "bare", "mutex", "list"], capture_output=True, text=True,
        timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert_one_line_fault(done, "app.conf.mutex_cache")


def test_celery_mutex_command_watches_and_serves(holders: Holders, tmp_path: Path) -> None:
    """``celery -A proj mutex watch`` draws the holder until Ctrl-C (status 0), and
    ``celery -A proj mutex serve`` prints its address and serves the state of the app's
    own cache (``simple-mutex serve``'s page)."""
    import urllib.request

    info = holders.hold("task", "tasks.report.43")
    _celery_project(tmp_path, holders)

    def celery(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(BIN / "celery"), "-A", "proj", "mutex", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
        )  # fmt: skip

    watch = celery("watch", "--interval", "0.5")
    try:
        assert watch.stdout is not None
        first = [watch.stdout.readline() for _ in range(3)]
        assert any(f"pid {info['pid']}" in line for line in first), first
    finally:
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0
    serve = celery("serve", "--port", "0")
    try:
        assert serve.stdout is not None
        said = serve.stdout.readline()
        address = said.split(" at ", 1)[1].split()[0]
        with urllib.request.urlopen(address + "state", timeout=10) as reply:
            state = json.loads(reply.read())
        assert [(lock["key"], lock["pid"]) for lock in state["locks"]] == [
            ("tasks.report.43", info["pid"])
        ]
        assert state["actions"] is False
    finally:
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=30) == 0


def test_serve_listens_on_ipv6_loopback_and_refuses_a_bad_port() -> None:
    """``--host ::1`` serves the page over IPv6 (reached by its address literal); a port
    out of range is one line and status 2, not a traceback."""
    import urllib.request

    bad = cli("serve", REDIS_URL, "--port", "99999")
    assert_one_line_fault(bad, "port must be in 0..65535")
    server = subprocess.Popen(
        [str(BIN / "simple-mutex"), "serve", REDIS_URL, "--host", "::1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        said = server.stdout.readline()
        address = said.split(" at ", 1)[1].split()[0]
        assert address.startswith("http://[::1]:"), said
        with urllib.request.urlopen(address + "state", timeout=10) as reply:
            assert reply.status == 200
            assert "locks" in json.loads(reply.read())
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0
