"""``simple-mutex serve URL`` (and ``celery -A proj mutex serve``): a local web page of
every held key and every line, refreshed live, with its actions when enabled: release a
holder, step over a waiting call of a line.

One thread reads the cache every ``interval`` (``board.read``) and keeps the page's JSON;
every viewer gets that copy, so ten open tabs cost what one does. The server is the
standard library's, bound to loopback unless told otherwise.

The actions are off unless the server was started with ``--actions``: it then takes a token
(``SIMPLE_MUTEX_PAGE_TOKEN``, or one drawn from ``secrets``) and prints the page's address
with the token after ``#``, a part of a URL a browser never sends, so it reaches no log;
the page sends it back in a header on each action. A request from another origin cannot
set that header without a preflight this server never grants, and a request whose
``Host`` is a name other than ``localhost`` or the one given to ``--host`` (DNS
rebinding) is refused; an address literal on the right port is accepted.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO
from urllib.parse import quote

from simple_mutex.admin import board as boards
from simple_mutex.admin import call_of, calls_in, release, step_over
from simple_mutex.admin.board import CALLS_SHOWN
from simple_mutex.admin.commands import describe, now, one_line, stamp
from simple_mutex.admin.page import PAGE
from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import ConstraintError, ConstraintValueError, MalfunctionError

log = logging.getLogger("simple_mutex")

TOKEN_ENV = "SIMPLE_MUTEX_PAGE_TOKEN"
TOKEN_HEADER = "X-Simple-Mutex-Token"
EVENTS_KEPT = 200
# The page runs its own inline script and style and talks to this server alone.
POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"
)
MAX_BODY = 4096  # an action names a key (at most 1,024 characters) and two numbers


class Board:
    """The page's state: refreshed by one thread, read by every request as bytes encoded
    once per refresh."""

    def __init__(self, cache: ConditionalCache, prefix: str, *, actions: bool) -> None:
        self.cache, self.prefix, self.actions = cache, prefix, actions
        self._lock = threading.Lock()
        self._last: boards.Snapshot | None = None
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._state: dict[str, Any] = {"at": None, "locks": [], "lines": [], "events": []}
        self._encoded = b"{}"
        self.error: str | None = None

    def refresh(self) -> None:
        """Read the cache once; a failure is shown on the page, the last state kept."""
        try:
            snap = boards.read(self.cache, self.prefix)
        except MalfunctionError as exc:
            with self._lock:
                self.error = f"{stamp(now())} refresh failed: {one_line(exc)}"
                self._encode()
            return
        with self._lock:
            self._events.extend(boards.changes(self._last, snap))
            self._show(snap)

    def prime(self, snap: boards.Snapshot) -> None:
        """The first state, from the read that proved the cache answers."""
        with self._lock:
            self._show(snap)

    def _show(self, snap: boards.Snapshot) -> None:
        self._last = snap
        self._state = boards.state(snap, list(self._events), actions=self.actions)
        self.error = None
        self._encode()

    def _encode(self) -> None:
        self._encoded = json.dumps({**self._state, "error": self.error}).encode()

    def json(self) -> bytes:
        with self._lock:
            return self._encoded

    def release(self, key: str, slot: int, fence: int) -> tuple[bool, str]:
        """Free the holder of ``key``'s ``slot`` the page showed (the last snapshot's,
        named by its fence), exactly that holder: refused, with nothing freed, if the
        permit was freed or changed hands since, a take-over that kept the fence
        included (``admin.release``)."""
        with self._lock:
            shown = [] if self._last is None else list(self._last.locks)
        for lock in shown:
            if (lock.key, lock.slot, lock.fence) == (key, slot, fence):
                described = describe(lock)
                if release(self.cache, lock, by="simple-mutex serve"):
                    said = {"at": now().isoformat(), "kind": "released", "key": key,
                            "text": f"from this page: {described}"}  # fmt: skip
                    with self._lock:
                        self._events.append(said)
                    self.refresh()
                    return True, f"freed {described}"
                return False, f"refused: {described} was freed or changed hands since"
        return False, f"refused: {key!r} slot {slot} with fence {fence} is not on the page"

    def step_over(self, key: str, ticket: int) -> tuple[bool, str]:
        """Step over ``ticket`` of ``key``'s line, a call the page showed waiting (parked,
        or sent and not arrived): it never runs (``admin.step_over``)."""
        with self._lock:
            line = None if self._last is None else self._last.lines.get(key)
        shown = {} if line is None else {c["ticket"]: c for c in calls_in(line, CALLS_SHOWN)}
        if ticket not in shown or shown[ticket]["state"] == "running":
            return False, f"refused: ticket {ticket} of {key!r} is not waiting on the page"
        done = step_over(self.cache, key, ticket, self.prefix, by="simple-mutex serve",
                         call=shown[ticket]["call"])  # fmt: skip
        if not done.done:
            return False, f"refused: ticket {ticket} of {key!r} is {done.was} now"
        text = f"ticket {ticket} ({call_of(done.message)}) of {key!r}: it will not run"
        with self._lock:
            self._events.append({"at": now().isoformat(), "kind": "stepped over", "key": key,
                                 "text": f"from this page: {text}"})  # fmt: skip
        self.refresh()
        return True, f"stepped over {text}"


def handler(
    board: Board, token: str | None, host_ok: Callable[[str], bool]
) -> type[BaseHTTPRequestHandler]:
    """The request handler of one board: ``GET /`` the page, ``GET /state`` its JSON,
    ``POST /release`` and ``POST /step-over`` (with the token) its actions."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "simple-mutex"
        timeout = 10  # a client that stops sending mid-request frees its thread

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("serve: " + format, *args)  # never the token: it is in no URL

        def _reply(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", POLICY)
            self.end_headers()
            self.wfile.write(body)

        def _answer(self, status: int, what: dict[str, Any]) -> None:
            self._reply(status, json.dumps(what).encode(), "application/json")

        def _host_ok(self) -> bool:
            if host_ok(self.headers.get("Host", "")):
                return True
            self._answer(HTTPStatus.MISDIRECTED_REQUEST, {"error": "unknown Host"})
            return False

        def do_GET(self) -> None:
            if not self._host_ok():
                return
            if self.path in ("/", "/index.html"):
                self._reply(HTTPStatus.OK, PAGE.encode(), "text/html; charset=utf-8")
            elif self.path == "/state":
                self._reply(HTTPStatus.OK, board.json(), "application/json")
            else:
                self._answer(HTTPStatus.NOT_FOUND, {"error": "no such page"})

        def do_POST(self) -> None:
            if not self._host_ok():
                return
            if self.path not in ("/release", "/step-over"):
                self._answer(HTTPStatus.NOT_FOUND, {"error": "no such action"})
                return
            given = self.headers.get(TOKEN_HEADER, "")
            if token is None or not hmac.compare_digest(given.encode(), token.encode()):
                self._answer(HTTPStatus.FORBIDDEN, {"error": "actions are off, or the "
                             "token is wrong: start serve with --actions and open the "
                             "address it prints"})  # fmt: skip
                return
            try:
                body = _body(self)
                if self.path == "/release":
                    key, slot, fence = _named(body, ("key", str), ("slot", int), ("fence", int))
                    act = functools.partial(board.release, key, slot, fence)
                else:
                    key, ticket = _named(body, ("key", str), ("ticket", int))
                    act = functools.partial(board.step_over, key, ticket)
            except ValueError as exc:
                self._answer(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
                return
            try:
                done, text = act()
            except MalfunctionError as exc:
                self._answer(HTTPStatus.BAD_GATEWAY, {"error": one_line(exc)})
                return
            except ConstraintError as exc:  # a key no lock can have
                self._answer(HTTPStatus.BAD_REQUEST, {"error": one_line(exc)})
                return
            self._answer(HTTPStatus.OK if done else HTTPStatus.CONFLICT,
                         {"done": done, "text": text})  # fmt: skip

    return Handler


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _host_ok(given: str, bound_host: str, port: int) -> bool:
    """Whether a request's ``Host`` names this server: its port, and for a name, the one
    it was told to listen on or ``localhost``; any address literal (an address cannot be
    rebound to another machine by DNS, as a name can: the attack the check stops)."""
    name, _, given_port = given.rpartition(":")
    if given_port != str(port) or not name:
        return False
    name = name.removeprefix("[").removesuffix("]")
    if name in ("localhost", bound_host):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _body(request: BaseHTTPRequestHandler) -> dict[str, Any]:
    """An action's JSON object from a POST body, of at most ``MAX_BODY`` bytes."""
    try:
        length = int(request.headers.get("Content-Length", "0"))
    except ValueError:
        raise ValueError("Content-Length must be a number") from None
    if not 0 < length <= MAX_BODY:
        raise ValueError(f"an action is a JSON object of at most {MAX_BODY} bytes")
    try:
        body = json.loads(request.rfile.read(length))
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the limit
        raise ValueError("an action is a JSON object") from None
    if not isinstance(body, dict):
        raise ValueError("an action is a JSON object")
    return body


def _named(body: dict[str, Any], *fields: tuple[str, type]) -> tuple[Any, ...]:
    """The values of ``fields`` (name, exact type: a bool is no int) from ``body``."""
    found = tuple(body.get(name) for name, _ in fields)
    if any(type(value) is not kind for value, (_, kind) in zip(found, fields, strict=True)):
        wanted = ", ".join(f'"{name}": {kind.__name__}' for name, kind in fields)
        raise ValueError(f"this action names {{{wanted}}}")
    return found


def serve(
    cache: ConditionalCache,
    prefix: str,
    out: TextIO,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    interval: float = 1.0,
    actions: bool = False,
    token: str | None = None,
    ready: Callable[[ThreadingHTTPServer], None] | None = None,
) -> int:
    """Serve the page until Ctrl-C (status 0). The first read happens before the server
    listens, so a wrong URL or a server that is down fails here (the caller's status 2)."""
    if not 0 < interval <= 3600:
        raise ConstraintValueError(f"interval must be seconds in (0, 3600], got {interval!r}")
    if not 0 <= port <= 65535:
        raise ConstraintValueError(f"port must be in 0..65535 (0: any free one), got {port!r}")
    board = Board(cache, prefix, actions=actions)
    board.prime(boards.read(cache, prefix))  # raises: nothing to serve from a cache out of reach
    if actions and token is None:
        token = secrets.token_urlsafe(18)
    bound = [0]  # the port, known once bound
    server_class = _Server6 if ":" in host else ThreadingHTTPServer
    server = server_class(
        (host, port),
        handler(board, token if actions else None, lambda given: _host_ok(given, host, bound[0])),
    )
    server.daemon_threads = True
    bound[0] = server.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{bound[0]}/"
    secret = f"#token={quote(token, safe='')}" if actions and token else ""
    out.write(f"simple-mutex serve: prefix {prefix!r}, every {interval:g} s, at {address}"
              f"{secret} (Ctrl-C ends)\n")  # fmt: skip
    if actions:
        out.write(
            "actions are on: anyone with the address above can free a lock or step "
            "over a waiting call\n"
        )
    out.flush()
    stopped = threading.Event()

    def refresh_loop() -> None:
        while not stopped.wait(interval):
            board.refresh()

    threading.Thread(target=refresh_loop, name="simple-mutex-serve", daemon=True).start()
    if ready is not None:
        ready(server)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        out.write("\n")
    finally:
        stopped.set()
        server.server_close()
    return 0
