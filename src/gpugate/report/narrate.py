"""A run's journal entries and STATUS= lines: the run says what happened, this words it; a
holder in words, as every entry about it names it, and its rule in words."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from gpugate.core import outcome
from gpugate.core.decide import Choice, Rule, Verdict
from gpugate.core.roles import Role
from gpugate.core.shm_cleanup import Kept
from gpugate.errors import ExitCode, GateError
from gpugate.host.containers import Container
from gpugate.host.nvml import MIB, Gpu
from gpugate.host.safe_files import account
from gpugate.host.scan import user_name
from gpugate.report.journal import (
    PRIORITY_ERR,
    PRIORITY_INFO,
    PRIORITY_NOTICE,
    PRIORITY_WARNING,
    Event,
    Reporter,
    stderr_is_journal,
)
from gpugate.untrusted import (
    CGROUP,
    COMM,
    COMMAND,
    CONTAINER,
    FILE,
    STATE,
    field_bytes,
    printable,
    safe_line,
)

MAX_LISTED_PIDS = 10  # PIDs a line lists before "…"
WAITING_EVERY_S = 10.0  # a memory wait sends the `waiting` event this often


def processes(pids: Sequence[int]) -> str:
    """`3 process(es) (PID 1, 2, 3)`, listing at most MAX_LISTED_PIDS."""
    more = ", …" if len(pids) > MAX_LISTED_PIDS else ""
    return f"{len(pids)} process(es) (PID {', '.join(map(str, pids[:MAX_LISTED_PIDS]))}{more})"


def unreadable_text(pids: Sequence[int]) -> str:
    return f"not permitted to read the open files of {processes(pids)}"


def cut_short_text(pids: Sequence[int]) -> str:
    return f"the open files of {processes(pids)} were not all read before the deadline"


def size_text(count: int, *, column: bool = False) -> str:
    """812 B, 4.0 KiB, 1.5 MiB, 3.2 GiB; column (status's): -, 812B, 4.0K, 1.5M, 3.2G."""
    if column and count == 0:
        return "-"
    gap, units = ("", "KMG") if column else (" ", ("KiB", "MiB", "GiB"))
    value, unit = float(count), "B"
    for larger in units:
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{count}{gap}B" if unit == "B" else f"{value:.1f}{gap}{unit}"


def quoted(path: str) -> str:
    """A file's name between quotes, shown (any account may name a file in /dev/shm)."""
    return f"'{printable(path, FILE)}'"


def gpu_list(indices: Iterable[int], sep: str = ", ", none: str = "none") -> str:
    """GPUs by index, as every line names them: `0, 1, 3`, or `none` (sweep's: `0,1,3`, `-`)."""
    return sep.join(str(index) for index in sorted(indices)) or none


def describe(choice: Choice) -> str:
    info = choice.holder.info
    gpus = f" GPU {gpu_list(choice.holder.gpus)}" if choice.holder.gpus else ""
    sources = ",".join(sorted(choice.holder.sources))
    command = printable(info.command, COMMAND)
    where = f", {container_text(choice.holder.container)}" if choice.holder.container else ""
    return f"PID {info.pid} ({info.user}, {choice.role}{gpus}{where}, via {sources}): {command}"


def container_text(container: Container) -> str:
    """`docker container vllm (3f2a1b0c4d5e)`: Container.label with its creator's name shown."""
    if container.name:
        name = printable(container.name, CONTAINER)
        return f"{container.runtime} container {name} ({container.short_id})"
    return container.label


def choice_fields(choice: Choice) -> dict[str, Any]:
    """GPUGATE_PID, _GPU, _ROLE, _COMMAND of every entry about a holder, _USED_MIB where NVML
    says, _MPS_CLIENT (its GPUs) for an MPS client; in a container, also GPUGATE_CONTAINER (the
    id), _CONTAINER_RUNTIME and _CONTAINER_NAME."""
    holder, container = choice.holder, choice.holder.container
    fields: dict[str, Any] = {
        "pid": holder.pid,
        "gpus": sorted(holder.gpus),
        "role": choice.role,
        "command": field_bytes(holder.info.command, COMMAND),
    }
    known = [mib for mib in holder.used_mib.values() if mib is not None]
    if known:
        fields["used_mib"] = sum(known)  # NVML's, an MPS client's included
    if holder.mps_client:
        fields["mps_client"] = ",".join(map(str, sorted(holder.mps_client)))
    if container is not None:
        fields["container"] = field_bytes(container.id, CONTAINER)
        fields["container_runtime"] = container.runtime
        if container.name:
            fields["container_name"] = field_bytes(container.name, CONTAINER)
    return fields


def held_text(choice: Choice) -> str:
    gpus = ", ".join(map(str, choice.on_owned))
    ports = ", ".join(map(str, sorted(choice.holder.ports)))
    parts = (f"GPU {gpus}" if gpus else "", f"port {ports}" if ports else "")
    return " and ".join(part for part in parts if part)


def reason_text(
    choice: Choice, unit: str, phase: str, workloads: Callable[[str], str | None] | None = None
) -> str:
    """What the journal says after the holder; phase: named in the setting that blocked;
    workloads: another workload's unit in words (a pod's container from its lease), or None."""
    held, holder, rule = held_text(choice), choice.holder, choice.rule
    if rule is Rule.PROTECTED:
        return "protected by configuration"
    if rule is Rule.WATCHER:
        return "a watcher: NVML lists it on no GPU, with no memory"
    if rule is Rule.CGROUP:
        return f"in {unit}'s cgroup"
    if rule is Rule.UNIT_CONTAINER and holder.container is not None:
        return f"in {container_text(holder.container)}, one of {unit}'s (containers)"
    if rule is Rule.NOT_OWNED:
        why = "holds only control devices" if holder.control_devices else "holds no GPU"
        return f"{why} of {unit}"
    if rule is Rule.STRADDLES:
        foreign = ", ".join(map(str, choice.foreign))
        return f"holds {held or 'no GPU of it'} but also GPU {foreign}, which {unit} does not own"
    if rule is Rule.APP_TREE:
        return f"same application as PID {choice.seed_pid}"
    if rule is Rule.OTHER_ACCOUNT:
        return (
            f"{account(holder.info.uid)}'s process holds {held or 'them'}; this "
            f"`gpugate run` acts for {account(choice.for_uid)} and kills only its processes"
        )
    if rule is Rule.ORPHAN:
        kept = choice.verdict is Verdict.BLOCK
        return f"orphan holding {held}" + (f" ({phase}.kill_orphans = false)" if kept else "")
    named = workloads(choice.other_unit) if workloads and choice.other_unit else None
    return other_unit_text(choice, unit, held, named)


# Never kill_other_units: set to run beside another workload, it kills that workload.
SHARE_HINT = "to run beside it, set share_gpus = true for both (docs/what-gets-killed.md)"


def other_unit_text(choice: Choice, unit: str, held: str, named: str | None = None) -> str:
    """named: the other workload in words where its lease says (a pod: namespace/pod/container,
    shown escaped already), else its unit."""
    container, other = choice.holder.container, printable(choice.other_unit, CGROUP)
    if choice.rule is Rule.SHARER:
        whose = container_text(container) if container else named or other
        return f"{whose} shares {held} with {unit} on purpose: a sharer, left alone"
    if choice.verdict is Verdict.KILL:
        return f"{container_text(container) if container else named or other} holds {held}"
    if container is None and named:
        return f"{named} holds {held} (scope {other}); {SHARE_HINT}"
    if container is None:
        return f"active unit {other} holds {held}; {SHARE_HINT}"
    handle = printable(container.handle, CONTAINER)
    return (
        f"{container_text(container)} holds {held} (scope {other}); "
        f'if it is {unit}\'s, set containers = ["{handle}"] in its gpugate config '
        f"(gpugate install {unit} --container {handle}); else {SHARE_HINT}"
    )


class Narrator:
    """One run's journal entries and STATUS= lines (`tell`: each RunEvent as WORDS says); also
    those of its surroundings."""

    def __init__(self, reporter: Reporter, clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter, self.dry_run, self.clock = reporter, reporter.dry_run, clock
        self.waiting_next_at: float | None = None  # the next memory wait's `waiting` event
        # Another workload's unit in words where its lease names it (a pod's scope as
        # namespace/pod/container), for the refusals that name it; None: its unit.
        self.workloads: Callable[[str], str | None] | None = None

    def tell(self, event: outcome.RunEvent) -> None:
        """The run's sink: the event in words, as WORDS says for its kind."""
        WORDS[type(event)](self, event)

    def looking(self) -> None:
        self.reporter.status("looking for processes holding the GPUs")

    def run_started(self, e: outcome.RunStarted) -> None:
        discovery, config_source, used_mib = e.discovery, e.workload.loaded.source, e.used_mib
        owned = [gpu.index for gpu in discovery.owned]
        gpu_source = e.workload.gpu_source
        source = f"GPUs from {gpu_source}; " if gpu_source else ""
        evidence = (
            "NVML lists the GPUs' processes: a device-file holder it lists nowhere is a watcher"
            if discovery.nvml_lists_processes
            else "NVML lists no processes here: device files alone name the holders (no watchers)"
        )
        self.reporter.event(
            Event.RUN_STARTED,
            f"{'dry run: ' if self.dry_run else ''}{len(owned)} GPU(s) [{gpu_list(owned)}], "
            f"{used_mib} MiB used; {source}config {config_source}; "
            f"cgroup {discovery.unit_cgroup}; {evidence}",
            priority=PRIORITY_WARNING if e.workload.gpu_source_warns else PRIORITY_INFO,
            gpus=owned,
            used_mib=used_mib,
            config=config_source,
            gpu_source=gpu_source or config_source,
            evidence="nvml" if discovery.nvml_lists_processes else "device-files",
        )

    def blind_spots(self, e: outcome.BlindSpots) -> None:
        discovery = e.discovery
        if discovery.unreadable:
            self.reporter.warn(
                "unreadable",
                f"{unreadable_text(discovery.unreadable)}: GPU holders among them are invisible; "
                "run gpugate as root",
            )
        if discovery.cut_short:
            self.reporter.warn(
                "scan-cut-short",
                f"{cut_short_text(discovery.cut_short)}: GPU holders among them may be missed",
            )
        for gpu_index, pid in discovery.invisible:
            if gpu_index in discovery.owned_indices:
                self.reporter.event(
                    Event.WARNING,
                    f"NVML lists PID {pid} on GPU {gpu_index}, but this /proc has no such "
                    "process: gpugate runs in another PID namespace (a container without "
                    "the host's PIDs) and cannot kill it",
                    pid=pid,
                    gpus=[gpu_index],
                    reason="other-pid-namespace",
                )

    def choices(self, e: outcome.Decided) -> None:
        would, unit, phase = self.dry_run, self.reporter.unit, self.reporter.phase
        spared = [c for c in e.decision.spared if c.holder.gpus]
        for choices, event, verb in (
            (e.decision.targets, Event.HOLDER_FOUND, "would kill" if would else "will kill"),
            (e.decision.blockers, Event.REFUSED, "would not kill" if would else "not killing"),
            (spared, Event.PROCESS_SPARED, "would spare" if would else "sparing"),
        ):
            for choice in choices:
                self.reporter.event(
                    event,
                    f"{verb} {describe(choice)}: "
                    f"{reason_text(choice, unit, phase, self.workloads)}",
                    reason=choice.rule.value,
                    **choice_fields(choice),
                )
        if e.decision.refused:
            self.reporter.status("refused: another unit or account holds the GPUs")

    def signal_sent(self, e: outcome.SignalSent) -> None:
        name = signal.Signals(e.signum).name
        self.reporter.event(
            Event.SIGNAL_SENT,
            f"{name} to {describe(e.choice)}",
            signal=name,
            comm=field_bytes(e.choice.holder.info.comm, COMM),
            **choice_fields(e.choice),
        )

    def container_stopped(self, e: outcome.ContainerStopped) -> None:
        result, runtime = e.result, e.result.container.runtime
        why = result.error.message if result.error is not None else result.detail
        why = f"no {runtime} CLI found" if result.no_cli else why
        done = "stopped" if result.ok else f"failed ({why}); signalling its processes"
        self.reporter.event(
            Event.SIGNAL_SENT,
            f"{runtime} stop {container_text(result.container)}: {done}",
            priority=PRIORITY_NOTICE if result.ok else PRIORITY_WARNING,
            signal=f"{runtime} stop",
            container=result.container.id,
            container_runtime=runtime,
            role=Role.UNIT_CONTAINER,
        )

    def stuck(self, e: outcome.Stuck) -> None:
        self.reporter.event(
            Event.SURVIVOR,
            f"{describe(e.choice)} is still alive after SIGKILL "
            f"(state {e.state}, wchan {e.wchan}); waiting until the deadline",
            pid=e.choice.holder.pid,
            state=e.state,
            wchan=e.wchan,
        )

    def survivor(self, e: outcome.Survived) -> None:
        for choice in e.choices:
            self.reporter.event(
                Event.SURVIVOR,
                f"{describe(choice)} survived SIGKILL until the deadline",
                pid=choice.holder.pid,
            )
        self.reporter.status(f"{len(e.choices)} process(es) survived SIGKILL")

    def fault_elsewhere(self, e: outcome.FaultElsewhere) -> None:
        self.reporter.warn(
            "gpu-fault",
            f"{e.fault.error}; not a GPU of {self.reporter.unit}: going on with its own GPUs",
            gpus=[e.fault.index],
        )

    def degraded(self, e: outcome.Degraded) -> None:
        self.reporter.warn(
            "nvml-degraded",
            f"{e.error.message}; {e.phase}.on_nvml_error = warn: cleaning the unit's cgroup only",
        )

    def nvml_skipped(self, e: outcome.NvmlSkipped) -> None:
        self.reporter.warn(
            "nvml-not-answering",
            f"not asking NVML: this start's pre found it not answering ({e.why}); "
            f"{e.phase} cleans the unit's cgroup only",
        )

    def lock_wait(self, e: outcome.LockWait) -> None:
        self.reporter.status(f"waiting for another gpugate run on {e.gpu.label}")
        self.reporter.event(
            Event.WAITING,
            f"waiting for another gpugate run that holds the lock of {e.gpu.label}; "
            f"{e.left_s:.0f} s left",
            gpus=[e.gpu.index],
            waiting_for="lock",
            seconds_left=f"{e.left_s:.0f}",
        )

    def lock_not_taken(self, e: outcome.LockNotTaken) -> None:
        self.reporter.warn(
            "lock-not-taken",
            f"{e.path}: GPU lock not taken ({e.cause}); {self.reporter.phase} goes on without it",
        )

    def memory_wait(self, e: outcome.MemoryWait) -> None:
        """STATUS= each poll; the `waiting` event at once, then about every WAITING_EVERY_S."""
        busy, free_mib, left_s, first = e.busy, e.free_mib, e.left_s, e.busy[0]
        self.reporter.status(
            f"waiting for {len(busy)} GPU(s) to free memory: {first.gpu.label} "
            f"{first.used_mib} MiB used (free at {free_mib}), {left_s:.0f} s left"
        )
        now = self.clock()
        if self.waiting_next_at is not None and now < self.waiting_next_at:
            return
        self.waiting_next_at = now + WAITING_EVERY_S
        used = {item.gpu.index: item.used_mib for item in busy}
        listed = ", ".join(f"GPU {index} {mib} MiB" for index, mib in sorted(used.items()))
        self.reporter.event(
            Event.WAITING,
            f"waiting for the driver to free memory: {listed} used (free at {free_mib} MiB); "
            f"{left_s:.0f} s left",
            gpus=sorted(used),
            used_mib=sum(used.values()),
            waiting_for="memory",
            seconds_left=f"{left_s:.0f}",
        )

    def memory_timeout(self, e: outcome.MemoryTimeout) -> None:
        for item in e.busy:
            holders = ", ".join(str(pid) for pid in item.pids) or "no process"
            self.reporter.event(
                Event.TIMEOUT,
                f"{item.gpu.label} still has {item.used_mib} MiB used (free at {e.free_mib} MiB)"
                f" after {e.timeout_s:g} s; NVML lists: {holders}",
                priority=PRIORITY_ERR if e.failing else PRIORITY_WARNING,
                gpus=[item.gpu.index],
                used_mib=item.used_mib,
                gpu_uuid=item.gpu.uuid,
            )

    def respawning(self, e: outcome.Respawning) -> None:
        for respawner in e.respawners:
            info = respawner.info
            self.reporter.event(
                Event.TIMEOUT,
                f"PID {info.pid} ({info.user}): {printable(info.command, COMMAND)} respawned the "
                f"holders {respawner.respawns} time(s) and was still respawning after "
                f"{e.timeout_s:g} s; it is not part of the application (a login shell, a "
                "supervisor): stop it, or run the server under the unit",
                pid=info.pid,
                command=field_bytes(info.command, COMMAND),
                respawns=respawner.respawns,
                reason="respawning",
            )
        self.reporter.status("failed: the holders keep respawning")

    def respawned(self, e: outcome.Respawned) -> None:
        info, respawns = e.respawner.info, e.respawner.respawns
        self.reporter.event(
            Event.HOLDER_FOUND,
            f"PID {info.pid} ({info.user}): {printable(info.command, COMMAND)} respawned the "
            f"holders {respawns} time(s) during the wait; each respawn was killed",
            priority=PRIORITY_WARNING,
            pid=info.pid,
            command=field_bytes(info.command, COMMAND),
            respawns=respawns,
            reason="respawned",
        )

    def ports_held(self, e: outcome.PortsHeld) -> None:
        self.reporter.event(
            Event.TIMEOUT,
            f"TCP port {', '.join(map(str, e.ports))} still listened on after {e.timeout_s:g} s "
            "by a process gpugate cannot see (not root, or its fds are unreadable)",
            ports=",".join(map(str, e.ports)),
        )

    def memory_freed(self, e: outcome.MemoryFreed) -> None:
        self.reporter.event(
            Event.MEMORY_FREED,
            f"GPU {', '.join(gpu.shown for gpu in sorted(e.owned, key=lambda g: g.index))} free "
            f"(at or below {e.free_mib} MiB) after {e.seconds:.2f} s",
            gpus=[gpu.index for gpu in e.owned],
        )

    def shm_files(self, e: outcome.ShmFiles) -> None:
        for item in e.removals:
            facts, holders = item.facts, ", ".join(map(str, item.holders))
            if item.kept is None and facts is not None:  # removed, or would be
                would = f"PID {holders}, which would be killed"
                self.reporter.event(
                    Event.SHM_REMOVED,
                    f"{'would remove' if self.dry_run else 'removed'} {quoted(facts.path)} "
                    f"({size_text(facts.bytes)}, owner {user_name(facts.uid)}): shared memory of "
                    f"{would if self.dry_run else 'killed PID ' + holders}",
                    shm_path=field_bytes(facts.path, FILE),
                    shm_bytes=facts.bytes,
                    shm_size=facts.size,
                    shm_holders=holders,
                )
                continue
            by, path = ", ".join(item.kept_by), facts.path if facts else item.file.path
            owner = f" (owner {user_name(facts.uid)}, mode {facts.mode:04o})" if facts else ""
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
            why = words.get(item.kept, "") if item.kept else ""
            self.reporter.event(
                Event.SHM_KEPT,
                f"{'would keep' if self.dry_run else 'kept'} {quoted(path)}, shared memory of "
                f"killed PID {holders}: {why}",
                shm_path=field_bytes(path, FILE),
                shm_holders=holders,
                shm_kept=why,
                reason=str(item.kept or ""),
                shm_bytes=facts.bytes if facts else None,
            )

    def shm_short(self, e: outcome.ShmShort) -> None:
        short, parts = e.short, []
        for key, facts in short.largest:
            by = ", ".join(e.label(pid) for pid in e.holders.get(key, [])[:2]) or "no process"
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
            exit_code=int(ExitCode.SHM_SPACE),
            shm_path=short.space.area.path,
            shm_free_bytes=short.free_bytes,
            shm_needed_bytes=short.needed_bytes,
        )
        self.reporter.status(f"{short.space.area.path} short of free space")

    def finished(self, e: outcome.Finished) -> None:
        summary = e.summary
        result = outcome.result_label(summary.exit_code)
        if self.dry_run:
            verdict = "would succeed" if result == "success" else f"would fail: {result}"
            self.reporter.event(
                Event.RUN_FINISHED,
                f"dry run: would kill {summary.would_kill} process(es); the run {verdict}; "
                "nothing was killed",
                priority=PRIORITY_NOTICE,
                result=result,
                would_kill=summary.would_kill,
            )
            return
        self.reporter.event(
            Event.RUN_FINISHED,
            f"{result}: {len(summary.killed)} process(es) stopped in {summary.rounds} round(s);"
            f" discover {summary.seconds_discover * 1000:.0f} ms, kill {summary.seconds_kill:.2f}"
            f" s, wait {summary.seconds_wait:.2f} s",
            priority=PRIORITY_NOTICE if result == "success" else PRIORITY_ERR,
            result=result,
            killed=len(summary.killed),
            seconds_wait=f"{summary.seconds_wait:.3f}",
            freed_mib=sum(summary.freed_mib_by_gpu.values()),
        )
        if result == "success":
            self.reporter.clear_status()  # the service runs on: no gpugate words under it
        else:
            self.reporter.status(f"done: {result}")

    def state_unwritable(self, error: GateError) -> None:
        self.reporter.warn(
            "state-unwritable",
            f"{error.message}; {self.reporter.phase} goes on: killing what is left and "
            "removing its files need no space",
            problem=error.code,
        )

    def metrics_not_written(self, path: object, cause: str) -> None:
        self.reporter.warn(
            "metrics-unwritable", f"metrics not written to {path}: {cause}; the run's result stands"
        )

    def failed(self, error: GateError, error_stream: TextIO | None = None) -> None:
        """An error that ends the run: one entry (GPUGATE_PROBLEM: error.code), one STATUS=, and
        `gpugate: message` on error_stream (stderr) unless that is the journal already."""
        exit_code, problem = int(error.exit_code), error.code or None
        self.reporter.event(
            Event.ERROR, error.message, echo=False, exit_code=exit_code, problem=problem
        )
        message, error_stream = safe_line(error.message), error_stream or sys.stderr
        if not stderr_is_journal(error_stream):
            with contextlib.suppress(OSError):  # a closed terminal: the journal has it
                print(f"gpugate: {message}", file=error_stream, flush=True)
        self.reporter.status(f"failed: {message}")

    # What a systemd unit's surroundings say: its GPU leases, this start's failed pre.

    def not_recorded(self, error: GateError) -> None:
        self.reporter.warn(
            "state-not-recorded",
            f"{error.message}; not recorded, {self.reporter.phase} goes on",
            problem=error.code,
        )

    def lease_unreadable(self, path: Path, why: str) -> None:
        self.reporter.warn("lease-unreadable", unreadable_record_text(path, "a gpugate lease", why))

    def failed_start_unreadable(self, path: Path, why: str) -> None:
        self.reporter.warn(
            "failed-start-unreadable",
            unreadable_record_text(path, "a gpugate failed-start record", why),
        )

    def lease_stale(
        self, lease_unit: str, gpus: Sequence[int], state: str, *, dry_run: bool
    ) -> None:
        self.reporter.warn(
            "lease-stale",
            f"GPU lease of {printable(lease_unit, STATE)} on GPU {gpu_list(gpus)} is stale "
            f"({printable(lease_unit, STATE)} is {state}); {'would take' if dry_run else 'taking'} "
            "it over",
            gpus=list(gpus),
            lease_unit=lease_unit,
            lease_unit_state=state,
        )

    def gpus_shared(self, lease_unit: str, gpus: Sequence[int]) -> None:
        self.reporter.event(
            Event.PROCESS_SPARED,
            f"GPU {gpu_list(gpus)} shared with {printable(lease_unit, STATE)} (share_gpus in both)",
            gpus=list(gpus),
            reason="shared",
            lease_unit=lease_unit,
        )

    def lease_refused(
        self,
        refusal: str,
        gpus: Sequence[int],
        *,
        holders: Sequence[str] = (),
        first: bool = True,
        who: str | None = None,
    ) -> None:
        """holders: the units whose leases refuse it (GPUGATE_LEASE_UNIT); first: False where
        STATUS= said the refusal already; who: the workload in words where not its unit."""
        self.reporter.event(
            Event.REFUSED,
            f"not starting {who or self.reporter.unit}: {refusal}",
            gpus=sorted(gpus),
            reason="leased",
            lease_unit=",".join(sorted(set(holders))) or None,
        )
        if first:
            self.reporter.status(f"refused: {refusal}")

    def lease_overridden(self, lease_unit: str, holder: str, gpus: Sequence[int]) -> None:
        self.reporter.warn(
            "lease-forced",
            f"GPU {gpu_list(gpus)} leased to {holder}; starting {self.reporter.unit} anyway "
            "(gpugate run --force)",
            gpus=list(gpus),
            lease_unit=lease_unit,
        )

    def start_failed_earlier(self, reason: str) -> None:
        # Last, so that `systemctl status` (STATUS= and the journal's tail) shows it.
        text = f"start failed in gpugate pre: {reason}"
        self.reporter.event(Event.ERROR, text, reason="failed-start", failed_start=reason)
        self.reporter.status(text)

    def waiting_skipped(self, gpus: Sequence[Gpu]) -> None:
        self.reporter.event(
            Event.TIMEOUT,
            f"not waiting again on GPU {gpu_list(g.index for g in gpus)}: this start's pre "
            "already waited its wait_timeout_s for that memory",
            priority=PRIORITY_WARNING,
            gpus=[gpu.index for gpu in gpus],
            reason="failed-start",
        )


# Each kind of RunEvent and the method that words it: the one place a run's events become
# journal entries, STATUS= lines and EXTEND_TIMEOUT_USEC=.
WORDS: dict[type[outcome.RunEvent], Callable[[Narrator, Any], None]] = {
    outcome.RunStarted: Narrator.run_started,
    outcome.FaultElsewhere: Narrator.fault_elsewhere,
    outcome.Degraded: Narrator.degraded,
    outcome.NvmlSkipped: Narrator.nvml_skipped,
    outcome.BlindSpots: Narrator.blind_spots,
    outcome.Decided: Narrator.choices,
    outcome.ExtendTimeout: lambda n, e: n.reporter.extend_timeout(e.seconds),
    outcome.LockWait: Narrator.lock_wait,
    outcome.LockNotTaken: Narrator.lock_not_taken,
    outcome.Stopping: lambda n, e: n.reporter.status(
        f"stopping {e.count} process(es), round {e.round_number}"
    ),
    outcome.ContainerStopping: lambda n, e: n.reporter.status(
        f"stopping {e.count} container(s) through their runtime"
    ),
    outcome.ContainerStopped: Narrator.container_stopped,
    outcome.SignalSent: Narrator.signal_sent,
    outcome.Stuck: Narrator.stuck,
    outcome.Survived: Narrator.survivor,
    outcome.StillHeld: lambda n, _: n.reporter.status(
        "GPUs still held by processes gpugate may not kill"
    ),
    outcome.MemoryWait: Narrator.memory_wait,
    outcome.MemoryTimeout: Narrator.memory_timeout,
    outcome.Respawning: Narrator.respawning,
    outcome.Respawned: Narrator.respawned,
    outcome.PortsHeld: Narrator.ports_held,
    outcome.MemoryFreed: Narrator.memory_freed,
    outcome.ShmFiles: Narrator.shm_files,
    outcome.ShmShort: Narrator.shm_short,
    outcome.Finished: Narrator.finished,
}


def unreadable_record_text(path: Path, what: str, why: str) -> str:
    because = f" ({why})" if why else ""
    return f"{printable(str(path), FILE)}: not {what}{because}; ignored"


def failed_start_text(code: ExitCode, busy: Sequence[outcome.BusyGpu], timeout_s: float) -> str:
    """What a failed pre records for its post."""
    if busy:
        return "; ".join(
            f"{item.gpu.label} still {item.used_mib} MiB used after {timeout_s:g} s"
            f" (PIDs {', '.join(map(str, item.pids)) or 'none listed'})"
            for item in busy
        )
    return f"exit {int(code)} ({code.name.lower()}); see journalctl for its entries"


def lease_refusal_text(
    conflicts: Sequence[tuple[Sequence[int], str]],
    *,
    containers: bool = False,
    theirs: Sequence[bool] = (),
    ours: str = "",
    sharing: bool = False,
    where: str = "its config",
    one_place: bool = False,
) -> str:
    """Why a start is refused: conflicts are (GPU indices, who holds their lease); then which
    setting would let both run (never kill_other_units). theirs: each conflict's share_gpus;
    ours: how this workload would share (empty: both configs, unnamed); sharing: its share_gpus;
    where: the holders' setting; one_place: both settings are one file's (containers.toml)."""
    parts = [f"GPU {', '.join(map(str, gpus))} leased to {holder}" for gpus, holder in conflicts]
    held = (
        "container is still running and holds them until it stops"
        if containers
        else "unit is still active or activating and holds them until its post"
    )
    if not ours:
        ours = "set share_gpus = true in both " + ("configs" if containers else "units' configs")
        one_place = True
    if theirs and all(theirs) and not sharing:
        hint = f"it shares them on purpose (share_gpus = true): to run beside it, {ours}"
    elif sharing and not any(theirs):
        hint = "it does not share them (share_gpus = false): stop it first, or set "
        hint += f"share_gpus = true in {where} too"
    elif one_place or not theirs:
        hint = f"stop it first, or {ours} to share them"
    else:
        hint = f"stop it first, or, to share them, {ours} and set share_gpus = true in {where} too"
    return f"{'; '.join(parts)}: that {held}; {hint}"
