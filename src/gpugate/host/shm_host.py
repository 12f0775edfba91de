"""The real host behind `core.shm_cleanup.ShmHost`: a fresh pass over /proc limited to the shm
files, their facts, unlinks and free space."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpugate.core.shm_cleanup import FreshHolders
from gpugate.host.scan import scan_device_users
from gpugate.host.shm import (
    FileFacts,
    ShmArea,
    ShmFile,
    ShmKey,
    Space,
    Unlinked,
    facts,
    largest_files,
    space,
    unlink_if_same,
)


@dataclass(frozen=True)
class HostShm:
    areas: Sequence[ShmArea]
    proc_root: Path

    def holders(self) -> FreshHolders:
        scan = scan_device_users(self.proc_root, None, shm_areas=self.areas)
        by_key: dict[ShmKey, set[int]] = {}
        for pid, files in scan.shm.items():
            for file in files:
                by_key.setdefault(file.key, set()).add(pid)
        return FreshHolders(by_key, scan.unreadable)

    def facts(self, file: ShmFile) -> FileFacts | None:
        return facts(self.areas, file)

    def unlink(self, file: ShmFile) -> Unlinked:
        return unlink_if_same(self.areas, file)

    def spaces(self) -> list[Space]:
        return [found for area in self.areas if (found := space(area)) is not None]

    def largest(self, count: int) -> list[tuple[ShmKey, FileFacts]]:
        return largest_files(self.areas, count)
