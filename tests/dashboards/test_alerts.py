"""Alert rules (promtool check + unit tests), the demo's Prometheus config and Grafana provisioning."""

from __future__ import annotations

import re
import subprocess

import pytest
from dashboard_checks import DASHBOARDS, load_generator, metric_names_in, require_binary

from hicache_obs.exporters import metric_names as m

gen = load_generator()
RULES = [r for g in gen.build_alert_rules()["groups"] for r in g["rules"]]
ALERTS = {r["alert"]: r for r in RULES}
PROVISIONING = DASHBOARDS / "provisioning" / "grafana"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = require_binary("promtool", "HICACHE_REQUIRE_PROMTOOL")
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=DASHBOARDS, timeout=60)


# ------------------------------------------------------------------ promtool
def test_promtool_check_rules() -> None:
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in out.stdout


def test_promtool_test_rules() -> None:
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_check_demo_config() -> None:
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 1 rule files found" in out.stdout


# ------------------------------------------------------------------ rules
def test_required_alerts() -> None:
    assert ALERTS["HiCacheUnrecordedIndices"]["expr"] == f"increase({m.UNRECORDED_INDICES_TOTAL}[5m]) > 0"
    assert m.AUDIT_VIOLATIONS_TOTAL in ALERTS["HiCacheAuditViolation"]["expr"]
    assert m.EVENTS_DROPPED_TOTAL in ALERTS["HiCacheEventsDropped"]["expr"]
    stuck = ALERTS["HiCacheTransfersStuck"]["expr"]
    assert m.TRANSFERS_IN_FLIGHT in stuck and m.OPERATIONS_TOTAL in stuck and "[5m]" in stuck


@pytest.mark.parametrize("alert", sorted(ALERTS))
def test_alert_has_severity_annotations_and_known_metrics(alert: str) -> None:
    rule = ALERTS[alert]
    assert rule["labels"]["severity"] in ("critical", "warning")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    defined, undefined = metric_names_in(rule["expr"], m.ALL_METRICS)
    assert defined and not undefined, rule["expr"]


def _unit_test_cases() -> dict[str, set[str]]:
    """alert name -> {"firing", "quiet"} cases in alerts_test.yml (a line-based read: no YAML parser here)."""
    cases: dict[str, set[str]] = {}
    lines = (DASHBOARDS / "alerts_test.yml").read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"\s*alertname:\s*(\S+)\s*$", line)
        if not match:
            continue
        nxt = next(ln for ln in lines[i + 1 :] if ln.strip() and not ln.strip().startswith("#"))
        kind = "quiet" if re.match(r"\s*exp_alerts:\s*\[\]\s*$", nxt) else "firing"
        cases.setdefault(match.group(1), set()).add(kind)
    return cases


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    cases = _unit_test_cases()
    for alert in ALERTS:
        assert cases.get(alert) == {"firing", "quiet"}, f"{alert}: {cases.get(alert)}"
    assert set(cases) <= set(ALERTS), f"tests of unknown alerts: {set(cases) - set(ALERTS)}"


# ------------------------------------------------------------------ demo config and provisioning
def test_demo_prometheus_config_scrapes_the_demo() -> None:
    text = (DASHBOARDS / "prometheus.yml").read_text()
    assert re.search(r"^\s*-\s*job_name:\s*hicache\s*$", text, re.M)
    assert '"127.0.0.1:9400"' in text
    assert re.search(r"^rule_files:\s*\n\s*-\s*alerts\.yml\s*$", text, re.M)


def test_grafana_datasource_provisioning() -> None:
    text = (PROVISIONING / "datasources" / "hicache.yml").read_text()
    assert re.search(r"^apiVersion:\s*1\s*$", text, re.M)
    assert re.search(r"^\s*type:\s*prometheus\s*$", text, re.M)
    assert re.search(r"^\s*url:\s*http://(localhost|prometheus):9090\s*$", text, re.M)
    assert re.search(r"^\s*isDefault:\s*true\s*$", text, re.M)
    assert not re.search(r"^\s*uid:", text, re.M), "the dashboards use the datasource variable, not a uid"


def test_grafana_dashboard_provisioning() -> None:
    text = (PROVISIONING / "dashboards" / "hicache.yml").read_text()
    assert re.search(r"^apiVersion:\s*1\s*$", text, re.M)
    assert re.search(r"^\s*type:\s*file\s*$", text, re.M)
    assert re.search(r"^\s*path:\s*/var/lib/grafana/dashboards/hicache\s*$", text, re.M)
