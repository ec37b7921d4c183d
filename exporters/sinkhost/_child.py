"""The sink host child: builds its sinks from their specs, then feeds them the frames it reads.

Run as ``python -m hicache_obs.exporters.sinkhost --reply-fd FD --wake-fd FD SPECS`` by
:class:`SinkHost`.

With ``--wake-fd`` the child does not wait on the frames' pipe while frames come: it reads
what the pipe holds every millisecond, less often (up to every ``IDLE_S``) while none come,
and at once when the parent writes a byte to the wake descriptor (after a flush or close
request, or when the pipe is full). A reader asleep on the pipe would be woken by every
batch the producer writes, and on a virtual machine that wake-up (an interrupt to another
CPU) costs the producer's thread tens of microseconds a batch. Once none came for
``SLEEP_AFTER_S`` it sleeps on the pipe too, so an idle child costs no CPU time and only
the first batch after a pause wakes it. Without ``--wake-fd`` it reads the pipe as it
blocks (a child started by hand).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import select
import sys
import time
from typing import Any

import msgspec

from ._specs import check_specs
from ._wire import CLOSE, EVENTS, FLUSH, HEADER, PIPE_BYTES, read_exact

__all__ = ["BUSY_S", "FrameReader", "HostAudit", "IDLE_S", "SLEEP_AFTER_S", "build_sinks", "main"]

#: How often the child reads the frames' pipe while frames come, and at most while none do;
#: after how long without any it sleeps until the pipe has something (its CPU time idle: none).
BUSY_S = 0.001
IDLE_S = 0.016
SLEEP_AFTER_S = 0.25


def build_sinks(specs: list[dict[str, Any]]) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """The child's sinks in handling order (spans before lines), its ready reply, closers."""
    from hicache_obs._files import FILE_MODE, make_dirs

    sinks: list[Any] = []
    ready: dict[str, Any] = {"ready": True}
    closers: list[Any] = []
    by_kind = {s["sink"]: s for s in specs}
    otel = None
    if "otel" in by_kind:
        from .._otel import OtelSpanSink

        s = by_kind["otel"]
        exporter: Any = None
        if s.get("exporter") == "memory":
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            exporter = InMemorySpanExporter()
        elif s.get("endpoint"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=s["endpoint"])
        otel = OtelSpanSink(service_name=s.get("service_name", "hicache-obs"), exporter=exporter)
        sinks.append(otel)
    if "prometheus" in by_kind:
        from .._prometheus import DEFAULT_POOLS, PrometheusSink, start_metrics_server

        s = by_kind["prometheus"]
        prom = PrometheusSink(pools=s.get("pools", DEFAULT_POOLS))
        # the server lives as long as the process (its exit closes the socket)
        _server, port = start_metrics_server(prom.registry, s.get("port", 0), s.get("addr", "127.0.0.1"))
        ready["prometheus_port"] = port
        sinks.append(prom)
    if "structlog" in by_kind:
        from .._structlog_sink import StructlogSink

        s = by_kind["structlog"]
        target = s.get("file", "-")
        if target == "-":
            fh = sys.stdout
        else:
            make_dirs(os.path.dirname(os.path.abspath(target)))
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
            fh = os.fdopen(fd, "a", encoding="utf-8")
            closers.append(fh.close)
        sinks.append(StructlogSink(file=fh, level=s.get("level", "info"), span_ids=otel))
    if "jsonl" in by_kind:
        from hicache_obs.events._store import JsonlStore

        s = by_kind["jsonl"]
        sinks.append(
            JsonlStore(
                s["dir"],
                rank=s.get("rank", 0),
                max_bytes=s.get("max_bytes", 64 << 20),
                fsync=bool(s.get("fsync", False)),
            )
        )
    return sinks, ready, closers


class HostAudit:
    """The auditor in the host: the batches as :func:`~hicache_obs.events._audit.audit_batch`
    makes them, each violation right before the event that revealed it (with that event's seq
    and time), and the log's own violations dropped (this auditor's replace them: none is
    counted twice); the end-of-log ones, at close, with the seq and time of the last event."""

    def __init__(self) -> None:
        from hicache_obs.events._audit import Auditor, audit_batch, audit_end

        self.auditor = Auditor()
        self._audit_batch, self._audit_end = audit_batch, audit_end
        self._last: dict[int, Any] = {}  # rank -> its last event (one log: one rank)

    def run(self, batch: list[Any]) -> list[Any]:
        if batch:
            self._last[batch[-1].rank] = batch[-1]
        return self._audit_batch(batch, self.auditor)

    def finish(self) -> list[Any]:
        if not self._last:
            return []
        return self._audit_end(self.auditor, self._last)


def feed(sinks: list[Any], batch: list[Any], audited: list[Any], errors: dict[str, int]) -> None:
    """Stores get ``batch`` (the log's own events); the other sinks ``audited`` (with violations)."""
    for s in sinks:
        events = batch if getattr(s, "paths", None) is not None else audited
        if not events:
            continue
        try:
            s.handle_batch(events)
        except Exception as exc:  # one sink failing must not stop the others
            errors[s.name] = errors.get(s.name, 0) + 1
            print(f"hicache sink host: sink {s.name} failed on a batch: {exc!r}", file=sys.stderr, flush=True)


READY_CPU = [0.0]  # the child's process_time() when it said it was ready


def stats_of(
    sinks: list[Any], events: int, batches: int, errors: dict[str, int], audit: HostAudit | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"events": events, "batches": batches, "errors": dict(errors)}
    out["cpu_s"] = time.process_time() - READY_CPU[0]  # the host's CPU time since it was ready
    if audit is not None:
        out["violations"] = audit.auditor.counts()
    for s in sinks:
        if hasattr(s, "spans_ended"):
            out["spans_ended"] = s.spans_ended
            out["spans_exported"] = s.spans_exported
            out["spans_dropped"] = s.spans_dropped
        if hasattr(s, "lines_written"):
            out["lines_written"] = s.lines_written
        if hasattr(s, "paths"):
            out["paths"] = [str(p) for p in s.paths]
    return out


def call_all(sinks: list[Any], method: str, errors: dict[str, int], *args: Any) -> None:
    for s in sinks:
        try:
            getattr(s, method)(*args)
        except Exception as exc:  # one sink failing must not stop the others
            errors[s.name] = errors.get(s.name, 0) + 1
            print(f"hicache sink host: sink {s.name} failed to {method}: {exc!r}", file=sys.stderr, flush=True)


class FrameReader:
    """The frames on a pipe, read without blocking: :meth:`fill` takes what the pipe holds,
    up to about ``limit`` bytes not handled yet, :meth:`next` returns the next whole frame
    (kind, payload) or None; ``full`` when the last fill stopped at ``limit`` (more may
    wait), ``eof`` once the writer closed its end (the parent went away).

    The bound keeps the child's memory at about one pipe's worth whatever the parent has
    queued: each read makes room in the pipe, and the parent fills it again."""

    def __init__(self, fd: int, limit: int = PIPE_BYTES) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.limit = limit
        self.eof = False
        self.full = False
        self._buf = bytearray()
        self._at = 0

    def fill(self) -> bool:
        """Read what the pipe holds now, up to ``limit`` bytes waiting; True if anything came."""
        got = False
        self.full = False
        while not self.eof:
            if len(self._buf) - self._at >= self.limit:
                self.full = True
                break
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            if self._at:  # what was handled is dropped before the buffer grows
                del self._buf[: self._at]
                self._at = 0
            self._buf += chunk
            got = True
        return got

    def next(self) -> tuple[bytes, bytes] | None:
        at, buf = self._at, self._buf
        if len(buf) - at < HEADER.size:
            return None
        kind, n = HEADER.unpack_from(buf, at)
        end = at + HEADER.size + n
        if len(buf) < end:
            return None
        with memoryview(buf) as view:  # one copy, and no view left when the buffer changes
            payload = bytes(view[at + HEADER.size : end])
        if end == len(buf):  # all handled: an idle child keeps no burst's buffer
            buf.clear()
            self._at = 0
        else:
            self._at = end
        return kind, payload

    @property
    def partial(self) -> int:
        """Bytes of a frame not whole yet."""
        return len(self._buf) - self._at


def _cut_short(n: int) -> None:
    print(f"hicache sink host: the parent went away in the middle of a frame ({n} bytes of it came)", file=sys.stderr)


def _blocking_frames(inp: Any) -> Any:
    """The frames of a pipe read as it blocks: (kind, payload), ending when the writer goes."""
    while True:
        header = read_exact(inp, HEADER.size)
        if len(header) < HEADER.size:
            return
        kind, n = HEADER.unpack(header)
        payload = read_exact(inp, n)
        if len(payload) < n:
            _cut_short(HEADER.size + len(payload))
            return
        yield kind, payload


def _polled_frames(fd: int, wake_fd: int) -> Any:
    """The frames of pipe ``fd``, read on a timer while they come (every BUSY_S, backing off
    to IDLE_S while none do) or when ``wake_fd`` is readable; after SLEEP_AFTER_S with none,
    the child sleeps until the pipe or ``wake_fd`` has something. Ends when the writer goes."""
    frames = FrameReader(fd)
    poller = select.poll()
    poller.register(wake_fd, select.POLLIN)
    wake_open = True
    watching_pipe = False
    wait = BUSY_S
    last = time.monotonic()
    while True:
        got = frames.fill()
        while (frame := frames.next()) is not None:
            yield frame
        if frames.eof:
            if frames.partial:
                _cut_short(frames.partial)
            return
        if frames.full:  # more waits in the pipe: read it now
            continue
        now = time.monotonic()
        if got:
            last, wait = now, BUSY_S
        else:
            wait = min(IDLE_S, wait * 2)
        asleep = now - last >= SLEEP_AFTER_S  # nothing came for a while: the next batch may wake it
        if asleep != watching_pipe:
            if asleep:
                poller.register(fd, select.POLLIN)
            else:
                poller.unregister(fd)
            watching_pipe = asleep
        if not (wake_open or watching_pipe):
            time.sleep(wait)
            continue
        for ready, ev in poller.poll(-1 if asleep else int(wait * 1000) or 1):
            if ready != wake_fd:
                continue  # the pipe: read at the top of the loop
            data = os.read(wake_fd, 4096) if ev & select.POLLIN else b""
            if not data:  # the parent closed its end: the frames' pipe says when it is gone
                poller.unregister(wake_fd)
                wake_open = False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache_obs.exporters.sinkhost")
    p.add_argument("--reply-fd", type=int, required=True)
    p.add_argument("--wake-fd", type=int, default=None, help="read the frames on a timer; a byte here wakes the child")
    p.add_argument("specs")
    args = p.parse_args(argv)
    reply = os.fdopen(args.reply_fd, "wb", buffering=0)

    def say(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj).encode() + b"\n")

    try:
        specs = check_specs(json.loads(args.specs))
        sinks, ready, closers = build_sinks(specs)
        from hicache_obs.events._schema import AnyEvent

        audit = HostAudit() if any(spec["sink"] == "audit" for spec in specs) else None
        decode = msgspec.msgpack.Decoder(list[AnyEvent]).decode  # type: ignore[valid-type]
    except Exception as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        return 2
    # all set-up done before the parent hears "ready": none of it runs beside its work
    gc.collect()
    gc.freeze()  # what start-up built stays: later collections skip it
    READY_CPU[0] = time.process_time()
    say(ready)
    frames = _blocking_frames(sys.stdin.buffer) if args.wake_fd is None else _polled_frames(0, args.wake_fd)
    try:
        code = _serve(frames, sinks, decode, audit, closers, say)
    finally:
        if args.wake_fd is not None:  # stdin's file description may be a terminal's, shared
            with contextlib.suppress(OSError):
                os.set_blocking(0, True)
    if code:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every sink is closed: skip the interpreter's teardown


def _serve(frames: Any, sinks: list[Any], decode: Any, audit: HostAudit | None, closers: list[Any], say: Any) -> int:
    """Feed the sinks the frames, answer flushes, close at CLOSE or when the parent goes;
    2 for a frame of an unknown kind."""
    events = batches = 0
    errors: dict[str, int] = {}
    for kind, payload in frames:
        if kind == EVENTS:
            batch = decode(payload)
            events += len(batch)
            batches += 1
            feed(sinks, batch, audit.run(batch) if audit is not None else batch, errors)
        elif kind == FLUSH:
            call_all(sinks, "flush", errors)
            say({"flushed": int(payload), "stats": stats_of(sinks, events, batches, errors, audit)})
        elif kind == CLOSE:
            if audit is not None:  # end of the log: ops submitted and never finished
                feed(sinks, [], audit.finish(), errors)
            call_all(sinks, "close", errors)
            for fn in closers:
                fn()
            sys.stdout.flush()
            say({"closed": True, "stats": stats_of(sinks, events, batches, errors, audit)})
            break
        else:
            print(f"hicache sink host: unknown frame {kind!r}; stopping", file=sys.stderr, flush=True)
            return 2
    else:  # the parent went away: close what we have
        if audit is not None:
            feed(sinks, [], audit.finish(), errors)
        call_all(sinks, "close", errors)
    return 0

