"""The mutating admission webhook that holds MIG pods for the planner.

A shell on the same layer as :mod:`migpilot.agent` (the two never import each other). Its
decision is pure and sans-IO (:mod:`migpilot.webhook.admission`); :mod:`~migpilot.webhook.leases`
reads the controller's Lease and makes the webhook's client, :mod:`~migpilot.webhook.claims`
reads the DRA claims a new pod names through it (the two modules that talk to the Kubernetes
API), and :mod:`~migpilot.webhook.serving` is the HTTPS server around them. See
``docs/webhook.md``.
"""
