"""Unit tests of the lock engine: every flow driven on a fake clock, no real sleeps.

A flow yields cache operations; the fake driver below answers them from a script and
advances the fake clock by each ``Wait`` (and, when asked, by a fixed cost per write), so
deadlines, jitter, slot order and the unclear-outcome rule are checked exactly and
instantly.
"""

from __future__ import annotations

import asyncio
import random
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from alarms import Alarm

from simple_mutex import (
    InMemoryCache,
    MalfunctionError,
    Mutex,
    SimpleCacheConditionError,
    SimpleMutexAcquireTimeoutError,
)
from simple_mutex._core import flows, timing
from simple_mutex._core.flows import (
    CompareAndDelete,
    CompareAndSet,
    Get,
    Pause,
    PutIfAbsent,
    Released,
    Wait,
    WaitThenPut,
)
from simple_mutex._core.timing import poll_pause
from simple_mutex._runtime import drivers
from simple_mutex._runtime.drivers import execute, run, run_async
from simple_mutex.contract import Entry

pytestmark = pytest.mark.fast

VALUE = '{"token":"ours"}'
OTHER = '{"token":"theirs"}'
START = 1000.0  # the fake clock's reading when a flow starts
OURS = Entry(VALUE, "v2", 7, 1e9)
THEIRS = Entry(OTHER, "v9", 8, 1e9)


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, start: float = START) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t


def entry_for(op: PutIfAbsent, fence: int = 7) -> Entry:
    return Entry(op.value, f"v{fence}", fence, 1e9)


def held() -> SimpleCacheConditionError:
    return SimpleCacheConditionError("held")


def scripted(*answers: Any) -> Callable[[Any], Any]:
    """Answer ops in order: an exception instance is raised, a function is called with the
    op, anything else is returned."""
    queue = list(answers)

    def answer(op: Any) -> Any:
        result = queue.pop(0)
        if isinstance(result, BaseException):
            raise result
        return result(op) if callable(result) else result

    return answer


def busy(op: Any) -> Any:
    """Every put finds the key held."""
    if type(op) is PutIfAbsent:
        raise held()
    raise AssertionError(f"unexpected op {op!r}")


def busy_then_granted(times: int) -> Callable[[Any], Any]:
    """The first ``times`` puts find the key held; the next one is granted."""
    return scripted(*[held() for _ in range(times)], entry_for)


class Driver:
    """Runs a flow to its end. ``answer(op)`` returns the op's result or raises the error
    the cache would raise; Wait ops advance the clock by their seconds and are recorded
    with the time remaining when they were issued."""

    def __init__(
        self,
        clock: FakeClock,
        answer: Callable[[Any], Any],
        *,
        write_cost: float = 0.0,
        wait_errors: Sequence[MalfunctionError] = (),
        wait_error_cost: float = 0.0,
    ) -> None:
        self.clock = clock
        self.wait_error_cost = wait_error_cost  # what a failed wait took (a socket timeout)
        self.answer = answer
        self.write_cost = write_cost
        self.wait_errors = list(wait_errors)  # raised by the first Waits, in order
        self.ops: list[Any] = []
        self.issued_at: list[float] = []

    def drive(self, flow: Any) -> Any:
        op = next(flow)
        while True:
            assert len(self.ops) < 100_000, "flow never finished"
            self.ops.append(op)
            self.issued_at.append(self.clock.t)
            if type(op) is Wait and self.wait_errors:
                self.clock.t += self.wait_error_cost
                result, error = None, self.wait_errors.pop(0)
            elif type(op) in (Wait, Pause):
                assert op.seconds > 0, f"non-positive wait {op}"
                self.clock.t += op.seconds
                result, error = None, None
            else:
                if type(op) is WaitThenPut:  # the wait runs its course, then the put
                    assert op.seconds > 0, f"non-positive wait {op}"
                    self.clock.t += op.seconds
                self.clock.t += self.write_cost
                try:
                    result, error = self.answer(op), None
                except (SimpleCacheConditionError, MalfunctionError) as exc:
                    result, error = None, exc
            try:
                op = flow.throw(error) if error is not None else flow.send(result)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]

    def waits(self) -> list[Wait]:
        return [op for op in self.ops if type(op) is Wait]


def acquire_flow(
    *,
    slot_keys: Sequence[str] = ("mutex.k",),
    timeout: float | None = 10.0,
    interval: float = 1.0,
    lease: float = 30.0,
    seed: int = 1,
    courtesy: float = 0.0,
    value: str = VALUE,
    now: FakeClock | None = None,
    hand_over: bool = False,
) -> Any:
    """An acquire flow of key "k" (our VALUE, a 30 s lease, a 10 s timeout by default)."""
    return flows.acquire(
        courtesy=courtesy,
        hand_over=hand_over,
        key="k",
        slot_keys=list(slot_keys),
        value=value,
        lease=lease,
        timeout=timeout,
        interval=interval,
        now=now or FakeClock(),
        rng=random.Random(seed),
    )


def acquire(
    answer: Callable[[Any], Any],
    *,
    write_cost: float = 0.0,
    wait_errors: Sequence[MalfunctionError] = (),
    wait_error_cost: float = 0.0,
    **options: Any,
) -> tuple[Driver, Any]:
    """Drive ``acquire_flow(**options)`` from START; the driver (its ops and clock) and the
    grant, or the SimpleMutexAcquireTimeoutError or MalfunctionError it raised."""
    clock = FakeClock()
    runner = Driver(
        clock, answer, write_cost=write_cost, wait_errors=wait_errors,
        wait_error_cost=wait_error_cost,
    )  # fmt: skip
    try:
        return runner, runner.drive(acquire_flow(now=clock, **options))
    except (SimpleMutexAcquireTimeoutError, MalfunctionError) as error:
        return runner, error


def timed_out(answer: Callable[[Any], Any] = busy, **options: Any) -> Driver:
    """Drive an acquire that must end in SimpleMutexAcquireTimeoutError; its driver."""
    driver, error = acquire(answer, **options)
    assert type(error) is SimpleMutexAcquireTimeoutError, error
    return driver


# -- grant -----------------------------------------------------------------------------


def test_free_key_is_granted_on_the_first_put():
    """A free key costs exactly one put-if-absent carrying our value and the lease."""
    driver, grant = acquire(entry_for, lease=12.5)
    assert driver.ops == [PutIfAbsent("mutex.k", VALUE, 12.5)]
    assert grant.slot == 0
    assert grant.entry == Entry(VALUE, "v7", 7, 1e9)


def test_grant_started_is_taken_before_the_winning_put():
    """Grant.started is the clock just before the winning write, not after it returned."""
    driver, grant = acquire(busy_then_granted(1), write_cost=0.25)
    winning = max(i for i, op in enumerate(driver.ops) if type(op) is PutIfAbsent)
    assert grant.started == driver.issued_at[winning]
    assert grant.started < driver.clock.t  # the write itself took time after it
    assert grant.started > START  # and it is not the start of the whole flow


def test_grant_started_precedes_the_put_even_when_resolved_by_read_back():
    """After an ambiguous put resolved by a read-back, started is still before the put."""
    answer = scripted(MalfunctionError("timed out"), Entry(VALUE, "v3", 3, 1e9))
    driver, grant = acquire(answer, write_cost=0.5)
    assert grant.started == START
    assert driver.clock.t == START + 1.0  # the put and the get each cost 0.5


# -- timeout ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout", "interval", "seed"),
    [(10.0, 1.0, 1), (2.5, 1.0, 2), (0.3, 1.0, 3), (7.0, 0.7, 4), (1.0, 0.001, 5)],
)
def test_busy_key_times_out_exactly_at_the_deadline(timeout, interval, seed):
    """Waits never overrun the time left, sum to the timeout, and a last try ends it."""
    driver, error = acquire(busy, timeout=timeout, interval=interval, seed=seed)
    assert type(error) is SimpleMutexAcquireTimeoutError
    deadline = START + timeout
    for op, at in zip(driver.ops, driver.issued_at, strict=True):
        if type(op) is Wait:
            assert op.seconds <= deadline - at + 1e-9
    assert sum(w.seconds for w in driver.waits()) == pytest.approx(timeout, abs=1e-9)
    assert driver.clock.t == pytest.approx(deadline, abs=1e-9)
    assert type(driver.ops[-1]) is PutIfAbsent  # one last try once the deadline arrived
    assert error.key == "k"
    assert "timeout" in str(error)


@pytest.mark.parametrize("slots", [1, 5])
def test_timeout_zero_tries_every_slot_once_without_waiting(slots):
    """timeout=0 makes exactly one put per slot and raises, never yielding a Wait."""
    keys = ["mutex.k"] if slots == 1 else [f"s#{i}" for i in range(slots)]
    driver = timed_out(slot_keys=keys, timeout=0)
    assert sorted(op.key for op in driver.ops) == sorted(keys)
    assert all(op == PutIfAbsent(op.key, VALUE, 30.0) for op in driver.ops)  # no Wait
    assert driver.clock.t == START


def test_timeout_none_keeps_waiting_until_the_key_frees():
    """timeout=None never gives up: it waits through hundreds of polls, then wins."""
    driver, grant = acquire(busy_then_granted(499), timeout=None)
    assert grant.slot == 0
    assert len(driver.waits()) == 499
    assert driver.clock.t - START > 200  # far past any default-looking bound


def test_wait_names_every_slot_key():
    """A Wait lists all slot keys, so a release of any permit can wake the waiter."""
    slots = ["a", "a#1", "a#2"]
    driver = timed_out(slot_keys=slots, timeout=3.0)
    assert driver.waits()
    assert all(w.keys == tuple(slots) for w in driver.waits())


# -- jitter ----------------------------------------------------------------------------


def test_poll_pause_stays_within_half_and_one_and_a_half_intervals():
    """Jittered pauses lie in [0.5, 1.5] x interval and actually spread over that range."""
    rng = random.Random(42)
    pauses = [poll_pause(2.0, rng) for _ in range(5000)]
    assert all(1.0 <= p <= 3.0 for p in pauses)
    assert min(pauses) < 1.1
    assert max(pauses) > 2.9


def test_waits_in_a_flow_are_jittered_within_bounds():
    """Without a deadline, every Wait is 0.5x..1.5x interval and they are not all equal."""
    driver, _ = acquire(busy_then_granted(200), timeout=None, interval=0.4, seed=9)
    seconds = [w.seconds for w in driver.waits()]
    assert len(seconds) == 200
    assert all(0.2 <= s <= 0.6 for s in seconds)
    assert len(set(seconds)) > 150


def test_waiters_with_different_seeds_do_not_stay_in_step():
    """Two waiters started together poll at different times (the point of jitter)."""
    first, second = (timed_out(timeout=20.0, seed=seed).waits()[:5] for seed in (1, 2))
    assert [w.seconds for w in first] != [w.seconds for w in second]


# -- semaphore slots -------------------------------------------------------------------

SLOTS = [f"s#{i}" for i in range(4)]


def rounds_of_puts(ops: list[Any]) -> list[list[str]]:
    """Split the op log into the puts made between consecutive Waits."""
    rounds: list[list[str]] = [[]]
    for op in ops:
        if type(op) is Wait:
            rounds.append([])
        else:
            rounds[-1].append(op.key)
    return [r for r in rounds if r]


def test_semaphore_tries_every_slot_once_per_round_from_a_random_start():
    """Between two Waits each slot is tried exactly once, walking cyclically from a start
    that varies across rounds and covers every slot."""
    rounds = rounds_of_puts(timed_out(slot_keys=SLOTS, timeout=200.0, seed=11).ops)
    assert len(rounds) > 10
    for keys in rounds:
        first = SLOTS.index(keys[0])
        assert keys == [SLOTS[(first + i) % 4] for i in range(4)]
    assert {keys[0] for keys in rounds} == set(SLOTS)


def test_semaphore_grants_the_first_free_slot_it_reaches():
    """With some slots busy, the grant names the free slot and its entry."""

    def answer(op: Any) -> Any:
        if op.key != "s#2":
            raise held()
        return entry_for(op, fence=40)

    for seed in range(6):
        driver, grant = acquire(answer, slot_keys=["s", "s#1", "s#2"], seed=seed)
        assert grant.slot == 2
        assert grant.entry.fence == 40
        assert driver.waits() == []


# -- ambiguous writes ------------------------------------------------------------------


def test_ambiguous_put_whose_read_back_shows_our_value_is_granted():
    """A MalfunctionError on put followed by a Get showing our value counts as granted."""
    ours = Entry(VALUE, "v5", 5, 1e9)
    driver, grant = acquire(scripted(MalfunctionError("reply lost"), ours))
    assert driver.ops == [PutIfAbsent("mutex.k", VALUE, 30.0), Get("mutex.k")]
    assert grant.entry == ours
    assert grant.slot == 0


@pytest.mark.parametrize("seen", [Entry(OTHER, "v9", 9, 1e9), None])
def test_ambiguous_put_whose_read_back_shows_another_value_reraises(seen):
    """A Get showing someone else's value (or nothing) re-raises the original fault."""
    fault = MalfunctionError("reply lost")
    driver, error = acquire(scripted(fault, seen))
    assert error is fault
    assert [type(op) for op in driver.ops] == [PutIfAbsent, Get]


def test_ambiguous_put_on_a_semaphore_reads_back_the_same_slot():
    """The read-back targets the slot whose put failed ambiguously."""
    slots = ["s", "s#1", "s#2"]
    answer = scripted(MalfunctionError("reply lost"), Entry(VALUE, "v1", 1, 1e9))
    driver, grant = acquire(answer, slot_keys=slots, seed=5)
    put, get = driver.ops
    assert get == Get(put.key)
    assert slots[grant.slot] == put.key


# -- courtesy and a failed wait ------------------------------------------------------------


def test_courtesy_pauses_before_the_first_put():
    """A holder that just woke a waiter pauses before asking again, so the waiter wins."""
    driver, _ = acquire(entry_for, courtesy=0.004)
    assert [type(op) for op in driver.ops] == [Pause, PutIfAbsent]
    assert driver.ops[0].seconds == pytest.approx(0.004)


def test_courtesy_never_outlasts_the_timeout_and_try_once_skips_it():
    """The pause is capped by the wait timeout, and timeout=0 (try once) never pauses."""
    capped, _ = acquire(entry_for, courtesy=0.004, timeout=0.001)
    assert capped.ops[0] == Pause(0.001)
    once, _ = acquire(entry_for, courtesy=0.004, timeout=0)
    assert [type(op) for op in once.ops] == [PutIfAbsent]


# -- a fused wait (a cache with wait_then_put) ------------------------------------------


def fault(*, unsent: bool = False) -> MalfunctionError:
    return MalfunctionError("redis cache failed during wait_then_put", unsent=unsent)


def test_a_fused_wait_follows_a_failed_put_and_never_sends_the_put_again():
    """One plain put; then each try is a fused wait whose put the cache runs itself (a
    plain put after it would double a waiter's requests). The lease runs from before the
    fused wait that won, not from its end: the cache's own start is later still."""
    answer = scripted(held(), held(), held(), entry_for)
    driver, grant = acquire(answer, hand_over=True)
    assert [type(op) for op in driver.ops] == [PutIfAbsent, WaitThenPut, WaitThenPut, WaitThenPut]
    last = driver.ops[-1]
    assert (last.keys, last.key, last.value, last.ttl) == (("mutex.k",), "mutex.k", VALUE, 30.0)
    assert grant.started == driver.issued_at[-1] < driver.clock.t
    assert grant.entry.value == VALUE


def test_a_fused_wait_blocks_for_a_quarter_of_the_lease_at_most():
    """A lease of 2 s and a 5 s poll: each fused wait blocks 0.5 s at most, so a grant
    at the end of one still leaves the holder three quarters of its lease."""
    driver = timed_out(scripted(*[held()] * 200), hand_over=True, lease=2.0, interval=5.0)
    fused = [op for op in driver.ops if type(op) is WaitThenPut]
    assert fused
    assert max(op.seconds for op in fused) <= timing.hand_over_block(2.0) == 0.5


def test_fused_waits_keep_the_deadline():
    """All held: the fused waits add up to the timeout, and the acquire times out."""
    driver = timed_out(scripted(*[held()] * 200), hand_over=True, timeout=3.0)
    assert driver.clock.t - START == pytest.approx(3.0)


def test_a_fused_wait_needs_no_courtesy_and_a_semaphore_never_fuses():
    """The waiter a release woke already holds the key, so the releaser asks at once;
    several slots wait the plain way (a fused put names one slot)."""
    driver, _ = acquire(entry_for, courtesy=0.004, hand_over=True)
    assert [type(op) for op in driver.ops] == [PutIfAbsent]
    semaphore, _ = acquire(
        scripted(held(), held(), entry_for), slot_keys=("s#0", "s#1"), hand_over=True
    )
    assert [type(op) for op in semaphore.ops] == [PutIfAbsent, PutIfAbsent, Wait, PutIfAbsent]


def test_a_fused_fault_whose_put_landed_is_our_grant():
    """The reply was lost but the put landed: one read finds our value, and that is the
    grant (from before the fused wait)."""
    driver, grant = acquire(scripted(held(), fault(), OURS), hand_over=True)
    assert [type(op) for op in driver.ops] == [PutIfAbsent, WaitThenPut, Get]
    assert grant.entry == OURS
    assert grant.started == driver.issued_at[1]


@pytest.mark.parametrize("unsent", [False, True], ids=["sent", "unsent"])
def test_a_fused_fault_falls_back_to_a_plain_wait_once(unsent):
    """A fused wait that failed, its put not ours (or never sent: no read): a plain put
    and a plain wait, which tell a broken wake-up channel from a server that is gone;
    once a plain wait works, fused waits again."""
    answers = [held(), fault(unsent=unsent), *([] if unsent else [None]), held(), held(),
               entry_for]  # fmt: skip
    driver, grant = acquire(scripted(*answers), hand_over=True)
    kinds = [type(op) for op in driver.ops]
    assert kinds == [PutIfAbsent, WaitThenPut, *([] if unsent else [Get]), PutIfAbsent, Wait,
                     PutIfAbsent, WaitThenPut]  # fmt: skip
    assert grant.entry.value == VALUE


# -- faults while waiting: ridden out once the cache has answered -------------------------


def down(op: Any) -> Any:
    """Every op faults: the server is gone (a put and its read-back alike)."""
    raise MalfunctionError(f"etcd cache failed during {type(op).__name__}")


def held_then_down() -> Callable[[Any], Any]:
    """The first put finds the key held; from then on the server is gone."""
    answered: list[bool] = []

    def answer(op: Any) -> Any:
        if not answered:
            answered.append(True)
            raise held()
        return down(op)

    return answer


def test_a_fault_before_the_cache_ever_answered_is_raised_at_once():
    """Nothing known about the server yet: a down or misconfigured one is reported, not
    waited out."""
    driver, error = acquire(down)
    assert isinstance(error, MalfunctionError)
    assert [type(op) for op in driver.ops] == [PutIfAbsent, Get]  # no pause, no wait


def test_a_waiter_rides_out_faults_and_is_granted_once_the_cache_is_back():
    """An election while waiting: the put and its read-back fault, the waiter pauses at
    its poll interval and puts again, and the grant comes within the timeout."""
    answers = [held(), fault(), fault(), fault(), None, entry_for]
    driver, grant = acquire(scripted(*answers), timeout=40)
    assert grant.entry.value == VALUE
    kinds = [type(op) for op in driver.ops]
    assert kinds == [PutIfAbsent, Wait, PutIfAbsent, Get, Pause, PutIfAbsent, Get, Pause,
                     PutIfAbsent]  # fmt: skip


def test_a_fused_waiter_rides_out_a_fault_its_read_back_meets_too():
    """Redis's fused wait and put fails (a reset) and so does the read that settles it:
    answered already, the waiter pauses and tries again, as a plain one does."""
    answers = [held(), fault(), fault(), fault(), None, entry_for]
    driver, grant = acquire(scripted(*answers), hand_over=True, timeout=40)
    assert grant.entry.value == VALUE
    kinds = [type(op) for op in driver.ops]
    assert kinds[:5] == [PutIfAbsent, WaitThenPut, Get, Pause, PutIfAbsent]


def test_faults_that_outlast_the_timeout_raise_the_fault_not_a_busy_timeout():
    """The server stays gone: the waiter tries until its deadline and then says why."""
    driver, error = acquire(held_then_down(), timeout=5)
    assert isinstance(error, MalfunctionError)
    assert driver.clock.t == driver.issued_at[0] + 5  # the last pause ends at the deadline


def test_without_a_timeout_faults_are_ridden_out_for_a_bounded_time():
    """No deadline: faults in a row end the wait after FAULT_RIDE_OUT, not never."""
    driver, error = acquire(held_then_down(), timeout=None)
    assert isinstance(error, MalfunctionError)
    faulty = driver.clock.t - driver.issued_at[2]  # from the first fault
    assert timing.FAULT_RIDE_OUT <= faulty < timing.FAULT_RIDE_OUT + 1.5


def test_a_busy_answer_between_faults_starts_the_ride_out_afresh():
    """FAULT_RIDE_OUT counts faults in a row: an answer in between resets it."""
    blips = [fault(), fault()] * 20  # 20 s of faults (put and read-back), then an answer
    clock_faults = [held(), *blips, held(), *blips, entry_for]
    driver, grant = acquire(scripted(*clock_faults), timeout=None, interval=1.0, seed=3)
    assert grant.entry.value == VALUE
    assert driver.clock.t > timing.FAULT_RIDE_OUT


def test_a_withheld_write_is_never_ridden_out():
    """The server took the put but it must not count (too few replicas): raised, so the
    caller withdraws it, never retried as if nothing landed."""
    withheld = MalfunctionError("too few replicas", withheld=True)
    driver, error = acquire(scripted(held(), withheld))
    assert error is withheld
    assert Pause not in [type(op) for op in driver.ops]


@pytest.mark.parametrize("hand_over", [False, True], ids=["plain", "fused"])
def test_a_lasting_refusal_while_waiting_is_raised_at_once(hand_over):
    """Permission denied, or a malformed record, after the cache said the key is held:
    waiting does not mend it, so it is raised at once, not ridden out to the deadline."""
    denied = MalfunctionError("redis cache failed during put_if_absent: NOPERM", lasting=True)
    driver, error = acquire(scripted(held(), denied), hand_over=hand_over, timeout=40)
    assert error is denied
    assert Get not in [type(op) for op in driver.ops]  # a refused put is not read back
    assert Pause not in [type(op) for op in driver.ops]
    assert driver.clock.t - driver.issued_at[0] < 1.5  # one poll, not 40 s


def test_a_lasting_refusal_met_after_transient_faults_ends_the_ride_out():
    """Riding out an election, the waiter meets a refusal (its rights were revoked
    meanwhile): that one is raised at once, though time is left."""
    denied = MalfunctionError("etcd cache failed during get: Forbidden", lasting=True)
    driver, error = acquire(scripted(held(), fault(), fault(), fault(), denied), timeout=40)
    assert error is denied
    assert driver.clock.t - driver.issued_at[0] < 5


def test_the_lasting_mark_survives_pickling():
    """Celery and RQ pickle the error to report it: it still says it was lasting."""
    import pickle

    error = pickle.loads(pickle.dumps(MalfunctionError("no rights", key="k", lasting=True)))
    assert error.lasting
    assert error.key == "k"


# -- renew, release, take-over, release-where, abandon: the same unclear-outcome rule -----


def drive(flow: Any, *answers: Any) -> tuple[Any, list[Any]]:
    driver = Driver(FakeClock(), scripted(*answers))
    return driver.drive(flow), driver.ops


def miss() -> SimpleCacheConditionError:
    return SimpleCacheConditionError("version miss")


def renewal(version: str = "v1", length: float = 9.0) -> Any:
    return flows.renew("mutex.k", VALUE, version, length, FakeClock())


def test_renew_is_one_compare_and_set_on_our_version():
    """A renewal is one compare-and-set carrying our value, the new length and version."""
    renewed, ops = drive(renewal(), OURS)
    assert renewed.entry == OURS
    assert ops == [CompareAndSet("mutex.k", VALUE, 9.0, "v1")]


@pytest.mark.parametrize(
    "seen",
    [THEIRS, None, Entry(VALUE, "v1", 7, 1e9)],
    ids=["another-owner", "gone", "ours-but-not-renewed"],
)
def test_a_renewal_miss_on_a_record_that_is_not_ours_now_is_a_loss(seen):
    """After a version miss, one read: another owner's record, none, or ours still at the
    version we sent (the cache's clock expired it) is a lost lease."""
    renewed, ops = drive(renewal(), miss(), seen)
    assert renewed is None
    assert ops[1] == Get("mutex.k")


def test_a_renewal_miss_on_our_record_writes_again_from_the_version_read():
    """Our value at another version: a write of ours landed unseen (a lost reply, a
    driver's retry, a second renewal of the same lease), whose start and length are not
    ours to know. It is never taken as this renewal's (DESIGN §4 rule 15): one more
    compare-and-set from the version read, and that write sets the deadline."""
    landed = Entry(VALUE, "v3", 7, 1e9)
    renewed, ops = drive(renewal(), miss(), OURS, landed)
    assert renewed.entry == landed
    assert ops == [
        CompareAndSet("mutex.k", VALUE, 9.0, "v1"),
        Get("mutex.k"),
        CompareAndSet("mutex.k", VALUE, 9.0, "v2"),
    ]


def test_a_renewal_whose_record_keeps_changing_under_it_is_a_fault():
    """Bounded: a record that moves under every write (another process with our token)
    ends as a MalfunctionError, never a loop."""
    answers = []
    for n in range(flows.RENEW_WRITES):
        answers += [miss(), Entry(VALUE, f"w{n}", 7, 1e9)]
    with pytest.raises(MalfunctionError, match="changed under each"):
        drive(renewal(), *answers)


def test_release_is_one_compare_and_delete_and_reports_a_woken_waiter():
    """A release is one compare-and-delete on our version; the cache's wake-up is kept."""
    outcome, ops = drive(flows.release("mutex.k", VALUE, "v1", OURS.fence), True)
    assert outcome == Released(freed=True, woke=True)
    assert ops == [CompareAndDelete("mutex.k", "v1")]


def test_a_release_miss_frees_our_record_at_the_version_it_reads():
    """A renewal whose reply was lost moved our version: the read finds it, and the
    second delete uses it."""
    outcome, ops = drive(flows.release("mutex.k", VALUE, "v1", OURS.fence), miss(), OURS, False)
    assert outcome == Released(freed=True, woke=False)
    assert ops == [
        CompareAndDelete("mutex.k", "v1"),
        Get("mutex.k"),
        CompareAndDelete("mutex.k", "v2"),
    ]


@pytest.mark.parametrize("seen", [THEIRS, None])
def test_a_release_never_frees_another_holders_record(seen):
    """When the read shows someone else (or nothing), nothing more is written."""
    outcome, ops = drive(flows.release("mutex.k", VALUE, "v1", OURS.fence), miss(), seen)
    assert outcome == Released(freed=False, woke=False)
    assert [type(op) for op in ops] == [CompareAndDelete, Get]


def test_a_release_fault_that_was_never_sent_propagates_for_the_lease_to_decide():
    """A delete that provably never left is not a verdict: it goes up unchanged (the
    lease may retry), with nothing read."""
    fault = MalfunctionError("refused", unsent=True)
    with pytest.raises(MalfunctionError) as info:
        drive(flows.release("mutex.k", VALUE, "v1", OURS.fence), fault)
    assert info.value is fault


@pytest.mark.parametrize("seen", [None, THEIRS])
def test_a_release_fault_whose_delete_landed_is_settled_by_one_read(seen):
    """The reply was lost and the delete had landed: the read finds no record of ours
    (none, or the waiter's the release woke), which is freed. The lease judges by its
    own clock whether the record could have lapsed first; another holder's record is
    never written."""
    outcome, ops = drive(
        flows.release("mutex.k", VALUE, "v1", OURS.fence), MalfunctionError("x"), seen
    )
    assert outcome == Released(freed=True, woke=False)
    assert ops == [CompareAndDelete("mutex.k", "v1"), Get("mutex.k")]


def test_a_release_fault_on_a_record_taken_over_under_our_fence_is_not_freed():
    """The read after the fault finds another holder under our own fence: a take-over
    (on_busy="replace") moved our record, which therefore was still there when our
    delete was sent. Not freed by us: the lease reports the loss."""
    replacer = Entry(OTHER, "v9", OURS.fence, 1e9)
    flow = flows.release("mutex.k", VALUE, "v1", OURS.fence)
    outcome, ops = drive(flow, MalfunctionError("x"), replacer)
    assert outcome == Released(freed=False, woke=False)
    assert ops == [CompareAndDelete("mutex.k", "v1"), Get("mutex.k")]


def test_a_release_fault_whose_delete_was_lost_deletes_again():
    """The delete never arrived: the read finds our record, freed at the version read."""
    flow = flows.release("mutex.k", VALUE, "v1", OURS.fence)
    outcome, ops = drive(flow, MalfunctionError("x"), OURS, True)
    assert outcome == Released(freed=True, woke=True)
    assert ops == [
        CompareAndDelete("mutex.k", "v1"),
        Get("mutex.k"),
        CompareAndDelete("mutex.k", "v2"),
    ]


def test_a_release_fault_the_read_cannot_settle_goes_up_unchanged():
    """The read fails too: the first fault goes up, not a verdict."""
    fault = MalfunctionError("x")
    with pytest.raises(MalfunctionError) as info:
        drive(flows.release("mutex.k", VALUE, "v1", OURS.fence), fault, MalfunctionError("y"))
    assert info.value is fault


def owned_by_theirs(entry: Entry) -> bool:
    return entry.value == OTHER


def test_take_over_swaps_only_an_accepted_record_and_keeps_its_fence():
    """Slot 0 belongs to someone else, slot 1 is accepted: compare-and-set on slot 1."""
    flow = flows.take_over(["s", "s#1"], VALUE, 30.0, owned_by_theirs, FakeClock())
    grant, ops = drive(flow, OURS, THEIRS, Entry(VALUE, "v10", 8, 1e9))
    assert grant.slot == 1
    assert grant.entry.fence == THEIRS.fence
    assert ops == [Get("s"), Get("s#1"), CompareAndSet("s#1", VALUE, 30.0, "v9")]


def test_take_over_finds_nothing_when_no_record_is_accepted():
    """No accepted holder: None, and nothing written."""
    flow = flows.take_over(["s"], VALUE, 30.0, owned_by_theirs, FakeClock())
    grant, ops = drive(flow, OURS)
    assert grant is None
    assert ops == [Get("s")]


def test_release_where_frees_accepted_records_on_the_version_read():
    """Each accepted record is deleted on the version read; a changed one is skipped."""
    flow = flows.release_where(["s", "s#1", "s#2"], owned_by_theirs)
    freed, ops = drive(flow, THEIRS, True, None, THEIRS, miss())
    assert freed == 1
    assert ops == [
        Get("s"),
        CompareAndDelete("s", "v9"),
        Get("s#1"),
        Get("s#2"),
        CompareAndDelete("s#2", "v9"),
    ]


def test_free_for_moves_the_record_aside_then_deletes_it():
    """An operator's release: first to the releaser's own record (a version of its own),
    then deleted there, so a cache's trace names a version the holder never had."""
    aside = Entry("ASIDE", "v20", 9, 1e9)
    freed, ops = drive(flows.free_for("s", "v9", "ASIDE"), aside, True)
    assert freed is True
    assert ops == [
        CompareAndSet("s", "ASIDE", flows.FREEING_LEASE, "v9"),
        CompareAndDelete("s", "v20"),
    ]
    changed, _ = drive(flows.free_for("s", "v9", "ASIDE"), miss())
    assert changed is False


def test_evict_moves_each_accepted_record_aside_before_deleting_it():
    """A replaced holder may still run: each accepted record is freed as free_for frees
    (its own release must miss, not find its version freed); a changed one is skipped."""
    aside = Entry("ASIDE", "v20", 9, 1e9)
    flow = flows.evict(["s", "s#1", "s#2"], owned_by_theirs, "ASIDE")
    freed, ops = drive(flow, THEIRS, aside, True, None, THEIRS, miss())
    assert freed == 1
    assert ops == [
        Get("s"),
        CompareAndSet("s", "ASIDE", flows.FREEING_LEASE, "v9"),
        CompareAndDelete("s", "v20"),
        Get("s#1"),
        Get("s#2"),
        CompareAndSet("s#2", "ASIDE", flows.FREEING_LEASE, "v9"),
    ]


def test_abandon_frees_only_slots_holding_our_value_and_swallows_faults():
    """An interrupted acquire frees what it may have written, best effort."""
    flow = flows.abandon(["s", "s#1", "s#2"], VALUE)
    result, ops = drive(flow, MalfunctionError("down"), THEIRS, OURS, True)
    assert result is None
    assert ops == [Get("s"), Get("s#1"), Get("s#2"), CompareAndDelete("s#2", "v2")]


def test_read_returns_each_slots_entry():
    """holders() reads every slot once."""
    entries, ops = drive(flows.read(["s", "s#1"]), OURS, None)
    assert entries == [OURS, None]
    assert ops == [Get("s"), Get("s#1")]


# -- the blocking and asyncio drivers against a real cache -----------------------------


@pytest.mark.parametrize("driver", ["blocking", "asyncio"])
def test_a_driver_grants_a_free_key_and_times_out_on_a_held_one(driver):
    """run() and run_async() write the record into the cache; a second acquire with
    timeout=0 is refused and leaves it as it was."""
    cache = InMemoryCache()
    drive = run if driver == "blocking" else lambda c, f: asyncio.run(run_async(c, f))
    grant = drive(cache, acquire_flow(timeout=0))
    assert cache.get("mutex.k") == grant.entry
    assert grant.entry.value == VALUE
    with pytest.raises(SimpleMutexAcquireTimeoutError):
        drive(cache, acquire_flow(timeout=0, value=OTHER))
    assert cache.get("mutex.k") == grant.entry


def test_run_executes_waits_and_retries_after_a_release():
    """run() passes Wait ops to the cache and tries again; a release during the wait wins."""

    class ReleasingCache(InMemoryCache):
        def __init__(self) -> None:
            super().__init__()
            self.waits: list[tuple[tuple[str, ...], float]] = []
            self.blocker = self.put_if_absent("mutex.k", OTHER, ttl=60)

        def wait(self, keys: Sequence[str], timeout: float) -> None:
            self.waits.append((tuple(keys), timeout))
            self.compare_and_delete("mutex.k", version=self.blocker.version)

    cache = ReleasingCache()
    grant = run(cache, acquire_flow(timeout=None))
    assert len(cache.waits) == 1
    assert cache.waits[0][0] == ("mutex.k",)
    assert grant.entry.value == VALUE
    assert grant.entry.fence > cache.blocker.fence


class BrokenCache(InMemoryCache):
    """A cache whose driver leaks raw OSErrors (a backend that forgot to map them)."""

    name = "brokencache"
    driver_errors = (OSError,)

    def get(self, key: str) -> Entry | None:
        raise OSError("disk on fire")

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        raise OSError("connection reset")


def test_execute_maps_a_stray_driver_error_to_malfunction_naming_cache_and_operation():
    """An OSError from a cache's get becomes a MalfunctionError naming cache and op."""
    with pytest.raises(MalfunctionError) as info:
        execute(BrokenCache(), Get("mutex.k"))
    message = str(info.value)
    assert "brokencache" in message
    assert "Get" in message
    assert "mutex.k" in message
    assert isinstance(info.value.__cause__, OSError)


class InterruptedCache(InMemoryCache):
    """A cache whose wait is cut short by a signal handler's exception."""

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        raise Alarm("the job's time is up")


def test_an_exception_that_is_not_the_drivers_reaches_the_caller_unchanged():
    """Only a cache's ``driver_errors`` are backend faults: an exception a signal
    handler raised while the acquire waited leaves at once, as itself, instead of being
    taken for a fault to wait out (after which the body ran anyway)."""
    cache = InterruptedCache()
    mutex = Mutex(cache)
    held = mutex.acquire("k")
    started = time.monotonic()
    with pytest.raises(Alarm):
        mutex.acquire("k", timeout=5)
    assert time.monotonic() - started < 2
    with pytest.raises(Alarm):
        execute(cache, Wait(("mutex.k",), 1.0))
    held.release()
    assert not mutex.locked("k")


def test_execute_passes_condition_errors_through_unwrapped():
    """A cache's own SimpleCacheConditionError is not turned into a malfunction."""
    cache = InMemoryCache()
    with pytest.raises(SimpleCacheConditionError):
        execute(cache, CompareAndDelete("absent", "v1"))
    with pytest.raises(SimpleCacheConditionError):
        execute(cache, CompareAndSet("absent", VALUE, 1.0, "v1"))


@pytest.mark.parametrize(("driver", "timeout"), [("blocking", None), ("asyncio", 0)])
def test_a_broken_cache_is_a_malfunction_with_the_key_from_either_driver(driver, timeout):
    """A put that leaks OSError (then a read-back that does too) ends in MalfunctionError,
    never the OSError, naming the cache and carrying the key, blocking or asyncio."""
    mutex = Mutex(BrokenCache())
    call = {
        "blocking": lambda: mutex.acquire("order.7", timeout=timeout),
        "asyncio": lambda: asyncio.run(mutex.acquire_async("order.7", timeout=timeout)),
    }[driver]
    with pytest.raises(MalfunctionError) as info:
        call()
    assert not isinstance(info.value, OSError)
    assert info.value.key == "order.7"
    assert "brokencache" in str(info.value)


class _WakingCache(InMemoryCache):
    """Says every release woke a waiter, as Redis does when one was blocked."""

    def compare_and_delete(self, key, *, version):
        super().compare_and_delete(key, version=version)
        return True


def test_a_release_that_woke_a_waiter_makes_the_next_acquire_hold_back(monkeypatch):
    """After a release that woke someone, the same Mutex's next acquire of that key
    pauses first; a release that woke nobody leaves the next acquire immediate."""
    pauses: list[float] = []
    clock = types.SimpleNamespace(  # the blocking driver sleeps a Pause through its `time`
        sleep=lambda seconds: (pauses.append(seconds), time.sleep(seconds)),
        monotonic=time.monotonic,
    )
    monkeypatch.setattr(drivers, "time", clock)
    woken = Mutex(_WakingCache(), lease=30)
    woken.acquire("k").release()
    woken.acquire("k").release()
    assert len(pauses) == 1
    assert 0 < pauses[0] <= timing.HANDOFF_COURTESY
    quiet = Mutex(InMemoryCache(), lease=30)
    quiet.acquire("k").release()
    quiet.acquire("k").release()
    assert len(pauses) == 1


def test_a_failed_wait_retries_at_once_then_falls_back_to_pauses():
    """A broken notification channel costs the acquire nothing: the first failure puts
    again at once (is the server gone?), a second one in a row polls with a plain pause."""
    gone = [MalfunctionError("listener gone"), MalfunctionError("still gone")]
    driver, _ = acquire(busy_then_granted(2), timeout=None, wait_errors=gone)
    kinds = [type(op) for op in driver.ops]
    assert kinds == [PutIfAbsent, Wait, PutIfAbsent, Wait, Pause, PutIfAbsent]
    assert driver.ops[4].seconds == driver.ops[3].seconds


@pytest.mark.parametrize("timeout", [1.0, 1.1, 1.25, 1.4])
def test_a_wait_that_fails_past_the_deadline_ends_the_acquire_at_once(timeout):
    """A frozen server: each failed wait costs a 0.3 s socket timeout. No poll pause runs
    past the deadline, and a wait that failed past it is the acquire's last operation
    (it raises that fault: one more put would cost another socket timeout), so the
    acquire takes at most its timeout plus one socket timeout."""
    frozen = [MalfunctionError("frozen") for _ in range(20)]
    driver, error = acquire(busy, timeout=timeout, wait_errors=frozen, wait_error_cost=0.3)
    deadline = START + timeout
    assert isinstance(error, SimpleMutexAcquireTimeoutError | MalfunctionError)
    assert driver.clock.t <= deadline + 0.3
    for n, (op, at) in enumerate(zip(driver.ops, driver.issued_at, strict=True)):
        if type(op) is Pause:
            assert at + op.seconds <= deadline
        if type(op) is Wait and at + 0.3 >= deadline:
            assert n == len(driver.ops) - 1, driver.ops[n:]
            assert str(error) == "frozen"


class AnswersNonsense(InMemoryCache):
    """A backend that breaks the contract: ``put_if_absent`` returns None without writing
    (the seed's test), ``get`` a plain string."""

    name = "nonsense"

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return None  # type: ignore[return-value]

    def get(self, key: str) -> Entry | None:
        return "held"  # type: ignore[return-value]


def test_a_cache_answering_outside_the_contract_is_a_malfunction_naming_it():
    """try_acquire and holder() on such a backend raise MalfunctionError naming the cache,
    the operation and what it returned, never a bare AttributeError from deeper in."""
    mutex = Mutex(AnswersNonsense())
    with pytest.raises(
        MalfunctionError, match=r"nonsense cache broke the cache contract.*PutIfAbsent.*None"
    ):
        mutex.try_acquire("k")
    with pytest.raises(MalfunctionError, match=r"nonsense cache broke the cache contract.*Get"):
        mutex.holder("k")
