"""Run by test_interrupted_wait.py in a process of its own: raises an exception as each
``@contextmanager`` of the library returns from ``__enter__`` during an acquire and
release on the PostgreSQL at argv[1], keeps each traceback alive, and checks that the
cache still answers after each. Exits 1 naming the point where it hung; prints the number
of points it interrupted."""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from alarms import Alarm

import simple_mutex
from simple_mutex import Mutex, cache_from_url


def main(url: str) -> int:
    mutex = Mutex(cache_from_url(url), lease=30, prefix=f"enter-{uuid.uuid4().hex[:8]}.")
    entering = contextlib._GeneratorContextManager.__enter__.__code__
    package = str(Path(simple_mutex.__file__).parent)
    kept: list[BaseException] = []  # tracebacks kept alive, as a log record keeps them
    points = 0
    while True:
        seen, target = 0, points + 1

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code is not entering:
                return None

            def at_return(frame: Any, event: str, arg: Any) -> Any:
                nonlocal seen
                code = frame.f_locals["self"].gen.gi_code
                if event == "return" and code.co_filename.startswith(package):
                    seen += 1
                    if seen == target:  # noqa: B023 (read while this run traces)
                        raise Alarm("time is up")
                return at_return

            return at_return

        sys.settrace(tracer)
        try:
            mutex.acquire(f"k{points}", timeout=5).release()
        except Alarm as exc:
            kept.append(exc)
        finally:
            sys.settrace(None)
        if seen <= points:  # this run met no point left to interrupt
            break
        points += 1
        answered = threading.Event()

        def next_call(answered: threading.Event) -> None:
            mutex.locked("other")
            answered.set()

        threading.Thread(target=next_call, args=(answered,), daemon=True).start()
        if not answered.wait(10):
            print(f"the cache hung after an interrupt at point {points}", flush=True)
            return 1
    print(f"interrupted points: {points}", flush=True)
    return 0


if __name__ == "__main__":
    import os

    code = main(sys.argv[1])
    os._exit(code)  # no clean-up that could wait on a guard left held
