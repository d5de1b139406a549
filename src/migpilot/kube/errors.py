"""What a call to the Kubernetes API server can fail with, for every shell.

Why it exists: the agent, the controller and the webhook each react to the same few failures (a
watch too old to resume, a write that lost a race, a server that refused or could not be
reached); one hierarchy lets :mod:`~migpilot.kube.client` translate lightkube's errors once and
:mod:`~migpilot.kube.memory` raise the same ones in the unit tests.

Imports no client.
"""

from __future__ import annotations

from migpilot import errors


class KubeApiError(errors.MigpilotError):
    """The API server refused a call or could not be reached (the message says which)."""

    def __init__(self, message: str, *, transient: bool = False, code: int | None = None) -> None:
        super().__init__(message)
        self.transient = transient
        """Worth trying again as it is: 429 (``storage is (re)initializing`` right after a
        CRD is created), a 5xx, or no answer at all (refused connection, timeout)."""
        self.code = code
        """The HTTP status the server answered (403, 500, ...); ``None`` without an answer."""


class GoneError(KubeApiError):
    """410 Gone: a watch's resource version is too old; list again and watch from there."""


class ConflictError(KubeApiError):
    """409 Conflict: the object changed since it was read (or exists already)."""


class NotFoundError(KubeApiError):
    """404 Not Found: the object (or its namespace) does not exist."""
