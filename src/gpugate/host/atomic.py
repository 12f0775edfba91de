"""Files replaced whole: written beside the target, flushed to disk, then renamed over it, so a
reader (systemd, node_exporter, the next gpugate run) sees the old file or the new one, never
half of one, also after a crash or a power cut.

Everything is done relative to the folder's descriptor (host/safe_files.py): the temporary is
made with O_EXCL|O_NOFOLLOW under a name of its own, its mode set with fchmod on the
descriptor, and it is renamed into place; a symbolic link another account planted in the folder
is never followed, so root never creates, writes or chmods the link's target."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from gpugate.host.safe_files import folder


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    with folder(path.parent) as folder_fd:
        write_in(folder_fd, path.name, text.encode("utf-8"), mode)


def write_in(folder_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Replace name in the folder (a descriptor from safe_files.open_folder) with data."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    temporary = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(temporary, flags, 0o600, dir_fd=folder_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(temporary, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder_fd)
        raise
    # The rename itself is on disk only once the folder is.
    with contextlib.suppress(OSError):
        os.fsync(folder_fd)
