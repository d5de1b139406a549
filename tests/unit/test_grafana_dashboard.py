"""The Grafana dashboard ``deploy/grafana/migpilot.json``: a valid dashboard model whose panels
all query the ``${datasource}`` variable, use only variables it defines, and filter each series
by the variables its labels allow. Its queries run against a real Prometheus in
``tests/e2e/test_grafana.py``."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests import dashboard

DOC = dashboard.load()
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The labels of each series the dashboard reads that a variable filters (docs/observability.md).
FILTERED_BY = {
    "migpilot_node_allocation_ratio": {"node", "model"},
    "migpilot_node_fragmentation_ratio": {"node", "model"},
    "migpilot_instances": {"node"},
    "migpilot_gpu_utilization_ratio": {"node"},
    "migpilot_gpu_memory_used_bytes": {"node"},
    "migpilot_device_utilization_ratio": {"node", "namespace"},
    "migpilot_device_memory_used_bytes": {"node", "namespace"},
    "migpilot_device_memory_total_bytes": {"node", "namespace"},
}
SELECTOR = re.compile(r"\b(migpilot_\w+)(\{[^}]*\})?")


def _variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in DOC["templating"]["list"]}


def test_the_chart_ships_the_same_dashboard() -> None:
    assert dashboard.CHART_COPY.read_bytes() == dashboard.DASHBOARD.read_bytes()


def test_it_is_a_dashboard_model_grafana_imports() -> None:
    assert DOC["schemaVersion"] >= 36
    assert DOC["uid"] == "migpilot" and DOC["title"]
    ids = [p["id"] for p in DOC["panels"]]
    assert len(ids) == len(set(ids))
    for p in DOC["panels"]:
        assert set(p["gridPos"]) == {"h", "w", "x", "y"}, p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


def test_the_datasource_is_a_prometheus_variable() -> None:
    ds = _variables()["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"


@pytest.mark.parametrize("name", dashboard.VARIABLES)
def test_node_model_and_namespace_are_label_values_with_all_as_any(name: str) -> None:
    var = _variables()[name]
    assert var["type"] == "query" and var["datasource"] == DATASOURCE
    assert var["multi"] is True and var["includeAll"] is True and var["allValue"] == ".*"
    assert re.fullmatch(rf"label_values\(migpilot_\w+(\{{[^}}]*\}})?, {name}\)", var["definition"])
    assert var["query"]["query"] == var["definition"]


def test_every_panel_has_the_datasource_and_a_query() -> None:
    shown = dashboard.panels(DOC)
    assert len(shown) >= 10
    for p in shown:
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE, p["title"]
            assert t["expr"].strip(), p["title"]


def test_every_variable_used_is_defined_and_every_defined_one_used() -> None:
    defined = set(_variables())
    texts = [expr for _, _, expr in dashboard.queries(DOC)]
    texts += [v["definition"] for v in DOC["templating"]["list"] if v["type"] == "query"]
    texts += [str(p["datasource"]) for p in dashboard.panels(DOC)]
    uses = set().union(*(dashboard.used(t) for t in texts))
    assert uses - defined - set(dashboard.BUILTINS) == set()
    assert defined <= uses


def test_each_series_is_filtered_by_every_variable_its_labels_allow() -> None:
    seen = set()
    for title, ref, expr in dashboard.queries(DOC):
        for name, selector in SELECTOR.findall(expr):
            base = re.sub(r"_(bucket|total|count|sum)$", "", name)
            labels = FILTERED_BY.get(base, set())
            seen.add(base)
            for label in labels:
                assert f'{label}=~"${label}"' in selector, (title, ref, name)
            for label in set(dashboard.VARIABLES) - labels:
                assert f"${label}" not in selector, (title, ref, name)
    assert set(FILTERED_BY) <= seen  # every per-node and per-pod series is on the dashboard


def test_every_series_queried_is_one_migpilot_serves() -> None:
    served = "\n".join(p.read_text() for p in (dashboard.REPO / "src" / "migpilot").rglob("*.py"))
    for title, _, expr in dashboard.queries(DOC):
        for name, _ in SELECTOR.findall(expr):
            base = re.sub(r"_(bucket|total)$", "", name)
            assert f'"{base}"' in served, (title, name)


def test_with_every_variable_at_all_no_dollar_is_left() -> None:
    for _, _, expr in dashboard.queries(DOC):
        got = dashboard.resolved(expr)
        assert "$" not in got
        if "$node" in expr:
            assert 'node=~".*"' in got
    assert dashboard.resolved("rate(x[$__rate_interval])") == "rate(x[30s])"
    with pytest.raises(KeyError):
        dashboard.resolved("$nosuch")
