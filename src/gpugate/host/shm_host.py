"""The real host behind `core.shm_cleanup.ShmHost`: a fresh pass over /proc limited to the shm
files, their facts, unlinks and free space."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpugate.host.scan import scan_device_users
from gpugate.host.shm import (
    FileFacts,
    FreshHolders,
    ShmArea,
    ShmFile,
    ShmKey,
    Space,
    Unlinked,
    facts,
    inode_index,
    largest_files,
    space,
    unlink_if_same,
)


@dataclass
class HostShm:
    """One cleanup's view: the inode index of the areas is read once, when first needed."""

    areas: Sequence[ShmArea]
    proc_root: Path
    _index: dict[ShmKey, list[str]] | None = None

    def index(self) -> dict[ShmKey, list[str]]:
        if self._index is None:
            self._index = inode_index(self.areas)
        return self._index

    def holders(self) -> FreshHolders:
        scan = scan_device_users(self.proc_root, None, shm_areas=self.areas)
        by_key: dict[ShmKey, set[int]] = {}
        for pid, files in scan.shm.items():
            for file in files:
                by_key.setdefault(file.key, set()).add(pid)
        return FreshHolders(by_key, scan.unreadable)

    def facts(self, file: ShmFile) -> FileFacts | None:
        return facts(self.areas, file) or facts(self.areas, file, self.index())

    def unlink(self, file: ShmFile, allowed: Callable[[FileFacts], bool]) -> Unlinked:
        done = unlink_if_same(self.areas, file, allowed=allowed)
        if done.facts is None:
            done = unlink_if_same(self.areas, file, self.index(), allowed)
        return done

    def spaces(self) -> list[Space]:
        return [found for area in self.areas if (found := space(area)) is not None]

    def largest(self, count: int) -> list[tuple[ShmKey, FileFacts]]:
        return largest_files(self.areas, count)
