"""The node agent: reconciles desired MIG layouts on a node's GPUs and offers the instances to the
kubelet (device plugin, GFD labels). A shell package over ``migpilot.gpu`` and ``migpilot.mig``.
"""
