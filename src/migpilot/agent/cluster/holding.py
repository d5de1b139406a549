"""Keep as many instances as the pods bound to this node ask for, even before the kubelet says
which ones they got.

Why it exists: a pod bound to the node is counted by the kubelet against the node's devices
before its containers start; until the kubelet calls Allocate (and lists the assignment in
PodResources) nobody can say which instance it will get. If the node's GpuLayout dropped an
instance in that window (a controller that disagrees, a stale spec), destroying it could leave
the kubelet one device short, and the pod would fail admission. So, whatever the desired layout
says, :class:`BoundPodsHold` counts as in use, for each MIG resource, enough free instances to
make up what the bound pods ask for beyond the instances already known to be in use (lowest GPU
and start first). The controller applies the same count when it plans; this is the agent's half
of "even if the two disagree". A unified pod (``nvidia.com/gpu`` with ``gpumem``,
``docs/unified.md``) counts the profiles of the instances reserved for it or handed to it (or,
with none known, its asks resolved on the node's GPU model), given by ``unified``
(:meth:`~unifying.UnifiedPool.profiles_for`); those instances are themselves kept by the
GpuLayout's protection and the Allocate ledger, so the count adds only what they do not cover.

A shell module: it reads the pods the agent's pod watch keeps (:class:`boundpods.PodBook`) and
the GPU backend; it imports no client and no gRPC.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from migpilot.agent import reconciling
from migpilot.agent.cluster import boundpods
from migpilot.gpu import backend
from migpilot.planning import snapshot


class BoundPodsHold:
    """An in-use source: the free instances the bound pods' counts keep (see the module)."""

    def __init__(
        self,
        pods: boundpods.PodBook,
        *,
        node: str,
        gpus: backend.GpuBackend,
        allocated: reconciling.InUse,
        unified: Callable[[boundpods.BoundPod], tuple[str, ...]] | None = None,
    ) -> None:
        self._pods = pods
        self._node = node
        self._gpus = gpus
        self._allocated = allocated
        self._unified = unified

    def in_use(self) -> frozenset[str]:
        """UUIDs of the free instances held for bound pods."""
        need: Counter[str] = Counter()
        for pod in self._pods.pods(self._node):
            for resource, count in pod.requests:
                need[resource] += count
            if self._unified is not None and pod.gpu is not None and pod.gpu.unified:
                for profile in self._unified(pod):
                    need[snapshot.resource_name(profile)] += 1
        if not need:
            return frozenset()
        held = self._allocated.in_use()
        devices: dict[str, list[backend.MigDevice]] = {}
        for info in self._gpus.gpus():
            if info.mig is None or not info.mig.current or info.model is None:
                continue
            for dev in self._gpus.mig_devices(info.index):
                if dev.uuid is not None:
                    devices.setdefault(snapshot.resource_name(dev.profile), []).append(dev)
        out: set[str] = set()
        for resource, count in need.items():
            devs = sorted(devices.get(resource, ()), key=lambda d: (d.gpu, d.start))
            missing = count - sum(d.uuid in held for d in devs)
            for dev in devs:
                if missing <= 0:
                    break
                if dev.uuid not in held and dev.uuid is not None:
                    out.add(dev.uuid)
                    missing -= 1
        return frozenset(out)
