"""The words for what root will not read or follow (docs/hardening.md, rule 2): a config file
or state folder another account may change, a path that is not a regular file, the metrics
folder of another account, a unit environment that steers root's hooks (rule 6)."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Sequence
from pathlib import Path

from gpugate.host.safe_files import Exposure, NotRegularFile, TooLarge, Untrusted

RULE = "docs/hardening.md, rule 2"
KINDS = {
    "fifo": "a FIFO",
    "socket": "a socket",
    "character-device": "a character device",
    "block-device": "a block device",
    "folder": "a folder",
    "symlink": "a symbolic link",
}


def account(uid: int | None) -> str:
    """An account as operators read it: `alice (uid 1000)`."""
    if uid is None:
        return "an account gpugate could not read"
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def facts(found: Untrusted) -> str:
    """`owner alice (uid 1000), mode 0644`: the component's owner and mode."""
    return f"owner {account(found.uid)}, mode {stat.S_IMODE(found.mode):04o}"


def why(found: Untrusted) -> str:
    what = "folder " if stat.S_ISDIR(found.mode) else ""
    where = "it" if found.path == found.of else f"its {what}{found.path}"
    problem = {
        Exposure.OWNER: f"{where} belongs to another account",
        Exposure.GROUP_WRITABLE: f"{where} is writable by group {group(found.gid)}",
        Exposure.WORLD_WRITABLE: f"{where} is writable by every account",
    }[found.problem]
    if found.path != found.of:
        problem += f" ({facts(found)})"
    return problem


def trusted_accounts() -> str:
    euid = os.geteuid()
    return "root" if euid == 0 else f"root or {account(euid)}"


def untrusted_text(found: Untrusted, *, state: bool = False) -> str:
    """A path another account may change, refused: a config file (after `PATH: `), or
    gpugate's own state folder, lock_dir (after `lock_dir: `; state)."""
    mine = f" ({facts(found)})" if found.path == found.of else ""
    accounts = trusted_accounts()
    if state:
        where = f"{found.of}: "
        rule = (
            f"gpugate's state folder and the folders above it must belong to {accounts} and "
            "be writable by no group or other account"
        )
    else:
        where = ""
        rule = (
            "gpugate reads only a config file that it and every folder above it belong to "
            f"{accounts} and no group or other account may write"
        )
    return f"{where}refused: {why(found)}{mine}; {rule} ({RULE}); nothing was done"


def unreadable(exc: OSError) -> str:
    """A config path that is not a regular file or is absurdly large: not read."""
    if isinstance(exc, NotRegularFile):
        return f"refused: {KINDS.get(exc.kind, exc.kind)}, not a regular file; not read"
    if isinstance(exc, TooLarge):
        return f"refused: {exc.size} bytes, more than a config file ({exc.limit}); not read"
    return exc.strerror or str(exc)


def metrics_folder_warning(textfile: Path, found: Untrusted) -> str:
    return (
        f"warning: metrics_textfile {textfile}: {why(found)}: gpugate writes there only "
        "through the folder's descriptor, never following a link and replacing files by "
        f"rename ({RULE})"
    )


def environment_warnings(unit: str, names: Sequence[tuple[str, str]]) -> list[str]:
    """One line per variable of the unit's Environment= (where: "Environment=" or the
    EnvironmentFile=) that changes what root's hooks load (docs/hardening.md, rule 6)."""
    return [
        f"warning: {unit}: {where} sets {name}: gpugate's hooks run as root with the unit's "
        f"environment, and {name} chooses code they load (docs/hardening.md, rule 6); set it "
        "in the server's own ExecStart= (env NAME=... COMMAND) instead"
        for name, where in names
    ]
