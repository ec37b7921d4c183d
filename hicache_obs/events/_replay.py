"""Reading logs back: :func:`read_segments` and :func:`replay`.

A log is one or more JSON Lines files (or a folder of ``events*.jsonl``
segments), possibly from several ranks. Every line is decoded against the event
schema. A last line without its newline (a torn write) is reported and skipped;
any other malformed line raises :class:`~hicache_obs.errors.LogFormatError`
naming the file and line. Within each rank the events must form one gap-free,
duplicate-free ``seq`` run (:class:`~hicache_obs.errors.SequenceError` otherwise).
Only regular files are read (a symlink to one is followed): a FIFO, a device or a
socket named like a segment is refused with a ``LogFormatError`` before it is read.
A segment may start with a header line naming its format version
(``{"format":"hicache-obs/events","version":N,...}``; none: version 1). The header is
line 1 in error messages, the events follow from line 2; a version newer than
``READABLE_VERSIONS`` is refused with :class:`~hicache_obs.errors.UnsupportedLogVersionError`.
The pools a log creates are held to :class:`~hicache_obs.events._state.PoolLimits`
(a :class:`~hicache_obs.errors.LogLimitError` beyond).
:func:`replay` folds each rank into a :class:`~hicache_obs.events._state.CacheState`
and merges the ranks into one history ordered by time.
"""

from __future__ import annotations

import heapq
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .._native import gap_free_run
from ..errors import LogFormatError, SequenceError, UnsupportedLogVersionError
from ._schema import LOG_FORMAT, READABLE_VERSIONS, AnyEvent, Event, expanded
from ._state import CacheState, PoolLimits, fold
from ._store import SEGMENT_GLOB

__all__ = ["TornLine", "ReplayResult", "expand_paths", "read_file", "read_segments", "replay", "MAX_LINE_BYTES"]

#: Lines longer than this are rejected without being decoded (bounded memory per line).
MAX_LINE_BYTES = 16 << 20

_decoder = msgspec.json.Decoder(AnyEvent)


@dataclass(frozen=True)
class TornLine:
    file: str
    line: int


@dataclass
class ReplayResult:
    """Events of every rank, merged by time; each rank's folded bookkeeping."""

    events: list[Event]
    files: list[str] = field(default_factory=list)
    torn_lines: list[TornLine] = field(default_factory=list)
    states: dict[int, CacheState] = field(default_factory=dict)
    by_rank: dict[int, list[Event]] = field(default_factory=dict)
    findings: list[Any] | None = None  # audit findings, with replay(..., audit=True)
    #: events read per rank (also when they were not kept: ``replay(..., keep_events=False)``)
    event_counts: dict[int, int] = field(default_factory=dict)
    #: the log format version of each file read (1 for a file without a header)
    versions: dict[str, int] = field(default_factory=dict)

    @property
    def state(self) -> CacheState:
        """The bookkeeping of the only (or lowest) rank."""
        if not self.states:
            return CacheState()
        return self.states[min(self.states)]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.event_counts or self.by_rank)

    @property
    def n_events(self) -> int:
        """Events read, of every rank."""
        return sum(self.event_counts.values()) if self.event_counts else len(self.events)


def expand_paths(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files as given; folders expand to their ``events*.jsonl`` segments, sorted. A folder
    without segments of its own expands to those of its subfolders (one folder per rank,
    as ``hicache-obs instrument`` writes them)."""
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            segs = sorted(path.glob(SEGMENT_GLOB)) or sorted(path.glob(f"*/{SEGMENT_GLOB}"))
            if not segs:
                raise LogFormatError(
                    f"{path}: folder holds no {SEGMENT_GLOB} segments, nor do its subfolders", file=str(path)
                )
            out.extend(segs)
        elif path.exists():
            out.append(path)
        else:
            raise LogFormatError(f"{path}: no such file or folder", file=str(path))
    return out


_CHUNK = 8 << 20


def _blocks(fh: Any, piece: int = 0) -> Iterator[tuple[str, int, Any, int]]:
    """Yield runs of complete lines: ``("lines", first line number, buffer, line count)``,
    or ``("overlong", line number, b"", 1)`` / ``("torn", line number, b"", 0)``.

    Reads in chunks and never holds more than one chunk plus ``MAX_LINE_BYTES``; no line
    in a ``lines`` block is longer than ``MAX_LINE_BYTES``. The lines inside a chunk are
    handed on as a view of it, uncopied; only a line that spans chunks is joined. With
    ``piece``, a chunk's lines come in blocks of about that many bytes.
    """
    lineno = 0
    tail = b""  # the start of a line that continues in the next chunk
    skipping = False  # inside an overlong line: discard until its newline
    while True:
        chunk = fh.read(_CHUNK)
        if not chunk:
            break
        start = 0
        if skipping:
            nl = chunk.find(b"\n")
            if nl == -1:
                continue
            lineno += 1
            yield "overlong", lineno, b"", 1
            skipping = False
            start = nl + 1
        if tail:  # the line that spans chunks ends here, or goes on
            nl = chunk.find(b"\n", start)
            if nl == -1:
                tail += chunk[start:]
                if len(tail) > MAX_LINE_BYTES:
                    tail = b""
                    skipping = True
                continue
            lineno += 1
            if len(tail) + nl - start > MAX_LINE_BYTES:
                yield "overlong", lineno, b"", 1
            else:
                yield "lines", lineno, tail + chunk[start : nl + 1], 1
            tail = b""
            start = nl + 1
        cut = chunk.rfind(b"\n", start)
        if cut == -1:
            tail = chunk[start:]
            if len(tail) > MAX_LINE_BYTES:
                tail = b""
                skipping = True
            continue
        view = memoryview(chunk)
        while start <= cut:
            end = chunk.find(b"\n", min(start + piece, cut)) if piece else cut
            n = chunk.count(b"\n", start, end + 1)
            yield "lines", lineno + 1, view[start : end + 1], n
            lineno += n
            start = end + 1
        tail = chunk[cut + 1 :]
    if skipping or tail:
        yield "torn", lineno + 1, b"", 0


def read_file(
    path: str | os.PathLike[str], versions: dict[str, int] | None = None
) -> tuple[list[Event], TornLine | None]:
    """Decode one JSON Lines file; returns its events and the torn last line, if any.

    A last line without its newline is torn (the writer always ends a line with one):
    it is reported and skipped, never decoded. A header line is read, not returned; with
    ``versions``, the file's format version is stored there under its name.
    """
    name = str(path)
    events: list[Event] = []
    for kind, i, block, n in _file_blocks(path, versions=versions):
        if kind == "torn":
            return events, TornLine(name, i)
        _decode_block(name, i, block, n, events)
    return events, None


def _file_blocks(
    path: str | os.PathLike[str], piece: int = 0, versions: dict[str, int] | None = None
) -> Iterator[tuple[str, int, Any, int]]:
    """:func:`_blocks` of one file, a ``torn`` item last if its last line is torn; an
    unreadable file or a line over ``MAX_LINE_BYTES`` raises :class:`LogFormatError`.

    A header on line 1 is checked (:func:`_header_version`) and left out of the blocks,
    which then start at line 2; ``versions[name]`` gets the file's format version."""
    name = str(path)
    if versions is not None:
        versions[name] = 1  # until a header says otherwise
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise LogFormatError(f"{name}: cannot read: {exc.strerror or exc}", file=name) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise LogFormatError(f"{name}: not a regular file ({_file_kind(mode)}); refused", file=name)
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with fh:
        try:
            first = True
            for kind, i, block, n in _blocks(fh, piece):
                if kind == "overlong":
                    raise LogFormatError(f"{name}:{i}: line longer than {MAX_LINE_BYTES} bytes", file=name, line=i)
                if first:  # line 1: a header, or already an event (version 1)
                    first = False
                    header = _header_line(block) if kind == "lines" else None
                    if header is not None:
                        version = _header_version(name, header)
                        if versions is not None:
                            versions[name] = version
                        if n == 1:
                            continue
                        block, i, n = block[len(header) + 1 :], 2, n - 1
                yield kind, i, block, n
        except OSError as exc:
            raise LogFormatError(f"{name}: cannot read: {exc.strerror or exc}", file=name) from None


#: A header line is read from the first this many bytes of a segment; a longer line 1 is an event.
HEADER_MAX_BYTES = 64 << 10

_header_keys = ("format", "version", "rank", "segment")


def _header_line(block: Any) -> bytes | None:
    """Line 1 of a segment (without its newline) if it is a header, else ``None``.

    A header is a JSON object with a ``format`` key and no ``type`` key (an event always
    has ``type``). Anything else, malformed JSON included, is left to the event decoder,
    which reports it as today."""
    peek = bytes(block[:HEADER_MAX_BYTES])
    nl = peek.find(b"\n")
    if nl == -1 or b'"format"' not in peek[:nl]:
        return None
    line = peek[:nl]
    try:
        obj = msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or "format" not in obj or "type" in obj:
        return None
    return line


def _header_version(name: str, line: bytes) -> int:
    """The format version a segment header gives, checked: a :class:`LogFormatError` names the
    field and value that is wrong, an :class:`UnsupportedLogVersionError` a version too new."""
    obj = msgspec.json.decode(line)
    fmt = obj["format"]
    if fmt != LOG_FORMAT:
        raise LogFormatError(
            f"{name}:1: segment header: format {_short_value(fmt)} is not {LOG_FORMAT!r}", file=name, line=1
        )
    for key in _header_keys[1:]:
        if key not in obj:
            raise LogFormatError(f"{name}:1: segment header: no {key!r} field", file=name, line=1)
        value = obj[key]
        if type(value) is not int or value < (1 if key == "version" else 0):
            least = "an integer >= 1" if key == "version" else "an integer >= 0"
            raise LogFormatError(
                f"{name}:1: segment header: {key} {_short_value(value)} is not {least}", file=name, line=1
            )
        if key == "version" and value not in READABLE_VERSIONS:
            readable = _versions_text()
            if value > max(READABLE_VERSIONS):
                raise UnsupportedLogVersionError(
                    f"{name}: log format version {value} is newer than this hicache-obs "
                    f"(reads {readable}); upgrade hicache-obs to read it",
                    file=name,
                    version=value,
                )
            raise LogFormatError(  # pragma: no cover - every version up to the newest is readable
                f"{name}:1: segment header: version {value} is not one this hicache-obs reads ({readable})",
                file=name,
                line=1,
            )
    return int(obj["version"])


def _versions_text() -> str:
    v = READABLE_VERSIONS
    if len(v) == 1:
        return f"version {v[0]}"
    if list(v) == list(range(v[0], v[-1] + 1)):
        return f"versions {v[0]}-{v[-1]}"
    return "versions " + ", ".join(map(str, v))  # pragma: no cover - the versions read have no gap


def _short_value(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 80 else text[:80] + "..."


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return f"file type {stat.S_IFMT(mode):#o}"  # pragma: no cover - no other kind on Linux


def _decode_block(name: str, first: int, block: Any, n_lines: int, out: list[Event]) -> None:
    """Decode ``n_lines`` complete lines at C speed; on any doubt, line by line for the exact error."""
    try:
        decoded = _decoder.decode_lines(block)
        if len(decoded) == n_lines:  # no blank line was skipped
            out.extend(decoded)
            return
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    decode = _decoder.decode
    for k, line in enumerate(bytes(block).split(b"\n")[:-1]):
        i = first + k
        if not line.strip():
            raise LogFormatError(f"{name}:{i}: empty line", file=name, line=i)
        try:
            out.append(decode(line))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if _header_line(line + b"\n") is not None:
                raise LogFormatError(
                    f"{name}:{i}: a segment header, which is only read as line 1 of a segment (segments joined?)",
                    file=name,
                    line=i,
                ) from None
            raise LogFormatError(f"{name}:{i}: {_short(exc)}", file=name, line=i) from None
        except RecursionError:
            raise LogFormatError(f"{name}:{i}: nesting too deep", file=name, line=i) from None
    raise LogFormatError(f"{name}:{first}: block failed to decode", file=name, line=first)  # pragma: no cover


def _short(exc: Exception) -> str:
    msg = str(exc)
    return msg if len(msg) <= 200 else msg[:200] + "..."


def read_segments(paths: Sequence[str | os.PathLike[str]]) -> ReplayResult:
    """Read and validate files or folders; events per rank in seq order, not folded."""
    files = expand_paths(paths)
    torn: list[TornLine] = []
    read: list[tuple[str, list[Event]]] = []
    versions: dict[str, int] = {}
    for f in files:
        evs, t = read_file(f, versions)
        if t is not None:
            torn.append(t)
        read.append((str(f), evs))
    ordered = _in_order(read)
    if ordered is None:  # several ranks in a file, or segments out of order: event by event
        by_rank: dict[int, list[tuple[Event, str]]] = {}
        for name, evs in read:
            for ev in evs:
                by_rank.setdefault(ev.rank, []).append((ev, name))
        ordered = {}
        for rank, items in by_rank.items():
            items.sort(key=lambda x: x[0].seq)
            _check_sequence(rank, items)
            ordered[rank] = [ev for ev, _ in items]
    res = ReplayResult(events=[], files=[str(f) for f in files], torn_lines=torn, by_rank=ordered, versions=versions)
    res.events = _merge(ordered)
    return res


def _in_order(read: list[tuple[str, list[Event]]]) -> dict[int, list[Event]] | None:
    """The usual log: each segment one rank's gap-free run of seqs, the segments of a rank
    following on. Then each rank's events are the segments joined, checked without a
    per-event sort; ``None`` when that does not hold (the caller sorts and names the
    first gap or duplicate)."""
    by_rank: dict[int, list[Event]] = {}
    for _, evs in read:
        run = gap_free_run(evs)
        if run is None:
            if not evs:
                continue
            return None
        rank, first = run
        have = by_rank.setdefault(rank, [])
        if len(have) != first:  # every rank starts at seq 0 and has no gap between segments
            return None
        have.extend(evs)
    return by_rank


def _check_sequence(rank: int, items: list[tuple[Event, str]]) -> None:
    if not items:
        return
    first = items[0][0].seq
    if first != 0:
        raise SequenceError(f"rank {rank}: log starts at seq {first} ({items[0][1]}); seqs 0..{first - 1} are missing")
    prev_seq, prev_file = -1, ""
    for ev, name in items:
        if ev.seq == prev_seq:
            raise SequenceError(f"rank {rank}: duplicate seq {ev.seq} ({prev_file} and {name})")
        if ev.seq != prev_seq + 1:
            raise SequenceError(
                f"rank {rank}: sequence gap: seq {prev_seq} ({prev_file}) is followed by seq {ev.seq} ({name})"
            )
        prev_seq, prev_file = ev.seq, name


def _merge(by_rank: dict[int, list[Event]]) -> list[Event]:
    """The ranks' events in one list, each ``OpsSubmitted`` as the events it stands for."""
    if len(by_rank) == 1:
        return expanded(list(next(iter(by_rank.values()))))  # a list of its own
    # each rank keeps its seq order; ranks interleave by time, then rank
    return expanded(heapq.merge(*(by_rank[r] for r in sorted(by_rank)), key=lambda e: (e.ts_ns, e.rank)))


#: Bytes of a log decoded at a time when its events are folded as they are read
#: (``keep_events=False``): a block's events are folded and freed while the CPU's caches
#: still hold them (a larger block is slower: it leaves them).
STREAM_BLOCK_BYTES = 256 << 10


def replay(source: Any, *, audit: bool = False, keep_events: bool = True, states: bool = True) -> ReplayResult:
    """Rebuild the bookkeeping from a log.

    ``source``: a path, a folder, a list of them, an :class:`EventLog`, or an
    iterable of events. Returns the merged history, each rank's
    :class:`CacheState`, the files read and the torn lines skipped. With ``audit``
    the audit rules run over the same fold (``findings``), end-of-log rules included.

    With ``keep_events=False`` the events are not kept (``events`` and ``by_rank`` are
    empty; ``event_counts`` says how many there were): files are then folded block by
    block as they are read, in bounded memory, when each segment continues its rank's
    gap-free run (what a store writes); otherwise they are read whole, sorted and
    checked first, as with ``keep_events=True``. States, findings and errors are the same.

    With ``audit`` and ``states=False`` only the audit rules run (``states`` stays empty):
    the same findings in about a tenth of the memory per pool slot (the auditor's map has
    one byte per slot, the bookkeeping's ten with one-slot pages).
    """
    if not states and not audit:
        from ..errors import ConfigError

        raise ConfigError("replay(states=False) needs audit=True: without states there is nothing to return")
    paths = _paths_of(source)
    if paths is not None and not keep_events:
        streamed = _replay_streaming(paths, audit, states)
        if streamed is not None:
            return streamed
    if paths is not None:
        res = read_segments(paths)
    else:
        events = source.events() if hasattr(source, "events") and callable(source.events) else source
        res = _from_events(events)
    res.event_counts = {rank: len(evs) for rank, evs in res.by_rank.items()}
    limits = PoolLimits()
    if audit:
        from ._audit import Auditor

        auditor = Auditor(fold_state=states, limits=limits)
        for rank in sorted(res.by_rank):
            auditor.feed(res.by_rank[rank])
        res.findings = auditor.finish()
        res.states = auditor.states
    else:
        for rank, evs in res.by_rank.items():
            res.states[rank] = fold(evs, limits)
    if not keep_events:
        res.events, res.by_rank = [], {}
    return res


def _paths_of(source: Any) -> list[Any] | None:
    if isinstance(source, (str, os.PathLike)):
        return [source]
    if isinstance(source, (list, tuple)) and source and all(isinstance(s, (str, os.PathLike)) for s in source):
        return list(source)
    return None


def _replay_streaming(
    paths: Sequence[str | os.PathLike[str]], audit: bool, with_states: bool = True
) -> ReplayResult | None:
    """Fold files block by block as they are read, keeping no event; ``None`` as soon as a
    block does not continue its rank's gap-free run (the caller then reads, sorts and
    checks the whole log). Malformed lines raise as :func:`read_file` does."""
    files = expand_paths(paths)
    limits = PoolLimits()
    auditor = None
    if audit:
        from ._audit import Auditor

        auditor = Auditor(fold_state=with_states, limits=limits)
    states: dict[int, CacheState] = {}
    next_seq: dict[int, int] = {}  # per rank: the seq its next event must carry
    torn: list[TornLine] = []
    versions: dict[str, int] = {}
    for f in files:
        name = str(f)
        for kind, i, block, n in _file_blocks(f, STREAM_BLOCK_BYTES, versions):
            if kind == "torn":
                torn.append(TornLine(name, i))
                break
            events: list[Event] = []
            _decode_block(name, i, block, n, events)
            run = gap_free_run(events)
            if run is None:
                if events:
                    return None
                continue
            rank, first = run
            if next_seq.get(rank, 0) != first:
                return None
            next_seq[rank] = first + len(events)
            if auditor is not None:
                auditor.feed(events)
                continue
            st = states.get(rank)
            if st is None:
                st = states[rank] = CacheState(limits=limits)
            apply = st.apply
            for ev in events:
                apply(ev)
    res = ReplayResult(
        events=[], files=[str(f) for f in files], torn_lines=torn, event_counts=dict(next_seq), versions=versions
    )
    if auditor is not None:
        # the order a rank-by-rank fold reports in: each rank's findings in seq order,
        # then the end-of-log ones, rank by rank
        res.findings = sorted(auditor.finish(), key=lambda x: (x.seq == -1, x.rank))
        res.states = auditor.states
    else:
        res.states = states
    return res


def _from_events(events: Iterable[Event]) -> ReplayResult:
    by_rank: dict[int, list[tuple[Event, str]]] = {}
    for ev in events:
        by_rank.setdefault(ev.rank, []).append((ev, "<memory>"))
    ordered: dict[int, list[Event]] = {}
    for rank, items in by_rank.items():
        items.sort(key=lambda x: x[0].seq)
        _check_sequence(rank, items)
        ordered[rank] = [ev for ev, _ in items]
    return ReplayResult(events=_merge(ordered), by_rank=ordered)
