"""What `gpugate install` says of the unit's own settings that its drop-in keeps (timeouts,
NotifyAccess=, a /dev/shm of the unit's own), and of the /dev/shm it gives the unit."""

from __future__ import annotations

from gpugate.host.systemd import Setting, UnitSettings

OFF = "off"


def _kept(setting: Setting, why: str) -> str:
    return f"kept the unit's {setting.key}={setting.value} ({setting.path}): {why}"


def kept_lines(unit: UnitSettings, private_shm: str, hook_timeout_s: int) -> list[str]:
    """One line per setting of the unit the drop-in keeps, and what it adds of its own."""
    lines: list[str] = []
    extends = "gpugate asks systemd for more time (EXTEND_TIMEOUT_USEC) only while it works"
    for setting in (unit.start_timeout, unit.stop_timeout):
        if setting is not None:
            lines.append(_kept(setting, extends))
    if unit.start_timeout is None or unit.stop_timeout is None:
        which = [
            name
            for name, setting in (
                ("TimeoutStartSec", unit.start_timeout),
                ("TimeoutStopSec", unit.stop_timeout),
            )
            if setting is None
        ]
        lines.append(f"the unit sets no {' or '.join(which)}: the drop-in sets {hook_timeout_s}s")
    if unit.notify_access is not None:
        if unit.notify_access.value == "all":
            lines.append(_kept(unit.notify_access, "it lets the hooks notify too"))
        else:
            lines.append(
                f"the unit's NotifyAccess={unit.notify_access.value} ({unit.notify_access.path}) "
                "is replaced by NotifyAccess=exec: the hooks must notify systemd"
            )
    if unit.own_shm is not None:
        lines.append(_kept(unit.own_shm, "the unit has a /dev/shm of its own already"))
    elif private_shm == OFF:
        lines.append('private_shm = "off": the unit shares the host\'s /dev/shm')
    else:
        lines.append(
            f"the unit gets a /dev/shm of its own (size={private_shm}; private_shm): "
            "its segments go with its last process"
        )
    return lines
