"""The controller and the simulator run one loop (issue 22): the same event sequence driven
through both gives the same decisions.

One A100-80GB node; four pods arrive at once: ``a`` (1g.10gb) and ``b`` (3g.40gb) fit together,
``c`` (7g.80gb) needs the whole GPU, ``d`` (1g.6gb, an A30 profile) can never run there. ``a``
and ``b`` run for 10 s, then ``c`` gets the GPU. The simulator replays it on its virtual clock;
the controller is stepped on a fake clock against the in-memory API server, with a fake agent
(it reports every instance of the spec made) and a fake kube-scheduler (it binds every pod
let go to the node it is pinned to). Both call :func:`control.reconcile`; every decision is
recorded, and the plans (who is placed where, on which instances), the verdicts on the pods
left, and the pods let go must agree.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Callable
from typing import Any

import pytest

from migpilot.api import gpulayouts_wire
from migpilot.controller import kubeapi, observing, running
from migpilot.kube import objects as kubeobjects
from migpilot.planning import control
from migpilot.sim import clusters, policies, simulating, traces

CLUSTER = clusters.parse("a100-80gb:1x1")
NODE = CLUSTER.nodes[0]
PODS = {
    "a": ("1g.10gb", 10.0),
    "b": ("3g.40gb", 10.0),
    "c": ("7g.80gb", 100.0),
    "d": ("1g.6gb", 10.0),
}
WINDOW_S = 1.0


def _record(monkeypatch: pytest.MonkeyPatch) -> list[control.Decision]:
    """Every decision :func:`control.reconcile` makes from now on."""
    seen: list[control.Decision] = []
    real = control.reconcile

    def recording(*args: Any, **kw: Any) -> control.Decision:
        decision = real(*args, **kw)
        seen.append(decision)
        return decision

    monkeypatch.setattr(control, "reconcile", recording)
    return seen


def _summary(decisions: list[control.Decision]) -> dict[str, Any]:
    """What must agree: each plan's placements (pod -> profiles), in order; the verdicts on
    the pods each plan left; every pod let go; no expiry."""
    plans = [
        {p.pod: sorted(i.profile for i in p.instances) for p in d.plan.placements}
        for d in decisions
        if d.plan is not None
    ]
    judged = [
        sorted((j.pod, j.verdict.value, j.reason) for j in d.judged)
        for d in decisions
        if d.plan is not None
    ]
    pins = sorted(pod for d in decisions for pod, _ in d.pins)
    expired = [e.pod for d in decisions for e in d.expired]
    return {"plans": plans, "judged": judged, "pins": pins, "expired": expired}


def test_the_controller_and_the_simulator_decide_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    simulated = _record(monkeypatch)
    result = _simulate()
    assert result.pods_scheduled == 3 and result.pods_rejected == 1
    sim = _summary(simulated)
    controlled = _record(monkeypatch)
    asyncio.run(_control())
    ctl = _summary(controlled)
    assert ctl == sim
    # And what they agree on is the story above.
    assert sim["plans"] == [
        {"default/a": ["1g.10gb"], "default/b": ["3g.40gb"]},
        {"default/c": ["7g.80gb"]},
    ]
    assert [v for v in sim["judged"][0] if v[0] == "default/d"] == [
        (
            "default/d",
            "refuse",
            "can never run: no GPU in the cluster advertises nvidia.com/mig-1g.6gb (only "
            "a30-24gb offers it)",
        )
    ]
    assert [v[:2] for v in sim["judged"][0] if v[0] == "default/c"] == [("default/c", "wait")]
    assert sim["pins"] == ["default/a", "default/b", "default/c"]


def _simulate() -> simulating.Result:
    rows = [f"{name},0,{run:g},mig-{profile}=1" for name, (profile, run) in PODS.items()]
    trace = traces.parse(
        "name,arrival,duration,requests\n" + "\n".join(rows) + "\n",
        source="one-loop.csv",
        model=CLUSTER.reference_model,
    )
    settings = simulating.Settings(
        mode=simulating.Replay.FAITHFUL,
        paranoid=True,
        timing=simulating.Timing(batch_window_s=WINDOW_S),
    )
    return simulating.simulate(
        trace, cluster=CLUSTER, policy=policies.dynamic("migpilot", CLUSTER), settings=settings
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _node(instances: dict[str, int]) -> dict[str, Any]:
    alloc = NODE.allocatable
    return {
        "metadata": {
            "name": NODE.name,
            "uid": f"uid-{NODE.name}",
            "labels": {**NODE.labels, "nvidia.com/mig.capable": "true"},
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": {
                "cpu": f"{alloc.cpu_milli}m",
                "memory": str(alloc.memory_bytes),
                **{f"nvidia.com/mig-{p}": str(n) for p, n in instances.items()},
            },
        },
    }


def _pod(name: str, profile: str) -> dict[str, Any]:
    limits = {f"nvidia.com/mig-{profile}": "1"}
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": limits}}],
            "schedulingGates": [{"name": observing.GATE}],
        },
        "status": {"phase": "Pending"},
    }


async def _control() -> None:
    api = kubeapi.InMemoryApi()
    clock = _Clock()
    settings = running.Settings(identity="c1", batch_window_s=WINDOW_S)
    controller = running.Controller(api, settings=settings, clock=clock)
    controller.leading = True
    controller._lease_until = math.inf

    async def show(kind: kubeobjects.Kind, doc: dict[str, Any]) -> None:
        await api.put(kind, doc)
        controller._take(kind, api.objects[kind][kubeapi.InMemoryApi.key_of(doc)], deleted=False)
        controller._poke()  # as the watch does

    async def agent_and_scheduler() -> None:
        """The node's agent reports its spec made; kube-scheduler binds the pods let go."""
        for _ in range(3):
            layout = copy.deepcopy(api.objects[kubeobjects.Kind.LAYOUTS][NODE.name])
            spec = gpulayouts_wire.parse(layout).spec
            made: dict[str, int] = {}
            instances = []
            for g in spec.gpus:
                for i in g.instances:
                    made[i.profile] = made.get(i.profile, 0) + 1
                    instances.append(
                        {
                            "profile": i.profile,
                            "start": i.start,
                            "uuid": f"MIG-{i.profile}-{i.start}",
                            "state": "reserved" if i.reserved_for else "free",
                        }
                    )
            layout["status"] = {
                "observedGeneration": 1,
                "gpus": [
                    {
                        "index": 0,
                        "model": NODE.model.product_names[0],
                        "uuid": "GPU-0",
                        "instances": instances,
                    }
                ],
            }
            await show(kubeobjects.Kind.LAYOUTS, layout)
            await show(kubeobjects.Kind.NODES, _node(made))
            await controller.step()
            for doc in list(api.objects[kubeobjects.Kind.PODS].values()):
                if "schedulingGates" in doc["spec"] or doc["spec"].get("nodeName"):
                    continue
                bound = copy.deepcopy(doc)
                bound["spec"]["nodeName"] = NODE.name
                await show(kubeobjects.Kind.PODS, bound)
            await controller.step()

    async def at(t: float, before: Callable[[], Any] | None = None) -> None:
        clock.now = t
        if before is not None:
            await before()
        await controller.step()
        await agent_and_scheduler()

    await show(kubeobjects.Kind.NODES, _node({}))
    await controller.step()  # writes the node's empty GpuLayout
    await agent_and_scheduler()

    async def arrive() -> None:
        for name, (profile, _) in PODS.items():
            await show(kubeobjects.Kind.PODS, _pod(name, profile))

    await at(0.0, arrive)
    await at(WINDOW_S)  # the batch window is over: the first plan

    async def depart() -> None:
        for name in ("a", "b"):
            doc = copy.deepcopy(api.objects[kubeobjects.Kind.PODS][f"default/{name}"])
            doc["status"] = {"phase": "Succeeded"}
            await show(kubeobjects.Kind.PODS, doc)

    await at(WINDOW_S + 10.0, depart)
    await at(2 * WINDOW_S + 10.0)  # the second plan
    while not controller._notes.empty():
        controller._notes.get_nowait()
