"""The one Kubernetes boundary of migpilot's shells: the agent, the controller, the webhook and
the KWOK test tools.

Why it exists: each shell once had its own errors, list and watch types, error translation and
in-memory API server. Here they are once, in the shape of lightkube and kopf's client layer:

- :mod:`~migpilot.kube.errors`: what a call to the API server can fail with;
- :mod:`~migpilot.kube.objects`: the kinds, list and watch results, selectors and the reading
  of raw objects' metadata;
- :mod:`~migpilot.kube.requests`: the bodies the shells send, built from plain data (pure);
- :mod:`~migpilot.kube.configs`: ``--kubeconfig`` read into lightkube's config;
- :mod:`~migpilot.kube.client`: the lightkube clients (sync and async) with the requests sent
  and the errors translated; the only module of the package that sends anything;
- :mod:`~migpilot.kube.memory`: one API server in memory for the unit tests of every shell.
- :mod:`~migpilot.kube.leasereader`: the controller's Lease as the webhook and the agents on
  DRA nodes follow it (cached reads, the last one kept when a read fails).

Each shell keeps only its own narrow Protocol (the operations it needs) and its adapters to
:mod:`~migpilot.kube.client` and :mod:`~migpilot.kube.memory`. The pure core never imports this
package (an import-linter contract checks it).
"""
