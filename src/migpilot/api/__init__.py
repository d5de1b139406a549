"""migpilot's Kubernetes API types (``migpilot.io``), as pure values both shells share.

The controller writes a GpuLayout's spec and the node agent its status; both read the other half.
One module per resource holds the schema, so the two sides cannot drift into two models of it.

Pure core: may import :mod:`migpilot.planning`, :mod:`migpilot.mig` and :mod:`migpilot.errors`,
and never a shell (CLI, agent, controller), a Kubernetes client, HTTP or a clock (the shells hand
in timestamps). ``pyproject.toml`` states this as import-linter contracts.
"""
