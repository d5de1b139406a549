"""The agent keeps as many instances as the pods bound to its node ask for (agent/holding.py),
before the kubelet says which ones they got, and the reconciler honours it."""

from __future__ import annotations

from typing import Any

from migpilot.agent import reconciling
from migpilot.agent.cluster import boundpods, holding
from migpilot.agent.rules import changes
from migpilot.gpu import emulated
from migpilot.kube import objects as kubeobjects
from migpilot.mig import catalog, layouts

H100 = catalog.resolve_gpu("h100-80gb")
NODE = "n0"


def _pod(name: str, resource: str, count: int = 1, node: str = NODE) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "resources": {"limits": {resource: str(count)}}}],
        },
        "status": {"phase": "Running"},
    }


def _gpus() -> emulated.EmulatedBackend:
    gpus = emulated.EmulatedBackend([H100], durable=False)
    for start in (0, 1, 2):
        gpus.create_instance(0, profile="1g.10gb", start=start)
    gpus.create_instance(0, profile="3g.40gb", start=4)
    return gpus


def test_bound_pods_keep_free_instances_beyond_those_known_in_use() -> None:
    gpus = _gpus()
    book = boundpods.PodBook()
    book.listed(
        [
            _pod("a", "nvidia.com/mig-1g.10gb", 2),
            _pod("b", "nvidia.com/mig-3g.40gb"),
            _pod("elsewhere", "nvidia.com/mig-1g.10gb", node="n1"),
        ]
    )
    small = sorted(
        (d for d in gpus.mig_devices(0) if d.profile == "1g.10gb"), key=lambda d: d.start
    )
    known = reconciling.InUseSet([small[2].uuid or ""])
    held = holding.BoundPodsHold(book, node=NODE, gpus=gpus, allocated=known).in_use()
    big = next(d for d in gpus.mig_devices(0) if d.profile == "3g.40gb")
    # Two 1g.10gb asked for, one known in use: one more kept (the lowest start); the 3g kept.
    assert held == {small[0].uuid, big.uuid}


def test_a_layout_that_drops_them_leaves_them_while_the_pods_are_bound() -> None:
    gpus = _gpus()
    book = boundpods.PodBook()
    book.listed([_pod("a", "nvidia.com/mig-1g.10gb", 2)])
    hold = holding.BoundPodsHold(book, node=NODE, gpus=gpus, allocated=reconciling.InUseSet())
    reconciler = reconciling.Reconciler(gpus, hold)
    # The desired layout keeps only the 3g.40gb: the two held 1g.10gb stay, the third goes.
    want = {
        0: changes.DesiredGpu(
            mig_enabled=True, layout=layouts.Layout.of([layouts.Instance(4, "3g.40gb")])
        )
    }
    reconciler.reconcile(want)
    left = sorted(f"{d.profile}@{d.start}" for d in gpus.mig_devices(0))
    assert left == ["1g.10gb@0", "1g.10gb@1", "3g.40gb@4"]
    # The pods go: the next pass removes them.
    book.changed(
        kubeobjects.WatchEvent(
            kubeobjects.EventType.DELETED, _pod("a", "nvidia.com/mig-1g.10gb", 2)
        )
    )
    reconciler.reconcile(want)
    assert sorted(f"{d.profile}@{d.start}" for d in gpus.mig_devices(0)) == ["3g.40gb@4"]
