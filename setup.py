"""gpugate's build: setuptools, plus the protobuf modules of `gpugate nri` generated from the
.proto files in src/gpugate/host/nri_api (NRI's API, ttrpc's envelope) with grpcio-tools'
protoc, pinned in pyproject.toml's build-system beside the protobuf runtime the generated code
needs. They are generated here, once per build, rather than at first run into a cache: nothing
root imports is ever written on the host, and protoc (grpcio-tools, a compiled package) is no
run-time dependency. An editable install writes them beside the .proto files (git ignores
them)."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTOS = ("gpugate/host/nri_api/api.proto", "gpugate/host/nri_api/ttrpc.proto")
SRC = Path(__file__).resolve().parent / "src"


def generate(out: Path) -> None:
    from grpc_tools import protoc  # noqa: PLC0415  # the build's own requirement, not a module's

    out.mkdir(parents=True, exist_ok=True)
    # -I the package root: the files are registered as gpugate/host/nri_api/*.proto, so
    # another api.proto in the same process (the CRI test client's) does not collide.
    argv = ["protoc", f"-I{SRC}", f"--python_out={out}", f"--pyi_out={out}", *PROTOS]
    include = Path(protoc.__file__).parent / "_proto"
    if protoc.main([*argv, f"-I{include}"]) != 0:
        raise SystemExit(f"protoc failed on {', '.join(PROTOS)}")


class BuildWithProtos(build_py):
    def run(self) -> None:
        super().run()
        editable = getattr(self, "editable_mode", False)
        generate(SRC if editable else Path(self.build_lib))


setup(cmdclass={"build_py": BuildWithProtos})
