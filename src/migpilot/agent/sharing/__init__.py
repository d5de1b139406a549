"""The node agent's side of GPU sharing: NVIDIA's device-plugin sharing configs followed, the
MPS control daemons kept running and their GPUs' compute mode, the GpuLayout's MPS slices, and
the pool of instances set aside for unified (``nvidia.com/gpu``) requests.

Why a package: these change together with what a shared GPU is (:mod:`migpilot.sharing` holds
the pure model they apply); they are neither the reconciler's rules nor the Kubernetes side.
"""
