"""Chrome Trace Event JSON (opens in Perfetto and chrome://tracing) from an event log.

:func:`chrome_trace` returns ``{"traceEvents": [...], "displayTimeUnit": "ms"}``:

- one process per rank (``pid`` = rank, named ``hicache rank N``);
- one track (``tid``) per stream: ``controller`` (the main/current stream: queueing,
  merging, index moves), ``hicache-write``, ``hicache-load`` (and any other stream
  an op was submitted on), plus an ``audit`` track for violations;
- each operation a complete slice (``"ph": "X"``) on its stream's track, from
  submission to completion, args ``op``, ``direction``, ``slots``, ``bytes``,
  ``pools``, ``slots_by_pool``, ``unrecorded``, ``status`` ...; a stream runs its work
  in order, so a slice starts no earlier than the previous slice on that track ended
  (the true submission time is in ``args.submit_us``);
- index moves (controller track) and stream records (the stream's track) as instant
  events (``"ph": "i", "s": "t"``), queueing and merging as instants on the controller;
- violations as instants with ``"cname": "terrible"`` on the ``audit`` track, and the
  slice of an op with a violation or a failure gets ``"cname": "bad"`` (never
  completed: ``"yellow"``);
- pool occupancy as counter events (``"ph": "C"``, ``used slots <pool>/<tier>``).

Timestamps are microseconds relative to the first event. :class:`ChromeTraceSink`
collects events live and writes the trace on ``close()``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from hicache_obs.events._lifecycle import OpLifecycles, OpRecord
from hicache_obs.events._schema import (
    AuditViolation,
    Event,
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    expanded,
    runs_len,
)

from ._fields import export_status

__all__ = ["CONTROLLER_TRACK", "AUDIT_TRACK", "STREAM_TRACKS", "chrome_trace", "write_chrome_trace", "ChromeTraceSink"]

CONTROLLER_TRACK = "controller"
AUDIT_TRACK = "audit"
#: tracks every trace names, in this order (tid 0, 1, 2, 3)
STREAM_TRACKS = (CONTROLLER_TRACK, "hicache-write", "hicache-load")


class _Tracks:
    def __init__(self) -> None:
        self.tids: dict[str, int] = {name: i for i, name in enumerate(STREAM_TRACKS)}
        self.tids[AUDIT_TRACK] = len(self.tids)

    def tid(self, name: str) -> int:
        if not name or name == "main":
            name = CONTROLLER_TRACK
        t = self.tids.get(name)
        if t is None:
            t = self.tids[name] = len(self.tids)
        return t


def _us(ts_ns: int, t0: int) -> float:
    return round((ts_ns - t0) / 1000.0, 3)


def _op_args(rec: OpRecord, t0: int) -> dict[str, Any]:
    sub = rec.submit
    args: dict[str, Any] = {
        "op": rec.op,
        "direction": rec.direction,
        "status": export_status(rec),
        "slots": rec.slots,
        "bytes": rec.bytes,
        "pools": rec.pools,
        "slots_by_pool": dict(rec.slots_by_pool),
        "bytes_by_pool": dict(rec.bytes_by_pool),
        "unrecorded": rec.unrecorded_indices,
        "unrecorded_pools": rec.unrecorded_pools,
        "node_ids": list(rec.node_ids),
        "merged_ops": list(rec.merged_ops),
        "io_backend": rec.io_backend,
        "layout": rec.layout,
        "submit_us": _us(sub.ts_ns, t0) if sub is not None else None,
    }
    if rec.queue_wait_ns is not None:
        args["queue_wait_us"] = rec.queue_wait_ns / 1000.0
    if rec.duration_ns is not None:
        args["duration_us"] = rec.duration_ns / 1000.0
    if rec.error is not None:
        args["error"] = rec.error
    if rec.violations:
        args["violations"] = [f"{v.rule}: {v.pool} {v.role}" for v in rec.violations]
    return args


def chrome_trace(events: Iterable[Event]) -> dict[str, Any]:
    """The Chrome Trace Event JSON object of a log (see module docstring)."""
    evs: Sequence[Event] = events if isinstance(events, (list, tuple)) else list(events)
    out: list[dict[str, Any]] = []
    if not evs:
        return {"traceEvents": out, "displayTimeUnit": "ms"}
    t0 = min(ev.ts_ns for ev in evs)
    last_ts: dict[int, int] = {}
    tracks: dict[int, _Tracks] = {}
    used: dict[tuple[int, str, str], int] = {}

    def tr(rank: int) -> _Tracks:
        t = tracks.get(rank)
        if t is None:
            t = tracks[rank] = _Tracks()
        return t

    def instant(ev: Event, name: str, track: str, cat: str, args: dict[str, Any], cname: str | None = None) -> None:
        d: dict[str, Any] = {
            "name": name,
            "cat": cat,
            "ph": "i",
            "s": "t",
            "ts": _us(ev.ts_ns, t0),
            "pid": ev.rank,
            "tid": tr(ev.rank).tid(track),
            "args": args,
        }
        if cname is not None:
            d["cname"] = cname
        out.append(d)

    ops = OpLifecycles.offline(evs).top_level()
    stream_of = {rec.key: rec.stream for rec in ops}
    for ev in evs:
        tr(ev.rank)
        if ev.ts_ns > last_ts.get(ev.rank, 0):
            last_ts[ev.rank] = ev.ts_ns
        if isinstance(ev, OperationQueued):
            instant(ev, f"queued op {ev.op}", CONTROLLER_TRACK, "queue",
                    {"op": ev.op, "direction": ev.direction, "node_id": ev.node_id, "slots_by_pool": dict(ev.slots_by_pool)})  # fmt: skip
        elif isinstance(ev, OperationsMerged):
            instant(ev, f"merged op {ev.op}", CONTROLLER_TRACK, "queue",
                    {"op": ev.op, "direction": ev.direction, "merged_ops": list(ev.merged_ops)})  # fmt: skip
        elif isinstance(ev, IndicesMoved):
            instant(ev, f"move {ev.pool} {ev.role} indices", CONTROLLER_TRACK, "index_move",
                    {"op": ev.op, "pool": ev.pool, "role": ev.role, "src": ev.src_device, "dst": ev.dst_device,
                     "numel": ev.tensor.numel})  # fmt: skip
        elif isinstance(ev, StreamRecorded):
            instant(ev, f"record_stream {ev.pool} {ev.role}", ev.stream, "stream_record",
                    {"op": ev.op, "pool": ev.pool, "role": ev.role, "stream": ev.stream, "numel": ev.tensor.numel})  # fmt: skip
        elif isinstance(ev, AuditViolation):
            args = {"op": ev.op, "rule": ev.rule, "pool": ev.pool, "role": ev.role, "detail": ev.detail,
                    "stream": ev.stream or stream_of.get((ev.rank, ev.op), "")}  # fmt: skip
            instant(ev, f"VIOLATION {ev.rule} {ev.pool}", AUDIT_TRACK, "audit", args, cname="terrible")
        elif isinstance(ev, PoolCreated):
            used[(ev.rank, ev.pool, ev.tier)] = 0
            out.append(_counter(ev, t0, ev.pool, ev.tier, 0))
        elif isinstance(ev, (SlotsAllocated, SlotsFreed)):
            k = (ev.rank, ev.pool, ev.tier)
            n = runs_len(ev.indices)
            used[k] = used.get(k, 0) + (n if isinstance(ev, SlotsAllocated) else -n)
            out.append(_counter(ev, t0, ev.pool, ev.tier, used[k]))

    # operation slices: a stream runs its work in order, so slices on a track never overlap
    track_end: dict[tuple[int, int], float] = {}
    for rec in ops:
        if rec.submit is None:
            continue
        tid = tr(rec.rank).tid(rec.stream)
        start = _us(rec.submit.ts_ns, t0)
        end_ns = rec.end_ns(default=last_ts.get(rec.rank, rec.submit.ts_ns))
        end = _us(end_ns if end_ns is not None else rec.submit.ts_ns, t0)
        start = max(start, track_end.get((rec.rank, tid), start))
        end = max(end, start)
        track_end[(rec.rank, tid)] = end
        slice_: dict[str, Any] = {
            "name": f"{rec.name} op {rec.op}",
            "cat": "transfer",
            "ph": "X",
            "ts": start,
            "dur": round(end - start, 3),
            "pid": rec.rank,
            "tid": tid,
            "args": _op_args(rec, t0),
        }
        if rec.violations or rec.failed:
            slice_["cname"] = "bad"
        elif rec.done is None:
            slice_["cname"] = "yellow"
        out.append(slice_)

    meta: list[dict[str, Any]] = []
    for rank, t in sorted(tracks.items()):
        meta.append(
            {
                "name": "process_name",
                "ph": "M",
                "ts": 0,
                "pid": rank,
                "tid": 0,
                "args": {"name": f"hicache rank {rank}"},
            }
        )
        meta.append(
            {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
        for name, tid in t.tids.items():
            meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": tid, "args": {"name": name}})
            meta.append(
                {"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": tid, "args": {"sort_index": tid}}
            )
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def _counter(ev: Event, t0: int, pool: str, tier: str, value: int) -> dict[str, Any]:
    return {
        "name": f"used slots {pool}/{tier}",
        "cat": "pool",
        "ph": "C",
        "ts": _us(ev.ts_ns, t0),
        "pid": ev.rank,
        "tid": 0,
        "args": {"used": value},
    }


def write_chrome_trace(events: Iterable[Event], path: str | os.PathLike[str]) -> None:
    """Write :func:`chrome_trace` of ``events`` to ``path`` (atomically: temp file, then rename)."""
    from hicache_obs._files import write_text

    write_text(path, json.dumps(chrome_trace(events), separators=(",", ":")))


class ChromeTraceSink:
    """Collects events live and writes the Chrome trace on ``close()``.

    ``path``: where ``close()`` writes (``close(path)`` overrides it; None writes
    nothing). ``max_events`` bounds memory; events past it are counted in
    ``dropped`` and left out of the trace.
    """

    name = "chrome-trace"

    def __init__(self, path: str | os.PathLike[str] | None = None, *, max_events: int = 2_000_000) -> None:
        self.path = path
        self.max_events = max_events
        self.events: list[Event] = []
        self.dropped = 0
        self._lock = threading.Lock()
        self._closed = False

    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        events = expanded(events)  # an OpsSubmitted as the events it stands for
        with self._lock:
            room = self.max_events - len(self.events)
            if room >= len(events):
                self.events.extend(events)
            else:
                self.events.extend(events[: max(room, 0)])
                self.dropped += len(events) - max(room, 0)

    def flush(self) -> None:
        """Nothing to flush: the trace is written on close."""

    def trace(self) -> dict[str, Any]:
        with self._lock:
            events = list(self.events)
        return chrome_trace(events)

    def write(self, path: str | os.PathLike[str]) -> None:
        with self._lock:
            events = list(self.events)
        write_chrome_trace(events, path)

    def close(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write the trace to ``path`` (or the constructor's); idempotent."""
        target = path if path is not None else self.path
        if self._closed and path is None:
            return
        self._closed = True
        if target is not None:
            self.write(target)
