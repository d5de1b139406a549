"""KWOK's pod Stages rewritten to leave some nodes' pods alone, for a fake kubelet that plays
those nodes' kubelet itself.

KWOK's ``pod-ready`` Stage marks every bound pod Running at once, and its ``pod-delete`` Stage
deletes a terminating pod at once. A node whose pods must wait for something a kubelet does
first (the soak's device manager calling Allocate, ``bench/soak_kubelet.py``; the DRA kubelet
calling NodePrepareResources, and NodeUnprepareResources before a deleted pod goes,
:mod:`tests.kube.drakubelet`) is left out of those Stages with a ``.spec.nodeName NotIn``
expression; every other node's pods go on as KWOK ships it. The files KWOK ships are never
changed: the rewritten ones go to a folder of the caller's.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

POD_READY = "pod-ready"
"""KWOK's Stage that marks a bound pod Running."""
POD_DELETE = "pod-delete"
"""KWOK's Stage that deletes a pod once it has a deletion timestamp."""


def _name(doc: Mapping[str, Any]) -> object:
    return (doc.get("metadata") or {}).get("name")


def held_until_admitted(
    stage: Mapping[str, Any], *, nodes: Sequence[str], names: Sequence[str] = (POD_READY,)
) -> dict[str, Any]:
    """KWOK's ``stage`` (a Stage document, one of ``names``) that leaves the pods bound to
    ``nodes`` alone: their fake kubelet starts (or deletes) them."""
    if not nodes:
        raise ValueError("held_until_admitted needs at least one node")
    name = _name(stage)
    if stage.get("kind") != "Stage" or name not in names:
        wanted = " or ".join(names)
        raise ValueError(f"not KWOK's {wanted} Stage: kind {stage.get('kind')!r}, name {name!r}")
    out = copy.deepcopy(dict(stage))
    selector = out.setdefault("spec", {}).setdefault("selector", {})
    selector.setdefault("matchExpressions", []).append(
        {"key": ".spec.nodeName", "operator": "NotIn", "values": list(nodes)}
    )
    return out


def kwok_stages(
    stages: Sequence[Path],
    *,
    nodes: Sequence[str],
    folder: Path,
    names: Sequence[str] = (POD_READY,),
) -> tuple[Path, ...]:
    """``stages`` (KWOK's Stage files) with each Stage of ``names`` rewritten into ``folder`` by
    :func:`held_until_admitted`; the others as they are. A name of ``names`` found in no file is
    an error: the held nodes' pods would be left to KWOK after all."""
    out: list[Path] = []
    found: set[object] = set()
    for path in stages:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        if not any(_name(d) in names for d in docs):
            out.append(path)
            continue
        found |= {_name(d) for d in docs} & set(names)
        changed = [
            held_until_admitted(d, nodes=nodes, names=names) if _name(d) in names else d
            for d in docs
        ]
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / path.name
        target.write_text(yaml.safe_dump_all(changed, sort_keys=False))
        out.append(target)
    for name in names:
        if name not in found:
            raise ValueError(f"no {name} Stage among {', '.join(str(p) for p in stages)}")
    return tuple(out)


def running_status(doc: Mapping[str, Any], *, now: datetime.datetime) -> dict[str, Any]:
    """The status a kubelet writes once the pod ``doc``'s containers started (a merge patch of
    ``Pod.Status``): Running, Ready, each container running."""
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    spec = doc.get("spec") or {}
    conditions = [
        {"type": t, "status": "True", "lastTransitionTime": stamp}
        for t in ("PodScheduled", "Initialized", "Ready", "ContainersReady")
    ]
    containers = [
        {
            "name": c.get("name", ""),
            "image": c.get("image", ""),
            "imageID": "",
            "ready": True,
            "started": True,
            "restartCount": 0,
            "state": {"running": {"startedAt": stamp}},
        }
        for c in spec.get("containers") or ()
    ]
    return {
        "status": {
            "phase": "Running",
            "startTime": stamp,
            "conditions": conditions,
            "containerStatuses": containers,
        }
    }
