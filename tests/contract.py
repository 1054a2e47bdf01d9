"""The contract suite every ConditionalCache must pass (see simple_mutex/contract.py).

A backend's test module subclasses ``CacheContract`` and provides a ``cache`` fixture (the
class's own, or the module's) that yields a fresh, empty cache (or one whose keys cannot
collide with other tests: use ``unique_key``). Real time is used, with short TTLs, so the
same suite runs against real servers; no test here sleeps more than about a second, and
the class runs in a few seconds.

Knobs a subclass may override for a slow or remote backend:

``short_ttl``
    The TTL of entries a test lets expire (seconds).
``expiry_slack``
    How long past ``short_ttl`` a test sleeps before it expects the entry gone (covers
    a server that judges expiry by its own clock, or rounds TTLs to milliseconds).
``clock_tolerance``
    How far ``expires_at`` may sit from ``time.time() + ttl`` (clock skew to a server).
``wait_slack``
    How far past its timeout ``wait()`` may return (scheduling and round trips).
``foreign_key_chars``
    Characters the server does not keep verbatim in a key (the scan tests skip them).
``remembers_releases``
    The cache keeps a trace of a release (a freed row, a held mark naming the version
    freed), so the same release sent again says freed, not missed.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest
from procs import FORK
from workers import ReleaseLater

from simple_mutex import ConditionalCache, SimpleCacheConditionError
from simple_mutex.caches.adapt import index_prefix
from simple_mutex.contract import Entry, Scannable


def _use_inherited_cache(cache: ConditionalCache, key: str) -> None:
    for _ in range(20):
        entry = cache.put_if_absent(key, "child", ttl=30)
        cache.compare_and_delete(key, version=entry.version)


def scannable(cache: ConditionalCache) -> Scannable:
    assert isinstance(cache, Scannable)
    return cache


# A test whose premise is a step taken within a short TTL tries again when the machine was
# slower than that (measured, not assumed), up to this many times.
LATE_TRIES = 5


def unique_key(name: str = "k") -> str:
    return f"contract.{name}.{uuid.uuid4().hex}"


def assert_refused(cache: ConditionalCache, key: str, version: str, current: Entry | None) -> None:
    """A stale ``version`` can neither set nor delete ``key``, which still holds ``current``
    (or stays absent)."""
    with pytest.raises(SimpleCacheConditionError):
        cache.compare_and_set(key, current.value if current else "v2", ttl=30, version=version)
    with pytest.raises(SimpleCacheConditionError):
        cache.compare_and_delete(key, version=version)
    assert cache.get(key) == current


def held(cache: ConditionalCache, value: str, ttl: float = 30) -> tuple[str, Entry]:
    """A fresh key, put with ``value``: the key and its entry."""
    key = unique_key()
    return key, cache.put_if_absent(key, value, ttl=ttl)


def waited_on(cache: ConditionalCache, key: str) -> Entry:
    """Hold ``key`` and fail a second put on it, as a waiter does before it waits (Redis
    signals a release only to keys a failed put marked); the holder's entry."""
    entry = cache.put_if_absent(key, "holder", ttl=60)
    with pytest.raises(SimpleCacheConditionError):
        cache.put_if_absent(key, "waiter", ttl=60)
    return entry


class CacheContract:
    """Subclass me where a ``cache`` fixture is defined."""

    short_ttl: float = 0.2
    expiry_slack: float = 0.1
    clock_tolerance: float = 1.0
    wait_slack: float = 0.15
    foreign_key_chars: str = ""
    remembers_releases: bool = False

    def let_expire(self) -> None:
        time.sleep(self.short_ttl + self.expiry_slack)

    # -- the fixture itself -------------------------------------------------------------

    def test_cache_has_a_name_and_the_five_methods(self, cache: ConditionalCache) -> None:
        """The cache satisfies the runtime Protocol and names itself for error messages."""
        assert isinstance(cache, ConditionalCache)
        assert isinstance(cache.name, str)
        assert cache.name

    # -- get and put_if_absent ----------------------------------------------------------

    def test_put_if_absent_then_get_returns_the_entry(self, cache: ConditionalCache) -> None:
        """A first put wins, and get returns exactly what was written."""
        key, entry = held(cache, "v1")
        assert entry.value == "v1"
        assert cache.get(key) == entry

    def test_get_of_an_absent_key_is_none(self, cache: ConditionalCache) -> None:
        """A key never written reads as None."""
        assert cache.get(unique_key()) is None

    def test_values_round_trip_byte_for_byte(self, cache: ConditionalCache) -> None:
        """JSON with quotes, backslashes and non-ASCII text comes back unchanged."""
        key = unique_key()
        value = '{"token":"a\\"b","host":"h\\u00e9","label":"Grüße ☃ \\n"}'
        cache.put_if_absent(key, value, ttl=30)
        got = cache.get(key)
        assert got is not None
        assert got.value == value

    def test_second_put_if_absent_loses(self, cache: ConditionalCache) -> None:
        """Put-if-absent on a live key raises the condition error."""
        key, first = held(cache, "v1")
        with pytest.raises(SimpleCacheConditionError):
            cache.put_if_absent(key, "v2", ttl=30)
        assert cache.get(key) == first

    def test_put_of_the_identical_value_returns_the_existing_entry_unchanged(
        self, cache: ConditionalCache
    ) -> None:
        """Repeating our own put (a lost reply, a driver's retry) returns the existing entry
        unchanged, after a renewal too; the next grant's fence is larger."""
        key, first = held(cache, "same")
        assert cache.put_if_absent(key, "same", ttl=30) == first
        assert cache.get(key) == first
        renewed = cache.compare_and_set(key, "same", ttl=60, version=first.version)
        assert cache.put_if_absent(key, "same", ttl=30) == renewed
        cache.compare_and_delete(key, version=renewed.version)
        assert cache.put_if_absent(key, "same", ttl=30).fence > first.fence

    def test_put_if_absent_on_an_expired_key_wins(self, cache: ConditionalCache) -> None:
        """An expired entry counts as absent: a new put takes the key over (and get shows
        the entry it wrote, took_over being the put's own report)."""
        key = unique_key()
        cache.put_if_absent(key, "old", ttl=self.short_ttl)
        self.let_expire()
        entry = cache.put_if_absent(key, "new", ttl=30)
        assert entry.value == "new"
        assert cache.get(key) == entry._replace(took_over=False)

    def test_put_if_absent_on_a_freed_key_wins(self, cache: ConditionalCache) -> None:
        """A key freed by compare_and_delete can be taken again at once."""
        key, first = held(cache, "v1")
        cache.compare_and_delete(key, version=first.version)
        entry = cache.put_if_absent(key, "v2", ttl=30)
        assert cache.get(key) == entry
        assert entry.value == "v2"

    def test_get_returns_none_for_an_expired_entry(self, cache: ConditionalCache) -> None:
        """An entry past its TTL is not returned, though nobody deleted it (and one within
        it is: judged by the clock, as a loaded machine may take longer than the TTL
        between the put and the get)."""
        for _ in range(LATE_TRIES):
            key, started = unique_key(), time.monotonic()
            cache.put_if_absent(key, "v1", ttl=self.short_ttl)
            seen = cache.get(key)
            if time.monotonic() - started < self.short_ttl:
                break
        else:
            pytest.fail(f"the get came {self.short_ttl} s after its put {LATE_TRIES} times")
        assert seen is not None
        self.let_expire()
        assert cache.get(key) is None

    def test_keys_are_independent(self, cache: ConditionalCache) -> None:
        """Keys sharing a prefix, or differing by '#', '%', '~', ':', are independent."""
        base = unique_key()
        keys = [base, base + "#1", base + "#2", base + "%2F", base + "~x", base + ":y"]
        entries = [cache.put_if_absent(k, f"v{i}", ttl=30) for i, k in enumerate(keys)]
        for key, entry in zip(keys, entries, strict=True):
            assert cache.get(key) == entry
        cache.compare_and_delete(base, version=entries[0].version)
        assert cache.get(base) is None
        for key, entry in zip(keys[1:], entries[1:], strict=True):
            assert cache.get(key) == entry

    def test_expires_at_is_now_plus_ttl_in_unix_seconds(self, cache: ConditionalCache) -> None:
        """expires_at is a Unix timestamp about ttl seconds ahead of the wall clock."""
        key = unique_key()
        before = time.time()
        entry = cache.put_if_absent(key, "v1", ttl=30)
        after = time.time()
        assert isinstance(entry.expires_at, float)
        assert before + 30 - self.clock_tolerance <= entry.expires_at
        assert entry.expires_at <= after + 30 + self.clock_tolerance
        got = cache.get(key)
        assert got is not None
        assert got.expires_at == pytest.approx(entry.expires_at, abs=0.01)

    def test_entry_fields_have_the_documented_types(self, cache: ConditionalCache) -> None:
        """value str, version str, fence int (not bool), expires_at float."""
        entry = cache.put_if_absent(unique_key(), "v1", ttl=30)
        assert isinstance(entry, Entry)
        assert isinstance(entry.value, str)
        assert isinstance(entry.version, str)
        assert entry.version
        assert type(entry.fence) is int
        assert entry.fence >= 1

    # -- took_over: the grant replaced a holder that never freed the key -----------------

    def test_a_first_grant_did_not_take_over(self, cache: ConditionalCache) -> None:
        """A key never granted before: took_over is False."""
        _, entry = held(cache, "v1")
        assert entry.took_over is False

    def test_a_grant_after_a_lapse_took_over(self, cache: ConditionalCache) -> None:
        """The holder never freed the key (its entry lapsed): the next grant says it took
        over. Only that put's answer says so: get, a renewal, the same put repeated (a
        lost reply's retry) and the grant after a release all say False."""
        key, _ = held(cache, "crashed", self.short_ttl)
        self.let_expire()
        rescuer = cache.put_if_absent(key, "rescuer", ttl=30)
        assert rescuer.took_over is True
        assert cache.get(key) == rescuer._replace(took_over=False)
        assert cache.put_if_absent(key, "rescuer", ttl=30).took_over is False
        renewed = cache.compare_and_set(key, "rescuer", ttl=30, version=rescuer.version)
        assert renewed.took_over is False
        cache.compare_and_delete(key, version=renewed.version)
        assert cache.put_if_absent(key, "next", ttl=30).took_over is False

    def test_a_grant_after_a_release_did_not_take_over(self, cache: ConditionalCache) -> None:
        """compare_and_delete freed the key: the next grant took nothing over."""
        key, first = held(cache, "polite")
        cache.compare_and_delete(key, version=first.version)
        assert cache.put_if_absent(key, "next", ttl=30).took_over is False

    def test_a_renewed_holder_that_lapsed_is_taken_over(self, cache: ConditionalCache) -> None:
        """A holder that renewed, then stopped (crashed) without freeing: taken over."""
        key, first = held(cache, "renewing", ttl=30)
        cache.compare_and_set(key, "renewing", ttl=self.short_ttl, version=first.version)
        self.let_expire()
        assert cache.put_if_absent(key, "rescuer", ttl=30).took_over is True

    def test_took_over_is_told_per_semaphore_slot(self, cache: ConditionalCache) -> None:
        """A semaphore's slots (``key#N``) each answer for their own last holder: the one
        that lapsed is taken over, the freed one and the never-granted one are not."""
        base = unique_key()
        lapsing, freed, fresh = base, base + "#1", base + "#2"
        cache.put_if_absent(lapsing, "a", ttl=self.short_ttl)
        cache.compare_and_delete(freed, version=cache.put_if_absent(freed, "b", ttl=30).version)
        self.let_expire()
        grants = [cache.put_if_absent(key, "new", ttl=30) for key in (lapsing, freed, fresh)]
        assert [entry.took_over for entry in grants] == [True, False, False]

    def test_a_takeover_that_lapses_in_turn_is_taken_over_again(
        self, cache: ConditionalCache
    ) -> None:
        """Two crashes in a row: each grant after a lapse says it took over."""
        key, _ = held(cache, "first", self.short_ttl)
        self.let_expire()
        assert cache.put_if_absent(key, "second", ttl=self.short_ttl).took_over is True
        self.let_expire()
        assert cache.put_if_absent(key, "third", ttl=30).took_over is True

    # -- fences -------------------------------------------------------------------------

    def test_fence_strictly_increases_across_put_delete_put(self, cache: ConditionalCache) -> None:
        """Releasing a key does not restart its fence: each new grant has a larger one."""
        key = unique_key()
        fences = []
        for i in range(4):
            entry = cache.put_if_absent(key, f"v{i}", ttl=30)
            fences.append(entry.fence)
            cache.compare_and_delete(key, version=entry.version)
        assert fences == sorted(set(fences))
        assert len(set(fences)) == 4

    def test_fence_strictly_increases_across_expiry_and_put(self, cache: ConditionalCache) -> None:
        """An expired key taken over gets a larger fence than the holder it replaced."""
        key, first = held(cache, "v1", self.short_ttl)
        self.let_expire()
        second = cache.put_if_absent(key, "v2", ttl=30)
        assert second.fence > first.fence

    def test_losing_put_does_not_consume_the_fence(self, cache: ConditionalCache) -> None:
        """A failed put leaves the live entry's fence alone (the next grant is still larger)."""
        key, first = held(cache, "v1")
        with pytest.raises(SimpleCacheConditionError):
            cache.put_if_absent(key, "v2", ttl=30)
        got = cache.get(key)
        assert got is not None
        assert got.fence == first.fence
        cache.compare_and_delete(key, version=first.version)
        assert cache.put_if_absent(key, "v3", ttl=30).fence > first.fence

    # -- compare_and_set ----------------------------------------------------------------

    def test_compare_and_set_keeps_fence_and_changes_version(self, cache: ConditionalCache) -> None:
        """A CAS on the current version keeps the fence and gets a new version."""
        key, first = held(cache, "v1")
        second = cache.compare_and_set(key, "v2", ttl=30, version=first.version)
        assert second.value == "v2"
        assert second.fence == first.fence
        assert second.version != first.version
        assert cache.get(key) == second

    def test_compare_and_set_with_the_same_value_still_changes_version(
        self, cache: ConditionalCache
    ) -> None:
        """A renewal writes the identical record; its version must change all the same."""
        key, first = held(cache, "same")
        second = cache.compare_and_set(key, "same", ttl=30, version=first.version)
        assert second.version != first.version
        with pytest.raises(SimpleCacheConditionError):
            cache.compare_and_set(key, "same", ttl=30, version=first.version)

    def test_compare_and_set_restarts_expiry(self, cache: ConditionalCache) -> None:
        """After a CAS with a fresh TTL the entry outlives its original expiry."""
        for _ in range(LATE_TRIES):
            started = time.monotonic()
            key, first = held(cache, "v1", self.short_ttl)
            time.sleep(self.short_ttl * 0.6)
            try:
                second = cache.compare_and_set(
                    key, "v2", ttl=self.short_ttl * 4, version=first.version
                )
                break
            except SimpleCacheConditionError:
                if time.monotonic() - started < self.short_ttl:
                    raise  # refused while the entry was live: a real failure
                # the machine took longer than the TTL to get here: not what is tested
        else:
            pytest.fail(f"the renewal came {self.short_ttl} s after its put {LATE_TRIES} times")
        assert second.expires_at > first.expires_at
        time.sleep(self.short_ttl * 0.6 + self.expiry_slack)  # past the first expiry
        assert cache.get(key) == second

    def test_compare_and_set_sets_expiry_to_now_plus_the_new_ttl(
        self, cache: ConditionalCache
    ) -> None:
        """The new TTL replaces the old one (it may also shorten it)."""
        key, first = held(cache, "v1")
        before = time.time()
        second = cache.compare_and_set(key, "v2", ttl=300, version=first.version)
        assert second.expires_at >= before + 300 - self.clock_tolerance
        third = cache.compare_and_set(key, "v3", ttl=5, version=second.version)
        assert third.expires_at <= time.time() + 5 + self.clock_tolerance

    def test_a_version_replaced_by_a_renewal_misses(self, cache: ConditionalCache) -> None:
        """After one CAS, the version it replaced can neither set nor delete the entry;
        the new one can."""
        key, first = held(cache, "v1")
        second = cache.compare_and_set(key, "v1", ttl=30, version=first.version)
        assert_refused(cache, key, first.version, second)
        cache.compare_and_delete(key, version=second.version)
        assert cache.get(key) is None

    # -- misses: neither compare_and_set nor compare_and_delete goes through ------------

    def test_a_wrong_version_misses(self, cache: ConditionalCache) -> None:
        """Naming a version the key never had sets and deletes nothing."""
        key, first = held(cache, "v1")
        assert_refused(cache, key, first.version + "x", first)

    def test_an_absent_key_misses(self, cache: ConditionalCache) -> None:
        """A key never written can be neither set (it is not created) nor deleted."""
        assert_refused(cache, unique_key(), "1", None)

    def test_a_freed_keys_old_version_misses(self, cache: ConditionalCache) -> None:
        """After a delete, its version never sets the key (it stays free). Deleting at it
        again is the same release sent twice: a cache that remembers its release says
        freed again (``remembers_releases``), one that does not misses."""
        key, first = held(cache, "v1")
        cache.compare_and_delete(key, version=first.version)
        with pytest.raises(SimpleCacheConditionError):
            cache.compare_and_set(key, "v2", ttl=30, version=first.version)
        if self.remembers_releases:
            assert not cache.compare_and_delete(key, version=first.version)
        else:
            with pytest.raises(SimpleCacheConditionError):
                cache.compare_and_delete(key, version=first.version)
        assert cache.get(key) is None

    def test_a_release_repeated_after_a_new_grant_never_frees_the_new_holder(
        self, cache: ConditionalCache
    ) -> None:
        """Once the key is granted again, the old version's release sent again never
        touches the new holder's record: it misses, or (a cache that remembers a release
        under the next grant: Redis) says freed again, and the new holder keeps the key.
        After that holder's own release, it misses."""
        key, first = held(cache, "v1")
        cache.compare_and_delete(key, version=first.version)
        second = cache.put_if_absent(key, "v2", ttl=30)
        with pytest.raises(SimpleCacheConditionError):
            cache.compare_and_set(key, "v1", ttl=30, version=first.version)
        with contextlib.suppress(SimpleCacheConditionError):
            cache.compare_and_delete(key, version=first.version)
        assert cache.get(key) == second
        cache.compare_and_delete(key, version=second.version)
        with pytest.raises(SimpleCacheConditionError):
            cache.compare_and_delete(key, version=first.version)

    def test_an_expired_entrys_own_version_misses(self, cache: ConditionalCache) -> None:
        """An expired entry can be neither resurrected nor deleted by its old holder."""
        key, first = held(cache, "v1", self.short_ttl)
        self.let_expire()
        assert_refused(cache, key, first.version, None)

    # -- compare_and_delete -------------------------------------------------------------

    def test_compare_and_delete_frees_the_key(self, cache: ConditionalCache) -> None:
        """Deleting with the current version frees the key: get reads None, and with nobody
        waiting the delete reports no waiter woken (None or False)."""
        key, entry = held(cache, "v1")
        assert not cache.compare_and_delete(key, version=entry.version)
        assert cache.get(key) is None

    def test_stale_holder_cannot_delete_the_new_holders_entry(
        self, cache: ConditionalCache
    ) -> None:
        """After expiry and takeover, the old version never frees the new holder's entry."""
        key, old = held(cache, "old", self.short_ttl)
        self.let_expire()
        new = cache.put_if_absent(key, "new", ttl=30)
        assert_refused(cache, key, old.version, new._replace(took_over=False))

    # -- wait ---------------------------------------------------------------------------

    def test_wait_returns_within_its_timeout_on_a_held_key(self, cache: ConditionalCache) -> None:
        """wait() on a key nobody frees comes back by its timeout (early is allowed)."""
        key = unique_key()
        cache.put_if_absent(key, "v1", ttl=30)
        start = time.monotonic()
        cache.wait([key], 0.2)
        assert time.monotonic() - start <= 0.2 + self.wait_slack

    def test_wait_with_a_tiny_timeout_returns_promptly(self, cache: ConditionalCache) -> None:
        """wait() with a near-zero timeout does not block."""
        key = unique_key()
        cache.put_if_absent(key, "v1", ttl=30)
        start = time.monotonic()
        cache.wait([key], 0.001)
        assert time.monotonic() - start <= self.wait_slack

    def test_wait_on_several_keys_returns_within_its_timeout(self, cache: ConditionalCache) -> None:
        """wait() accepts several keys (semaphore slots), some free, and stays bounded."""
        base = unique_key()
        cache.put_if_absent(base, "v1", ttl=30)
        start = time.monotonic()
        cache.wait([base, base + "#1", base + "#2"], 0.2)
        assert time.monotonic() - start <= 0.2 + self.wait_slack

    @pytest.mark.backends
    def test_a_forked_child_uses_the_cache_on_its_own(self, cache: ConditionalCache) -> None:
        """A cache inherited through fork() (Celery prefork, RQ work horses) works in the
        child, and the parent's keeps answering in step: no shared connection, no lock
        copied held."""
        key = unique_key("fork")
        cache.compare_and_delete(key, version=cache.put_if_absent(key, "p", ttl=30).version)
        children = [
            FORK.Process(target=_use_inherited_cache, args=(cache, f"{key}.{n}")) for n in range(3)
        ]
        for child in children:
            child.start()
        for _ in range(50):
            entry = cache.put_if_absent(key, "parent", ttl=30)
            assert cache.get(key) == entry
            cache.compare_and_delete(key, version=entry.version)
        for child in children:
            child.join(10)
            if child.exitcode is None:
                child.kill()
        assert [child.exitcode for child in children] == [0, 0, 0]

    # -- scan (the optional Scannable capability, which every cache here has) ------------

    def test_cache_can_scan(self, cache: ConditionalCache) -> None:
        """The cache offers the optional scan capability (operators' tools need it)."""
        assert isinstance(cache, Scannable)

    def test_scan_lists_exactly_the_live_entries_under_the_prefix(
        self, cache: ConditionalCache
    ) -> None:
        """Live entries under the prefix (semaphore slots included) are listed, each as get
        returns it; freed keys, keys under a sibling prefix and other keys are not."""
        base = unique_key("scan") + "."
        index_prefix(cache, base)  # as a Mutex under this prefix would
        held_keys = [base + "a", base + "b.c", base + "d#1"]
        for key in held_keys:
            cache.put_if_absent(key, f"value of {key}", ttl=30)
        freed = base + "freed"
        cache.compare_and_delete(freed, version=cache.put_if_absent(freed, "f", ttl=30).version)
        cache.put_if_absent(base[:-1] + "-sibling", "s", ttl=30)
        cache.put_if_absent(unique_key(), "elsewhere", ttl=30)
        waited_on(cache, base + "waited")  # side records (waiter marks, fences) stay hidden
        listed = dict(scannable(cache).scan(base))
        assert set(listed) == {*held_keys, base + "waited"}
        for key, entry in listed.items():
            assert cache.get(key) == entry

    def test_scan_never_lists_expired_entries(self, cache: ConditionalCache) -> None:
        """An entry whose ttl ran out is not listed, though a live neighbour is."""
        base = unique_key("scan") + "."
        index_prefix(cache, base)
        cache.put_if_absent(base + "short", "v", ttl=self.short_ttl)
        cache.put_if_absent(base + "long", "v", ttl=30)
        self.let_expire()
        assert [key for key, _ in scannable(cache).scan(base)] == [base + "long"]

    @pytest.mark.parametrize("special", ["*", "?", "[x]", "%", "_", ".", "^", "$", "\\", "(", "+"])
    def test_scan_prefix_characters_are_literal(
        self, cache: ConditionalCache, special: str
    ) -> None:
        """Glob (Redis), LIKE (SQL) and regex characters in the prefix match only
        themselves: the decoys match the prefix read as a pattern, never literally."""
        if special in self.foreign_key_chars:
            pytest.skip(f"this server does not keep {special!r} in a key verbatim")
        base = unique_key("scan") + "."
        index_prefix(cache, base + "a" + special)
        ours = [base + "a" + special, base + "a" + special + "tail", base + "a" + special + "#1"]
        decoys = [base + "aX", base + "aXtail", base + "a", base + "ab" + special]
        for key in ours + decoys:
            cache.put_if_absent(key, "v", ttl=30)
        listed = sorted(key for key, _ in scannable(cache).scan(base + "a" + special))
        assert listed == sorted(ours)


class NotifyContract:
    """Caches whose ``wait()`` a release wakes: mix in with CacheContract. A poll would
    return at the wait's timeout (5 s here); a woken wait within ``wake_bound``."""

    # A woken wait against a timed-out one (5 s): 0.5 s tells them apart on a loaded
    # 2-core machine (0.05 s failed once in CI for DiskCache); speed is bench/'s to show.
    wake_bound: float = 0.5
    long_wait: float = 5.0

    def test_wait_is_woken_by_a_release_in_another_thread(self, cache: ConditionalCache) -> None:
        """wait() returns within wake_bound of the release, not at its timeout."""
        key = unique_key()
        version = waited_on(cache, key).version
        release = ReleaseLater(0.05, lambda: cache.compare_and_delete(key, version=version))
        cache.wait([key], self.long_wait)
        assert release.woke() < self.wake_bound

    def test_wait_on_several_slots_is_woken_by_any(self, cache: ConditionalCache) -> None:
        """A waiter on a semaphore's slots is woken by the release of any one of them."""
        base = unique_key()
        keys = [base, base + "#1", base + "#2"]
        entries = [waited_on(cache, k) for k in keys]
        version = entries[2].version
        release = ReleaseLater(0.05, lambda: cache.compare_and_delete(keys[2], version=version))
        cache.wait(keys, self.long_wait)
        assert release.woke() < self.wake_bound

    def test_a_release_before_the_wait_is_not_lost(self, cache: ConditionalCache) -> None:
        """The lost wake-up race: the release lands between the waiter's failed put and its
        wait. wait() still returns at once."""
        key = unique_key()
        cache.compare_and_delete(key, version=waited_on(cache, key).version)
        start = time.monotonic()
        cache.wait([key], self.long_wait)
        assert time.monotonic() - start < self.wake_bound


# -- the smoke run of a construction variant -----------------------------------------------

# A cache built another way (a pool, a connection or client the caller passes, a factory,
# decoded replies, a restricted user, the client's clock, a fake of the server) runs the
# same driver calls as the cache its backend's full contract runs on. What the variant can
# break is its wiring: replies decoded otherwise, a privilege missing, its own expiry
# filter, a connection in the wrong mode. These tests touch each method, each reply shape,
# expiry and fences, a refused condition of each kind, scan, and a wait; the full contract
# runs once per backend and face.
SMOKE = (
    "test_cache_has_a_name_and_the_five_methods",
    "test_put_if_absent_then_get_returns_the_entry",
    "test_values_round_trip_byte_for_byte",
    "test_second_put_if_absent_loses",
    "test_entry_fields_have_the_documented_types",
    "test_put_if_absent_on_an_expired_key_wins",
    "test_get_returns_none_for_an_expired_entry",
    "test_a_grant_after_a_lapse_took_over",
    "test_fence_strictly_increases_across_put_delete_put",
    "test_fence_strictly_increases_across_expiry_and_put",
    "test_compare_and_set_keeps_fence_and_changes_version",
    "test_a_wrong_version_misses",
    "test_an_expired_entrys_own_version_misses",
    "test_stale_holder_cannot_delete_the_new_holders_entry",
    "test_wait_returns_within_its_timeout_on_a_held_key",
    "test_a_forked_child_uses_the_cache_on_its_own",
    "test_scan_lists_exactly_the_live_entries_under_the_prefix",
)
NOTIFY_SMOKE = ("test_wait_is_woken_by_a_release_in_another_thread",)


class ContractSmoke(CacheContract):
    """The smoke run of the contract (``SMOKE``), for a construction variant of a cache
    whose full contract runs elsewhere: subclass it as you would ``CacheContract``."""


class NotifySmoke(NotifyContract):
    """The wake-up of ``NotifyContract`` (``NOTIFY_SMOKE``), for a variant of a cache that
    notifies: mix in with ``ContractSmoke``."""


def _keep_only(suite: type, kept: tuple[str, ...], full: type) -> None:
    tests = {name for base in full.__mro__ for name in vars(base) if name.startswith("test_")}
    unknown = set(kept) - tests
    assert not unknown, f"not tests of {full.__name__}: {sorted(unknown)}"
    for name in tests - set(kept):
        setattr(suite, name, None)  # pytest collects no test under a name set to None


_keep_only(ContractSmoke, SMOKE, CacheContract)
_keep_only(NotifySmoke, NOTIFY_SMOKE, NotifyContract)
