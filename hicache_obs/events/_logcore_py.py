"""The event log's append path in pure Python: the specification ``hicache_obs/_logcore.c``
is tested against, and what runs where ``HICACHE_OBS_NO_EXTENSIONS`` names ``logcore``
(see ``hicache_obs._native``). ``EventLog`` subclasses :class:`LogCore`.

The same contract as the C module, error messages included
(``tests/native/test_differential_logcore.py`` compares the two):

- ``emit(cls, /, **fields)``: refuse a header field (seq, ts_ns, rank) among the fields;
  take the log's lock; build ``cls(**fields, seq=, ts_ns=time.time_ns(), rank=)`` (a
  failed construction spends no seq; a class that emitted while it was built, or returned
  something that does not carry the seq it was given, is refused); append it to the
  retained deque, wait for room in every blocking sink runner, store it in the ring,
  advance ``published``; deliver it to every subscriber in order. A subscriber's
  ``Exception`` goes to ``_subscriber_failed(fn, ev, exc)`` and the rest still run; an
  event emitted while subscribers run waits in ``pending`` and is delivered after the
  current one reached every subscriber; a ``BaseException`` is held until everything
  queued was delivered, then raised. The lock is released on every path out.
- Stages (the ``stages`` list bound, when not None): before the event is stored, each
  stage is called with it in order; one that raises an ``Exception`` goes to
  ``_subscriber_failed(stage, ev, exc)`` and the event goes on, anything else it raises
  leaves the event unstored (no seq spent); a stage that emitted is a ``RuntimeError``;
  what they found, ``[(stage, findings), ...]`` for each that returned something true,
  goes to ``_place_findings(ev, found)``, which stores the findings and then the event
  and returns the event stored (what ``emit`` returns).
- Hand-off (feeders): the outermost publish calls ``handoff(start, events)`` with the
  ring's events ``[handoff_next, published)`` once ``batch`` wait or ``interval`` passed
  since the last hand-off (monotonic clock: the module-level ``_now``, which tests may
  replace); ``_handoff_now()`` at once; ``_wait_handoff()`` sleeps in ``select.poll`` on
  the two fds (the GIL released) until a hand-off is due: when nothing waits it looks
  again every ``interval``, as the C loop does, and never spins.
- ``_close()``: the sinks' stopping point (``closed_at``); later events are still log
  events but reach no ring slot, no runner, no hand-off, and are counted in
  ``_after_close`` (the first one reported to ``_appended_after_close(ev)``).
- ``gap_free_run(events)``: ``(rank, first seq)`` when the list is one rank's gap-free run.

It imports nothing of ``hicache_obs.events`` (``hicache_obs._native`` loads it while that
package is being imported).
"""

from __future__ import annotations

import operator
import select
import time
from typing import Any

__all__ = ["LogCore", "gap_free_run"]

_MAX = (1 << 63) - 1
_MIN = -(1 << 63)
_HEADER = frozenset(("seq", "ts_ns", "rank"))
_now = time.monotonic_ns  # the hand-off's clock (a hook: tests replace it)
_time_ns = time.time_ns


def _ll(v: Any) -> int:
    x = v if type(v) is int else operator.index(v)
    if not _MIN <= x <= _MAX:
        raise OverflowError("int too big to convert")
    return x


def _double(v: Any) -> float:
    """``v`` as a C double, as the C argument parsing takes it (a float, ``__float__`` or ``__index__``)."""
    if isinstance(v, float):
        return float(v)
    if hasattr(type(v), "__float__") or hasattr(type(v), "__index__"):
        return float(v)
    raise TypeError(f"must be real number, not {type(v).__name__}")


class LogCore:
    """The event log's append path (see the module's docstring)."""

    # the C struct's fields, zero before __init__/_bind
    rank: Any = None
    _c_seq = 0
    _c_published = 0
    _c_dispatching = False
    _c_closed = False
    _c_closed_at = 0
    _c_after_close = 0
    _c_ring: list[Any] | None = None
    _c_ring_size = 0
    _c_events_append: Any = None
    _c_subscribers: list[Any] = []  # replaced by _bind, never mutated here
    _c_blocking: list[Any] = []
    _c_pending: Any = None
    _c_stages: list[Any] | None = None
    _c_acquire: Any = None
    _c_release: Any = None
    _c_handoff: Any = None
    _c_handoff_next = 0
    _c_handoff_batch = 0
    _c_handoff_interval = 0
    _c_handoff_last = 0
    _c_handoff_on = False
    _c_handoff_busy = False

    # ------------------------------------------------------------ counters
    @property
    def _seq(self) -> int:
        """the next seq to hand out"""
        return self._c_seq

    @_seq.setter
    def _seq(self, value: Any) -> None:
        # never below what is published (those seqs are taken), never the end of the seq space
        self._c_seq = _counter(value, "_seq", self._c_published, _MAX - 1)

    @_seq.deleter
    def _seq(self) -> None:
        raise AttributeError("_seq cannot be deleted")

    @property
    def published(self) -> int:
        """events stored in the ring; sink runners read seqs below it"""
        return self._c_published

    @published.setter
    def published(self, value: Any) -> None:
        self._c_published = _counter(value, "published", 0, self._c_seq)

    @published.deleter
    def published(self) -> None:
        raise AttributeError("published cannot be deleted")

    @property
    def _dispatching(self) -> bool:
        return self._c_dispatching

    @property
    def _closed(self) -> bool:
        return self._c_closed

    @property
    def _closed_at(self) -> int:
        return self._c_closed_at

    @property
    def _after_close(self) -> int:
        return self._c_after_close

    @property
    def _handoff_next(self) -> int:
        return self._c_handoff_next

    # --------------------------------------------------------------- binding
    def _bind(
        self,
        ring: list[Any],
        events: Any,
        subscribers: list[Any],
        blocking: list[Any],
        pending: Any,
        lock: Any,
        stages: list[Any] | None = None,
    ) -> None:
        """Give the core the log's ring, retained deque, subscribers, blocking runners, pending deque, lock and
        (optional) stages."""
        for position, v in ((1, ring), (3, subscribers), (4, blocking)):
            if not isinstance(v, list):
                raise TypeError(f"_bind() argument {position} must be list, not {type(v).__name__}")
        if stages is not None and not isinstance(stages, list):
            raise TypeError(f"_bind() argument 'stages' must be list or None, not {type(stages).__name__:.100}")
        if self._c_dispatching or self._c_handoff_busy:
            raise RuntimeError("_bind() while the log delivers events")
        n = len(ring)
        if n < 1 or n & (n - 1):
            raise ValueError(f"the ring's length must be a power of two, got {n}")
        events_append = events.append
        acquire, release = lock.acquire, lock.release
        self._c_events_append = events_append
        self._c_acquire = acquire
        self._c_release = release
        self._c_ring = ring
        self._c_ring_size = n
        self._c_subscribers = subscribers
        self._c_blocking = blocking
        self._c_pending = pending
        self._c_stages = stages

    def _ring_ok(self) -> list[Any]:
        ring = self._c_ring
        if ring is not None and len(ring) == self._c_ring_size and self._c_ring_size > 0:
            return ring
        raise RuntimeError(
            f"the log's ring was resized: {len(ring) if ring is not None else 0} slots, bound with "
            f"{self._c_ring_size}; the event is not stored"
        )

    # ------------------------------------------------------------------ emit
    def emit(self, *args: Any, **fields: Any) -> Any:
        """emit(cls, /, **fields): create, append and deliver one event of type ``cls``."""
        if len(args) != 1:
            raise TypeError(f"emit() takes the event class as its only positional argument, got {len(args)}")
        release = self._c_release
        if release is None:
            raise RuntimeError("emit() on an EventLog whose __init__ did not run")
        cls = args[0]
        if not _HEADER.isdisjoint(fields):
            try:
                name = cls.__name__
            except Exception:
                name = repr(cls)
            raise TypeError(f"emit({name}, ...) stamps seq, ts_ns and rank itself; got {sorted(fields)!r}")
        self._c_acquire()
        try:
            self._ring_ok()
            seq = self._c_seq
            if seq < 0 or seq == _MAX:
                raise OverflowError(f"emit(): the log's seq space is spent (next seq {seq})")
            ev = cls(**fields, seq=seq, ts_ns=_time_ns(), rank=self.rank)
            if self._c_seq != seq:  # the class emitted while it was built: two events would share a seq
                raise RuntimeError(
                    f"emit(): building the event took seq {seq} for another event (the event class emitted "
                    "one); this event is not appended"
                )
            try:
                got = ev.seq
            except Exception:
                got = None
            if type(got) is not int or got != seq:  # no event of this log: nothing spent
                raise TypeError(
                    f"emit(): the event class returned {type(ev).__name__:.100} whose seq is {got!r}, not the seq "
                    f"{seq} it was given; it is not appended (no seq spent)"
                )
            stages = self._c_stages
            if stages is not None and len(stages) > 0:
                stored = self._run_stages(ev, seq)
                if stored is not None:  # _place_findings stored the findings, then the event
                    ev = stored
                    release()
                    return ev
            self._c_seq = seq + 1
            self._store(ev, seq)
        except BaseException:
            try:
                release()
            except BaseException:
                pass  # the first error wins
            raise
        release()
        return ev

    def _run_stages(self, ev: Any, seq: int) -> Any:
        """The stages on ``ev`` (built with ``seq``, not stored): None when they found nothing,
        else the event ``_place_findings`` stored."""
        found: list[tuple[Any, Any]] | None = None
        stages = self._c_stages
        i = 0
        while stages is not None and i < len(stages):
            stage = stages[i]
            i += 1
            try:
                r = stage(ev)
            except Exception as exc:
                self._subscriber_failed(stage, ev, exc)  # type: ignore[attr-defined]
                continue
            if r is not None and r:
                if found is None:
                    found = []
                found.append((stage, r))
        if self._c_seq != seq:
            raise RuntimeError(
                f"emit(): a stage emitted into the log while it looked at {type(ev).__name__:.100} seq {seq}; "
                "a stage returns its findings instead. This event is not appended"
            )
        if found is None:
            return None
        return self._place_findings(ev, found)  # type: ignore[attr-defined]

    def _publish(self, ev: Any, /) -> None:
        """Store and deliver an event whose seq the caller (EventLog.append, holding the lock) just spent."""
        if self._c_release is None:
            raise RuntimeError("append() on an EventLog whose __init__ did not run")
        seq_obj = ev.seq
        seq = seq_obj if isinstance(seq_obj, int) else -1
        if not _MIN <= seq <= _MAX or seq != self._c_seq - 1 or seq < self._c_published:
            raise ValueError(
                f"_publish(): the event's seq must be the one just spent ({self._c_seq - 1}, "
                f"{self._c_published} published), got {seq_obj!r}"
            )
        self._ring_ok()
        self._store(ev, seq)

    def _store(self, ev: Any, seq: int) -> None:
        """Store event ``seq`` (its seq spent), then deliver it, or queue it when subscribers run.

        Once the seq is spent the event reaches the ring whatever fails before (a
        KeyboardInterrupt inside a blocking runner's ``wait_for_room``): the error is
        raised after the store, and the event is then not delivered to subscribers."""
        closed = self._c_closed
        try:
            self._c_events_append(ev)
            if closed:
                self._c_after_close += 1
                if self._c_after_close == 1:
                    self._appended_after_close(ev)  # type: ignore[attr-defined]
            else:
                blocking = self._c_blocking
                i = 0
                while i < len(blocking):
                    blocking[i].wait_for_room()
                    i += 1
        finally:
            if not closed:
                ring = self._ring_ok()  # wait_for_room runs Python code
                ring[seq & (self._c_ring_size - 1)] = ev
                if self._c_published < seq + 1:  # never backwards, whatever ran in between
                    self._c_published = seq + 1
        if self._c_dispatching:
            self._c_pending.append(ev)
            return
        self._c_dispatching = True
        try:
            held = self._deliver(ev, None)
            pending = self._c_pending
            while len(pending) > 0:  # what subscribers emitted, in log order, after the current event
                held = self._deliver(pending.popleft(), held)
        finally:
            self._c_dispatching = False
        if held is not None:
            raise held
        if self._c_handoff is not None and not self._c_handoff_busy and not self._c_closed:
            waiting = self._c_published - self._c_handoff_next
            if waiting >= self._c_handoff_batch or (
                waiting > 0 and _now() - self._c_handoff_last >= self._c_handoff_interval
            ):
                self._handoff_run()

    def _deliver(self, ev: Any, held: BaseException | None) -> BaseException | None:
        """Hand one event to every subscriber, in order; returns the first BaseException held."""
        subs = self._c_subscribers
        i = 0
        while i < len(subs):
            fn = subs[i]
            i += 1
            try:
                fn(ev)
            except Exception as exc:
                try:
                    self._subscriber_failed(fn, ev, exc)  # type: ignore[attr-defined]
                except BaseException as again:
                    held = held or again
            except BaseException as stop:  # KeyboardInterrupt: raised once everything is delivered
                held = held or stop
        return held

    # -------------------------------------------------------------- hand-off
    def _handoff_run(self) -> None:
        fn = self._c_handoff
        if fn is None or self._c_handoff_busy:
            return
        start, end = self._c_handoff_next, self._c_published
        if self._c_closed and end > self._c_closed_at:  # what came after close() goes to no receiver
            end = self._c_closed_at
        if end <= start:
            return
        ring = self._ring_ok()
        size = self._c_ring_size
        if end - start > size:
            start = end - size
        mask = size - 1
        batch = [ring[s & mask] for s in range(start, end)]
        self._c_handoff_next = end  # taken, whatever the callable does with them
        self._c_handoff_last = _now()
        self._c_handoff_busy = True
        try:
            fn(start, batch)
        finally:
            self._c_handoff_busy = False

    def _set_handoff(self, fn: Any, next: Any, batch: Any, interval: Any, /) -> None:
        """_set_handoff(fn, next, batch, interval): hand events from seq next on to fn(start, events)."""
        nxt, size, secs = _ll(next), _ll(batch), _double(interval)
        if fn is not None and not callable(fn):
            raise TypeError(f"_set_handoff(): the hand-off must be callable or None, got {type(fn).__name__:.100}")
        if self._c_ring is None:
            raise RuntimeError("_set_handoff() on an EventLog whose __init__ did not run")
        half = len(self._c_ring) // 2
        if size < 1 or size > half:
            raise ValueError(f"hand-off batch must be between 1 and half the ring ({half}), got {size}")
        if not 0 < secs < 1e6:
            raise ValueError(f"hand-off interval must be above 0 seconds (and sane), got {interval!r}")
        if nxt < 0:
            raise ValueError(f"hand-off start must be a seq >= 0, got {nxt}")
        self._c_handoff_on = False
        if fn is None:
            self._c_handoff = None
            return
        self._c_handoff = fn
        self._c_handoff_batch = size
        self._c_handoff_interval = int(secs * 1e9)
        self._c_handoff_next = nxt
        self._c_handoff_last = _now()
        self._c_handoff_on = True

    def _handoff_now(self) -> None:
        """Hand off whatever waits, now (the caller holds the log's lock)."""
        self._handoff_run()

    def _wait_handoff(self, timeout: Any, stop_fd: Any, out_fd: Any, /) -> int:
        """_wait_handoff(timeout, stop_fd, out_fd) -> 0 timeout, 1 due, 2 out_fd writable, 3 stop_fd readable.

        Sleeps in ``select.poll`` (the GIL released): a watcher of an idle producer."""
        secs = _double(timeout)
        stop, out = _c_int(stop_fd), _c_int(out_fd)
        if not 0 <= secs < 1e6:
            raise ValueError(f"_wait_handoff(): timeout must be >= 0 seconds, got {timeout!r}")
        deadline = _now() + int(secs * 1e9)
        poller = select.poll()
        if stop >= 0:
            poller.register(stop, select.POLLIN)
        if out >= 0 and out != stop:
            poller.register(out, select.POLLOUT)
        while True:
            now = _now()
            interval = self._c_handoff_interval
            end = self._c_published
            if self._c_closed and end > self._c_closed_at:
                end = self._c_closed_at
            waiting = end - self._c_handoff_next if self._c_handoff_on else 0
            due = self._c_handoff_last + interval
            if waiting > 0 and now >= due:
                return 1
            if now >= deadline:
                return 0
            wait = deadline - now
            look = due - now if waiting > 0 else interval  # nothing waits: look again later
            if 0 < look < wait:
                wait = look
            ready = poller.poll((wait + 999_999) // 1_000_000)
            for fd, _ in ready:
                if fd == stop:
                    return 3
            if ready and out >= 0:
                return 2

    def _close(self) -> None:
        """Stop the sinks at what is published now: later events reach none, counted (the caller holds the lock)."""
        if not self._c_closed:
            self._c_closed_at = self._c_published
            self._c_closed = True


def _counter(value: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__:.100}")
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be in {lo}..{hi}, got {value!r}")
    return int(value)


def _c_int(v: Any) -> int:
    x = v if type(v) is int else operator.index(v)
    if x > 2**31 - 1:
        raise OverflowError("signed integer is greater than maximum")
    if x < -(2**31):
        raise OverflowError("signed integer is less than minimum")
    return x


def gap_free_run(events: Any, /) -> tuple[Any, Any] | None:
    """(rank, first seq) when the events are one rank's gap-free run of seqs in order; None
    otherwise (or when the list is empty)."""
    if not isinstance(events, list):
        raise TypeError(f"gap_free_run() takes a list of events, got {type(events).__name__:.100}")
    if not events:
        return None
    rank0: Any = None
    first_obj: Any = None
    first = 0
    i = 0
    while i < len(events):
        ev = events[i]
        seq = ev.seq
        rank = ev.rank
        v = seq if type(seq) is int else operator.index(seq)
        if not _MIN <= v <= _MAX:
            return None
        if i == 0:
            first, rank0, first_obj = v, rank, seq
        elif not (first <= _MAX - i and v == first + i) or not (rank is rank0 or rank == rank0):
            return None
        i += 1
    return (rank0, first_obj)
