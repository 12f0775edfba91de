"""The runtime `gpugate-oci-runtime` runs after adding its hooks: runc, or NVIDIA's, as
`gpugate install --containers` recorded, at fixed paths only root may change. CHAIN marks the
environment passed to NVIDIA's runtime: a wrapper it runs again runs runc, ending the chain."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from gpugate.compat import tomllib
from gpugate.errors import ConfigError, Refused
from gpugate.host.safe_files import first_root_executable, read_trusted
from gpugate.untrusted import for_error

RECORD = Path("/etc/gpugate/oci-runtime.toml")
RUNC = "runc"
NVIDIA = "nvidia-container-runtime"
PATHS: dict[str, tuple[str, ...]] = {
    RUNC: ("/usr/bin/runc", "/usr/sbin/runc", "/usr/local/bin/runc", "/usr/local/sbin/runc"),
    # Debian/Ubuntu/RHEL packages; NVIDIA's GPU operator installs its toolkit in the second.
    NVIDIA: (
        "/usr/bin/nvidia-container-runtime",
        "/usr/local/nvidia/toolkit/nvidia-container-runtime",
    ),
}
CHAIN = "GPUGATE_OCI_RUNTIME_CHAIN"
MAX_RECORD = 4096


class Wrapped(NamedTuple):
    name: str  # what runs: the recorded one, or runc where it is missing or the chain ends
    path: str | None  # its fixed path; None where none is installed


def read_record(path: Path | None = None) -> str:
    """The recorded runtime's name (runc where there is no record), else ConfigError."""
    path = RECORD if path is None else path
    try:
        data = tomllib.loads(read_trusted(path, MAX_RECORD, follow_links=False))
    except Refused as exc:
        if exc.missing:
            return RUNC
        raise ConfigError(str(path), "", str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "", f"not valid TOML: {exc}") from None
    value = data.get("runtime", RUNC)
    if value not in PATHS:
        why = f"{for_error(str(value))}: not one of {', '.join(PATHS)}"
        raise ConfigError(str(path), "runtime", f"{why} (gpugate install --containers writes it)")
    return str(value)


def record_text(name: str) -> str:
    return (
        "# Written by gpugate install --containers: the runtime gpugate-oci-runtime runs after\n"
        "# adding gpugate's hooks (runc, or nvidia-container-runtime where it was in place).\n"
        f'runtime = "{name}"\n'
    )


def find(name: str) -> str | None:
    return first_root_executable(PATHS[name])


def choose(recorded: str, environ: Mapping[str, str]) -> Wrapped:
    """The recorded runtime where it is installed and not yet in the chain, else runc."""
    name = RUNC if environ.get(CHAIN) or find(recorded) is None else recorded
    return Wrapped(name, find(name))
