"""What the node agent decides, as pure functions of data: the desired layouts (from a GpuLayout
spec or a mig-parted config), the changes that reach them, and the GFD labels.

Why a package: these rules change with what the agent must do, not with how it talks to the
GPUs, the kubelet or the API server; kept pure (no thread, no clock, no client, no I/O; an
import-linter contract checks it), they are tested without any of those.
"""
