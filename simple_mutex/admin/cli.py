"""``simple-mutex`` (and ``python -m simple_mutex``): see and free locks from a shell.

::

    simple-mutex list URL [--prefix P] [--json]
    simple-mutex show URL KEY [--prefix P]
    simple-mutex release URL KEY [--prefix P] [--slot N] [--yes]
    simple-mutex step-over URL KEY TICKET [--prefix P] [--yes]
    simple-mutex watch URL [--prefix P] [--interval S]
    simple-mutex serve URL [--prefix P] [--host H] [--port N] [--interval S] [--actions]
    simple-mutex timeline FILE_OR_DIR... -o OUT.html
    simple-mutex redis-functions URL [--print]

``URL`` is what ``cache_from_url`` takes (``redis://``, ``postgresql://``, ``file:///``...);
``--prefix`` the lock prefix (``Mutex``'s ``mutex.`` by default; ``semaphore.`` for a
default ``Semaphore``). Exit status: 0 done, 1 nothing to do or refused, 2 a bad URL, an
unreachable server or a missing driver (one line naming the fix, no traceback).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from simple_mutex.admin import DEFAULT_PREFIX, commands
from simple_mutex.admin.serve import TOKEN_ENV, serve
from simple_mutex.caches.url import cache_from_url
from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import SimpleMutexError

FAULT = 2


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="simple-mutex", description="See, watch and free simple-mutex locks."
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, *, key: bool = False) -> argparse.ArgumentParser:
        found = sub.add_parser(name, help=help, description=help)
        found.add_argument("url", metavar="URL", help="the lock cache, e.g. redis://host:6379/0")
        if key:
            found.add_argument("key", metavar="KEY", help="the lock key, as your code spells it")
        found.add_argument(
            "--prefix", default=DEFAULT_PREFIX,
            help=f"the locks' prefix= (default {DEFAULT_PREFIX!r}; 'semaphore.' for Semaphore)",
        )  # fmt: skip
        return found

    listing = command("list", "list the live locks")
    listing.add_argument("--json", action="store_true", help="print a JSON array")
    command("show", "show one key in full (every slot of a semaphore)", key=True)
    freeing = command("release", "free the holder of one key, exactly the one read", key=True)
    freeing.add_argument("--slot", type=int, help="which permit of a semaphore to free")
    freeing.add_argument("--yes", action="store_true", help="do not ask first")
    stepping = command(
        "step-over", "step over one call of a key's line: it never runs (show KEY lists them)",
        key=True,
    )  # fmt: skip
    stepping.add_argument("ticket", type=int, metavar="TICKET", help="the call's ticket")
    stepping.add_argument("--yes", action="store_true", help="do not ask first")
    watching = command("watch", "a live table of holders and takeovers, until Ctrl-C")
    watching.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")

    serving = command("serve", "a live web page of held keys, lines and events, until Ctrl-C")
    serve_options(serving.add_argument)

    loading = sub.add_parser(
        "redis-functions",
        help="load the Redis functions a cache with functions=true calls (an administrator's "
        "URL: FUNCTION LOAD)",
    )
    loading.add_argument("url", metavar="URL", help="the Redis, as an administrator")
    loading.add_argument(
        "--print", action="store_true", help="print the library (FUNCTION LOAD text) instead"
    )

    drawing = sub.add_parser("timeline", help="draw journal files as one HTML page")
    drawing.add_argument("files", nargs="+", metavar="FILE_OR_DIR")
    drawing.add_argument("-o", "--output", required=True, metavar="OUT")
    return top


def serve_options(add: Callable[..., object]) -> None:
    """The options of ``serve`` (``celery mutex serve`` has the same)."""
    add("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    add("--port", type=int, default=8765, help="the port (default 8765; 0: any free one)")
    add("--interval", type=float, default=1.0, help="seconds between reads of the cache")
    add("--actions", action="store_true",
        help=f"allow releasing and stepping over from the page, with a token "
             f"({TOKEN_ENV}, or a new one) in the address it prints")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if args.command == "timeline":
        return timeline(args.files, args.output)
    if args.command == "redis-functions" and args.print:
        try:  # the library is built from the scripts' module, which needs redis-py
            from simple_mutex.caches.redis.protocol import functions_library
        except SimpleMutexError as exc:
            return fail(exc)
        sys.stdout.write(functions_library())
        return 0
    if args.command in ("watch", "serve") and not 0 < args.interval <= 3600:
        return fail("--interval must be seconds in (0, 3600]")
    try:
        cache = cache_from_url(args.url)
    except SimpleMutexError as exc:
        return fail(exc)
    except Exception as exc:  # a driver's own complaint about the URL: still one line
        # Only the scheme and the error's kind: the rest of a URL may hold a password.
        scheme = args.url.partition(":")[0]
        return fail(f"could not open the {scheme}:// cache ({type(exc).__name__}); check the URL")
    return run(cache, args)


def run(cache: ConditionalCache, args: argparse.Namespace) -> int:
    out = sys.stdout
    try:
        if args.command == "list":
            return commands.list_locks(cache, args.prefix, out, json_output=args.json)
        if args.command == "show":
            return commands.show_lock(cache, args.key, args.prefix, out)
        if args.command == "release":
            return commands.release_lock(
                cache, args.key, args.prefix, out, slot=args.slot, yes=args.yes
            )
        if args.command == "step-over":
            return commands.step_over_call(
                cache, args.key, args.ticket, args.prefix, out, yes=args.yes
            )
        if args.command == "redis-functions":
            return commands.load_functions(cache, out)
        if args.command == "serve":
            return serve(cache, args.prefix, out, host=args.host, port=args.port,
                         interval=args.interval, actions=args.actions,
                         token=os.environ.get(TOKEN_ENV) or None)  # fmt: skip
        return commands.watch_locks(cache, args.prefix, out, interval=args.interval)
    except OSError as exc:  # serve's port taken, or an address not of this machine
        return fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    except SimpleMutexError as exc:
        return fail(exc)
    except KeyboardInterrupt:  # at a prompt, or mid-listing: no traceback
        print(file=sys.stderr)
        return 130


def fail(problem: BaseException | str) -> int:
    print(commands.one_line(problem), file=sys.stderr)
    return FAULT


def timeline(files: list[str], output: str) -> int:
    """Delegated to ``simple_mutex.journal.timeline`` (imported only here: may be absent)."""
    try:
        from simple_mutex.journal import timeline as drawing  # type: ignore[attr-defined, unused-ignore]
    except ImportError as exc:
        return fail(f"the timeline command is not available in this install ({exc})")
    status: int = drawing.cli_main(files, output)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
