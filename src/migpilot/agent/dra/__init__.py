"""The kubelet side of migpilot's DRA driver (``mig.migpilot.io``): preparing claims on a node.

Under Dynamic Resource Allocation kube-scheduler picks a device (a MIG placement, or a whole GPU
with MIG off) for a claim and the kubelet asks the driver's kubelet plugin to make it usable
before the pod starts. This package is that plugin. Its sans-IO core: :mod:`placements` names
the devices, :mod:`claims` reads a claim's allocation, :mod:`preparing` decides (through small
Protocols), :mod:`ownership` is the claims ledger's content, :mod:`cdispecs` a claim's CDI spec,
and :mod:`memory` holds the in-memory stand-ins of the Protocols. Its shells: :mod:`apiclaims`
(claims through the agent's API), :mod:`gpuinstances` (instances on the MIG backend, with the
ledger file), :mod:`cdiclaims` (the spec files), :mod:`serving` (the gRPC servers the kubelet
talks to) and :mod:`node` (the four built and started for the agent). ``docs/dra.md``,
"Kubelet plugin".
"""
