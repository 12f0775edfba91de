"""NVIDIA Container Toolkit's config.toml, as far as it decides which of a container's device
lists NVIDIA's hook reads (api/config/v1/config.go: `accept-nvidia-visible-devices-envvar-
when-unprivileged`, default true; `accept-nvidia-visible-devices-as-volume-mounts`, default
false). Read only where root owns it and its folders and no one else may write them, at most
1 MiB; otherwise NVIDIA's defaults stand, and the Toolkit says why (its note, a code)."""

from __future__ import annotations

from pathlib import Path

from gpugate.compat import tomllib
from gpugate.host.oci_gpus import Toolkit
from gpugate.host.safe_files import read_capped, untrusted

CONFIG = Path("/etc/nvidia-container-runtime/config.toml")
ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
MOUNTS_KEY = "accept-nvidia-visible-devices-as-volume-mounts"
# Why NVIDIA's defaults stand in for the file (report/lines words them).
UNTRUSTED = "untrusted"  # another account than root may change it or a folder above it
UNREADABLE = "unreadable"  # not a regular file of at most 1 MiB, not UTF-8 TOML
NOT_BOOLEAN = "not-boolean"  # one of the two keys is not true or false


def read_toolkit(path: Path = CONFIG) -> Toolkit:
    if not path.exists() and not path.is_symlink():
        return Toolkit()
    if untrusted(path) is not None:
        return Toolkit(note=UNTRUSTED)
    try:
        data = tomllib.loads(read_capped(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return Toolkit(note=UNREADABLE)
    envvar, mounts = data.get(ENVVAR_KEY, True), data.get(MOUNTS_KEY, False)
    if not isinstance(envvar, bool) or not isinstance(mounts, bool):
        return Toolkit(note=NOT_BOOLEAN)
    return Toolkit(envvar_unprivileged=envvar, volume_mounts=mounts)
