"""`gpugate sweep`: between starts, sort every GPU holder by its owner, tell what nobody owns
(journal, metrics, STATUS=), reap it with pre's rules after `[sweep] reap_after_s`, and drain
a Slurm node after `drain_after_s` (once per holder)."""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

from gpugate.config.file import LoadedConfig, replaced
from gpugate.core.discover import Discovery
from gpugate.core.outcome import PlainWorkload
from gpugate.core.roles import OWNERS, HolderOwner, Owner, holds_memory, owner_of
from gpugate.core.run import RunScope
from gpugate.errors import ExitCode, GateError
from gpugate.front.hook import Hook, HostAccess, collect, run_hook, set_drain_reason
from gpugate.host.logind import Logind
from gpugate.host.nvml import Gpu
from gpugate.host.scan import ProcessId, ProcFs
from gpugate.integrations.config_files import CACHE_NAME, load_config
from gpugate.integrations.metrics import Labels, Samples, record_sweep
from gpugate.integrations.records import (
    RUNNING_STATES,
    STATE_NAME,
    Seen,
    boot_time,
    locked_state,
    read_leases,
    write_state,
)
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from gpugate.report.lines import (
    sweep_state_refused,
    sweep_state_unwritten,
    sweep_status,
    unowned_gone,
    unowned_seen,
)
from gpugate.report.narrate import Narrator

SLURMD_UNIT = "slurmd.service"
SWEEP_UNIT = "gpugate-sweep.service"  # the journal's GPUGATE_UNIT, OBJECT_SYSTEMD_UNIT
SWEEP_CGROUP = "/gpugate-sweep-no-unit"  # the reap's "unit cgroup": none, nothing is in it
UNLISTED = "unlisted"  # memory NVML lists no process for (a dead PID's, a MIG slice's)


def tracked(config_reap_sessions: bool) -> frozenset[Owner]:
    """The owners whose holders the sweep times and may reap: nobody's, and an attended
    session's where `[sweep] reap_sessions` says so."""
    return frozenset({Owner.NOBODY, Owner.SESSION} if config_reap_sessions else {Owner.NOBODY})


def remember(
    holdings: Sequence[HolderOwner],
    earlier: Mapping[ProcessId, Seen],
    now: float,
    reporter: Reporter | None,
    kinds: Collection[Owner] = (Owner.NOBODY,),
) -> dict[ProcessId, Seen]:
    """The unowned holders now (owners in kinds), each with since when (boot time); says who is
    new and who is gone. A since after now was counted on another boot: new again."""
    seen: dict[ProcessId, Seen] = {}
    for holding in holdings:
        if holding.owner not in kinds:
            continue
        ident, gpus = holding.holder.info.ident, tuple(sorted(holding.holder.using))
        before = earlier.get(ident)
        before = None if before is None or before.since > now else before  # another boot's
        if before is None and reporter is not None:
            unowned_seen(reporter, holding.holder, holding.mib)
        seen[ident] = Seen(now, gpus) if before is None else before._replace(gpus=gpus)
    for ident, before in sorted(earlier.items(), key=lambda item: item[0].pid):
        if ident not in seen and reporter is not None:
            unowned_gone(reporter, ident, before.gpus, max(now - before.since, 0.0))
    return seen


def gauges(
    discovery: Discovery,
    holdings: Sequence[HolderOwner],
    seen: Mapping[ProcessId, Seen],
    now: float,
    *,
    wall: float | None = None,
    kinds: Collection[Owner] = (Owner.NOBODY,),
) -> Samples:
    """now: boot time, what the state's sinces count in; wall: Unix time, the timestamp (None:
    now, where one clock stands for both)."""
    memory: dict[Labels, float] = {}
    counts: dict[Labels, float] = {}
    sessions: dict[Labels, float] = {}
    ages: dict[Labels, float] = {}
    for gpu in discovery.gpus:
        by_owner = {str(owner): 0 for owner in OWNERS}
        for holding in holdings:
            by_owner[str(holding.owner)] += holding.holder.used_mib.get(gpu.index) or 0
        usage = discovery.usage.get(gpu.index)
        listed = sum(p.used_mib or 0 for p in usage.processes) if usage else 0
        by_owner[UNLISTED] = max((usage.used_mib if usage else 0) - listed, 0)
        for owner, mib in by_owner.items():
            memory[(("gpu", str(gpu.index)), ("owner", owner), ("uuid", gpu.uuid))] = mib
        on = [h for h in holdings if gpu.index in h.holder.using]
        unowned = [h for h in on if h.owner in kinds]
        key = (("gpu", str(gpu.index)),)
        counts[key] = len(unowned)
        sessions[key] = sum(1 for h in on if h.owner is Owner.SESSION)
        sinces = [seen[h.holder.info.ident].since for h in unowned if h.holder.info.ident in seen]
        ages[key] = max(now - min(sinces), 0.0) if sinces else 0
    return {
        "gpugate_gpu_memory_mib": memory,
        "gpugate_unowned_processes": counts,
        "gpugate_unowned_seconds": ages,
        "gpugate_session_processes": sessions,
        "gpugate_sweep_timestamp_seconds": {(): now if wall is None else wall},
    }


def live_leased(loaded: LoadedConfig, unit_state: Callable[[str], str | None]) -> set[str]:
    """UUIDs (lower case) a lease holds whose unit is running (or whose state is unknown)."""
    leases = read_leases(loaded.config.lock_dir).leases
    running = [lease for lease in leases if unit_state(lease.unit) in (None, *RUNNING_STATES)]
    return {uuid.lower() for lease in running for uuid in lease.uuids}


def reapable(
    discovery: Discovery,
    holdings: Sequence[HolderOwner],
    seen: Mapping[ProcessId, Seen],
    now: float,
    *,
    after_s: float,
    leased: set[str],
    kinds: Collection[Owner] = (Owner.NOBODY,),
) -> list[Gpu]:
    """The GPUs whose unowned holders (owners in kinds) have all been so after_s and all show
    memory there (holds_memory): never one a unit, job, container or (not in kinds) an
    attended session holds, nor a leased one, nor one only holders without memory hold."""
    keep_off = {Owner.UNIT, Owner.JOB, Owner.CONTAINER, Owner.SESSION} - set(kinds)
    found = []
    for gpu in discovery.gpus:
        on = [h for h in holdings if gpu.index in h.holder.using]
        unowned = [h for h in on if h.owner in kinds]
        if not unowned or gpu.uuid.lower() in leased or any(h.owner in keep_off for h in on):
            continue
        if not all(holds_memory(h.holder, gpu.index, discovery) for h in unowned):
            continue  # a holder without memory there: in doubt, not reaped
        idents = [h.holder.info.ident for h in unowned]
        ages = [now - seen[ident].since for ident in idents if ident in seen]
        if len(ages) == len(unowned) and min(ages) >= after_s:
            found.append(gpu)
    return found


class LeaseRecheck(PlainWorkload):
    """The reap's surroundings: a lease taken since the look refuses it, under the GPU locks;
    the look's watchers stay watchers (owners that do not depend on the GPUs' memory)."""

    __slots__ = ("unit_state", "watchers")

    def __init__(
        self,
        loaded: LoadedConfig,
        unit_state: Callable[[str], str | None],
        watchers: tuple[ProcessId, ...] = (),
    ) -> None:
        super().__init__(loaded)
        self.unit_state, self.watchers = unit_state, watchers

    def refuses_start(self, owned: Sequence[Gpu], *, dry_run: bool) -> bool:
        leased = live_leased(self.loaded, self.unit_state)
        return any(gpu.uuid.lower() in leased for gpu in owned)

    def known_watchers(self) -> Sequence[ProcessId]:
        return self.watchers


def reap(
    gpus: Sequence[Gpu],
    loaded: LoadedConfig,
    front: HostAccess,
    reporter: Reporter,
    watchers: tuple[ProcessId, ...],
) -> int:
    """One pre-phase run over gpus; orphans killed whatever [pre] kill_orphans says."""
    pre = replaced(loaded.config.pre, kill_orphans=True)
    config = replaced(loaded.config, gpus=tuple(gpu.uuid for gpu in gpus), pre=pre)
    reaping = loaded._replace(config=config)
    scope = RunScope(
        Phase.PRE,
        SWEEP_UNIT,
        lambda: SWEEP_CGROUP,
        roots=front.host_roots(),
        driver_factory=front.driver_factory,
    )
    hook = Hook(scope, lambda _s, got, _r: LeaseRecheck(got, front.unit_state, watchers), reporter)
    return int(run_hook(hook, reaping).exit_code)  # no run record: the sweep's gauges say it


def discover_host(loaded: LoadedConfig, front: HostAccess) -> Discovery:
    """Every GPU holder on the host, each process's fds read only where NVML's lists do not
    account for the GPUs' memory; NvmlNotAnswering where the driver hung."""
    roots = front.host_roots()
    procfs = ProcFs(roots.proc)
    with contextlib.closing(front.driver_factory()) as driver:
        with procfs.oneshot():
            discovery = collect(None, loaded, driver, roots, procfs=procfs, listed_first=True)
        hung = driver.not_answering()
        if hung is not None:
            raise hung
        return discovery


def sweep(
    config: Path | None,
    front: HostAccess,
    clock: Callable[[], float] = time.time,
    boot_clock: Callable[[], float] = boot_time,
) -> int:
    """One sweep; the exit code: 0, the error's (said as the sweep's journal entry), or the
    reap's where one ran and failed. clock: the gauges' timestamp; boot_clock: unowned time,
    on a clock no step of the wall clock moves."""
    reporter = front.reporter_factory(SWEEP_UNIT, "sweep")
    try:
        loaded = load_config(None, config, cache=front.host_roots().run / CACHE_NAME)
        wall, now = clock(), boot_clock()
        discovery = discover_host(loaded, front)
        logind = Logind(front.sessions_dir)
        holdings = [
            HolderOwner(holder, owner_of(holder, discovery, loaded.config, logind))
            for holder in sorted(discovery.holders.values(), key=lambda h: h.pid)
            if holder.gpus or holder.used_mib
        ]
        kinds = tracked(loaded.config.sweep.reap_sessions)
        seen = keep_state(loaded, holdings, now, reporter, kinds)
        textfile = loaded.config.metrics_textfile
        if textfile is not None:
            samples = gauges(discovery, holdings, seen, now, wall=wall, kinds=kinds)
            try:
                record_sweep(textfile, samples)
            except OSError as exc:
                Narrator(reporter).metrics_not_written(textfile, exc.strerror or str(exc))
        code, reaped = int(ExitCode.OK), []
        after_s = loaded.config.sweep.reap_after_s
        if after_s is not None:
            leased = live_leased(loaded, front.unit_state)
            gpus = reapable(
                discovery, holdings, seen, now, after_s=after_s, leased=leased, kinds=kinds
            )
            if gpus:
                watchers = tuple(h.holder.info.ident for h in holdings if h.owner is Owner.WATCHER)
                code = reap(gpus, loaded, front, reporter, watchers)
                reaped = [gpu.index for gpu in gpus]
        if front.unit_state(SLURMD_UNIT) in RUNNING_STATES:
            drain_due(loaded, front, holdings, seen, now, reaped, code, reporter)
        unowned_gpus = sorted({i for h in holdings if h.owner in kinds for i in h.holder.using})
        sweep_status(reporter, len(seen), unowned_gpus, reaped if code == 0 else [])
        return code
    except GateError as exc:
        Narrator(reporter).failed(exc)
        return int(exc.exit_code)


def drain_due(
    loaded: LoadedConfig,
    front: HostAccess,
    holdings: Sequence[HolderOwner],
    seen: Mapping[ProcessId, Seen],
    now: float,
    reaped: list[int],
    code: int,
    reporter: Reporter,
) -> None:
    node = socket.gethostname().split(".")[0]  # slurmd's own default NodeName
    if code == ExitCode.UNKILLABLE:  # the reaped GPUs' unowned holders, still the same processes
        procfs, on = ProcFs(front.host_roots().proc), set(reaped)
        kinds = tracked(loaded.config.sweep.reap_sessions)
        infos = [h.holder.info for h in holdings if h.owner in kinds and h.holder.using & on]
        pids = [
            info.pid
            for info in infos
            if (again := procfs.info(info.pid)) is not None and again.start_time == info.start_time
        ]
        head = f"gpugate: sweep's reap on GPU {','.join(map(str, reaped))} left unkillable PID "
        set_drain_reason(node, pids_within(head, pids), sys.stderr)
    after_s = loaded.config.sweep.drain_after_s
    if after_s is None:
        return
    listed = {
        h.holder.info.ident for h in holdings if h.owner is Owner.NOBODY and h.holder.used_mib
    }
    found = {
        ident: entry
        for ident, entry in seen.items()
        if ident in listed and not entry.drained and now - entry.since >= after_s
    }
    if not found:
        return
    gpus = sorted({gpu for entry in found.values() for gpu in entry.gpus})
    oldest = max(now - entry.since for entry in found.values())
    head = f"gpugate: GPU {','.join(map(str, gpus))} held by nobody for {oldest:.0f}s, PID "
    set_drain_reason(node, pids_within(head, sorted(ident.pid for ident in found)), sys.stderr)
    lock_dir = loaded.config.lock_dir
    try:
        with locked_state(lock_dir) as (folder_fd, kept):
            marked = {
                ident: Seen(entry.since, entry.gpus, entry.drained or ident in found)
                for ident, entry in kept.unowned.items()
            }
            write_state(folder_fd, marked)
    except OSError as exc:  # the next sweep drains again
        sweep_state_unwritten(reporter, lock_dir / STATE_NAME, exc.strerror or str(exc))


def pids_within(head: str, pids: Sequence[int]) -> str:
    """head and the PIDs, within scontrol's 250 characters of Reason= (the PIDs cut first)."""
    listed = ",".join(map(str, pids))
    return head + (listed if len(head) + len(listed) <= 250 else listed[: 249 - len(head)] + "+")


def keep_state(
    loaded: LoadedConfig,
    holdings: Sequence[HolderOwner],
    now: float,
    reporter: Reporter,
    kinds: Collection[Owner] = (Owner.NOBODY,),
) -> dict[ProcessId, Seen]:
    """remember(), against the state under lock_dir; a state not kept is only a warning."""
    path = loaded.config.lock_dir / STATE_NAME
    seen: dict[ProcessId, Seen] | None = None
    try:
        with locked_state(loaded.config.lock_dir) as (folder_fd, state):
            if state.refused is not None:
                sweep_state_refused(reporter, path, state.refused)
            seen = remember(holdings, state.unowned, now, reporter, kinds)
            write_state(folder_fd, seen)
    except OSError as exc:
        sweep_state_unwritten(reporter, path, exc.strerror or str(exc))
    return remember(holdings, {}, now, None, kinds) if seen is None else seen
