"""The startup taint: a new node takes no pod until its agent has reported it.

Why it exists: a node autoscaler (Karpenter) brings a node up for pods migpilot could not place,
and the node's scheduling must wait for migpilot's agent. Until the agent has reported the
node's GPUs (the GpuLayout's status, so the controller can plan on them) and its device
resources are in the Node as the device plugin advertises them, what the Node shows is not
true: Karpenter's KWOK nodes even start with the instance type's MIG counts as allocatable,
for instances that do not exist. Karpenter puts a NodePool's ``startupTaints`` on each node it
registers and counts the node initialized only once they are gone; so the NodePool lists
:data:`TAINT_KEY` ``:NoSchedule`` (``docs/autoscaling.md``, "Node autoscaling") and the agent
removes it, and nothing else, from its own Node once both are done (:class:`StartupTaint`, a
pass listener). The admission policy that confines an agent to its own Node allows exactly this
change of its spec (``deploy/policies/agent-nodes.yaml``).

The Node comes from a watch the agent already runs (the single agent's Node watch, the fleet's
watch of its Nodes): :meth:`StartupTaint.node_seen`. The taint can arrive after the agent is
ready (Karpenter adds it when it registers the node, which may be after the agent's first
pass), so the removal is not a one-off: whenever the watch shows the taint on a ready node,
:meth:`StartupTaint.fingerprint` changes and the pass that follows removes it. A failed removal
is logged and retried at the next pass (:attr:`StartupTaint.settled` is ``False`` meanwhile).
On a node without the taint this costs nothing: no request is sent.

A shell module: the API through :class:`~kubeapi.NodeApi` only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from migpilot import errors, logs
from migpilot.agent.cluster import kubeapi
from migpilot.agent.deviceplugin import devices
from migpilot.agent.rules import changes
from migpilot.kube import errors as kube_errors
from migpilot.kube import requests
from migpilot.planning import quantities

_log = logging.getLogger(__name__)

TAINT_KEY = "migpilot.io/agent-not-ready"
"""The startup taint's key. A NodePool (or any node provisioner) puts
``migpilot.io/agent-not-ready:NoSchedule`` on a new GPU node; the node's agent removes it once
it has reported the node's GPUs and its resources are advertised."""
TAINT_EFFECT = "NoSchedule"
"""The startup taint's effect."""
TAINT = f"{TAINT_KEY}:{TAINT_EFFECT}"
"""The taint as ``kubectl taint`` and Karpenter's docs write it."""


def tainted(node: Mapping[str, Any] | None) -> bool:
    """Whether the Node (its JSON) has the startup taint (key and effect, any value)."""
    if node is None:
        return False
    taints = (node.get("spec") or {}).get("taints") or []
    return any(requests.same_taint(t, key=TAINT_KEY, effect=TAINT_EFFECT) for t in taints)


def shows(node: Mapping[str, Any] | None, counts: Mapping[str, int]) -> bool:
    """Whether the Node's ``status.allocatable`` has exactly ``counts`` of each resource named
    (a resource absent counts 0; an unreadable quantity matches nothing)."""
    if node is None:
        return False
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    for name, want in counts.items():
        try:
            have = quantities.amount(allocatable.get(name, 0), where=f"allocatable {name}")
        except errors.MigpilotError:  # the Node's value is someone else's: no match
            return False
        if have != want:
            return False
    return True


def _nothing_to_advertise() -> Mapping[str, int]:
    return {}


class StartupTaint:
    """Removes :data:`TAINT_KEY` from the agent's own Node once the agent is ready (see the
    module). ``reported`` says the GpuLayout's status and the GFD labels are written;
    ``advertised`` gives the resource counts the Node must show (``None``: not known yet, as
    before the device plugin registered or the stand-in kubelet first published). Both are
    set by :meth:`ready_when` once the agent's parts are wired; until then it is never ready.
    """

    def __init__(self, api: kubeapi.NodeApi, *, node: str) -> None:
        self._api = api
        self.node = node
        self._lock = threading.Lock()
        self._tainted = False
        self._allocatable: dict[str, Any] = {}
        self._reported: Callable[[], bool] = lambda: False
        self._advertised: Callable[[], Mapping[str, int] | None] = _nothing_to_advertise
        self._settled = True
        self._waiting_logged = False

    def ready_when(
        self,
        *,
        reported: Callable[[], bool],
        advertised: Callable[[], Mapping[str, int] | None] = _nothing_to_advertise,
    ) -> None:
        """What ready means on this node (see the class)."""
        self._reported, self._advertised = reported, advertised

    # -- the Node, from a watch ----------------------------------------------------------------
    def node_seen(self, doc: Mapping[str, Any] | None) -> None:
        """The Node as a watch saw it last (``None``: gone)."""
        allocatable = dict(((doc or {}).get("status") or {}).get("allocatable") or {})
        with self._lock:
            self._tainted = tainted(doc)
            self._allocatable = allocatable

    @property
    def pending(self) -> bool:
        """Whether the Node, as last seen, has the taint."""
        with self._lock:
            return self._tainted

    def ready(self) -> bool:
        """Whether the agent has reported the node and the Node shows what it advertises."""
        if not self._reported():
            return False
        want = self._advertised()
        if want is None:
            return False
        with self._lock:
            allocatable = dict(self._allocatable)
        return shows({"status": {"allocatable": allocatable}}, want)

    def fingerprint(self) -> Hashable:
        """Changes when the taint appears or goes, and when the Node starts or stops showing
        the advertised counts while it has the taint: a pass is then due, which removes it."""
        if not self.pending:
            return None
        want = self._advertised()
        with self._lock:
            allocatable = dict(self._allocatable)
        return (
            "tainted",
            want is not None and shows({"status": {"allocatable": allocatable}}, want),
        )

    @property
    def settled(self) -> bool:
        """Whether nothing is left to do that a failure left undone (a removal that failed is
        retried at the next pass)."""
        return self._settled

    # -- the pass listener ---------------------------------------------------------------------
    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """After a pass (the reporter and the stand-in told first): remove the taint if the
        Node has it and the agent is ready."""
        self.settle()

    def settle(self) -> None:
        """Remove the taint now if the Node has it and the agent is ready; a failure is
        logged, and :attr:`settled` stays ``False`` until a later try succeeds."""
        if not self.pending:
            self._settled = True
            return
        if not self.ready():
            if not self._waiting_logged:
                _log.info("Node %s: has the startup taint %s; removing it once the GPUs are "
                          "reported and the resources advertised", self.node, TAINT,
                          extra=logs.about(node=self.node))  # fmt: skip
                self._waiting_logged = True
            self._settled = True  # nothing failed: the next change of the inputs makes a pass
            return
        try:
            removed = self._api.remove_node_taint(self.node, key=TAINT_KEY, effect=TAINT_EFFECT)
        except kube_errors.KubeApiError as err:
            _log.error("Node %s: startup taint %s not removed, retrying at the next pass: %s",
                       self.node, TAINT, err, extra=logs.about(node=self.node))  # fmt: skip
            self._settled = False
            return
        self._settled = True
        with self._lock:
            self._tainted = False  # the watch will say so too
        if removed:
            _log.info("Node %s: GPUs reported and resources advertised: startup taint %s "
                      "removed", self.node, TAINT, extra=logs.about(node=self.node))  # fmt: skip
