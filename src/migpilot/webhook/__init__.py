"""The mutating admission webhook that holds MIG pods for the planner.

A shell on the same layer as :mod:`migpilot.agent` (the two never import each other). Its
decision is pure and sans-IO (:mod:`migpilot.webhook.admission`); :mod:`~migpilot.webhook.leases`
is the one module that talks to the Kubernetes API (it reads the controller's Lease), and
:mod:`~migpilot.webhook.serving` is the HTTPS server around both. See ``docs/webhook.md``.
"""
