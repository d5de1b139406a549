"""migpilot's Kubernetes API types (``migpilot.io``), as pure values both shells share.

The controller writes a GpuLayout's spec and the node agent its status; both read the other half.
One module per resource holds its types (``gpulayouts``: frozen dataclasses and enums), and one
its wire format (``gpulayouts_wire``: the JSON the API server holds, parsed and written), so the
two sides cannot drift into two models of it.

Pure core, below the planner: may import :mod:`migpilot.sharing`, :mod:`migpilot.mig` and
:mod:`migpilot.errors`, and never :mod:`migpilot.planning` (translating to and from the planner's
types is the controller's job, ``controller/translating.py`` and ``controller/pinning.py``), a
shell (CLI, agent, controller), a Kubernetes client, HTTP or a clock (the shells hand in
timestamps). ``pyproject.toml`` states this as import-linter contracts.
"""
