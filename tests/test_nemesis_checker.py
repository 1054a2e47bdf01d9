"""The nemesis's history checker on hand-written histories: each anomaly kind it claims
to catch is caught, and a clean history of the same shape yields none (so every test here
would fail if its property were not checked)."""

from __future__ import annotations

from typing import Any

import nemesis  # noqa: F401  (puts tests/ on sys.path for the nemesis.* imports)
import pytest
from nemesis.checker import (
    BEHIND_STRANDED,
    GONE_AT_RENEWAL,
    TAKEN_OVER,
    Spec,
    check,
    check_latest,
    check_order,
    check_tasks,
    check_ticks,
)

pytestmark = pytest.mark.fast


class H:
    """A history builder: ``hold`` writes the events of one lock hold."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.n = 0

    def add(self, op: str, t: float, pid: int = 1, **fields: Any) -> None:
        self.events.append({"t": t, "pid": pid, "w": f"w{pid}", "op": op, **fields})

    def proc(self, pid: int, start: float = 0.0, end: float | None = 100.0) -> None:
        self.add("start", start, pid)
        if end is not None:
            self.add("exit", end, pid)

    def hold(
        self,
        pid: int,
        key: str,
        fence: int,
        *,
        inv: float,
        got: float,
        steps: list[float],
        deadline: float,
        accepted: list[bool] | None = None,
        rel: float | None = None,
        timeout: float | None = 10.0,
        slot: int = 0,
    ) -> str:
        self.n += 1
        op = f"w{pid}:{self.n}"
        self.add("acquire", inv, pid, id=op, key=key, timeout=timeout, lease=1, renew=False)
        self.add("granted", got, pid, id=op, key=key, fence=fence, slot=slot, deadline=deadline)
        for n, t in enumerate(steps):
            ok = True if accepted is None else accepted[n]
            self.add("step", t, pid, id=op, key=key, fence=fence, slot=slot, n=n, t0=t - 0.001,
                     deadline=deadline, accepted=ok, last=fence)  # fmt: skip
        end = rel if rel is not None else (steps[-1] if steps else got) + 0.001
        self.add("released", end, pid, id=op, key=key, ok=True, t0=end - 0.001)
        self.add("done", end, pid, id=op)
        return op

    def sorted(self) -> list[dict[str, Any]]:
        return sorted(self.events, key=lambda e: e["t"])


def kinds(events: list[dict[str, Any]], **kw: Any) -> list[str]:
    return sorted(a.kind for a in check(events, **kw))


def two_holders(second_got: float, second_fence: int = 2, slot: int = 0) -> H:
    """A holds k from 1.1 to 1.4; B, invoked at 1.15 (after A's grant returned), gets it
    at ``second_got``."""
    h = H()
    h.proc(1)
    h.proc(2)
    h.hold(1, "k", 1, inv=1.0, got=1.1, steps=[1.2, 1.3, 1.4], deadline=2.0)
    h.hold(2, "k", second_fence, inv=1.15, got=second_got, steps=[second_got + 0.1],
           deadline=second_got + 1, slot=slot)  # fmt: skip
    return h


def test_clean_hand_off_has_no_anomaly() -> None:
    """B granted after A's last step and release: nothing to report."""
    assert kinds(two_holders(1.5).sorted()) == []


def test_overlap_of_two_protected_spans() -> None:
    """B's lease began while A still stepped inside its own: an overlap."""
    assert "overlap" in kinds(two_holders(1.25).sorted())


def test_semaphore_permits_allow_that_many_spans() -> None:
    """Two at once is no overlap for a 2-permit key, three is."""
    h = two_holders(1.25, slot=1)
    assert kinds(h.sorted(), spec=Spec(permits={"k": 2})) == []
    h.hold(3, "k", 3, inv=1.0, got=1.26, steps=[1.27], deadline=3.0, slot=2)
    h.proc(3)
    assert "overlap" in kinds(h.sorted(), spec=Spec(permits={"k": 2}))


def test_unprotected_step_refused_by_the_store_is_fine() -> None:
    """A frozen holder wakes after its deadline: its step is unprotected, the store refuses
    it (a later fence was written): no anomaly, the fence did its job."""
    h = H()
    h.proc(1)
    h.proc(2)
    h.hold(1, "k", 1, inv=1.0, got=1.1, steps=[1.2, 2.5], deadline=2.0, accepted=[True, False])
    h.hold(2, "k", 2, inv=1.5, got=2.1, steps=[2.2], deadline=3.0)
    h.add("fault", 1.3, 0, kind="sigstop", target=1)
    h.add("resumed", 2.45, 0, target=1)
    assert kinds(h.sorted()) == []


def test_stale_write_accepted() -> None:
    """The same history, but the store accepted the frozen holder's older fence after the
    newer one: caught from the history alone and from the store's log."""
    h = H()
    h.proc(1)
    h.proc(2)
    h.hold(1, "k", 1, inv=1.0, got=1.1, steps=[1.2, 2.5], deadline=2.0)
    h.hold(2, "k", 2, inv=1.5, got=2.1, steps=[2.2], deadline=3.0)
    h.add("fault", 1.3, 0, kind="sigstop", target=1)
    h.add("resumed", 2.45, 0, target=1)
    assert kinds(h.sorted()) == ["stale-write"]
    log = [(0, "k/0", 1, "a"), (1, "k/0", 2, "b"), (2, "k/0", 1, "a")]
    assert [a.kind for a in check([], store_log=log)] == ["stale-write"]


def test_protected_write_refused_means_a_grant_inside_the_lease() -> None:
    h = H()
    h.proc(1)
    h.hold(1, "k", 1, inv=1.0, got=1.1, steps=[1.2, 1.3], deadline=2.0, accepted=[True, False])
    assert kinds(h.sorted()) == ["refused-while-protected"]


def test_fence_reversal_and_repeat() -> None:
    """B invoked after A was granted, yet B's fence is lower (a reversal), or equal."""
    assert kinds(two_holders(1.5, second_fence=0).sorted()) == ["fence-order", "stale-write"]
    assert "fence-repeat" in kinds(two_holders(1.5, second_fence=1).sorted())


def test_concurrent_acquires_may_return_in_either_order() -> None:
    """A's grant returned after B was invoked: no real-time order, no fence constraint."""
    h = H()
    h.proc(1)
    h.proc(2)
    h.hold(1, "k", 2, inv=1.0, got=1.5, steps=[1.6], deadline=3.0)
    h.hold(2, "k", 1, inv=1.1, got=1.2, steps=[1.3], deadline=3.0, rel=1.4)
    assert kinds(h.sorted()) == []


def test_per_slot_fences_only_order_one_slot() -> None:
    h = H()
    h.proc(1)
    h.proc(2)
    h.hold(1, "k", 5, inv=1.0, got=1.1, steps=[1.2], deadline=3.0, slot=0)
    h.hold(2, "k", 3, inv=1.3, got=1.4, steps=[1.5], deadline=3.0, slot=1)
    assert kinds(h.sorted(), spec=Spec(permits={"k": 2})) == ["fence-order"]
    assert kinds(h.sorted(), spec=Spec(permits={"k": 2}, per_slot_fences=True)) == []


def test_hang_past_timeout_discounting_sigstop() -> None:
    """An acquire(timeout=1) that returned after 5 s hangs, unless it was frozen 4.5 s."""
    h = H()
    h.proc(1)
    h.add("acquire", 1.0, 1, id="a", key="k", timeout=1.0, lease=1, renew=False)
    h.add("busy", 6.0, 1, id="a", key="k", error="timeout")
    assert kinds(h.sorted()) == ["hang"]
    h.add("fault", 1.2, 0, kind="sigstop", target=1)
    h.add("resumed", 5.7, 0, target=1)
    assert kinds(h.sorted()) == []


def test_process_killed_at_the_end_is_a_hang() -> None:
    h = H()
    h.proc(1)
    h.add("unended", 9.0, 0, target=1, name="w1")
    assert kinds(h.sorted()) == ["hang"]


def test_late_interrupt() -> None:
    """Steps went on 3 s past the deadline with the process running: no interrupt."""
    h = H()
    h.proc(1)
    h.hold(1, "k", 1, inv=1.0, got=1.1, steps=[1.5, 5.0], deadline=2.0)
    assert kinds(h.sorted()) == ["late-interrupt"]


def test_alarm_swallowed_while_waiting() -> None:
    h = H()
    h.proc(1)
    h.hold(1, "k", 1, inv=1.0, got=3.0, steps=[3.1], deadline=4.0)
    clean = kinds(h.sorted())
    h.add("alarm", 2.0, 1, id="w1:1")
    assert clean == []
    assert kinds(h.sorted()) == ["swallowed-interrupt"]


def test_sigterm_survivor() -> None:
    h = H()
    h.proc(1, end=None)
    h.add("fault", 1.0, 0, kind="sigterm", target=1)
    h.add("acquire", 20.0, 1, id="x", key="k", timeout=None, lease=1, renew=False)
    assert "survived-signal" in kinds(h.sorted())


def test_a_revoke_of_a_task_already_ended_sends_no_sigterm() -> None:
    """A revoke that reaches the worker after the task's body ended terminates nothing:
    the child going on is no survivor. One whose body never ended is."""
    h = H()
    h.proc(1, end=None)
    h.add("run", 1.0, 1, task="a", phase="end")
    h.add("fault", 1.1, 0, kind="revoke", task="a", target=1)
    h.add("acquire", 20.0, 1, id="x", key="k", timeout=None, lease=1, renew=False)
    assert "survived-signal" not in kinds(h.sorted())
    h.add("fault", 1.2, 0, kind="revoke", task="b", target=1)
    assert "survived-signal" in kinds(h.sorted())


def test_lost_op_and_crash() -> None:
    """An op with no end in a process that exited normally is lost; a process that
    vanished with no fault crashed; one killed by the nemesis is neither."""
    h = H()
    h.proc(1)
    h.add("acquire", 1.0, 1, id="x", key="k", timeout=None, lease=1, renew=False)
    h.proc(2, end=None)
    h.proc(3, end=None)
    h.add("fault", 5.0, 0, kind="sigkill", target=3)
    assert kinds(h.sorted()) == ["crash", "lost-op"]


def test_a_record_gone_under_its_holder_has_vanished() -> None:
    """Spec.records_kept (failover runs): a release before the believed deadline that
    finds the record taken over, or a renewal that finds it gone, is a vanished grant; a
    release after the deadline is only late, and without records_kept nothing is said."""

    def released(loss: str, t0: float) -> list[dict[str, Any]]:
        h = H()
        h.proc(1)
        op = h.hold(1, "k", 1, inv=1.0, got=1.1, steps=[1.2], deadline=2.0, rel=3.0)
        h.events = [e for e in h.events if e["op"] != "released"]
        h.add("released", t0 + 0.001, 1, id=op, key="k", ok=False, t0=t0, deadline=2.0,
              loss=loss)  # fmt: skip
        return h.sorted()

    kept = Spec(records_kept=True)
    assert kinds(released(TAKEN_OVER, 1.5), spec=kept) == ["vanished"]
    assert kinds(released(GONE_AT_RENEWAL, 1.5), spec=kept) == ["vanished"]
    assert kinds(released(TAKEN_OVER, 2.5), spec=kept) == []
    assert kinds(released(TAKEN_OVER, 1.5)) == []


def task_history(*rows: tuple[str, float, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"t": t, "pid": 1, "w": "q", "op": op, **f} for op, t, f in rows]


def test_tasks_lost_double_run_and_unexplained_failure() -> None:
    ok = task_history(
        ("submit", 0.0, {"task": "a"}),
        ("run", 1.0, {"task": "a", "phase": "start", "pid": 5}),
        ("run", 2.0, {"task": "a", "phase": "end", "pid": 5}),
        ("outcome", 3.0, {"task": "a", "state": "success"}),
    )
    assert check_tasks(ok) == []
    assert [a.kind for a in check_tasks(ok[:1])] == ["lost-task"]
    twice = [
        *ok,
        {"t": 1.5, "pid": 6, "w": "q", "op": "run", "task": "a", "phase": "start"},
        {"t": 2.5, "pid": 6, "w": "q", "op": "run", "task": "a", "phase": "end"},
    ]
    assert sorted(a.kind for a in check_tasks(twice)) == ["double-run", "double-run"]
    failed = [
        ok[0],
        {
            "t": 3.0,
            "pid": 1,
            "w": "q",
            "op": "outcome",
            "task": "a",
            "state": "failure",
            "error": "boom",
        },
    ]
    assert [a.kind for a in check_tasks(failed)] == ["unexplained-failure"]
    dealt = [*failed, {"t": 1.0, "pid": 0, "w": "n", "op": "fault", "kind": "revoke", "task": "a"}]
    assert check_tasks(dealt) == []


def test_a_retry_after_a_kill_may_run_again() -> None:
    """The first run was killed (fault), the retry ran to its end: one run, no anomaly."""
    rows = task_history(
        ("submit", 0.0, {"task": "a", "unique": True}),
        ("run", 1.0, {"task": "a", "phase": "start", "pid": 5}),
        ("fault", 1.5, {"task": "a", "kind": "horse-kill", "target": 5}),
        ("run", 3.0, {"task": "a", "phase": "start", "pid": 6}),
        ("run", 4.0, {"task": "a", "phase": "end", "pid": 6}),
        ("outcome", 5.0, {"task": "a", "state": "success"}),
    )
    assert check_tasks(rows) == []
    skipped = [
        *rows[:3],
        {"t": 5.0, "pid": 1, "w": "q", "op": "outcome", "task": "a", "state": "skipped"},
    ]
    assert [a.kind for a in check_tasks(skipped)] == ["lost-task"]


def test_a_dealt_time_limit_must_bite() -> None:
    """A task with a 1 s limit whose body ran to its end 3 s after it began (it waited
    for the lock past its limit): the limit was swallowed. Ending within it is fine."""
    rows = task_history(
        ("submit", 0.0, {"task": "a", "limit": 1.0}),
        ("run", 1.0, {"task": "a", "phase": "prerun", "pid": 5}),
        ("fault", 1.0, {"task": "a", "kind": "job-timeout"}),
        ("run", 3.9, {"task": "a", "phase": "start", "pid": 5}),
        ("run", 4.0, {"task": "a", "phase": "end", "pid": 5}),
        ("outcome", 5.0, {"task": "a", "state": "success"}),
    )
    assert [a.kind for a in check_tasks(rows)] == ["swallowed-interrupt"]
    rows[3]["t"], rows[4]["t"] = 1.5, 1.6
    assert check_tasks(rows) == []


def test_a_call_must_not_begin_well_after_it_expired() -> None:
    """A call whose ``expires`` passed while it was parked ends revoked, never run: one
    whose body began more than EXPIRY_SLACK after it is an anomaly; before, or revoked
    with no run (the expiry fault dealt to it explains the failure), none."""
    rows = task_history(
        ("submit", 0.0, {"task": "a", "queued": True, "expires_at": 0.5}),
        ("fault", 0.0, {"task": "a", "kind": "expiry"}),
        ("run", 3.5, {"task": "a", "phase": "start", "pid": 5}),
        ("run", 3.6, {"task": "a", "phase": "end", "pid": 5}),
        ("outcome", 4.0, {"task": "a", "state": "success"}),
    )
    assert [a.kind for a in check_tasks(rows)] == ["ran-expired"]
    rows[2]["t"], rows[3]["t"] = 0.4, 0.5
    assert check_tasks(rows) == []
    revoked = [*rows[:2], {**rows[4], "state": "failure", "error": "REVOKED expired"}]
    assert check_tasks(revoked) == []
    assert check_tasks(rows[:2]) == []  # dropped unseen by the broker: no outcome, no run


def test_ticks_missed_and_repeated() -> None:
    rows = task_history(("tick", 1.0, {"entry": "e", "slot": "s1"}),
                        ("tick", 2.0, {"entry": "e", "slot": "s2"}),
                        ("tick", 2.1, {"entry": "e", "slot": "s2"}))  # fmt: skip
    found = check_ticks(rows, {"e": ["s1", "s2", "s3"]})
    assert sorted(a.kind for a in found) == ["tick-missed", "tick-repeated"]


def test_a_disk_stall_is_discounted_for_everyone() -> None:
    """DiskCache's write lock held from outside for 4 s (a wedged disk): an acquire that
    waited behind it is no hang; the same wait without the stall is."""
    h = H()
    h.proc(1)
    h.add("acquire", 1.0, 1, id="a", key="k", timeout=0.0, lease=1, renew=False)
    h.add("busy", 5.0, 1, id="a", key="k", error="timeout")
    assert kinds(h.sorted()) == ["hang"]
    h.add("fault", 0.9, 0, kind="disk-stall", target="server", length=4.0)
    assert kinds(h.sorted()) == []


def test_a_retry_of_one_task_gets_a_fence_of_its_own() -> None:
    """Two grants of one fence are a repeat, also when both are attempts of one Celery
    task id: a retry is granted anew once its earlier attempt let go (it once took the
    record over, fence and all, beside that attempt's clean-up)."""
    h = two_holders(1.5, second_fence=1)
    assert "fence-repeat" in kinds(h.sorted())
    for e in h.events:
        if e["op"] == "acquire":
            e["task"] = "t1"
    assert "fence-repeat" in kinds(h.sorted())


def queued(*grants: tuple[str, float, str | None]) -> list[dict[str, Any]]:
    """Tasks a, b, c sent in that order on the queued key q.a, then granted as ``grants``
    say: (task, when, the line's late reason)."""
    rows: list[tuple[str, float, dict[str, Any]]] = [
        ("submit", n * 0.1, {"task": task, "key": "q.a", "queued": True})
        for n, task in enumerate("abc")
    ]
    rows += [("granted", t, {"task": task, "id": f"{task}:{t}", "key": "q.a", "late": late})
             for task, t, late in grants]  # fmt: skip
    return sorted(task_history(*rows), key=lambda e: e["t"])


def test_queued_calls_granted_against_send_order() -> None:
    """b granted before a, which was sent first: out of order; in send order, or a
    never granted (killed before it ran), it is not."""
    found = check_order(queued(("b", 1.0, None), ("a", 2.0, None), ("c", 3.0, None)))
    assert [(a.kind, a.key) for a in found] == [("out-of-order", "q.a")]
    assert found[0].detail.startswith("task b")
    assert "before task a, sent earlier" in found[0].detail
    assert check_order(queued(("a", 1.0, None), ("b", 2.0, None), ("c", 3.0, None))) == []
    assert check_order(queued(("b", 1.0, None), ("c", 2.0, None))) == []
    # Only the first grant counts: a's redelivered copy after b is its own turn's, not b's.
    assert check_order(queued(("a", 1.0, None), ("b", 2.0, None), ("a", 2.5, None))) == []


def test_a_late_run_out_of_order_is_no_anomaly() -> None:
    """a stepped over as a gap, run late once it came (said so): b and c keep their order."""
    late = queued(("b", 1.0, None), ("c", 2.0, None), ("a", 3.0, "skipped"))
    assert check_order(late) == []
    assert [a.kind for a in check_order(queued(("b", 1.0, None), ("a", 3.0, "skipped"),
                                               ("c", 0.5, None)))] == ["out-of-order"]  # fmt: skip


def latest(*rows: tuple[str, float, dict[str, Any]]) -> list[dict[str, Any]]:
    """Tasks a, b, c sent in that order with on_busy="latest" on l.a, then ``rows``."""
    sent: list[tuple[str, float, dict[str, Any]]] = [
        ("submit", n * 0.1, {"task": task, "key": "l.a", "queued": True, "supersedes": True})
        for n, task in enumerate("abc")
    ]
    return sorted(task_history(*sent, *rows), key=lambda e: e["t"])


def superseded(task: str, by: str, t: float = 2.0) -> tuple[str, float, dict[str, Any]]:
    return ("outcome", t, {"task": task, "state": "skipped", "reason": "superseded", "by": by})


def granted(task: str, t: float) -> tuple[str, float, dict[str, Any]]:
    return ("granted", t, {"task": task, "id": f"{task}:{t}", "key": "l.a", "late": None})


def test_keep_latest_supersedes_only_older_calls_never_runs_them_and_runs_the_newest() -> None:
    """a runs, b is superseded by c, c runs: clean. b granted as well, b superseded by a
    (sent before it), c never granted: one anomaly each; c never granted but revoked (a
    fault dealt to it): none."""
    clean = latest(granted("a", 1.0), superseded("b", "c"), granted("c", 3.0))
    assert check_latest(clean) == []
    assert [a.kind for a in check_latest([*clean, *latest(granted("b", 2.5))[3:]])] == [
        "superseded-ran"
    ]  # fmt: skip
    older = latest(granted("a", 1.0), superseded("b", "a"), granted("c", 3.0))
    assert [a.kind for a in check_latest(older)] == ["superseded-by-older"]
    lost = latest(granted("a", 1.0), superseded("b", "c"))
    assert [(a.kind, a.ids) for a in check_latest(lost)] == [("newest-lost", ("c",))]
    revoked = [*lost, *task_history(("fault", 2.5, {"kind": "revoke", "task": "c"}))]
    assert check_latest(revoked) == []


def test_a_parked_arrival_is_an_acquire_that_ended() -> None:
    """A queued arrival parks (Ignore) after its acquire record, without a grant: no
    lost-op, no hang; and a fault to its process after it parked is not dealt to it."""
    h = H()
    h.proc(1)
    h.add("acquire", 1.0, 1, id="p", key="q.a", timeout=10, lease=2, renew=True)
    h.add("parked", 1.01, 1, id="p", key="q.a")
    assert kinds(h.sorted()) == []
    rows = task_history(
        ("submit", 0.0, {"task": "a", "queued": True}),
        ("run", 1.0, {"task": "a", "phase": "prerun", "pid": 5}),
        ("run", 1.1, {"task": "a", "phase": "parked", "pid": 5}),
        ("fault", 2.0, {"kind": "worker-kill", "target": 5}),
    )
    assert [a.kind for a in check_tasks(rows)] == ["lost-task"]
    assert check_tasks([r for r in rows if r.get("phase") != "parked"]) == []


def test_an_acks_late_task_killed_before_its_ack_may_end_twice() -> None:
    """Its worker killed after the body ended, before the ack: the broker delivers it again
    and it runs to its end again (at least once). Not so for a queued call (its line ended
    the turn first: the copy must be dropped), nor with no kill between the two ends."""

    def twice(kill_at: float, **submit: Any) -> list[dict[str, Any]]:
        return task_history(
            ("submit", 0.0, {"task": "a", "late": True, **submit}),
            ("run", 1.0, {"task": "a", "phase": "prerun", "pid": 5}),
            ("run", 1.1, {"task": "a", "phase": "start", "pid": 5}),
            ("run", 1.5, {"task": "a", "phase": "end", "pid": 5}),
            ("fault", kill_at, {"kind": "worker-kill", "target": 5}),
            ("run", 2.0, {"task": "a", "phase": "prerun", "pid": 6}),
            ("run", 2.1, {"task": "a", "phase": "start", "pid": 6}),
            ("run", 2.5, {"task": "a", "phase": "end", "pid": 6}),
            ("outcome", 3.0, {"task": "a", "state": "success"}),
        )

    assert check_tasks(twice(1.6)) == []
    assert [a.kind for a in check_tasks(twice(1.6, queued=True))] == ["double-run"]
    assert [a.kind for a in check_tasks(twice(2.8))] == ["double-run"]


def _replaced(late_step: float) -> H:
    """A holds r.k (fence 1, its lease believed until 3.0); B replaces it at 1.5 (fence
    2) and writes at 1.6; A's steps after 1.5 are refused, the last begins at
    ``late_step``."""
    h = H()
    h.proc(1)
    h.proc(2)
    h.hold(1, "r.k", 1, inv=1.0, got=1.1, steps=[1.2, 1.55, 1.7, late_step], deadline=3.0,
           accepted=[True, True, False, False])  # fmt: skip
    h.hold(2, "r.k", 2, inv=1.4, got=1.5, steps=[1.6], deadline=3.5)
    return h


def test_a_replaced_holder_is_protected_until_its_takeover() -> None:
    """on_busy="replace": the holder's steps after the newer call's grant are not
    protected, so the store refusing them is the fence at work, and the two holds do not
    overlap (without ``Spec.replacing`` the same history is an overlap and a refused
    protected write); a step begun more than interrupt_slack after the takeover means
    the stop did not land (late-interrupt)."""
    replacing = Spec(replacing=("r.",))
    assert kinds(_replaced(1.8).sorted(), spec=replacing) == []
    assert kinds(_replaced(1.8).sorted()) == ["overlap", "refused-while-protected"]
    assert kinds(_replaced(2.9).sorted(), spec=replacing) == ["late-interrupt"]


def test_a_replaced_tasks_lost_lease_is_explained_only_by_a_later_grant() -> None:
    """A task on a replacing key failing with SimpleMutexLeaseExpiredError is explained
    when another grant of its key came after its own; with none, it is unexplained."""
    failed = {"state": "failure", "error": "FAILURE SimpleMutexLeaseExpiredError('lost')"}
    alone = task_history(
        ("submit", 0.0, {"task": "a", "key": "r.k"}),
        ("granted", 1.0, {"task": "a", "id": "a:1", "key": "r.k"}),
        ("run", 1.0, {"task": "a", "phase": "start", "pid": 5}),
        ("outcome", 3.0, {"task": "a", **failed}),
    )
    assert [a.kind for a in check_tasks(alone, ("r.",))] == ["unexplained-failure"]
    newer = {"t": 1.5, "pid": 6, "w": "q", "op": "granted", "task": "b", "id": "b:1", "key": "r.k"}
    assert check_tasks([*alone, newer], ("r.",)) == []
    assert [a.kind for a in check_tasks([*alone, newer])] == ["unexplained-failure"]


def test_a_queued_call_is_skipped_only_as_a_duplicate_of_its_run() -> None:
    """RQ records a duplicate copy's skip marker on the job id: a queued job reported
    skipped (reason "duplicate") after its body ran is no anomaly; skipped with no run
    of it begun, or for any other reason (a queued job is never busy), it was lost."""

    def skipped(reason: str | None, ran: bool) -> list[dict[str, Any]]:
        rows: list[tuple[str, float, dict[str, Any]]] = [
            ("submit", 0.0, {"task": "a", "key": "q.a", "queued": True}),
        ]
        if ran:
            rows += [("run", 1.1, {"task": "a", "phase": "start", "pid": 5}),
                     ("run", 1.5, {"task": "a", "phase": "end", "pid": 5})]  # fmt: skip
        rows.append(("outcome", 3.0, {"task": "a", "state": "skipped", "reason": reason}))
        return task_history(*rows)

    assert check_tasks(skipped("duplicate", ran=True)) == []
    assert [a.kind for a in check_tasks(skipped("duplicate", ran=False))] == ["lost-task"]
    assert [a.kind for a in check_tasks(skipped("busy", ran=True))] == ["lost-task"]


def test_an_rq_job_begins_its_body_once_per_attempt_it_was_given() -> None:
    """RQ runs a job again only for a retry it was given: a horse killed in the body of a
    job without retries leaves it FAILED, so a second body start is a double run; with
    one retry, two starts are its due (a park never starts the body)."""

    def killed_and_again(retries: int) -> list[dict[str, Any]]:
        return task_history(
            ("submit", 0.0, {"task": "a", "key": "q.a", "queued": True, "retries": retries}),
            ("run", 1.0, {"task": "a", "phase": "prerun", "pid": 5}),
            ("run", 1.1, {"task": "a", "phase": "start", "pid": 5}),
            ("fault", 1.2, {"kind": "horse-kill", "task": "a", "target": 5}),
            ("run", 4.0, {"task": "a", "phase": "prerun", "pid": 6}),
            ("run", 4.1, {"task": "a", "phase": "start", "pid": 6}),
            ("run", 4.5, {"task": "a", "phase": "end", "pid": 6}),
            ("outcome", 5.0, {"task": "a", "state": "success"}),
        )

    assert check_tasks(killed_and_again(1)) == []
    assert [a.kind for a in check_tasks(killed_and_again(0))] == ["double-run"]


def test_an_rq_job_popped_by_a_worker_killed_before_it_ran_may_have_no_outcome() -> None:
    """RQ: a job popped by a worker that was SIGKILLed before it started it stays in the
    queue's intermediate list (``stranded``) until RQ's maintenance fails it, minutes
    later: no outcome, and no lost task. Stranded with no worker killed after its send, it
    was lost."""

    def stranded(kill_at: float) -> list[dict[str, Any]]:
        return task_history(
            ("submit", 1.0, {"task": "a", "key": "q.a", "queued": True, "retries": 0}),
            ("fault", kill_at, {"kind": "worker-kill", "target": 7}),
            ("stranded", 9.0, {"task": "a"}),
        )

    assert check_tasks(stranded(2.0)) == []
    assert [a.kind for a in check_tasks(stranded(0.5))] == ["lost-task"]
    assert [a.kind for a in check_tasks([e for e in stranded(2.0) if e["op"] != "stranded"])
            ] == ["lost-task"]  # fmt: skip


def test_a_queued_job_behind_a_stranded_head_of_its_line_is_named_so() -> None:
    """The calls a stranded head holds back (its line waits for RQ to call it abandoned)
    are lost-task anomalies that say so, which ``KNOWN`` can then tell from any other
    loss: only a later ticket of the same line and epoch is behind it."""

    def ticket(n: int, epoch: str = "e1") -> dict[str, Any]:
        return {"epoch": epoch, "number": n}

    def queued(task: str, t: float, n: int, key: str = "q.a", epoch: str = "e1") -> Any:
        return ("submit", t, {"task": task, "key": key, "queued": True, "retries": 0,
                              "ticket": ticket(n, epoch)})  # fmt: skip

    events = task_history(
        queued("ahead", 0.5, 1),
        queued("head", 1.0, 2),
        queued("behind", 1.1, 3),
        queued("elsewhere", 1.2, 4, key="q.b"),
        queued("new-epoch", 1.3, 5, epoch="e2"),
        ("fault", 2.0, {"kind": "worker-kill", "target": 7}),
        ("stranded", 9.0, {"task": "head"}),
    )
    found = {a.ids[0]: a.detail for a in check_tasks(events)}
    assert set(found) == {"ahead", "behind", "elsewhere", "new-epoch"}  # the head is gone
    assert [t for t, d in found.items() if BEHIND_STRANDED in d] == ["behind"]
    assert "head" in found["behind"]
    unstranded = [e for e in events if e["op"] != "stranded"]
    assert not any(BEHIND_STRANDED in a.detail for a in check_tasks(unstranded))


def test_the_rq_tier_reads_a_late_run_from_rq_mutexs_warning() -> None:
    """RQ tells a job's body nothing of a run out of order; the tier's horses read the
    line's reason from the line driver's warning (on ``rq_mutex``'s logger, naming the
    call as ``rq_mutex.line`` does), which must stay the one it matches."""
    import inspect
    import logging
    from types import SimpleNamespace

    from nemesis import rq_jobs

    import rq_mutex.line
    from simple_mutex.busy.line import driver

    assert f'"{rq_jobs.OUT_OF_ORDER}"' in inspect.getsource(driver)
    job = SimpleNamespace(id="j1")
    call = rq_mutex.line.JobCall(None, None, "n", job=job, policy=None)  # type: ignore[arg-type]
    assert call.who == "job j1"  # the first argument of the warning
    # The handler is on rq_mutex's logger in every horse; fed the warning's record here
    # directly, since a Celery worker started in this process may have disabled loggers.
    handlers = [h for h in logging.getLogger("rq_mutex").handlers if isinstance(h, rq_jobs._Late)]
    assert handlers
    record = logging.LogRecord("rq_mutex", logging.WARNING, __file__, 0, rq_jobs.OUT_OF_ORDER,
                               ("job j1", 3, "q.a", "skipped"), None)  # fmt: skip
    handlers[0].handle(record)
    assert rq_jobs._state["late"]["j1"] == "skipped"


def test_an_outcome_records_the_exception_from_its_type_on() -> None:
    """A job's error keeps its exception's type however long its message: a replaced job's
    lost lease, whose hint runs past 300 characters, once read as a failure with no cause
    (its type had fallen off the traceback's tail)."""
    import traceback

    from nemesis.checker import exception_of

    from simple_mutex.errors import SimpleMutexLeaseExpiredError

    hint = "the work ran (" + GONE_AT_RENEWAL + "); " + "another holder may have entered. " * 12

    def body() -> None:
        raise SimpleMutexLeaseExpiredError(f"lease lost on r.a: {hint}\nsecond line")

    try:
        body()
    except SimpleMutexLeaseExpiredError:
        text = traceback.format_exc()
    assert "LeaseExpired" not in text[-300:]  # the case: the tail alone has no type
    error = exception_of(text)
    assert error.startswith("simple_mutex.errors.SimpleMutexLeaseExpiredError: lease lost")
    assert len(error) == 300
    assert exception_of("ValueError: one\ntwo\n") == "ValueError: one\ntwo"
