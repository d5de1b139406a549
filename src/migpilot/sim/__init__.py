"""The simulator: discrete-event replay of GPU traces against partitioning policies.

Pure core: a virtual clock, seeded randomness only, no I/O (the CLI reads traces and writes
reports). It drives the same planners the controller uses.
"""
