"""The `gpugate` command's entry: the OCI hook and runtime wrapper, which every container
start runs, go their own small way; everything else is the command line (front/cli.py)."""

from __future__ import annotations

import os
import sys


def run() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["oci-hook"]:
        from gpugate.front.commands.oci_hook import main  # noqa: PLC0415

        _exit(main(argv[1:]))
    if argv[:1] == ["oci-runtime"]:
        oci_runtime(argv[1:])
    from gpugate.front.cli import main as cli  # noqa: PLC0415

    _exit(cli())


def oci_runtime(argv: list[str] | None = None) -> None:
    """`gpugate-oci-runtime ARGS...`: runc's arguments, passed on unchanged."""
    from gpugate.front.commands.oci_runtime import main  # noqa: PLC0415

    _exit(main(sys.argv[1:] if argv is None else argv))


def _exit(code: int) -> None:
    """Exit without tearing the interpreter down: freeing pydantic's and pynvml's modules one
    by one takes ~40 ms, after the GPUs are free and before systemd may start the unit."""
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105 - contextlib costs the fast path an import
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing to say there
            pass
    os._exit(code)
