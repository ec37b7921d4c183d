"""``hicache_obs._slots``: hostile counts and runs are errors that name the value, never wrapped.

Run in a child interpreter, as the other native cases, so that a crash is a failed test.
"""

from __future__ import annotations

import textwrap

import pytest
from native_kit import run_lines

PRELUDE = """
from array import array
from hicache_obs._slots import SlotMap, pair_runs_of, runs_of, side_runs
"""


def _run(body: str) -> list[str]:
    return run_lines(PRELUDE + textwrap.dedent(body))


def test_peek_of_a_negative_or_huge_count_is_an_error() -> None:
    out = _run("""
        m = SlotMap(64, 4)
        for k in (-5, -(2**70), 2**70, 17, "3", 2.0, 0, 3):
            show(m.peek, k)
    """)
    assert out == [
        "ValueError peek of -5 pages: the number of pages must be >= 0",
        f"ValueError peek of {-(2**70)} pages: the number of pages must be >= 0",
        f"ValueError peek of {2**70} pages with 16 free",
        "ValueError peek of 17 pages with 16 free",
        "TypeError peek() takes a number of pages (int), got str",
        "TypeError peek() takes a number of pages (int), got float",
        "[]",
        "[0, 1, 2]",
    ]


@pytest.mark.parametrize(
    ("pairs", "expect"),
    [
        # joined runs whose end passes 2^63: was a run of negative length
        (
            "((0, 0, 2**63 - 1), (2**63 - 1, 5, 1))",
            "OverflowError side_runs: pair run 1 (9223372036854775807, 5, 1) has an end beyond 64 bits",
        ),
        ("((2**62, 0, 2**62), (2**63, 0, 1))", "OverflowError"),
        (
            "((-(2**63), 0, 2**63 - 1), (-1, 0, 2**63 - 1))",
            "OverflowError side_runs: joined run from -9223372036854775808 is longer than 64 bits",
        ),
        ("((0, 0, 0),)", "ValueError side_runs: pair run 0 (0, 0, 0) has a length <= 0"),
        ("((4, 0, -3),)", "ValueError side_runs: pair run 0 (4, 0, -3) has a length <= 0"),
        ("((1, 2),)", "TypeError side_runs: a pair run is (host, device, length), got (1, 2)"),
        ("(('a', 1, 3),)", "TypeError"),
        ("((0, 9, 2), (2, 1, 3))", "((0, 5),)"),
    ],
)
def test_side_runs_never_yields_a_wrapped_or_empty_run(pairs: str, expect: str) -> None:
    out = _run(f"show(side_runs, {pairs}, 0)")
    assert out[0].startswith(expect), out


def test_side_runs_checks_the_side() -> None:
    out = _run("show(side_runs, ((0, 0, 1),), 2); show(side_runs, ((0, 0, 1),), 2**40)")
    assert out[0] == "ValueError side_runs: side must be 0 (host) or 1 (device), got 2"
    assert out[1].startswith("OverflowError")


def test_run_encoders_at_the_ends_of_64_bits() -> None:
    out = _run("""
        show(runs_of, [2**63 - 2, 2**63 - 1])
        show(runs_of, [2**63 - 1, -(2**63)])  # not consecutive: no wrap
        show(runs_of, [2**63])
        show(runs_of, array("Q", [2**64 - 1]))
        show(runs_of, array("Q", [2**63 - 1]))
        show(pair_runs_of, [2**63 - 1, 0], [0, 1])
        show(runs_of, memoryview(array("q", [5, 6, 7, 8]))[::-1])
        show(runs_of, array("d", [1.0]))
    """)
    assert out == [
        "((9223372036854775806, 2),)",
        "((9223372036854775807, 1), (-9223372036854775808, 1))",
        "OverflowError an index value does not fit in 64 bits",
        "OverflowError an index value does not fit in 64 bits",
        "((9223372036854775807, 1),)",
        "((9223372036854775807, 0, 1), (0, 1, 1))",
        "((8, 1), (7, 1), (6, 1), (5, 1))",
        "TypeError runs_of: a 1-D buffer of integers is needed, got format d with 1 dimensions",
    ]


def test_slot_map_counts_and_runs_out_of_range() -> None:
    out = _run("""
        for args in ((-1,), (2**31 + 1,), (8, 0), (8, -2), (2**70,)):
            show(SlotMap, *args)
        m = SlotMap(8, 2)
        show(m.apply_alloc, ((6, 2**63 - 1),))
        show(m.apply_alloc, ((2**63 - 1, 2),))
        show(m.apply_alloc, ((-(2**63), 1),))
        show(m.apply_alloc, ((2**64, 1),))
        show(m.is_allocated, 2**70)
        print(m.used, m.free_pages)
        u = SlotMap.__new__(SlotMap)
        show(u.apply_alloc, ((0, 1),))
        show(u.peek, 1)
    """)
    assert out[0] == "ValueError capacity must be in 0..2147483648, got -1"
    assert out[1] == "ValueError capacity must be in 0..2147483648, got 2147483649"
    assert (
        out[2] == "ValueError page_size must be >= 1, got 0" and out[3] == "ValueError page_size must be >= 1, got -2"
    )
    assert out[4].startswith("OverflowError")
    assert out[5] == "[6, 7, 8, 9, 10, 11, 12, 13]"  # reported, nothing applied
    assert out[6] == "[9223372036854775807, 9223372036854775808]"
    assert out[7] == "[-9223372036854775808]"
    assert out[8] == "[18446744073709551616]"
    assert out[9] == "False" and out[10] == "0 4"
    assert out[11] == out[12] == "RuntimeError SlotMap.__init__ did not run"
