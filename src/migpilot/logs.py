"""How a long-running migpilot process logs: text for a person, or one JSON object per line.

Why it exists: the controller, the agent, the fleet and the webhook run in pods whose logs an
admin ships to ELK or Loki; a line of free text has to be parsed back with a regular
expression, a JSON object does not. ``--log-format json`` on each of those commands writes
one object per line with ``time`` (UTC, RFC 3339, milliseconds), ``level``, ``logger`` and
``message``, then ``pod`` (``namespace/name``) or ``node`` when the record concerns one, any
other ``extra`` field, and ``exception`` (the whole traceback, one string) when the record
carries one. Text stays the default, each command keeping its own line format.

Where ``pod`` and ``node`` come from, the first found winning: the log call's own
``extra=logs.about(pod=key, node=name)``; the block it runs in (``with
logs.concerning(node=name):``, which the fleet wraps around each node's pass, so that a line of
the single agent's code, which does not know which of a thousand nodes it serves, still names
it); the process's default (``configure(fields=...)``, the agent's own node).

It also quiets the HTTP client libraries (one line per request is the client's business, not
the operator's). Standard library only; the commands call :func:`configure` once, after
checking their flags.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import datetime
import enum
import json
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The line a person reads, unless a command names its own."""

QUIET = ("httpx2", "httpcore2", "httpx", "httpcore", "asyncio")
"""Loggers kept at WARNING: one line per HTTP request is not news."""

CONTEXT = ("pod", "node")
"""The fields that say what a record concerns, written right after the message."""

# Every attribute a plain LogRecord has: anything else on a record came from ``extra``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


class Format(enum.StrEnum):
    """``--log-format``."""

    TEXT = "text"
    """A line a person reads (the default)."""
    JSON = "json"
    """One JSON object per line, for ELK or Loki."""


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON (see the module). Non-ASCII text is escaped (``\\u00e9``),
    so the line is valid, and the same, whatever encoding the stream has; a line break in a
    message is escaped too, so a record is always one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT:
            value = getattr(record, name, None)
            if value is not None and value != "":
                out[name] = value
        for name, value in record.__dict__.items():
            if name not in _STANDARD and name not in out and not name.startswith("_"):
                out[name] = value
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=True, default=str)


def about(*, pod: str | None = None, node: str | None = None) -> dict[str, str]:
    """The ``extra`` of a log call on a pod (``namespace/name``) and/or a node; what is
    ``None`` or empty is left out (a pod not bound yet has no node to name)."""
    fields = {"pod": pod, "node": node}
    return {name: value for name, value in fields.items() if value}


_CONCERNING: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "migpilot_logs_concerning", default=()
)
"""What the records of the current thread (or asyncio task) concern: :func:`concerning`."""


@contextlib.contextmanager
def concerning(*, pod: str | None = None, node: str | None = None) -> Iterator[None]:
    """Every record logged inside the block, in this thread or task, concerns ``pod`` and
    ``node`` unless its call names its own (nested blocks add to the outer one's)."""
    fields = {**dict(_CONCERNING.get()), **about(pod=pod, node=node)}
    token = _CONCERNING.set(tuple(fields.items()))
    try:
        yield
    finally:
        _CONCERNING.reset(token)


class _Concerning(logging.Filter):
    """Gives a record the fields of the :func:`concerning` block it was logged in."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in _CONCERNING.get():
            if getattr(record, name, None) in (None, ""):
                setattr(record, name, value)
        return True


class _Defaults(logging.Filter):
    """Gives every record the fields it lacks (the agent's own node)."""

    def __init__(self, fields: Mapping[str, str]) -> None:
        super().__init__()
        self._fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in self._fields.items():
            if getattr(record, name, None) in (None, ""):
                setattr(record, name, value)
        return True


class _Handler(logging.StreamHandler[IO[str]]):
    """The handler :func:`configure` installs, marked so that a second call replaces it.
    Without a stream of its own it writes to ``sys.stderr`` as it is at each record, as
    ``logging.lastResort`` does: whoever swapped stderr since (a test's capture, since closed)
    is followed, not written to after it closed."""

    def __init__(self, stream: IO[str] | None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self._follow = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow:
            self.stream = sys.stderr
        super().emit(record)


def formatter(log_format: Format | str, *, text: str = TEXT_FORMAT) -> logging.Formatter:
    """The formatter for ``log_format``: :class:`JsonFormatter`, or ``text`` as a line."""
    if Format(log_format) is Format.JSON:
        return JsonFormatter()
    return logging.Formatter(text)


def configure(
    log_format: Format | str,
    *,
    verbose: bool = False,
    text: str = TEXT_FORMAT,
    fields: Mapping[str, str] | None = None,
    stream: IO[str] | None = None,
    quiet: Iterable[str] = QUIET,
) -> logging.Handler:
    """Send the root logger's records to ``stream`` (stderr) in ``log_format``, at DEBUG when
    ``verbose`` else INFO; ``fields`` are given to every record that lacks them (and was not
    logged in a :func:`concerning` block naming them). Replaces what
    an earlier call installed, and leaves other handlers (a test's capture) alone."""
    handler = _Handler(stream)
    handler.setFormatter(formatter(log_format, text=text))
    handler.addFilter(_Concerning())  # before the defaults: a block's node wins over them
    if fields:
        handler.addFilter(_Defaults(fields))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    return handler


def add_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-format text|json`` to a command's parser."""
    parser.add_argument(
        "--log-format",
        choices=[f.value for f in Format],
        default=Format.TEXT.value,
        help="text: a line a person reads (default); json: one JSON object per line with "
        "time, level, logger, message and the pod or node concerned, for ELK or Loki",
    )


def _utc(created: float) -> str:
    moment = datetime.datetime.fromtimestamp(created, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
