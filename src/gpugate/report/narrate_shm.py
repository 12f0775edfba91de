"""What a run says about the shared memory its targets left: each file removed (or, in a dry
run, that would be) with its size, each file of theirs kept and why, and /dev/shm too full for
the next start. `narrate.Narrator` says the rest of the run."""

from __future__ import annotations

import pwd
from collections.abc import Callable, Mapping
from typing import Any

from gpugate.core.shm_cleanup import Kept, ShmRemoval, SpaceShort
from gpugate.errors import ExitCode
from gpugate.host.shm import FileFacts, ShmKey
from gpugate.report.journal import PRIORITY_ERR, PRIORITY_INFO, PRIORITY_NOTICE, Event, Reporter
from gpugate.untrusted import FILE, exact, shown

MIB = 1024 * 1024


def size_text(count: int, *, column: bool = False) -> str:
    """Bytes for a person: 812 B, 4.0 KiB, 1.5 MiB, 3.2 GiB; column (status's narrow one):
    -, 812B, 4.0K, 1.5M, 3.2G."""
    if column and count == 0:
        return "-"
    units = ("B", "K", "M", "G") if column else ("B", "KiB", "MiB", "GiB")
    gap = "" if column else " "
    value = float(count)
    for unit in units:
        if value < 1024 or unit == units[-1]:
            return f"{count}{gap}B" if unit == "B" else f"{value:.1f}{gap}{unit}"
        value /= 1024
    return f"{count}{gap}B"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def quoted(path: str) -> str:
    """A file's name between quotes, shown (any account may name a file in /dev/shm)."""
    return f"'{shown(path, FILE)}'"


def pids_text(pids: tuple[int, ...]) -> str:
    return ", ".join(map(str, pids))


def kept_text(item: ShmRemoval) -> str:
    """Why a file of the killed stays, in words (its code is GPUGATE_REASON)."""
    by = ", ".join(item.kept_by)
    owner = (
        f" (owner {user_name(item.facts.uid)}, mode {item.facts.mode:04o})" if item.facts else ""
    )
    words = {
        Kept.ALSO_HELD: f"also held by {by}, not killed",
        Kept.PATH_ONLY: "the killed held it only through an O_PATH descriptor, which any "
        "account may take on any file it can name: no evidence it was theirs",
        Kept.NOT_THEIRS: f"no killed holder's account could have removed it itself{owner}",
        Kept.UNREADABLE: f"the open files of {by} could not be read: it may hold it",
        Kept.HELD_NOW: f"open or mapped now by {by}",
        Kept.GONE: "gone already, or replaced since",
        Kept.UNLINK_FAILED: f"unlink: {item.detail}",
    }
    return words.get(item.kept, "") if item.kept is not None else ""


class ShmNarration:
    """The shm entries; `Narrator` is one."""

    reporter: Reporter
    dry_run: bool

    def shm_files(self, removals: list[ShmRemoval]) -> None:
        for item in removals:
            if item.removed and item.facts is not None:
                self._removed(item, item.facts)
            else:
                self._kept(item)

    def _killed(self, pids: tuple[int, ...]) -> str:
        if self.dry_run:
            return f"PID {pids_text(pids)}, which would be killed"
        return f"killed PID {pids_text(pids)}"

    def _removed(self, item: ShmRemoval, facts: FileFacts) -> None:
        verb = "would remove" if self.dry_run else "removed"
        self.reporter.event(
            Event.SHM_REMOVED,
            f"{verb} {quoted(facts.path)} ({size_text(facts.bytes)}, owner "
            f"{user_name(facts.uid)}): shared memory of {self._killed(item.holders)}",
            priority=PRIORITY_NOTICE,
            shm_path=exact(facts.path, FILE),
            shm_bytes=facts.bytes,
            shm_size=facts.size,
            shm_holders=pids_text(item.holders),
        )

    def _kept(self, item: ShmRemoval) -> None:
        path = item.facts.path if item.facts else item.file.path
        verb = "would keep" if self.dry_run else "kept"
        sized: dict[str, Any] = {} if item.facts is None else {"shm_bytes": item.facts.bytes}
        why = kept_text(item)
        self.reporter.event(
            Event.SHM_KEPT,
            f"{verb} {quoted(path)}, shared memory of killed PID {pids_text(item.holders)}: {why}",
            priority=PRIORITY_INFO,
            shm_path=exact(path, FILE),
            shm_holders=pids_text(item.holders),
            shm_kept=why,
            reason=str(item.kept or ""),
            **sized,
        )

    def shm_short(
        self,
        short: SpaceShort,
        holders: Mapping[ShmKey, list[int]],
        label: Callable[[int], str],
    ) -> None:
        """holders: PIDs holding each of the largest files."""
        parts = []
        for key, facts in short.largest:
            held = holders.get(key, [])
            by = ", ".join(label(pid) for pid in held[:2]) if held else "no process"
            parts.append(
                f"{quoted(facts.path)} {size_text(facts.bytes)} (owner {user_name(facts.uid)}, "
                f"held by {by})"
            )
        largest = "; largest: " + "; ".join(parts) if parts else ""
        would = "would have" if self.dry_run else "has"
        self.reporter.event(
            Event.ERROR,
            f"{short.space.area.path} {would} {size_text(short.free_bytes)} free after the "
            f"cleanup, less than shm_min_free_mib = {short.needed_bytes // MIB}{largest}",
            priority=PRIORITY_ERR,
            exit_code=int(ExitCode.SHM_SPACE),
            shm_path=short.space.area.path,
            shm_free_bytes=short.free_bytes,
            shm_needed_bytes=short.needed_bytes,
        )
        self.reporter.status(f"{short.space.area.path} short of free space")
