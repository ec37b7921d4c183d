"""The in-memory event log: append-only, gap-free ``seq``, subscribers, sinks.

These are the operations subscribers, sinks, feeders and the controller use; no module
reaches past them into the log's private members (ruff's SLF001 is on for the package).

Write:

- ``emit(cls, **fields)``: stamp the header (seq, ts_ns, rank), append, deliver
  (compiled: ``hicache_obs/_logcore.c``)
- ``append(event)``: append a pre-built event whose ``seq`` is the next one

Stages (the live auditor):

- ``add_stage(stage, backfill=True)``: ``stage(event)`` runs in the producer's thread on
  every later event before it is stored or reaches a subscriber or sink, and returns what
  it found about it (findings with a ``to_event(seq=, ts_ns=)``), or nothing. Each finding
  becomes an event stored right *before* the event that revealed it, with that event's
  ``ts_ns``; the revealing event then takes the next seq (``emit`` returns the event as
  stored). So a reader that sees an op's completion has seen every verdict about it. At
  ``close()`` each stage's ``finish()`` runs before the sinks stop. Returns a remove callable.

Subscribers and sinks:

- ``subscribe(fn, first=False, backfill=False)``: a synchronous subscriber, called
  inline in log order (bookkeeping folds, the live auditor); with ``backfill`` it first
  gets the retained events, atomically; returns an unsubscribe callable
- ``add_sink(sink)``: an asynchronous :class:`~hicache_obs.events._sinks.Sink`,
  fed in batches by a worker thread that reads the log's ring of recent events
- ``read(start, end)``: the ring's events ``[start, end)`` still intact (a sink
  runner's batch; what the producer lapped is left out, for the reader to count)
- ``sinks``, ``subscriber_errors``: the runners and feeders; the failures per subscriber

Feeders (a sink host's pipe, fed from the producer's own thread):

- ``attach_feeder(feeder)``: a receiver whose ``take(start, events)`` never blocks,
  handed batches from the producer's own thread every ``batch`` events or ``interval``
  seconds: no worker thread, so no GIL hand-over while the controller runs; returns the
  first seq it gets. ``detach_feeder(feeder)`` stops it.
- ``feeder_handle(feeder)``: its :class:`FeederHandle` (``start_seq``, ``handoff_now()``,
  ``wait(timeout, wake_fd, out_fd)`` -> :class:`HandoffWake`, ``detach()``), what the
  feeder's own threads use

Owner:

- ``bind_owner(controller)``, ``owner``: the one open controller whose bookkeeping is
  the fold of this log (a second one is a ``ConfigError``)

Read and lifecycle:

- ``events()``: the events still retained; ``overflowed``: how many the bound evicted
- ``published`` (events stored in the ring), ``next_seq``, ``ring_size``
- ``flush()``, ``close()``; ``closed_at``, ``dropped_after_close``

Events emitted while subscribers run are delivered after the current event reached
every subscriber, so every subscriber sees log order.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any, TypeVar

import msgspec

from .._native import LogCore  # compiled, or a ConfigError (hicache_obs._native)
from ..errors import ConfigError, SequenceError
from ._schema import Event

__all__ = ["EventLog", "FeederHandle", "HandoffWake", "Stage", "Subscriber"]

Subscriber = Callable[[Event], None]
#: ``stage(event) -> findings or None``: each finding has ``to_event(seq=, ts_ns=)`` (see ``add_stage``).
Stage = Callable[[Event], Any]
E = TypeVar("E", bound=Event)

_log = logging.getLogger("hicache_obs.events")


class HandoffWake(IntEnum):
    """Why :meth:`FeederHandle.wait` returned."""

    TIMEOUT = 0  #: the timeout passed
    DUE = 1  #: events wait and the interval since the last hand-off passed (an idle producer)
    WRITABLE = 2  #: ``out_fd`` can be written
    WOKEN = 3  #: ``wake_fd`` can be read


class FeederHandle:
    """What a feeder (``attach_feeder``) does with its log, from its own threads.

    - ``start_seq``: the first seq the feeder is handed (what ``attach_feeder`` returned)
    - ``handoff_now()``: under the log's lock, hand what waits to the feeders now (a flush,
      or a watcher that found the producer idle); False once the feeder is detached
    - ``wait(timeout, wake_fd, out_fd)``: sleep without the GIL until a hand-off is due,
      ``wake_fd`` is readable or ``out_fd`` writable (-1: not watched), at most ``timeout``
      seconds; returns a :class:`HandoffWake`
    - ``detach()``: under the log's lock, hand over what waits, then stop handing events to
      the feeder; returns ``published`` at that instant (the feeder was handed every event
      below it). Idempotent.
    """

    __slots__ = ("feeder", "start_seq", "_handoff", "_wait", "_detach")

    def __init__(
        self,
        feeder: Any,
        start_seq: int,
        handoff: Callable[[Any], bool],
        wait: Callable[[float, int, int], int],
        detach: Callable[[Any], int],
    ) -> None:
        self.feeder = feeder
        self.start_seq = start_seq
        self._handoff = handoff
        self._wait = wait
        self._detach = detach

    def handoff_now(self) -> bool:
        return self._handoff(self.feeder)

    def wait(self, timeout: float, wake_fd: int = -1, out_fd: int = -1) -> HandoffWake:
        return HandoffWake(self._wait(timeout, wake_fd, out_fd))

    def detach(self) -> int:
        return self._detach(self.feeder)


class EventLog(LogCore):
    """Append-only log of events with synchronous subscribers and async sinks.

    ``capacity`` bounds how many events stay in memory (oldest evicted first,
    counted in ``overflowed``); subscribers and sinks still see every event.

    ``emit`` is the compiled ``LogCore.emit`` (``hicache_obs/_logcore.c``); ``append``
    checks an event built elsewhere and hands it to the same compiled store and delivery.
    """

    # inherited from LogCore: emit(cls, /, **fields) stamps the header (seq, ts_ns, rank;
    # a header field among the fields is a TypeError), stores the event and delivers it
    # to every subscriber in order; a failed construction spends no seq. Its attributes
    # rank, published (events stored in the ring; sinks read seqs below it), _seq and
    # _dispatching live in the C struct.

    def __init__(self, *, rank: int = 0, capacity: int | None = 1_000_000, ring_size: int = 1 << 16) -> None:
        if ring_size < 1 << 12 or ring_size & (ring_size - 1):
            raise ConfigError(f"ring_size must be a power of two >= 4096, got {ring_size}")
        self.rank = rank
        self.ring_size = ring_size
        self._mask = ring_size - 1
        self._ring: list[Any] = [None] * ring_size
        self.published = 0
        self._blocking: list[Any] = []
        self.capacity = capacity
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = 0
        self._subscribers: list[Subscriber] = []
        self._subscriber_errors: dict[str, int] = {}
        self._sinks: list[Any] = []
        self._feeders: list[Any] = []
        self._feeder_starts: dict[int, int] = {}  # id(feeder) -> the first seq it was handed
        self._feeder_cadence = (256, 0.05)
        self._lock = threading.RLock()
        self._owner: weakref.ref[Any] | None = None  # the controller whose bookkeeping is this log's fold
        self._pending: deque[Event] = deque()
        self._stages: list[Stage] = []
        self._bind(
            ring=self._ring,
            events=self._events,
            subscribers=self._subscribers,
            blocking=self._blocking,
            pending=self._pending,
            lock=self._lock,
            stages=self._stages,
        )

    # ------------------------------------------------------------------ write
    @property
    def overflowed(self) -> int:
        """Events the ``capacity`` bound evicted from memory (every event was appended once)."""
        return self._seq - len(self._events)

    def append(self, event: E) -> E:
        """Append an event built elsewhere; its ``seq`` must be the next one.

        The log's stages see it first. A stage that finds something about it makes this a
        :class:`~hicache_obs.errors.SequenceError` and nothing is appended: the findings
        would have to come before the event, so its seq could not be kept (emit the event
        instead, or copy an audited log into a log without an audit stage).
        """
        with self._lock:
            if event.seq != self._seq:
                raise SequenceError(
                    f"event seq {event.seq} appended where seq {self._seq} was expected "
                    f"(type {type(event).__name__})"
                )
            if self._stages:
                found = [f for _, got in self._stage_findings(event) for f in got]
                if found:
                    raise SequenceError(
                        f"append({type(event).__name__} seq {event.seq}): this log's stages found "
                        f"{len(found)} violation(s) ({', '.join(sorted({str(getattr(f, 'rule', f)) for f in found}))}) "
                        "that must come before the event, so its seq cannot be kept; nothing was appended "
                        "(emit() it, or append to a log without an audit stage)"
                    )
            self._seq += 1
            self._publish(event)  # what emit() does after building its event (compiled)
            return event

    # ---------------------------------------------------------------- stages
    def add_stage(self, stage: Stage, *, backfill: bool = True) -> Callable[[], None]:
        """Run ``stage(event)`` on every later event before it is stored or delivered.

        ``stage`` returns what it found about the event (a list of findings, each with
        ``to_event(seq=, ts_ns=)``: an :class:`~hicache_obs.events._audit.Finding`), or
        None/empty. The findings' events are stored before the event, with its ``ts_ns``
        and the seqs it would have had; the event is re-stamped with the next seq and
        ``emit`` returns that event. A stage with a ``placed(event)`` method is told the
        stored event after its findings were placed; one with ``finish()`` has it called
        by :meth:`close` before the sinks stop (it may emit: end-of-log findings). A stage
        that raises an ``Exception`` is counted in :attr:`subscriber_errors` and the event
        goes on; it must not emit into this log. With ``backfill`` the stage first sees
        the retained events: what it finds about them is stored now, after them (they are
        published already). Returns a callable that removes the stage.

        The compiled ``emit`` runs the stages (``hicache_obs/_logcore.c``); the rare path,
        placing findings, is :meth:`_place_findings`.
        """
        if not callable(stage):
            raise ConfigError(f"a stage must be callable (event -> findings), got {type(stage).__name__}")
        with self._lock:
            self._refuse_if_closed("add_stage", stage)
            if any(s is stage for s in self._stages):
                raise ConfigError(f"add_stage({_name(stage)}): that stage is already on this log")
            if backfill:
                for ev in list(self._events):
                    for _, found in self._stage_findings(ev, (stage,)):
                        for f in found:  # the event is out already: its findings come after it
                            self._store_finding(f, ev.ts_ns)
            self._stages.append(stage)

        def remove() -> None:
            with self._lock:
                for i, s in enumerate(self._stages):
                    if s is stage:
                        del self._stages[i]
                        break

        return remove

    @property
    def stages(self) -> list[Stage]:
        return list(self._stages)

    def _stage_findings(self, ev: Event, stages: Iterable[Stage] | None = None) -> list[tuple[Stage, Any]]:
        """``(stage, findings)`` of each stage that found something about ``ev`` (lock held)."""
        out: list[tuple[Stage, Any]] = []
        for stage in list(self._stages) if stages is None else stages:
            try:
                found = stage(ev)
            except Exception as exc:
                self._subscriber_failed(stage, ev, exc)
                continue
            if found:
                out.append((stage, found))
        return out

    def _store_finding(self, f: Any, ts_ns: int) -> Event:
        v = f.to_event(seq=self._seq, ts_ns=ts_ns)
        self._seq += 1
        self._publish(v)
        return v

    def _place_findings(self, ev: Event, found: list[tuple[Stage, Any]]) -> Event:
        """Store what the stages found about ``ev`` (built, not stored: its seq is the next),
        then ``ev`` re-stamped with the seq after them; returns the event stored. The compiled
        (or pure) emit calls it, under the lock, when a stage found something."""
        for _, got in found:
            for f in got:
                self._store_finding(f, ev.ts_ns)
        ev = msgspec.structs.replace(ev, seq=self._seq)
        self._seq += 1
        self._publish(ev)
        for stage, _ in found:
            placed = getattr(stage, "placed", None)
            if placed is not None:
                placed(ev)
        return ev

    def _appended_after_close(self, ev: Event) -> None:
        """The compiled store's report of the first event appended after ``close()``."""
        _log.warning(
            "%s seq=%d appended to the log after close(): no sink gets it (counted in dropped_after_close)",
            type(ev).__name__,
            ev.seq,
        )

    def _refuse_if_closed(self, what: str, receiver: Any) -> None:
        if self._closed:  # its stopping point would lie behind its start
            raise ConfigError(f"{what}({type(receiver).__name__}) on a closed EventLog: no sink gets events any more")

    @property
    def dropped_after_close(self) -> int:
        """Events appended after ``close()``: in the log and its subscribers, in no sink."""
        return self._after_close

    @property
    def closed_at(self) -> int | None:
        """The seq from which no sink gets events (``close()`` ran), else None."""
        return self._closed_at if self._closed else None

    def _subscriber_failed(self, fn: Subscriber, ev: Event, exc: BaseException) -> None:
        name = getattr(fn, "__qualname__", None) or _name(fn)
        self._subscriber_errors[name] = self._subscriber_errors.get(name, 0) + 1
        _log.error("event subscriber %s failed on %s seq=%d", name, type(ev).__name__, ev.seq, exc_info=exc)

    # ------------------------------------------------------------ subscribers
    def subscribe(self, fn: Subscriber, *, first: bool = False, backfill: bool = False) -> Callable[[], None]:
        """Call ``fn(event)`` inline for every later event; returns an unsubscribe function.

        ``first`` puts ``fn`` before the other subscribers. With ``backfill`` ``fn`` is first
        called with every event the log retains, under the log's lock, so it misses none and
        sees none twice (a live auditor attached after the controller was built).
        """
        with self._lock:
            if backfill:
                for ev in list(self._events):
                    fn(ev)
            if first:
                self._subscribers.insert(0, fn)
            else:
                self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe

    def add_sink(self, sink: Any, *, backfill: bool = True, **runner_options: Any) -> Any:
        """Feed ``sink`` events from a worker thread (see :class:`SinkRunner`).

        With ``backfill`` the sink first gets the recent events the ring still holds,
        so a sink attached after the controller was built still sees its ``PoolCreated``.
        """
        from ._sinks import SinkRunner

        with self._lock:
            self._refuse_if_closed("add_sink", sink)
            start = max(0, self.published - self.ring_size // 2) if backfill else self.published
            runner = SinkRunner(sink, self, start_seq=start, **runner_options)
            self._sinks.append(runner)
            if runner.policy == "block":
                self._blocking.append(runner)
        return runner

    def attach_feeder(self, feeder: Any, *, backfill: bool = True, batch: int = 256, interval: float = 0.05) -> int:
        """Hand every later event to ``feeder.take(start, events)``; returns the first seq it gets.

        The outermost ``emit``/``append`` hands the events published since the last
        hand-off over, from the producer's thread and under the log's lock, once ``batch``
        of them wait or ``interval`` seconds passed since the last hand-off (the compiled
        ``LogCore._set_handoff``). ``take`` runs on the producer's time: it must not block
        beyond a bound of its own, and what it raises is logged here and goes no further.
        A producer that goes idle leaves the rest to the feeder's own watcher, through
        its :meth:`feeder_handle` (``wait`` sleeps without the GIL until a hand-off is due,
        then ``handoff_now``). With ``backfill`` the feeder first gets the
        recent events the ring still holds, as ``add_sink`` does. Several feeders share one
        cadence: the smallest ``batch`` and ``interval`` asked for. The feeder is listed in
        :attr:`sinks` (``flush``/``close`` of the log reach it).
        """
        if not callable(getattr(feeder, "take", None)):
            raise ConfigError(f"a feeder needs a take(start, events) method, got {type(feeder).__name__}")
        if not 1 <= batch <= self.ring_size // 2:
            raise ConfigError(f"feeder batch must be between 1 and {self.ring_size // 2} events, got {batch}")
        if not 0 < interval <= 3600:
            raise ConfigError(f"feeder interval must be above 0 and at most 3600 seconds, got {interval}")
        with self._lock:
            self._refuse_if_closed("attach_feeder", feeder)
            start = max(0, self.published - self.ring_size // 2) if backfill else self.published
            handoff_from = start
            if self._feeders:  # the others were handed everything below _handoff_next
                handoff_from = self._handoff_next
                if start < handoff_from:
                    feeder.take(start, [self._ring[i & self._mask] for i in range(start, handoff_from)])
                batch = min(batch, self._feeder_cadence[0])
                interval = min(interval, self._feeder_cadence[1])
            self._feeder_cadence = (batch, interval)
            self._feeders.append(feeder)
            self._feeder_starts[id(feeder)] = start
            self._sinks.append(feeder)
            self._set_handoff(self._handoff, handoff_from, batch, interval)
        return start

    def feeder_handle(self, feeder: Any) -> FeederHandle:
        """The attached ``feeder``'s handle on this log (see :class:`FeederHandle`)."""
        with self._lock:
            if feeder not in self._feeders:
                raise ConfigError(
                    f"feeder_handle({type(feeder).__name__}): that feeder is not attached to this log "
                    "(attach_feeder first)"
                )
            start = self._feeder_starts[id(feeder)]
        return FeederHandle(feeder, start, self._feeder_handoff, self._wait_handoff, self._feeder_detach)

    def _feeder_handoff(self, feeder: Any) -> bool:
        with self._lock:
            if feeder not in self._feeders:
                return False
            self._handoff_now()  # compiled: hands [handoff_next, published) to every feeder
            return True

    def _feeder_detach(self, feeder: Any) -> int:
        with self._lock:
            if feeder in self._feeders:
                self._handoff_now()
            self.detach_feeder(feeder)
            return self.published

    def detach_feeder(self, feeder: Any) -> None:
        """Stop handing events to ``feeder`` (what it was handed stays handed)."""
        with self._lock:
            if feeder in self._feeders:
                self._feeders.remove(feeder)
                if feeder not in self._feeders:
                    self._feeder_starts.pop(id(feeder), None)
            if not self._feeders:
                self._set_handoff(None, 0, 1, 1.0)

    def _handoff(self, start: int, events: list[Event]) -> None:
        for feeder in list(self._feeders):
            try:
                feeder.take(start, events)
            except Exception:  # a feeder's own errors are its to count; this is the backstop
                name = getattr(feeder, "name", feeder)
                _log.exception("feeder %s failed on events %d..%d", name, start, start + len(events) - 1)

    # ------------------------------------------------------------------ owner
    def bind_owner(self, owner: Any) -> None:
        """Make ``owner`` (a controller: an object with a ``closed`` attribute) the log's owner.

        A controller's bookkeeping is the fold of its log, so a log records one open
        controller at a time: while another owner is alive and not ``closed`` this is a
        :class:`~hicache_obs.errors.ConfigError`. The log holds its owner weakly.
        """
        if not (hasattr(type(owner), "closed") or hasattr(owner, "closed")):  # a property, or set already
            raise ConfigError(
                f"bind_owner({type(owner).__name__}): an owner needs a closed attribute "
                "(a second owner is refused while the first is open)"
            )
        with self._lock:
            current = self.owner
            if current is not None and current is not owner and not current.closed:
                raise ConfigError(
                    f"this EventLog (rank {self.rank}) already records an open {type(current).__name__}; "
                    "its bookkeeping is the fold of that log, so give each controller (each rank) its own log"
                )
            self._owner = weakref.ref(owner)

    @property
    def owner(self) -> Any:
        """The object :meth:`bind_owner` bound last while it is alive (closed or not), else None."""
        ref = self._owner
        return ref() if ref is not None else None

    @property
    def sinks(self) -> list[Any]:
        return list(self._sinks)

    @property
    def subscriber_errors(self) -> dict[str, int]:
        return dict(self._subscriber_errors)

    # ------------------------------------------------------------------- read
    def read(self, start: int, end: int) -> list[Event]:
        """The events ``[start, end)`` the ring still holds intact, oldest first.

        ``end`` may not pass :attr:`published`. The ring keeps the last ``ring_size``
        events, and a producer may lap it while this reads: an event overwritten before it
        was read is left out, so the list is short by the events lost (a sink runner counts
        them as dropped). It takes no lock: a sink's worker thread reads while the producer emits.
        """
        if not 0 <= start <= end <= self.published:
            raise ValueError(
                f"read({start}, {end}): the range must satisfy 0 <= start <= end <= published "
                f"({self.published})"
            )
        ring, mask = self._ring, self._mask
        batch = [ring[i & mask] for i in range(start, end)]
        # the producer may have lapped the ring while we read (any slot, not only the ends):
        # if it published far enough to reach the range, keep what is intact
        if batch and (
            self.published - self.ring_size > start or batch[0].seq != start or batch[-1].seq != end - 1
        ):
            batch = [ev for i, ev in enumerate(batch) if getattr(ev, "seq", None) == start + i]
        return batch

    def events(self) -> list[Event]:
        """The retained events, oldest first."""
        with self._lock:
            return list(self._events)

    def __len__(self) -> int:
        return self._seq

    @property
    def next_seq(self) -> int:
        return self._seq

    def extend(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.append(ev)

    def flush(self, timeout: float | None = 10.0) -> None:
        """Wait until every sink handled what it was offered so far."""
        for runner in list(self._sinks):
            runner.flush(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Flush and stop every sink at what is published now; idempotent.

        Under the log's lock ``close`` fixes the sinks' stopping point (:attr:`closed_at`):
        every event below it is offered to every sink, and each runner accounts for it as
        handled, dropped or (a sink that hung) queued. An event a thread emits later is still
        appended (its seq, the retained events, the subscribers: the log stays exact) but
        reaches no sink and is not stored in the ring (``published`` stays at ``closed_at``,
        so a runner still catching up reads intact events): it is counted in
        :attr:`dropped_after_close`, and the first one is logged.
        """
        if not self._closed:
            for stage in list(self._stages):  # end-of-log findings, while sinks still take events
                finish = getattr(stage, "finish", None)
                if finish is None:
                    continue
                try:
                    finish()
                except Exception as exc:
                    _log.error("stage %s failed to finish", _name(stage), exc_info=exc)
                    self._subscriber_errors[_name(stage)] = self._subscriber_errors.get(_name(stage), 0) + 1
        with self._lock:
            if self._closed:
                return
            self._close()  # compiled: the sinks' stopping point; later events are counted
            runners = list(self._sinks)
        for runner in runners:
            runner.close(timeout)


def _name(fn: Any) -> str:
    """A stage's or subscriber's name in counts and messages: its qualified name, or its class's."""
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)
