"""Soak and chaos bench: the whole system under Poisson churn and faults at random times.

Run: ``.venv/bin/python bench/bench_soak.py [--minutes 30] [--seed 1] [--small]`` (after
``./scripts/test`` has set up ``.venv`` and built the control plane). Prints a summary and writes
``bench/results/soak.json`` (``--out`` to write elsewhere). ``docs/soak.md`` explains the
invariants and the bounds; ``tests/e2e/test_soak.py`` runs a 3-minute, smaller version in CI.

On the real control plane of ``tests/kube`` (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, KWOK): ``migpilot webhook``, two ``migpilot controller`` processes (leader
election), one ``migpilot agent`` process per KWOK node (emulated GPUs, the stand-in kubelet,
``--log-format json``). The cluster: H100 and A100-80GB nodes of two GPUs each in MIG mode,
one MPS node (two A100-80GB, MIG off, ``migpilot.io/mode=mps``) and one time-slicing node
serving HAMi-style pods on replicas (one H100, four replicas). The first H100 node's agent runs
the real kubelet path instead (``--kubelet DIR``): a fake kubelet serves it device-plugin
Registration and PodResources over gRPC, and the bench's device manager
(:mod:`soak_kubelet`) calls its Allocate for the pods bound there.

The load: Poisson arrivals of MIG pods (``nvidia.com/mig-<profile>``), HAMi-style pods
(``nvidia.com/gpu: 1`` with ``nvidia.com/gpumem``) and MPS pods (``nvidia.com/gpu-<N>gb``),
thinned so that what the live pods ask stays near 90 % of the cluster's GPU memory; each pod
runs for an exponentially distributed time, then is deleted. The faults, at seeded random
times: every 2-3 minutes SIGKILL a random agent or the leading controller (restarted 2 s later,
as a DaemonSet or Deployment would); once, kube-apiserver restarted; once, the webhook down for
60 s; once, the kubelet node's PodResources socket taken away for 60-120 s. Everything is
seeded (``--seed``): the same seed draws the same pods and fault times
(what the system does with them still depends on timing).

The invariants (:mod:`soak_checks`, pure, unit-tested) are checked over what was recorded: the
bench's own actions, its watches of pods and GpuLayouts, and the agents' JSON logs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx2  # noqa: E402
import lightkube  # noqa: E402
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements  # noqa: E402
from lightkube.models.meta_v1 import ObjectMeta  # noqa: E402
from lightkube.resources.admissionregistration_v1 import MutatingWebhookConfiguration  # noqa: E402
from lightkube.resources.coordination_v1 import Lease  # noqa: E402
from lightkube.resources.core_v1 import Namespace, Pod  # noqa: E402
from tests.kube import controlplane, crds, kwokstages, system, tools  # noqa: E402

import soak_checks as checks  # noqa: E402
import soak_kubelet  # noqa: E402
from migpilot import errors  # noqa: E402
from migpilot.api import gpulayouts as gl  # noqa: E402
from migpilot.api import gpulayouts_wire as wire  # noqa: E402
from migpilot.api import leases  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "soak.json"
NAMESPACE = "soak"
GPUS_PER_NODE = 2
TS_REPLICAS = 4
TS_CONFIG = (
    "version: v1\nflags: {migStrategy: none}\n"
    "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: "
    f"{TS_REPLICAS}}}]}}}}\n"
)
GPU_GB = 80
"""Every GPU here is an 80 GB one: the unit the load is measured in."""
MIG_PROFILES = {"1g.10gb": 3, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1}
"""The MIG profiles asked, with their weights (both 80 GB models have all of them)."""
PROFILE_GB = {
    "1g.10gb": 10,
    "1g.20gb": 20,
    "2g.20gb": 20,
    "3g.40gb": 40,
    "4g.40gb": 40,
    "7g.80gb": 80,
}
HAMI_MIB = {8000: 3, 16000: 2, 30000: 1}
MPS_GB = {10: 2, 20: 1}
KINDS = {"mig": 0.65, "hami": 0.25, "mps": 0.10}
RESTART_DELAY_S = 2.0
"""How long a killed process stays down before it is started again (a kubelet's restart)."""
SETTLE_S = {
    "kill-agent": 20.0,
    "kill-controller": 15.0 + 15.0,
    "restart-apiserver": 30.0,
    "webhook-down": 10.0,
    "podresources-down": 20.0,
}
"""How long after a faulted part is back its fault window lasts: an agent's first passes and
status; a controller: the Lease running out (15 s, the default duration) and a pass; the
apiserver: every watch listing again; the webhook: pods created while it was down;
PodResources: the agent's next passes and status, with the pods' devices known again."""
BOUND_S = 60.0
"""Every pod runs within this long after a node could serve it (outside fault windows)."""
RESERVATION_GRACE_S = 60.0
"""A reservation may outlive its pod by this long (outside fault windows)."""
FINAL_WAIT_S = 120.0
STARTUP_WAIT_S = 300.0
"""How long every agent has to write its node's first GpuLayout status (a busy machine)."""
STARTUP_TAIL_LINES = 12
"""Lines of each silent agent's log shown when that wait times out."""
ALLOCATION_GRACE_S = 300.0
"""The agent's hold on a device Allocate handed out that PodResources never listed
(``serving.PluginSettings.allocation_grace_s``)."""
UNLISTED_MARGIN_S = 10.0
"""Around a PodResources outage, how long a hand-out may go unlisted (two agent passes)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """One soak run."""

    minutes: float = 30.0
    seed: int = 1
    h100_nodes: int = 5
    a100_nodes: int = 5
    lifetime_s: float = 60.0
    """Mean running time of a pod (exponential)."""
    target: float = 0.9
    """The share of the cluster's GPU memory the live pods ask, kept by thinning arrivals."""
    kill_every_s: tuple[float, float] = (120.0, 180.0)
    webhook_down_s: float = 60.0
    podresources_down_s: tuple[float, float] = (60.0, 120.0)
    """How long the kubelet node's PodResources socket is away (drawn from the seed)."""

    @property
    def nodes(self) -> int:
        return self.h100_nodes + self.a100_nodes + 2


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    name: str
    backend: str
    mode: str
    gpus: int
    extra: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    kubelet: bool = False
    """Its agent runs the real kubelet path (``--kubelet DIR``), served by a
    :class:`soak_kubelet.DeviceManager`, instead of the stand-in."""


def _cluster(settings: Settings, root: Path) -> list[NodeSpec]:
    ts = root / "ts.yaml"
    ts.write_text(TS_CONFIG, encoding="utf-8")
    nodes = [
        NodeSpec(
            f"soak-h100-{i}",
            f"emulated:h100-80gb:x{GPUS_PER_NODE}",
            "mig",
            GPUS_PER_NODE,
            kubelet=i == 0,
        )
        for i in range(settings.h100_nodes)
    ]
    nodes += [
        NodeSpec(f"soak-a100-{i}", f"emulated:a100-80gb:x{GPUS_PER_NODE}", "mig", GPUS_PER_NODE)
        for i in range(settings.a100_nodes)
    ]
    nodes.append(
        NodeSpec(
            "soak-mps",
            "emulated:a100-80gb:x2:mig-off",
            "mps",
            2,
            ("--mps-root", str(root / "mps")),
            (("migpilot.io/mode", "mps"),),
        )
    )
    nodes.append(
        NodeSpec(
            "soak-ts",
            "emulated:h100-80gb:x1:mig-off",
            "time-slicing",
            1,
            ("--strategy", "none", "--device-plugin-config", str(ts)),
            (("migpilot.io/mode", "time-slicing"),),
        )
    )
    return nodes


# --- the load ----------------------------------------------------------------------------------


def _weighted(rng: random.Random, table: Mapping[Any, float]) -> Any:
    keys = list(table)
    return rng.choices(keys, weights=[table[k] for k in keys])[0]


def draw_ask(rng: random.Random) -> checks.Ask:
    """One pod's ask, drawn from the mix."""
    kind = _weighted(rng, KINDS)
    if kind == "mig":
        return checks.Ask("mig", profile=_weighted(rng, MIG_PROFILES))
    if kind == "hami":
        return checks.Ask("hami", gpumem_mib=_weighted(rng, HAMI_MIB))
    return checks.Ask("mps", gb=_weighted(rng, MPS_GB))


def ask_gb(ask: checks.Ask) -> float:
    """GPU memory an ask takes, in GB (a HAMi ask by the MIG instance serving it)."""
    if ask.kind == "mig":
        return PROFILE_GB[ask.profile or ""]
    if ask.kind == "mps":
        return float(ask.gb or 0)
    mib = ask.gpumem_mib or 0
    return float(next(gb for gb in (10, 20, 40, 80) if gb * 1000 >= mib))


def _pod(name: str, ask: checks.Ask) -> Pod:
    if ask.kind == "mig":
        limits = {f"nvidia.com/mig-{ask.profile}": "1"}
    elif ask.kind == "hami":
        limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(ask.gpumem_mib)}
    else:
        limits = {f"nvidia.com/gpu-{ask.gb}gb": "1"}
    return Pod(
        metadata=ObjectMeta(name=name, namespace=NAMESPACE),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ]
        ),
    )


class Recorder:
    """Everything the bench does and sees, time-stamped (wall clock, as the agents' logs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[checks.Event] = []
        self.faults: list[dict[str, Any]] = []
        self.created: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.deleted: dict[str, float] = {}
        self.asks: dict[str, checks.Ask] = {}
        self.errors: list[str] = []

    def add(self, event: checks.Event) -> None:
        with self.lock:
            self.events.append(event)


def _key(name: str) -> str:
    return f"{NAMESPACE}/{name}"


class Load:
    """Poisson arrivals, thinned to keep the asked memory near the target; exponential
    lifetimes once Running."""

    def __init__(
        self, client: lightkube.Client, rec: Recorder, settings: Settings, capacity_gb: float
    ) -> None:
        self.client, self.rec, self.settings = client, rec, settings
        self.rng = random.Random(settings.seed)
        self.capacity_gb = capacity_gb
        mean_gb = sum(
            KINDS[k] * g
            for k, g in (
                ("mig", _mean({PROFILE_GB[p]: w for p, w in MIG_PROFILES.items()})),
                (
                    "hami",
                    _mean(
                        {ask_gb(checks.Ask("hami", gpumem_mib=m)): w for m, w in HAMI_MIB.items()}
                    ),
                ),
                ("mps", _mean({float(g): w for g, w in MPS_GB.items()})),
            )
        )
        steady = settings.target * capacity_gb / mean_gb
        self.rate = 2.0 * steady / settings.lifetime_s
        """Arrivals per second before thinning: twice what the target needs."""
        self.live: dict[str, checks.Ask] = {}
        self.leaves: dict[str, float] = {}
        self._lifetimes: dict[str, float] = {}
        self.count = 0
        self.thinned = 0

    def asked_gb(self) -> float:
        with self.rec.lock:  # the progress thread reads it too
            asks = list(self.live.values())
        return sum(ask_gb(a) for a in asks)

    def run(self, until: float, stop: threading.Event) -> None:
        next_arrival = time.time() + self.rng.expovariate(self.rate)
        while not stop.is_set() and time.time() < until:
            now = time.time()
            if now >= next_arrival:
                next_arrival += self.rng.expovariate(self.rate)
                ask = draw_ask(self.rng)
                lifetime = self.rng.expovariate(1.0 / self.settings.lifetime_s)
                if self.asked_gb() + ask_gb(ask) <= self.settings.target * self.capacity_gb:
                    self._create(ask, lifetime)
                else:
                    self.thinned += 1
                continue
            with self.rec.lock:  # the watch thread adds to ``running`` meanwhile
                started = [n for n in self.rec.running if n in self.live]
            for name in started:
                if name not in self.leaves:
                    self.leaves[name] = self.rec.running[name] + self._lifetimes.pop(name)
            for name, t in sorted(self.leaves.items(), key=lambda kv: kv[1]):
                if t <= now and name in self.live:
                    self.delete(name)
            time.sleep(min(0.1, max(0.0, next_arrival - time.time())))

    def _create(self, ask: checks.Ask, lifetime: float) -> None:
        name = f"p{self.count:05d}"
        self.count += 1
        t = time.time()
        self.rec.created[name] = t
        self.rec.asks[name] = ask
        self.rec.add(checks.PodCreated(t, _key(name), ask))
        with self.rec.lock:
            self.live[name] = ask
        self._lifetimes[name] = lifetime
        _retrying(lambda: self.client.create(_pod(name, ask)), f"create {name}", self.rec)

    def delete(self, name: str) -> None:
        t = time.time()
        self.rec.deleted[name] = t
        self.rec.add(checks.PodDeleted(t, _key(name)))
        with self.rec.lock:
            self.live.pop(name, None)
        self.leaves.pop(name, None)
        _retrying(
            lambda: self.client.delete(Pod, name, namespace=NAMESPACE, grace_period=0),
            f"delete {name}",
            self.rec,
            missing_ok=True,
        )


def _mean(table: dict[float, float]) -> float:
    return sum(k * w for k, w in table.items()) / sum(table.values())


def _retrying(
    call: Callable[[], object], what: str, rec: Recorder, *, missing_ok: bool = False
) -> None:
    """Retry through an apiserver restart (up to 120 s); a 409/404 on a retry is fine."""
    deadline = time.monotonic() + 120.0
    tries = 0
    while True:
        tries += 1
        try:
            call()
            return
        except lightkube.ApiError as e:
            code = e.status.code
            if (code == 404 and missing_ok) or (code == 409 and tries > 1):
                return
            if code is not None and code < 500 and code != 429:
                rec.errors.append(f"{what}: {e}")
                return
        except Exception as e:  # connection refused while the apiserver restarts
            if time.monotonic() > deadline:
                rec.errors.append(f"{what}: {e}")
                return
        time.sleep(0.5)


# --- the watches ------------------------------------------------------------------------------


def _watch_forever(
    kubeconfig: Path,
    resource: Any,
    namespace: str | None,
    seen: Callable[[str, Any], None],
    stop: threading.Event,
) -> None:
    """List and watch ``resource`` until ``stop``, listing again after any failure (the
    apiserver's restart): every object listed is ``seen`` again."""
    while not stop.is_set():
        client = controlplane.client_for(kubeconfig)
        try:
            kwargs = {"namespace": namespace} if namespace else {}
            listed = client.list(resource, **kwargs)
            for obj in listed:
                seen("LISTED", obj)
            for kind, obj in client.watch(
                resource, resource_version=listed.resourceVersion, **kwargs
            ):
                if stop.is_set():
                    return
                seen(kind, obj)
        except Exception:  # the apiserver went away; list again
            time.sleep(0.5)
        finally:
            client.close()


def _pod_seen(rec: Recorder) -> Callable[[str, Any], None]:
    def seen(kind: str, pod: Pod) -> None:
        t = time.time()
        assert pod.metadata is not None
        name = pod.metadata.name or ""
        if kind == "DELETED" or name not in rec.created:
            return
        node = pod.spec.nodeName if pod.spec else None
        running = pod.status is not None and pod.status.phase == "Running"
        gated = bool(pod.spec and pod.spec.schedulingGates)
        with rec.lock:
            if node and name not in rec.bound:
                rec.bound[name] = t
            if running and name not in rec.running:
                rec.running[name] = t
            rec.events.append(checks.PodSeen(t, _key(name), node, running, gated))

    return seen


def node_view(node: str, mode: str, status: gl.LayoutStatus) -> checks.NodeView:
    """The checkers' view of one GpuLayout status."""
    return checks.NodeView(
        node,
        mode,
        tuple(
            checks.GpuView(
                index=g.index,
                model=g.model,
                uuid=g.uuid,
                mig=mode == "mig",
                instances=tuple(
                    checks.InstanceView(i.profile, i.start, i.uuid, i.state.value)
                    for i in g.instances
                ),
                slices=tuple(checks.SliceView(s.id, s.memory_gb, s.state.value) for s in g.mps),
                replicas=tuple(checks.SliceView(r.id, 0, r.state.value) for r in g.replicas),
            )
            for g in status.gpus
        ),
    )


def reserved_for(spec: gl.LayoutSpec) -> frozenset[str]:
    out: set[str] = set()
    for g in spec.gpus:
        out |= {i.reserved_for for i in g.instances if i.reserved_for}
        out |= {s.reserved_for for s in g.mps if s.reserved_for}
        out |= {r.reserved_for for r in g.replicas if r.reserved_for}
        if g.reserved_for:
            out.add(g.reserved_for)
    return frozenset(out)


def _layout_seen(rec: Recorder, modes: dict[str, str]) -> Callable[[str, Any], None]:
    def seen(kind: str, obj: Any) -> None:
        t = time.time()
        if kind == "DELETED":
            return
        try:
            layout = wire.parse(obj.to_dict())
        except Exception as e:  # recorded: a GpuLayout the bench cannot read
            rec.errors.append(f"GpuLayout unreadable: {e}")
            return
        node = layout.name
        if node not in modes:
            return
        view = node_view(node, modes[node], layout.status) if layout.status else None
        rec.add(checks.LayoutSeen(t, node, reserved_for(layout.spec), view))

    return seen


# --- the faults --------------------------------------------------------------------------------


def fault_plan(
    settings: Settings, agents: list[str], *, kubelet_node: str | None = None
) -> list[tuple[float, str, str]]:
    """(seconds from the start, fault, target), drawn from the seed: a kill every
    ``kill_every_s`` (a random agent, or the leader two times in five), one apiserver restart
    and one webhook outage, each at a random time in the middle of the run, and, with a
    ``kubelet_node``, its PodResources socket away once, early enough to be back before the
    end (drawn last, so the other faults' times are those of a run without it)."""
    rng = random.Random(settings.seed * 7919 + 1)
    duration = settings.minutes * 60.0
    plan: list[tuple[float, str, str]] = []
    t = rng.uniform(*settings.kill_every_s)
    while t < duration - 20.0:
        if rng.random() < 0.4:
            plan.append((t, "kill-controller", "leader"))
        else:
            plan.append((t, "kill-agent", rng.choice(agents)))
        t += rng.uniform(*settings.kill_every_s)
    plan.append((rng.uniform(0.2, 0.6) * duration, "restart-apiserver", "kube-apiserver"))
    plan.append((rng.uniform(0.3, 0.7) * duration, "webhook-down", "migpilot-webhook"))
    if kubelet_node is not None:
        plan.append((rng.uniform(0.15, 0.4) * duration, "podresources-down", kubelet_node))
    return sorted(plan)


class Faults:
    """Carries out the fault plan; records each fault's window."""

    def __init__(
        self,
        sys_: system.System,
        rec: Recorder,
        nodes: dict[str, NodeSpec],
        settings: Settings,
        kubelets: Mapping[str, soak_kubelet.DeviceManager] | None = None,
    ) -> None:
        self.sys, self.rec, self.nodes, self.settings = sys_, rec, nodes, settings
        self.kubelets = dict(kubelets or {})
        self.windows: list[checks.Fault] = []
        self.outages: list[checks.Outage] = []
        """The PodResources outages, from the socket's removal to its return."""
        self._rng = random.Random(settings.seed * 104729 + 3)
        self._restores: list[threading.Thread] = []
        self._controller_kills = 0
        """Controllers killed so far: how the next comes back (:meth:`_controller_back_as`)."""

    def run(
        self,
        plan: list[tuple[float, str, str]],
        start: float,
        *,
        stop: threading.Event,
        done: threading.Event,
        leave: threading.Event,
    ) -> None:
        """Inject the faults of ``plan``, set ``done``, and stay alive until ``leave``: the
        processes this thread restarts die with it (their parent-death signal follows the
        thread that started them, not the process)."""
        for at, what, target in plan:
            while not stop.is_set() and time.time() < start + at:
                time.sleep(0.1)
            if stop.is_set():
                break
            try:
                self._inject(what, target, start)
            except Exception as e:  # recorded; the run goes on
                self.rec.errors.append(f"fault {what} {target}: {e}")
        for thread in self._restores:  # every fault over before the run ends
            thread.join()
        done.set()
        leave.wait()

    def _record(self, t0: float, t1: float, what: str, target: str, start: float) -> None:
        settle = SETTLE_S[what]
        self.windows.append(checks.Fault(t0, t1 + settle, f"{what} {target}"))
        self.rec.faults.append(
            {
                "fault": what,
                "target": target,
                "at_s": round(t0 - start, 1),
                "restored_after_s": round(t1 - t0, 1),
                "window_s": round(t1 + settle - t0, 1),
            }
        )
        print(f"[{t0 - start:7.1f} s] {what} {target} (back after {t1 - t0:.1f} s)", flush=True)

    def _inject(self, what: str, target: str, start: float) -> None:
        t0 = time.time()
        if what == "podresources-down":
            # Not waited for here: the other faults go on meanwhile (a minute or two).
            down_s = self._rng.uniform(*self.settings.podresources_down_s)
            self.kubelets[target].take_pod_resources_away()
            print(f"[{t0 - start:7.1f} s] {what} {target} for {down_s:.0f} s", flush=True)
            thread = threading.Thread(
                target=self._restore, args=(target, t0, t0 + down_s, start), daemon=True
            )
            thread.start()
            self._restores.append(thread)
            return
        if what == "kill-agent":
            agent = self.sys.agents[target]
            agent.signal(signal.SIGKILL)
            agent.process.wait()
            time.sleep(RESTART_DELAY_S)
            spec = self.nodes[target]
            self.sys.start_agent(
                target,
                spec.backend,
                *_agent_flags(spec),
                kubelet=_kubelet_flag(spec, self.kubelets),
            )
        elif what == "kill-controller":
            leader = self._leader()
            killed = leader if leader in self.sys.controllers else min(self.sys.controllers)
            component = self.sys.controllers.pop(killed)
            component.signal(signal.SIGKILL)
            component.process.wait()
            time.sleep(RESTART_DELAY_S)
            again = self._controller_back_as(killed)
            self.sys.start_controller(again, *CONTROLLER_FLAGS, verbose=False)
            target = killed if again == killed else f"{killed}, back as {again}"
        elif what == "restart-apiserver":
            self.sys.plane.restart_apiserver(down_s=3.0)
        elif what == "webhook-down":
            self.sys.stop_webhook()
            time.sleep(self.settings.webhook_down_s)
            _start_webhook_again(self.sys)
        self._record(t0, time.time(), what, target, start)

    def _restore(self, target: str, t0: float, back_at: float, start: float) -> None:
        time.sleep(max(0.0, back_at - time.time()))
        try:
            self.kubelets[target].give_pod_resources_back()
        except Exception as e:  # recorded; the run goes on
            self.rec.errors.append(f"fault podresources-down {target}: restore: {e}")
        t1 = time.time()
        self.outages.append(checks.Outage(t0, t1, target))
        self._record(t0, t1, "podresources-down", target, start)

    def _controller_back_as(self, killed: str) -> str:
        """The identity a killed controller comes back under. The two ways alternate, a
        replaced pod first: a Deployment's new pod has a new name, so a new identity, and the
        standby (or the new pod) takes the Lease over once it runs out (a failover); a
        container restarted in its pod keeps the pod's name, so its identity, and takes its own
        Lease back at once. With the same identity every time, the leader never changed hands
        in a whole run."""
        self._controller_kills += 1
        if self._controller_kills % 2 == 0:
            return killed
        base = killed.split("-r", maxsplit=1)[0]
        return f"{base}-r{self._controller_kills}"

    def _leader(self) -> str | None:
        try:
            lease = self.sys.client.get(Lease, leases.NAME, namespace=self.sys.lease_ns)
        except Exception:  # no Lease yet
            return None
        return lease.spec.holderIdentity if lease.spec else None


def _start_webhook_again(sys_: system.System) -> None:
    """The webhook back on a new port: its old registration is replaced by the new one."""
    old = sys_.webhook_config
    if old is not None:
        with contextlib.suppress(lightkube.ApiError):
            sys_.client.delete(MutatingWebhookConfiguration, old)
    sys_.start_webhook()


CONTROLLER_FLAGS: tuple[str, ...] = ()


def _agent_flags(spec: NodeSpec) -> tuple[str, ...]:
    return (*spec.extra, "--log-format", "json")


def _kubelet_flag(spec: NodeSpec, kubelets: Mapping[str, soak_kubelet.DeviceManager]) -> str:
    """The node's ``--kubelet``: its fake kubelet's folder, or ``simulated``."""
    return str(kubelets[spec.name].dir) if spec.kubelet else "simulated"


# --- the run -----------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 2)


def _latencies(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50_s": _percentile(values, 0.5),
        "p99_s": _percentile(values, 0.99),
        "max_s": round(max(values), 2) if values else None,
    }


def _emulated(path: Path) -> dict[int, frozenset[tuple[str, int, str]]]:
    """The emulated GPUs' instances (profile, start, UUID) per GPU index, from the state file."""
    state = json.loads(path.read_text())
    return {
        int(g["index"]): frozenset(
            (str(i["profile"]), int(i["start"]), str(i["uuid"] or "")) for i in g["instances"]
        )
        if g.get("mig_current")
        else frozenset()
        for g in state["gpus"]
    }


def _say(text: str) -> None:
    print(text, flush=True)


def run(settings: Settings, *, log: Callable[[str], None] = _say) -> dict[str, Any]:
    """One soak run: the cluster up, load and faults for ``settings.minutes``, the checks."""
    root = Path(tempfile.mkdtemp(prefix="mpsoak-"))
    nodes = {n.name: n for n in _cluster(settings, root)}
    found = tools.locate()
    held = sorted(n.name for n in nodes.values() if n.kubelet)
    if held:  # their pods stay Pending until their DeviceManager has allocated and started them
        stages = kwokstages.kwok_stages(found.kwok_stages, nodes=held, folder=root / "stages")
        found = dataclasses.replace(found, kwok_stages=stages)
    plane = controlplane.ControlPlane.start(found=found)
    sys_ = system.System(plane, root)
    client = plane.client
    rec = Recorder()
    stop = threading.Event()
    faults_done, faults_leave = threading.Event(), threading.Event()
    modes = {n.name: n.mode for n in nodes.values()}
    threads: list[threading.Thread] = []
    kubelets = {
        n.name: soak_kubelet.DeviceManager(
            root / f"kubelet-{n.name}",
            node=n.name,
            namespace=NAMESPACE,
            kubeconfig=plane.kubeconfig,
            record=rec.add,
        )
        for n in nodes.values()
        if n.kubelet
    }
    try:
        sys_.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE)))
        sys_.start_webhook()
        for manager in kubelets.values():
            manager.start()
        for spec in nodes.values():
            sys_.add_node(
                spec.name,
                spec.backend,
                *_agent_flags(spec),
                labels=dict(spec.labels),
                kubelet=_kubelet_flag(spec, kubelets),
            )
        for identity in ("c1", "c2"):
            sys_.start_controller(identity, *CONTROLLER_FLAGS, verbose=False)
        _await_first_statuses(client, sys_, timeout=STARTUP_WAIT_S)
        log(f"cluster up: {len(nodes)} nodes, control plane in {plane.started_in_s:.1f} s")
        for resource, ns, seen in (
            (Pod, NAMESPACE, _pod_seen(rec)),
            (crds.GpuLayout, None, _layout_seen(rec, modes)),
        ):
            thread = threading.Thread(
                target=_watch_forever,
                args=(plane.kubeconfig, resource, ns, seen, stop),
                daemon=True,
            )
            thread.start()
            threads.append(thread)
        capacity_gb = float(sum(n.gpus for n in nodes.values()) * GPU_GB)
        load = Load(client, rec, settings, capacity_gb)
        faults = Faults(sys_, rec, nodes, settings, kubelets)
        plan = fault_plan(settings, sorted(nodes), kubelet_node=next(iter(sorted(kubelets)), None))
        start = time.time()
        until = start + settings.minutes * 60.0
        fault_thread = threading.Thread(
            target=faults.run,
            args=(plan, start),
            kwargs={"stop": stop, "done": faults_done, "leave": faults_leave},
            daemon=True,
        )
        fault_thread.start()
        progress = threading.Thread(
            target=_progress, args=(rec, load, start, until, stop, log), daemon=True
        )
        progress.start()
        load.run(until, stop)
        faults_done.wait()
        end_load = time.time()
        # The end: every pod still there is deleted, and the system settles before the final
        # comparison (statuses caught up with the GPUs and the pods).
        for name in sorted(load.live):
            load.delete(name)

        def excused() -> dict[str, frozenset[str]]:
            with rec.lock:
                seen = list(rec.events)
            return checks.unlisted_holds(
                seen,
                faults.outages,
                grace_s=ALLOCATION_GRACE_S,
                margin_s=UNLISTED_MARGIN_S,
                end=time.time(),
            )

        # GpuLayouts the bench could not read, by node and reason: a violation each, not a crash.
        unreadable: dict[tuple[str, str], checks.Violation] = {}
        _settle(sys_, client, nodes, log, excused, unreadable=unreadable)
        end = time.time()
        time.sleep(2.0)
        stop.set()
        with rec.lock:
            events = list(rec.events)
        refused: list[checks.Violation] = []
        for path in sorted(root.glob("agent-*.log")):
            lines = path.read_text(errors="replace").splitlines()
            refused += checks.refused_specs(lines)
            for line in lines:
                if (event := checks.agent_event(line)) is not None:
                    events.append(event)
        statuses = _final_statuses(client, modes, unreadable)
        actual = {n: _emulated(root / f"{n}.json") for n in nodes}
        held = checks.held_at_end(events, end=end)
        unlisted = checks.unlisted_holds(
            events,
            faults.outages,
            grace_s=ALLOCATION_GRACE_S,
            margin_s=UNLISTED_MARGIN_S,
            end=end,
        )
        windows = faults.windows
        violations = [
            *checks.used_destroyed(events),
            *checks.double_held(events),
            *checks.slow_pods(events, windows, bound_s=BOUND_S, end=end_load),
            *checks.gated_while_servable(events, windows, bound_s=BOUND_S, end=end_load),
            *checks.stale_reservations(events, windows, grace_s=RESERVATION_GRACE_S),
            *checks.final_mismatch(statuses, actual, held, t=end, excused=unlisted),
            *checks.destroyed_without_podresources(events, faults.outages),
            *refused,
            *unreadable.values(),
        ]
        if not violations:
            shutil.rmtree(root, ignore_errors=True)
        else:
            log(f"violations: the logs are kept in {root}")
        return _summary(
            settings,
            rec=rec,
            load=load,
            events=events,
            windows=windows,
            violations=violations,
            start=start,
            end_load=end_load,
            nodes=nodes,
            kubelets=kubelets,
            outages=faults.outages,
            unlisted=unlisted,
        )
    finally:
        stop.set()
        for manager in kubelets.values():
            manager.stop()
        with contextlib.suppress(Exception):
            sys_.stop()
        plane.stop()
        faults_leave.set()


def _unreported(client: lightkube.Client, nodes: list[str]) -> list[str]:
    """The nodes whose GpuLayout has no status yet (its agent has not reported)."""
    missing = []
    for n in nodes:
        try:
            doc = client.get(crds.GpuLayout, n).to_dict()
        except lightkube.ApiError:
            missing.append(n)
            continue
        if not doc.get("status"):
            missing.append(n)
    return missing


def _await_first_statuses(
    client: lightkube.Client, sys_: system.System, *, timeout: float, poll_s: float = 0.5
) -> None:
    """Until every agent has written its node's GpuLayout status. An agent or controller that
    exits fails the wait at once, with its log's tail; the timeout names the agents that have
    not reported, each with its log's tail (a silent agent is found by name, not by a count)."""
    agents, controllers = dict(sys_.agents), dict(sys_.controllers)
    deadline = time.monotonic() + timeout
    missing, last_error = sorted(agents), ""
    while True:
        for component in (*agents.values(), *controllers.values()):
            component.check_running()
        try:
            missing = _unreported(client, sorted(agents))
        except (OSError, httpx2.HTTPError, http.client.HTTPException) as e:  # asked again
            last_error = f" (last error: {e})"
        if not missing:
            return
        if time.monotonic() > deadline:
            tails = "".join(
                f"\n--- last lines of {agents[n].name} ({agents[n].log}):\n"
                f"{agents[n].tail(STARTUP_TAIL_LINES)}"
                for n in missing
            )
            raise controlplane.ControlPlaneError(
                f"timed out after {timeout:.0f} s waiting for the first status of "
                f"{len(missing)} of {len(agents)} agents: {', '.join(missing)}{last_error}{tails}"
            )
        time.sleep(poll_s)


def _read_layout(
    client: lightkube.Client, node: str, unreadable: dict[tuple[str, str], checks.Violation]
) -> gl.GpuLayout | None:
    """``node``'s GpuLayout, or ``None`` when it cannot be read (a spec over its GPU, say):
    recorded in ``unreadable`` as a violation, once per node and reason."""
    try:
        return wire.parse(client.get(crds.GpuLayout, node).to_dict())
    except errors.MigpilotError as err:
        unreadable.setdefault(
            (node, str(err)),
            checks.Violation(
                "spec-not-appliable",
                time.time(),
                f"GpuLayout {node}: the bench cannot read it (nor can the agent): {err}",
            ),
        )
        return None


def _settled(
    client: lightkube.Client,
    nodes: dict[str, NodeSpec],
    excused: Mapping[str, frozenset[str]],
    unreadable: dict[tuple[str, str], checks.Violation],
) -> bool:
    """No pod left, and every GpuLayout's status Ready for its spec's generation, holding
    nothing used or reserved (but the ``excused`` instances, :func:`checks.unlisted_holds`).
    A GpuLayout that cannot be read is not settled (and recorded in ``unreadable``)."""
    if list(client.list(Pod, namespace=NAMESPACE)):
        return False
    for n in nodes:
        layout = _read_layout(client, n, unreadable)
        if layout is None:
            return False
        status = layout.status
        if status is None:
            return False
        ready = [c for c in status.conditions if c.type == gl.READY]
        if not ready or ready[0].status is not gl.ConditionStatus.TRUE:
            return False
        states: set[gl.InstanceState] = set()
        for g in status.gpus:
            states |= {i.state for i in g.instances if i.uuid not in excused.get(n, ())}
            states |= {s.state for s in g.mps}
            states |= {r.state for r in g.replicas}
        if states & {gl.InstanceState.USED, gl.InstanceState.RESERVED}:
            return False
    return True


def _settle(
    sys_: system.System,
    client: lightkube.Client,
    nodes: dict[str, NodeSpec],
    log: Callable[[str], None],
    excused: Callable[[], Mapping[str, frozenset[str]]],
    *,
    unreadable: dict[tuple[str, str], checks.Violation],
) -> None:
    try:
        controlplane.wait_for(
            lambda: _settled(client, nodes, excused(), unreadable),
            what="the system to settle",
            timeout=FINAL_WAIT_S,
        )
    except controlplane.ControlPlaneError as e:
        log(f"not settled after {FINAL_WAIT_S:.0f} s: {str(e)[:200]}")


def _final_statuses(
    client: lightkube.Client,
    modes: dict[str, str],
    unreadable: dict[tuple[str, str], checks.Violation],
) -> dict[str, checks.NodeView]:
    out = {}
    for node, mode in modes.items():
        layout = _read_layout(client, node, unreadable)
        if layout is not None and layout.status is not None:
            out[node] = node_view(node, mode, layout.status)
    return out


def _progress(  # noqa: PLR0917 - a thread's target
    rec: Recorder,
    load: Load,
    start: float,
    until: float,
    stop: threading.Event,
    log: Callable[[str], None],
) -> None:
    while not stop.wait(30.0) and time.time() < until:
        with rec.lock:
            running = sum(1 for n in load.live if n in rec.running)
            live = len(load.live)
        log(
            f"[{time.time() - start:7.1f} s] created {load.count}, live {live} "
            f"(running {running}), asked {load.asked_gb() / load.capacity_gb:.0%} of GPU memory"
        )


def _summary(
    settings: Settings,
    *,
    rec: Recorder,
    load: Load,
    events: list[checks.Event],
    windows: list[checks.Fault],
    violations: list[checks.Violation],
    start: float,
    end_load: float,
    nodes: dict[str, NodeSpec],
    kubelets: Mapping[str, soak_kubelet.DeviceManager],
    outages: list[checks.Outage],
    unlisted: Mapping[str, frozenset[str]],
) -> dict[str, Any]:
    bind = [rec.bound[n] - rec.created[n] for n in rec.bound if n in rec.created]
    quiet = [
        rec.bound[n] - rec.created[n]
        for n in rec.bound
        if not any(w.start <= rec.created[n] <= w.end for w in windows)
    ]
    completed = [n for n in rec.deleted if n in rec.running and rec.deleted[n] <= end_load]
    by_kind: dict[str, int] = {}
    for n in completed:
        by_kind[rec.asks[n].kind] = by_kind.get(rec.asks[n].kind, 0) + 1
    return {
        "settings": {
            **dataclasses.asdict(settings),
            "nodes": [
                {
                    "name": n.name,
                    "backend": n.backend,
                    "mode": n.mode,
                    "kubelet": "fake kubelet (--kubelet DIR)" if n.kubelet else "simulated",
                }
                for n in nodes.values()
            ],
            "bound_s": BOUND_S,
            "reservation_grace_s": RESERVATION_GRACE_S,
            "settle_s": SETTLE_S,
            "arrival_rate_per_s": round(load.rate, 3),
        },
        "lifecycles": {
            "created": load.count,
            "completed": len(completed),
            "completed_by_kind": by_kind,
            "never_running": sum(1 for n in rec.created if n not in rec.running),
            "arrivals_thinned": load.thinned,
        },
        "faults": rec.faults,
        "kubelet_nodes": {
            name: {
                "pods_allocated": sum(
                    1 for e in events if isinstance(e, checks.Assigned) and e.node == name
                ),
                "allocated_during_podresources_outage": sum(
                    1
                    for e in events
                    if isinstance(e, checks.Assigned)
                    and e.node == name
                    and any(o.node == name and o.start <= e.t <= o.end for o in outages)
                ),
                "destroyed_during_podresources_outage": sum(
                    1
                    for e in events
                    if isinstance(e, checks.Destroyed)
                    and e.node == name
                    and any(o.node == name and o.start <= e.t <= o.end for o in outages)
                ),
                "allocate_failures": manager.allocate_failures,
                "unlisted_at_end": sorted(unlisted.get(name, ())),
                "errors": manager.errors[:20],
            }
            for name, manager in kubelets.items()
        },
        "bind_latency": _latencies(bind),
        "bind_latency_outside_faults": _latencies(quiet),
        "events_checked": {
            kind: sum(1 for e in events if type(e).__name__ == kind)
            for kind in sorted({type(e).__name__ for e in events})
        },
        "violations": [dataclasses.asdict(v) | {"t": round(v.t - start, 1)} for v in violations],
        "violation_count": len(violations),
        "bench_errors": rec.errors[:50],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--small",
        action="store_true",
        help="two H100 and two A100 nodes (with the MPS and time-slicing nodes: 6), a kill "
        "every 50-70 s: the CI version",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    settings = small(args.minutes, args.seed) if args.small else Settings(args.minutes, args.seed)
    started = time.time()
    result = run(settings)
    flags = f" --minutes {args.minutes:g} --seed {args.seed}" + (" --small" if args.small else "")
    doc = {
        "command": f"python bench/bench_soak.py{flags}",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "wall_s": round(time.time() - started, 1),
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("lifecycles", "bind_latency", "violation_count")}))
    for v in result["violations"][:20]:
        print(f"VIOLATION {v['invariant']} at {v['t']} s: {v['detail']}")
    print(f"wrote {shlex.quote(str(args.out))}")
    return 0 if result["violation_count"] == 0 else 1


def small(minutes: float, seed: int) -> Settings:
    """The CI version: 6 nodes, shorter lifetimes, a kill every 50-70 s."""
    return Settings(
        minutes=minutes,
        seed=seed,
        h100_nodes=2,
        a100_nodes=2,
        lifetime_s=40.0,
        kill_every_s=(50.0, 70.0),
        webhook_down_s=30.0,
        podresources_down_s=(60.0, 80.0),
    )


if __name__ == "__main__":
    raise SystemExit(main())
