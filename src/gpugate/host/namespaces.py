"""Is this process the host's root? A rootless runtime (podman run by alice, rootless docker)
runs its hooks and its runtime wrapper as uid 0 *inside the user namespace it made*: euid is 0
there, but that root owns nothing of the host's (its uid 0 is alice's uid outside), so the
euid alone cannot tell. The kernel can: the initial user namespace, and only it in practice,
maps every uid onto itself, `/proc/self/uid_map` reading exactly `0 0 4294967295`; a user
namespace made by a user maps a small range (`0 1000 1`, `1 100000 65536`). Where root made a
namespace with the full identity map, it is still not the initial one: where both can be read,
`/proc/self/ns/user` differing from PID 1's says so. Standard library only: the OCI hook's
fast path imports this (front/oci_entry.py)."""

from __future__ import annotations

import os

INITIAL_UID_MAP = ("0", "0", "4294967295")
MAX_UID_MAP = 4096  # the kernel allows 340 lines of at most 36 bytes; a few are plenty to say


def not_host_root(proc: str = "/proc") -> str | None:
    """None where this process is the host's root; else why not, in a few words of its own
    (`euid 1000`, `user namespace, uid_map 0 1000 1`). A uid_map that cannot be read (no /proc)
    leaves the euid to decide; a PID 1 whose namespace cannot be read (not ptrace-able from
    here) leaves the uid_map to decide."""
    euid = os.geteuid()
    if euid != 0:
        return f"euid {euid}"
    try:
        with open(f"{proc}/self/uid_map", encoding="ascii", errors="replace") as stream:
            fields = stream.read(MAX_UID_MAP).split()
    except OSError:
        return None
    if tuple(fields) != INITIAL_UID_MAP:
        return "user namespace, uid_map " + " ".join(fields[:6])
    try:
        mine, init = os.stat(f"{proc}/self/ns/user"), os.stat(f"{proc}/1/ns/user")
    except OSError:
        return None
    if (mine.st_dev, mine.st_ino) != (init.st_dev, init.st_ino):
        return "user namespace other than PID 1's"
    return None
