"""What a run tells the operator: the wording and fields of its journal entries and STATUS=
lines. The pipeline says what happened (`Narrator.signal_sent(choice, signum)`); this module
says it in words, so the run's sequence and its narration can each be read on their own. The
wait's wording is `narrate_wait`; how a holder is named in words, `holder_text`."""

from __future__ import annotations

import signal
from typing import TextIO

from gpugate.core.decide import Choice, Decision
from gpugate.core.discover import Discovery
from gpugate.core.outcome import RunSummary
from gpugate.core.roles import Role
from gpugate.errors import GateError
from gpugate.host.containers import StopResult
from gpugate.host.nvml import GpuFault
from gpugate.report.holder_text import container_fields, container_text, describe
from gpugate.report.journal import (
    PRIORITY_ERR,
    PRIORITY_INFO,
    PRIORITY_NOTICE,
    PRIORITY_WARNING,
    Event,
    Reporter,
    WaitingReports,
)
from gpugate.report.lines import MAX_LISTED_PIDS, gpu_list
from gpugate.report.narrate_shm import ShmNarration
from gpugate.report.narrate_wait import WaitNarration
from gpugate.report.reasons import reason_text
from gpugate.untrusted import COMM, COMMAND, exact


def watcher_evidence(discovery: Discovery) -> str:
    if discovery.nvml_lists_processes:
        return "NVML lists the GPUs' processes: a device-file holder it lists nowhere is a watcher"
    return "NVML lists no processes here: device files alone name the holders (no watchers)"


def cut_short_text(pids: list[int]) -> str:
    """Processes whose open files the run's deadline left unread (millions of descriptors)."""
    shown = ", ".join(map(str, pids[:MAX_LISTED_PIDS]))
    more = ", …" if len(pids) > MAX_LISTED_PIDS else ""
    return (
        f"the open files of {len(pids)} process(es) (PID {shown}{more}) were not all read "
        "before the deadline"
    )


def stop_failure(result: StopResult) -> str:
    """Why a runtime's stop failed, in words."""
    if result.no_cli:
        return f"no {result.container.runtime} CLI found"
    return result.error.message if result.error is not None else result.detail


class Narrator(WaitNarration, ShmNarration):
    """One run's journal entries and STATUS= lines, through the run's Reporter."""

    def __init__(self, reporter: Reporter) -> None:
        """reporter: a dry run's is Reporter.as_dry_run()'s (its words say "would")."""
        self.reporter = reporter
        self.dry_run = reporter.dry_run
        self.waiting = WaitingReports(reporter)

    def looking(self) -> None:
        self.status("looking for processes holding the GPUs")

    def run_started(
        self,
        discovery: Discovery,
        config_source: str,
        used_mib: int,
        *,
        gpu_source: str = "",
        gpu_source_warns: bool = False,
    ) -> None:
        """gpu_source: where the unit's GPUs came from (gpu_source.GpuChoice.source)."""
        owned = [gpu.index for gpu in discovery.owned]
        source = f"GPUs from {gpu_source}; " if gpu_source else ""
        self.reporter.event(
            Event.RUN_STARTED,
            f"{'dry run: ' if self.dry_run else ''}{len(owned)} GPU(s) [{gpu_list(owned)}], "
            f"{used_mib} MiB used; {source}config {config_source}; "
            f"cgroup {discovery.unit_cgroup}; {watcher_evidence(discovery)}",
            priority=PRIORITY_WARNING if gpu_source_warns else PRIORITY_INFO,
            gpus=owned,
            used_mib=used_mib,
            config=config_source,
            gpu_source=gpu_source or config_source,
            evidence="nvml" if discovery.nvml_lists_processes else "device-files",
        )

    def blind_spots(self, discovery: Discovery) -> None:
        """What this run cannot see: other users' open files, another PID namespace."""
        if discovery.unreadable:
            shown = ", ".join(map(str, discovery.unreadable[:MAX_LISTED_PIDS]))
            more = ", …" if len(discovery.unreadable) > MAX_LISTED_PIDS else ""
            self.reporter.event(
                Event.WARNING,
                f"not permitted to read the open files of {len(discovery.unreadable)} "
                f"process(es) (PID {shown}{more}): GPU holders among them are invisible; "
                "run gpugate as root",
                priority=PRIORITY_WARNING,
                reason="unreadable",
            )
        if discovery.cut_short:
            self.reporter.event(
                Event.WARNING,
                f"{cut_short_text(discovery.cut_short)}: GPU holders among them may be missed",
                priority=PRIORITY_WARNING,
                reason="scan-cut-short",
            )
        owned = discovery.owned_indices
        for gpu_index, pid in discovery.invisible:
            if gpu_index in owned:
                self.reporter.event(
                    Event.WARNING,
                    f"NVML lists PID {pid} on GPU {gpu_index}, but this /proc has no such "
                    "process: gpugate runs in another PID namespace (a container without "
                    "the host's PIDs) and cannot kill it",
                    priority=PRIORITY_WARNING,
                    pid=pid,
                    gpus=[gpu_index],
                    reason="other-pid-namespace",
                )

    def choices(self, decision: Decision) -> None:
        would = self.dry_run
        for choices, event, priority, verb in (
            (
                decision.targets,
                Event.HOLDER_FOUND,
                PRIORITY_INFO,
                "would kill" if would else "will kill",
            ),
            (
                decision.blockers,
                Event.REFUSED,
                PRIORITY_ERR,
                "would not kill" if would else "not killing",
            ),
            (
                [c for c in decision.spared if c.holder.gpus],
                Event.PROCESS_SPARED,
                PRIORITY_INFO,
                "would spare" if would else "sparing",
            ),
        ):
            for choice in choices:
                self.reporter.event(
                    event,
                    f"{verb} {describe(choice)}: "
                    f"{reason_text(choice, self.reporter.unit, self.reporter.phase)}",
                    priority=priority,
                    pid=choice.holder.pid,
                    gpus=sorted(choice.holder.gpus),
                    role=choice.role,
                    command=exact(choice.holder.info.command, COMMAND),
                    reason=choice.rule.value,
                    **container_fields(choice),
                )

    def refused(self) -> None:
        self.status("refused: another unit or account holds the GPUs")

    def stopping(self, count: int, round_number: int) -> None:
        self.status(f"stopping {count} process(es), round {round_number}")

    def signal_sent(self, choice: Choice, signum: int) -> None:
        name = signal.Signals(signum).name
        self.reporter.event(
            Event.SIGNAL_SENT,
            f"{name} to {describe(choice)}",
            priority=PRIORITY_NOTICE,
            pid=choice.holder.pid,
            gpus=sorted(choice.holder.gpus),
            signal=name,
            command=exact(choice.holder.info.command, COMMAND),
            comm=exact(choice.holder.info.comm, COMM),
            role=choice.role,
            **container_fields(choice),
        )

    def container_stopping(self, count: int) -> None:
        self.status(f"stopping {count} container(s) through their runtime")

    def container_stopped(self, result: StopResult) -> None:
        verb = f"{result.container.runtime} stop"
        outcome = (
            "stopped" if result.ok else f"failed ({stop_failure(result)}); signalling its processes"
        )
        self.reporter.event(
            Event.SIGNAL_SENT,
            f"{verb} {container_text(result.container)}: {outcome}",
            priority=PRIORITY_NOTICE if result.ok else PRIORITY_WARNING,
            signal=verb,
            container=result.container.id,
            container_runtime=result.container.runtime,
            role=Role.UNIT_CONTAINER,
        )

    def stuck(self, choice: Choice, state: str, wchan: str) -> None:
        self.reporter.event(
            Event.SURVIVOR,
            f"{describe(choice)} is still alive after SIGKILL "
            f"(state {state}, wchan {wchan}); waiting until the deadline",
            priority=PRIORITY_ERR,
            pid=choice.holder.pid,
            state=state,
            wchan=wchan,
        )

    def survivor(self, choice: Choice) -> None:
        self.reporter.event(
            Event.SURVIVOR,
            f"{describe(choice)} survived SIGKILL until the deadline",
            priority=PRIORITY_ERR,
            pid=choice.holder.pid,
        )

    def survived(self, count: int) -> None:
        self.status(f"{count} process(es) survived SIGKILL")

    def still_held(self) -> None:
        self.status("GPUs still held by processes gpugate may not kill")

    def extend_timeout(self, seconds: float) -> None:
        self.reporter.extend_timeout(seconds)

    def fault_elsewhere(self, fault: GpuFault, unit: str) -> None:
        self.reporter.event(
            Event.WARNING,
            f"{fault.error}; not a GPU of {unit}: going on with its own GPUs",
            priority=PRIORITY_WARNING,
            gpus=[fault.index],
            reason="gpu-fault",
        )

    def degraded(self, error: GateError, phase: str) -> None:
        self.reporter.event(
            Event.WARNING,
            f"{error.message}; {phase}.on_nvml_error = warn: cleaning the unit's cgroup only",
            priority=PRIORITY_WARNING,
            reason="nvml-degraded",
        )

    def nvml_skipped(self, why: str, phase: str) -> None:
        self.reporter.event(
            Event.WARNING,
            f"not asking NVML: this start's pre found it not answering ({why}); {phase} "
            "cleans the unit's cgroup only",
            priority=PRIORITY_WARNING,
            reason="nvml-not-answering",
        )

    def finished(self, summary: RunSummary) -> None:
        result = summary.result
        if self.dry_run:
            self.dry_run_finished(summary)
            return
        self.reporter.event(
            Event.RUN_FINISHED,
            f"{result}: {len(summary.killed)} process(es) stopped in {summary.rounds} round(s);"
            f" discover {summary.seconds_discover * 1000:.0f} ms, kill {summary.seconds_kill:.2f}"
            f" s, wait {summary.seconds_wait:.2f} s",
            priority=PRIORITY_NOTICE if summary.result == "success" else PRIORITY_ERR,
            result=result,
            killed=len(summary.killed),
            seconds_wait=f"{summary.seconds_wait:.3f}",
            freed_mib=summary.freed_mib,
        )
        if result == "success":
            self.reporter.clear_status()  # the service runs on: no gpugate words under it
        else:
            self.status(f"done: {result}")

    def dry_run_finished(self, summary: RunSummary) -> None:
        """A dry run's last line, also when nothing would be killed."""
        result = summary.result
        verdict = (
            "the run would succeed" if result == "success" else f"the run would fail: {result}"
        )
        self.reporter.event(
            Event.RUN_FINISHED,
            f"dry run: would kill {summary.would_kill} process(es); {verdict}; nothing was killed",
            priority=PRIORITY_NOTICE,
            result=result,
            would_kill=summary.would_kill,
        )

    def state_unwritable(self, error: GateError) -> None:
        """A phase after a stop found its state folder unwritable (full, read-only, missing):
        it goes on; what it then cannot record it says as it comes."""
        self.reporter.event(
            Event.WARNING,
            f"{error.message}; {self.reporter.phase} goes on: killing what is left and "
            "removing its files need no space",
            priority=PRIORITY_WARNING,
            reason="state-unwritable",
            problem=error.code,
        )

    def lock_not_taken(self, path: object, cause: str) -> None:
        self.reporter.event(
            Event.WARNING,
            f"{path}: GPU lock not taken ({cause}); {self.reporter.phase} goes on without it",
            priority=PRIORITY_WARNING,
            reason="lock-not-taken",
        )

    def metrics_not_written(self, path: object, cause: str) -> None:
        """Metrics are never a run's failure (docs/metrics.md): a warning, the run's exit as
        it was."""
        self.reporter.event(
            Event.WARNING,
            f"metrics not written to {path}: {cause}; the run's result stands",
            priority=PRIORITY_WARNING,
            reason="metrics-unwritable",
        )

    def failed(self, error: GateError, error_stream: TextIO | None = None) -> None:
        """A run that ended in an error: one entry (with its code where it has
        one), and one line on error_stream (default stderr) where it is not the journal already."""
        self.reporter.fail(error.message, int(error.exit_code), error_stream, error.code)
