"""A process that holds one lock while ``test_cli.py`` looks at it from outside.

``python cli_holder.py URL PREFIX PERMITS KEY LEASE RENEW DIR NAME [WAIT]``

Acquires ``KEY`` (a Mutex when PERMITS is 1, else a Semaphore of PERMITS), waiting up to
WAIT seconds (default: try once) with a short poll, and writes ``DIR/NAME.held.json``
(pid, slot, fence, token). Then it holds until ``DIR/NAME.stop`` appears (it releases) or the
lease is lost (a failed renewal interrupts it), and writes ``DIR/NAME.done.json`` with
the outcome: ``released``, ``release-missed`` (release() found it gone) or ``lost``.
Reports are written whole (renamed into place), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from simple_mutex import Mutex, Semaphore, SimpleMutexLeaseExpiredError, cache_from_url


def report(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main() -> None:
    url, prefix, permits, key, lease, renew, folder, name, *wait = sys.argv[1:]
    cache = cache_from_url(url)
    space = (
        Mutex(cache, prefix=prefix, lease=float(lease), label=name)
        if int(permits) == 1
        else Semaphore(cache, permits=int(permits), prefix=prefix, lease=float(lease), label=name)
    )
    out = Path(folder)
    timeout = float(wait[0]) if wait else 0
    held = space.acquire(key, timeout=timeout, interval=0.01, renew=renew == "renew")
    # The token is reported only so the test can prove the command never prints it.
    mine = {"pid": os.getpid(), "slot": held.slot, "fence": held.fence, "token": held.token}
    report(out / f"{name}.held.json", mine)
    outcome, message = "released", ""
    try:
        with held:
            while not (out / f"{name}.stop").exists():
                time.sleep(0.02)  # Python code between sleeps: the loss interrupt lands
            outcome = "released" if held.release() else "release-missed"
    except SimpleMutexLeaseExpiredError as lost:
        outcome, message = "lost", str(lost)
    report(out / f"{name}.done.json", {"outcome": outcome, "message": message})


if __name__ == "__main__":
    main()
