"""A stand-in for the kubelet on nodes that have none (KWOK), for tests and demos only.

A real kubelet learns the device plugin's resources from ListAndWatch and copies their counts
into the Node's ``status.capacity`` and ``status.allocatable`` (``docs/agent.md``). On a KWOK
node nothing does, so with ``migpilot agent --kubelet simulated`` this listener does it after
every pass: each resource the device plugin would advertise under the strategy (``nvidia.com/
mig-<profile>`` under mixed), counted, with a resource whose last device disappeared kept at
``0`` as the kubelet keeps a registered resource. It is kept apart from the real path on
purpose: nothing else in the agent knows it exists.

Not yet: assigning instances to the pods bound to the node, as Allocate would.

A shell module: it writes through :class:`~kubeapi.NodeApi` and never imports a client.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from migpilot.agent import kubeapi, reconciling
from migpilot.agent.deviceplugin import advertising, devices

_log = logging.getLogger(__name__)


def resource_counts(view: devices.NodeDevices, strategy: devices.MigStrategy) -> dict[str, int]:
    """How many healthy devices of each resource the plugin would advertise (none under an
    invalid single-strategy node, as NVIDIA's plugin then advertises nothing)."""
    try:
        resources = advertising.resources_for(view, strategy)
    except advertising.InvalidMigConfigurationError:
        return {}
    return {r.name: sum(d.health is devices.Health.HEALTHY for d in r.devices) for r in resources}


class SimulatedKubelet:
    """Publishes the advertised resource counts into the Node's capacity and allocatable."""

    def __init__(self, api: kubeapi.NodeApi, *, node: str, strategy: devices.MigStrategy) -> None:
        self._api = api
        self._node = node
        self._strategy = strategy
        self._published: dict[str, str] | None = None

    def passed(
        self,
        *,
        state: Mapping[int, reconciling.GpuState],
        report: reconciling.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """Patch the Node when the counts changed; API failures are logged and retried."""
        counts = {k: str(v) for k, v in resource_counts(view, self._strategy).items()}
        before = self._published or {}
        patch = dict.fromkeys(before, "0") | counts
        if patch == self._published:
            return
        try:
            self._api.patch_node_resources(self._node, dict(patch))
        except kubeapi.KubeApiError as err:
            _log.error("Node %s: resources not published: %s", self._node, err)
            return
        self._published = patch
        _log.info("Node %s: published %s (simulated kubelet)", self._node,
                  ", ".join(f"{k}={v}" for k, v in sorted(patch.items())))  # fmt: skip
