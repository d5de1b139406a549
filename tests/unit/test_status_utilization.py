"""``migpilot status --prometheus-url``: reading ``migpilot_device_utilization_ratio`` from
Prometheus's query API (a real HTTP server on localhost), mapping it to the device rows, and a
failing source being a warning with no utilisation shown, never a made-up number."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from migpilot.cli import status_cmd
from migpilot.controller import kube, querying, surveying
from tests.unit.test_status import _cluster, _devices, _node_of, _text


def _sample(value: str, **labels: str) -> dict[str, Any]:
    return {"metric": {"__name__": querying.QUERY, **labels}, "value": [1.0, value]}


def _vector(*samples: dict[str, Any]) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": list(samples)}}


def test_parse_keys_by_device_and_by_pod_with_one_device() -> None:
    doc = _vector(
        _sample("0.25", namespace="ns", pod="a", device="MIG-a"),
        _sample("0.5", namespace="ns", pod="two", device="GPU-0::mps-0"),
        _sample("0.75", namespace="ns", pod="two", device="GPU-0::mps-1"),
        _sample("NaN", namespace="ns", pod="nan", device="MIG-n"),
        _sample("x", namespace="ns", pod="bad", device="MIG-b"),
    )
    assert querying.parse_vector(doc) == {
        "MIG-a": 0.25,
        "ns/a": 0.25,
        "GPU-0::mps-0": 0.5,
        "GPU-0::mps-1": 0.75,
    }  # ns/two has two devices: no per-pod number is made up


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"status": "error", "error": "parse error at char 3"}, "parse error at char 3"),
        ({"status": "success", "data": {"resultType": "matrix"}}, "instant vector"),
        ([], "no success"),
    ],
)
def test_parse_refuses_what_is_not_a_vector(doc: Any, said: str) -> None:
    with pytest.raises(querying.QueryError, match=said):
        querying.parse_vector(doc)


def test_a_device_reading_wins_over_its_pods() -> None:
    got = surveying.survey(**_cluster(), utilization={"MIG-a": 0.3, "ns/a": 0.9})
    assert _devices(_node_of(got, "n1"))[(0, "1g.10gb", 4)].utilization == 0.3
    only_pod = surveying.survey(**_cluster(), utilization={"ns/a": 0.9})
    assert _devices(_node_of(only_pod, "n1"))[(0, "1g.10gb", 4)].utilization == 0.9


def _objects() -> kube.Objects:
    return kube.Objects(**_cluster())


def test_a_source_fills_the_util_column() -> None:
    warned: list[str] = []
    source = querying.InMemorySource({"MIG-a": 0.42}, name="http://prom:9090")
    got = status_cmd.surveyed(_objects(), source=source, warn=warned.append)
    assert not warned
    assert got.utilization_source == "http://prom:9090"
    lines = [line.split() for line in _text(got).splitlines()]
    assert ["0", "1g.10gb", "4", "used", "ns/a", "(inferred)", "42%"] in lines
    assert surveying.to_json(got)["utilizationSource"] == "http://prom:9090"


def test_a_failing_source_is_a_warning_and_no_column() -> None:
    warned: list[str] = []
    source = querying.InMemorySource(name="http://prom:9090", fail="connection refused")
    got = status_cmd.surveyed(_objects(), source=source, warn=warned.append)
    assert warned == ["migpilot: warning: no utilisation: connection refused"]
    assert got.utilization_source is None
    assert all(d.utilization is None for n in got.nodes for g in n.gpus for d in g.devices)
    assert "UTIL" not in _text(got)


class _Prom(http.server.BaseHTTPRequestHandler):
    answers: ClassVar[list[tuple[int, bytes]]] = []
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.asked.append(self.path)
        code, body = self.answers.pop(0)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def prom() -> Iterator[str]:
    _Prom.answers, _Prom.asked = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Prom)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_prometheus_over_http(prom: str) -> None:
    body = json.dumps(_vector(_sample("0.5", namespace="ns", pod="a", device="MIG-a"))).encode()
    _Prom.answers.append((200, body))
    assert querying.Prometheus(prom).utilization() == {"MIG-a": 0.5, "ns/a": 0.5}
    (path,) = _Prom.asked
    url = urllib.parse.urlsplit(path)
    assert url.path == "/api/v1/query"
    assert urllib.parse.parse_qs(url.query) == {"query": ["migpilot_device_utilization_ratio"]}


def test_prometheus_errors_are_query_errors(prom: str) -> None:
    bad = {"status": "error", "errorType": "bad_data", "error": "invalid parameter"}
    _Prom.answers += [(400, json.dumps(bad).encode()), (503, b"<html>down</html>")]
    with pytest.raises(querying.QueryError, match="invalid parameter"):
        querying.Prometheus(prom).utilization()
    with pytest.raises(querying.QueryError, match="HTTP 503"):
        querying.Prometheus(prom).utilization()
    with pytest.raises(querying.QueryError, match="127.0.0.1:1"):
        querying.Prometheus("http://127.0.0.1:1", timeout_s=2).utilization()
