"""The pre and post runs: config → discover → decide → kill → wait → report.

Discovery and killing repeat (bounded in rounds and by the deadline) so that a holder that
forks while it is being killed is found and killed too.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpugate.config import LoadedConfig
from gpugate.containers import stop_containers
from gpugate.decide import Choice, Decision, Role, decide
from gpugate.discover import Discovery, discover
from gpugate.errors import ExitCode, NvmlUnavailable
from gpugate.kill import Pinned, pin, terminate
from gpugate.locks import gpu_locks
from gpugate.nvml import Gpu, GpuDriver, GpuUsage, NvmlDriver
from gpugate.procfs import ProcessId, ProcFs
from gpugate.report import (
    PRIORITY_ERR,
    PRIORITY_INFO,
    PRIORITY_NOTICE,
    PRIORITY_WARNING,
    Event,
    Reporter,
)
from gpugate.units import resolve_unit_cgroup
from gpugate.wait import BusyGpu, wait_until_free

MAX_ROUNDS = 5
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"


class NoGpus:
    """Stands in for NVML when it failed and the policy says go on: cgroup cleanup only."""

    def gpus(self) -> Sequence[Gpu]:
        return []

    def usage(self, gpu: Gpu) -> GpuUsage:
        raise AssertionError("no GPUs to query")

    def close(self) -> None:
        pass


@dataclass
class RunSummary:
    exit_code: ExitCode = ExitCode.OK
    killed: list[Choice] = field(default_factory=list)
    rounds: int = 0
    seconds_discover: float = 0.0
    seconds_kill: float = 0.0
    seconds_wait: float = 0.0
    freed_mib: int = 0
    busy: list[BusyGpu] = field(default_factory=list)
    owned: list[Gpu] = field(default_factory=list)  # the GPUs this run made free
    freed_mib_by_gpu: dict[int, int] = field(default_factory=dict)  # by GPU index


def _gpu_list(indices: Sequence[int] | set[int]) -> str:
    return ", ".join(str(index) for index in sorted(indices)) or "none"


def describe(choice: Choice) -> str:
    info = choice.holder.info
    gpus = f" GPU {_gpu_list(choice.holder.gpus)}" if choice.holder.gpus else ""
    sources = ",".join(sorted(choice.holder.sources))
    where = f", {choice.holder.container.label}" if choice.holder.container else ""
    return (
        f"PID {info.pid} ({info.user}, {choice.role}{gpus}{where}, via {sources}): "
        f"{info.command[:200]}"
    )


def container_fields(choice: Choice) -> dict[str, Any]:
    """GPUGATE_CONTAINER (the id), _RUNTIME and _NAME for a holder in a container."""
    container = choice.holder.container
    if container is None:
        return {}
    fields: dict[str, Any] = {
        "container": container.id,
        "container_runtime": container.runtime,
    }
    if container.name:
        fields["container_name"] = container.name
    return fields


def run_phase(
    phase: str,
    unit: str,
    loaded: LoadedConfig,
    reporter: Reporter,
    *,
    dry_run: bool = False,
    driver_factory: Callable[[], GpuDriver] = NvmlDriver,
    pinner: Callable[[ProcessId, ProcFs], Pinned | None] = pin,
    clock: Callable[[], float] = time.monotonic,
    target_cgroup: str | None = None,
) -> RunSummary:
    """target_cgroup: the cgroup whose processes all die (a Slurm job's); default: the unit's."""
    policy = loaded.config.policy(phase)
    reporter.status("looking for processes holding the GPUs")

    def run_with(driver: GpuDriver) -> RunSummary:
        return PhaseRun(
            phase,
            unit=unit,
            loaded=loaded,
            reporter=reporter,
            driver=driver,
            pinner=pinner,
            clock=clock,
            target_cgroup=target_cgroup,
        ).run(dry_run)

    def degrade(exc: NvmlUnavailable) -> RunSummary:
        # NVML failed at start or mid-run (driver unloaded, GPU lost, query unsupported).
        if policy.on_nvml_error == "fail":
            raise exc
        reporter.event(
            Event.ERROR,
            f"{exc.message}; {phase}.on_nvml_error = warn: cleaning the unit's cgroup only",
            priority=PRIORITY_WARNING,
        )
        return run_with(NoGpus())

    try:
        driver: GpuDriver = driver_factory()
    except NvmlUnavailable as exc:
        return degrade(exc)
    try:
        return run_with(driver)
    except NvmlUnavailable as exc:
        return degrade(exc)
    finally:
        driver.close()


class PhaseRun:
    def __init__(
        self,
        phase: str,
        *,
        unit: str,
        loaded: LoadedConfig,
        reporter: Reporter,
        driver: GpuDriver,
        pinner: Callable[[ProcessId, ProcFs], Pinned | None],
        clock: Callable[[], float],
        target_cgroup: str | None = None,
    ) -> None:
        self.pinner = pinner
        self.phase = phase
        self.unit = unit
        self.loaded = loaded
        self.config = loaded.config
        self.policy = loaded.config.policy(phase)
        self.reporter = reporter
        self.driver = driver
        self.clock = clock
        self.started = clock()
        self.deadline = self.started + self.policy.wait_timeout_s
        self.summary = RunSummary()
        self.used_before: dict[int, int] = {}  # MiB by GPU index, before anything was killed
        paths = self.config.paths
        self.unit_cgroup = target_cgroup or resolve_unit_cgroup(
            unit, paths.cgroup_root, ask_systemd=str(paths.cgroup_root) == DEFAULT_CGROUP_ROOT
        )

    def find(self) -> tuple[Discovery, Decision]:
        procfs = ProcFs(self.config.paths.proc_root)
        found = discover(
            unit=self.unit,
            unit_cgroup=self.unit_cgroup,
            config=self.config,
            config_source=self.loaded.source,
            driver=self.driver,
            procfs=procfs,
            resolve_gpus=not isinstance(self.driver, NoGpus),
        )
        return found, decide(found, self.config, self.phase, procfs)

    def run(self, dry_run: bool) -> RunSummary:
        reporter, summary = self.reporter, self.summary
        discovery, decision = self.find()
        summary.seconds_discover = self.clock() - self.started
        owned = discovery.owned
        summary.owned = list(owned)
        # Before any kill: later rounds rediscover, and by then memory may already be freed.
        self.used_before = {gpu.index: discovery.usage[gpu.index].used_mib for gpu in owned}
        used_before = sum(self.used_before.values())
        reporter.event(
            Event.RUN_STARTED,
            f"{'dry run: ' if dry_run else ''}{len(owned)} GPU(s) "
            f"[{_gpu_list([g.index for g in owned])}], {used_before} MiB used; "
            f"config {self.loaded.source}; cgroup {self.unit_cgroup}",
            gpus=[gpu.index for gpu in owned],
            used_mib=used_before,
            config=self.loaded.source,
        )
        if discovery.unreadable:
            shown = ", ".join(map(str, discovery.unreadable[:10]))
            more = "..." if len(discovery.unreadable) > 10 else ""
            reporter.event(
                Event.ERROR,
                f"not permitted to read the open files of {len(discovery.unreadable)} "
                f"process(es) (PID {shown}{more}): GPU holders among them are invisible; "
                "run gpugate as root",
                priority=PRIORITY_WARNING,
            )
        owned_indices = discovery.owned_indices
        for gpu_index, pid in discovery.invisible:
            if gpu_index in owned_indices:
                reporter.event(
                    Event.ERROR,
                    f"NVML lists PID {pid} on GPU {gpu_index}, but this /proc has no such "
                    "process: gpugate runs in another PID namespace (a container without "
                    "the host's PIDs) and cannot kill it",
                    priority=PRIORITY_WARNING,
                    pid=pid,
                    gpus=[gpu_index],
                )
        _report_choices(reporter, decision, dry_run)
        if decision.refused:
            reporter.status("refused: another unit holds the GPUs")
            summary.exit_code = ExitCode.HELD_BY_OTHERS
            return self.finish()
        if dry_run:
            summary.exit_code = ExitCode.HELD_BY_OTHERS if decision.blockers else ExitCode.OK
            return summary
        # The unit's start/stop timeout may be shorter than our deadline: ask for all of it.
        reporter.extend_timeout(self.deadline - self.clock() + 10)
        with gpu_locks(
            self.config.paths.lock_dir,
            owned,
            self.deadline,
            on_wait=lambda gpu: reporter.status(f"waiting for another gpugate run on {gpu.label}"),
            clock=self.clock,
        ):
            discovery, decision, survivors = self.kill(discovery, decision)
            if survivors:
                summary.exit_code = ExitCode.UNKILLABLE
                reporter.status(f"{len(survivors)} process(es) survived SIGKILL")
            elif decision.blockers:
                summary.exit_code = ExitCode.HELD_BY_OTHERS
                reporter.status("GPUs still held by processes gpugate may not kill")
            else:
                self.wait(discovery, decision)
        return self.finish()

    def kill(
        self, discovery: Discovery, decision: Decision
    ) -> tuple[Discovery, Decision, list[ProcessId]]:
        """Kill the targets; rediscover and repeat while new ones appear (forks)."""
        kill_started = self.clock()
        if self.phase == "pre" and discovery.unit_containers:
            self.stop_containers(discovery, decision)
        by_ident: dict[ProcessId, Choice] = {}
        survivors: list[ProcessId] = []
        for round_number in range(1, MAX_ROUNDS + 1):
            fresh = [c for c in decision.targets if c.holder.info.ident not in by_ident]
            if not fresh:
                break
            self.summary.rounds = round_number
            if round_number > 1:
                _report_choices(self.reporter, Decision(fresh), dry_run=False)
            self.reporter.status(f"stopping {len(fresh)} process(es), round {round_number}")
            by_ident.update((c.holder.info.ident, c) for c in fresh)
            result = terminate(
                [c.holder.info.ident for c in fresh],
                grace_s=self.policy.sigterm_grace_s,
                sigkill_wait_s=self.policy.sigkill_wait_s,
                deadline=self.deadline,
                procfs=ProcFs(self.config.paths.proc_root),
                on_signal=lambda ident, signum: self.on_signal(by_ident[ident], signum),
                on_sigkill_wait=lambda idents: self.on_stuck([by_ident[i] for i in idents]),
                pinner=self.pinner,
                clock=self.clock,
            )
            self.summary.killed.extend(by_ident[i] for i in result.terminated + result.killed)
            survivors = result.survivors
            if survivors or self.clock() >= self.deadline:
                break
            discovery, decision = self.find()
        self.summary.seconds_kill = self.clock() - kill_started
        for ident in survivors:
            self.reporter.event(
                Event.SURVIVOR,
                f"{describe(by_ident[ident])} survived SIGKILL until the deadline",
                priority=PRIORITY_ERR,
                pid=ident.pid,
            )
        return discovery, decision, survivors

    def stop_containers(self, discovery: Discovery, decision: Decision) -> None:
        """The unit's own containers stop through their runtime first (it records them as
        stopped); the pinned signals then follow for any process that outlived it."""
        wanted = {c.holder.container.id for c in decision.targets if c.holder.container}
        containers = [c for c in discovery.unit_containers if c.id in wanted]
        self.reporter.status(f"stopping {len(containers)} container(s) through their runtime")
        for result in stop_containers(containers, self.policy.sigterm_grace_s):
            verb = result.container.runtime + " stop"
            self.reporter.event(
                Event.SIGNAL_SENT,
                f"{verb} {result.container.label}: "
                + (
                    "stopped"
                    if result.ok
                    else f"failed ({result.detail}); signalling its processes"
                ),
                priority=PRIORITY_NOTICE if result.ok else PRIORITY_WARNING,
                signal=verb,
                container=result.container.id,
                container_runtime=result.container.runtime,
                role=Role.UNIT_CONTAINER,
            )

    def on_signal(self, choice: Choice, signum: int) -> None:
        name = signal.Signals(signum).name
        self.reporter.event(
            Event.SIGNAL_SENT,
            f"{name} to {describe(choice)}",
            priority=PRIORITY_NOTICE,
            pid=choice.holder.pid,
            gpus=sorted(choice.holder.gpus),
            signal=name,
            command=choice.holder.info.command,
            comm=choice.holder.info.comm,
            role=choice.role,
            **container_fields(choice),
        )

    def on_stuck(self, choices: list[Choice]) -> None:
        procfs = ProcFs(self.config.paths.proc_root)
        for choice in choices:
            stat = procfs.stat(choice.holder.pid)
            state = stat.state if stat else "?"
            wchan = procfs.wchan(choice.holder.pid)
            self.reporter.event(
                Event.SURVIVOR,
                f"{describe(choice)} is still alive after SIGKILL "
                f"(state {state}, wchan {wchan}); waiting until the deadline",
                priority=PRIORITY_ERR,
                pid=choice.holder.pid,
                state=state,
                wchan=wchan,
            )

    def wait(self, discovery: Discovery, decision: Decision) -> None:
        owned = discovery.owned
        if not owned:
            return
        free_mib = self.config.free_mib
        wait_started = self.clock()

        def on_progress(busy: list[BusyGpu], left: float) -> None:
            first = busy[0]
            self.reporter.status(
                f"waiting for {len(busy)} GPU(s) to free memory: {first.gpu.label} "
                f"{first.used_mib} MiB used (free at {free_mib}), {left:.0f} s left"
            )
            self.reporter.extend_timeout(left + 10)

        busy = wait_until_free(
            self.driver,
            owned,
            free_mib=free_mib,
            ignored_pids={c.holder.pid for c in decision.spared},
            deadline=self.deadline,
            on_progress=on_progress,
            clock=self.clock,
        )
        self.summary.seconds_wait = self.clock() - wait_started
        self.summary.busy = busy
        for gpu in owned:
            used_after = self.driver.usage(gpu).used_mib
            freed = max(self.used_before.get(gpu.index, 0) - used_after, 0)
            self.summary.freed_mib_by_gpu[gpu.index] = freed
        self.summary.freed_mib = sum(self.summary.freed_mib_by_gpu.values())
        for item in busy:
            holders = ", ".join(str(pid) for pid in item.pids) or "no process"
            self.reporter.event(
                Event.TIMEOUT,
                f"{item.gpu.label} still has {item.used_mib} MiB used (free at {free_mib} MiB)"
                f" after {self.policy.wait_timeout_s:g} s; NVML lists: {holders}",
                priority=PRIORITY_ERR if self.policy.on_timeout == "fail" else PRIORITY_WARNING,
                gpus=[item.gpu.index],
                used_mib=item.used_mib,
                gpu_uuid=item.gpu.uuid,
            )
        if not busy:
            self.reporter.event(
                Event.MEMORY_FREED,
                f"GPU {_gpu_list([g.index for g in owned])} free "
                f"(at or below {free_mib} MiB) after {self.summary.seconds_wait:.2f} s",
                gpus=[gpu.index for gpu in owned],
            )
        elif self.policy.on_timeout == "fail":
            self.summary.exit_code = ExitCode.MEMORY_TIMEOUT

    def finish(self) -> RunSummary:
        summary = self.summary
        result = "success" if summary.exit_code is ExitCode.OK else summary.exit_code.name.lower()
        self.reporter.event(
            Event.RUN_FINISHED,
            f"{result}: {len(summary.killed)} process(es) stopped in {summary.rounds} round(s);"
            f" discover {summary.seconds_discover * 1000:.0f} ms, kill {summary.seconds_kill:.2f}"
            f" s, wait {summary.seconds_wait:.2f} s",
            priority=PRIORITY_NOTICE if summary.exit_code is ExitCode.OK else PRIORITY_ERR,
            result=result,
            killed=len(summary.killed),
            seconds_wait=f"{summary.seconds_wait:.3f}",
            freed_mib=summary.freed_mib,
        )
        self.reporter.status(f"done: {result}")
        return summary


def _report_choices(reporter: Reporter, decision: Decision, dry_run: bool) -> None:
    kill_verb = "would kill" if dry_run else "will kill"
    for choices, event, priority, verb in (
        (decision.targets, Event.HOLDER_FOUND, PRIORITY_INFO, kill_verb),
        (decision.blockers, Event.REFUSED, PRIORITY_ERR, "not killing"),
        (
            [c for c in decision.spared if c.holder.gpus],
            Event.PROCESS_SPARED,
            PRIORITY_INFO,
            "sparing",
        ),
    ):
        for choice in choices:
            reporter.event(
                event,
                f"{verb} {describe(choice)}: {choice.reason}",
                priority=priority,
                pid=choice.holder.pid,
                gpus=sorted(choice.holder.gpus),
                role=choice.role,
                command=choice.holder.info.command,
                reason=choice.reason,
                **container_fields(choice),
            )
