"""The part of the Kubernetes API the node agent needs, as a small Protocol, and its in-memory
adapter.

The agent reads one object, its node's GpuLayout (``gpulayouts.migpilot.io``, named after the
node), follows it with a watch, and writes three things: the GpuLayout's status (server-side
apply as ``migpilot-agent``), the GFD labels on its Node, and, when it stands in for the kubelet,
the Node's extended-resource capacity and allocatable. :class:`NodeApi` is exactly that, with raw
JSON documents in and out (the caller parses them with :mod:`migpilot.api.gpulayouts`), so a
malformed object reaches the agent's own checks rather than failing inside a client. The agent
also lists and watches the pods bound to its node (and reads a pod the GpuLayout reserves
instances for, to tell a unified request), its Node and a ConfigMap, reads the ResourceClaims
its DRA kubelet plugin prepares, and the fleet of simulated
agents (:mod:`migpilot.kwok.fleet`) lists and watches every GpuLayout and the Nodes a label
selects, once for all its nodes.

The types, errors and selectors are the shared boundary's (:mod:`migpilot.kube`).
:class:`InMemoryNodeApi` is the same contract over the shared in-memory API server
(:class:`~migpilot.kube.memory.InMemoryServer`: the apiserver's versions, watches and 410 Gone),
with what the agent's tests write as the controller and read back;
:mod:`migpilot.agent.cluster.kube` is the adapter to the lightkube client
(:mod:`migpilot.kube.client`).

No I/O, no clock; never imports lightkube or httpx2.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from migpilot.agent.cluster import sliceapi
from migpilot.api import gpulayouts, gpulayouts_wire
from migpilot.kube import errors, memory, objects, requests


class NodeApi(Protocol):
    """What the node agent asks of the Kubernetes API (errors:
    :class:`~migpilot.kube.errors.KubeApiError`)."""

    def list_layout(self, name: str) -> objects.Listed:
        """The GpuLayout named ``name`` (none or one) and the list's resource version."""
        ...

    def watch_layout(self, name: str, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Changes to the GpuLayout ``name`` after ``resource_version``, as they happen.

        Raises :class:`~migpilot.kube.errors.GoneError` when that version is too old to watch from.
        """
        ...

    def apply_layout_status(self, name: str, status: gpulayouts.LayoutStatus) -> None:
        """Server-side apply of the status subresource as :data:`gpulayouts.AGENT_FIELD_MANAGER`."""
        ...

    def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Set labels on the Node (``None`` removes the key); other labels are left alone."""
        ...

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        """Set extended resources in the Node's status capacity and allocatable (``None``
        removes one); other resources are left alone."""
        ...

    def remove_node_taint(self, node: str, *, key: str, effect: str) -> bool:
        """Remove the taint ``key:effect`` (any value) from the Node's ``spec.taints``, leaving
        every other taint as it is: ``True`` when it was there and is gone, ``False`` when it
        was not there. A Node changed meanwhile by someone else is read again (optimistic
        concurrency), so no one's taint is lost."""
        ...

    def list_pods(self, *, node: str | None) -> objects.Listed:
        """The pods bound to ``node`` (``None``: to any node), in every namespace."""
        ...

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod ``namespace/name`` (raw JSON), ``None`` when there is none (404); the
        agent reads a pod the GpuLayout reserves instances for before it is bound."""
        ...

    def watch_pods(
        self, *, node: str | None, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Changes to the pods :meth:`list_pods` selects (a pod bound after the list arrives
        as ``ADDED``); :class:`~migpilot.kube.errors.GoneError` when too old."""
        ...

    def list_layouts(self) -> objects.Listed:
        """Every GpuLayout."""
        ...

    def watch_layouts(self, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Changes to every GpuLayout; :class:`~migpilot.kube.errors.GoneError` when too old."""
        ...

    def list_nodes(self, *, selector: objects.LabelSelector) -> objects.Listed:
        """The Nodes ``selector`` selects."""
        ...

    def watch_nodes(
        self, *, selector: objects.LabelSelector, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Changes to the Nodes ``selector`` selects (a Node that stops matching arrives as
        ``DELETED``); :class:`~migpilot.kube.errors.GoneError` when too old."""
        ...

    def list_node(self, name: str) -> objects.Listed:
        """The Node ``name`` (none or one)."""
        ...

    def watch_node(self, name: str, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Changes to the Node ``name``; :class:`~migpilot.kube.errors.GoneError` when too old."""
        ...

    def list_configmap(self, namespace: str, name: str) -> objects.Listed:
        """The ConfigMap ``namespace/name`` (none or one)."""
        ...

    def watch_configmap(
        self, namespace: str, name: str, *, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Changes to that ConfigMap; :class:`~migpilot.kube.errors.GoneError` when too old."""
        ...

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The ``resource.k8s.io/v1`` ResourceClaim ``namespace/name`` (raw JSON), ``None``
        when there is none (404); the DRA kubelet plugin reads the claims it prepares."""
        ...


_L = objects.Kind.LAYOUTS
_N = objects.Kind.NODES
_P = objects.Kind.PODS


class InMemoryNodeApi:
    """A :class:`NodeApi` over the shared in-memory API server (see the module).

    Tests write the controller's half with :meth:`put_spec` and :meth:`delete_layout`, Nodes
    with :meth:`put_node` and pods with :meth:`put_pod` and :meth:`delete_pod`, and read what
    the agent wrote with :meth:`layout`, :attr:`node_labels` and :attr:`node_resources` (also
    merged into a Node made with :meth:`put_node`, as a server would). Watches filter as the
    server's selectors do. Thread-safe; a watch blocks until the next change or :meth:`close`.
    """

    def __init__(self, server: memory.InMemoryServer | None = None) -> None:
        self.server = server if server is not None else memory.InMemoryServer()
        """The API server underneath (one may be shared with other adapters)."""
        self.node_labels: dict[str, dict[str, str]] = {}
        """Node name -> its labels as the agent set them."""
        self.node_resources: dict[str, dict[str, str]] = {}
        """Node name -> extended resources in its capacity (= allocatable)."""
        self.status_writes = 0
        """How many status applies were made (to check the agent does not write needlessly)."""
        self.pod_lists = 0
        """How many times pods were listed."""
        self.pod_gets = 0
        """How many times one pod was read."""
        self.taint_removals = 0
        """How many times a taint was removed from a Node."""

    @property
    def _lock(self) -> threading.Condition:
        return self.server.lock

    # -- the controller's side (tests) ---------------------------------------------------------
    def put_spec(self, name: str, spec: Mapping[str, Any]) -> None:
        """Create or replace the GpuLayout's spec (raw JSON); generation +1 when it changed."""
        with self._lock:
            old = self.server.objects[_L].get(name)
            if old is None:
                doc: dict[str, Any] = {
                    "apiVersion": gpulayouts.API_VERSION,
                    "kind": gpulayouts.KIND,
                    "metadata": {"name": name, "generation": 1,
                                 "uid": f"uid-{self.server.version}"},
                    "spec": copy.deepcopy(dict(spec)),
                }  # fmt: skip
                self.server.store(_L, name, doc)
                return
            if old.get("spec") == spec:
                return
            doc = copy.deepcopy(old)
            doc["spec"] = copy.deepcopy(dict(spec))
            doc["metadata"]["generation"] += 1
            self.server.store(_L, name, doc)

    def delete_layout(self, name: str) -> None:
        """Delete the GpuLayout (nothing if there is none)."""
        self.server.delete(_L, name)

    def layout(self, name: str) -> gpulayouts.GpuLayout | None:
        """The GpuLayout now, parsed."""
        with self._lock:
            doc = self.server.objects[_L].get(name)
            return None if doc is None else gpulayouts_wire.parse(copy.deepcopy(doc))

    def compact(self) -> None:
        """Forget the change history: watches from any older version get
        :class:`~migpilot.kube.errors.GoneError`."""
        self.server.compact()

    def close(self) -> None:
        """End every watch (they return)."""
        self.server.close()

    def put_node(self, name: str, labels: Mapping[str, str]) -> None:
        """Create a Node with ``labels``, or replace its labels."""
        with self._lock:
            old = self.server.objects[_N].get(name)
            fresh: dict[str, Any] = {"apiVersion": "v1", "kind": "Node",
                                     "metadata": {"name": name}, "status": {}}  # fmt: skip
            doc = copy.deepcopy(old) if old is not None else fresh
            doc["metadata"]["labels"] = dict(labels)
            self.server.store(_N, name, doc)

    def delete_node(self, name: str) -> None:
        """Delete the Node (nothing if there is none)."""
        self.server.delete(_N, name)

    def put_pod(self, doc: Mapping[str, Any]) -> None:
        """Create or replace a pod (raw JSON, ``metadata.namespace`` and ``name`` set)."""
        self.server.put(_P, doc)

    def put_configmap(self, namespace: str, name: str, data: Mapping[str, str]) -> None:
        """Create or replace a ConfigMap."""
        self.server.put(
            objects.Kind.CONFIGMAPS,
            {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"namespace": namespace, "name": name}, "data": dict(data)},
        )  # fmt: skip

    def set_node_label(self, name: str, key: str, value: str | None) -> None:
        """Set (``None``: remove) one label of an existing Node, as an admin would."""
        with self._lock:
            doc = copy.deepcopy(self.server.objects[_N][name])
            labels = doc["metadata"].setdefault("labels", {})
            if value is None:
                labels.pop(key, None)
            else:
                labels[key] = value
            self.server.store(_N, name, doc)

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete a pod (nothing if there is none)."""
        self.server.delete(_P, f"{namespace}/{name}")

    def slices(self) -> sliceapi.InMemorySliceApi:
        """The ResourceSlice calls (DRA mode), on the same server."""
        return sliceapi.InMemorySliceApi(self.server)

    # -- NodeApi -------------------------------------------------------------------------------
    def list_layout(self, name: str) -> objects.Listed:
        """The object (none or one) and the current version."""
        return self.server.list(_L, fields=(objects.named(name),))

    def watch_layout(self, name: str, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Events after ``resource_version`` until :meth:`close`."""
        return self.server.watch(
            _L, resource_version=resource_version, fields=(objects.named(name),)
        )

    def _sorted(self, listed: objects.Listed) -> objects.Listed:
        items = tuple(sorted(listed.items, key=objects.key_of))
        return objects.Listed(items, listed.resource_version)

    def list_node(self, name: str) -> objects.Listed:
        """The Node ``name`` (none or one)."""
        return self.server.list(_N, fields=(objects.named(name),))

    def watch_node(self, name: str, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Changes to the Node ``name``."""
        return self.server.watch(
            _N, resource_version=resource_version, fields=(objects.named(name),)
        )

    def list_configmap(self, namespace: str, name: str) -> objects.Listed:
        """The ConfigMap (none or one)."""
        return self.server.list(
            objects.Kind.CONFIGMAPS, namespace=namespace, fields=(objects.named(name),)
        )

    def watch_configmap(
        self, namespace: str, name: str, *, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Changes to the ConfigMap."""
        return self.server.watch(
            objects.Kind.CONFIGMAPS,
            resource_version=resource_version,
            namespace=namespace,
            fields=(objects.named(name),),
        )

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The ResourceClaim, or ``None``."""
        return self.server.get(objects.Kind.RESOURCECLAIMS, name, namespace=namespace)

    def list_pods(self, *, node: str | None) -> objects.Listed:
        """The pods bound to ``node`` (any node for ``None``)."""
        with self._lock:
            self.pod_lists += 1
        return self._sorted(self.server.list(_P, fields=(objects.on_node(node),)))

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod, or ``None``."""
        with self._lock:
            self.pod_gets += 1
        return self.server.get(_P, name, namespace=namespace)

    def watch_pods(
        self, *, node: str | None, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Pod changes after ``resource_version`` as the field selector sees them."""
        return self.server.watch(
            _P, resource_version=resource_version, fields=(objects.on_node(node),)
        )

    def list_layouts(self) -> objects.Listed:
        """Every GpuLayout."""
        return self._sorted(self.server.list(_L))

    def watch_layouts(self, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Every GpuLayout change after ``resource_version``."""
        return self.server.watch(_L, resource_version=resource_version)

    def list_nodes(self, *, selector: objects.LabelSelector) -> objects.Listed:
        """The Nodes ``selector`` selects."""
        return self._sorted(self.server.list(_N, labels=selector))

    def watch_nodes(
        self, *, selector: objects.LabelSelector, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Node changes after ``resource_version`` as the label selector sees them."""
        return self.server.watch(_N, resource_version=resource_version, labels=selector)

    def apply_layout_status(self, name: str, status: gpulayouts.LayoutStatus) -> None:
        """Replace the status; a missing object is a
        :class:`~migpilot.kube.errors.NotFoundError` (404), as on a server."""
        with self._lock:
            old = self.server.objects[_L].get(name)
            if old is None:
                raise errors.NotFoundError(f'gpulayouts.migpilot.io "{name}" not found')
            # A fresh top level and metadata (``store`` sets its resourceVersion); the spec is
            # shared, never changed in place.
            doc = {**old, "metadata": dict(old["metadata"])}
            doc["status"] = dict(gpulayouts_wire.status_patch(name, status))["status"]
            self.status_writes += 1
            if doc != old:
                self.server.store(_L, name, doc)

    def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Merge into the node's labels (and into its Node, when there is one)."""
        with self._lock:
            _merge(self.node_labels.setdefault(node, {}), labels)
            self._patch_node(node, requests.node_labels_patch(labels))

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        """Merge into the node's extended resources (and into its Node, when there is one)."""
        with self._lock:
            _merge(self.node_resources.setdefault(node, {}), resources)
            self._patch_node(node, requests.node_resources_patch(resources))

    def remove_node_taint(self, node: str, *, key: str, effect: str) -> bool:
        """Remove that taint from the Node (a
        :class:`~migpilot.kube.errors.NotFoundError` when there is no Node); whether it was
        there. Counted in :attr:`taint_removals`."""
        with self._lock:
            old = self.server.objects[_N].get(node)
            if old is None:
                raise errors.NotFoundError(f'nodes "{node}" not found')
            taints = (old.get("spec") or {}).get("taints") or []
            kept = [t for t in taints if not requests.same_taint(t, key=key, effect=effect)]
            if len(kept) == len(taints):
                return False
            patch = requests.node_taints_patch(
                kept, resource_version=str(old["metadata"].get("resourceVersion", ""))
            )
            self.taint_removals += 1
            self.server.store(_N, node, memory.merge_patch(old, patch))
            return True

    def set_node_taints(self, name: str, taints: list[dict[str, str]]) -> None:
        """Replace an existing Node's taints, as an admin (or a node autoscaler) would."""
        with self._lock:
            doc = copy.deepcopy(self.server.objects[_N][name])
            doc.setdefault("spec", {})["taints"] = copy.deepcopy(taints)
            self.server.store(_N, name, doc)

    def _patch_node(self, node: str, patch: Mapping[str, Any]) -> None:
        """The merge patch the lightkube adapter sends, applied to the Node if there is one."""
        old = self.server.objects[_N].get(node)
        if old is not None:
            doc = memory.merge_patch(old, patch)
            if doc != old:
                self.server.store(_N, node, doc)


def _merge(into: dict[str, str], patch: Mapping[str, str | None]) -> None:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        else:
            into[key] = value
