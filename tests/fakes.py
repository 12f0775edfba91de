"""Test doubles for gpugate's injected I/O: a GPU driver whose memory follows real child
processes, a journal and a notifier that record what they were told."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpugate.config.file import LoadedConfig
from gpugate.config.schema import GateConfig
from gpugate.core.outcome import RunSummary
from gpugate.core.run import RunScope
from gpugate.errors import GateError, GpuError
from gpugate.front.hook import Hook, run_phase
from gpugate.host.nvml import Gpu, GpuFault, GpuProcess, GpuUsage, MigSlice, mig_key
from gpugate.host.systemd import HostRoots
from gpugate.integrations.unit import UnitContext
from gpugate.phase import Phase
from gpugate.report.journal import Reporter


def alive(pid: int, start_time: int | None = None) -> bool:
    try:
        with open(f"/proc/{pid}/stat", errors="replace") as handle:
            text = handle.read()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited as we opened it
        return False
    fields = text[text.rfind(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def start_time_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", errors="replace") as handle:
        text = handle.read()
    return int(text[text.rfind(")") + 2 :].split()[19])


def mig_uuid(index: int, gi: int, ci: int) -> str:
    """The stand-in NVML's MIG UUID of a slice (tests/fake_nvml/fake_nvml.c)."""
    return f"MIG-fa4e5a11-0000-0000-0000-{index:04x}{gi:04x}{ci:04x}"


def run_summary(**fields: object) -> RunSummary:
    """A RunSummary as a run fills it in: its fields set one by one."""
    summary = RunSummary()
    for name, value in fields.items():
        assert hasattr(summary, name), name
        setattr(summary, name, value)
    return summary


@dataclass
class FakeGpuMemory:
    """GPU memory that a registered process uses while it lives, plus a release lag after it
    exits, plus memory leaked with no process at all. Knows nothing of gpugate's discovery."""

    count: int = 8
    total_mib: int = 97887
    release_lag_s: float = 0.0
    minors: Sequence[int] | None = None
    claims: dict[tuple[int, int], tuple[set[int], int]] = field(default_factory=dict)
    leaked_mib: dict[int, int] = field(default_factory=dict)
    gone_at: dict[tuple[int, int], float] = field(default_factory=dict)
    listed_without_memory: dict[int, list[int]] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)  # as NVML_ERROR_GPU_IS_LOST: not listed
    failing_usage: set[int] = field(default_factory=set)  # listed, but usage() fails
    queries: int = 0
    claim_dir: Path | None = None  # a process may claim for itself: a file PID holding "GPU MIB"
    lists_processes: bool = True  # False: a driver that cannot list processes (NotSupported)
    # GPUs in MIG mode: index -> its slices' (GI, CI, MiB); a slice is claimed by its mig_key,
    # and its GPU lists the slice's processes too (on_slice), as NVML aggregates them
    mig: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    mps_clients: set[int] = field(default_factory=set)  # PIDs NVML lists as MPS clients

    def _self_claims(self) -> None:
        if self.claim_dir is None:
            return
        for path in self.claim_dir.glob("[0-9]*"):
            pid = int(path.name)
            try:
                gpu, mib = map(int, path.read_text().split())
                key = (pid, start_time_of(pid))
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue  # half written, or the process is gone
            self.claims.setdefault(key, ({gpu}, mib))

    def claim(self, pid: int, gpus: set[int], mib: int) -> None:
        self.claims[(pid, start_time_of(pid))] = (gpus, mib)

    def gpus(self) -> Sequence[Gpu]:
        minors = self.minors or list(range(self.count))
        found: list[Gpu] = []
        for i in range(self.count):
            if i in self.lost:
                continue
            uuid = f"GPU-fa4e5a11-0000-0000-0000-{i:012x}"
            found.append(
                Gpu(i, uuid, minors[i], "Fake GPU", self.total_mib, mig_mode=i in self.mig)
            )
            for k, (gi, ci, mib) in enumerate(self.mig.get(i, [])):
                mig = MigSlice(i, uuid, k, gi, ci, "1g.10gb")
                found.append(
                    Gpu(mig_key(i, k), mig_uuid(i, gi, ci), minors[i], "Fake GPU MIG", mib, mig=mig)
                )
        return found

    def faults(self) -> Sequence[GpuFault]:
        return [
            GpuFault(
                i, GpuError(i, f"NVML: GPU {i} is lost (fell off the bus)", code="nvml-gpu-lost")
            )
            for i in sorted(self.lost)
        ]

    def usage(self, gpu: Gpu) -> GpuUsage:
        self.queries += 1
        self._self_claims()
        if gpu.index in self.failing_usage:
            raise GpuError(
                gpu.index, f"NVML: nvmlDeviceGetMemoryInfo on GPU {gpu.index}: Unknown Error"
            )
        used = self.leaked_mib.get(gpu.index, 0)
        processes: list[GpuProcess] = []
        now = time.monotonic()
        slices = {mig_key(gpu.index, k) for k in range(len(self.mig.get(gpu.index, [])))}
        for key, (gpus, mib) in list(self.claims.items()):
            on_slice = bool(gpus & slices)
            if gpu.index not in gpus and not on_slice:
                continue
            if alive(*key):
                used += mib
                client = key[0] in self.mps_clients
                processes.append(GpuProcess(key[0], mib, on_slice=on_slice, mps_client=client))
            else:
                gone = self.gone_at.setdefault(key, now)
                if now - gone < self.release_lag_s:
                    used += mib
        processes.extend(
            GpuProcess(pid, None) for pid in self.listed_without_memory.get(gpu.index, [])
        )
        if not self.lists_processes:
            return GpuUsage(gpu, used, (), processes_listed=False)
        return GpuUsage(gpu, used, tuple(processes))

    def answer_by(self, deadline: float) -> None:
        pass  # answers at once

    def not_answering(self) -> None:
        return None

    def close(self) -> None:
        pass


@dataclass
class RecordingJournal:
    entries: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def send(self, message: str, fields: dict[str, str]) -> None:
        self.entries.append((message, dict(fields)))

    def events(self, name: str) -> list[dict[str, str]]:
        return [{"MESSAGE": m, **f} for m, f in self.entries if f.get("GPUGATE_EVENT") == name]


@dataclass
class RecordingNotifier:
    states: list[str] = field(default_factory=list)

    def notify(self, state: str) -> None:
        self.states.append(state)


HOLDER_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    paths, ignore_term, children, ready = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
    handles = [open(p, "rb") for p in paths.split(",") if p]
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for _ in range(children):
        if os.fork() == 0:
            break  # the child keeps the inherited device handles and the same behaviour
    with open(f"{ready}.{os.getpid()}", "w") as f:
        f.write("ok")
    while True:
        time.sleep(3600)
    """
)


@dataclass
class ProcessPool:
    """Real processes started by a test; `cleanup` kills exactly those and nothing else."""

    workdir: Path
    started: list[tuple[int, int]] = field(default_factory=list)
    popens: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def holder(
        self,
        paths: Sequence[Path],
        *,
        ignore_term: bool = False,
        children: int = 0,
        new_session: bool = False,
        argv0: str | None = None,
    ) -> list[int]:
        """Start a process holding the files open; with children, it forks that many which
        inherit the handles. Returns the PIDs (parent first)."""
        ready = self.workdir / f"ready-{len(self.popens)}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                HOLDER_SCRIPT,
                ",".join(str(p) for p in paths),
                "1" if ignore_term else "0",
                str(children),
                str(ready),
            ],
            start_new_session=new_session,
        )
        self.popens.append(proc)
        deadline = time.monotonic() + 15
        while len(list(self.workdir.glob(f"{ready.name}.*"))) < children + 1:
            if time.monotonic() > deadline:
                raise TimeoutError("holder processes did not start")
            time.sleep(0.01)
        pids = sorted(int(p.suffix[1:]) for p in self.workdir.glob(f"{ready.name}.*"))
        pids.remove(proc.pid)
        pids.insert(0, proc.pid)
        for pid in pids:
            self.started.append((pid, start_time_of(pid)))
        return pids

    def command(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        # Popen returns once the exec succeeded (its error pipe closed): the PID is the program's.
        proc = subprocess.Popen(list(argv), **kwargs)  # type: ignore[call-overload]
        self.popens.append(proc)
        self.started.append((proc.pid, start_time_of(proc.pid)))
        return proc

    @staticmethod
    def until(ready: Callable[[], bool], what: str, timeout_s: float = 15) -> None:
        """Block until a process says it is ready (a condition it makes true), or fail."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.01)

    def cleanup(self) -> None:
        for pid, start in self.started:
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            proc.wait(timeout=10)


UNIT = "vllm.service"
UNIT_CGROUP = "/system.slice/vllm.service"


@dataclass
class FakeHost:
    """A stand-in device root and cgroup tree, a fake GPU memory, and real processes."""

    root: Path
    dev: Path
    cgroup_root: Path
    memory: FakeGpuMemory
    pool: ProcessPool
    journal: RecordingJournal
    notifier: RecordingNotifier

    @property
    def run(self) -> Path:
        """The host's /run (gpugate keeps its config cache there)."""
        return self.root / "run"

    def device(self, name: str) -> Path:
        return self.dev / name

    def gpu_files(self, *indices: int) -> list[Path]:
        return [self.dev / "nvidiactl", self.dev / "nvidia-uvm"] + [
            self.dev / f"nvidia{i}" for i in indices
        ]

    def put_in_unit(self, *pids: int, cgroup: str = UNIT_CGROUP) -> None:
        procs = self.cgroup_root / cgroup.lstrip("/") / "cgroup.procs"
        procs.parent.mkdir(parents=True, exist_ok=True)
        existing = procs.read_text() if procs.exists() else ""
        procs.write_text(existing + "".join(f"{pid}\n" for pid in pids))

    @property
    def roots(self) -> HostRoots:
        return HostRoots(dev=self.dev, cgroup=self.cgroup_root, run=self.run)

    @property
    def roots_args(self) -> list[str]:
        """The same roots for a gpugate run as a command (its hidden --host-roots option)."""
        return ["--host-roots", f"dev={self.dev},cgroup={self.cgroup_root},run={self.run}"]

    def run_phase(
        self, phase: str, loaded: LoadedConfig, reporter: Reporter, **kwargs: Any
    ) -> RunSummary:
        """gpugate's run_phase on this host: the unit's stand-in cgroup, these roots."""
        cgroup = kwargs.pop("unit_cgroup", UNIT_CGROUP)
        scope = RunScope(Phase(phase), UNIT, lambda: cgroup, for_uid=kwargs.pop("for_uid", None))
        return run_unit_phase(scope, loaded, reporter, roots=self.roots, **kwargs)

    def config(self, **overrides: object) -> LoadedConfig:
        def fast(phase: dict[str, object]) -> dict[str, object]:
            # Kill steps fit in the deadline (the config requires it), also in a short one.
            wait_s = float(phase.get("wait_timeout_s", 10.0))  # type: ignore[arg-type]
            step_s = min(1.0, wait_s / 4)
            return {"sigterm_grace_s": step_s, "sigkill_wait_s": step_s, **phase}

        data: dict[str, object] = {
            "lock_dir": self.root / "locks",
            "pre": fast(dict(overrides.pop("pre", {}))),  # type: ignore[call-overload]
            "post": {
                "kill_orphans": False,
                "kill_app_tree": False,
                **fast(dict(overrides.pop("post", {}))),  # type: ignore[call-overload]
            },
            **overrides,
        }
        return LoadedConfig(GateConfig.model_validate(data), "test.toml")

    def reporter(self, phase: str = "pre") -> Reporter:
        return Reporter(UNIT, phase, journal=self.journal, notifier=self.notifier, echo=False)


def run_unit_phase(
    scope: RunScope,
    loaded: LoadedConfig,
    reporter: Reporter,
    *,
    roots: HostRoots,
    dry_run: bool = False,
    environ: Any = None,
    shm_host: Any = None,
    unit_env: Any = None,
    **kwargs: Any,
) -> RunSummary:
    """A unit's phase run as the front wires it, with the tests' stand-ins: environ (the
    hook's environment, default ours), unit_env (systemd's answer), shm_host (areas -> the
    shm files' host side); kwargs: UnitContext's guard_manual_run, active_state, ignore_leases, unit_state,
    and RunScope's driver_factory, pinner, clock."""
    unit = {
        k: kwargs.pop(k)
        for k in ("guard_manual_run", "active_state", "ignore_leases", "unit_state")
        if k in kwargs
    }
    context = UnitContext(os.environ if environ is None else environ, environment=unit_env, **unit)
    if shm_host is not None:
        kwargs["shm_host"] = lambda areas, proc_root: shm_host(areas)
    scope = scope._replace(roots=roots, dry_run=dry_run, **kwargs)
    return run_phase(Hook(scope, context.surroundings, reporter), loaded)


NOBODY = 65534


def as_nobody(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run work in a forked copy of this (root) process that dropped to nobody; its JSON-able
    result comes back through a pipe. {} where the child failed before it could answer."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        code = 99
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            os.write(write_end, json.dumps(work()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        data: dict[str, Any] = json.loads(reader.read() or "{}")
    os.waitpid(child, 0)
    return data


@dataclass(frozen=True)
class FakeProcess:
    """One process of a stand-in /proc: the targets of its fds, its maps lines' paths (with
    the device and inode each line shows), and its shape: "process", "kernel" (no address
    space, no files) or "leaderless" (a thread group whose leader exited: the files are
    under task/TID)."""

    pid: int
    fds: tuple[str, ...] = ()
    maps: tuple[tuple[str, int, int], ...] = ()  # (path, st_dev, st_ino)
    shape: str = "process"


def fake_proc(root: Path, processes: Sequence[FakeProcess]) -> Path:
    """A stand-in /proc that the device-file scan reads as it reads the real one: PID/maps,
    PID/fd/N (symbolic links to the targets), PID/task/TID. Replaces what was there."""
    if root.exists():
        subprocess.run(["rm", "-rf", "--", str(root)], check=True)
    root.mkdir(parents=True)
    for process in processes:
        top = root / str(process.pid)
        (top / "task" / str(process.pid)).mkdir(parents=True)
        (top / "fd").mkdir()
        (top / "maps").write_text("")
        if process.shape == "kernel":
            continue
        where = top
        if process.shape == "leaderless":
            where = top / "task" / str(process.pid + 1)
            (where / "fd").mkdir(parents=True)
        lines = [
            f"7f{n:04x}000-7f{n:04x}fff rw-s 00000000 "
            f"{os.major(dev):02x}:{os.minor(dev):02x} {ino} {path}\n"
            for n, (path, dev, ino) in enumerate(process.maps)
        ]
        (where / "maps").write_text("".join(lines) or "5555-6666 r-xp 00000000 00:00 0 [heap]\n")
        for number, target in enumerate(process.fds):
            (where / "fd" / str(number)).symlink_to(target)
    return root


@contextlib.contextmanager
def raises_error(
    kind: type[GateError], **attributes: object
) -> Iterator[pytest.ExceptionInfo[GateError]]:
    """pytest.raises for a gpugate error, asserting its class (so its exit code), the attributes
    given (a ConfigError's field, an error's journal code) and that its message is one line;
    not its words."""
    with pytest.raises(kind) as raised:
        yield raised
    for name, value in attributes.items():
        assert getattr(raised.value, name) == value, (name, getattr(raised.value, name))
    assert raised.value.message and "\n" not in raised.value.message
