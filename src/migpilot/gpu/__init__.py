"""GPU backends: the one small interface the node agent drives, and its implementations.

``nvml`` talks to the driver through NVIDIA's official bindings; ``emulated`` keeps N GPUs of any
catalog model in process (with NVML's semantics, persistence and fault injection) for tests, the
demo and the simulator. A shell package: it may import the MIG model, never the planner's shells.
"""
