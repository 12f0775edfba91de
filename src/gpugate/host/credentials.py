"""A process's credentials as /proc/PID/status shows them: real uid and gid, supplementary
groups, and whether it runs as root with the capabilities that pass over file modes.

What gpugate removes for a killed process it removes only where that process's account could
have done so itself (core.shm_cleanup): these are the facts that rule is decided on.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpugate.host.safe_files import read_at

CAP_DAC_OVERRIDE = 1
CAP_FOWNER = 3
O_PATH = 0o10000000  # fdinfo's `flags:` are octal; an O_PATH fd needs no permission on the file


@dataclass(frozen=True)
class Credentials:
    uid: int  # real
    gid: int  # real
    groups: frozenset[int]
    # real uid 0 with CAP_DAC_OVERRIDE and CAP_FOWNER in effect: the kernel lets it write and
    # unlink any file; root whose capabilities were dropped is judged by the modes like others
    privileged: bool = False


def parse_status(text: str) -> Credentials | None:
    """Uid:, Gid:, Groups: and CapEff: of /proc/PID/status; None where a line is missing or
    malformed (a process that is exiting, a stand-in file)."""
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("Uid", "Gid", "Groups", "CapEff"):
            fields[key] = value.split()
    try:
        uid, gid = int(fields["Uid"][0]), int(fields["Gid"][0])
        groups = frozenset(int(group) for group in fields.get("Groups", []))
        caps = int(fields["CapEff"][0], 16) if fields.get("CapEff") else 0
    except (KeyError, IndexError, ValueError):
        return None
    needed = (1 << CAP_DAC_OVERRIDE) | (1 << CAP_FOWNER)
    return Credentials(uid, gid, groups, privileged=uid == 0 and caps & needed == needed)


def read_credentials(proc_fd: int, pid_name: str) -> Credentials | None:
    try:
        return parse_status(
            read_at(proc_fd, f"{pid_name}/status", 16384).decode("ascii", "replace")
        )
    except OSError:
        return None


def fd_opens_file(fdinfo: str) -> bool:
    """An fd that opened the file for reading or writing: not O_PATH (which any account may
    take on any file it can name). False where the flags cannot be read: no evidence."""
    for line in fdinfo.splitlines():
        key, _, value = line.partition(":")
        if key == "flags":
            try:
                return not int(value.strip(), 8) & O_PATH
            except ValueError:
                return False
    return False
