"""The planner's objective, in one place, so every planner and the benchmark score plans alike.

In order of importance:

1. the most pods placed, weighted by priority: lexicographically, the number placed at the
   highest priority, then at the next, and so on (``pod_weights`` turns that into integer
   weights: a pod outweighs all pods of lower priority together);
2. the fewest free instances destroyed, then the fewest GPUs touched (reusing a free instance
   beats creating a new one);
3. the most useful free capacity left (:func:`migpilot.mig.layouts.free_value` summed over GPUs,
   counting only used and assigned instances as occupied: it rewards large free regions and
   whole free GPUs);
4. the node policy (binpack or spread), a tie-breaker each planner applies while choosing.

One term sits between 2's destroys and GPUs touched: for the pods that ask to be spread over
GPUs themselves (``hami.io/gpu-scheduler-policy: spread`` on the pod, not the default), the
other occupied instances on their GPUs (``crowded``). A pod that asks for spread gets the least
used GPU even when that touches one more GPU; the default GPU policy stays a tie-breaker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from migpilot.mig import layouts
from migpilot.planning import plans, snapshot


def pod_weights(pods: Iterable[snapshot.Pod]) -> dict[str, int]:
    """Integer weights making the pod objective lexicographic by priority level."""
    pods = list(pods)
    per_level = Counter(p.priority for p in pods)
    weight: dict[int, int] = {}
    below = 0
    for level in sorted(per_level):
        weight[level] = below + 1
        below += per_level[level] * weight[level]
    return {p.key: weight[p.priority] for p in pods}


@dataclass(frozen=True, slots=True, order=True)
class Score:
    """A plan's objective values; larger compares better (``key``)."""

    weighted: int
    placed: int
    destroyed: int
    touched: int
    free_value: int
    crowded: int = 0
    """Pods that ask to be spread themselves: for each instance of a pod spread over GPUs, the
    other occupied instances on its GPU; for each pod spread over nodes, the other occupied
    instances on its node (0 when every such pod has its GPUs, or node, to itself)."""

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        """Sort key: larger is better."""
        return (self.weighted, -self.destroyed, -self.crowded, -self.touched, self.free_value)


def score(snap: snapshot.Snapshot, plan: plans.Plan) -> Score:
    """Evaluate a plan against the objective."""
    weights = pod_weights(snap.pods)
    placed = [p for p in plan.placements if p.pod in weights]
    targets = {(g.node, g.gpu): g.layout for g in plan.gpus}
    assigned: dict[tuple[str, int], set[layouts.Instance]] = {}
    for p in placed:
        for i in p.instances:
            assigned.setdefault((p.node, i.gpu), set()).add(layouts.Instance(i.start, i.profile))
    destroyed = touched = value = 0
    for node in snap.nodes:
        for gpu in node.gpus:
            key = (node.name, gpu.index)
            target = targets.get(key, gpu.layout)
            now, then = set(gpu.layout.instances), set(target.instances)
            destroyed += sum(1 for i in gpu.instances if not i.used and i.instance not in then)
            touched += now != then
            occupied = {i.instance for i in gpu.instances if i.used} | assigned.get(key, set())
            value += layouts.free_value(gpu.model, layouts.Layout.of(occupied))
    gpu_spread = {p.key for p in snap.pods if p.gpu_policy is snapshot.Policy.SPREAD}
    node_spread = {p.key for p in snap.pods if p.node_policy is snapshot.Policy.SPREAD}
    crowded = 0
    if gpu_spread or node_spread:
        used = {
            (node.name, gpu.index): sum(1 for i in gpu.instances if i.used)
            for node in snap.nodes
            for gpu in node.gpus
        }
        on_node: Counter[str] = Counter()
        for (node_name, _), n in used.items():
            on_node[node_name] += n
        for (node_name, _), held in assigned.items():
            on_node[node_name] += len(held)
        for p in placed:
            if p.pod in node_spread:
                crowded += on_node[p.node] - len(p.instances)
            if p.pod in gpu_spread:
                for i in p.instances:
                    key = (p.node, i.gpu)
                    crowded += used.get(key, 0) + len(assigned.get(key, ())) - 1
    return Score(
        weighted=sum(weights[p.pod] for p in placed),
        placed=len(placed),
        destroyed=destroyed,
        touched=touched,
        free_value=value,
        crowded=crowded,
    )
