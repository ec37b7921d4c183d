"""Reading a log: in chunks (replay._blocks), every line comes back once, numbered, with
lines that span chunks joined and lines over the limit reported, whatever the chunking;
segments are joined without a sort only when each is one rank's gap-free run."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_obs._logcore import gap_free_run
from hicache_obs.errors import SequenceError
from hicache_obs.events import AllocationFailed
from hicache_obs.events import _replay as rp


def _expected(data: bytes, limit: int) -> list[tuple[str, int, bytes]]:
    *complete, rest = data.split(b"\n")
    out = [("overlong", i, b"") if len(line) > limit else ("line", i, line) for i, line in enumerate(complete, 1)]
    if rest:
        out.append(("torn", len(complete) + 1, b""))
    return out


def _got(data: bytes, piece: int = 0) -> list[tuple[str, int, bytes]]:
    out: list[tuple[str, int, bytes]] = []
    for kind, first, block, n in rp._blocks(io.BytesIO(data), piece):
        if kind != "lines":
            out.append((kind, first, b""))
            continue
        lines = bytes(block).split(b"\n")
        assert len(lines) == n + 1 and lines[-1] == b""  # n complete lines, nothing after the last newline
        out.extend(("line", first + k, line) for k, line in enumerate(lines[:-1]))
    return out


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"x")), max_size=12),
    torn=st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"x")),
    chunk=st.integers(1, 9),
    piece=st.integers(0, 5),  # 0: a chunk's lines in one block
)
def test_every_line_once_whatever_the_chunking(lines: list[bytes], torn: bytes, chunk: int, piece: int) -> None:
    data = b"".join(line + b"\n" for line in lines) + torn
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rp, "_CHUNK", chunk)
        mp.setattr(rp, "MAX_LINE_BYTES", 12)  # above the chunk size, as in use (8 MiB vs 16 MiB)
        got = _got(data, piece)
    assert got == _expected(data, 12)


def test_a_block_is_a_view_of_the_chunk_not_a_copy() -> None:
    data = b"a\nbb\nccc\n"
    [(kind, first, block, n)] = list(rp._blocks(io.BytesIO(data)))
    assert (kind, first, n) == ("lines", 1, 3) and isinstance(block, memoryview) and bytes(block) == data
    pieces = [(first, bytes(block), n) for _, first, block, n in rp._blocks(io.BytesIO(data), 2)]
    assert pieces == [(1, b"a\nbb\n", 2), (3, b"ccc\n", 1)]  # about 2 bytes a block, whole lines


def _ev(seq: int, rank: int = 0) -> AllocationFailed:
    return AllocationFailed(seq=seq, ts_ns=1, rank=rank, pool="kv", tier="host", requested=1, available=0)


def test_gap_free_run_tells_one_ranks_ordered_run_from_anything_else() -> None:
    assert gap_free_run([_ev(s, 2) for s in range(5, 9)]) == (2, 5)
    assert gap_free_run([_ev(0)]) == (0, 0)
    assert gap_free_run([]) is None
    assert gap_free_run([_ev(0), _ev(2)]) is None  # a gap
    assert gap_free_run([_ev(0), _ev(0)]) is None  # a duplicate
    assert gap_free_run([_ev(1), _ev(0)]) is None  # out of order
    assert gap_free_run([_ev(0, 0), _ev(1, 1)]) is None  # two ranks
    assert gap_free_run([_ev(1 << 63)]) is None  # beyond 64 bits: left to the sorting path
    with pytest.raises(TypeError, match="takes a list of events, got tuple"):
        gap_free_run((_ev(0),))  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        gap_free_run([_ev(0), object()])


def test_replay_of_segments_out_of_order_still_sorts_and_checks(tmp_path: Path) -> None:
    evs = [_ev(s) for s in range(6)]
    enc = msgspec.json.Encoder()
    (tmp_path / "events-0-00000.jsonl").write_bytes(b"".join(enc.encode(e) + b"\n" for e in evs[3:]))
    (tmp_path / "events-0-00001.jsonl").write_bytes(b"".join(enc.encode(e) + b"\n" for e in evs[:3]))
    assert [e.seq for e in rp.replay(tmp_path).events] == list(range(6))
    (tmp_path / "events-0-00001.jsonl").write_bytes(b"".join(enc.encode(e) + b"\n" for e in evs[:2]))
    with pytest.raises(SequenceError, match=r"sequence gap: seq 1 .* is followed by seq 3"):
        rp.replay(tmp_path)


@pytest.mark.parametrize(
    ("module", "what"), [("hicache_obs._logcore", "append path"), ("hicache_obs._slots", "slot maps")]
)
def test_a_missing_extension_is_a_clear_error_at_import(module: str, what: str) -> None:
    # in a fresh interpreter: the module is blocked before anything imports it
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "try:\n    import hicache_obs.events\nexcept Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    # required: else a piece with a pure twin (the slot maps) runs that (tests/native/test_switch.py)
    env = {**os.environ, "HICACHE_OBS_REQUIRE_EXTENSIONS": "1"}
    env.pop("HICACHE_OBS_NO_EXTENSIONS", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env)
    out = run.stdout
    assert out.startswith(f"ConfigError {module} (") and ") is not built (" in out and what in out, out
    assert "make venv" in out
