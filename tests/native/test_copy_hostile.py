"""``hicache_obs._copy.copy_runs``: geometry, runs and addresses are checked before a byte moves.

Each case once crashed the interpreter or wrote outside the planes; it runs in a child
interpreter, and every refused call must leave both buffers as they were.
"""

from __future__ import annotations

import textwrap

import pytest
from native_kit import crashed, run_code

PRELUDE = """
import ctypes
from array import array
from hicache_obs._copy import copy_runs
dst = bytearray(b"\\x11" * 4096)   # room for 64 slots of 64 B, one layer
src = bytearray(b"\\x22" * 4096)
da = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
sa = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
def call(*args, runs=(0, 0, 1)):
    packed = runs if not isinstance(runs, tuple) else array("q", runs)
    try:
        copy_runs(*args[:2], packed, *args[2:])
        print("copied")
    except (ValueError, TypeError, OverflowError, BufferError) as exc:
        print(type(exc).__name__, exc)
    print("untouched", dst == bytearray(b"\\x11" * 4096) and src == bytearray(b"\\x22" * 4096))
"""


def _run(body: str) -> str:
    proc = run_code(PRELUDE + textwrap.dedent(body))
    assert not crashed(proc), f"the child crashed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


GOOD = "False, 1, 64, 64, 64, 4096, 64, 64, 4096"  # swap, layers, chunk, dst slots/strides, src slots/strides


def test_a_sane_call_copies_exactly_one_chunk() -> None:
    out = _run(f"""
        call(da, sa, {GOOD}, runs=(3, 5, 2))
        print(dst[192:320] == b"\\x22" * 128, dst[:192] == b"\\x11" * 192, dst[320:] == b"\\x11" * (4096 - 320))
    """)
    assert "copied" in out and "True True True" in out


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ("(0, 0, 2**63 - 1)", "run 0 (dst 0, src 0, length 9223372036854775807) is outside the planes"),
        ("(2**63 - 1, 0, 1)", "run 0 (dst 9223372036854775807, src 0, length 1) is outside"),
        ("(0, 0, 1, 0, 0, -(2**63))", "run 1 (dst 0, src 0, length -9223372036854775808) is outside"),
    ],
)
def test_huge_run_lengths_do_not_overflow_the_range_check(runs: str, message: str) -> None:
    out = _run(f"call(da, sa, {GOOD}, runs={runs})")
    assert message in out and "untouched True" in out


def test_negative_slot_counts_are_refused_not_wrapped() -> None:
    """dst_slots - length overflowed for dst_slots < 0: a run of 2^63-1 slots was accepted."""
    out = _run("call(da, sa, False, 1, 64, -2, 64, 4096, 64, 64, 4096, runs=(0, 0, 2**63 - 1))")
    assert "copy_runs(): dst_slots must be in 0..9223372036854775807, got -2" in out and "untouched True" in out


@pytest.mark.parametrize(
    ("geometry", "message"),
    [
        # a chunk longer than the slot stride: the last slot's chunk ran past the plane
        (
            "False, 1, 128, 64, 64, 4096, 64, 64, 4096",
            "the dst plane's chunks overlap: chunk 128 B, 64 slots of stride 64",
        ),
        # huge strides: slot * stride overflowed into a small or negative offset
        ("False, 1, 64, 64, 2**62, 4096, 64, 64, 4096", "runs past the end of the address space"),
        ("False, 1, 64, 64, 64, 4096, 64, 2**63 - 1, 2**63 - 1", "the src plane at"),
        ("False, 2, 64, 64, 64, 4096, 64, 2**62, 2**62", "the src plane's chunks overlap"),
        (
            "False, 1, 64, 64, 64, 4096, 64, 64, 2**63",
            "src_layer_stride must be in 1..9223372036854775807, got 9223372036854775808",
        ),
        ("False, 1, 64, 64, 64, 4096, 64, 64, -64", "src_layer_stride must be in 1..9223372036854775807, got -64"),
        ("False, 1, 64.0, 64, 64, 4096, 64, 64, 4096", "chunk must be an int, got float"),
    ],
)
def test_geometry_that_does_not_tile_or_overflows_is_refused(geometry: str, message: str) -> None:
    out = _run(f"call(da, sa, {geometry})")
    assert message in out and "untouched True" in out


@pytest.mark.parametrize("huge", ["dst", "src"])
def test_a_huge_plane_over_the_other_buffer_is_refused(huge: str) -> None:
    """A layer stride of 2^62 makes a 4 EiB plane: laid from the lower buffer it covers the
    other one, whichever of the two the allocator put first (laid from the upper one it
    would name memory that is not mapped, which no check of addresses can know)."""
    lo, hi = "min(da, sa)", "max(da, sa)"
    if huge == "dst":
        out = _run(f"call({lo}, {hi}, False, 2, 64, 64, 64, 2**62, 64, 64, 4096)")
    else:
        out = _run(f"call({hi}, {lo}, False, 2, 64, 64, 64, 4096, 64, 64, 2**62)")
    assert "the planes overlap" in out and "untouched True" in out


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        (
            'array("i", [0, 0, 1, 0, 0, 1])',
            "runs must be a buffer of int64 (format 'q'), got format 'i' of 4-byte items",
        ),
        ('array("d", [0, 0, 1])', "got format 'd' of 8-byte items"),
        ('bytes(array("q", [0, 0, 1]))', "got format 'B' of 1-byte items"),
        ('memoryview(array("q", [0, 0, 1, 9, 9, 9]))[::2]', "memoryview: underlying buffer is not C-contiguous"),
        ("[0, 0, 1]", "a bytes-like object is required"),
    ],
)
def test_runs_must_be_contiguous_int64(runs: str, message: str) -> None:
    out = _run(f"call(da, sa, {GOOD}, runs={runs})")
    assert message in out and "untouched True" in out


@pytest.mark.parametrize(
    ("addresses", "message"),
    [
        ("0, sa", "dst must be a non-null address, got 0"),
        ("-4096, sa", "dst must be a non-null address, got -4096"),
        ("da, 2**64 + da", "src must be a non-null address, got"),
        ("2**64 - 64, sa", "runs past the end of the address space"),
        ("da, da + 64", "the planes overlap"),
        ('"1", sa', "dst must be an address (int), got str"),
    ],
)
def test_addresses_that_wrap_or_overlap_are_refused(addresses: str, message: str) -> None:
    out = _run(f"call({addresses}, {GOOD})")
    assert message in out and "untouched True" in out


def test_runs_changed_while_the_copy_runs_are_not_read_again() -> None:
    """The loop reads a private copy of the runs, taken after they were checked."""
    out = _run(f"""
        import threading
        runs = array("q", [0, 0, 64])
        stop = False
        def flip():
            while not stop:
                runs[2] = 2**40
                runs[2] = 64
        t = threading.Thread(target=flip)
        t.start()
        for _ in range(300):
            try:
                copy_runs(da, sa, runs, {GOOD})
            except ValueError:
                pass
        stop = True
        t.join()
        print("alive", dst == bytearray(b"\\x22" * 4096))
    """)
    assert "alive True" in out
