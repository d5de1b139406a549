"""Keep MPS-shared GPUs in ``EXCLUSIVE_PROCESS`` while their daemon runs, as NVIDIA's plugin does.

Why it exists: a GPU shared through MPS must accept one CUDA context only, the MPS server's;
in the ``DEFAULT`` compute mode a process that bypasses MPS (no pipe directory, or a container
that mounts the GPU without it) still gets its own context on the GPU, outside every client's
memory and thread limit. NVIDIA's MPS control daemon sets its GPUs to ``EXCLUSIVE_PROCESS``
before it starts and back to ``DEFAULT`` after it quits (``nvidia-smi -i UUID -c MODE``). The
agent does the same around the :class:`~migpilot.agent.sharing.mps.MpsSupervisor`'s pass:

* :meth:`ComputeModeKeeper.prepare`, before the pass: every whole GPU a wanted daemon shares is
  put in ``EXCLUSIVE_PROCESS`` where it is not already; a daemon one of whose GPUs cannot be set
  is returned as blocked (the supervisor fails its start, so the node's sharing state is
  ``failed``), and the next pass tries again;
* :meth:`ComputeModeKeeper.release`, after the pass: a GPU the agent put (or found) in
  ``EXCLUSIVE_PROCESS`` for a daemon, which no daemon the supervisor still keeps shares, goes
  back to ``DEFAULT``; a failure is logged and retried at the next pass.

Only whole GPUs: a daemon's device UUID that names no GPU of the backend's list (a MIG device)
or names a GPU in MIG mode is left alone, since the mode then belongs to each MIG device and
migpilot never sets it there. A GPU no daemon ever needed is never touched, so a mode an
administrator set outside MPS stays. The decisions (:func:`daemon_gpus`, :func:`to_exclusive`,
:func:`to_default`) are pure; the class does the backend calls. A shell module: it imports the
GPU backend interface and the MPS daemon spec, no driver bindings and no Kubernetes client.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from migpilot.gpu import backend, mps

_log = logging.getLogger(__name__)

EXCLUSIVE = backend.ComputeMode.EXCLUSIVE_PROCESS
DEFAULT = backend.ComputeMode.DEFAULT


@dataclass(frozen=True, slots=True)
class ModeChange:
    """Set GPU ``gpu`` to ``mode``, for ``daemons`` (none when it is given back)."""

    gpu: int
    mode: backend.ComputeMode
    daemons: tuple[str, ...] = ()


def daemon_gpus(
    specs: Iterable[mps.MpsDaemonSpec], gpus: Iterable[backend.GpuInfo]
) -> dict[str, tuple[int, ...]]:
    """The whole GPUs (indexes) each daemon shares, by daemon name.

    A daemon's devices are UUIDs: one naming a GPU not in MIG mode counts; a MIG device's UUID
    (no GPU has it) or a GPU in MIG mode does not. A daemon with no devices sees every GPU of
    the node, so it shares every GPU not in MIG mode.
    """
    whole = {g.uuid: g.index for g in gpus if g.mig is None or not g.mig.current}
    out: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        found = whole.values() if not spec.devices else (whole.get(u) for u in spec.devices)
        out[spec.name] = tuple(sorted({i for i in found if i is not None}))
    return out


def to_exclusive(
    needed: Mapping[str, tuple[int, ...]], current: Mapping[int, backend.ComputeMode | None]
) -> tuple[ModeChange, ...]:
    """The GPUs to put in ``EXCLUSIVE_PROCESS`` before the daemons in ``needed`` may start.

    ``current`` is each GPU's mode, ``None`` where it could not be read (then it is set anyway:
    setting a mode twice is harmless). Each change names the daemons that wait for it.
    """
    waiting: dict[int, list[str]] = {}
    for name in sorted(needed):
        for gpu in needed[name]:
            waiting.setdefault(gpu, []).append(name)
    return tuple(
        ModeChange(gpu, EXCLUSIVE, tuple(names))
        for gpu, names in sorted(waiting.items())
        if current.get(gpu) is not EXCLUSIVE
    )


def to_default(
    *,
    kept: Mapping[str, tuple[int, ...]],
    owned: Set[int],
    current: Mapping[int, backend.ComputeMode | None],
) -> tuple[tuple[ModeChange, ...], frozenset[int]]:
    """What to give back once daemons stopped: the changes, and the GPUs no longer owned.

    ``owned`` are the GPUs set (or found) exclusive for a daemon; ``kept`` the GPUs of the
    daemons still kept. An owned GPU no kept daemon shares goes back to ``DEFAULT`` when it is
    in ``EXCLUSIVE_PROCESS``; one found in another mode (someone changed it) is no longer
    owned and keeps that mode; one whose mode could not be read stays owned for the next pass.
    """
    shared = {gpu for gpus in kept.values() for gpu in gpus}
    changes: list[ModeChange] = []
    done: set[int] = set()
    for gpu in sorted(owned - shared):
        mode = current.get(gpu)
        if mode is EXCLUSIVE:
            changes.append(ModeChange(gpu, DEFAULT))
        elif mode is not None:
            done.add(gpu)
    return tuple(changes), frozenset(done)


class ComputeModeKeeper:
    """Sets the compute modes around the MPS supervisor's pass (see the module docstring).

    Not thread-safe: the agent calls it under its pass lock.
    """

    def __init__(self, gpus: backend.GpuBackend) -> None:
        self._gpus = gpus
        self._owned: set[int] = set()
        """GPUs put (or found) in ``EXCLUSIVE_PROCESS`` for a daemon, not yet given back."""

    @property
    def owned(self) -> frozenset[int]:
        """The GPUs this keeper holds in ``EXCLUSIVE_PROCESS`` for MPS daemons."""
        return frozenset(self._owned)

    def prepare(self, specs: Sequence[mps.MpsDaemonSpec]) -> dict[str, str]:
        """Put the GPUs of the daemons in ``specs`` in ``EXCLUSIVE_PROCESS``; the daemons that
        must not start (a GPU of theirs could not be set), each with a one-line reason."""
        if not specs:
            return {}
        try:
            infos = self._gpus.gpus()
        except backend.BackendError as e:
            _log.warning("MPS daemons wait: cannot list the GPUs to set their compute mode: %s", e)
            return {s.name: f"cannot list the GPUs to set their compute mode: {e}" for s in specs}
        needed = daemon_gpus(specs, infos)
        gpus = {gpu for indexes in needed.values() for gpu in indexes}
        self._owned |= gpus
        blocked: dict[str, str] = {}
        for change in to_exclusive(needed, self._read(gpus)):
            try:
                self._gpus.set_compute_mode(change.gpu, change.mode)
            except backend.BackendError as e:
                reason = f"GPU {change.gpu}: cannot set compute mode {change.mode.value}: {e}"
                _log.warning("MPS daemons %s wait: %s", ", ".join(change.daemons), reason)
                for name in change.daemons:
                    blocked.setdefault(name, reason)
                continue
            _log.info(
                "GPU %d: compute mode %s (MPS daemons %s)",
                change.gpu,
                change.mode.value,
                ", ".join(change.daemons),
            )
        return blocked

    def release(self, kept: Sequence[mps.MpsDaemonSpec]) -> None:
        """Give back to ``DEFAULT`` the owned GPUs that no daemon in ``kept`` shares."""
        if not self._owned:
            return
        try:
            infos = self._gpus.gpus()
        except backend.BackendError as e:
            _log.warning("cannot list the GPUs to give their compute mode back: %s", e)
            return
        shares = daemon_gpus(kept, infos)
        known = {g.index for g in infos}
        self._owned &= known  # a GPU gone from the node has no mode to give back
        shared = {gpu for indexes in shares.values() for gpu in indexes}
        changes, done = to_default(
            kept=shares, owned=self._owned, current=self._read(self._owned - shared)
        )
        self._owned -= done
        for change in changes:
            try:
                self._gpus.set_compute_mode(change.gpu, change.mode)
            except backend.BackendError as e:
                _log.warning(
                    "GPU %d: cannot give compute mode %s back (retried next pass): %s",
                    change.gpu,
                    change.mode.value,
                    e,
                )
                continue
            self._owned.discard(change.gpu)
            _log.info("GPU %d: compute mode %s (no MPS daemon shares it)", change.gpu, DEFAULT)

    def _read(self, gpus: Iterable[int]) -> dict[int, backend.ComputeMode | None]:
        out: dict[int, backend.ComputeMode | None] = {}
        for gpu in sorted(gpus):
            try:
                out[gpu] = self._gpus.compute_mode(gpu)
            except backend.BackendError as e:
                _log.warning("GPU %d: cannot read its compute mode: %s", gpu, e)
                out[gpu] = None
        return out
