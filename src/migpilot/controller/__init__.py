"""The controller: serves pending MIG pods by planning the cluster and pinning each pod to a node.

``observing`` (pure) reads Pods, Nodes and GpuLayouts into the planner's snapshot, with
``translating`` (pure) turning a GpuLayout into the planner's GPUs; ``pinning`` (pure) writes
the specs (from a plan, in one pass) and the pod patches; ``running`` is the loop, ``leading``
the Lease, ``metrics`` the Prometheus figures; ``kube`` is the one module that talks to the API
server (lightkube), behind the ``kubeapi.ControllerApi`` Protocol. See ``docs/controller.md``.
"""
