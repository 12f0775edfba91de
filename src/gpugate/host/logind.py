"""logind's sessions: which login session a process's cgroup is in (its session-N.scope under
user.slice, where PID 1 put it) and whether that session is still open, from logind's own
state file, /run/systemd/sessions/N (systemd's src/login/logind-session.c, session_save():
`STATE=online|active|closing`, `ACTIVE=0|1`)."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from gpugate.compat import StrEnum
from gpugate.host.safe_files import read_capped

SESSIONS_DIR = Path("/run/systemd/sessions")
MAX_SESSION_FILE = 1 << 14  # a few hundred bytes: UID=, USER=, STATE=, SCOPE=, ...
# pam_systemd's sessions: /user.slice/user-UID.slice/session-ID.scope (IDs: [a-zA-Z0-9]+,
# logind's session_id_valid); a user's own units live under user@UID.service, never here.
SESSION_SCOPE = re.compile(r"/user\.slice/user-[0-9]+\.slice/session-([A-Za-z0-9]{1,64})\.scope")


def session_of_cgroup(cgroup: str | None) -> str | None:
    """The logind session ID whose scope holds this cgroup (or one below it), else None."""
    match = SESSION_SCOPE.fullmatch("/".join((cgroup or "").split("/")[:4]))
    return match.group(1) if match else None


class SessionState(StrEnum):
    OPEN = "open"  # STATE=active or online: its user is logged in
    CLOSED = "closed"  # STATE=closing (logged out, its scope left behind), or no file: gone
    UNKNOWN = "unknown"  # a file root did not write, too large, unreadable or unparsable


STATES = {"active": SessionState.OPEN, "online": SessionState.OPEN, "closing": SessionState.CLOSED}


class Logind:
    """Session states, each read once per instance (one sweep, one status)."""

    __slots__ = ("_known", "folder")

    def __init__(self, folder: Path = SESSIONS_DIR) -> None:
        self.folder = folder
        self._known: dict[str, SessionState] = {}

    def state(self, session: str) -> SessionState:
        if session not in self._known:
            self._known[session] = self._read(session)
        return self._known[session]

    def _read(self, session: str) -> SessionState:
        try:  # no logind here, or its folder unreadable: nothing said either way
            folder_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return SessionState.UNKNOWN
        try:
            _root_only(os.fstat(folder_fd))
            data = read_capped(session, MAX_SESSION_FILE, dir_fd=folder_fd, check=_root_only)
        except OSError as exc:
            return SessionState.CLOSED if exc.errno == errno.ENOENT else SessionState.UNKNOWN
        finally:
            os.close(folder_fd)
        lines = data.decode("utf-8", errors="replace").splitlines()
        values = dict(line.partition("=")[::2] for line in lines if "=" in line)
        return STATES.get(values.get("STATE", ""), SessionState.UNKNOWN)


def _root_only(info: os.stat_result) -> None:
    """Owned by root and writable by no one else (logind's files are 0644 root), else EPERM."""
    if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(errno.EPERM, "not root's alone")
