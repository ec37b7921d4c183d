"""Sinks in a process of their own: the controller's process only encodes batches.

A sink on a worker thread shares the GIL with the controller. Every torch call the
controller makes hands the GIL over, so the sink's CPU time comes almost fully out of
the controller's wall time. :class:`SinkHost` runs the sinks in a child process
(``python -m hicache_obs.exporters.sinkhost``) instead, fed through a pipe; the child
decodes the batches and feeds its sinks in log order.

:func:`add_sink_host` feeds it with a :class:`HostFeeder`: the log hands the feeder
every ``batch`` events (256) from the producer's own thread (``EventLog.attach_feeder``),
which msgpack-encodes them and writes what the pipe takes
without waiting; the rest waits in a bounded queue (policy ``drop`` or ``block``, every
event counted). A worker thread would cost the controller a GIL hand-over each time it
wakes up, and leave up to an interval's worth of events for the child to handle at close. The feeder's watcher
thread sleeps without the GIL and acts only when the producer went idle with events
waiting (after ``interval``, 50 ms) or when queued frames fit into the pipe again.
``log.add_sink(host)`` still works: a :class:`~hicache_obs.events._sinks.SinkRunner`
thread then calls :meth:`SinkHost.handle_batch`, which waits for room in the pipe.

While batches come the child does not wait on the pipe: it reads what the pipe holds every
millisecond, backing off to every 16 ms while none come, and at once when the parent
writes a byte to its wake descriptor (fd 4: after a flush or close request, or when the
pipe is full). A child asleep in a read of the pipe would be woken by each batch, and the
producer's write would pay for that wake-up. After a quarter second with no batch the child sleeps on the
pipe as well, so an idle host costs no CPU time and only the first batch after a pause
wakes it.

The sinks are described, not passed, as JSON-able dicts (the child builds them):

- ``{"sink": "prometheus", "port": 0, "addr": "127.0.0.1", "pools": [...]}``: the child
  serves ``/metrics`` (``port`` 0 takes a free port; :attr:`SinkHost.metrics_port` says
  which). Its ``hicache_events_dropped_total`` counts the child's own sinks only; the
  parent's feeder counts what never reached the child (``feeder.stats()``).
- ``{"sink": "structlog", "file": PATH | "-", "level": "info"}``: JSON lines appended to
  ``PATH`` (created 0o644) or written to stdout (``"-"``).
- ``{"sink": "otel", "endpoint": URL}`` (OTLP/HTTP; without ``endpoint`` the
  ``OTEL_EXPORTER_OTLP_*`` environment decides) or ``{"sink": "otel", "exporter":
  "memory"}`` (spans kept in the child, counted in :attr:`SinkHost.stats`). With a
  structlog sink in the same host, its lines carry the spans' ``trace_id``/``span_id``.
- ``{"sink": "jsonl", "dir": PATH, "max_bytes": N, "fsync": false, "rank": R}``: the
  durable store (:func:`add_sink_host` fills ``rank`` from the log). The feeder of a
  host with a store should block rather than drop, and be closed at exit
  (:func:`add_sink_host` does both, as ``open_store`` does).

- ``{"sink": "audit"}``: the stream-safety auditor runs in the host instead of inline
  in the controller's process. The host's other sinks get the stream
  :func:`~hicache_obs.events._audit.audited` gives offline: each ``AuditViolation`` right
  before the event that revealed it, with that event's ``seq`` and time (metrics, span
  attributes and status, log lines: the same as with an inline auditor), the end-of-log
  findings at close, with the last event's. Violations the parent's log already holds (a
  live auditor there too) are dropped, the host's replace them: none is counted twice.
  They do not enter the parent's log, nor a ``jsonl`` store in the host (they have no
  ``seq`` of their own); ``hicache-obs audit`` finds them again in the stored log.

Bad specs raise :class:`~hicache_obs.errors.ConfigError` in the parent before any process
starts; a child that cannot build its sinks makes the constructor raise with the child's
message. The child finishes its set-up (imports, decoder, auditor) before it says it is
ready, so none of it runs beside the controller's work. After ``close()`` the child has
flushed and closed every sink; it exits right after. A child that dies turns every
later batch into a counted error (and drops).
"""

from __future__ import annotations

from ..._moved import package_getattr
from ._client import SinkHost, SinkHostError
from ._feeder import add_sink_host
from ._specs import SINK_KINDS

__all__ = ["add_sink_host", "SinkHost", "SinkHostError", "SINK_KINDS"]

#: names that left ``__all__``: still read from here for one release, with a warning
__getattr__ = package_getattr(__name__, {"HostFeeder": "_feeder", "PIPE_BYTES": "_wire"})
