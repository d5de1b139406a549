"""An independent check of a plan against its snapshot: every planner's output must pass it.

It re-derives what a correct plan must satisfy without trusting the planner: target layouts are
valid, instances in use are neither destroyed nor moved, the actions turn the current layouts
into the targets, every pod is placed at most once with exactly what it asked for (instances
advertised under exactly the resource names it requests, as kube-scheduler matches them; for a
unified request, one instance per GPU asked, each serving its container's ask on its GPU's model:
a plain profile with the memory and compute slices asked, on a model the pod's filters allow --
migpilot's planners give the smallest such profile, HAMi may give a larger one) on one node that
admits it, no instance serves two pods or a pod that did not get it from a free slot, and CPU
and memory fit. On nodes in another mode than mig (:mod:`migpilot.planning.modes`): no MIG
instance is planned there, a pod goes only to a node whose mode serves it, MPS target slices fit
the GPU (memory, 48 clients, 100 % compute), no slice in use or reserved is shrunk or removed,
the slice actions turn the current slices into the targets, every pod gets free or new slices of
exactly the sizes it asks (each used once), and time-slicing replicas are not overcommitted.
Used by the property-based tests, the benchmark and ``migpilot plan``'s
self-check.
"""

from __future__ import annotations

from collections import Counter

from migpilot import errors
from migpilot.mig import layouts, profiles
from migpilot.planning import constraints, modes, plans, podaffinity, snapshot, unified


def problems(snap: snapshot.Snapshot, plan: plans.Plan) -> list[str]:
    """Everything wrong with ``plan`` for ``snap``; empty when the plan is sound."""
    out: list[str] = []
    gpus = {(n.name, g.index): (n, g) for n in snap.nodes for g in n.gpus}
    seen_gpus = [(g.node, g.gpu) for g in plan.gpus]
    if sorted(seen_gpus) != sorted(gpus) or len(set(seen_gpus)) != len(seen_gpus):
        out.append("plan.gpus does not list every GPU of the snapshot exactly once")
    targets = {(g.node, g.gpu): g for g in plan.gpus}
    expected_actions: set[tuple[str, int, str, str, int]] = set()
    for key, (node, gpu) in gpus.items():
        gp = targets.get(key)
        target = gp.layout if gp else gpu.layout
        where = f"{node.name}/gpu{gpu.index}"
        try:
            reason = layouts.violation(gpu.model, target.instances)
        except errors.UnknownProfileError as e:
            reason = str(e)
        if reason is not None:
            out.append(f"{where}: target layout is invalid: {reason}")
        then = set(target.instances)
        for inst in gpu.instances:
            if inst.used and inst.instance not in then:
                out.append(f"{where}: instance in use {inst.instance} is destroyed or moved")
        now = set(gpu.layout.instances)
        if gp is not None and gp.changed != (now != then):
            out.append(
                f"{where}: 'changed' is {gp.changed} but the layout "
                + ("changed" if now != then else "did not change")
            )
        for i in now - then:
            expected_actions.add((node.name, gpu.index, plans.Op.DESTROY.value, i.profile, i.start))
        for i in then - now:
            expected_actions.add((node.name, gpu.index, plans.Op.CREATE.value, i.profile, i.start))
    got_actions = [(a.node, a.gpu, a.op.value, a.profile, a.start) for a in plan.actions]
    if len(set(got_actions)) != len(got_actions) or set(got_actions) != expected_actions:
        out.append("actions do not turn the current layouts into the target layouts")
    for a in plan.actions:
        n_g = gpus.get((a.node, a.gpu))
        if n_g and a.op is plans.Op.DESTROY:
            for inst in n_g[1].instances:
                if inst.used and inst.start == a.start and inst.profile == a.profile:
                    out.append(f"{a.node}/gpu{a.gpu}: destroys instance in use {inst.instance}")
    # Ordering: on each GPU all destroys come before any create.
    last: dict[tuple[str, int], str] = {}
    for a in plan.actions:
        k = (a.node, a.gpu)
        if a.op is plans.Op.DESTROY and last.get(k) == plans.Op.CREATE.value:
            out.append(f"{a.node}/gpu{a.gpu}: a destroy comes after a create")
        last[k] = a.op.value
    out.extend(_check_pods(snap, plan, gpus, targets))
    out.extend(_check_sharing(snap, plan))
    out.extend(_check_modes(snap, plan, gpus, targets))
    return out


def _check_modes(
    snap: snapshot.Snapshot,
    plan: plans.Plan,
    gpus: dict[tuple[str, int], tuple[snapshot.Node, snapshot.Gpu]],
    targets: dict[tuple[str, int], plans.GpuPlan],
) -> list[str]:
    """Dynamic MIG mode (``docs/migmode.md``): only idle GPUs of dynamic nodes are switched,
    once each; a GPU whole after the plan has no instance; each whole-GPU pod gets exactly the
    whole GPUs it asks for, free ones, each to one pod."""
    out: list[str] = []
    final = {key: g.mig for key, (_, g) in gpus.items()}
    seen: set[tuple[str, int]] = set()
    for sw in plan.switches:
        key = (sw.node, sw.gpu)
        where = f"{sw.node}/gpu{sw.gpu}"
        n_g = gpus.get(key)
        if n_g is None:
            out.append(f"{where}: switches the MIG mode of no such GPU")
            continue
        node, gpu = n_g
        if key in seen:
            out.append(f"{where}: its MIG mode is switched twice")
        seen.add(key)
        if not node.dynamic:
            out.append(f"{where}: switches a MIG mode on a node not labelled dynamic")
        if sw.mig == gpu.mig:
            out.append(f"{where}: switches the MIG mode to the one it has")
        if any(i.used for i in gpu.instances) or gpu.whole_taken:
            out.append(f"{where}: switches the MIG mode of a GPU with something used or reserved")
        final[key] = sw.mig
    for key, mig in final.items():
        gp = targets.get(key)
        if not mig and gp is not None and gp.layout.instances:
            out.append(f"{key[0]}/gpu{key[1]}: whole (MIG off) after the plan, yet has instances")
    whole = {p.key: p for p in snap.whole_pods}
    given: set[tuple[str, int]] = set()
    for pl in plan.placements:
        for ai in pl.instances:
            if not final.get((pl.node, ai.gpu), True):
                out.append(f"pod {pl.pod}: given an instance on whole GPU {pl.node}/gpu{ai.gpu}")
        pod = whole.get(pl.pod)
        if pod is None:
            continue
        if pl.instances or pl.shares:
            out.append(f"pod {pl.pod}: asks for whole GPUs, given instances or shares")
        if len(set(pl.gpus)) != len(pl.gpus) or len(pl.gpus) != pod.whole:
            out.append(f"pod {pl.pod}: got whole GPUs {list(pl.gpus)}, asked for {pod.whole}")
        first = gpus.get((pl.node, pl.gpus[0])) if pl.gpus else None
        if first is not None and not first[0].dynamic:
            out.append(f"pod {pl.pod}: placed on {pl.node}, not labelled dynamic")
        for i in pl.gpus:
            key = (pl.node, i)
            n_g = gpus.get(key)
            if n_g is None:
                out.append(f"pod {pl.pod}: {pl.node}/gpu{i}: no such GPU")
                continue
            if final[key]:
                out.append(f"pod {pl.pod}: {pl.node}/gpu{i} is in MIG mode after the plan")
            if n_g[1].whole_taken:
                out.append(f"pod {pl.pod}: {pl.node}/gpu{i} is already held or reserved")
            if key in given:
                out.append(f"pod {pl.pod}: {pl.node}/gpu{i} is given to two pods")
            given.add(key)
    return out


def _check_pods(
    snap: snapshot.Snapshot,
    plan: plans.Plan,
    gpus: dict[tuple[str, int], tuple[snapshot.Node, snapshot.Gpu]],
    targets: dict[tuple[str, int], plans.GpuPlan],
) -> list[str]:
    out: list[str] = []
    mig_pods = {p.key for p in snap.pods}
    pods = {p.key: p for p in (*snap.pods, *snap.whole_pods)}
    nodes = {n.name: n for n in snap.nodes}
    placed = Counter(p.pod for p in plan.placements)
    out += [
        f"pod {v} (pod affinity or topology spread)"
        for v in podaffinity.violations(
            snap,
            {p.pod: p.node for p in plan.placements if p.pod in mig_pods and p.node in nodes},
        )
    ]
    unsched = Counter(u.pod for u in plan.unschedulable)
    for key in pods:
        if placed[key] + unsched[key] != 1:
            out.append(
                f"pod {key}: placed {placed[key]} times and unschedulable {unsched[key]} times"
            )
    for key in set(placed) | set(unsched):
        if key not in pods:
            out.append(f"pod {key}: not in the snapshot")
    taken: set[tuple[str, int, int]] = set()
    cpu: Counter[str] = Counter()
    mem: Counter[str] = Counter()
    for pl in plan.placements:
        pod = pods.get(pl.pod)
        node = nodes.get(pl.node)
        if pod is None or node is None:
            out.append(f"pod {pl.pod}: placed on unknown node {pl.node!r}")
            continue
        reason = constraints.rejection(node, pod)
        if reason is not None:
            out.append(f"pod {pl.pod}: node {node.name} does not admit it: {reason}")
        cpu[node.name] += pod.cpu_milli
        mem[node.name] += pod.memory_bytes
        if pod.whole:
            continue  # its whole GPUs: _check_modes
        if pl.gpus:
            out.append(f"pod {pl.pod}: given whole GPUs, but it asks for none")
        if not pod.served_in(node.mode):
            out.append(f"pod {pl.pod}: node {node.name} is in mode {node.mode.value}")
            continue
        if node.mode is not modes.Mode.MIG:
            if pl.instances:
                out.append(f"pod {pl.pod}: given MIG instances on {node.name}, not in mode mig")
            continue  # shares: _check_sharing
        if pl.shares:
            out.append(f"pod {pl.pod}: given MPS slices or replicas on {node.name}, in mode mig")
        need = Counter({r.profile: r.count for r in pod.mig})
        got: Counter[str] = Counter()
        given: list[tuple[str, profiles.GpuModel, str]] = []
        for ai in pl.instances:
            where = f"pod {pl.pod}: {node.name}/gpu{ai.gpu}"
            n_g = gpus.get((node.name, ai.gpu))
            if n_g is None:
                out.append(f"{where}: no such GPU")
                continue
            gpu = n_g[1]
            inst = layouts.Instance(ai.start, ai.profile)
            target = (
                targets[(node.name, ai.gpu)].layout
                if (node.name, ai.gpu) in targets
                else gpu.layout
            )
            if inst not in set(target.instances):
                out.append(f"{where}: {inst} is not in the target layout")
            if any(e.used and e.instance == inst for e in gpu.instances):
                out.append(f"{where}: {inst} is already in use")
            if (node.name, ai.gpu, ai.start) in taken:
                out.append(f"{where}: {inst} is given to two pods")
            taken.add((node.name, ai.gpu, ai.start))
            if pod.unified is not None:
                given.append((where, gpu.model, ai.profile))
            # kube-scheduler matches resource names as strings: the instance must be advertised
            # under exactly a name the pod requests.
            elif ai.profile not in need or not snapshot.offered(gpu.model, ai.profile):
                asked = ", ".join(snapshot.resource_name(r.profile) for r in pod.mig)
                out.append(
                    f"{where}: {ai.profile} is advertised as {snapshot.resource_name(ai.profile)}"
                    f", but the pod requests {asked}"
                )
            else:
                got[ai.profile] += 1
        if pod.unified is not None:
            out.extend(_check_unified(pl.pod, pod.unified, given))
        elif got != need:
            out.append(f"pod {pl.pod}: got {dict(got)} but asked for {dict(need)}")
    for name, node in nodes.items():
        alloc = node.allocatable
        if alloc is None:
            continue
        if cpu[name] > alloc.cpu_milli:
            out.append(f"node {name}: pods need {cpu[name]}m CPU, {alloc.cpu_milli}m allocatable")
        if mem[name] > alloc.memory_bytes:
            out.append(
                f"node {name}: pods need {mem[name]} bytes, {alloc.memory_bytes} allocatable"
            )
    return out


def _check_sharing(snap: snapshot.Snapshot, plan: plans.Plan) -> list[str]:
    """The MPS slices and time-slicing replicas of a plan (see the module docstring)."""
    out: list[str] = []
    nodes = {n.name: n for n in snap.nodes}
    pods = {p.key: p for p in snap.pods}
    for n in snap.nodes:
        if n.mode is not modes.Mode.MIG:
            for g in n.gpus:
                mig = next((x for x in plan.gpus if (x.node, x.gpu) == (n.name, g.index)), None)
                if mig is not None and mig.layout.instances:
                    out.append(f"{n.name}/gpu{g.index}: MIG instances on a node in mode {n.mode}")
    current = {(n.name, g.index): g for n in snap.nodes if n.mode is modes.Mode.MPS for g in n.gpus}
    listed = [(g.node, g.gpu) for g in plan.mps]
    if current and (sorted(listed) != sorted(current) or len(set(listed)) != len(listed)):
        out.append("plan.mps does not list every GPU of the nodes in mode mps exactly once")
    target: dict[tuple[str, int], dict[int, modes.MpsSlice]] = {}
    expected: set[tuple[str, int, str, int]] = set()
    for gp in plan.mps:
        key = (gp.node, gp.gpu)
        gpu = current.get(key)
        where = f"{gp.node}/gpu{gp.gpu}"
        if gpu is None:
            out.append(f"{where}: MPS slices on a GPU not in mode mps")
            continue
        problem = modes.slices_problem(gpu.model, gp.slices)
        if problem is not None:
            out.append(f"{where}: target slices do not fit: {problem}")
        then = {s.id: s for s in gp.slices}
        now = {s.id: s for s in gpu.mps}
        target[key] = then
        for s in gpu.mps:
            kept = then.get(s.id)
            if s.taken and (kept is None or kept.memory_gb != s.memory_gb or kept.cores != s.cores):
                out.append(f"{where}: slice {s.id} of {s.memory_gb} GB in use is shrunk or removed")
            elif kept is not None and (kept.memory_gb, kept.cores) != (s.memory_gb, s.cores):
                out.append(f"{where}: slice {s.id} changes in place (remove it, create another)")
        if gp.changed != (set(now) != set(then)):
            out.append(f"{where}: 'changed' is {gp.changed}")
        expected |= {(gp.node, gp.gpu, plans.SliceOp.REMOVE.value, i) for i in set(now) - set(then)}
        expected |= {(gp.node, gp.gpu, plans.SliceOp.CREATE.value, i) for i in set(then) - set(now)}
    got = [(a.node, a.gpu, a.op.value, a.slice) for a in plan.slice_actions]
    if len(set(got)) != len(got) or set(got) != expected:
        out.append("slice actions do not turn the current MPS slices into the target slices")
    replicas: Counter[tuple[str, int]] = Counter()
    given: set[tuple[str, int, int]] = set()
    for pl in plan.placements:
        pod, node = pods.get(pl.pod), nodes.get(pl.node)
        if pod is None or node is None or node.mode is modes.Mode.MIG:
            continue
        if node.mode is modes.Mode.TIME_SLICING:
            out.extend(_check_replicas(pl, pod, node, replicas))
            continue
        if not pl.shares:
            out.append(f"pod {pl.pod}: got no MPS slice on {node.name}")
            continue
        sizes: list[int] = []
        per_gpu: Counter[int] = Counter()
        for sh in pl.shares:
            where = f"pod {pl.pod}: {node.name}/gpu{sh.gpu}"
            slices = target.get((node.name, sh.gpu))
            got_slice = None if slices is None or sh.slice is None else slices.get(sh.slice)
            if got_slice is None:
                out.append(f"{where}: slice {sh.slice} is not in the target slices")
                continue
            gpu = current[(node.name, sh.gpu)]
            sid = got_slice.id
            if any(e.id == sid and e.taken for e in gpu.mps):
                out.append(f"{where}: slice {sid} is already in use")
            if (node.name, sh.gpu, sid) in given:
                out.append(f"{where}: slice {sid} is given to two pods")
            given.add((node.name, sh.gpu, sid))
            if sh.memory_gb != got_slice.memory_gb:
                out.append(f"{where}: slice {sid} has {got_slice.memory_gb} GB, not {sh.memory_gb}")
            sizes.append(got_slice.memory_gb)
            per_gpu[sh.gpu] += 1
        by_index = {g.index: g.model for g in node.gpus}
        model = by_index.get(pl.shares[0].gpu)
        needs = modes.mps_needs(pod.mps, pod.unified, model) if model else None
        want = sorted(n.memory_gb for n in needs or ())
        if sorted(sizes) != want:
            out.append(f"pod {pl.pod}: got slices of {sorted(sizes)} GB but asked for {want}")
        asks = len(pod.unified.asks) if pod.unified is not None else None
        if asks is not None and any(n > asks for n in per_gpu.values()):
            out.append(f"pod {pl.pod}: two slices of one container on one GPU")
    return out


def _check_replicas(
    pl: plans.Placement,
    pod: snapshot.Pod,
    node: snapshot.Node,
    replicas: Counter[tuple[str, int]],
) -> list[str]:
    """A pod's time-slicing replicas: one per GPU asked, none overcommitted."""
    out: list[str] = []
    gpus = {g.index: g for g in node.gpus}
    for sh in pl.shares:
        gpu = gpus.get(sh.gpu)
        if gpu is None or sh.slice is not None:
            out.append(f"pod {pl.pod}: {node.name}/gpu{sh.gpu} is no time-slicing replica")
            continue
        replicas[(node.name, sh.gpu)] += 1
        if gpu.replicas_used + replicas[(node.name, sh.gpu)] > gpu.replicas:
            out.append(f"{node.name}/gpu{sh.gpu}: more than its {gpu.replicas} replicas given")
    asked = pod.unified.count if pod.unified is not None else 0
    if len(pl.shares) != asked:
        out.append(f"pod {pl.pod}: got {len(pl.shares)} replicas but asked for {asked}")
    return out


def _check_unified(
    key: str,
    request: unified.UnifiedRequest,
    given: list[tuple[str, profiles.GpuModel, str]],
) -> list[str]:
    """A unified pod's instances against its request: each on an allowed model, of a profile that
    serves a container's ask (:func:`unified.serves`), one per GPU asked (a matching of
    instances to the GPUs the containers ask for must exist)."""
    out: list[str] = []
    usable: list[list[int]] = []
    """Per instance, the asks (by index) it may serve."""
    for where, model, name in given:
        if not unified.allowed(request, model):
            out.append(f"{where}: {model.id} is excluded by the pod's GPU model filters")
            continue
        try:
            prof = model.profile_named(name)
        except errors.UnknownProfileError:
            out.append(f"{where}: {name} is not a profile of {model.id}")
            continue
        fits = [k for k, ask in enumerate(request.asks) if unified.serves(ask, model, prof)]
        if not fits:
            out.append(f"{where}: {name} does not serve the pod's request ({request.text()})")
        usable.append(fits)
    if out:
        return out
    if len(given) != request.count or not _matched(usable, [a.count for a in request.asks]):
        have = ", ".join(f"{m.id}:{n}" for _, m, n in given) or "nothing"
        out.append(f"pod {key}: got {have} but asked for {request.text()}")
    return out


def _matched(usable: list[list[int]], counts: list[int]) -> bool:
    """Whether every instance can be given to an ask it serves, no ask getting more than its
    count (augmenting paths; a pod has a handful of instances)."""
    slots = [k for k, n in enumerate(counts) for _ in range(n)]
    owner: list[int | None] = [None] * len(slots)

    def assign(i: int, seen: set[int]) -> bool:
        for s, k in enumerate(slots):
            if k not in usable[i] or s in seen:
                continue
            seen.add(s)
            current = owner[s]
            if current is None or assign(current, seen):
                owner[s] = i
                return True
        return False

    return all(assign(i, set()) for i in range(len(usable)))
