"""The node agent's Kubernetes side: its API Protocol and adapters, the watches of its
GpuLayout, Node, ConfigMap and pods, the status and labels it reports, the static layouts a
Node label names, the Node capacity it publishes, and the instances the bound pods' counts keep.

Why a package: these change together with the Kubernetes objects the agent reads and writes.
Only :mod:`~migpilot.agent.cluster.kube` reaches the shared client (:mod:`migpilot.kube`); the
rest talks to :class:`~migpilot.agent.cluster.kubeapi.NodeApi` (import-linter contracts).
"""
