"""`[sweep] drain_after_s`, where slurmd runs: drain the node (never resume it) once a GPU
holds memory of a process nobody has owned that long, or once a reap left a holder SIGKILL
cannot end (D state). Through scontrol at its fixed path, with a deadline
(integrations/slurm.set_drain_reason, as the epilog's drain); once for each holder (the sweep
state's `drained`), not once a minute, so an operator's own reason is not overwritten."""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TextIO

from gpugate.core.owners import Holding, Owner
from gpugate.host.procfs import ProcessId, ProcFs
from gpugate.integrations.records import RUNNING_STATES, Seen, locked_state, write_state
from gpugate.integrations.slurm import set_drain_reason
from gpugate.report import lines

SLURMD_UNIT = "slurmd.service"


def slurmd_runs(unit_state: Callable[[str], str | None]) -> bool:
    return unit_state(SLURMD_UNIT) in RUNNING_STATES


def node_name() -> str:
    """slurmd's own default NodeName: the short host name."""
    return socket.gethostname().split(".")[0]


def due(
    holdings: Sequence[Holding], seen: Mapping[ProcessId, Seen], now: float, after_s: float
) -> dict[ProcessId, Seen]:
    """Unowned holders NVML lists on a GPU, unowned at least after_s, not drained for yet."""
    listed = {
        h.holder.info.ident for h in holdings if h.owner is Owner.NOBODY and h.holder.used_mib
    }
    return {
        ident: entry
        for ident, entry in seen.items()
        if ident in listed and not entry.drained and now - entry.since >= after_s
    }


def drain_unowned(found: Mapping[ProcessId, Seen], now: float, stream: TextIO) -> None:
    gpus = sorted({gpu for entry in found.values() for gpu in entry.gpus})
    pids = sorted(ident.pid for ident in found)
    oldest = max(now - entry.since for entry in found.values())
    set_drain_reason(node_name(), lines.sweep_drain_reason(gpus, pids, oldest), stream)


def still_alive(holdings: Sequence[Holding], gpus: Collection[int], proc: Path) -> list[int]:
    """The unowned holders of gpus that are still the processes they were."""
    procfs = ProcFs(proc)
    alive = []
    for holding in holdings:
        info = holding.holder.info
        if holding.owner is Owner.NOBODY and holding.holder.using & set(gpus):
            now = procfs.info(info.pid)
            if now is not None and now.start_time == info.start_time:
                alive.append(info.pid)
    return alive


def drain_unkillable(gpus: Sequence[int], pids: Sequence[int], stream: TextIO) -> None:
    set_drain_reason(node_name(), lines.sweep_unkillable_reason(gpus, pids), stream)


def mark_drained(lock_dir: Path, idents: Collection[ProcessId]) -> None:
    """OSError where the state cannot be kept (then the next sweep drains again)."""
    with locked_state(lock_dir) as (folder_fd, state):
        marked = {
            ident: Seen(entry.since, entry.gpus, entry.drained or ident in idents)
            for ident, entry in state.unowned.items()
        }
        write_state(folder_fd, marked)
