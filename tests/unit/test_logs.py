"""``--log-format json``: one JSON object per line, with the pod or node concerned, on every
long-running command; text stays the default.

The command tests run ``cli.main`` in process with the part that would serve replaced by a
function that logs, so the line checked is what the command's own logging setup wrote.
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import ssl
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from migpilot import logs
from migpilot.agent import assembling
from migpilot.agent.cluster import kubeapi as agent_kubeapi
from migpilot.cli import main as cli
from migpilot.controller import kubeapi, running
from migpilot.controller import serving as controller_serving
from migpilot.gpu import emulated
from migpilot.kube import memory as kubememory
from migpilot.kube import objects as kubeobjects
from migpilot.kwok import fleet
from migpilot.webhook import leases as webhook_leases
from migpilot.webhook import serving as webhook_serving
from tests.kube import certs
from tests.unit import test_kwok_fleet as fleet_tests
from tests.unit import test_kwok_standin as standin_tests
from tests.unit.test_controller_running import (
    _agent_reports,
    _node,
    _pod,
    _ready_node,
    _reserved,
    _run,
    _until,
)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Each test leaves the root logger as it found it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def _record(msg: str, *args: Any, level: int = logging.INFO, **extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("migpilot.test", level, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def _lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def test_a_record_is_one_object_with_time_level_logger_message_and_what_it_concerns() -> None:
    record = _record("pod %s pinned to %s", "ns/p", "n0", pod="ns/p", node="n0")
    record.created = 1767225600.25  # 2026-01-01T00:00:00.250Z
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    assert json.loads(line) == {
        "time": "2026-01-01T00:00:00.250Z",
        "level": "INFO",
        "logger": "migpilot.test",
        "message": "pod ns/p pinned to n0",
        "pod": "ns/p",
        "node": "n0",
    }
    assert list(json.loads(line))[:6] == ["time", "level", "logger", "message", "pod", "node"]


def test_no_pod_or_node_field_when_the_record_concerns_none_and_other_extras_kept() -> None:
    doc = json.loads(logs.JsonFormatter().format(_record("plan 1", level=logging.DEBUG, gpu=3)))
    assert "pod" not in doc and "node" not in doc
    assert doc["level"] == "DEBUG" and doc["gpu"] == 3


def test_a_message_with_line_breaks_and_non_ascii_is_one_valid_ascii_line() -> None:
    record = _record("GpuLayout n\u00e9ud ignored:\nline two \u2014 \U0001f600", node="n\u00e9ud")
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    assert line.isascii()
    doc = json.loads(line)
    assert doc["message"] == "GpuLayout n\u00e9ud ignored:\nline two \u2014 \U0001f600"
    assert doc["node"] == "n\u00e9ud"


def test_an_exception_is_one_field_with_its_traceback() -> None:
    try:
        raise ValueError("bad spec \u00e9")
    except ValueError:
        record = logging.LogRecord(
            "migpilot.controller", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["message"] == "failed"
    assert doc["exception"].startswith("Traceback (most recent call last):\n")
    assert "test_an_exception_is_one_field_with_its_traceback" in doc["exception"]
    assert doc["exception"].endswith("ValueError: bad spec \u00e9")


def test_a_value_json_cannot_write_is_written_as_its_text() -> None:
    doc = json.loads(logs.JsonFormatter().format(_record("x", path=Path("/a/b"))))
    assert doc["path"] == "/a/b"


def test_configure_json_writes_each_record_as_a_line_and_fills_default_fields() -> None:
    stream = io.StringIO()
    logs.configure("json", stream=stream, fields={"node": "n7"})
    log = logging.getLogger("migpilot.agent")
    log.info("reconciled")
    log.info("pod on another node", extra={"node": "n8", "pod": "ns/p"})
    log.debug("not at INFO")
    first, second = _lines(stream.getvalue())
    assert (first["message"], first["node"]) == ("reconciled", "n7")
    assert (second["node"], second["pod"]) == ("n8", "ns/p")


def test_configure_again_replaces_its_handler_and_keeps_others() -> None:
    root = logging.getLogger()
    other = logging.NullHandler()
    root.addHandler(other)
    first, second = io.StringIO(), io.StringIO()
    logs.configure("json", stream=first)
    logs.configure("text", stream=second, verbose=True, text="%(levelname)s %(message)s")
    logging.getLogger("migpilot.x").debug("hello")
    assert first.getvalue() == ""
    assert second.getvalue() == "DEBUG hello\n"
    assert other in root.handlers
    assert logging.getLogger("httpx").level == logging.WARNING


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError):
        logs.formatter("yaml")


# -- the flag on each command -----------------------------------------------------------------


def _logs_one(*_: Any, **__: Any) -> int:
    logging.getLogger("migpilot.test").info(
        "pod ns/p pinned to n0", extra={"pod": "ns/p", "node": "n0"}
    )
    return 0


def _json_line(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    err = capsys.readouterr().err
    (doc,) = [d for d in _lines(err) if d["logger"] == "migpilot.test"]
    return doc


def _webhook_args(tmp_path: Path) -> list[str]:
    (tmp_path / "c.pem").write_text("x")
    (tmp_path / "k.pem").write_text("x")
    return ["webhook", "--cert", str(tmp_path / "c.pem"), "--key", str(tmp_path / "k.pem")]


def _command(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The command line of ``name``, with what would serve replaced by :func:`_logs_one`."""
    if name == "controller":
        monkeypatch.setattr(controller_serving, "run", _logs_one)
        return ["controller", "--identity", "me", "--metrics-port", "0"]
    if name == "fleet":
        monkeypatch.setattr(fleet, "run", _logs_one)
        return ["fleet"]
    if name == "webhook":
        monkeypatch.setattr(webhook_serving, "run", _logs_one)
        return _webhook_args(tmp_path)
    monkeypatch.setattr(assembling, "run_once", _logs_one)
    return [
        "agent",
        "--backend",
        "emulated:h100-80gb:x1",
        "--state-file",
        str(tmp_path / "state.json"),
        "--no-kubelet",
        "--once",
    ]


@pytest.mark.parametrize("name", ["controller", "agent", "fleet", "webhook"])
def test_log_format_json_on_each_command(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _command(name, tmp_path, monkeypatch)
    assert cli.main([*argv, "--log-format", "json"], out=io.StringIO()) == 0
    doc = _json_line(capsys)
    assert (doc["level"], doc["message"]) == ("INFO", "pod ns/p pinned to n0")
    assert (doc["pod"], doc["node"]) == ("ns/p", "n0")
    assert doc["time"].endswith("Z")


@pytest.mark.parametrize("name", ["controller", "agent", "fleet", "webhook"])
def test_text_stays_the_default_on_each_command(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _command(name, tmp_path, monkeypatch)
    assert cli.main(argv, out=io.StringIO()) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "migpilot.test" in x]
    assert line.endswith("pod ns/p pinned to n0")
    assert not line.startswith("{")


@pytest.mark.parametrize("name", ["controller", "agent", "fleet", "webhook"])
def test_an_unknown_log_format_is_refused_on_each_command(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _command(name, tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--log-format", "logfmt"], out=io.StringIO())
    assert exit_.value.code == 2
    assert "--log-format: invalid choice: 'logfmt'" in capsys.readouterr().err


def test_the_agent_gives_its_node_to_every_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def once(*_: Any, **__: Any) -> int:
        logging.getLogger("migpilot.test").info("reconciled")
        return 0

    argv = _command("agent", tmp_path, monkeypatch)
    monkeypatch.setattr(assembling, "run_once", once)
    monkeypatch.setattr(assembling, "connect_cluster", lambda *_, **__: None)  # no API server here
    assert cli.main([*argv, "--node", "gpu-7", "--log-format", "json"], out=io.StringIO()) == 0
    doc = _json_line(capsys)
    assert (doc["message"], doc["node"]) == ("reconciled", "gpu-7")


# -- what the controller's lines concern ------------------------------------------------------


def test_the_controllers_lines_on_a_pod_name_the_pod_and_its_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        _, start, profile = _reserved(api, "n0")["ns/p"]
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-1g.10gb": "1"}))
        await _until("the pin", lambda: any("pinned" in m for m in caplog.messages))

    with caplog.at_level(logging.INFO, logger="migpilot.controller"):
        _run(body)
    (pinned,) = [r for r in caplog.records if "pinned" in r.getMessage()]
    doc = json.loads(logs.JsonFormatter().format(pinned))
    assert (doc["pod"], doc["node"]) == ("ns/p", "n0")


def test_without_a_stream_it_follows_stderr_as_it_is_at_each_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A handler bound to the stderr of the moment wrote to a test's capture after it closed
    # ("I/O operation on closed file" on every later record); it writes where stderr is now.
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler = logs.configure("text", text="%(message)s")
    try:
        logging.getLogger("migpilot.test").warning("one")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("migpilot.test").warning("two")
    finally:
        logging.getLogger().removeHandler(handler)
    assert second.getvalue() == "two\n"


# -- what a line concerns: logs.about and logs.concerning ----------------------------------------


def test_about_names_the_pod_and_the_node_and_leaves_out_what_is_unknown() -> None:
    assert logs.about(pod="ns/p", node="n0") == {"pod": "ns/p", "node": "n0"}
    assert logs.about(pod="ns/p", node=None) == {"pod": "ns/p"}
    assert logs.about(node="") == {}


def test_a_block_names_what_its_lines_concern_unless_a_call_or_an_inner_block_says_otherwise() -> (
    None
):
    stream = io.StringIO()
    logs.configure("json", stream=stream, fields={"node": "default"})
    log = logging.getLogger("migpilot.test")
    with logs.concerning(node="n1"):
        log.info("in the block")
        log.info("a call of its own", extra=logs.about(node="n2"))
        with logs.concerning(pod="ns/p"):
            log.info("inner block")
    log.info("after the block")
    lines = {d["message"]: (d.get("node"), d.get("pod")) for d in _lines(stream.getvalue())}
    assert lines == {
        "in the block": ("n1", None),
        "a call of its own": ("n2", None),
        "inner block": ("n1", "ns/p"),
        "after the block": ("default", None),
    }


def test_a_block_concerns_its_own_thread_only() -> None:
    stream = io.StringIO()
    logs.configure("json", stream=stream)
    log = logging.getLogger("migpilot.test")
    inside, other = threading.Event(), threading.Event()

    def elsewhere() -> None:
        inside.wait(5)
        log.info("another thread")
        other.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with logs.concerning(node="n1"):
        inside.set()
        other.wait(5)
        log.info("this thread")
    thread.join(5)
    lines = {d["message"]: d.get("node") for d in _lines(stream.getvalue())}
    assert lines == {"another thread": None, "this thread": "n1"}


# -- the fleet's, the agent's and the webhook's lines name their node and pod ---------------------


def test_every_line_of_a_fleet_pass_names_its_node_and_a_pods_line_the_pod() -> None:
    """The fleet runs a thousand nodes' agents in one process, with no default node: its own
    lines, and those of the single agent's code run in a node's pass (which never names the
    node itself), carry the node; the stand-in kubelet's line on a pod carries the pod."""
    stream = io.StringIO()
    logs.configure("json", stream=stream)
    api = agent_kubeapi.InMemoryNodeApi()
    f = fleet.Fleet(api, settings=fleet.FleetSettings(times=emulated.INSTANT))
    for node in ("n0", "n1"):
        api.put_node(node, {fleet.EMULATED_GPUS_LABEL: "h100-80gb.x1"})
        api.put_spec(
            node,
            fleet_tests.spec([fleet_tests.inst("1g.10gb", 0, "ns/p" if node == "n0" else None)]),
        )
    api.put_node("bad", {fleet.EMULATED_GPUS_LABEL: "nope.x2"})
    f.layouts_listed(api.list_layouts().items)
    f.nodes_listed(api.list_nodes(selector=fleet.DEFAULT_SELECTOR).items)
    f.drain()
    api.put_pod(fleet_tests.pod_doc("p", "n0", {fleet_tests.R1G: 1}))
    f.pods.listed(api.list_pods(node=None).items)
    f.drain()
    api.close()
    lines = [
        d
        for d in _lines(stream.getvalue())
        if d["logger"].startswith(("migpilot.agent", "migpilot.kwok"))
    ]
    assert lines and all(d.get("node") in ("n0", "n1", "bad") for d in lines), lines
    by_logger = {(d["logger"], d["node"]) for d in lines}
    assert {
        ("migpilot.kwok.fleet", "n0"),
        ("migpilot.kwok.fleet", "bad"),  # refused: its label names no GPUs
        ("migpilot.agent.running", "n0"),  # the reconciler's actions, named by the pass
        ("migpilot.agent.running", "n1"),
        ("migpilot.agent.cluster.following", "n1"),  # the GpuLayout status written
    } <= by_logger
    (gets,) = [d for d in lines if "pod ns/p gets" in d["message"]]
    assert (gets["logger"], gets["pod"], gets["node"]) == ("migpilot.kwok.standin", "ns/p", "n0")
    assert all(d["node"] in d["message"] for d in lines if "Node " in d["message"])


def test_an_agents_lines_name_their_node_and_pod_without_the_processs_default(
    node: standin_tests.Node,
) -> None:
    stream = io.StringIO()
    logs.configure("json", stream=stream)  # no default node: the calls name it themselves
    node.api.put_spec(standin_tests.NODE, standin_tests.spec([standin_tests.inst("1g.10gb", 0)]))
    node.step()
    node.api.put_pod(standin_tests.pod_doc("p", {standin_tests.R1G: 1}))
    node.step()
    lines = _lines(stream.getvalue())
    (gets,) = [d for d in lines if "pod default/p gets" in d["message"]]
    assert (gets["pod"], gets["node"]) == ("default/p", standin_tests.NODE)
    written = [d for d in lines if d["message"].startswith("GpuLayout ")]
    assert written and all(d["node"] == standin_tests.NODE for d in written)


@pytest.fixture
def node() -> Iterator[standin_tests.Node]:
    api = agent_kubeapi.InMemoryNodeApi()
    gpus = emulated.EmulatedBackend([standin_tests.H100], durable=False)
    yield standin_tests.wire(api, gpus)
    api.close()
    gpus.close()


def _pod_review(uid: str, metadata: dict[str, Any], *, node: str | None = None) -> bytes:
    spec: dict[str, Any] = {"containers": [{"name": "app", "resources": {}}]}
    if node is not None:
        spec["nodeName"] = node
    request = {
        "uid": uid,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE",
        "namespace": "team",
        "name": metadata.get("name", ""),
        "object": {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec},
    }
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    return json.dumps(review).encode()


def test_the_webhooks_line_on_a_review_names_the_pod_and_its_node(tmp_path: Path) -> None:
    stream = io.StringIO()
    logs.configure("json", stream=stream, verbose=True)  # one line per review: at DEBUG
    ca = certs.CertificateAuthority(tmp_path)
    pair = ca.issue("webhook", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    settings = webhook_serving.Settings(
        tls=webhook_serving.TlsSettings(cert_file=pair.cert, key_file=pair.key),
        host="127.0.0.1",
        port=0,
    )
    lease = {
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"holderIdentity": "c", "renewTime": "1970-01-01T00:01:40Z"},
    }
    api = kubememory.InMemoryServer()
    api.put(kubeobjects.Kind.LEASES, lease)
    freshness = webhook_leases.Freshness(
        webhook_leases.KubeLease(api, name="c", namespace="ns"), cache_s=2.0, clock=lambda: 100.0
    )
    context = ssl.create_default_context(cafile=ca.pair.cert)
    with webhook_serving.WebhookServer(settings, freshness=freshness) as server:
        for path, body in (
            ("/mutate-pods", _pod_review("u1", {"name": "infer"}, node="n3")),
            ("/validate-pods", _pod_review("u2", {"generateName": "job-"})),
        ):
            conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context)
            try:
                conn.request("POST", path, body, headers={"Content-Type": "application/json"})
                assert conn.getresponse().status == 200
            finally:
                conn.close()
    reviews = {
        d["message"].split(" ")[2].rstrip(":"): d
        for d in _lines(stream.getvalue())
        if d["logger"] == "migpilot.webhook" and d["message"].startswith("review ")
    }
    assert (reviews["u1"]["pod"], reviews["u1"]["node"]) == ("team/infer", "n3")
    assert reviews["u2"]["pod"] == "team/job-*" and "node" not in reviews["u2"]
