"""The shared memory a killed application leaves behind: which files in /dev/shm go, by evidence.

The rule: a file is removed only if a process this run killed had it open or mapped (seen in the
same pass over /proc that found the holders), no process this run did not kill was seen holding
it (a protected daemon, another unit, a bystander), no process holds it now (a fresh look, after
the targets are gone, right before the unlinks), and its name still is that very file (device
and inode, checked through the folder's fd right before the unlink). Never by name alone, never
a file no killed process held. The host side (reading /proc, stat, unlink) is injected.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from gpugate.host.shm import (
    FileFacts,
    FreshHolders,
    ShmFile,
    ShmKey,
    Space,
    Unlinked,
    merge,
)


class ShmHost(Protocol):
    def holders(self) -> FreshHolders: ...

    def facts(self, file: ShmFile) -> FileFacts | None: ...

    def unlink(self, file: ShmFile) -> Unlinked: ...

    def spaces(self) -> list[Space]: ...

    def largest(self, count: int) -> list[tuple[ShmKey, FileFacts]]: ...


class KeptWhy(Enum):
    """Why a file of the killed stays: GPUGATE_SHM_KEPT; report.narrate_shm words it."""

    ALSO_HELD = "also-held"  # another process, not killed, was seen holding it
    UNREADABLE = "unreadable"  # some process's open files could not be read: it may hold it
    HELD_NOW = "held-now"  # open or mapped by a process at the last look
    GONE = "gone"  # gone already, or another file by that name since
    UNLINK_FAILED = "unlink-failed"  # the unlink failed (detail: the OS's words)


@dataclass(frozen=True)
class Kept:
    why: KeptWhy
    by: tuple[str, ...] = ()  # the processes it concerns, as the run names them (label)
    detail: str = ""


@dataclass(frozen=True)
class ShmRemoval:
    """One file of the killed: removed (or, in a dry run, would be), or kept and why."""

    file: ShmFile
    holders: tuple[int, ...]  # the killed PIDs that held it
    facts: FileFacts | None  # size and owner; None where it is gone already
    kept: Kept | None = None  # why it stays; None: removed (or would be)

    @property
    def removed(self) -> bool:
        return self.kept is None and self.facts is not None


@dataclass
class ShmLedger:
    """What each discovery showed of the shm files: who held which. Fed by every discovery of a
    run (kill rounds, looks during the wait), read once the targets are gone."""

    files: dict[ShmKey, ShmFile] = field(default_factory=dict)
    holders: dict[ShmKey, set[int]] = field(default_factory=dict)  # every PID seen holding it

    def note(self, shm: Mapping[int, Iterable[ShmFile]]) -> None:
        for pid, files in shm.items():
            for key, file in merge(files).items():
                known = self.files.get(key)
                self.files[key] = file if known is None else merge([known, file])[key]
                self.holders.setdefault(key, set()).add(pid)

    def of_the_killed(
        self, killed: Collection[int], label: Callable[[int], str]
    ) -> list[tuple[ShmFile, tuple[int, ...], Kept | None]]:
        """Each file a killed PID held: the file, the killed holders, and why it must stay
        (another process was seen holding it) or None. label names a PID for the reason."""
        found: list[tuple[ShmFile, tuple[int, ...], Kept | None]] = []
        for key, pids in sorted(self.holders.items()):
            by_killed = tuple(sorted(pids & set(killed)))
            if not by_killed:
                continue
            others = sorted(pids - set(killed))
            reason = (
                Kept(KeptWhy.ALSO_HELD, tuple(label(pid) for pid in others)) if others else None
            )
            found.append((self.files[key], by_killed, reason))
        return found


def plan(
    ledger: ShmLedger, killed: Collection[int], host: ShmHost, label: Callable[[int], str]
) -> list[ShmRemoval]:
    """A dry run's answer: what would be removed once KILLED (the would-be targets) are gone."""
    return [
        ShmRemoval(file, holders, host.facts(file), kept)
        for file, holders, kept in ledger.of_the_killed(killed, label)
    ]


def remove(
    ledger: ShmLedger, killed: Collection[int], host: ShmHost, label: Callable[[int], str]
) -> list[ShmRemoval]:
    """After the targets are gone: unlink each file of the killed that nobody else holds."""
    wanted = ledger.of_the_killed(killed, label)
    if not wanted:
        return []
    fresh = host.holders()  # one fresh look for all of them, right before the unlinks
    results: list[ShmRemoval] = []
    for file, holders, seen_with_others in wanted:
        kept = seen_with_others
        if kept is None and fresh.unreadable:
            kept = Kept(KeptWhy.UNREADABLE, tuple(map(str, sorted(fresh.unreadable))))
        if kept is None and (now := sorted(fresh.by_key.get(file.key, ()))):
            kept = Kept(KeptWhy.HELD_NOW, tuple(label(pid) for pid in now))
        if kept is not None:
            results.append(ShmRemoval(file, holders, host.facts(file), kept))
            continue
        unlinked = host.unlink(file)
        if unlinked.facts is None:
            results.append(ShmRemoval(file, holders, None, Kept(KeptWhy.GONE)))
        elif unlinked.error is not None:
            kept = Kept(KeptWhy.UNLINK_FAILED, detail=str(unlinked.error))
            results.append(ShmRemoval(file, holders, unlinked.facts, kept))
        else:
            results.append(ShmRemoval(file, holders, unlinked.facts))
    return results


@dataclass(frozen=True)
class SpaceShort:
    """An shm area with less free than the next start needs, and what fills it."""

    space: Space
    free_bytes: int  # after the cleanup (a dry run: as if its removals were done)
    needed_bytes: int
    largest: list[tuple[ShmKey, FileFacts]]


def short_of_space(
    host: ShmHost, needed_bytes: int, freed_bytes: int = 0, count: int = 3
) -> SpaceShort | None:
    """The first area with less than needed_bytes free (plus freed_bytes: what a dry run would
    have removed), with its COUNT largest files; None where every area has room."""
    for space in host.spaces():
        free = space.free_bytes + freed_bytes
        if free < needed_bytes:
            largest = [item for item in host.largest(count * 4) if item[0].dev == space.area.dev]
            return SpaceShort(space, free, needed_bytes, largest[:count])
    return None
