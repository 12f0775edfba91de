"""A killed application's /dev/shm files go by evidence, never by name: held or mapped by one it
killed, removable by its account, held by no one else, the same inode right before the unlink."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import NamedTuple, Protocol

from gpugate.compat import StrEnum
from gpugate.host.shm import (
    Credentials,
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

    def unlink(self, file: ShmFile, allowed: Callable[[FileFacts], bool]) -> Unlinked: ...

    def spaces(self) -> list[Space]: ...

    def largest(self, count: int) -> list[tuple[ShmKey, FileFacts]]: ...


class Kept(StrEnum):
    """Why a file a killed process held stays (journal: GPUGATE_REASON on shm_kept)."""

    ALSO_HELD = "shm-also-held"  # a process this run did not kill was seen holding it
    PATH_ONLY = "shm-path-only"  # the killed held it only through O_PATH: no evidence
    NOT_THEIRS = "shm-not-theirs"  # no killed holder's account could have removed it
    UNREADABLE = "shm-unreadable"  # the fresh look could not read some process's files
    HELD_NOW = "shm-held-now"  # open or mapped now, after the kill
    GONE = "shm-gone"  # no name is this file any more (removed, or replaced)
    UNLINK_FAILED = "shm-unlink-failed"


class ShmRemoval(NamedTuple):
    """One file of the killed: removed (a dry run: would be), or kept and why."""

    file: ShmFile
    holders: tuple[int, ...]  # the killed PIDs that held it
    facts: FileFacts | None  # size and owner; None where it is gone already
    kept: Kept | None = None  # why it stays; None: removed (or would be)
    kept_by: tuple[str, ...] = ()  # ALSO_HELD, HELD_NOW, UNREADABLE: the processes (labels)
    detail: str = ""  # UNLINK_FAILED: the error's name
    accounts: tuple[Credentials, ...] = ()  # of the killed that held it open or mapped

    @property
    def removed(self) -> bool:
        return self.kept is None and self.facts is not None

    def allowed(self, facts: FileFacts) -> bool:
        return any(could_remove(who, facts) for who in self.accounts)


def _class_bits(who: Credentials, uid: int, gid: int, mode: int) -> int:
    """The rwx bits the kernel applies to WHO: the owner's, else the group's, else others'."""
    if who.uid == uid:
        return (mode >> 6) & 7
    if who.gid == gid or gid in who.groups:
        return (mode >> 3) & 7
    return mode & 7


def could_remove(who: Credentials, facts: FileFacts) -> bool:
    """Could that account have removed the file itself: it may write the file, the folder
    lets it write and search, and in a sticky folder (/dev/shm) it owns the file or folder."""
    if who.privileged:
        return True
    writes = who.uid == facts.uid or bool(_class_bits(who, facts.uid, facts.gid, facts.mode) & 2)
    folder = _class_bits(who, facts.folder_uid, facts.folder_gid, facts.folder_mode)
    if not writes or folder & 3 != 3:
        return False
    sticky = bool(facts.folder_mode & 0o1000)
    return not sticky or who.uid in (facts.uid, facts.folder_uid)


class ShmLedger:
    """Who held which shm file, and how: fed by every discovery of a run."""

    __slots__ = ("files", "holders", "opened")

    def __init__(self) -> None:
        self.files: dict[ShmKey, ShmFile] = {}
        self.holders: dict[ShmKey, set[int]] = {}  # every PID seen holding it
        # the PIDs that held it open for reading or writing, or mapped, with their credentials
        self.opened: dict[ShmKey, dict[int, Credentials | None]] = {}

    def note(self, shm: Mapping[int, Iterable[ShmFile]]) -> None:
        for pid, files in shm.items():
            for key, file in merge(files).items():
                known = self.files.get(key)
                self.files[key] = file if known is None else merge([known, file])[key]
                self.holders.setdefault(key, set()).add(pid)
                if file.opened:
                    seen = self.opened.setdefault(key, {})
                    seen[pid] = seen.get(pid) or file.holder

    def of_the_killed(
        self, killed: Collection[int], label: Callable[[int], str]
    ) -> list[ShmRemoval]:
        """Each file a killed PID held, and why it must stay already."""
        found: list[ShmRemoval] = []
        for key, pids in sorted(self.holders.items()):
            by_killed = tuple(sorted(pids & set(killed)))
            if not by_killed:
                continue
            opened = self.opened.get(key, {})
            accounts = tuple(who for pid in by_killed if (who := opened.get(pid)) is not None)
            others = sorted(pids - set(killed))
            wanted = ShmRemoval(self.files[key], by_killed, None, accounts=accounts)
            if others:
                wanted = wanted._replace(kept=Kept.ALSO_HELD, kept_by=_labels(others, label))
            elif not any(pid in opened for pid in by_killed):
                wanted = wanted._replace(kept=Kept.PATH_ONLY)
            found.append(wanted)
        return found


def _labels(pids: Iterable[int], label: Callable[[int], str]) -> tuple[str, ...]:
    return tuple(label(pid) for pid in sorted(pids)[:3])


def plan(
    ledger: ShmLedger, killed: Collection[int], host: ShmHost, label: Callable[[int], str]
) -> list[ShmRemoval]:
    """A dry run's answer: what would be removed once KILLED (the would-be targets) are gone."""
    results: list[ShmRemoval] = []
    for item in ledger.of_the_killed(killed, label):
        facts = host.facts(item.file)
        kept = item.kept
        if kept is None and facts is not None and not item.allowed(facts):
            kept = Kept.NOT_THEIRS
        results.append(item._replace(facts=facts, kept=kept))
    return results


def remove(
    ledger: ShmLedger, killed: Collection[int], host: ShmHost, label: Callable[[int], str]
) -> list[ShmRemoval]:
    """After the targets are gone: unlink the files of the killed that may go."""
    wanted = ledger.of_the_killed(killed, label)
    if not wanted:
        return []
    fresh = host.holders()  # one fresh look for all of them, right before the unlinks
    results: list[ShmRemoval] = []
    for found in wanted:
        item = found
        if item.kept is None and fresh.unreadable:
            shown = _labels(fresh.unreadable, "PID {}".format)
            item = item._replace(kept=Kept.UNREADABLE, kept_by=shown)
        elif item.kept is None and (now := fresh.by_key.get(item.file.key, ())):
            item = item._replace(kept=Kept.HELD_NOW, kept_by=_labels(now, label))
        if item.kept is not None:
            results.append(item._replace(facts=host.facts(item.file)))
            continue
        done = host.unlink(item.file, item.allowed)
        if done.facts is None:
            results.append(item._replace(kept=Kept.GONE))
        elif done.refused:
            results.append(item._replace(facts=done.facts, kept=Kept.NOT_THEIRS))
        else:
            kept = None if done.error is None else Kept.UNLINK_FAILED
            results.append(item._replace(facts=done.facts, kept=kept, detail=done.error or ""))
    return results


class SpaceShort(NamedTuple):
    """An shm area with less free than the next start needs, and what fills it."""

    space: Space
    free_bytes: int  # after the cleanup (a dry run: as if its removals were done)
    needed_bytes: int
    largest: list[tuple[ShmKey, FileFacts]]


LARGEST_NAMED = 3  # files a short /dev/shm's entry names


def short_of_space(host: ShmHost, needed_bytes: int, freed_bytes: int) -> SpaceShort | None:
    """The first area with less than needed_bytes free (plus what a dry run would have
    removed), with its LARGEST_NAMED largest files; None where every area has room."""
    for space in host.spaces():
        free = space.free_bytes + freed_bytes
        if free < needed_bytes:
            # Across every area: enough that this one's largest are among them.
            found = host.largest(LARGEST_NAMED * 4)
            largest = [item for item in found if item[0].dev == space.area.dev]
            return SpaceShort(space, free, needed_bytes, largest[:LARGEST_NAMED])
    return None
