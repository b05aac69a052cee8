"""Every query of the shipped Grafana dashboard names only metrics pagerail exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pagerail.cluster.core.engine_metrics import EngineMetrics
from pagerail.cluster.frontend.tenant_quotas import TenantQuotas

DASHBOARD = Path(__file__).resolve().parent.parent / "helm" / "pagerail" / "dashboards" / "pagerail-dashboard.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_families() -> list:
    """The engine's families and the frontend's own (quota refusals by tenant)."""
    return [*EngineMetrics("any").registry.collect(), *TenantQuotas().registry.collect()]


def exported_series() -> set[str]:
    names = set()
    for family in exported_families():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    found += [v["query"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    return found


def test_dashboard_queries_name_only_exported_metrics():
    exported = exported_series()
    used = {name for query in queries() for name in re.findall(r"\bpagerail_[a-z0-9_]+", query)}
    assert used, "the dashboard queries no pagerail metric"
    assert used <= exported, f"not exported: {sorted(used - exported)}"
    # Every exported family appears somewhere, so the dashboard covers what the engine measures.
    families = {family.name for family in exported_families()}
    covered = {family for family in families if any(name.startswith(family) for name in used)}
    assert covered == families, f"not charted: {sorted(families - covered)}"
