"""The planner: from a cluster snapshot to target MIG layouts, actions and pod placements.

Pure core, like :mod:`migpilot.mig` (which it builds on): frozen values in, frozen values out, no
Kubernetes, gRPC, NVML or HTTP, no clock. Randomness only through an explicitly seeded
``random.Random`` (the snapshot generator). The controller, the simulator and the CLI all call
the same planners through :mod:`migpilot.planning.planners`.
"""
