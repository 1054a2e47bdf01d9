"""The task-queue tiers: real ``celery worker -P prefork`` (``celery``), real ``rq worker``
(``rq``), several ``celery beat`` with MutexScheduler (``beat``) and several ``rq cron``
with ``once_per_tick`` (``cron``). Each submits work while the nemesis deals the queue's
own faults, then checks the lock properties of the bodies' steps (``checker.check``) and
every task's outcome (``checker.check_tasks``) or every tick (``checker.check_ticks``).

Servers: RabbitMQ (Celery's broker: a killed worker's unacked message is redelivered at
once) and the shared Redis (results, lock cache, fenced store, RQ), under a run's own
queue, prefix and database keys; none of them is restarted or flushed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import random
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

import nemesis
from nemesis import checker, history
from nemesis.faults import schedule
from nemesis.runner import ENV, Result, finish, only
from nemesis.store import RedisStore

BROKER = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
REDIS = "redis://127.0.0.1:6379/14"
BIN = Path(os.sys.executable).parent  # type: ignore[attr-defined]


def run(tier: str, seed: int, duration: float, workdir: Path | None = None,
        kinds: set[str] | None = None) -> Result:  # fmt: skip
    runs: dict[str, Callable[..., Result]] = {
        "celery": run_celery, "rq": run_rq, "beat": run_beat, "cron": run_cron,
    }  # fmt: skip
    if tier not in runs:
        raise ValueError(f"unknown tier {tier!r}")
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"nemesis-{tier}-{seed}-"))
    (workdir / "history").mkdir(parents=True, exist_ok=True)
    return runs[tier](seed, duration, workdir, kinds)


class Procs:
    """Subprocesses of a run, each in a session of its own (a worker and its pool die
    together with ``killpg``); every one is ended at the end, whatever happened."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, {**ENV, **env}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [str(BIN / argv[0]), *argv[1:]], env={**self.env, **env}, cwd=nemesis.ROOT,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            if time.monotonic() > deadline or self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} did not log {text!r}:\n{self.log(name)[-3000:]}")
            time.sleep(0.1)

    def stop(self, rec: history.Recorder, names: list[str] | None = None) -> None:
        """SIGCONT then SIGTERM (a warm shutdown) the whole group; SIGKILL what lingers
        after 30 s (recorded as ``unended``: it did not end by itself)."""
        chosen = {n: p for n, p in self.procs.items() if names is None or n in names}
        for proc in chosen.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for name, proc in chosen.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                rec("unended", target=proc.pid, name=name)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (a prefork worker's pool)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def hog(prefix: str, key: str, lease: float = 8.0) -> None:
    """Hold ``key`` from this process for ``lease`` seconds (never released: it lapses),
    so that a task on it waits past its time limit."""
    from simple_mutex import Mutex
    from simple_mutex.caches import RedisCache

    Mutex(RedisCache(redis.Redis.from_url(REDIS)), lease=lease, prefix=prefix).acquire(key)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _sigkill(rec: history.Recorder, kind: str, task: str, pid: int) -> None:
    """The fault ``kind`` dealt to ``task``'s process: recorded, then SIGKILL."""
    rec("fault", kind=kind, task=task, target=pid)
    _signal(pid, signal.SIGKILL)


def _sigstop(
    rec: history.Recorder, stopped: list[tuple[float, int]], task: str, pid: int, length: float
) -> None:
    """SIGSTOP ``task``'s process for ``length`` s (``_resume`` ends the pause)."""
    rec("fault", kind="sigstop", task=task, target=pid, length=length)
    if _signal(pid, signal.SIGSTOP):
        stopped.append((time.monotonic() + length, pid))


def _resume(rec: history.Recorder, stopped: list[tuple[float, int]], now: float) -> None:
    """SIGCONT every stopped process whose pause ended by ``now`` (all of them at
    ``math.inf``), recording each."""
    for when, pid in list(stopped):
        if now >= when:
            _signal(pid, signal.SIGCONT)
            rec("resumed", target=pid)
            stopped.remove((when, pid))


def _begin(workdir: Path) -> tuple[Path, history.Recorder, str, str]:
    """A queue run's history directory, the nemesis's recorder (started), the run's id and
    its fenced store's key prefix."""
    hist = workdir / "history"
    rec = history.Recorder(hist, "nemesis")
    rec("start")
    run_id = uuid.uuid4().hex[:8]
    return hist, rec, run_id, f"nemstore:{run_id}:"


def _stop_worker(rec: history.Recorder, stopped: list[tuple[float, int]],
                 proc: subprocess.Popen[bytes], length: float) -> None:  # fmt: skip
    """SIGSTOP a whole worker, its main process and each child, for ``length`` s."""
    for pid in [proc.pid, *children(proc.pid)]:
        _sigstop(rec, stopped, "", pid, length)


def _kill_worker(
    rec: history.Recorder, procs: Procs, name: str, start_worker: Callable[[str], None]
) -> None:
    """SIGKILL the worker ``name``'s whole process group, recording it and each child (the
    checker ties each to the tasks it ran), then start it again."""
    proc = procs.procs[name]
    for pid in children(proc.pid):
        rec("fault", kind="worker-kill", target=pid)
    rec("fault", kind="worker-kill", target=proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    start_worker(name)


def _drive(
    rec: history.Recorder, procs: Procs, workers: list[str], ready: str,
    start_worker: Callable[[str], None], seed: int, duration: float, faults: dict[str, float],
    rng: random.Random, submit: Callable[[], object], deal: Callable[[str, float, float], None],
    stopped: list[tuple[float, int]], outcomes: Callable[[], None],
    tick: Callable[[], None] = lambda: None,
) -> None:  # fmt: skip
    """Start the workers and wait for each to log ``ready``; then for ``duration`` s
    submit work at random gaps, deal the seed's faults when due, run ``tick`` and resume
    each SIGSTOPped process when its pause ends; at the end resume every one and record
    the ``outcomes``. Every process is stopped on the way out, whatever happened."""
    try:
        for name in workers:
            start_worker(name)
        for name in workers:
            procs.wait_for(name, ready)
        start = time.monotonic()
        plan = schedule(seed, duration, faults, gap=1.5, max_length=4.0)
        next_submit = start
        while (now := time.monotonic()) < start + duration:
            if now >= next_submit and now < start + duration - 3:
                submit()
                next_submit = now + rng.uniform(0.1, 0.5)
            while plan and start + plan[0].at <= now:
                fault = plan.pop(0)
                deal(fault.kind, fault.length, fault.pick)
            tick()
            _resume(rec, stopped, now)
            time.sleep(0.02)
        _resume(rec, stopped, math.inf)
        outcomes()
    finally:
        procs.stop(rec)
        rec("exit")


def _check_queue_run(
    tier: str,
    seed: int,
    duration: float,
    workdir: Path,
    hist: Path,
    run_id: str,
    store_prefix: str,
    conn: Any,
    what: str,
    replacing: tuple[str, ...] = (),
) -> Result:
    """Read and drop the run's fenced store and keys, then check its history (keys under
    the ``replacing`` prefixes: ``on_busy="replace"``)."""
    store = RedisStore(REDIS, store_prefix)
    log = store.log()
    store.drop()
    for name in conn.scan_iter(match=f"*{run_id}*", count=1000):
        conn.delete(name)
    events = history.load(hist)
    if replacing:  # how many holds a newer call took over: the feature under test ran
        what += f", {len(checker.replaced_tasks(events, replacing))} replaced"
    anomalies = checker.check(events, log, checker.Spec(replacing=replacing))
    anomalies += checker.check_tasks(events, replacing)
    anomalies += checker.check_order(events) + checker.check_latest(events)
    return finish(tier, seed, duration, events, anomalies, workdir,
                  [f"{what}; store log {len(log)} writes"])  # fmt: skip


# -- Celery ---------------------------------------------------------------------------

CELERY_FAULTS = {
    "sigkill": 1.0, "sigstop": 1.5, "revoke": 1.5, "soft-time-limit": 1.0,
    "hard-time-limit": 1.0, "worker-kill": 0.7, "worker-stop": 0.7, "expiry": 0.7,
}  # fmt: skip


def run_celery(seed: int, duration: float, workdir: Path, kinds: set[str] | None) -> Result:
    from celery import Celery

    from celery_mutex.signals import mutex_parked

    hist, rec, run_id, store_prefix = _begin(workdir)
    prefix, queue = f"nem{run_id}.", f"nem-{run_id}"
    env = {
        "NEM_BROKER": BROKER, "NEM_BACKEND": REDIS, "NEM_CACHE": REDIS, "NEM_PREFIX": prefix,
        "NEM_QUEUE": queue, "NEM_HISTORY": str(hist), "NEM_STORE": f"{REDIS}?prefix={store_prefix}",
    }  # fmt: skip
    procs = Procs(workdir, env)
    app = Celery("nemesis-client", set_as_current=False)
    app.conf.update(broker_url=BROKER, result_backend=REDIS, task_default_queue=queue,
                    mutex_cache=REDIS, mutex_prefix=prefix)  # fmt: skip
    _queued_senders(app)
    conn = redis.Redis.from_url(REDIS)
    workers = ["cw0", "cw1"]
    generation: dict[str, int] = {}

    def start_worker(name: str) -> None:
        generation[name] = generation.get(name, -1) + 1
        procs.start(name, [
            "celery", "-A", "nemesis.celery_app", "worker", "-P", "prefork", "-c", "2",
            "-Q", queue, "-n", f"{name}-{run_id}-{generation[name]}@%h", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ])  # fmt: skip

    rng = random.Random(seed)
    submitted: dict[str, Any] = {}
    keys: dict[str, tuple[str, str]] = {}  # task id -> (its lock's kind: k, q, l, d, r; key)

    def submit(name: str = "work", key: str | None = None, kind: str | None = None,
               burst: bool = True, **options: Any) -> str:  # fmt: skip
        """Send a call: of the random ones, 40% through the line (``q.<key>``, kind q),
        20% keep latest (``l.<key>``, kind l) and 10% debounced (``d.<key>``, kind d), each
        of the last two followed by a burst of up to four more on its key, each through the
        client's MutexTask, taking its ticket at the send (the submit events of one key are
        in send order: this thread sends them one by one, recording each right after); and
        of the rest, a quarter ``on_busy="replace"`` (``r.<key>``, kind r)."""
        if kind is None:
            roll = rng.random() if key is None else 1.0
            kind = next((k for k, upto in SHARES if roll < upto), "k")
            if kind == "k" and key is None and rng.random() < REPLACING_SHARE:
                kind = "r"
        queued, replacing = kind in ("q", "l", "d"), kind == "r"
        key = key or rng.choice("abc")
        steps = options.pop("steps", rng.randint(2, 8))
        late = name == "work_late" or rng.random() < 0.3
        sent_at = time.monotonic()  # a relative expires counts from here
        if replacing:
            # Early ack only: a redelivered older call would replace the newer one.
            late = False
            task = "nemesis.celery_app.work_replacing"
            result = app.send_task(task, kwargs={"key": key, "steps": steps}, **options)
        elif queued:
            base = {"q": "work_queued", "l": "work_latest", "d": "work_debounced"}[kind]
            task = "nemesis.celery_app." + (f"{base}_late" if late else base)
            if "countdown" not in options and rng.random() < 0.25:
                # Through the broker (a countdown keeps the ticket from the send): it may
                # reach a worker before its turn and park there.
                options["countdown"] = round(rng.uniform(0.0, 1.0), 2)
            result = app.tasks[task].apply_async(kwargs={"key": key, "steps": steps}, **options)
        else:
            task = "nemesis.celery_app." + ("work_late" if late else "work")
            result = app.send_task(task, kwargs={"key": key, "steps": steps}, **options)
        limit = options.get("soft_time_limit") or options.get("time_limit")
        expires = options.get("expires")
        rec("submit", task=result.id, key=f"{kind}.{key}", name=task, limit=limit, late=late,
            queued=queued, supersedes=kind in ("l", "d"), replacing=replacing,
            expires_at=None if expires is None else sent_at + expires)  # fmt: skip
        submitted[result.id] = result
        keys[result.id] = (kind, key)
        if kind in ("l", "d") and burst:
            # A burst behind it on the same key, so newer calls take the waiting place.
            for _ in range(rng.randint(0, 4)):
                submit(key=key, kind=kind, burst=False)
        return str(result.id)

    def running() -> list[tuple[str, int]]:
        """Tasks whose body started in a live process, with that pid."""
        found = []
        for task_id in list(submitted)[-40:]:
            pid = conn.get(f"{prefix}pid.{task_id}")
            alive = pid is not None and Path(f"/proc/{int(pid)}").exists()
            if alive and not submitted[task_id].ready():
                found.append((task_id, int(pid)))
        return found

    def deal(kind: str, length: float, pick: float) -> None:
        live = running()
        if kind == "soft-time-limit":  # it lands while acquire waits behind a hog
            key = f"t{len(submitted)}"
            hog(prefix, f"k.{key}")
            rec("fault", kind=kind, task=submit(key=key, soft_time_limit=1))
            return
        if kind == "hard-time-limit":  # it lands in the body; a waiter must wait for the
            key = f"h{len(submitted)}"  # child to be gone (its clean-up is in the lock)
            rec("fault", kind=kind, task=submit(key=key, steps=60, time_limit=1.5))
            submit(key=key)
            return
        if kind == "expiry":  # a queued call that expires while it waits behind a 2 s
            # holder: it ends REVOKED at its turn, never run, and the next call runs
            key = f"x{len(submitted)}"
            submit(key=key, kind="q", steps=40, burst=False)
            rec("fault", kind=kind, task=submit(key=key, kind="q", expires=0.5, burst=False))
            submit(key=key, kind="q", burst=False)
            return
        if kind == "worker-kill":
            _kill_worker(rec, procs, workers[int(pick * len(workers))], start_worker)
            return
        if kind == "worker-stop":  # its prefetched and countdown messages wait with it: a
            # queued one may be stepped over as a gap (gap_for 3 s) and then run late
            _stop_worker(rec, stopped, procs.procs[workers[int(pick * len(workers))]], length)
            return
        if not live:
            return
        task_id, pid = live[int(pick * len(live))]
        if kind == "revoke":  # a waiter on its key must not enter during its clean-up
            kind_of, key = keys[task_id]
            if kind_of != "r":  # a waiter of a replacing key would stop it first,
                submit(key=key, kind=kind_of)  # and the revoke then finds nothing to end
                time.sleep(0.2)
            rec("fault", kind="revoke", task=task_id, target=pid)
            app.control.revoke(task_id, terminate=True, signal="SIGTERM")
        elif kind == "sigkill":
            _sigkill(rec, kind, task_id, pid)
        elif kind == "sigstop":
            _sigstop(rec, stopped, task_id, pid, length)

    def parked_at_send(sender: Any = None, task_id: str = "", key: str = "", **_: Any) -> None:
        rec("parked", task=task_id, key=key, at="send")  # behind a ticket ahead: no delivery

    stopped: list[tuple[float, int]] = []
    mutex_parked.connect(parked_at_send, weak=False)
    try:
        _drive(rec, procs, workers, "ready.", start_worker, seed, duration,
               only(CELERY_FAULTS, kinds), rng, submit, deal, stopped,
               lambda: _outcomes(rec, submitted, timeout=45, hist=hist))  # fmt: skip
    finally:
        mutex_parked.disconnect(parked_at_send)
    lines = [kind for kind, _ in keys.values()]
    what = (f"{len(submitted)} tasks submitted, {lines.count('q')} of them queued, "
            f"{lines.count('l')} keep latest, {lines.count('d')} debounced, "
            f"{lines.count('r')} replacing")  # fmt: skip
    return _check_queue_run("celery", seed, duration, workdir, hist, run_id, store_prefix, conn,
                            what, replacing=REPLACING)  # fmt: skip


# Of the random calls, up to each share: on_busy="queue", "latest", "debounce", each on
# keys of their own (q.<key>, l.<key>, d.<key>); of the rest, REPLACING_SHARE
# on_busy="replace" (r.<key>); the others wait (k.<key>).
SHARES = (("q", 0.4), ("l", 0.6), ("d", 0.7))
REPLACING_SHARE = 0.25
REPLACING = ("r.",)  # the key prefix of on_busy="replace" (checker.Spec.replacing)
QUEUED_SHARE = 0.4  # of the RQ tier's random jobs: on_busy="queue" (q.<run>.<key>)


def _queued_senders(app: Any) -> None:
    """Stand-ins on the client app for the worker's queueing tasks (same names, same mutex
    options): sent through them, each call takes its ticket at the send, as a producer's
    ``apply_async`` does; their bodies never run here."""
    from celery_mutex import MutexTask
    from nemesis.celery_locks import DEBOUNCE, LATEST, QUEUED

    mutexes = {"work_queued": QUEUED, "work_latest": LATEST, "work_debounced": DEBOUNCE}
    for name in [n for base in mutexes for n in (base, f"{base}_late")]:

        def stand_in(key: str, steps: int = 6, cleanup: int = 20, pause: float = 0.05) -> None:
            raise AssertionError("a stand-in: the worker runs this task")

        mutex = mutexes[name.removesuffix("_late")]
        app.task(base=MutexTask, shared=False, name=f"nemesis.celery_app.{name}",
                 mutex=mutex, acks_late=name.endswith("_late"))(stand_in)  # fmt: skip


def _outcomes(rec: history.Recorder, submitted: dict[str, Any], timeout: float, hist: Path) -> None:
    """Wait for every task to be ready (up to ``timeout`` in all), recording each outcome;
    a task never ready has none (the checker calls it lost). The wait ends early once
    every task still pending is gone with a fault (``checker.gone_with_a_fault``: no
    outcome can come for those) and none became ready for ``QUIET`` s (a revoked task's
    state is stored a moment after the revoke)."""
    from celery_mutex import is_skipped

    deadline = time.monotonic() + timeout
    pending = dict(submitted)
    last_outcome = time.monotonic()
    while pending and time.monotonic() < deadline:
        if time.monotonic() - last_outcome >= QUIET:
            if set(pending) <= checker.gone_with_a_fault(history.load(hist)):
                return
            last_outcome += 1  # look again in 1 s
        for task_id, result in list(pending.items()):
            if not result.ready():
                continue
            state, value = result.state, result.result
            if state == "SUCCESS" and is_skipped(value):
                rec("outcome", task=task_id, state="skipped", reason=value.get("reason"),
                    by=value.get("by"))  # fmt: skip
            elif state == "SUCCESS":
                rec("outcome", task=task_id, state="success")
            else:
                rec("outcome", task=task_id, state="failure", error=f"{state} {value!r}"[:300])
            del pending[task_id]
            last_outcome = time.monotonic()
        time.sleep(0.2)


QUIET = 5.0  # s with no outcome before a wait for outcomes may end early


# -- RQ -------------------------------------------------------------------------------

RQ_FAULTS = {"horse-kill": 1.5, "sigstop": 1.0, "job-timeout": 1.0, "retry-after-kill": 1.5,
             "worker-kill": 0.5, "worker-stop": 0.7}  # fmt: skip


def run_rq(seed: int, duration: float, workdir: Path, kinds: set[str] | None) -> Result:
    from rq import Retry

    import nemesis.rq_jobs  # noqa: F401  (its queued jobs take their tickets at the enqueue)
    from rq_mutex import Queue
    from rq_mutex.line import META as RQ_TICKET

    hist, rec, run_id, store_prefix = _begin(workdir)
    prefix = f"nemrq{run_id}."
    env = {"NEM_HISTORY": str(hist), "NEM_STORE": f"{REDIS}?prefix={store_prefix}",
           "NEM_PREFIX": prefix}  # fmt: skip
    procs = Procs(workdir, env)
    conn = redis.Redis.from_url(REDIS)
    queue = Queue(f"nem-{run_id}", connection=conn)
    workers = ["rw0", "rw1"]

    def start_worker(name: str) -> None:
        # A new name each time: RQ refuses a name a killed worker still has registered.
        # rq_mutex.Worker: the worker that records its dead horses, so a job's retry can
        # free what its killed attempt held (the RQ guide's requirement for that case).
        generation[name] = generation.get(name, -1) + 1
        procs.start(name, ["rq", "worker", "-w", "rq_mutex.Worker", "--with-scheduler",
                           "-u", REDIS, "-n", f"{name}-{run_id}-{generation[name]}",
                           queue.name])  # fmt: skip

    generation: dict[str, int] = {}

    rng = random.Random(seed)
    jobs: dict[str, Any] = {}
    to_kill: list[str] = []  # retry-after-kill jobs whose first horse is still to die

    def submit(func: str | None = None, key: str | None = None, steps: int | None = None,
               **options: Any) -> str:  # fmt: skip
        """Enqueue a job: ``queued`` (40% of the random ones) on ``q.<run>.<key>`` (lines
        of the run's own: RQ's locks take no prefix), its ticket taken in this enqueue
        (the submit events of one key are in send order: this thread enqueues them one
        by one, recording each right after). A random queued job comes in a burst of up
        to three on its key, so that both workers meet the key and one parks. Of the
        other random jobs, a quarter ``replacing`` (``r.<run>.<key>``), half of them
        followed by a second on their key."""
        burst = 0
        if func is None:
            func = "queued" if key is None and rng.random() < QUEUED_SHARE else "work"
            if func == "work" and key is None and rng.random() < REPLACING_SHARE:
                func = "replacing"
            # A replacing job is followed by one more on its key half the time: it meets
            # the first one running (or about to) and takes its key.
            burst = {"queued": rng.randint(0, 2), "replacing": rng.randint(0, 1)}.get(func, 0)
        key = key or rng.choice("abc")
        if func in ("queued", "replacing") and not key.startswith(run_id):
            key = f"{run_id}.{key}"
        job = queue.enqueue(f"nemesis.rq_jobs.{func}", key,
                            steps=steps or rng.randint(2, 8), **options)  # fmt: skip
        limit = options.get("job_timeout")
        lock = f"{RQ_LOCKS[func]}.{key}"
        retry = options.get("retry")
        rec("submit", task=job.id, key=lock, name=func, limit=limit, unique=func == "unique",
            queued=func == "queued", replacing=func == "replacing",
            retries=retry.max if retry is not None else 0,
            ticket=job.meta.get(RQ_TICKET))  # fmt: skip
        if func == "queued" and job.get_status(refresh=False) == "scheduled":
            rec("parked", task=job.id, key=lock, at="send")  # behind a ticket ahead: no horse
        jobs[job.id] = job
        for _ in range(burst):
            submit(func, key=key)
        return str(job.id)

    dealt: list[str] = []

    def every_other(kind: str) -> bool:
        """Every other fault of ``kind`` (the second, the fourth...) goes to a queued job."""
        dealt.append(kind)
        return dealt.count(kind) % 2 == 0

    def horse_of(job_id: str) -> int | None:
        pid = conn.get(f"{prefix}pid.{job_id}")
        if pid is None or not Path(f"/proc/{int(pid)}").exists():
            return None
        return int(pid)

    def deal(kind: str, length: float, pick: float) -> None:
        if kind == "job-timeout" and every_other(kind):  # lands in a queued job's body, in
            # its turn: the timeout ends the turn, and the next job of its key runs
            rec("fault", kind=kind, task=submit("queued", steps=60, job_timeout=1))
            return
        if kind == "job-timeout":  # lands while acquire waits behind a hog
            key = f"t{len(jobs)}"
            hog("mutex.", f"k.{key}")
            rec("fault", kind=kind, task=submit(key=key, job_timeout=1))
            return
        if kind == "retry-after-kill":  # its horse is killed once its body runs; every
            # other one queued (its retry runs in its turn, before the next job of its key)
            if every_other(kind):
                to_kill.append(submit("queued", steps=60, retry=Retry(max=2)))
            else:
                to_kill.append(submit("unique", key=f"{run_id}-{len(jobs)}", steps=60,
                                      retry=Retry(max=2)))  # fmt: skip
            return
        if kind == "worker-kill":
            _kill_worker(rec, procs, workers[int(pick * len(workers))], start_worker)
            return
        if kind == "worker-stop":  # a job it popped waits with it: a queued one may be
            # stepped over as a gap (gap_for 3 s) and then run late, said so
            _stop_worker(rec, stopped, procs.procs[workers[int(pick * len(workers))]], length)
            return
        live = [(j, pid) for j in list(jobs)[-30:] if (pid := horse_of(j)) is not None]
        live = [(j, pid) for j, pid in live if jobs[j].get_status(refresh=True) == "started"]
        if not live:
            return
        job_id, pid = live[int(pick * len(live))]
        if kind == "horse-kill":
            _sigkill(rec, kind, job_id, pid)
        elif kind == "sigstop":
            _sigstop(rec, stopped, job_id, pid, length)

    def kill_first_horses() -> None:
        for job_id in list(to_kill):
            pid = horse_of(job_id)
            if pid is not None:
                _sigkill(rec, "horse-kill", job_id, pid)
                to_kill.remove(job_id)

    stopped: list[tuple[float, int]] = []
    _drive(rec, procs, workers, "Listening on", start_worker, seed, duration,
           only(RQ_FAULTS, kinds), rng, submit, deal, stopped,
           lambda: _rq_outcomes(rec, jobs, 45, hist, queue), kill_first_horses)  # fmt: skip
    queued = sum(job.func_name.endswith(".queued") for job in jobs.values())
    replaced = sum(job.func_name.endswith(".replacing") for job in jobs.values())
    return _check_queue_run("rq", seed, duration, workdir, hist, run_id, store_prefix, conn,
                            f"{len(jobs)} jobs enqueued, {queued} of them queued, "
                            f"{replaced} replacing", replacing=REPLACING)  # fmt: skip


RQ_LOCKS = {
    "work": "k",
    "unique": "u",
    "queued": "q",
    "replacing": "r",
}  # job function -> its key's template


def _rq_outcomes(rec: history.Recorder, jobs: dict[str, Any], timeout: float, hist: Path,
                 queue: Any) -> None:  # fmt: skip
    """Wait for every job to end (up to ``timeout`` in all), recording each outcome. A job
    found in RQ's intermediate queue and in no registry is recorded ``stranded``: a worker
    popped it and was killed before it started it, and RQ only fails it at its next
    maintenance (every 10 min: "stuck in intermediate queue"); so is a job in the started
    registry whose body no horse ever began (its worker was killed before the fork). The
    wait ends early once every job still pending is gone with a fault
    (``checker.gone_with_a_fault``) and none ended for ``QUIET`` s."""
    from rq_mutex import is_skipped
    from rq_mutex.job import META_SKIP_REASON

    deadline = time.monotonic() + timeout
    pending = dict(jobs)
    stranded: set[str] = set()
    last_outcome = time.monotonic()
    while pending and time.monotonic() < deadline:
        if time.monotonic() - last_outcome >= QUIET:
            popped = set(queue.intermediate_queue.get_job_ids()) & set(pending)
            started = set(queue.started_job_registry.get_job_ids()) & set(pending)
            # Started, yet no horse of it ever ran a line of the job: its worker took it
            # and was killed before it forked one (RQ fails it only when it cleans the
            # registry of abandoned jobs, minutes later).
            began = {e.get("task") for e in history.load(hist) if e["op"] == "run"}
            for job_id in sorted((popped - started) | (started - began) - stranded):
                rec("stranded", task=job_id)
                stranded.add(job_id)
            if set(pending) <= checker.gone_with_a_fault(history.load(hist)):
                return
            last_outcome += 1  # look again in 1 s
        for job_id, job in list(pending.items()):
            status = job.get_status(refresh=True)
            if status == "finished":
                value = job.return_value()
                if is_skipped(value):  # why, from its meta: "duplicate" for a queued one
                    reason = job.get_meta(refresh=True).get(META_SKIP_REASON)
                    rec("outcome", task=job_id, state="skipped", reason=reason)
                else:
                    rec("outcome", task=job_id, state="success")
            elif status in ("failed", "stopped", "canceled"):
                result = job.latest_result()
                error = status if result is None else checker.exception_of(result.exc_string or "")
                rec("outcome", task=job_id, state="failure", error=error)
            else:
                continue
            del pending[job_id]
            last_outcome = time.monotonic()
        time.sleep(0.2)


# -- periodic: celery beat and rq cron ----------------------------------------------------

PERIODIC_FAULTS = {"sigkill": 1.0, "sigstop": 2.0}
BEAT_TZ = "Asia/Kathmandu"  # UTC+5:45: neither hours nor minutes line up with UTC


def run_beat(seed: int, duration: float, workdir: Path, kinds: set[str] | None) -> Result:
    """Three beats with MutexScheduler in a non-UTC zone, one prefork worker; the run
    spans at least one minute boundary (the crontab entry's tick)."""
    hist = workdir / "history"
    run_id = uuid.uuid4().hex[:8]
    env = {"NEM_BROKER": BROKER, "NEM_BACKEND": REDIS, "NEM_PREFIX": f"nemb{run_id}.",
           "NEM_QUEUE": f"nemb-{run_id}", "NEM_HISTORY": str(hist), "NEM_TZ": BEAT_TZ}  # fmt: skip
    procs = Procs(workdir, env)

    def start_worker() -> None:
        procs.start("bw", ["celery", "-A", "nemesis.beat_app", "worker", "-P", "prefork", "-c",
                           "2", "-Q", env["NEM_QUEUE"], "-n", f"bw-{run_id}@%h", "-l", "INFO",
                           "--without-gossip", "--without-mingle", "--without-heartbeat"],
                    )  # fmt: skip

    def start_one(name: str) -> None:
        procs.start(name, ["celery", "-A", "nemesis.beat_app", "beat", "-S",
                           "celery_mutex.beat:MutexScheduler", "-s", str(workdir / name),
                           "--pidfile", str(workdir / f"{name}.pid"), "--max-interval", "1",
                           "-l", "INFO"])  # fmt: skip

    def expected(start: float, end: float) -> dict[str, list[str]]:
        every = [dt.datetime.fromtimestamp(s, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                 for s in range(math.ceil(start), math.floor(end))]  # fmt: skip
        minutes = range(math.ceil(start / 60) * 60, math.floor(end), 60)
        cron = [dt.datetime.fromtimestamp(m, dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
                for m in minutes]  # fmt: skip
        return {"every": every, "cron": cron}

    procs.start_worker = start_worker  # type: ignore[attr-defined]
    # Long enough to cross a minute boundary by 8 s: the crontab's tick is checked too.
    to_boundary = 60 - time.time() % 60
    duration = max(duration, to_boundary + 12 if to_boundary > 8 else to_boundary + 72)
    return _periodic("beat", seed, duration, workdir, procs, ["b0", "b1", "b2"], start_one,
                     expected, lambda: procs.wait_for("bw", "ready."), kinds)  # fmt: skip


def run_cron(seed: int, duration: float, workdir: Path, kinds: set[str] | None) -> Result:
    """Three ``rq cron`` processes with once_per_tick, two registrations sharing a name,
    every second; one rq worker."""
    hist = workdir / "history"
    run_id = uuid.uuid4().hex[:8]
    env = {"NEM_QUEUE": f"nemc-{run_id}", "NEM_HISTORY": str(hist)}
    procs = Procs(workdir, env)
    config = str(Path(__file__).with_name("cron_config.py"))

    def start_worker() -> None:
        # RQ's SimpleWorker, but its stop never waits a minute for its pubsub thread (a
        # warm stop that did was called a hang).
        worker = "rq_support.workers.SimpleWorker"
        procs.start("cw", ["rq", "worker", "-w", worker, "-u", REDIS, env["NEM_QUEUE"]])

    def start_one(name: str) -> None:
        procs.start(name, ["rq", "cron", "-u", REDIS, config])

    def expected(start: float, end: float) -> dict[str, list[str]]:
        seconds = [str(s) for s in range(math.ceil(start), math.floor(end))]
        return {"users": seconds, "orders": seconds}

    procs.start_worker = start_worker  # type: ignore[attr-defined]
    return _periodic("cron", seed, duration, workdir, procs, ["c0", "c1", "c2"], start_one,
                     expected, lambda: procs.wait_for("cw", "Listening on"), kinds)  # fmt: skip


def _periodic(tier: str, seed: int, duration: float, workdir: Path, procs: Procs,
              names: list[str], start_one: Callable[[str], None],
              expected: Callable[[float, float], dict[str, list[str]]],
              ready: Callable[[], None], kinds: set[str] | None) -> Result:  # fmt: skip
    """Start a worker and the ``names`` schedulers, deal SIGKILL (restarted after 1 s) and
    SIGSTOP to schedulers, then check every tick of the window ran exactly once. A tick
    of the second a scheduler was SIGKILLed in may be lost (documented: the claim and the
    send are two steps); it is noted, not counted."""
    rec = history.Recorder(workdir / "history", "nemesis")
    rec("start")
    kills: list[float] = []  # wall times
    try:
        procs.start_worker()  # type: ignore[attr-defined]
        ready()
        for name in names:
            start_one(name)
        begin = time.time() + 6  # schedulers start, and the first tick goes out
        start = time.monotonic()
        plan = schedule(seed, duration, only(PERIODIC_FAULTS, kinds), gap=2.0, max_length=3.0)
        stopped: list[tuple[float, int]] = []
        restart: list[tuple[float, str]] = []
        while (now := time.monotonic()) < start + duration:
            while plan and start + plan[0].at <= now:
                fault = plan.pop(0)
                live = [n for n in names if procs.procs[n].poll() is None
                        and all(p != procs.procs[n].pid for _, p in stopped)]  # fmt: skip
                if len(live) < 2:  # one always runs: "the others send the next tick"
                    continue
                name = live[int(fault.pick * len(live))]
                pid = procs.procs[name].pid
                if fault.kind == "sigkill":
                    rec("fault", kind="sigkill", target=pid)
                    kills.append(time.time())
                    _signal(pid, signal.SIGKILL)
                    restart.append((now + 1.0, name))
                else:
                    rec("fault", kind="sigstop", target=pid, length=fault.length)
                    _signal(pid, signal.SIGSTOP)
                    stopped.append((now + fault.length, pid))
            _resume(rec, stopped, now)
            for when, name in list(restart):
                if now >= when:
                    procs.procs[name].wait(10)
                    start_one(name)
                    restart.remove((when, name))
            time.sleep(0.02)
        _resume(rec, stopped, math.inf)
        end = time.time() - 2
        time.sleep(4)  # the last ticks reach the worker
    finally:
        procs.stop(rec)
        rec("exit")
    events = history.load(workdir / "history")
    want = expected(begin, end)
    anomalies, lost = [], []
    for a in checker.check_ticks(events, want):
        if a.kind == "tick-missed" and _near_a_kill(a.detail, kills):
            lost.append(a.detail)
        else:
            anomalies.append(a)
    ticks = sum(e["op"] == "tick" for e in events)
    notes = [f"{sum(map(len, want.values()))} ticks expected, {ticks} ran",
             f"{len(lost)} ticks lost to a SIGKILL between claim and send (documented)",
             ]  # fmt: skip
    anomalies += checker.check(events, None, checker.Spec())
    return finish(tier, seed, duration, events, anomalies, workdir, notes)


def _near_a_kill(detail: str, kills: list[float]) -> bool:
    """Whether a missed tick's slot (in its detail) began within 1.5 s of a SIGKILL."""
    slot = detail.split(" ")[1]
    if slot.isdigit():
        at = float(slot)
    else:
        form = "%Y-%m-%dT%H:%M:%SZ" if slot.count(":") == 2 else "%Y-%m-%dT%H:%MZ"
        at = dt.datetime.strptime(slot, form).replace(tzinfo=dt.timezone.utc).timestamp()
    return any(-0.5 <= k - at <= 1.5 for k in kills)
