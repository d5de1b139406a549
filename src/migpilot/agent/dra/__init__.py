"""The kubelet side of migpilot's DRA driver (``mig.migpilot.io``): preparing claims on a node.

Under Dynamic Resource Allocation kube-scheduler picks a device (a MIG placement) for a claim
and the kubelet asks the driver's kubelet plugin to make it usable before the pod starts. This
package is that plugin: :mod:`placements` names the devices, :mod:`claims` reads a claim's
allocation, :mod:`preparing` decides (sans-IO, through small Protocols), :mod:`memory` holds the
in-memory stand-ins of the Protocols, and :mod:`serving` is the gRPC shell the kubelet talks to
(``docs/dra.md``, "Kubelet plugin").
"""
