"""Regenerate the Python modules of the kubelet API from the ``.proto`` files beside them.

Run ``python -m migpilot.agent.kubeletapi.generate`` after editing a ``.proto`` file and commit
the result (``api_pb2.py``, ``api_pb2_grpc.py``, ``api_pb2.pyi`` per API). A test regenerates
into a temporary folder and fails when the committed modules differ. It runs ``grpc_tools.protoc``
(a dev dependency) in a subprocess so importing this module needs nothing beyond the stdlib.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
SRC_ROOT = HERE.parents[2]
"""The ``src`` folder: protos are compiled relative to it so generated imports are absolute."""
PROTOS: tuple[str, ...] = (
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
    "dra/v1/api.proto",
    "pluginregistration/v1/api.proto",
)
"""The API files, relative to this package."""


def proto_paths() -> list[pathlib.Path]:
    """The ``.proto`` files of the package, absolute."""
    return [HERE / p for p in PROTOS]


def generate(out_root: pathlib.Path = SRC_ROOT) -> list[pathlib.Path]:
    """Compile every API into ``out_root`` (the ``src`` folder by default); return the outputs."""
    outputs: list[pathlib.Path] = []
    for proto in proto_paths():
        rel = proto.relative_to(SRC_ROOT)
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{SRC_ROOT}",
            f"--python_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"--pyi_out={out_root}",
            str(rel),
        ]
        subprocess.run(cmd, check=True, cwd=SRC_ROOT)
        stem = out_root / rel.parent
        outputs += [stem / "api_pb2.py", stem / "api_pb2_grpc.py", stem / "api_pb2.pyi"]
    return outputs


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: regenerate in place, or into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=SRC_ROOT, help="output src root")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
