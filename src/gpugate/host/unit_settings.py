"""What a unit sets itself, for `gpugate install`: its timeouts, NotifyAccess= and a /dev/shm
of its own, read from its files without gpugate's own drop-in, so that the drop-in adds only
what the unit leaves unset.

The text read is what `systemctl cat UNIT` shows (each file after a `# PATH` line, in the order
systemd applies them); where systemd does not run or answer, the same text is made from the
unit folders. Not `systemctl show`: its effective values cannot tell a unit's own
`TimeoutStopSec=90` from systemd's default, and include gpugate's last drop-in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpugate.errors import GateError
from gpugate.host.safe_files import find_program, run_program
from gpugate.host.systemd import systemd_running

CAT_TIMEOUT_S = 30
# Where systemd looks for system units, highest priority first (systemd.unit(5)).
UNIT_DIRS = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/run/systemd/transient",
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
)
OWN_DROPIN = "gpugate.conf"
DEV_SHM = "/dev/shm"


@dataclass(frozen=True)
class Setting:
    key: str
    value: str
    path: str


@dataclass(frozen=True)
class UnitSettings:
    """The [Service] assignments of the unit that gpugate's drop-in would otherwise set."""

    start_timeout: Setting | None = None  # TimeoutStartSec= or TimeoutSec=
    stop_timeout: Setting | None = None  # TimeoutStopSec= or TimeoutSec=
    notify_access: Setting | None = None
    own_shm: Setting | None = None  # a TemporaryFileSystem= entry on /dev/shm
    read_from: tuple[str, ...] = field(default=())  # the files read


def parse(text: str, own_dropin: str = OWN_DROPIN) -> UnitSettings:
    """The settings in `systemctl cat` text. Later assignments win, an empty one resets;
    gpugate's own drop-in (own_dropin in a `.d` folder) is left out."""
    start: Setting | None = None
    stop: Setting | None = None
    notify: Setting | None = None
    shm: Setting | None = None
    files: list[str] = []
    for path, key, value in _assignments(text, own_dropin, files):
        found = Setting(key, value, path) if value else None
        if key in ("TimeoutStartSec", "TimeoutSec"):
            start = found
        if key in ("TimeoutStopSec", "TimeoutSec"):
            stop = found
        if key == "NotifyAccess":
            notify = found
        if key == "TemporaryFileSystem":
            shm = _shm_entry(value, path, shm)
    return UnitSettings(start, stop, notify, shm, tuple(files))


def _shm_entry(value: str, path: str, before: Setting | None) -> Setting | None:
    """TemporaryFileSystem= is a list: an empty assignment clears it, others add to it."""
    if not value:
        return None
    for entry in value.split():
        point = entry.split(":", 1)[0].lstrip("-")
        if os.path.normpath(point) == DEV_SHM:
            return Setting("TemporaryFileSystem", entry, path)
    return before


def _assignments(text: str, own_dropin: str, files: list[str]) -> list[tuple[str, str, str]]:
    """(file, key, value) of each [Service] assignment, continuation lines joined."""
    found: list[tuple[str, str, str]] = []
    path, section, skip, pending, previous = "", "", False, "", ""
    for raw in text.splitlines():
        header = raw.startswith("# /") and " " not in raw[2:] and not previous.strip()
        previous = raw
        if header and not pending:  # systemctl cat's file header: after a blank line
            path, section = raw[2:].strip(), ""
            skip = os.path.basename(path) == own_dropin and path.rsplit("/", 2)[-2].endswith(".d")
            if not skip:
                files.append(path)
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if skip or not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service" and "=" in line:
            key, _, value = line.partition("=")
            found.append((path, key.strip(), value.strip()))
    return found


def read_unit(unit: str, systemd_dir: Path, *, ask_systemd: bool) -> str:
    """The unit's files as `systemctl cat` shows them: systemd's answer where it runs, else
    the files in every unit folder; without ask_systemd, the files in systemd_dir only."""
    if not ask_systemd:
        return files_text(unit, [str(systemd_dir)])
    if systemd_running():
        answer = _systemctl_cat(unit)
        if answer is not None:
            return answer
    return files_text(unit, UNIT_DIRS)


def _systemctl_cat(unit: str) -> str | None:
    systemctl = find_program("systemctl")
    if systemctl is None:
        return None
    try:
        result = run_program([systemctl, "cat", "--no-pager", "--", unit], CAT_TIMEOUT_S)
    except GateError:
        return None
    return result.stdout if result.returncode == 0 else None


def files_text(unit: str, dirs: Sequence[str]) -> str:
    """`systemctl cat` made by hand: the first unit file found (else an instance's
    template's), then the drop-ins of UNIT.d/ and the template's, by file name, a name in an
    earlier folder hiding the same name in later ones."""
    names = [unit]
    if "@" in unit and not unit.endswith("@.service"):
        names.append(unit.split("@", 1)[0] + "@.service")
    chunks: list[str] = []
    main = next(
        (f"{d}/{n}" for n in names for d in dirs if os.path.isfile(f"{d}/{n}")),
        None,
    )
    if main is not None:
        chunks.append(_chunk(main))
    dropins: dict[str, str] = {}
    for name in reversed(names):  # the template's drop-ins apply before the instance's
        for folder in dirs:
            for path in sorted(Path(folder, name + ".d").glob("*.conf")):
                dropins.setdefault(f"{name}/{path.name}", str(path))
    ordered = sorted(dropins.items(), key=lambda item: item[0].rsplit("/", 1)[1])
    chunks.extend(_chunk(path) for _, path in ordered)
    return "".join(chunks)


def _chunk(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return f"# {path}\n{text}\n"
