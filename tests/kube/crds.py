"""Custom resource definitions on the test control plane, applied once however many tests ask."""

from __future__ import annotations

import pathlib

import lightkube
import yaml
from lightkube import codecs
from lightkube.generic_resource import create_global_resource
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition

from migpilot.api import gpulayouts as gl
from tests.kube.controlplane import ControlPlane, wait_for

GPULAYOUT_CRD = (
    pathlib.Path(__file__).parents[2] / "deploy" / "crds" / "gpulayouts.migpilot.io.yaml"
)
GpuLayout = create_global_resource(gl.GROUP, gl.VERSION, gl.KIND, gl.PLURAL)


def ensure_gpulayouts(plane: ControlPlane) -> None:
    """Create the GpuLayout CRD unless it exists (409 is fine), and wait until it is served."""
    client = plane.client
    try:
        client.create(codecs.from_dict(yaml.safe_load(GPULAYOUT_CRD.read_text())))
    except lightkube.ApiError as e:
        if e.status.code != 409:
            raise

    def established() -> bool:
        got = client.get(CustomResourceDefinition, gl.CRD_NAME)
        conditions = (got.status.conditions if got.status else None) or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_for(established, what="the GpuLayout CRD to be Established", timeout=60)
    # Discovery of a new group can lag Established by a moment.
    wait_for(lambda: list(client.list(GpuLayout)) is not None, what="gpulayouts to be served")
