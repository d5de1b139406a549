"""``--log-format json``: one JSON object per line, with the pod or node concerned, on every
long-running command; text stays the default.

The command tests run ``cli.main`` in process with the part that would serve replaced by a
function that logs, so the line checked is what the command's own logging setup wrote.
"""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from migpilot import logs
from migpilot.agent import fleet
from migpilot.cli import agent_cmd
from migpilot.cli import main as cli
from migpilot.controller import kubeapi, running
from migpilot.controller import serving as controller_serving
from migpilot.webhook import serving as webhook_serving
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
    monkeypatch.setattr(agent_cmd, "_run_once", _logs_one)
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
    monkeypatch.setattr(agent_cmd, "_run_once", once)
    monkeypatch.setattr(agent_cmd, "_cluster", lambda *_, **__: None)  # no API server here
    assert cli.main([*argv, "--node", "gpu-7", "--log-format", "json"], out=io.StringIO()) == 0
    doc = _json_line(capsys)
    assert (doc["message"], doc["node"]) == ("reconciled", "gpu-7")


# -- what the controller's lines concern ------------------------------------------------------


def test_the_controllers_lines_on_a_pod_name_the_pod_and_its_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeapi.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        _, start, profile = _reserved(api, "n0")["ns/p"]
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await api.put(kubeapi.Kind.NODES, _node("n0", **{"nvidia.com/mig-1g.10gb": "1"}))
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
