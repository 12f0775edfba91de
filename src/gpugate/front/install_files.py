"""The files `gpugate install` writes: the drop-in's text, the config skeleton's text, and the
ownership header that marks a file as gpugate's.

Every file gpugate writes starts with a header that records the SHA-256 of the rest. A file
whose rest no longer matches, or that has no such header, is the operator's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Literal, Union

from gpugate.config.models import pydantic_config
from gpugate.config.toml_text import toml_value
from gpugate.config.values import DEFAULT_PRIVATE_SHM, PRIVATE_SHM_OFF, DefaultPolicy
from gpugate.errors import InstallError, PermissionDenied
from gpugate.host.systemd import UnitSettings

DEFAULT_GPUGATE = Path("/usr/bin/gpugate")


# The drop-in; units/gpugate.conf is this text with @GPUGATE@ = /usr/bin/gpugate.
# Every setting in it means the same on systemd 247 (Debian 11) to 257 (Debian 13): the "+"
# prefix dates from 231, NotifyAccess=exec from 232, EXTEND_TIMEOUT_USEC= from 236, and drop-in
# directories (UNIT.d/, TEMPLATE@.service.d/ for every instance) are older still
# (docs/install.md, "systemd 247 to 257").
DROPIN_TEMPLATE = """\
# gpugate on a GPU service: before each start and after each stop, find every process that
# holds the unit's GPUs, kill exactly those, and wait until NVML reports the memory freed.
# `gpugate install UNIT` puts it at /etc/systemd/system/UNIT.d/gpugate.conf; settings for the
# unit go to /etc/gpugate/UNIT.toml (`gpugate config check --unit UNIT`; man gpugate).
[Service]
# "+": run with full privileges even when the unit sets User=, ProtectSystem= or
# ProtectProc=: gpugate must see and signal other users' processes. %n: the unit's name.
ExecStartPre=+@GPUGATE@ pre %n
# Runs after every stop, a crash or a failed start included: reaps workers that outlived the
# main process and waits for the driver to release their memory before the unit is "inactive".
ExecStopPost=+@GPUGATE@ post %n
"""


# What follows the hooks, each block left out where the unit sets that itself
# (host/systemd.py); `gpugate install` says which it kept.
NOTIFY_BLOCK = """\
# Accept sd_notify messages from the hook processes, not only the main one: gpugate sends
# STATUS= (shown by `systemctl status`) and EXTEND_TIMEOUT_USEC= while it waits. (A unit whose
# own children must notify sets NotifyAccess=all itself: install then keeps it.)
NotifyAccess=exec
"""
TIMEOUT_COMMENT = """\
# Each covers a hook: SIGTERM grace + SIGKILL wait + the driver's release (gpugate's
# wait_timeout_s, 120 s by default) with room to spare. gpugate asks systemd for more time
# (EXTEND_TIMEOUT_USEC=) while it works, so a unit's own shorter timeout is kept, not replaced.
"""
START_TIMEOUT = "TimeoutStartSec=@SECONDS@\n"
STOP_TIMEOUT = "TimeoutStopSec=@SECONDS@\n"
SHM_BLOCK = """\
# The unit's own /dev/shm (private_shm in /etc/gpugate/UNIT.toml): the server's segments live
# in a tmpfs the kernel frees when the unit's last process ends, however it ends (a SIGKILL
# after TimeoutStopSec=, systemctl kill, a crash, a restart). private_shm = "off" and
# `gpugate install` again: the unit shares the host's /dev/shm (docs/shared-memory.md).
TemporaryFileSystem=/dev/shm:@OPTIONS@
"""
SHM_OPTIONS = "mode=1777,nosuid,nodev,size={size}"
HOOK_TIMEOUT_S = 300


# The fields the skeleton shows, each with its model's description as the comment above it.
CONFIG_FIELDS = (
    "gpus",
    "ports",
    "free_mib",
    "kill_other_units",
    "share_gpus",
    "protected_executables",
    "protected_units",
    "containers",
    "private_shm",
)


PHASE_TEXT = {
    "pre": "ExecStartPre=: before the unit starts.",
    "post": "ExecStopPost=: after the unit stopped.",
}


POLICY_FIELDS = tuple(field.name for field in dataclasses.fields(DefaultPolicy))


HEADER = re.compile(r"^# Written by gpugate install \(sha256:([0-9a-f]{64})\)\.\n")


HEADER_TEXT = (
    "# Written by gpugate install (sha256:{digest}).\n"
    "# Edit freely: install and uninstall then leave it alone unless given --force.\n"
)


SAFE_PATH = re.compile(r"^/[A-Za-z0-9_.+/-]+$")
SAFE_FLAG = re.compile(r"^(-I|-m|gpugate)$")  # the words self_command adds


Gpus = Union[Literal["all"], list[Union[int, str]]]  # `gpus` as written into the config


class Ownership(Enum):
    ABSENT = "absent"
    OURS = "ours"  # written by gpugate install, unchanged since
    OPERATORS = "operator's"  # edited since, or never written by gpugate


def render_dropin(
    gpugate: Path | Sequence[str],
    unit: UnitSettings | None = None,
    private_shm: str = DEFAULT_PRIVATE_SHM,
) -> str:
    """The drop-in: the hooks, and what the unit does not set itself (unit: what it sets;
    None: nothing), with a /dev/shm of its own unless private_shm is "off". gpugate: the
    command that runs gpugate (front/self_command.py), or one path."""
    words = (str(gpugate),) if isinstance(gpugate, Path) else tuple(gpugate)
    for text in words:
        if not (SAFE_PATH.match(text) or SAFE_FLAG.match(text)) or "/../" in text:
            raise InstallError(
                f"--gpugate-path {text!r}: an absolute path of letters, digits and _.+/- only "
                "(it goes into ExecStartPre= unquoted)"
            )
    if not words or not SAFE_PATH.match(words[0]):
        raise InstallError(f"--gpugate-path {' '.join(words)!r}: not an absolute path")
    unit = unit or UnitSettings()
    parts = [DROPIN_TEMPLATE.replace("@GPUGATE@", " ".join(words))]
    if unit.notify_access is None or unit.notify_access.value != "all":
        parts.append(NOTIFY_BLOCK)
    timeouts = [
        line.replace("@SECONDS@", str(HOOK_TIMEOUT_S))
        for line, kept in ((START_TIMEOUT, unit.start_timeout), (STOP_TIMEOUT, unit.stop_timeout))
        if kept is None
    ]
    if timeouts:
        parts += [TIMEOUT_COMMENT, *timeouts]
    if private_shm != PRIVATE_SHM_OFF and unit.own_shm is None:
        parts.append(SHM_BLOCK.replace("@OPTIONS@", SHM_OPTIONS.format(size=private_shm)))
    return "".join(parts)


def render_config(
    unit: str,
    gpus: Gpus | None,
    containers: Sequence[str] = (),
    ports: Sequence[int] | None = None,
) -> str:
    """A commented skeleton: the built-in defaults, commented out, except the GPUs, containers
    and ports given."""
    model = pydantic_config()  # the fields' descriptions
    defaults = model()
    lines = [
        f"# gpugate settings for {unit}. Each commented line shows the built-in default:",
        "# uncomment what you change. Check it: gpugate config check --unit " + unit,
        "",
    ]
    for name in CONFIG_FIELDS:
        lines.append(f"# {model.model_fields[name].description}")
        if name == "gpus":  # written out: "auto" unless --gpus named them
            lines.append(f"gpus = {toml_value('auto' if gpus is None else gpus)}")
        elif name == "containers" and containers:
            lines.append(f"containers = {toml_value(list(containers))}")
        elif name == "ports" and ports:
            lines.append(f"ports = {toml_value(list(ports))}")
        else:
            lines.append(f"# {name} = {toml_value(getattr(defaults, name))}")
    for phase, policy in (("pre", defaults.pre), ("post", defaults.post)):
        lines += ["", f"[{phase}]", f"# {PHASE_TEXT[phase]}"]
        for name in POLICY_FIELDS:
            text = type(policy).model_fields[name].description
            lines += [f"# {text}", f"# {name} = {toml_value(getattr(policy, name))}"]
    return "\n".join(lines) + "\n"


def with_header(body: str) -> str:
    return HEADER_TEXT.format(digest=hashlib.sha256(body.encode()).hexdigest()) + body


def ownership(path: Path) -> Ownership:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Ownership.ABSENT
    except UnicodeDecodeError:
        return Ownership.OPERATORS
    except PermissionError:
        raise PermissionDenied(f"{path}: permission denied reading it (run as root)") from None
    match = HEADER.match(text)
    header_lines = HEADER_TEXT.count("\n")
    parts = text.split("\n", header_lines)
    if match is None or len(parts) <= header_lines:
        return Ownership.OPERATORS
    unchanged = hashlib.sha256(parts[header_lines].encode()).hexdigest() == match[1]
    return Ownership.OURS if unchanged else Ownership.OPERATORS
