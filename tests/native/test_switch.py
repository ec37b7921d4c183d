"""``hicache_obs._native``: which piece runs compiled and which pure, chosen by the
environment at import, recorded in ``IMPLEMENTATIONS``; every value it does not know is a
ConfigError that names it. Each case runs in a fresh interpreter with its own environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from native_kit import TREE

ENV_NAMES = ("HICACHE_OBS_NO_EXTENSIONS", "HICACHE_OBS_REQUIRE_EXTENSIONS")

# a finder that makes the named compiled modules fail to import, as in a tree built without them
HIDE = """
import sys
class _Hide:
    def __init__(self, names): self.names = names
    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            raise ImportError("No module named %r" % name)
        return None
sys.meta_path.insert(0, _Hide({hidden!r}))
"""

SHOW = """
import json, logging
logging.basicConfig(level=logging.DEBUG, format="LOG %(name)s %(message)s")
import hicache_obs.core._runtime, hicache_obs.events, hicache_obs._native as n
from hicache_obs.events._state import SlotTable
from hicache_obs.events._log import EventLog
print(json.dumps({
    "impl": n.IMPLEMENTATIONS,
    "slot_map": SlotTable.__mro__[1].__module__,
    "log_core": EventLog.__mro__[1].__module__,
    "copies": getattr(hicache_obs.core._runtime.CpuRuntime().native_copies, "__name__", None),
}))
"""


def _child(src: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    full["PYTHONPATH"] = os.pathsep.join([TREE, *([full["PYTHONPATH"]] if full.get("PYTHONPATH") else [])])
    full.update(env)
    return subprocess.run(
        [sys.executable, "-P", "-c", textwrap.dedent(src)],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
        check=False,
    )


def _show(hidden: tuple[str, ...] = (), **env: str) -> tuple[dict[str, object], str]:
    proc = _child((HIDE.format(hidden=set(hidden)) if hidden else "") + SHOW, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def _impl(**env: str) -> dict[str, str]:
    """IMPLEMENTATIONS as a child with ``env`` sees it (imports no torch: fast)."""
    proc = _child("import json, hicache_obs._native as n; print(json.dumps(n.IMPLEMENTATIONS))", **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _config_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hicache_obs.errors.ConfigError: "), proc.stderr[-3000:]
    return last.removeprefix("hicache_obs.errors.ConfigError: ")


C = {"logcore": "c", "slots": "c", "copy": "c"}
PY = {"logcore": "py", "slots": "py", "copy": "py"}


def test_by_default_every_piece_is_compiled() -> None:
    for value in ("", "0", " 0 "):
        assert _impl(HICACHE_OBS_NO_EXTENSIONS=value) == C, value
    got, _ = _show()
    assert got == {
        "impl": C,
        "slot_map": "hicache_obs._slots",
        "log_core": "hicache_obs._logcore",
        "copies": "hicache_obs._copy",
    }


def test_the_pieces_named_run_pure() -> None:
    assert _impl(HICACHE_OBS_NO_EXTENSIONS="slots") == {**C, "slots": "py"}
    assert _impl(HICACHE_OBS_NO_EXTENSIONS="copy") == {**C, "copy": "py"}
    assert _impl(HICACHE_OBS_NO_EXTENSIONS="copy,slots,copy") == {**C, "slots": "py", "copy": "py"}
    assert _impl(HICACHE_OBS_NO_EXTENSIONS="logcore") == {**C, "logcore": "py"}
    assert _impl(HICACHE_OBS_NO_EXTENSIONS="1") == PY
    got, log = _show(HICACHE_OBS_NO_EXTENSIONS=" slots , copy")
    assert got == {
        "impl": {**C, "slots": "py", "copy": "py"},
        "slot_map": "hicache_obs.events._slots_py",
        "log_core": "hicache_obs._logcore",
        "copies": None,  # the cpu runtime copies with the torch kernels
    }
    assert "LOG hicache_obs.native" not in log  # asked for: nothing to report


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"HICACHE_OBS_NO_EXTENSIONS": "yes"},
            "HICACHE_OBS_NO_EXTENSIONS='yes': unknown piece 'yes'; the value is 1 (every piece), 0 or empty (none), "
            "or a comma-separated list of logcore, slots, copy",
        ),
        (
            {"HICACHE_OBS_NO_EXTENSIONS": "slots,_copy"},
            "HICACHE_OBS_NO_EXTENSIONS='slots,_copy': unknown piece '_copy';",
        ),
        ({"HICACHE_OBS_NO_EXTENSIONS": "slots,"}, "HICACHE_OBS_NO_EXTENSIONS='slots,': unknown piece '';"),
        (
            {"HICACHE_OBS_REQUIRE_EXTENSIONS": "true"},
            "HICACHE_OBS_REQUIRE_EXTENSIONS='true': the value is 1 (require every C module), 0 or empty",
        ),
        (
            {"HICACHE_OBS_REQUIRE_EXTENSIONS": "1", "HICACHE_OBS_NO_EXTENSIONS": "copy"},
            "HICACHE_OBS_REQUIRE_EXTENSIONS=1 with HICACHE_OBS_NO_EXTENSIONS='copy': copy cannot be both required "
            "compiled and forced pure",
        ),
    ],
)
def test_a_value_the_switch_does_not_know_is_a_config_error(env: dict[str, str], message: str) -> None:
    proc = _child("import hicache_obs._native", **env)
    assert _config_error(proc).startswith(message)


def test_a_piece_that_is_not_built_runs_pure_and_says_so_at_debug_level() -> None:
    got, log = _show(hidden=("hicache_obs._copy", "hicache_obs._slots", "hicache_obs._logcore"))
    assert got["impl"] == PY
    assert got["copies"] is None and got["slot_map"] == "hicache_obs.events._slots_py"
    lines = [ln for ln in log.splitlines() if ln.startswith("LOG hicache_obs.native")]
    assert lines == [
        "LOG hicache_obs.native hicache_obs._logcore is not built (No module named 'hicache_obs._logcore'): "
        "running its pure-Python twin",
        "LOG hicache_obs.native hicache_obs._slots is not built (No module named 'hicache_obs._slots'): "
        "running its pure-Python twin",
        "LOG hicache_obs.native hicache_obs._copy is not built (No module named 'hicache_obs._copy'): "
        "running its pure-Python twin",
    ]


@pytest.mark.parametrize(
    ("hidden", "role"),
    [
        ("hicache_obs._copy", "the cpu runtime's copy loop"),
        ("hicache_obs._slots", "the slot maps"),
        ("hicache_obs._logcore", "the event log's append path"),
    ],
)
def test_required_extensions_refuse_a_piece_that_is_not_built(hidden: str, role: str) -> None:
    proc = _child(HIDE.format(hidden={hidden}) + "import hicache_obs._native", HICACHE_OBS_REQUIRE_EXTENSIONS="1")
    assert _config_error(proc) == (
        f"{hidden} ({role}) is not built (No module named {hidden!r}) and HICACHE_OBS_REQUIRE_EXTENSIONS=1: install the "
        "package with a C compiler present (make venv, or pip install -e .)"
    )
    assert _impl(HICACHE_OBS_REQUIRE_EXTENSIONS="1") == C


def test_every_piece_pure_runs_a_log_and_its_folds() -> None:
    got, _ = _show(HICACHE_OBS_NO_EXTENSIONS="1")
    assert got == {
        "impl": PY,
        "slot_map": "hicache_obs.events._slots_py",
        "log_core": "hicache_obs.events._logcore_py",
        "copies": None,
    }


def test_bench_reports_what_each_piece_ran_on() -> None:
    proc = _child(
        """
        import json
        from hicache_obs.lab.bench import run_bench
        print(json.dumps(run_bench(sections=())["machine"]))
        """,
        HICACHE_OBS_NO_EXTENSIONS="copy",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    machine = json.loads(proc.stdout.splitlines()[-1])
    assert machine["implementations"] == {**C, "copy": "py"}
    assert list(machine["implementations"]) == ["logcore", "slots", "copy"]
