"""The MIG hardware model: GPU catalog, profiles, valid layouts, mig-parted config files.

Pure core: may import only the standard library (no clock), PyYAML for parsing text, and
:mod:`migpilot.errors`. It never imports the shells (CLI, agent, controller) or any client of an
outside system (Kubernetes, gRPC, NVML, HTTP); ``pyproject.toml`` states this as import-linter
contracts.
"""
