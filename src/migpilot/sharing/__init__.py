"""GPU sharing beyond MIG slices: NVIDIA's device-plugin sharing config (time-slicing, MPS).

Pure core (no I/O, no clock): ``config`` parses NVIDIA's config file format, ``configsets``
picks a node's config from a named set as NVIDIA's config-manager does, ``replicas`` turns
advertised devices into replicas and maps Allocate requests back, ``mps`` describes the MPS
daemons a node needs and what a container is told (and how much memory a GPU's MPS slices may
share), ``labelling`` gives GFD's sharing labels.
See ``docs/sharing.md``.
"""
