"""Timing one command or one call: wall clock, CPU time and peak RSS, and medians."""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Run:
    wall: float  # seconds
    cpu: float  # seconds, user + system
    rss_kib: int  # peak resident set size of the process (ru_maxrss)
    returncode: int
    stdout: str
    stderr: str


def run_timed(
    argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 300
) -> Run:
    """Run argv to its end; wall time from just before the fork to just after the reap, and
    the process's own CPU time and peak RSS from wait4(). Output goes to files, so that no
    reading of pipes sits between the exit and the reap."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=None if env is None else dict(env),
        )
        watchdog = threading.Timer(timeout, proc.kill)  # our own child
        watchdog.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            watchdog.cancel()
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Run(
            wall=wall,
            cpu=usage.ru_utime + usage.ru_stime,
            rss_kib=usage.ru_maxrss,
            returncode=proc.returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
        )


@dataclass
class Samples:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)

    def add(self, wall: float, cpu: float, rss_kib: int = 0) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)
        if rss_kib:
            self.rss_kib.append(rss_kib)

    @property
    def wall_ms(self) -> float:
        return statistics.median(self.wall) * 1000

    @property
    def cpu_ms(self) -> float:
        return statistics.median(self.cpu) * 1000

    @property
    def peak_rss_mib(self) -> float:
        return max(self.rss_kib) / 1024 if self.rss_kib else 0.0


def ms(value: float) -> str:
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def ratio(baseline: float, ours: float) -> str:
    return f"{baseline / ours:.1f}x" if ours > 0 else "n/a"
