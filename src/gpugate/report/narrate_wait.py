"""What a run tells the operator while it waits, and when the wait ends: another run's lock,
memory not yet freed, respawns, ports still listened on, the GPUs free. `narrate.Narrator`
says the rest of the run."""

from __future__ import annotations

from collections.abc import Sequence

from gpugate.core.kill import Respawner
from gpugate.core.outcome import BusyGpu
from gpugate.host.nvml import Gpu
from gpugate.report.journal import PRIORITY_ERR, PRIORITY_WARNING, Event, Reporter, WaitingReports
from gpugate.untrusted import COMMAND, exact, shown


class WaitNarration:
    """The wait's journal entries and STATUS= lines; `Narrator` is one."""

    reporter: Reporter
    waiting: WaitingReports

    def status(self, text: str) -> None:
        self.reporter.status(text)

    def lock_wait(self, gpu: Gpu, left_s: float) -> None:
        self.status(f"waiting for another gpugate run on {gpu.label}")
        self.waiting.lock(gpu.label, gpu.index, left_s)

    def memory_wait(self, busy: Sequence[BusyGpu], free_mib: int, left_s: float) -> None:
        first = busy[0]
        self.status(
            f"waiting for {len(busy)} GPU(s) to free memory: {first.gpu.label} "
            f"{first.used_mib} MiB used (free at {free_mib}), {left_s:.0f} s left"
        )
        self.waiting.memory({item.gpu.index: item.used_mib for item in busy}, free_mib, left_s)

    def memory_timeout(
        self, item: BusyGpu, free_mib: int, timeout_s: float, *, failing: bool
    ) -> None:
        holders = ", ".join(str(pid) for pid in item.pids) or "no process"
        self.reporter.event(
            Event.TIMEOUT,
            f"{item.gpu.label} still has {item.used_mib} MiB used (free at {free_mib} MiB)"
            f" after {timeout_s:g} s; NVML lists: {holders}",
            priority=PRIORITY_ERR if failing else PRIORITY_WARNING,
            gpus=[item.gpu.index],
            used_mib=item.used_mib,
            gpu_uuid=item.gpu.uuid,
        )

    def respawning(self, respawners: Sequence[Respawner], timeout_s: float) -> None:
        for respawner in respawners:
            info = respawner.info
            self.reporter.event(
                Event.TIMEOUT,
                f"PID {info.pid} ({info.user}): {shown(info.command, COMMAND)} respawned the "
                f"holders {respawner.respawns} time(s) and was still respawning after "
                f"{timeout_s:g} s; it is not part of the application (a login shell, a "
                "supervisor): stop it, or run the server under the unit",
                priority=PRIORITY_ERR,
                pid=info.pid,
                command=exact(info.command, COMMAND),
                respawns=respawner.respawns,
                reason="respawning",
            )
        self.status("failed: the holders keep respawning")

    def respawned(self, respawner: Respawner) -> None:
        info = respawner.info
        self.reporter.event(
            Event.HOLDER_FOUND,
            f"PID {info.pid} ({info.user}): {shown(info.command, COMMAND)} respawned the holders "
            f"{respawner.respawns} time(s) during the wait; each respawn was killed",
            priority=PRIORITY_WARNING,
            pid=info.pid,
            command=exact(info.command, COMMAND),
            respawns=respawner.respawns,
            reason="respawned",
        )

    def ports_held(self, ports: Sequence[int], timeout_s: float) -> None:
        self.reporter.event(
            Event.TIMEOUT,
            f"TCP port {', '.join(map(str, ports))} still listened on after {timeout_s:g} s "
            "by a process gpugate cannot see (not root, or its fds are unreadable)",
            priority=PRIORITY_ERR,
            ports=",".join(map(str, ports)),
        )

    def memory_freed(self, owned: Sequence[Gpu], free_mib: int, seconds: float) -> None:
        self.reporter.event(
            Event.MEMORY_FREED,
            f"GPU {', '.join(gpu.shown for gpu in sorted(owned, key=lambda g: g.index))} free "
            f"(at or below {free_mib} MiB) after {seconds:.2f} s",
            gpus=[gpu.index for gpu in owned],
        )
