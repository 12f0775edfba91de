"""Respawners: processes whose killed children keep coming back.

A respawner is a process, not taken itself (the application rule left it out: a login shell
running a `while true` loop, a supervisor, a user manager), whose child was killed as a holder
and which starts another holder in its place. The wait (`wait.wait_settled`) looks again while
such a parent is watched; each new target below it counts as one respawn.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from gpugate.core.decide import Choice
from gpugate.core.roles import ProcessTree
from gpugate.host.procfs import ProcessId, ProcInfo

MAX_ANCESTRY = 16


@dataclass
class Watched:
    """A parent of a killed target, left alive."""

    info: ProcInfo
    executables: set[str] = field(default_factory=set)  # of its killed children
    newest_killed_start: int = 0  # start time of its newest killed child
    respawns: int = 0


@dataclass(frozen=True)
class Respawner:
    info: ProcInfo
    respawns: int


class RespawnWatch:
    """The parents of this run's targets that were not targets themselves."""

    def __init__(self) -> None:
        self.watched: dict[ProcessId, Watched] = {}

    def killed(
        self,
        choices: Iterable[Choice],
        taken: Collection[ProcessId],
        tree: ProcessTree,
        *,
        self_chain: Collection[int],
    ) -> None:
        """After a kill round (or the first ones): count respawns, then watch the parents
        (never gpugate or its ancestors: self_chain)."""
        choices = list(choices)
        counted: set[ProcessId] = set()
        for choice in choices:
            parent = self._watched_ancestor(choice.holder.info, tree)
            if parent is not None and parent.info.ident not in counted:
                counted.add(parent.info.ident)
                parent.respawns += 1
        for choice in choices:
            info = choice.holder.info
            parent_info = tree.info(info.ppid)
            if (
                parent_info is None
                or parent_info.pid <= 1
                or parent_info.pid in self_chain
                or parent_info.ident in taken
            ):
                continue
            watched = self.watched.setdefault(parent_info.ident, Watched(parent_info))
            if info.exe:
                watched.executables.add(info.exe)
            watched.newest_killed_start = max(watched.newest_killed_start, info.start_time)

    def _watched_ancestor(self, info: ProcInfo, tree: ProcessTree) -> Watched | None:
        current: ProcInfo | None = info
        for _ in range(MAX_ANCESTRY):
            if current is None or current.pid <= 1:
                return None
            parent = tree.info(current.ppid)
            if parent is None:
                return None
            watched = self.watched.get(parent.ident)
            if watched is not None and info.start_time > watched.newest_killed_start:
                return watched
            current = parent
        return None

    def pending(self, tree: ProcessTree) -> list[int]:
        """New children of watched parents running a killed child's executable: a respawn
        under way that holds nothing yet."""
        found: list[int] = []
        for watched in self.watched.values():
            for child_pid in tree.children(watched.info.pid):
                child = tree.info(child_pid)
                if (
                    child is not None
                    and child.state not in ("Z", "X")
                    and child.start_time > watched.newest_killed_start
                    # the killed child's program again, or a fork not yet exec'd
                    and (child.exe in watched.executables or child.exe == watched.info.exe)
                ):
                    found.append(child_pid)
        return found

    def respawners(self, alive: Callable[[ProcessId], bool]) -> list[Respawner]:
        return [
            Respawner(w.info, w.respawns)
            for w in self.watched.values()
            if w.respawns and alive(w.info.ident)
        ]
