"""The history checker: proves, from the recorded events alone (``history``), that the
lock kept its promises, and names every violation as an ``Anomaly``.

Definitions (times are CLOCK_MONOTONIC, shared by every process of the machine):

* A **hold** is one granted acquire: ``granted.t`` is when the lease reached its holder.
  A **body step** writes to the fenced store; it is **protected** when it completed before
  the deadline its holder believed in (``step.t <= step.deadline``), i.e. up to that
  lease's deadline, renewals included. A step after the deadline is **unprotected**: a
  holder frozen past its lease may run a few before its interrupt lands; the fenced store
  must catch them (see stale-write).
* The **protected span** of a hold is ``[granted.t, t of its last protected step]``.

Properties, each an anomaly kind:

overlap
    Two protected spans on one key intersect (more than ``permits`` for a semaphore).
refused-while-protected
    The store refused a protected step: a higher fence of the same key was written while
    this holder still believed it held the key, so a later grant came inside its lease.
stale-write
    The store accepted a write whose fence is below one it had accepted before (from
    the store's own log), or below the fence of an accepted write that completed before
    this one was invoked (real-time order, from the history: independent of the store).
fence-order / fence-repeat
    A grant that was returned before another was invoked carries a fence >= the later one
    (per key; per key and slot where the tier documents per-slot fences), or two grants
    share a fence.
hang
    An acquire with a timeout returned after ``timeout + acquire_slack``, a release took
    longer than ``release_slack``, or a process had to be killed at the end (time spent
    SIGSTOPped is not counted).
late-interrupt
    A step began more than ``interrupt_slack`` of running time after its lease's deadline:
    the lapse interrupt did not land.
swallowed-interrupt
    An alarm (a job timeout raised from a signal handler) fired while an acquire waited,
    and the acquire was granted anyway, or the body went on stepping after it.
survived-signal
    A process went on recording more than ``signal_slack`` of running time after it was
    sent SIGTERM (its SystemExit was swallowed).
vanished
    (``Spec.records_kept``: failover runs) a grant the server forgot: a renewal found the
    record gone, or a release made before the believed deadline found it taken over.
    The holder was inside its lease, so the lock's record vanished under it (a write
    the failed primary acknowledged and its promoted replica never had).
lost-op / crash
    An acquire that never ended although its process was dealt no fault; a process that
    vanished without a fault and without ``exit``.
lost-task / double-run / unexplained-failure / tick-missed / tick-repeated
    Task-queue properties (``check_tasks``, ``check_ticks``).
out-of-order
    (``check_order``: ``on_busy="queue"``) a queued call of a key was first granted before
    a call of that key sent earlier, and the line did not say the run was late.
superseded-ran / superseded-by-older / newest-lost
    (``check_latest``: ``on_busy="latest"`` and ``"debounce"``) a call reported
    superseded was granted; or
    it names as the call that took its place one sent before it (or none we sent); or the
    newest call of a key was never granted, with no fault dealt to it.

Keys under ``on_busy="replace"`` (``Spec.replacing``, by key prefix): the newest call takes
the key from its running holder, so a hold is protected only until the next grant of its
key (its takeover), whatever deadline its holder believed in: the steps after it are
unprotected (the store must refuse them once the new holder wrote: stale-write), and one
that began more than ``interrupt_slack`` of running time after the takeover is a
late-interrupt (the stop did not land). A replaced task's failure with the lost lease is
explained (``check_tasks(replacing=...)``) when a grant of its key came during its run.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nemesis.history import Event
from simple_mutex.lease import GONE_AT_RELEASE, GONE_AT_RENEWAL

LIMIT_SLACK = 1.5  # a time limit's signal, and the body's current step
# A call's body may begin this long after its ``expires`` (a worker checks it as the call
# arrives and as its pool takes it; the lock and the line's start come after), never more.
EXPIRY_SLACK = 2.0
KILLING = {"sigkill", "sigterm", "server-kill-child", "horse-kill", "worker-kill", "revoke"}


@dataclass(frozen=True)
class Anomaly:
    kind: str
    key: str | None
    detail: str
    at: float = 0.0
    ids: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f" on {self.key!r}" if self.key is not None else ""
        return f"{self.kind}{where} at t={self.at:.3f}: {self.detail}"


@dataclass
class Spec:
    """What the tier promises and the slack its deadlines get."""

    permits: dict[str, int] = field(default_factory=dict)  # key -> permits (default 1)
    per_slot_fences: bool = False
    acquire_slack: float = 2.0  # one socket timeout and scheduling on a loaded machine
    release_slack: float = 3.0
    interrupt_slack: float = 1.0
    signal_slack: float = 5.0
    records_kept: bool = False  # check "vanished" (needs the released event's deadline)
    replacing: tuple[str, ...] = ()  # key prefixes under on_busy="replace"


@dataclass
class Hold:
    id: str
    key: str
    pid: int
    os: int  # the OS process (signals, SIGSTOP)
    acquire: Event
    granted: Event | None = None
    outcome: Event | None = None  # busy or failed
    steps: list[Event] = field(default_factory=list)
    released: Event | None = None
    lost: Event | None = None
    done: Event | None = None


class Stops:
    """When each process was frozen (SIGSTOP ... SIGCONT), to discount that time; a
    ``disk-stall`` (DiskCache's write lock held from outside) freezes every process's
    cache calls alike, as a wedged disk would (the cache waits up to its own 10 s)."""

    def __init__(self, events: Iterable[Event]) -> None:
        self._spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self._everyone: list[tuple[float, float]] = []
        open_at: dict[int, float] = {}
        for e in events:
            if e["op"] == "fault" and e["kind"] == "disk-stall":
                self._everyone.append((e["t"], e["t"] + min(e["length"], 5.0)))
            elif e["op"] == "fault" and e["kind"] == "sigstop":
                open_at.setdefault(e["target"], e["t"])
            elif e["op"] == "resumed" and e["target"] in open_at:
                self._spans[e["target"]].append((open_at.pop(e["target"]), e["t"]))
        for pid, t in open_at.items():
            self._spans[pid].append((t, float("inf")))

    def running(self, pid: int, start: float, end: float) -> float:
        """Seconds of [start, end] the process was not frozen."""
        spans = sorted([*self._spans.get(pid, ()), *self._everyone])
        frozen, reach = 0.0, start
        for a, b in spans:  # the union of the spans, clipped to [start, end]
            a, b = max(a, reach), min(b, end)
            if b > a:
                frozen += b - a
                reach = b
        return max(0.0, end - start - frozen)


def holds_of(events: list[Event]) -> dict[str, Hold]:
    holds: dict[str, Hold] = {}
    for e in events:
        op = e["op"]
        if op == "acquire":
            holds[e["id"]] = Hold(e["id"], e["key"], e["pid"], e.get("os", e["pid"]), e)
            continue
        hold = holds.get(e.get("id", ""))
        if hold is None or op == "fault":
            continue
        if op == "granted":
            hold.granted = e
        elif op in ("busy", "failed", "parked"):
            hold.outcome = e
        elif op == "step":
            hold.steps.append(e)
        elif op == "released":
            hold.released = e
        elif op == "lost":
            hold.lost = e
        elif op == "done":
            hold.done = e
    return holds


def _protected(step: Event) -> bool:
    return bool(step["t"] <= step["deadline"])


def check(events: list[Event], store_log: list[tuple[int, str, int, str]] | None = None,
          spec: Spec | None = None) -> list[Anomaly]:  # fmt: skip
    """Every anomaly of the lock properties in ``events`` (and the store's own log)."""
    spec = spec or Spec()
    holds = holds_of(events)
    if spec.replacing:
        _end_at_takeover(holds, spec.replacing)
    stops = Stops(events)
    found: list[Anomaly] = []
    found += _overlaps(holds, spec)
    found += _refused_while_protected(holds)
    found += _stale_writes(holds, store_log)
    found += _fence_order(holds, spec)
    found += _hangs(events, holds, stops, spec)
    found += _late_interrupts(holds, stops, spec)
    found += _swallowed(events, holds, stops, spec)
    found += _survivors(events, stops, spec)
    found += _lost_ops(events, holds)
    if spec.records_kept:
        found += vanished(holds)
    return found


def _takeovers(grants: Iterable[Event], replacing: tuple[str, ...]) -> dict[str, float]:
    """Per grant id on a replacing key: when the next grant of that key came (its
    takeover; none for the last)."""
    by_key: dict[str, list[Event]] = defaultdict(list)
    for g in grants:
        if g["key"].startswith(replacing):
            by_key[g["key"]].append(g)
    ends = {}
    for rows in by_key.values():
        rows.sort(key=lambda g: g["t"])
        for a, b in itertools.pairwise(rows):
            ends[a["id"]] = b["t"]
    return ends


def _end_at_takeover(holds: dict[str, Hold], replacing: tuple[str, ...]) -> None:
    """A replaced hold's deadline becomes its takeover, for every step it made."""
    grants = [h.granted for h in holds.values() if h.granted is not None]
    for hold_id, end in _takeovers(grants, replacing).items():
        hold = holds[hold_id]
        hold.steps = [{**s, "deadline": min(s["deadline"], end)} for s in hold.steps]


TAKEN_OVER = GONE_AT_RELEASE  # in time: an operator's release, a replacing call


def vanished(holds: dict[str, Hold]) -> list[Anomaly]:
    """Holds whose record disappeared while their holder was inside its lease."""
    found = []
    for hold in holds.values():
        r = hold.released
        if r is None or "deadline" not in r:
            continue
        loss = r.get("loss")
        if loss == GONE_AT_RENEWAL or (loss == TAKEN_OVER and r["t0"] < r["deadline"]):
            fence = hold.granted["fence"] if hold.granted else "?"
            found.append(_of_hold("vanished", hold, f"{hold.id} (pid {hold.pid}, fence {fence}): "
                                  f"{loss} at {r['t0']:.3f}, its deadline {r['deadline']:.3f}",
                                  r["t0"]))  # fmt: skip
    return found


def _span(hold: Hold) -> tuple[float, float] | None:
    protected = [s["t"] for s in hold.steps if _protected(s)]
    if hold.granted is None or not protected:
        return None
    return hold.granted["t"], max(protected)


def _overlaps(holds: dict[str, Hold], spec: Spec) -> list[Anomaly]:
    by_key: dict[str, list[tuple[float, float, Hold]]] = defaultdict(list)
    for hold in holds.values():
        span = _span(hold)
        if span is not None:
            by_key[hold.key].append((*span, hold))
    found = []
    for key, spans in by_key.items():
        permits = spec.permits.get(key, 1)
        spans.sort(key=lambda s: s[0])
        open_: list[tuple[float, float, Hold]] = []
        for start, end, hold in spans:
            open_ = [o for o in open_ if o[1] > start]  # touching spans do not overlap
            open_.append((start, end, hold))
            if len(open_) > permits:
                others = [o[2] for o in open_ if o[2] is not hold]
                detail = "; ".join(
                    f"{h.id} (pid {h.pid}, fence {h.granted['fence'] if h.granted else '?'}) "
                    f"protected {s:.3f}..{e:.3f}"
                    for s, e, h in open_
                )
                found.append(Anomaly(
                    "overlap", key,
                    f"{len(open_)} holders inside their leases at once (permits {permits}): "
                    f"{detail}",
                    start, (hold.id, *(h.id for h in others)),
                ))  # fmt: skip
    return found


def _first_bad_step(
    holds: dict[str, Hold], kind: str, at: str, bad: Callable[[Hold, Event], str | None]
) -> list[Anomaly]:
    """Per hold, an anomaly ``kind`` for the first of its steps ``bad`` describes (None: a
    good step), at the step's time ``at``: one per hold, the rest follow from it."""
    found = []
    for hold in holds.values():
        for step in hold.steps:
            said = bad(hold, step)
            if said is not None:
                found.append(_of_hold(kind, hold, said, step[at]))
                break
    return found


def _refused_while_protected(holds: dict[str, Hold]) -> list[Anomaly]:
    def refused(hold: Hold, step: Event) -> str | None:
        if not _protected(step) or step["accepted"]:
            return None
        return (
            f"{hold.id} (pid {hold.pid}, fence {step['fence']}) step {step['n']} at "
            f"{step['t']:.3f}, deadline {step['deadline']:.3f}: the store already had "
            f"fence {step['last']}, written by a later grant inside this lease"
        )

    return _first_bad_step(holds, "refused-while-protected", "t", refused)


def _store_key(step: Event) -> str:
    return f"{step['key']}/{step.get('slot', 0)}"


def _stale_writes(holds: dict[str, Hold], store_log: list[tuple[int, str, int, str]] | None
                  ) -> list[Anomaly]:  # fmt: skip
    found = []
    if store_log is not None:
        last: dict[str, tuple[int, str]] = {}
        for _seq, key, fence, writer in store_log:
            before = last.get(key)
            if before is not None and fence < before[0]:
                found.append(Anomaly(
                    "stale-write", key,
                    f"the store accepted {writer} with fence {fence} after {before[1]} with "
                    f"fence {before[0]} (store order)",
                ))  # fmt: skip
            if before is None or fence >= before[0]:
                last[key] = (fence, writer)
    accepted: dict[str, list[Event]] = defaultdict(list)
    for hold in holds.values():
        for step in hold.steps:
            if step["accepted"]:
                accepted[_store_key(step)].append({**step, "hold": hold.id})
    for key, writes in accepted.items():
        writes.sort(key=lambda w: w["t"])
        done_at = [w["t"] for w in writes]
        best: list[tuple[int, str]] = []  # prefix max of (fence, hold) by completion time
        for w in writes:
            prev = best[-1] if best else (-1, "")
            best.append(max(prev, (w["fence"], w["hold"])))
        for w in writes:
            i = bisect.bisect_left(done_at, w["t0"])  # writes completed before w was sent
            if i and best[i - 1][0] > w["fence"]:
                found.append(Anomaly(
                    "stale-write", key,
                    f"{w['hold']} wrote fence {w['fence']} (sent {w['t0']:.3f}, accepted) after "
                    f"{best[i - 1][1]}'s fence {best[i - 1][0]} had been accepted",
                    w["t"], (w["hold"], best[i - 1][1]),
                ))  # fmt: skip
    return found


def _fence_order(holds: dict[str, Hold], spec: Spec) -> list[Anomaly]:
    grants: dict[tuple[str, int], list[Hold]] = defaultdict(list)
    for hold in holds.values():
        if hold.granted is not None:
            slot = hold.granted.get("slot", 0) if spec.per_slot_fences else 0
            grants[(hold.key, slot)].append(hold)
    found = []
    for (key, _slot), group in grants.items():
        # Every grant carries a fence of its own, a Celery retry's too: a retry waits for
        # its earlier attempt to let go and is granted anew (it once took the record
        # over, fence and all, and ran beside that attempt's clean-up).
        seen = Counter(h.granted["fence"] for h in group if h.granted)
        for fence, n in seen.items():
            if n > 1:
                ids = tuple(h.id for h in group if h.granted and h.granted["fence"] == fence)
                found.append(Anomaly("fence-repeat", key, f"{n} grants carry fence {fence}: "
                                     f"{', '.join(ids)}", 0.0, ids))  # fmt: skip
        group.sort(key=lambda h: h.granted["t"] if h.granted else 0.0)
        returned = [h.granted["t"] for h in group if h.granted]
        best: list[tuple[int, str]] = []
        for h in group:
            assert h.granted is not None
            prev = best[-1] if best else (-1, "")
            best.append(max(prev, (h.granted["fence"], h.id)))
        for h in group:
            assert h.granted is not None
            i = bisect.bisect_left(returned, h.acquire["t"])  # granted before h was invoked
            if not i:
                continue
            fence, first = best[i - 1]
            if fence >= h.granted["fence"] and first != h.id:
                found.append(Anomaly(
                    "fence-order", key,
                    f"{h.id} (pid {h.pid}) was granted fence {h.granted['fence']} after "
                    f"{best[i - 1][1]} had been granted fence {best[i - 1][0]}",
                    h.granted["t"], (h.id, best[i - 1][1]),
                ))  # fmt: skip
    return found


def _hangs(events: list[Event], holds: dict[str, Hold], stops: Stops, spec: Spec
           ) -> list[Anomaly]:  # fmt: skip
    found = []
    for hold in holds.values():
        timeout = hold.acquire.get("timeout")
        end = hold.granted or hold.outcome
        if timeout is not None and end is not None:
            took = stops.running(hold.os, hold.acquire["t"], end["t"])
            if took > timeout + spec.acquire_slack:
                found.append(_of_hold("hang", hold, f"{hold.id} (pid {hold.pid}): acquire("
                                      f"timeout={timeout}) returned after {took:.3f} s of "
                                      f"running time ({end['op']})", end["t"]))  # fmt: skip
        if hold.released is not None:
            took = stops.running(hold.os, hold.released["t0"], hold.released["t"])
            if took > spec.release_slack:
                found.append(_of_hold("hang", hold, f"{hold.id}: release took {took:.3f} s",
                                      hold.released["t"]))  # fmt: skip
    for e in events:
        if e["op"] == "unended":
            found.append(Anomaly("hang", None, f"process {e['target']} ({e.get('name')}) did "
                                 "not end by itself and was killed", e["t"]))  # fmt: skip
    return found


def _late_interrupts(holds: dict[str, Hold], stops: Stops, spec: Spec) -> list[Anomaly]:
    def late(hold: Hold, step: Event) -> str | None:
        if step["t0"] <= step["deadline"]:
            return None
        ran = stops.running(hold.os, step["deadline"], step["t0"])
        if ran <= spec.interrupt_slack:
            return None
        return (
            f"{hold.id} (pid {hold.pid}) began step {step['n']} {ran:.3f} s of "
            f"running time after its deadline {step['deadline']:.3f}"
        )

    return _first_bad_step(holds, "late-interrupt", "t0", late)


def _swallowed(events: list[Event], holds: dict[str, Hold], stops: Stops, spec: Spec
               ) -> list[Anomaly]:  # fmt: skip
    found = []
    for e in events:
        if e["op"] != "alarm":
            continue
        hold = holds.get(e["id"])
        if hold is None:
            continue
        if hold.granted is not None and hold.granted["t"] >= e["t"]:
            found.append(_of_hold("swallowed-interrupt", hold, f"{hold.id} (pid {hold.pid}): an "
                                  f"alarm fired at {e['t']:.3f} while acquire waited, and the "
                                  f"lease was granted at {hold.granted['t']:.3f} anyway "
                                  f"({len(hold.steps)} body steps ran)", e["t"]))  # fmt: skip
            continue
        late = [s for s in hold.steps
                if stops.running(hold.os, e["t"], s["t0"]) > spec.interrupt_slack]  # fmt: skip
        if late:
            found.append(_of_hold("swallowed-interrupt", hold, f"{hold.id} (pid {hold.pid}): an "
                                  f"alarm fired at {e['t']:.3f} in the body and {len(late)} "
                                  "steps ran after it", e["t"]))  # fmt: skip
    return found


def _survivors(events: list[Event], stops: Stops, spec: Spec) -> list[Anomaly]:
    # A revoke terminates only a task still running when the worker reads it: one whose
    # body ended normally (its "end" phase) had finished first, and no SIGTERM was sent.
    finished = {e["task"] for e in events if e["op"] == "run" and e.get("phase") == "end"}
    termed: dict[int, float] = {}
    last: dict[int, Event] = {}
    for e in events:
        if e["op"] == "fault" and (
            e["kind"] == "sigterm" or (e["kind"] == "revoke" and e.get("task") not in finished)
        ):
            termed.setdefault(e["target"], e["t"])
        elif e["op"] not in ("fault", "resumed", "unended"):
            last[e.get("os", e["pid"])] = e
    found = []
    for pid, t in termed.items():
        e = last.get(pid)
        if e is not None and stops.running(pid, t, e["t"]) > spec.signal_slack:
            found.append(Anomaly(
                "survived-signal", None,
                f"process {pid} ({e['w']}) was sent SIGTERM at {t:.3f} and still recorded "
                f"{e['op']} at {e['t']:.3f}", e["t"],
            ))  # fmt: skip
    return found


def _lost_ops(events: list[Event], holds: dict[str, Hold]) -> list[Anomaly]:
    faulted: dict[int, float] = {}
    exited: set[int] = set()
    started: dict[int, Event] = {}
    for e in events:
        if e["op"] == "fault" and e["kind"] in KILLING and isinstance(e.get("target"), int):
            faulted.setdefault(e["target"], e["t"])
        elif e["op"] == "exit":
            exited.add(e["pid"])
        elif e["op"] == "start":
            started[e["pid"]] = e
    found = []
    for pid, e in started.items():
        if pid not in exited and e.get("os", pid) not in faulted and not e.get("forked"):
            found.append(Anomaly("crash", None, f"process {pid} ({e['w']}) vanished with no "
                                 "fault dealt and no exit recorded", e["t"]))  # fmt: skip
    for hold in holds.values():
        ended = hold.outcome or hold.done or (hold.granted and (hold.lost or hold.released))
        if ended or hold.pid not in exited:
            continue  # a process killed mid-op; a crash is reported above
        found.append(_of_hold("lost-op", hold, f"{hold.id} (pid {hold.pid}) never ended "
                              "although its process exited normally",
                              hold.acquire["t"]))  # fmt: skip
    return found


# -- task queues ------------------------------------------------------------------------


def _dealt_to_tasks(events: list[Event]) -> dict[str, list[Event]]:
    """The faults dealt to each task: to it by id, and to a process after its run began
    there."""
    dealt: dict[str, list[Event]] = defaultdict(list)
    by_pid: dict[Any, list[Event]] = defaultdict(list)
    runs: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e["op"] == "fault" and e.get("task"):
            dealt[e["task"]].append(e)
        elif e["op"] == "fault" and isinstance(e.get("target"), int):
            by_pid[e["target"]].append(e)
        elif e["op"] == "run":
            runs[e["task"]].append(e)
    for task, rows in runs.items():  # a fault to the process a run was in is dealt to it
        for r in rows:
            if r["phase"] == "prerun":
                # ...until that arrival parked (on_busy="queue": it left the process then)
                left = min([p["t"] for p in rows if p["phase"] in ("parked", "superseded")
                            and p["pid"] == r["pid"] and p["t"] >= r["t"]],
                           default=float("inf"))  # fmt: skip
                dealt[task] += [f for f in by_pid.get(r["pid"], ()) if r["t"] <= f["t"] < left]
    return dealt


def gone_with_a_fault(events: list[Event]) -> set[str]:
    """The tasks that may end with no outcome: acked at receipt (not ``late``), then their
    process was killed; or (RQ) ``stranded``: popped by a worker, which was killed after
    the job was sent and before it started it (RQ fails such a job only at its next
    maintenance). Nothing can bring them back (no message is left), so a wait for
    outcomes need not wait for them."""
    dealt = _dealt_to_tasks(events)
    stranded = {e["task"] for e in events if e["op"] == "stranded"}
    kills = [e["t"] for e in events if e["op"] == "fault" and e["kind"] == "worker-kill"]
    return {
        e["task"]
        for e in events
        if e["op"] == "submit"
        and (
            (not e.get("late") and any(f["kind"] in KILLING for f in dealt.get(e["task"], ())))
            or (e["task"] in stranded and any(t > e["t"] for t in kills))
        )
    }


def replaced_tasks(events: list[Event], replacing: tuple[str, ...]) -> set[str]:
    """Tasks whose grant on a replacing key was followed by another grant of that key."""
    grants = [e for e in events if e["op"] == "granted" and e.get("task")]
    task_of = {g["id"]: g["task"] for g in grants}
    return {task_of[hold_id] for hold_id in _takeovers(grants, replacing)}


def check_tasks(events: list[Event], replacing: tuple[str, ...] = ()) -> list[Anomaly]:
    """Every submitted task ran to its end once, was reported skipped, or failed with the
    fault the nemesis dealt it; never two runs at once, never silently lost. An
    ``acks_late`` task whose process was killed after its end, before the ack, may end once
    more (its redelivery), unless it was queued (``_redelivered``).

    Events: ``submit`` (``task``, ``unique``: its key is its own, so a skip is wrong),
    ``limit``: a time limit it must not outlive, ``queued``: sent through the line, so a
    skip must be a duplicate of a run of it, ``retries``: RQ's, so its body may begin at
    most ``1 + retries`` times), ``run`` (``task``, ``phase`` "prerun"
    (it began, before the lock), "start" (the body began), "end", ``pid``), ``fault``
    with a ``task``, ``outcome`` (``task``, ``state``: success / skipped / failure,
    ``error``). A ``submit`` with ``expires_at`` (its ``expires``, on the history's clock)
    must not begin its body more than ``EXPIRY_SLACK`` after it (``ran-expired``)."""
    submitted: dict[str, Event] = {}
    runs: dict[str, list[Event]] = defaultdict(list)
    outcomes: dict[str, Event] = {}
    for e in events:
        if e["op"] == "submit":
            submitted[e["task"]] = e
        elif e["op"] == "run":
            runs[e["task"]].append(e)
        elif e["op"] == "outcome":
            outcomes[e["task"]] = e
    dealt = _dealt_to_tasks(events)
    gone = gone_with_a_fault(events)
    stranded = gone & {e["task"] for e in events if e["op"] == "stranded"}
    replaced = replaced_tasks(events, replacing) if replacing else set()
    by_pid: dict[Any, list[Event]] = defaultdict(list)  # faults dealt to a process
    for e in events:
        if e["op"] == "fault" and not e.get("task") and isinstance(e.get("target"), int):
            by_pid[e["target"]].append(e)
    found = []
    for task, sub in submitted.items():
        out = outcomes.get(task)
        ends = [r for r in runs[task] if r["phase"] == "end"]
        starts = [r for r in runs[task] if r["phase"] == "start"]
        faults = dealt.get(task, [])
        kinds = ",".join(sorted({f["kind"] for f in faults})) or "none"
        if out is None and task in gone:
            continue  # acked at receipt, then its worker was killed: gone with the fault
        if out is None and sub.get("expires_at") is not None and not starts:
            # Discarded unseen by the broker once expired (RabbitMQ's message TTL, which
            # Celery sets from ``expires``): no outcome comes, for any Celery task.
            continue
        if out is None:
            ahead = _stranded_ahead(sub, submitted, stranded)
            why = f", queued {BEHIND_STRANDED} {ahead}" if ahead else ""
            found.append(_of_task("lost-task", sub, f"task {task} ({sub.get('name')}) has no "
                                  f"outcome{why} (faults dealt: {kinds})", sub["t"]))  # fmt: skip
            continue
        state = out["state"]
        if len(ends) - _redelivered(sub, ends, by_pid) > 1:
            found.append(_of_task("double-run", sub, f"task {task} ran to its end "
                                  f"{len(ends)} times", ends[1]["t"]))  # fmt: skip
        found += _concurrent_runs(task, sub, starts, ends, faults)
        if "retries" in sub and len(starts) > sub["retries"] + 1:
            # RQ runs a job once, and again only for a retry it was given (a killed horse
            # of a job without retries leaves it FAILED); a park or a duplicate copy
            # returns before the body.
            found.append(_of_task("double-run", sub, f"task {task} began its body "
                                  f"{len(starts)} times with {sub['retries']} retries "
                                  f"(faults dealt: {kinds})", starts[-1]["t"]))  # fmt: skip
        if state == "success" and not ends:
            found.append(_of_task("lost-task", sub, f"task {task} reported success but its "
                                  "body never reached its end", out["t"]))  # fmt: skip
        elif state == "skipped" and sub.get("unique"):
            found.append(_of_task(
                "lost-task", sub,
                f"task {task} ({sub.get('name')}) has a key of its own, yet was reported "
                f"skipped as busy (faults dealt: {kinds}): its own earlier attempt held it",
                out["t"],
            ))  # fmt: skip
        elif (
            state == "skipped"
            and sub.get("queued")
            and not (sub.get("supersedes") and out.get("reason") == "superseded")
            and (out.get("reason") not in (None, "duplicate") or not starts)
        ):
            # (A keep-latest or debounced call superseded by a newer one never runs:
            # check_latest holds it to that.)
            # A queued call is never busy: a skip is a copy of its ticket dropped as a
            # duplicate, which needs a run of it that began (RQ records the copy's result
            # on the job id; Celery's copy is ignored and reports nothing).
            found.append(_of_task(
                "lost-task", sub,
                f"task {task} ({sub.get('name')}) was queued, yet was reported skipped "
                f"(reason {out.get('reason')!r}) with {len(starts)} runs begun "
                f"(faults dealt: {kinds})", out["t"],
            ))  # fmt: skip
        elif (
            state == "failure"
            and not faults
            and not out.get("explained")
            and not (task in replaced and "LeaseExpired" in str(out.get("error")))
        ):
            found.append(_of_task("unexplained-failure", sub, f"task {task} failed with no "
                                  f"fault dealt: {out.get('error')}", out["t"]))  # fmt: skip
        expires_at = sub.get("expires_at")
        late_starts = [s for s in starts if expires_at is not None
                       and s["t"] > expires_at + EXPIRY_SLACK]  # fmt: skip
        if late_starts and not any(f["kind"] in ("sigstop", "worker-stop") for f in faults):
            found.append(_of_task(
                "ran-expired", sub,
                f"task {task} began its body {late_starts[0]['t'] - expires_at:.3f} s after "
                f"its expires (faults dealt: {kinds})", late_starts[0]["t"],
            ))  # fmt: skip
        limit = sub.get("limit")
        if limit is not None and not any(f["kind"] == "sigstop" for f in faults):
            for end in ends:
                began = [
                    r["t"] for r in runs[task]
                    if r["phase"] == "prerun" and r["pid"] == end["pid"] and r["t"] <= end["t"]
                ]  # fmt: skip
                if began and end["t"] - max(began) > limit + LIMIT_SLACK:
                    found.append(_of_task(
                        "swallowed-interrupt", sub,
                        f"task {task} had a time limit of {limit} s ({kinds}) and its body "
                        f"ran to its end {end['t'] - max(began):.3f} s after it started "
                        f"(state {state})", end["t"],
                    ))  # fmt: skip
    return found


def exception_of(traceback_text: str, limit: int = 300) -> str:
    """The exception a formatted traceback ends with, from its type on (at most ``limit``
    characters): what an outcome's ``error`` records. The traceback's tail would do for a
    short message, but a long one (a lost lease's hint) pushed the exception's type out of
    it, and a replaced job's ``LeaseExpired`` read as a failure with no cause."""
    lines = traceback_text.rstrip().splitlines()
    # The exception begins after the last frame line (frames are indented); a message of
    # several lines keeps them all.
    framed = [i for i, line in enumerate(lines) if line[:1].isspace()]
    start = framed[-1] + 1 if framed else 0
    return "\n".join(lines[start:])[:limit]


def _of_hold(kind: str, hold: Hold, detail: str, at: float) -> Anomaly:
    """An anomaly of ``hold``, on its key."""
    return Anomaly(kind, hold.key, detail, at, (hold.id,))


BEHIND_STRANDED = "behind the stranded head"


def _stranded_ahead(sub: Event, submitted: dict[str, Event], stranded: set[str]) -> str | None:
    """RQ: the stranded task (popped by a worker killed before it forked a horse) that
    holds an earlier ticket of ``sub``'s line, if any, named in the anomaly's detail: a
    sweep sends such a head again in its place (``rq_mutex.line``), so a call lost or
    left behind it is a failure of that rescue, which the detail points at."""
    mine = sub.get("ticket")
    if not sub.get("queued") or not isinstance(mine, dict):
        return None
    for task in sorted(stranded):
        other = submitted.get(task, {})
        theirs = other.get("ticket")
        if (
            other.get("key") == sub.get("key")
            and isinstance(theirs, dict)
            and theirs.get("epoch") == mine.get("epoch")
            and theirs.get("number", 0) < mine.get("number", 0)
        ):
            return task
    return None


def _of_task(kind: str, sub: Event, detail: str, at: float) -> Anomaly:
    """An anomaly of the task ``sub`` submitted, on its key."""
    return Anomaly(kind, sub.get("key"), detail, at, (sub["task"],))


def _redelivered(sub: Event, ends: list[Event], by_pid: dict[Any, list[Event]]) -> int:
    """Ends of an ``acks_late`` task after its process was killed between an earlier end
    and that run's ack: the broker delivers it again (at least once: Celery's promise).
    Not for a queued call: its line ended the turn before the ack, so the copy must be
    dropped as a duplicate."""
    if not sub.get("late") or sub.get("queued"):
        return 0
    ordered = sorted(ends, key=lambda r: r["t"])
    return sum(
        any(f["kind"] in KILLING and a["t"] <= f["t"] <= b["t"] for f in by_pid.get(a["pid"], ()))
        for a, b in itertools.pairwise(ordered)
    )


def _concurrent_runs(task: str, sub: Event, starts: list[Event], ends: list[Event],
                     faults: list[Event]) -> list[Anomaly]:  # fmt: skip
    """Two runs of one task alive at once: a start while an earlier run of it had neither
    ended nor been killed."""
    found = []
    ordered = sorted(starts, key=lambda r: r["t"])
    for a, b in itertools.pairwise(ordered):
        a_end = min(
            [r["t"] for r in ends if r.get("pid") == a["pid"] and r["t"] >= a["t"]]
            + [f["t"] for f in faults if f["t"] >= a["t"]]
            + [float("inf")]
        )
        if b["t"] < a_end:
            found.append(
                Anomaly(
                    "double-run",
                    sub.get("key"),
                    f"task {task} started again "
                    f"in pid {b['pid']} at {b['t']:.3f} while its run in pid "
                    f"{a['pid']} (from {a['t']:.3f}) was alive",
                    b["t"],
                    (task,),
                )
            )
    return found


def check_order(events: list[Event]) -> list[Anomaly]:
    """``on_busy="queue"``: per key, the calls sent through the line (``submit`` with
    ``queued``, in send order) are first granted in that order. Not counted: a call never
    granted (killed or revoked before it ran), and one whose first grant the line said was
    late (``granted.late``: a ticket stepped over as a gap that came after all)."""
    sent: dict[str, list[Event]] = defaultdict(list)
    first: dict[str, Event] = {}
    for e in events:
        if e["op"] == "submit" and e.get("queued"):
            sent[e["key"]].append(e)
        elif e["op"] == "granted" and e.get("task") is not None:
            first.setdefault(e["task"], e)
    found = []
    for key, subs in sent.items():
        ahead: tuple[float, str] | None = None  # the latest first grant of those sent before
        for sub in subs:
            grant = first.get(sub["task"])
            if grant is None or grant["key"] != key or grant.get("late") is not None:
                continue
            if ahead is not None and grant["t"] < ahead[0]:
                found.append(Anomaly(
                    "out-of-order", key,
                    f"task {sub['task']} (sent {sub['t']:.3f}) was granted at "
                    f"{grant['t']:.3f}, before task {ahead[1]}, sent earlier, was granted at "
                    f"{ahead[0]:.3f}; the line did not say it was late",
                    grant["t"], (grant["id"], first[ahead[1]]["id"]),
                ))  # fmt: skip
            if ahead is None or grant["t"] > ahead[0]:
                ahead = (grant["t"], sub["task"])
    return found


def check_latest(events: list[Event]) -> list[Anomaly]:
    """``on_busy="latest"`` and ``"debounce"`` (``submit`` with ``supersedes``, in send
    order per key): a call
    whose outcome is the skip marker with reason ``superseded`` was never granted, and the
    call it names (``outcome.by``) was sent after it; the newest call of each key was
    granted, unless a fault was dealt to it (a kill or a revoke may end it unrun)."""
    sent: dict[str, list[Event]] = defaultdict(list)
    order: dict[str, int] = {}
    granted: set[str] = set()
    outcomes: dict[str, Event] = {}
    for e in events:
        if e["op"] == "submit" and e.get("supersedes"):
            sent[e["key"]].append(e)
            order[e["task"]] = len(order)
        elif e["op"] == "granted" and e.get("task") is not None:
            granted.add(e["task"])
        elif e["op"] == "outcome":
            outcomes[e["task"]] = e
    dealt = _dealt_to_tasks(events)
    found = []
    for key, subs in sent.items():
        for sub in subs:
            task, out = sub["task"], outcomes.get(sub["task"])
            if out is None or out.get("reason") != "superseded":
                continue
            if task in granted:
                found.append(Anomaly("superseded-ran", key, f"task {task} was granted, yet "
                                     "reported superseded", out["t"], (task,)))  # fmt: skip
            by = out.get("by")
            if by not in order or order[by] <= order[task]:
                found.append(Anomaly("superseded-by-older", key, f"task {task} was reported "
                                     f"superseded by {by}, not a call sent after it",
                                     out["t"], (task,)))  # fmt: skip
        newest = subs[-1]
        if newest["task"] not in granted and not dealt.get(newest["task"]):
            found.append(Anomaly("newest-lost", key, f"task {newest['task']}, the newest call "
                                 "of its key, was never granted and no fault was dealt to it",
                                 newest["t"], (newest["task"],)))  # fmt: skip
    return found


def check_ticks(events: list[Event], expected: dict[str, list[str]]) -> list[Anomaly]:
    """Periodic jobs: every expected tick (per schedule entry) ran exactly once.
    ``expected`` maps an entry to its slots in the checked window; ``tick`` events carry
    ``entry`` and ``slot``."""
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    for e in events:
        if e["op"] == "tick":
            seen[e["entry"]][e["slot"]] += 1
    found = []
    for entry, slots in expected.items():
        for slot in slots:
            n = seen[entry][slot]
            if n == 0:
                found.append(Anomaly("tick-missed", entry, f"tick {slot} of {entry} never ran"))
            elif n > 1:
                found.append(
                    Anomaly("tick-repeated", entry, f"tick {slot} of {entry} ran {n} times")
                )
    return found


def figures(events: list[Event], anomalies: list[Anomaly]) -> dict[str, Any]:
    """What a run prints: histories, operations, faults by kind, anomalies by kind."""
    steps = [e for e in events if e["op"] == "step"]
    return {
        "histories": len({e["pid"] for e in events if e["op"] == "start"}),
        "events": len(events),
        "operations": sum(e["op"] in ("acquire", "submit", "tick") for e in events),
        "grants": sum(e["op"] == "granted" for e in events),
        "queued": sum(e["op"] == "submit" and bool(e.get("queued")) for e in events),
        "parked": sum(e["op"] == "parked" for e in events),
        "steps": len(steps),
        "unprotected_steps": sum(not _protected(s) for s in steps),
        "unprotected_refused": sum(not _protected(s) and not s["accepted"] for s in steps),
        "faults": dict(Counter(e["kind"] for e in events if e["op"] == "fault")),
        "anomalies": dict(Counter(a.kind for a in anomalies)),
    }


def dealt_to(events: list[Event], anomaly: Anomaly) -> list[str]:
    """The faults that touched an anomaly's operations (by op id, or by the pid of a hold
    while it ran): the first clue to its cause."""
    ids = set(anomaly.ids)
    pids: dict[int, tuple[float, float]] = {}
    for e in events:
        if e.get("id") in ids:
            a, b = pids.get(e["pid"], (e["t"], e["t"]))
            pids[e["pid"]] = (min(a, e["t"]), max(b, e["t"]))
    tasks = {e["task"] for e in events if e.get("id") in ids and e.get("task")} | ids
    kinds = []
    for e in events:
        if e["op"] != "fault":
            continue
        span = pids.get(e.get("target"))  # type: ignore[arg-type]
        mine = e.get("id") in ids or e.get("task") in tasks
        signalled = (
            e.get("id") is None and span is not None and (span[0] - 0.5 <= e["t"] <= span[1])
        )
        server = e.get("target") in ("proxy", "server") and anomaly.at - 5 <= e["t"] <= anomaly.at
        if mine or signalled or server:
            kinds.append(f"{e['kind']}@{e['t']:.3f}")
    return kinds
