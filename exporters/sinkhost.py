"""Sinks in a process of their own: the controller's process only encodes batches.

A sink on a worker thread shares the GIL with the controller. Every torch call the
controller makes hands the GIL over, so the sink's CPU time comes almost fully out of
the controller's wall time. :class:`SinkHost` runs the sinks in a child process
(``python -m hicache_obs.exporters.sinkhost``) instead: it is a batch sink for
``log.add_sink``, so the log's :class:`~hicache_obs.events.sinks.SinkRunner` still reads
the ring, counts drops and bounds flush/close. The runner's thread only msgpack-encodes
each batch (about 0.3 us per event) and writes it to the child's stdin. The child
decodes the batches and feeds its sinks in log order.

The sinks are described, not passed, as JSON-able dicts (the child builds them):

- ``{"sink": "prometheus", "port": 0, "addr": "127.0.0.1", "pools": [...]}``: the child
  serves ``/metrics`` (``port`` 0 takes a free port; :attr:`SinkHost.metrics_port` says
  which). Its ``hicache_events_dropped_total`` counts the child's own sinks only; the
  parent's runner counts what never reached the child (``runner.stats()``).
- ``{"sink": "structlog", "file": PATH | "-", "level": "info"}``: JSON lines appended to
  ``PATH`` (created 0o644) or written to stdout (``"-"``).
- ``{"sink": "otel", "endpoint": URL}`` (OTLP/HTTP; without ``endpoint`` the
  ``OTEL_EXPORTER_OTLP_*`` environment decides) or ``{"sink": "otel", "exporter":
  "memory"}`` (spans kept in the child, counted in :attr:`SinkHost.stats`). With a
  structlog sink in the same host, its lines carry the spans' ``trace_id``/``span_id``.
- ``{"sink": "jsonl", "dir": PATH, "max_bytes": N, "fsync": false, "rank": R}``: the
  durable store (:func:`add_sink_host` fills ``rank`` from the log). The parent's runner
  for a host with a store should block rather than drop, and be closed at exit
  (:func:`add_sink_host` does both, as ``open_store`` does).

- ``{"sink": "audit"}``: the stream-safety auditor runs in the host instead of inline
  in the controller's process. Its ``AuditViolation`` events reach the host's other sinks
  right after the event that revealed them (metrics, span attributes and status, log
  lines: the same as with an inline auditor), and the end-of-log findings at close. They
  do not enter the parent's log, nor a ``jsonl`` store in the host (they have no ``seq``
  of their own); ``hicache-obs audit`` finds them again in the stored log.

Bad specs raise :class:`~hicache_obs.errors.ConfigError` in the parent before any process
starts; a child that cannot build its sinks makes the constructor raise with the child's
message. After ``close()`` the child has flushed and closed every sink and exited.
A child that dies turns every later batch into a counted runner error (and drops).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import struct
import sys
import threading
import time
from typing import Any

import msgspec

from hicache_obs.errors import ConfigError, HiCacheError
from hicache_obs.events.store import close_at_exit

__all__ = ["SinkHost", "SinkHostError", "add_sink_host", "SINK_KINDS"]

#: The sinks a host can run, with the keys each one takes.
SINK_KINDS: dict[str, frozenset[str]] = {
    "audit": frozenset(),
    "prometheus": frozenset({"port", "addr", "pools"}),
    "structlog": frozenset({"file", "level"}),
    "otel": frozenset({"endpoint", "exporter", "service_name"}),
    "jsonl": frozenset({"dir", "max_bytes", "fsync", "rank"}),
}

_HEADER = struct.Struct("<cI")  # frame kind, payload length
_EVENTS, _FLUSH, _CLOSE = b"E", b"F", b"C"


class SinkHostError(HiCacheError, RuntimeError):
    """The sink host process failed to start, answer or stay alive."""


def _check_specs(sinks: Any) -> list[dict[str, Any]]:
    if not isinstance(sinks, (list, tuple)) or not sinks:
        raise ConfigError(f"a sink host needs a non-empty list of sink specs, got {sinks!r}")
    out = []
    seen: set[str] = set()
    for i, spec in enumerate(sinks):
        if not isinstance(spec, dict) or not isinstance(spec.get("sink"), str):
            raise ConfigError(f"sink spec {i} must be a dict with a 'sink' name, got {spec!r}")
        kind = spec["sink"]
        if kind not in SINK_KINDS:
            raise ConfigError(f"sink spec {i}: unknown sink {kind!r}; known: {', '.join(SINK_KINDS)}")
        if kind in seen:
            raise ConfigError(f"sink spec {i}: a host runs one {kind!r} sink, given twice")
        seen.add(kind)
        extra = set(spec) - {"sink"} - SINK_KINDS[kind]
        if extra:
            raise ConfigError(
                f"sink spec {i} ({kind}): unknown keys {sorted(extra)}; it takes {sorted(SINK_KINDS[kind])}"
            )
        if kind == "jsonl" and not isinstance(spec.get("dir"), str):
            raise ConfigError(f"sink spec {i} (jsonl): 'dir' must be a path string, got {spec.get('dir')!r}")
        if kind == "otel" and spec.get("exporter", "otlp") not in ("otlp", "memory"):
            raise ConfigError(f"sink spec {i} (otel): exporter must be 'otlp' or 'memory', got {spec['exporter']!r}")
        try:
            json.dumps(spec)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"sink spec {i} ({kind}) is not JSON-able: {exc}") from None
        out.append(dict(spec))
    return out


class SinkHost:
    """A batch sink that forwards every batch to sinks running in a child process."""

    name = "sinkhost"

    def __init__(
        self,
        sinks: list[dict[str, Any]],
        *,
        start_timeout: float = 30.0,
        reply_timeout: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.specs = _check_specs(sinks)
        self.reply_timeout = reply_timeout
        self.stats: dict[str, Any] = {}
        self.closed = False
        self._token = 0
        self._buf = b""
        self._enc = msgspec.msgpack.Encoder()
        self._code: int | None = None
        _reap_finished()
        # the child's stdin (batches and commands) and fd 3 (replies); no shell, a fixed
        # argv, and no other descriptor of this process (Python's are not inheritable)
        in_r, in_w = os.pipe()
        rep_r, rep_w = os.pipe()
        argv = [sys.executable, "-m", "hicache_obs.exporters.sinkhost", "--reply-fd", "3", json.dumps(self.specs)]
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                argv,
                os.environ if env is None else env,
                file_actions=[(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, rep_w, 3)],
            )
        except BaseException:
            for fd in (in_w, rep_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, rep_w):
                os.close(fd)
        self._stdin = os.fdopen(in_w, "wb")
        self._reply_fd = rep_r
        # the runner calls handle_batch and flush/close from different threads: one frame
        # (and one reply) at a time
        self._lock = threading.Lock()
        try:
            ready = self._reply(time.monotonic() + start_timeout)
            if "error" in ready:
                raise ConfigError(f"sink host could not start its sinks: {ready['error']}")
        except BaseException:
            self._kill()
            self._stdin.close()
            os.close(self._reply_fd)
            raise
        self.metrics_port: int | None = ready.get("prometheus_port")

    # ------------------------------------------------------------ sink API
    def handle_batch(self, events: list[Any]) -> None:
        payload = self._enc.encode(events)
        with self._lock:
            self._send(_EVENTS, payload)

    def flush(self) -> None:
        """Wait until the child handled everything sent so far and flushed its sinks."""
        with self._lock:
            self._token += 1
            self._send(_FLUSH, str(self._token).encode())
            deadline = time.monotonic() + self.reply_timeout
            while True:
                reply = self._reply(deadline)
                if reply.get("flushed") == self._token:
                    self.stats = reply["stats"]
                    return

    def close(self) -> None:
        """Close the child's sinks; returns once they are closed (flushed, files closed).

        The child then exits on its own (it only calls ``os._exit`` after its reply);
        :meth:`wait` waits for that, and a later host (or :meth:`wait`) reaps it. Not
        waiting here keeps the process teardown (a few ms) out of the caller's close.
        """
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._send(_CLOSE, b"")
            deadline = time.monotonic() + self.reply_timeout
            while True:
                reply = self._reply(deadline)
                if reply.get("closed"):
                    self.stats = reply["stats"]
                    break
        except SinkHostError as exc:
            self._kill()
            raise SinkHostError(f"sink host pid {self.pid} did not close cleanly: {exc}") from None
        finally:
            with contextlib.suppress(OSError):
                self._stdin.close()
            os.close(self._reply_fd)
            if self.returncode is None:
                _UNREAPED.add(self)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the child to exit; its exit code (``None`` if it still runs at ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.002)
        return self._code

    @property
    def returncode(self) -> int | None:
        """The child's exit code (negative: the signal that ended it), ``None`` while it runs."""
        if self._code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._code = os.waitstatus_to_exitcode(status)
                _UNREAPED.discard(self)
        return self._code

    # ------------------------------------------------------------ plumbing
    def _send(self, kind: bytes, payload: bytes) -> None:
        try:
            self._stdin.write(_HEADER.pack(kind, len(payload)))
            self._stdin.write(payload)
            self._stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise SinkHostError(f"sink host pid {self.pid} is gone (exit code {self.returncode}): {exc}") from None

    def _reply(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SinkHostError(f"sink host pid {self.pid} did not answer in time")
            ready, _, _ = select.select([self._reply_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._reply_fd, 65536)
            if not chunk:
                code = self.wait(1.0)
                raise SinkHostError(f"sink host pid {self.pid} exited with code {code}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait()


#: Hosts closed before their child had exited; reaped when the next host starts.
_UNREAPED: set[SinkHost] = set()


def _reap_finished() -> None:
    for host in list(_UNREAPED):
        _ = host.returncode  # reaps it when it has exited


def add_sink_host(log: Any, sinks: list[dict[str, Any]], **host_options: Any) -> Any:
    """Start a :class:`SinkHost` and attach it to ``log``; returns the runner.

    The runner blocks the producer (up to its timeout) rather than drop when the host
    holds a durable store, as :func:`~hicache_obs.events.store.open_store` does.
    """
    specs = _check_specs(sinks)
    for spec in specs:  # a hosted store names its segments after the log's rank
        if spec["sink"] == "jsonl":
            spec.setdefault("rank", log.rank)
    host = SinkHost(specs, **host_options)
    durable = any(s["sink"] == "jsonl" for s in host.specs)
    runner = log.add_sink(host, policy="block" if durable else "drop")
    if durable:  # like open_store: what is queued reaches the disk at exit too
        close_at_exit(runner)
    return runner


# ------------------------------------------------------------------ child side
def _build(specs: list[dict[str, Any]]) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """The child's sinks in handling order (spans before lines), its ready reply, closers."""
    from hicache_obs._files import FILE_MODE, make_dirs

    sinks: list[Any] = []
    ready: dict[str, Any] = {"ready": True}
    closers: list[Any] = []
    by_kind = {s["sink"]: s for s in specs}
    otel = None
    if "otel" in by_kind:
        from .otel import OtelSpanSink

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
        from .prometheus import DEFAULT_POOLS, PrometheusSink, start_metrics_server

        s = by_kind["prometheus"]
        prom = PrometheusSink(pools=s.get("pools", DEFAULT_POOLS))
        # the server lives as long as the process (its exit closes the socket)
        _server, port = start_metrics_server(prom.registry, s.get("port", 0), s.get("addr", "127.0.0.1"))
        ready["prometheus_port"] = port
        sinks.append(prom)
    if "structlog" in by_kind:
        from .structlog_sink import StructlogSink

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
        from hicache_obs.events.store import JsonlStore

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


class _HostAudit:
    """The auditor in the host: its violations are inserted after the events that revealed them."""

    def __init__(self) -> None:
        from hicache_obs.events.audit import Auditor

        self.auditor = Auditor(emit=self._emit)
        self._out: list[Any] = []
        self._cur: Any = None
        self._finishing = False

    def _emit(self, cls: Any, **fields: Any) -> None:
        cur = self._cur  # the event that revealed it (the last one, at the end of the log)
        ts = time.time_ns() if self._finishing else cur.ts_ns
        self._out.append(cls(seq=cur.seq, ts_ns=ts, rank=cur.rank, **fields))

    def run(self, batch: list[Any]) -> list[Any]:
        out = self._out = []
        handle = self.auditor.handle
        for ev in batch:
            out.append(ev)
            self._cur = ev
            handle(ev)
        return out

    def finish(self) -> list[Any]:
        self._out = []
        if self._cur is not None:
            self._finishing = True
            self.auditor.finish()
        return self._out


def _feed(sinks: list[Any], batch: list[Any], audited: list[Any], errors: dict[str, int]) -> None:
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


def _stats(
    sinks: list[Any], events: int, batches: int, errors: dict[str, int], audit: _HostAudit | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"events": events, "batches": batches, "errors": dict(errors)}
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


def _read_exact(stream: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def _call_all(sinks: list[Any], method: str, errors: dict[str, int], *args: Any) -> None:
    for s in sinks:
        try:
            getattr(s, method)(*args)
        except Exception as exc:  # one sink failing must not stop the others
            errors[s.name] = errors.get(s.name, 0) + 1
            print(f"hicache sink host: sink {s.name} failed to {method}: {exc!r}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache_obs.exporters.sinkhost")
    p.add_argument("--reply-fd", type=int, required=True)
    p.add_argument("specs")
    args = p.parse_args(argv)
    reply = os.fdopen(args.reply_fd, "wb", buffering=0)

    def say(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj).encode() + b"\n")

    try:
        sinks, ready, closers = _build(_check_specs(json.loads(args.specs)))
    except Exception as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        return 2
    say(ready)

    from hicache_obs.events.schema import AnyEvent

    audit = _HostAudit() if any(spec["sink"] == "audit" for spec in json.loads(args.specs)) else None
    decode = msgspec.msgpack.Decoder(list[AnyEvent]).decode  # type: ignore[valid-type]
    inp = sys.stdin.buffer
    events = batches = 0
    errors: dict[str, int] = {}
    while True:
        header = _read_exact(inp, _HEADER.size)
        if len(header) < _HEADER.size:  # the parent went away: close what we have
            if audit is not None:
                _feed(sinks, [], audit.finish(), errors)
            _call_all(sinks, "close", errors)
            break
        kind, n = _HEADER.unpack(header)
        payload = _read_exact(inp, n)
        if kind == _EVENTS:
            batch = decode(payload)
            events += len(batch)
            batches += 1
            _feed(sinks, batch, audit.run(batch) if audit is not None else batch, errors)
        elif kind == _FLUSH:
            _call_all(sinks, "flush", errors)
            say({"flushed": int(payload), "stats": _stats(sinks, events, batches, errors, audit)})
        elif kind == _CLOSE:
            if audit is not None:  # end of the log: ops submitted and never finished
                _feed(sinks, [], audit.finish(), errors)
            _call_all(sinks, "close", errors)
            for fn in closers:
                fn()
            sys.stdout.flush()
            say({"closed": True, "stats": _stats(sinks, events, batches, errors, audit)})
            break
        else:
            print(f"hicache sink host: unknown frame {kind!r}; stopping", file=sys.stderr, flush=True)
            return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every sink is closed: skip the interpreter's teardown


if __name__ == "__main__":
    sys.exit(main())
