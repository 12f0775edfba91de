"""Listening TCP sockets on given ports, from /proc/net/tcp and /proc/net/tcp6 (the reading
process's network namespace): socket inode -> port. The fd scan then finds who holds each one."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

TCP_LISTEN = "0A"


def listening_sockets(proc_root: Path, ports: Collection[int]) -> dict[int, int]:
    """Inode -> port of every socket in LISTEN state bound to one of the ports (any address)."""
    found: dict[int, int] = {}
    if not ports:
        return found
    for name in ("tcp", "tcp6"):
        try:
            text = (proc_root / "net" / name).read_text()
        except FileNotFoundError:
            continue  # no IPv6 on this kernel
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            port = int(fields[1].rsplit(":", 1)[1], 16)
            inode = int(fields[9])
            if port in ports and inode:
                found[inode] = port
    return found
