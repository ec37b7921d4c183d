"""benchmarks/sglang_callgrind.py's split of the counted instructions by the code that ran them
(``--by-code``), on ``callgrind_annotate`` output of the shape valgrind 3.19 prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_callgrind.py"
PY = "/opt/python/bin/python3.11"
BUILD = "/tmp/python-build.1/Python-3.11.7"
SITE = "/srv/venv/lib/python3.11/site-packages"

ANNOTATED = f"""--------------------------------------------------------------------------------
Profile data file 'metrics.1.1-01' (creator: callgrind-3.19.0)
Events recorded:  Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
--------------------------------------------------------------------------------
Ir                     Dr                   file:function
--------------------------------------------------------------------------------
1,000,000 (100.0%) 400,000 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                   Dr                  file:function
--------------------------------------------------------------------------------
  300,000 (30.00%)  90,000 (22.50%)  {BUILD}/Python/ceval.c:_PyEval_EvalFrameDefault'2 [{PY}]
   50,000 ( 5.00%)  10,000 ( 2.50%)  {BUILD}/./Include/object.h:_PyEval_EvalFrameDefault
  120,000 (12.00%)  30,000 ( 7.50%)  {BUILD}/Objects/dictobject.c:unicodekeys_lookup_unicode [{PY}]
   20,000 ( 2.00%)   5,000 ( 1.25%)  {BUILD}/./Include/internal/pycore_object.h:PyObject_GC_UnTrack
   30,000 ( 3.00%)   9,000 ( 2.25%)  /usr/src/python/Objects/typeobject.c:_PyType_Lookup [/usr/lib/libpython3.11.so.1.0]
   70,000 ( 7.00%)  20,000 ( 5.00%)  {BUILD}/Objects/obmalloc.c:_PyObject_Free [{PY}]
   40,000 ( 4.00%)  10,000 ( 2.50%)  {BUILD}/Modules/gcmodule.c:gc_collect_main [{PY}]
   90,000 ( 9.00%)  30,000 ( 7.50%)  ???:mpack_encode_cstr [{SITE}/msgspec/_core.cpython-311-x86_64-linux-gnu.so]
   60,000 ( 6.00%)  20,000 ( 5.00%)  ???:torch::check_has_torch_function(_object*, bool) [{SITE}/torch/lib/libtorch_python.so]
   80,000 ( 8.00%)  25,000 ( 6.25%)  /work/hicache_obs/_slots.c:fast_meta [/work/hicache_obs/_slots.cpython-311-x86_64-linux-gnu.so]
   10,000 ( 1.00%)   2,000 ( 0.50%)  /work/hicache_obs/_logcore.c:publish
   25,000 ( 2.50%)   5,000 ( 1.25%)  ???:__memcpy_avx_unaligned_erms [/usr/lib/x86_64-linux-gnu/libc.so.6]
  105,000 (10.50%)  40,000 (10.00%)  ???:0x0000000000012345 [???]
            0              0         ???:never_ran [{SITE}/numpy/core/_multiarray_umath.so]
"""


@pytest.fixture(scope="module")
def cg() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_callgrind", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_function_counted_once_in_its_code_group(cg: ModuleType) -> None:
    got = cg.by_code(ANNOTATED, PY)
    assert got == {
        "bytecode": 350_000,  # the loop itself and what was inlined into it
        "cpython": 170_000,  # a static interpreter's own functions, libpython's, inlined headers
        "memory": 110_000,
        "hicache_obs_c": 90_000,
        "msgspec": 90_000,
        "torch": 60_000,
        "other": 130_000,
    }
    assert sum(got.values()) == 1_000_000  # PROGRAM TOTALS, not counted twice
    assert list(got) == list(cg.CODE)


def test_a_function_of_another_executable_is_not_cpython(cg: ModuleType) -> None:
    assert cg.code_of(f"{BUILD}/Objects/dictobject.c", "insertdict", PY, PY) == "cpython"
    assert cg.code_of("???", "main", "/usr/bin/valgrind", PY) == "other"
    assert cg.code_of("/src/app/Objects/thing.c", "f", "/srv/lib/libapp.so", PY) == "other"


def test_the_loop_placed_under_another_name_of_ceval_c_is_the_bytecode_loop(cg: ModuleType) -> None:
    """An optimized CPython's debug information names parts of the bytecode loop after another
    function of ceval.c: they are the loop's, not the rest of CPython's calls."""
    assert cg.code_of(f"{BUILD}/Python/ceval.c", "_PyObject_MakeTpCall", PY, PY) == "bytecode"
    assert cg.code_of(f"{BUILD}/Objects/call.c", "_PyObject_MakeTpCall", PY, PY) == "cpython"
    assert cg.code_of(f"{BUILD}/./Include/object.h", "_PyObject_MakeTpCall", "", PY) == "cpython"


def test_nothing_before_the_function_table_is_counted(cg: ModuleType) -> None:
    header_only = ANNOTATED.split("PROGRAM TOTALS")[0] + "PROGRAM TOTALS\n"
    assert sum(cg.by_code(header_only, PY).values()) == 0


# ------------------------------------------------------------------ --opcodes
def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def test_opcode_count_counts_each_functions_own_steps_and_calls(cg: ModuleType) -> None:
    with cg.OpcodeCount() as once:
        _loop(10)
    with cg.OpcodeCount() as thrice:
        for _ in range(3):
            _loop(10)
    with cg.OpcodeCount() as longer:
        _loop(20)
    _loop(10)  # after the count: not in it
    name = f"tests/bench/test_sglang_callgrind.py:{_loop.__qualname__}"
    assert once.calls[name] == 1 and thrice.calls[name] == 3
    assert once.steps[name] > 30  # ten turns of a loop of several steps each
    assert thrice.steps[name] == 3 * once.steps[name]
    per_turn = (longer.steps[name] - once.steps[name]) / 10
    assert per_turn >= 3 and once.steps[name] > 10 * per_turn  # the loop's turns, and the steps around it


def test_a_function_is_named_by_its_path_below_site_packages_or_the_repository(cg: ModuleType) -> None:
    import json

    installed = cg.function_name(pytest.approx.__code__)  # the file moved between pytest releases
    assert installed.startswith("_pytest/") and installed.endswith(".py:approx")
    assert cg.function_name(_loop.__code__) == "tests/bench/test_sglang_callgrind.py:_loop"
    assert cg.function_name(cg.OpcodeCount.__enter__.__code__) == "benchmarks/sglang_callgrind.py:OpcodeCount.__enter__"
    stdlib = cg.function_name(json.dumps.__code__)  # elsewhere: the whole path
    assert stdlib.startswith("/") and stdlib.endswith("json/__init__.py:dumps")


def test_what_a_profile_adds_per_operation_most_steps_first(cg: ModuleType) -> None:
    bare = {"sglang/a.py:f": [1000, 10], "sglang/a.py:g": [50, 5]}
    profile = {"sglang/a.py:f": [1000, 10], "sglang/a.py:g": [40, 4], "hook.py:h": [300, 20], "hook.py:k": [300, 3]}
    assert cg.added_by_function(profile, bare, 10) == [
        ("hook.py:h", 30.0, 2.0),
        ("hook.py:k", 30.0, 0.3),
        ("sglang/a.py:g", -1.0, -0.1),
    ]
