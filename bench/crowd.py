"""A crowd of processes for the benchmarks: small C sleepers, some holding many fds and
mappings, a few holding the stand-in device files; all of them killed and reaped at the end.

The sleepers are children of one leader (sleepers.c) that the benchmark starts in a process
group of its own; the leader kills and reaps them when its stdin closes, which also happens
when the benchmark dies. Nothing else is ever signalled.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUILD = REPO / ".bench"
GPU_FILES = tuple(f"nvidia{i}" for i in range(8))
CONTROL_FILES = ("nvidiactl", "nvidia-uvm")


class BenchError(RuntimeError):
    """A benchmark could not be set up (no compiler, a tool missing, a limit too low)."""


def compile_c(source: Path, name: str, *flags: str) -> Path:
    """gcc -O2 source into .bench/NAME, unless it is already newer than the source."""
    target = BUILD / name
    if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BenchError("gcc not found: install it (scripts/setup does)")
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    result = subprocess.run(
        [gcc, "-O2", "-Wall", "-Wextra", *flags, "-o", str(tmp), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise BenchError(f"gcc {source.name} failed:\n{result.stderr}")
    tmp.replace(target)
    return target


def make_device_root(root: Path) -> Path:
    """Stand-in /dev: empty regular files nvidia0..7, nvidiactl, nvidia-uvm."""
    root.mkdir(parents=True, exist_ok=True)
    for name in (*GPU_FILES, *CONTROL_FILES):
        (root / name).touch()
    return root


@dataclass(frozen=True)
class Mix:
    """What the crowd looks like: COUNT sleepers, every HEAVY_EVERY-th one with HEAVY_FDS
    open fds and HEAVY_MAPS file mappings (a service-like process), the rest with 3 fds."""

    heavy_every: int = 20
    heavy_fds: int = 256
    heavy_maps: int = 200

    def describe(self, count: int) -> str:
        heavy = (count + self.heavy_every - 1) // self.heavy_every if self.heavy_every else 0
        return (
            f"{count} C sleepers; {heavy} of them (every {self.heavy_every}th) hold "
            f"{self.heavy_fds} fds (files, pipes, /dev/null) and {self.heavy_maps} file "
            "mappings, the others 3 fds (/dev/null)"
        )


@dataclass
class Crowd:
    """COUNT sleepers plus one per holder spec ("fd:PATH" holds it open, "map:PATH" only
    mapped); a context manager. `holders` maps each holder spec to its PID."""

    count: int
    holder_specs: tuple[str, ...] = ()
    mix: Mix = field(default_factory=Mix)
    pids: list[int] = field(default_factory=list)
    holders: dict[str, int] = field(default_factory=dict)
    spawn_seconds: float = 0.0
    _leader: subprocess.Popen[str] | None = None

    def __enter__(self) -> Crowd:
        self._check_limits()
        binary = compile_c(HERE / "sleepers.c", "sleepers")
        filler = BUILD / "filler"
        if not filler.exists() or filler.stat().st_size < 65536:
            filler.write_bytes(b"\0" * 65536)
        started = time.monotonic()
        self._leader = subprocess.Popen(
            [
                str(binary),
                str(self.count),
                str(self.mix.heavy_every),
                str(self.mix.heavy_fds),
                str(self.mix.heavy_maps),
                str(filler),
                *self.holder_specs,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group (process_group= is 3.11+)
        )
        assert self._leader.stdout is not None
        try:
            for line in self._leader.stdout:
                if line.strip() == "READY":
                    break
                self.pids.append(int(line))
            else:
                raise BenchError(f"sleepers exited ({self._leader.wait()}) before READY")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        assert len(self.pids) == self.count + len(self.holder_specs)
        self.holders = dict(zip(self.holder_specs, self.pids[self.count :]))
        self.spawn_seconds = time.monotonic() - started
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        leader = self._leader
        if leader is None:
            return
        self._leader = None
        assert leader.stdin is not None
        leader.stdin.close()  # the leader SIGKILLs and reaps every sleeper it forked
        try:
            leader.wait(timeout=120)
        except subprocess.TimeoutExpired:
            # Our own process group, created for this crowd: nothing else is in it.
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()
        if leader.stdout is not None:
            leader.stdout.close()
        left = [pid for pid in self.pids if _is_our_sleeper(pid, leader.pid)]
        if left:
            raise BenchError(f"{len(left)} sleepers outlived the crowd: {left[:10]}")

    def _check_limits(self) -> None:
        wanted = self.count + len(self.holder_specs) + 1
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        running = sum(1 for name in os.listdir("/proc") if name.isdigit())
        if running + wanted > pid_max * 0.9:
            raise BenchError(f"{wanted} more processes would come near pid_max ({pid_max})")
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY and os.geteuid() != 0 and running + wanted > soft:
            raise BenchError(f"ulimit -u is {soft}: too low for {wanted} more processes")


def _is_our_sleeper(pid: int, leader: int) -> bool:
    """Still alive and still in the crowd's process group (a recycled PID is not ours)."""
    try:
        return os.getpgid(pid) == leader
    except ProcessLookupError:
        return False
