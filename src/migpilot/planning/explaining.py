"""Why a pod stays pending: one reason per pod, and with ``--explain`` one per node.

Every planner calls :func:`explain` for the pods it leaves out, so reasons read the same whatever
planner ran. The reason is judged against the plan's final state: the instances in use, the
instances the plan gives to other pods, and the CPU and memory those pods take. Per node the
reason is the first check that fails, in the order kube-scheduler would meet them: node
admission (cordon, selector, affinity, taints), the node's sharing mode (label
``migpilot.io/mode``: ``node n3 is in mode mig; nvidia.com/gpu-10gb needs mps``), GPU models that
offer the profiles, CPU and memory, then room: MIG room, or on nodes in mode mps the GB of MPS
slices (free slices count as room, slices in use never do), on nodes in mode time-slicing the
replicas. The pod's summary is the most hopeful of its nodes' reasons.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping

from migpilot import errors
from migpilot.mig import catalog, layouts, profiles
from migpilot.planning import constraints, modes, plans, snapshot, unified
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps


class Why(enum.IntEnum):
    """Per-node outcome, most hopeful last (the summary takes the maximum)."""

    NOT_ADMITTED = 0
    WRONG_MODE = 1
    NOT_OFFERED = 2
    NO_CPU_MEMORY = 3
    IN_USE = 4
    TAKEN = 5
    ROOM_LEFT = 6


def _describe(need: Iterable[str]) -> str:
    counts = Counter(need)
    return " + ".join(f"{n} x {p}" if n > 1 else p for p, n in sorted(counts.items()))


def _fits(
    gpus: list[tuple[snapshot.Gpu, frozenset[layouts.Instance]]], need: tuple[str, ...]
) -> bool:
    """Do ``need`` instances fit on these GPUs beside the given occupied instances?

    One GPU at a time first; then spread over the node's GPUs, largest instance first, each on
    the first GPU with room (enough for the explanation, which only needs a yes or no).
    """
    for gpu, occupied in gpus:
        try:
            layouts.place(gpu.model, need, fixed=occupied)
            return True
        except errors.LayoutError:
            continue
    state = [set(o) for _, o in gpus]
    for name in sorted(need, key=lambda n: -_slots(gpus, n)):
        for k, (gpu, _) in enumerate(gpus):
            try:
                lay = layouts.place(gpu.model, [name], fixed=state[k])
            except errors.LayoutError:
                continue
            state[k] = set(lay.instances)
            break
        else:
            return False
    return True


def _slots(gpus: list[tuple[snapshot.Gpu, frozenset[layouts.Instance]]], name: str) -> int:
    for gpu, _ in gpus:
        for p in gpu.model.profiles:
            if p.name == name:
                return p.memory_slots
    return 0


_ShapeKey = tuple[int, snapshot.Demand]
"""(a node's GPU state, a pod's request): what explanations are cached by."""


_Early = tuple[list[tuple[Why, str] | None], bool, list[int], list[tuple[int, str, Why, str]]]
"""What :meth:`Explainer._early_all` works out per pod signature and request: the verdicts
before CPU and memory (:meth:`Explainer._early`; a wrong mode's text without the node), per
class of alike nodes (the flag: true) or per node; the positions of the nodes where CPU, memory
and room decide; and per earlier verdict, the first node that has it, named."""


class Explainer:
    """Explains pending pods against one plan's final state (built once per plan).

    Thousands of pending pods on thousands of nodes: a node's verdict up to CPU and memory
    (admission, mode, GPUs that serve the request) is worked out once per pod signature and
    request and class of alike nodes; CPU and memory per pod, only on the nodes that serve its
    request; room once per node (or GPU state) and request. Without per-node reasons the summary
    reads the first node of each earlier verdict and the nodes that serve the request.
    """

    def __init__(self, snap: snapshot.Snapshot, placements: Iterable[plans.Placement]) -> None:
        self.snap = snap
        pods = {p.key: p for p in snap.pods}
        self.used: dict[tuple[str, int], frozenset[layouts.Instance]] = {}
        assigned: dict[tuple[str, int], set[layouts.Instance]] = {}
        self.cpu: Counter[str] = Counter()
        self.mem: Counter[str] = Counter()
        # Per GPU of a node in mode mps or time-slicing: GB and clients (or replicas) the plan
        # gives to its pods.
        self.shared_gb: Counter[tuple[str, int]] = Counter()
        self.shared_n: Counter[tuple[str, int]] = Counter()
        for pl in placements:
            pod = pods.get(pl.pod)
            if pod is not None:
                self.cpu[pl.node] += pod.cpu_milli
                self.mem[pl.node] += pod.memory_bytes
            for sh in pl.shares:
                self.shared_gb[(pl.node, sh.gpu)] += sh.memory_gb
                self.shared_n[(pl.node, sh.gpu)] += 1
            for i in pl.instances:
                assigned.setdefault((pl.node, i.gpu), set()).add(
                    layouts.Instance(i.start, i.profile)
                )
        self.occupied: dict[tuple[str, int], frozenset[layouts.Instance]] = {}
        self._models: dict[str, list[tuple[profiles.GpuModel, list[snapshot.Gpu]]]] = {}
        self._admission = constraints.Admission(snap.nodes)
        # Nodes with the same GPUs in the same state give the same GPU verdict for a request: a
        # large cluster has far fewer GPU states than nodes.
        shapes: dict[tuple[object, ...], int] = {}
        self._shape: list[int] = []
        for node in snap.nodes:
            groups: dict[str, tuple[profiles.GpuModel, list[snapshot.Gpu]]] = {}
            for gpu in node.gpus:
                groups.setdefault(gpu.model.id, (gpu.model, []))[1].append(gpu)
            self._models[node.name] = list(groups.values())
            shape = []
            for gpu in node.gpus:
                key = (node.name, gpu.index)
                used = frozenset(i.instance for i in gpu.instances if i.used)
                self.used[key] = used
                self.occupied[key] = occupied = used | frozenset(assigned.get(key, ()))
                # The index too: a dynamic node's MIG view may skip a whole GPU (1 of 0, 1, 2),
                # and nodes sharing a shape share the GPUs a verdict names.
                shape.append((gpu.index, gpu.model.id, used, occupied))
            self._shape.append(shapes.setdefault(tuple(shape), len(shapes)))
        # What decides a node's verdict before CPU and memory: its admission class, its mode
        # and its GPUs (their models; on MIG nodes their state too).
        self._early_class = [
            (
                self._admission.class_of(position),
                node.mode,
                self._shape[position]
                if node.mode is modes.Mode.MIG
                else tuple(g.model.id for g in node.gpus),
            )
            for position, node in enumerate(snap.nodes)
        ]
        self._gpu_models = {
            node.name: (
                tuple(g.model for g in node.gpus),
                tuple(g.model.id for g in node.gpus),
            )
            for node in snap.nodes
        }
        ids: dict[tuple[object, ...], int] = {}
        self._class_id = [ids.setdefault(c, len(ids)) for c in self._early_class]
        self._class_positions: list[list[int]] = [[] for _ in ids]
        for position, k in enumerate(self._class_id):
            self._class_positions[k].append(position)
        # Per GPU of a node in mode mps: GB and clients of its taken slices.
        self.taken: dict[tuple[str, int], tuple[int, int]] = {
            (node.name, g.index): (
                sum(s.memory_gb for s in g.mps if s.taken),
                sum(1 for s in g.mps if s.taken),
            )
            for node in snap.nodes
            if node.mode is modes.Mode.MPS
            for g in node.gpus
        }
        self._cache: dict[tuple[object, ...], plans.Unschedulable] = {}
        self._fit_cache: dict[tuple[object, ...], bool] = {}
        self._offered: dict[_ShapeKey, str | tuple[tuple[str, ...], list[snapshot.Gpu]]] = {}
        self._room: dict[tuple[int, int], tuple[Why, str]] = {}
        """Per (GPU state, request shape): room on a MIG node."""
        self._shared_room: dict[tuple[int, int], tuple[Why, str]] = {}
        """Per (node position, request shape): room on a node in mode mps or time-slicing."""
        self._shape_ids: dict[tuple[object, ...], int] = {}
        self._usable_cache: dict[tuple[object, ...], tuple[int, ...]] = {}
        self._left: dict[tuple[str, bool], dict[int, tuple[int, int]]] = {}
        """Per (sharing node, with the plan or not): per GPU index, MPS: free GB and clients
        left; time-slicing: replicas left (and 0)."""
        self._early_cache: dict[tuple[object, ...], _Early] = {}
        """Per (signature, request): every node's reason decided before CPU and memory, and
        the positions of the nodes where CPU, memory and room decide."""

    def node_reason(
        self, position: int, pod: snapshot.Pod, *, admission: list[str | None] | None = None
    ) -> tuple[Why, str]:
        """Why the node at ``position`` does not run the pod in the plan.

        ``admission`` is ``Admission.reasons(pod)`` when the caller has it already.
        """
        early = self._early(position, pod, admission=admission)
        if early is not None:
            return self._named(self.snap.nodes[position], pod, early)
        return self._late(position, pod, self._shape_id(pod))

    def _shape_id(self, pod: snapshot.Pod) -> int:
        """A small number per request (MIG, unified, MPS): the room caches' key, hashed once."""
        return self._shape_ids.setdefault((pod.demand, pod.mps), len(self._shape_ids))

    def _early(
        self, position: int, pod: snapshot.Pod, *, admission: list[str | None] | None = None
    ) -> tuple[Why, str] | None:
        """The node's verdict where it comes before CPU and memory (admission, mode, GPUs that
        serve the request): the same for every pod of one signature and request, and for every
        node of one class (a wrong mode's text is left empty: :meth:`_named` names the node).
        ``None``: the node serves the request, CPU, memory and room decide (:meth:`_late`)."""
        node = self.snap.nodes[position]
        if admission is None or constraints.names_nodes(pod):
            reason = self._admission.reason(position, pod)
        else:
            reason = admission[self._admission.class_of(position)]
        if reason is not None:
            return Why.NOT_ADMITTED, reason
        if not pod.served_in(node.mode):
            return Why.WRONG_MODE, ""  # named per node: _named
        if node.mode is not modes.Mode.MIG:
            return self._not_offered(node, pod)
        vkey = (self._shape[position], pod.demand)
        offered = self._offered.get(vkey)
        if offered is None:
            offered = self._offered[vkey] = self._offer(node, pod)
        if isinstance(offered, str):
            return Why.NOT_OFFERED, offered
        return None

    def _early_all(self, pod: snapshot.Pod) -> _Early:
        """See :data:`_Early`."""
        admission = self._admission.reasons(pod)
        nodes = self.snap.nodes
        if constraints.names_nodes(pod):  # alike nodes no longer admit it alike: per node
            verdicts = [self._early(p, pod, admission=admission) for p in range(len(nodes))]
            classes = [[p] for p in range(len(nodes))]
        else:  # one verdict per class of alike nodes (admission, mode, GPUs)
            verdicts = [
                self._early(positions[0], pod, admission=admission)
                for positions in self._class_positions
            ]
            classes = self._class_positions
        open_: list[int] = []
        firsts: dict[Why, tuple[int, tuple[Why, str]]] = {}
        for verdict, positions in zip(verdicts, classes, strict=True):
            if verdict is None:
                open_.extend(positions)
            elif verdict[0] not in firsts or positions[0] < firsts[verdict[0]][0]:
                firsts[verdict[0]] = (positions[0], verdict)
        open_.sort()
        named = [
            (p, nodes[p].name, *self._named(nodes[p], pod, verdict))
            for p, verdict in sorted(firsts.values())
        ]
        return verdicts, classes is self._class_positions, open_, named

    @staticmethod
    def _named(node: snapshot.Node, pod: snapshot.Pod, verdict: tuple[Why, str]) -> tuple[Why, str]:
        """An earlier verdict for ``node``: a wrong mode names the node."""
        if verdict[0] is Why.WRONG_MODE:
            return Why.WRONG_MODE, _wrong_mode(node, _wanted_mode(pod))
        return verdict

    def _late(self, position: int, pod: snapshot.Pod, shape: int) -> tuple[Why, str]:
        """The verdict of a node that serves the request (:meth:`_early` gave ``None``): CPU and
        memory, then room (cached per GPU state, or per sharing node, and request ``shape``)."""
        node = self.snap.nodes[position]
        short = self._cpu_memory(node, pod)
        if short is not None:
            return Why.NO_CPU_MEMORY, short
        if node.mode is not modes.Mode.MIG:
            skey = (position, shape)
            shared = self._shared_room.get(skey)
            if shared is None:
                shared = self._shared_room[skey] = self._shared_verdict(node, pod)
            return shared
        rkey = (self._shape[position], shape)
        verdict = self._room.get(rkey)
        if verdict is None:
            offered = self._offered[(self._shape[position], pod.demand)]
            assert not isinstance(offered, str)
            verdict = self._room[rkey] = self._room_reason(node, *offered)
        return verdict

    def _cpu_memory(self, node: snapshot.Node, pod: snapshot.Pod) -> str | None:
        alloc = node.allocatable
        if alloc is None:
            return None
        free_cpu = alloc.cpu_milli - self.cpu[node.name]
        if pod.cpu_milli > free_cpu:
            return f"not enough CPU: needs {pod.cpu_milli}m, {max(free_cpu, 0)}m free"
        free_mem = alloc.memory_bytes - self.mem[node.name]
        if pod.memory_bytes > free_mem:
            return f"not enough memory: needs {pod.memory_bytes} bytes, {max(free_mem, 0)} free"
        return None

    def _usable(self, node: snapshot.Node, pod: snapshot.Pod) -> list[snapshot.Gpu]:
        """The GPUs of a node in mode mps or time-slicing that can serve the pod (cached per
        mode, GPU models and request: nodes alike share it)."""
        models, model_ids = self._gpu_models[node.name]
        key = (node.mode, model_ids, self._shape_id(pod))
        found = self._usable_cache.get(key)
        if found is None:
            mps = node.mode is modes.Mode.MPS
            per_model = {
                m.id: (
                    modes.mps_needs(pod.mps, pod.unified, m)
                    if mps
                    else modes.replica_needs(pod.unified, m)
                )
                is not None
                for m in models
            }
            found = self._usable_cache[key] = tuple(
                k for k, m in enumerate(models) if per_model[m.id]
            )
        return [node.gpus[k] for k in found]

    def _not_offered(self, node: snapshot.Node, pod: snapshot.Pod) -> tuple[Why, str] | None:
        """Why no GPU of a node in mode mps or time-slicing serves the pod (``None``: some do)."""
        if self._usable(node, pod):
            return None
        mps = node.mode is modes.Mode.MPS
        models = ", ".join(sorted({g.model.id for g in node.gpus}))
        if pod.unified is not None and not any(
            unified.allowed(pod.unified, g.model) for g in node.gpus
        ):
            return Why.NOT_OFFERED, f"its GPUs ({models}) are excluded by the pod's filters"
        if mps and pod.unified is not None and unified.too_many_for_mps(pod.unified):
            return Why.NOT_OFFERED, (
                "a container asking more than one GPU is not served by MPS slices (one "
                "container talks to one GPU's MPS daemon)"
            )
        most = max((sharing_mps.memory_gb(g.model) for g in node.gpus), default=0)
        return Why.NOT_OFFERED, f"its GPUs ({models}) have {most} GB; {_what(pod)} needs more"

    def _shared_verdict(self, node: snapshot.Node, pod: snapshot.Pod) -> tuple[Why, str]:
        """Room on a node in mode mps or time-slicing that serves the pod, CPU and memory
        aside: in the plan, without it, or none."""
        usable = self._usable(node, pod)
        what = _what(pod)
        if self._shared_fits(node, pod, usable, planned=True):
            return Why.ROOM_LEFT, f"{what} would still fit; the planner left it out"
        if self._shared_fits(node, pod, usable, planned=False):
            return Why.TAKEN, f"the room for {what} went to other pending pods"
        if node.mode is modes.Mode.MPS:
            return Why.IN_USE, f"no room for {what} without removing MPS slices in use"
        return Why.IN_USE, f"no free time-slicing replica for {what}"

    def _shared_fits(
        self, node: snapshot.Node, pod: snapshot.Pod, gpus: list[snapshot.Gpu], *, planned: bool
    ) -> bool:
        """Whether the pod's slices (or replicas) fit the GPUs beside what is taken now, and
        with ``planned`` beside what the plan gives to other pods too. Free slices are room."""
        left = self._left.get((node.name, planned))
        if left is None:
            left = self._left[(node.name, planned)] = self._left_on(node, planned=planned)
        if node.mode is not modes.Mode.MPS:
            replicas = [left[g.index][0] for g in gpus]
            assert pod.unified is not None
            for ask in pod.unified.asks:
                order = sorted(range(len(gpus)), key=lambda k: -replicas[k])
                if ask.count > len(order) or any(replicas[k] < 1 for k in order[: ask.count]):
                    return False
                for k in order[: ask.count]:
                    replicas[k] -= 1
            return True
        free = [left[g.index][0] for g in gpus]
        clients = [left[g.index][1] for g in gpus]
        groups: dict[int, set[int]] = {}
        needs = modes.mps_needs(pod.mps, pod.unified, gpus[0].model) or ()
        for need in needs:
            fit = [
                k
                for k in range(len(gpus))
                if free[k] >= need.memory_gb
                and clients[k] > 0
                and k not in groups.get(need.group, set())
            ]
            if not fit:
                return False
            k = min(fit, key=lambda k: (free[k], k))
            free[k] -= need.memory_gb
            clients[k] -= 1
            if need.group >= 0:
                groups.setdefault(need.group, set()).add(k)
        return True

    def _left_on(self, node: snapshot.Node, *, planned: bool) -> dict[int, tuple[int, int]]:
        """See :attr:`_left`."""
        out: dict[int, tuple[int, int]] = {}
        for g in node.gpus:
            key = (node.name, g.index)
            if node.mode is not modes.Mode.MPS:
                left = g.replicas - g.replicas_used
                if planned:
                    left -= self.shared_n[key]
                out[g.index] = (left, 0)
                continue
            used, n = self.taken[key]
            if planned:
                # Slices the plan gives that were free or new (a taken one is not given again).
                used += self.shared_gb[key]
                n += self.shared_n[key]
            out[g.index] = (
                sharing_mps.memory_gb(g.model) - used,
                sharing_config.MPS_MAX_CLIENTS - n,
            )
        return out

    def _offer(
        self, node: snapshot.Node, pod: snapshot.Pod
    ) -> str | tuple[tuple[str, ...], list[snapshot.Gpu]]:
        """The profiles the pod needs on the node's GPUs and those GPUs, or why none offer them."""
        by_need: dict[tuple[str, ...], list[snapshot.Gpu]] = {}
        for model, gpus_of_model in self._models[node.name]:
            need = pod.profiles_on(model)
            if need is not None:
                by_need.setdefault(need, []).extend(gpus_of_model)
        if not by_need:
            models = ", ".join(sorted({g.model.id for g in node.gpus}))
            if pod.unified is not None:
                why = unified.never_served(pod.unified, [m for m, _ in self._models[node.name]])
                return f"its GPUs ({models}) cannot serve {pod.request_text()}: {why}"
            missing = sorted(
                {
                    snapshot.resource_name(r.profile)
                    for r in pod.mig
                    if not any(snapshot.offered(g.model, r.profile) for g in node.gpus)
                }
            )
            if missing:
                return f"its GPUs ({models}) do not advertise {', '.join(missing)}"
            return f"no one model of its GPUs ({models}) advertises all of {_wanted(pod)}"
        if len(by_need) > 1:  # mixed models on one node: pick the largest group
            return max(by_need.items(), key=lambda kv: len(kv[1]))
        return next(iter(by_need.items()))

    def _room_reason(
        self, node: snapshot.Node, need: tuple[str, ...], gpus: list[snapshot.Gpu]
    ) -> tuple[Why, str]:
        """Whether the node's GPUs have room for ``need``, in the plan or without it."""
        what = _describe(need)
        if self._fits([(g, self.occupied[(node.name, g.index)]) for g in gpus], need):
            return Why.ROOM_LEFT, f"{what} would still fit; the planner left it out"
        if self._fits([(g, self.used[(node.name, g.index)]) for g in gpus], need):
            return Why.TAKEN, f"the room for {what} went to other pending pods"
        return Why.IN_USE, f"no room for {what} without destroying instances in use"

    def _fits(
        self, gpus: list[tuple[snapshot.Gpu, frozenset[layouts.Instance]]], need: tuple[str, ...]
    ) -> bool:
        """:func:`_fits`, cached: many nodes are in the same state."""
        key = (tuple((g.model.id, occ) for g, occ in gpus), need)
        hit = self._fit_cache.get(key)
        if hit is None:
            hit = self._fit_cache[key] = _fits(gpus, need)
        return hit

    def explain(self, pod: snapshot.Pod, *, per_node: bool = False) -> plans.Unschedulable:
        """The pod's summary reason (and per-node reasons when asked)."""
        key = (
            constraints.signature(pod),
            pod.demand,
            pod.mps,
            pod.cpu_milli,
            pod.memory_bytes,
            per_node,
        )
        cached = self._cache.get(key)
        if cached is not None:
            return plans.Unschedulable(pod.key, cached.reason, cached.nodes)
        # Pods of one signature and request differ only in CPU and memory: the nodes' earlier
        # verdicts are worked out once, the rest per pod.
        ekey = key[:3]
        early = self._early_cache.get(ekey)
        if early is None:
            early = self._early_cache[ekey] = self._early_all(pod)
        verdicts, per_class, open_, firsts = early
        shape = self._shape_id(pod)
        nodes = self.snap.nodes
        late = [(p, nodes[p].name, *self._late(p, pod, shape)) for p in open_]
        if per_node:
            if per_class:
                verdicts = [verdicts[k] for k in self._class_id]
            reasons = [
                (node.name, *self._named(node, pod, v))
                if v is not None
                else ("", Why.ROOM_LEFT, "")
                for node, v in zip(nodes, verdicts, strict=True)
            ]
            for p, name, why, text in late:
                reasons[p] = (name, why, text)
        else:
            # The summary reads the most hopeful verdict, the first node that has it, and the
            # nodes that have it among those CPU, memory and room decide: the first node of
            # each earlier verdict stands for the others.
            reasons = [(name, why, text) for _, name, why, text in sorted([*firsts, *late])]
        result = plans.Unschedulable(
            pod.key,
            _summary(pod, reasons),
            tuple((n, text) for n, _, text in reasons) if per_node else (),
        )
        self._cache[key] = result
        return result


def _wanted_mode(pod: snapshot.Pod) -> str:
    return f"{_what(pod)} needs {pod.needed_mode()}"


def _wrong_mode(node: snapshot.Node, wanted: str) -> str:
    """Why a node's mode does not serve a pod; ``wanted``: :func:`_wanted_mode`."""
    return f"node {node.name} is in mode {node.mode.value}; {wanted}"


def _summary(pod: snapshot.Pod, reasons: list[tuple[str, Why, str]]) -> str:
    wanted = pod.request_text()
    if not reasons:
        return "the cluster has no nodes"
    best = max(why for _, why, _ in reasons)
    example = next((n, text) for n, why, text in reasons if why == best)
    count = sum(1 for _, why, _ in reasons if why == best)
    if best is Why.NOT_ADMITTED:
        return f"no node admits the pod (e.g. {example[0]}: {example[1]})"
    if best is Why.WRONG_MODE:
        return f"no node that admits the pod is in a mode that serves it ({example[1]})"
    if best is Why.NOT_OFFERED:
        if pod.unified is not None or pod.mps:
            return f"no node that admits the pod has a GPU that serves {wanted} ({example[1]})"
        return f"no node that admits the pod advertises {_wanted(pod)}"
    if best is Why.NO_CPU_MEMORY:
        return (
            f"not enough CPU or memory on the nodes that offer {wanted} "
            f"(e.g. {example[0]}: {example[1]})"
        )
    if best is Why.IN_USE:
        if pod.mps:
            return f"no node offers {wanted} without removing MPS slices in use"
        if pod.unified is not None and any(why is Why.IN_USE for _, why, _ in reasons):
            nodes = {n for n, why, _ in reasons if why is Why.IN_USE}
            texts = {t for n, why, t in reasons if n in nodes}
            if any("instances in use" not in t for t in texts):
                return (
                    f"no node offers {wanted} without destroying instances or removing MPS "
                    f"slices in use, nor has a free time-slicing replica (e.g. {example[0]}: "
                    f"{example[1]})"
                )
        return f"no node offers {wanted} without destroying instances in use"
    if best is Why.TAKEN:
        return f"the room for {wanted} went to other pending pods (higher priority or placed first)"
    return (
        f"{wanted} would still fit on {count} node(s) (e.g. {example[0]}); the planner left it out"
    )


def explain(
    snap: snapshot.Snapshot,
    pending: Iterable[snapshot.Pod],
    placements: Iterable[plans.Placement],
    *,
    per_node: bool = False,
) -> list[plans.Unschedulable]:
    """Reasons for every pod in ``pending`` against the final placements of a plan. A pod whose
    resources no GPU of the cluster advertises gets that plainer reason (per-node reasons stay)."""
    pending = list(pending)
    if not pending:
        return []
    explainer = Explainer(snap, list(placements))
    plain = unresolvable(
        snapshot.Snapshot(nodes=snap.nodes, pods=tuple(pending), policy=snap.policy)
    )
    out = []
    for pod in pending:
        why = explainer.explain(pod, per_node=per_node)
        if pod.key in plain:
            why = plans.Unschedulable(why.pod, plain[pod.key], why.nodes)
        out.append(why)
    return out


def unresolvable(snap: snapshot.Snapshot) -> Mapping[str, str]:
    """Pods whose request no GPU model in the cluster offers, with the reason (cheap pre-check)."""
    out: dict[str, str] = {}
    mps_models = {g.model for n in snap.nodes if n.mode is modes.Mode.MPS for g in n.gpus}
    for pod in snap.pods:
        if pod.mps:
            if not mps_models:
                out[pod.key] = f"no node in the cluster is in mode mps ({_what(pod)} needs mps)"
            elif all(modes.mps_needs(pod.mps, None, m) is None for m in mps_models):
                most = max(sharing_mps.memory_gb(m) for m in mps_models)
                out[pod.key] = f"no MPS GPU in the cluster has room for {_what(pod)} ({most} GB)"
            continue
        if all(pod.profiles_on(m) is None for m in snap.models):
            if pod.unified is not None:
                why = unified.never_served(pod.unified, snap.models)
                out[pod.key] = f"no GPU in the cluster serves {pod.request_text()}: {why}"
                continue
            missing = [
                snapshot.resource_name(r.profile)
                for r in pod.mig
                if not any(snapshot.offered(m, r.profile) for m in snap.models)
            ]
            if missing and pod.dra:
                names = ", ".join(snapshot.mig_profile(r) for r in missing)
                out[pod.key] = (
                    f"no GPU in the cluster has the MIG profile {names}{_offered_by(missing)}"
                )
            elif missing:
                out[pod.key] = (
                    f"no GPU in the cluster advertises {', '.join(missing)}{_offered_by(missing)}"
                )
            else:
                out[pod.key] = f"no one GPU model in the cluster advertises all of {_wanted(pod)}"
    return out


def _what(pod: snapshot.Pod) -> str:
    """The pod's request as a reason names it: resource names, or the unified request."""
    if pod.unified is not None:
        return pod.unified.text()
    if pod.mps:
        return " + ".join(
            f"{r.count} x {r.resource}" if r.count > 1 else r.resource for r in pod.mps
        )
    return _wanted(pod)


def _wanted(pod: snapshot.Pod) -> str:
    """The pod's MIG requests by resource name, or, for a pod asking through DRA claims (no
    resource names), by profile."""
    if pod.dra:
        return "MIG placements " + pod.request_text()
    return " + ".join(
        f"{r.count} x {snapshot.resource_name(r.profile)}"
        if r.count > 1
        else snapshot.resource_name(r.profile)
        for r in pod.mig
    )


def _offered_by(resources: list[str]) -> str:
    """`` (it is a profile of A100-SXM4-40GB)``: which known GPUs advertise these, if any, so a
    user who typed another model's name sees whose it is."""
    models = [
        m.id
        for m in catalog.gpu_models()
        if all(snapshot.offered(m, snapshot.mig_profile(r)) for r in resources)
    ]
    if not models:
        return " (no known GPU offers it)" if len(resources) == 1 else ""
    return f" (only {', '.join(models)} offer{'s' if len(models) == 1 else ''} it)"
