"""The options Celery and RQ share, and what they decide when a key is busy.

``on_busy``: ``skip`` (finish without running), ``retry`` (run again later), ``wait``
(block until free), ``raise``, or ``queue`` (park the call in the key's line and run it
in its turn, in send order: ``docs/design/queue.md``; ``queue={...}`` bounds the line),
``latest`` (the line keeps one parked call per key besides the running one: a newer call
takes its place), ``debounce`` (one parked call per key, run ``period`` after the calls
stopped, at most ``max_delay`` after the first of them: ``debounce={...}``), or
``replace`` (the newest call takes the key from the running holder, with a larger fence,
and has it stopped: ``simple_mutex.busy.replace``);
``timeout`` bounds the wait before ``on_busy`` applies (``wait``: None = forever; the
others: one try). A busy retry runs again after
``countdown * backoff**n`` seconds, capped at ``cap``, jittered to [0.5, 1.5) of that when
``jitter``, at most ``max`` times (None: until the lock is free).

Synchronous execution (Celery ``apply()`` or ``task_always_eager``, RQ
``Queue(is_async=False)``) has no queue to retry through, so there a busy ``retry`` waits
instead: as long as its retries would have tried (the sum of their delays up to ``max``),
never more than one ``lease`` (a holder that still has the key after a lease is renewing,
or is the caller itself one call up), or exactly ``timeout`` when that is set. If the key
is still busy then, the call fails with ``SimpleMutexAcquireTimeoutError``. ``skip``,
``wait`` and ``raise`` behave the same in a worker and synchronously; a synchronous
``queue`` has no line to park in and waits, as ``wait`` does, and so does a synchronous
``replace`` (it has no worker to stop the holder through).

The policies are a closed type (``OnBusy``) and what a busy key leads to is another
(``Busy``: ``Skip`` or ``RunAgain``, or the busy error raised): each consumer matches
them exhaustively, so adding a policy makes mypy name every place that must handle it.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeAlias, get_args

from simple_mutex import Mutex, Semaphore, SimpleMutexAcquireTimeoutError
from simple_mutex._core.durations import positive_seconds, timeout_seconds
from simple_mutex.errors import ConstraintTypeError, ConstraintValueError, bad_input

OnBusy: TypeAlias = Literal[
    "skip", "retry", "wait", "raise", "queue", "latest", "debounce", "replace"
]
ON_BUSY: tuple[OnBusy, ...] = get_args(OnBusy)
IN_LINE: frozenset[OnBusy] = frozenset({"queue", "latest", "debounce"})
"""The policies that park a call in its key's line (``simple_mutex.busy.line``)."""


@dataclass(frozen=True)
class Skip:
    """Finish without running: the call returns the skip marker."""


@dataclass(frozen=True)
class RunAgain:
    """Run the call again after ``delay`` seconds, through the queue (a busy retry)."""

    delay: float


Busy: TypeAlias = Skip | RunAgain
"""What a key that stayed busy leads to, when it does not raise."""


def unreachable(value: NoReturn) -> NoReturn:
    """The last case of an exhaustive ``match`` (``typing.assert_never`` from 3.11 on):
    mypy rejects a call whose argument can still be a value, i.e. a case left out."""
    raise AssertionError(f"simple_mutex.busy: no case for {value!r}")


@dataclass(frozen=True)
class RetryPolicy:
    """When a busy task or job runs again; ``retry={...}`` merged over these defaults."""

    countdown: float = 1.0
    backoff: float = 2.0
    jitter: bool = True
    cap: float = 60.0
    max: int | None = None

    def delay(self, busy_retries: int, unit: float | None = None) -> float:
        """Seconds before busy retry number ``busy_retries + 1``; ``unit`` in [0, 1) is
        the jitter draw (random by default; the global ``random`` reseeds after fork)."""
        base = min(self.cap, self.countdown * self.backoff ** min(busy_retries, 64))
        if not self.jitter:
            return base
        return base * (0.5 + (random.random() if unit is None else unit))

    def next_delay(self, busy_retries: int, busy: SimpleMutexAcquireTimeoutError) -> float:
        """The delay of the next busy retry; raises once ``max`` retries were used."""
        if self.max is not None and busy_retries >= self.max:
            raise SimpleMutexAcquireTimeoutError(
                f"{busy.key!r} was still busy after {busy_retries} busy retries "
                f"(retry max={self.max})",
                key=busy.key,
            ) from busy
        return self.delay(busy_retries)

    def budget(self) -> float:
        """Seconds all the retries would wait in sum, without jitter (inf for max=None)."""
        if self.max is None:
            return float("inf")
        # Past 64 retries every delay equals the 64th: no need to count them one by one.
        head = sum(self.delay(n, 0.5) for n in range(min(self.max, 64)))
        return head + max(0, self.max - 64) * self.delay(64, 0.5)


OnFull: TypeAlias = Literal["raise", "skip"]
ON_FULL: tuple[OnFull, ...] = get_args(OnFull)


@dataclass(frozen=True)
class QueuePolicy:
    """The line of ``on_busy="queue"``; ``queue={...}`` merged over these defaults.

    ``max``: tickets a key's line may hold at once (waiting or running; None: no
    bound); a send beyond it raises ``LineFullError`` (``on_full="raise"``) or is not
    sent and answers the skip marker (``"skip"``). ``park_for``: how long a parked call
    may wait for its turn before it is dropped (and the line's record lives after its
    last write). ``gap_for``: how long the line waits for a ticket that was sent but
    never arrived (a lost message; a holder whose worker died, when its broker would
    redeliver it) before it steps over it; such a call, if it comes later, runs out of
    order, said so. ``sweep_every``: how often each worker sweeps the lines (publishes a
    head nobody ran, ends a dead holder's turn, steps over gaps)."""

    max: int | None = None
    on_full: OnFull = "raise"
    park_for: float = 86_400.0
    gap_for: float = 120.0
    sweep_every: float = 5.0

    @property
    def promote_grace(self) -> float:
        """How long a promoted head may take to start before a sweep publishes it again
        (a crash between a release and its publish): a copy too many is a duplicate, and
        runs once. Each later publish waits twice as long as the one before, up to ten
        minutes (``line.decisions.resend_after``): a backlog is not filled with copies."""
        return min(30.0, self.gap_for)


def most_patient(policies: Iterable[QueuePolicy]) -> QueuePolicy | None:
    """The bounds a sweep applies to a line whose calls come from several task or job
    functions: the longest ``gap_for`` (and so ``promote_grace``) and ``park_for`` of
    ``policies`` (the other fields the first's), so no function's call is stepped over
    or dropped sooner than its own options allow; None when there are none."""
    found = list(policies)
    if not found:
        return None
    return dataclasses.replace(
        found[0],
        gap_for=max(p.gap_for for p in found),
        park_for=max(p.park_for for p in found),
    )


@dataclass(frozen=True)
class DebouncePolicy:
    """``on_busy="debounce"``'s ``debounce={"period": s, "max_delay": s}``: a key's call
    runs ``period`` after its last call (each newer one takes the parked one's place and
    pushes the run back), but never later than ``max_delay`` after the first call of
    the burst. Both are required with ``on_busy="debounce"``; ``max_delay`` >= ``period``."""

    period: float | None = None
    max_delay: float | None = None


@dataclass(frozen=True)
class BusyPolicy:
    """The shared options of one task or job function, checked."""

    on_busy: OnBusy = "retry"
    timeout: float | None = None
    retry: RetryPolicy = RetryPolicy()
    lease: float = 60.0  # short, renewed: a killed worker's lock frees within a minute
    renew: bool = True
    permits: int = 1
    queue: QueuePolicy = QueuePolicy()
    debounce: DebouncePolicy = DebouncePolicy()

    @property
    def in_line(self) -> bool:
        """Whether a worker's call goes through its key's line (queue, latest, debounce)."""
        return self.on_busy in IN_LINE

    @classmethod
    def from_options(cls, where: str, options: Mapping[str, Any]) -> BusyPolicy:
        """The shared options found in ``options`` (checked), defaults for the rest."""
        policy = cls(**{n: check_option(where, n, v) for n, v in options.items() if n in SHARED})
        if policy.in_line and policy.permits != 1:
            raise ConstraintValueError(
                f"{where}: on_busy={policy.on_busy!r} runs one call of a key at a time, in "
                f"order; permits={policy.permits} would run several: drop permits, or choose "
                "another on_busy"
            )
        if policy.on_busy == "debounce":
            _check_debounce(where, policy)
        if policy.on_busy == "replace":
            policy.check_replace(where)
        return policy

    def check_replace(self, where: str) -> None:
        """Refuse what ``on_busy="replace"`` cannot honour (at definition, and for a
        per-call ``on_busy="replace"`` once the task's options are known)."""
        if self.permits != 1:
            raise ConstraintValueError(
                f"{where}: on_busy='replace' stops the one running holder of a key; with "
                f"permits={self.permits} there is no single holder to replace: drop "
                "permits, or choose another on_busy"
            )
        if not self.renew:
            raise ConstraintValueError(
                f"{where}: on_busy='replace' with renew=False: a holder the stop cannot "
                "reach (its worker gone or unreachable) learns it lost the key only at a "
                "renewal, and a fixed lease has none; drop renew=False"
            )
        if self.timeout is not None:
            raise ConstraintValueError(
                f"{where}: on_busy='replace' never waits for the holder (it takes the key "
                "from it), so timeout has no meaning there: drop timeout, or use "
                "on_busy='wait' with a timeout"
            )

    def wait_for(self, synchronous: bool) -> float | None:
        """How long an acquire waits before the key counts as busy (None: forever)."""
        if self.timeout is not None:
            return self.timeout
        match self.on_busy:
            case "wait":
                return None
            case "queue" | "latest" | "debounce" | "replace":
                # A worker's call consults its line and takes the lock only when its turn
                # came and the lock is free, or (replace) tries once, then takes the key
                # from its holder; a synchronous one has neither: it waits.
                return None if synchronous else 0.0
            case "retry":
                return min(self.lease, self.retry.budget()) if synchronous else 0.0
            case "skip" | "raise":
                return 0.0
            case _ as unknown:
                unreachable(unknown)

    def after_busy(
        self, busy: SimpleMutexAcquireTimeoutError, *, synchronous: bool, busy_retries: int
    ) -> Busy:
        """Once the key stayed busy: ``Skip``, or ``RunAgain`` after a delay. Raises for
        ``wait`` and ``raise``, for ``retry`` once its retries are used up, and for
        ``retry`` in synchronous execution."""
        match self.on_busy:
            case "skip":
                return Skip()
            case "retry" if synchronous:
                raise SimpleMutexAcquireTimeoutError(
                    f"{busy.key!r} stayed busy; a synchronous call cannot be re-queued, so "
                    "on_busy='retry' waited instead (bounded by timeout, or the retry budget "
                    "and one lease)",
                    key=busy.key,
                ) from busy
            case "retry":
                return RunAgain(self.retry.next_delay(busy_retries, busy))
            case "wait" | "raise" | "queue" | "latest" | "debounce" | "replace":
                raise busy
            case _ as unknown:
                unreachable(unknown)

    def lock_space(
        self, cache: object, prefix: str | None = None, name: str | None = None
    ) -> Mutex | Semaphore:
        """A Mutex for one permit, a Semaphore for more; without ``prefix``, under their
        own defaults (``mutex.``, ``semaphore.``). ``name`` labels its lock events (the
        task or job name)."""
        if self.permits == 1:
            return Mutex(
                cache, lease=self.lease, prefix="mutex." if prefix is None else prefix,
                name=name or "mutex",
            )  # fmt: skip
        return Semaphore(
            cache,
            permits=self.permits,
            lease=self.lease,
            prefix="semaphore." if prefix is None else prefix,
            name=name or "semaphore",
        )


def check_known(where: str, what: str, given: object, known: frozenset[str]) -> Mapping[str, Any]:
    """``given`` as a dict of names from ``known``: a typo must not pass silently."""
    if not isinstance(given, Mapping):
        raise ConstraintTypeError(f"{where}: expected a dict of {what}s, got {given!r}")
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConstraintValueError(
            f"{where}: unknown {what}(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    return given


def check_on_busy(where: str, value: object) -> OnBusy:
    for known in ON_BUSY:
        if value == known and isinstance(value, str):
            return known
    raise bad_input(
        value, str, f"{where}: on_busy must be one of {', '.join(ON_BUSY)}, got {value!r}"
    )


RETRY_FIELDS = frozenset(f.name for f in dataclasses.fields(RetryPolicy))


def retry_policy(where: str, value: object) -> RetryPolicy:
    """``retry={...}`` merged over the defaults; unknown fields and bad values raise."""
    given = check_known(where, "retry field", {} if value is None else value, RETRY_FIELDS)
    merged = {**dataclasses.asdict(RetryPolicy()), **given}
    countdown = positive_seconds(merged["countdown"], f"{where}: retry countdown")
    cap = positive_seconds(merged["cap"], f"{where}: retry cap")
    backoff = merged["backoff"]
    if isinstance(backoff, bool) or not isinstance(backoff, int | float) or not backoff >= 1:
        raise bad_input(
            backoff, (int, float), f"{where}: retry backoff must be a number >= 1, got {backoff!r}"
        )
    check_bool(where, "retry jitter", merged["jitter"])
    limit = merged["max"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise bad_input(
            limit, int, f"{where}: retry max must be None or an int >= 0, got {limit!r}"
        )
    return RetryPolicy(countdown, float(backoff), merged["jitter"], cap, limit)


QUEUE_FIELDS = frozenset(f.name for f in dataclasses.fields(QueuePolicy))


def queue_policy(where: str, value: object) -> QueuePolicy:
    """``queue={...}`` merged over the defaults; unknown fields and bad values raise."""
    given = check_known(where, "queue field", {} if value is None else value, QUEUE_FIELDS)
    merged = {**dataclasses.asdict(QueuePolicy()), **given}
    limit = merged["max"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise bad_input(
            limit, int, f"{where}: queue max must be None or an int >= 1, got {limit!r}"
        )
    on_full = merged["on_full"]
    if not (isinstance(on_full, str) and on_full in ON_FULL):
        raise bad_input(
            on_full, str, f"{where}: queue on_full must be 'raise' or 'skip', got {on_full!r}"
        )
    return QueuePolicy(
        limit,
        "skip" if on_full == "skip" else "raise",
        positive_seconds(merged["park_for"], f"{where}: queue park_for"),
        positive_seconds(merged["gap_for"], f"{where}: queue gap_for"),
        positive_seconds(merged["sweep_every"], f"{where}: queue sweep_every"),
    )


DEBOUNCE_FIELDS = frozenset(f.name for f in dataclasses.fields(DebouncePolicy))


def debounce_policy(where: str, value: object) -> DebouncePolicy:
    """``debounce={...}``: its fields checked (both are required once on_busy is
    ``"debounce"``: ``from_options`` says so)."""
    given = check_known(where, "debounce field", {} if value is None else value, DEBOUNCE_FIELDS)
    found = {
        name: positive_seconds(given[name], f"{where}: debounce {name}")
        for name in DEBOUNCE_FIELDS
        if given.get(name) is not None
    }
    return DebouncePolicy(**found)


def _check_debounce(where: str, policy: BusyPolicy) -> None:
    period, max_delay = policy.debounce.period, policy.debounce.max_delay
    if period is None or max_delay is None:
        raise ConstraintValueError(
            f"{where}: on_busy='debounce' needs debounce={{'period': s, 'max_delay': s}} "
            "(the quiet time before the run, and the most a call may wait from the first "
            "of its burst); set both"
        )
    if max_delay < period:
        raise ConstraintValueError(
            f"{where}: debounce max_delay ({max_delay:g} s) must be at least its period "
            f"({period:g} s): raise max_delay, or shorten period"
        )
    if max_delay > policy.queue.park_for:
        raise ConstraintValueError(
            f"{where}: debounce max_delay ({max_delay:g} s) must not exceed queue park_for "
            f"({policy.queue.park_for:g} s), or a parked call would be dropped before its "
            "run: lower max_delay, or raise queue={'park_for': ...}"
        )


def check_bool(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConstraintTypeError(f"{where}: {name} must be True or False, got {value!r}")
    return value


def check_permits(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_input(value, int, f"{where}: permits must be an int >= 1, got {value!r}")
    return value


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "on_busy": check_on_busy,
    "timeout": lambda where, value: timeout_seconds(value, f"{where}: timeout"),
    "retry": retry_policy,
    "lease": lambda where, value: positive_seconds(value, f"{where}: lease"),
    "renew": lambda where, value: check_bool(where, "renew", value),
    "permits": check_permits,
    "queue": queue_policy,
    "debounce": debounce_policy,
}
SHARED = frozenset(_CHECKS)
"""The option names both integrations take with the same meaning (besides key, cache)."""


def check_option(where: str, name: str, value: object) -> Any:
    """One shared option, checked and normalized (durations in seconds, a RetryPolicy)."""
    return _CHECKS[name](where, value)
