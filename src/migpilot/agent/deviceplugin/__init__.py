"""The kubelet device plugin: advertise GPUs and MIG devices to the kubelet, never restarting.

A sans-IO core decides what to advertise and what to answer (``devices`` holds the types,
``advertising`` the resources per MIG strategy, ``allocating`` the Allocate and
GetPreferredAllocation answers, ``health`` the XID rules, ``allocations`` the ledger of devices
handed out); ``serving`` is the gRPC shell (one server per resource, registration, kubelet
restarts) and ``podresources`` the kubelet PodResources client. Only ``serving`` and
``podresources`` import gRPC; the core imports no clock, socket or gRPC.
"""
