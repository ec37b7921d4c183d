"""Structured log lines: one per finished operation and one per audit violation.

:class:`StructlogSink` is a batch sink for ``log.add_sink``. For every merged
operation that completed or failed it logs one line (``hicache.transfer_completed``
or ``hicache.transfer_failed``) with ``op``, ``rank``, ``direction``, ``pools``,
``slots``, ``bytes``, ``slots_by_pool``, ``duration_s``, ``queue_wait_s``,
``node_ids``, ``stream``, ``io_backend``, ``unrecorded_indices`` and
``unrecorded_pools``; then one ``hicache.audit_violation`` line per violation of
that op (``rule``, ``pool``, ``role``, ``detail``), and at close one
``hicache.operation_incomplete`` line per op submitted but never finished.
A line is written at its op's completion or failure, in the batch that holds it: in an
audited log every violation of an op comes before the event that revealed it (see
:func:`~hicache_obs.events._audit.audited`). Violations not tied to an op the sink
follows (no op, or one that finished already) are logged as they arrive. ``timestamp``
is the event's own time (ISO 8601, UTC), not the time the line was written.

Correlation: give ``span_ids=`` an :class:`~hicache_obs.exporters._otel.OtelSpanSink`
(or any object with ``span_ids(op, rank)``, and optionally ``seen_seq(rank)`` and
``wait_seen(seq, rank, timeout)``) and every line of an op that has a span carries
``trace_id``/``span_id`` in hex, the same ids the span exporter sends. The two sinks
run on different threads, so a line waits (up to ``id_wait_s``) until the span sink
has handled the op's submission.

Levels: finished operations at ``level`` (default ``info``), failures at ``error``,
violations and incomplete operations at ``warning``.

The sink never calls ``structlog.configure``: without ``logger`` it writes JSON
lines to ``file`` (stdout by default) through a private logger
(:func:`make_json_logger`). A ``logger`` may be any structlog-style logger
(``logger.info(event, **fields)``); a stdlib ``logging.Logger`` is wrapped so that it
receives the JSON line as its message.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TextIO

import msgspec
import structlog

from hicache_obs.events._lifecycle import NOT_OP_EVENTS, OpLifecycles, OpRecord, Step
from hicache_obs.events._schema import AuditViolation, Event, expanded

from ._fields import export_status

__all__ = ["StructlogSink", "make_json_logger", "LEVELS"]

LEVELS = ("debug", "info", "warning", "error", "critical")


def _dumps(obj: Any, default: Any = None, **_: Any) -> str:
    """structlog's JSON serializer, through msgspec (several times faster than ``json.dumps``)."""
    return msgspec.json.encode(obj, enc_hook=default if default is not None else repr).decode()


def make_json_logger(file: TextIO | None = None, *, logger: Any = None) -> Any:
    """A private structlog logger rendering one JSON object per line (no global configuration).

    Writes to ``file`` (stdout by default), or hands the rendered line to ``logger``
    (e.g. a stdlib ``logging.Logger``) when given.
    """
    target = logger if logger is not None else structlog.PrintLogger(file if file is not None else sys.stdout)
    return structlog.wrap_logger(
        target,
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        context_class=dict,
        cache_logger_on_first_use=False,
    )


def _iso(ts_ns: int) -> str:
    dt = datetime.fromtimestamp(ts_ns // 1_000_000_000, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{(ts_ns % 1_000_000_000) // 1000:06d}Z"


@dataclass
class _Line:
    rank: int
    op: int
    need_seq: int  # the span sink must have handled this seq for the ids to be final (-1: no span)
    deadline: float
    method: str
    event: str
    fields: dict[str, Any]


class StructlogSink:
    """Writes one structured line per finished operation and per violation (see module docstring)."""

    name = "structlog"

    def __init__(
        self,
        logger: Any = None,
        *,
        level: str = "info",
        span_ids: Any = None,
        file: TextIO | None = None,
        id_wait_s: float = 1.0,
    ) -> None:
        if level not in LEVELS:
            from hicache_obs.errors import ConfigError

            raise ConfigError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
        if logger is None:
            logger = make_json_logger(file)
        elif isinstance(logger, logging.Logger):
            logger = make_json_logger(logger=logger)
        self.logger = logger
        self.level = level
        self.span_ids = span_ids
        self.id_wait_s = id_wait_s
        self._ops = OpLifecycles()
        self._lines: deque[_Line] = deque()
        self.lines_written = 0
        self._closed = False
        # the runner calls flush/close from another thread than handle_batch
        self._lock = threading.RLock()

    # ------------------------------------------------------------ sink API
    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        events = expanded(events)  # an OpsSubmitted as the events it stands for
        with self._lock:
            apply = self._ops.apply
            for ev in events:
                if type(ev) in NOT_OP_EVENTS:
                    continue  # allocations and frees touch no op
                got = apply(ev)
                if got is None:
                    continue
                step, rec = got
                if step is Step.FINISHED:
                    self._finished(rec)  # type: ignore[arg-type]
                elif rec is None and step is Step.VIOLATION:
                    self._violation(ev, None)  # type: ignore[arg-type]  # of no op it follows: at once
            self._drain(block=True)

    def flush(self) -> None:
        with self._lock:
            self._drain(block=True, final=True)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for r in self._ops.unfinished():
            if r.submit is not None:
                self._queue(r, "warning", "hicache.operation_incomplete", self._op_fields(r, r.submit.ts_ns))
                for v in r.violations:
                    self._violation(v, r)
        self._drain(block=True, final=True)

    # ------------------------------------------------------------- lines
    def _op_fields(self, r: OpRecord, ts_ns: int) -> dict[str, Any]:
        dur = r.duration_ns
        wait = r.queue_wait_ns
        out: dict[str, Any] = {
            "timestamp": _iso(ts_ns),
            "rank": r.rank,
            "op": r.op,
            "direction": r.direction,
            "status": export_status(r),
            "pools": r.pools,
            "slots": r.slots,
            "bytes": r.bytes,
            "slots_by_pool": dict(r.slots_by_pool),
            "duration_s": None if dur is None else dur / 1e9,
            "queue_wait_s": None if wait is None else wait / 1e9,
            "node_ids": list(r.node_ids),
            "stream": r.stream,
            "io_backend": r.io_backend,
            "unrecorded_indices": r.unrecorded_indices,
            "unrecorded_pools": r.unrecorded_pools,
        }
        if r.error is not None:
            out["error"] = r.error
        return out

    def _finished(self, r: OpRecord) -> None:
        if r.done is None:
            return
        if r.failed:
            self._queue(r, "error", "hicache.transfer_failed", self._op_fields(r, r.done.ts_ns))
        else:
            self._queue(r, self.level, "hicache.transfer_completed", self._op_fields(r, r.done.ts_ns))
        for v in r.violations:
            self._violation(v, r)

    def _violation(self, v: AuditViolation, r: OpRecord | None) -> None:
        fields = {
            "timestamp": _iso(v.ts_ns),
            "rank": v.rank,
            "op": v.op,
            "rule": v.rule,
            "pool": v.pool,
            "role": v.role,
            "direction": v.direction,
            "stream": v.stream,
            "detail": v.detail,
        }
        if r is None:
            self._lines.append(_Line(v.rank, v.op, -1, 0.0, "warning", "hicache.audit_violation", fields))
        else:
            self._queue(r, "warning", "hicache.audit_violation", fields)

    def _queue(self, r: OpRecord, method: str, event: str, fields: dict[str, Any]) -> None:
        need = r.submit.seq if (r.submit is not None and self.span_ids is not None) else -1
        self._lines.append(_Line(r.rank, r.op, need, time.monotonic() + self.id_wait_s, method, event, fields))

    def _ready(self, line: _Line, block: bool) -> bool:
        src = self.span_ids
        if line.need_seq < 0 or src is None or getattr(src, "closed", False):
            return True
        seen = getattr(src, "seen_seq", None)
        if seen is None or seen(line.rank) >= line.need_seq:
            return True
        left = line.deadline - time.monotonic()
        if left <= 0:
            return True
        if not block:
            return False
        wait = getattr(src, "wait_seen", None)
        if wait is None:
            time.sleep(min(left, 0.01))
            return seen(line.rank) >= line.need_seq or time.monotonic() >= line.deadline
        wait(line.need_seq, line.rank, left)
        return True

    def _drain(self, *, block: bool, final: bool = False) -> None:
        lines = self._lines
        while lines:
            line = lines[0]
            if not self._ready(line, block):
                if not final:
                    return
                continue
            lines.popleft()
            self._write(line)

    def _write(self, line: _Line) -> None:
        fields = line.fields
        if line.need_seq >= 0 and self.span_ids is not None:
            ids = self.span_ids.span_ids(line.op, line.rank)
            if ids is not None:
                fields["trace_id"], fields["span_id"] = ids
        getattr(self.logger, line.method)(line.event, **fields)
        self.lines_written += 1
