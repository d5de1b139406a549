"""The Grafana dashboard ``deploy/grafana/migpilot.json`` read for the tests: its panels' queries
and its variables, and the queries as Prometheus runs them with every variable at ``.*``
(Grafana's ``allValue`` for "All")."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "migpilot.json"
CHART_COPY = REPO / "deploy" / "helm" / "migpilot" / "dashboards" / "migpilot.json"
"""The chart's copy (Helm's ``.Files.Get`` reads only files inside the chart): equal bytes."""

VARIABLES = ("node", "model", "namespace")
"""The dashboard's query variables, each multi-valued with "All" as ``.*``."""
BUILTINS = {"__rate_interval": "30s", "__interval": "30s", "__range": "5m"}
"""Grafana's own variables, as the tests set them (Prometheus scrapes every second there)."""
USED = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
"""A variable used in a query: ``$node``, ``${node}`` or ``${node:regex}``."""


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels that show data (rows left out; a collapsed row's panels included)."""
    out = []
    for p in doc["panels"]:
        if p["type"] == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def queries(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, target refId, expr) of every panel's target."""
    return [(p["title"], t["refId"], t["expr"]) for p in panels(doc) for t in p["targets"]]


def used(text: str) -> set[str]:
    """The variables ``text`` uses."""
    return {a or b for a, b in USED.findall(text)}


def resolved(expr: str) -> str:
    """``expr`` with the dashboard's variables at ``.*`` and Grafana's at :data:`BUILTINS`."""

    def value(m: re.Match[str]) -> str:
        name = m[1] or m[2]
        if name in VARIABLES:
            return ".*"
        return BUILTINS[name]

    return USED.sub(value, expr)
