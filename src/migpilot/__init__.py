"""migpilot: dynamic NVIDIA MIG partitioning for Kubernetes.

The package is split into a pure core (``migpilot.mig`` for the hardware model; later the planner
and the simulator) and thin shells (``migpilot.cli``; later the node agent, controller and
extender). ``docs/architecture.md`` draws the layers; ``pyproject.toml`` states them as
import-linter contracts that CI enforces.
"""

__version__ = "0.1.0"
