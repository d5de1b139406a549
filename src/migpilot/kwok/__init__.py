"""The tools for KWOK test clusters: nodes with no kubelet and no GPU, for tests and demos.

Why it exists apart from the agent: on a KWOK node nothing plays the kubelet, so the stand-in
kubelet (:mod:`~migpilot.kwok.standin`) publishes the device plugin's resources into the Node
and hands devices to pods as Allocate would, and the fleet (:mod:`~migpilot.kwok.fleet`) runs
the simulated agents of many such nodes in one process. They use the agent's own parts
(:mod:`migpilot.agent.assembling` wires them); the agent never imports them (an import-linter
contract checks it), so nothing of the test tools reaches a real node.
"""
