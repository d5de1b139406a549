"""Per-device utilisation for ``migpilot status --prometheus-url``, read from Prometheus.

Why it exists: the agents export ``migpilot_device_utilization_ratio`` per device handed to a
container (``docs/observability.md``, "Per-pod GPU metrics"); ``migpilot status`` shows it next
to each instance's holder. :class:`UtilizationSource` is the small boundary: :class:`Prometheus`
asks the HTTP API (``GET /api/v1/query``) with the standard library, :class:`InMemorySource`
serves fixed readings to tests. :func:`parse_vector` is the pure reading of the answer.

Keys of the result: the device-plugin ID (``device`` label, a MIG UUID for a MIG instance) and
``namespace/pod`` for a pod with exactly one device; a pod with several devices is keyed only by
its devices, never by a made-up sum or mean. A failing source raises :class:`QueryError`; the
caller says so and shows no utilisation. May import :mod:`migpilot.errors` only.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol

from migpilot import errors

QUERY = "migpilot_device_utilization_ratio"


class QueryError(errors.MigpilotError):
    """The utilisation source did not answer, or answered something else than a vector."""


class UtilizationSource(Protocol):
    """Where ``migpilot status`` reads utilisation (0-1) from."""

    name: str
    """Said in the output (``utilizationSource`` in JSON)."""

    def utilization(self) -> Mapping[str, float]:
        """Utilisation by device ID and by ``namespace/pod``; raises :class:`QueryError`."""
        ...


def parse_vector(doc: Any) -> dict[str, float]:
    """The instant-vector answer of ``/api/v1/query`` as utilisation by device and by pod."""
    if not isinstance(doc, dict) or doc.get("status") != "success":
        error = doc.get("error") if isinstance(doc, dict) else None
        raise QueryError(f"Prometheus answered no success: {error or doc!r:.200}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise QueryError("Prometheus answered something else than an instant vector")
    by_device: dict[str, float] = {}
    by_pod: dict[str, list[float]] = {}
    for sample in data.get("result") or []:
        labels = sample.get("metric") if isinstance(sample, dict) else None
        value = sample.get("value") if isinstance(sample, dict) else None
        if not isinstance(labels, dict) or not isinstance(value, list) or len(value) != 2:
            continue
        try:
            ratio = float(value[1])
        except (TypeError, ValueError):
            continue
        if not math.isfinite(ratio):
            continue
        device = labels.get("device")
        if device:
            by_device[str(device)] = ratio
        ns, pod = labels.get("namespace"), labels.get("pod")
        if ns and pod:
            by_pod.setdefault(f"{ns}/{pod}", []).append(ratio)
    out = {pod: vals[0] for pod, vals in by_pod.items() if len(vals) == 1}
    out.update(by_device)
    return out


class Prometheus:
    """Prometheus's HTTP API at ``url`` (e.g. ``http://prometheus:9090``)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.name = url
        self._url = url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": QUERY})
        self._timeout_s = timeout_s

    def utilization(self) -> Mapping[str, float]:
        try:
            with urllib.request.urlopen(self._url, timeout=self._timeout_s) as answer:
                doc = json.loads(answer.read())
        except urllib.error.HTTPError as err:
            try:
                doc = json.loads(err.read())
            except ValueError:
                raise QueryError(f"{self.name}: HTTP {err.code}") from None
        except (OSError, ValueError) as err:
            raise QueryError(f"{self.name}: {err}") from None
        return parse_vector(doc)


class InMemorySource:
    """Fixed readings, or a fixed failure, for tests."""

    def __init__(
        self, readings: Mapping[str, float] | None = None, *, name: str = "memory", fail: str = ""
    ) -> None:
        self.name = name
        self._readings = dict(readings or {})
        self._fail = fail

    def utilization(self) -> Mapping[str, float]:
        if self._fail:
            raise QueryError(self._fail)
        return dict(self._readings)
