"""Discovery: every holder of the stand-in nvidia0..7 on a host with N extra processes, found
by gpugate's own code, by `fuser -v` and by `lsof`, timed in the same run, interleaved.

gpugate's figures are in-process calls of the real code (bench/probe.py): discover() (cgroup,
device files, NVML through the stand-in library) and scan_device_users() alone. fuser and lsof
are whole commands (their start is ~1 ms of it). `C floor` is bench/floor_scan.c: the same
reads of /proc as gpugate's, in C, with nothing else: the kernel's share of the cost.
Peak RSS and wall time of a whole `gpugate pre --dry-run` at the same scale come with it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.crowd import HERE, REPO, Crowd, Mix, compile_c
from bench.stage import UNIT, Stage
from bench.timing import Samples, run_timed

GPUGATE = "gpugate discover()"
GPUGATE_SCAN = "gpugate scan only"
FUSER = "fuser -v"
LSOF = "lsof"
FLOOR = "C floor"


@dataclass
class DiscoveryResult:
    processes: int  # extra processes started for the run
    on_host: int  # processes /proc listed during it
    mix: str
    samples: dict[str, Samples]
    holders: dict[str, set[int]]  # GPU holders each tool reported (last run)
    expected: set[int]  # the crowd's holders of nvidia0..7
    pre_dry_run: Samples = field(default_factory=Samples)  # whole `gpugate pre --dry-run`


def holder_specs(stage: Stage) -> tuple[str, ...]:
    """One fd holder per GPU file, one holder of nvidia3 by mapping only, one holder of
    nvidiactl only (a control device: not a GPU holder, for any of the tools)."""
    return (
        *(f"fd:{path}" for path in stage.gpu_paths()),
        f"map:{stage.dev / 'nvidia3'}",
        f"fd:{stage.dev / 'nvidiactl'}",
    )


class Probe:
    """bench/probe.py in its own process, with the stand-in NVML."""

    def __init__(self, stage: Stage) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.probe",
                str(stage.dev),
                str(stage.root / "cgroup"),
                str(stage.lib),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=stage.env(source_tree=True),
            cwd=REPO,
        )

    def ask(self, command: str) -> tuple[float, float, set[int]]:
        """(wall s, CPU s, GPU holders) of one call."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench.probe exited ({self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(str(answer["error"]))
        return float(answer["wall"]), float(answer["cpu"]), set(answer["gpu_holders"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def parse_fuser(stdout: str) -> set[int]:
    return {int(pid) for pid in re.findall(r"\d+", stdout)}


def parse_lsof(stdout: str) -> set[int]:
    pids = set()
    for line in stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 1 and fields[1].isdigit():
            pids.add(int(fields[1]))
    return pids


def measure_discovery(
    stage: Stage,
    processes: int,
    repeats: int,
    *,
    mix: Mix | None = None,
    gpugate_command: list[str] | None = None,
    with_lsof: bool = True,
    with_floor: bool = True,
) -> DiscoveryResult:
    mix = mix or Mix()
    floor = compile_c(HERE / "floor_scan.c", "floor_scan") if with_floor else None
    files = stage.gpu_paths()
    tools: dict[str, object] = {GPUGATE: "discover", GPUGATE_SCAN: "scan"}
    tools[FUSER] = ["fuser", "-v", *files]
    if with_lsof:
        tools[LSOF] = ["lsof", *files]
    if floor is not None:
        tools[FLOOR] = [str(floor), str(stage.dev / "nvidia")]
    samples = {name: Samples() for name in tools}
    holders: dict[str, set[int]] = {}
    # The holders are a small application of their own (a leader and its workers), apart
    # from the crowd, as a hand-started server is.
    with Crowd(0, holder_specs(stage)) as held, Crowd(processes, mix=mix):
        expected = {pid for spec, pid in held.holders.items() if "nvidiactl" not in spec}
        on_host = sum(1 for name in Path("/proc").iterdir() if name.name.isdigit())
        probe = Probe(stage)
        try:
            for repeat in range(repeats):
                order = list(tools.items())
                shift = repeat % len(order)  # no tool always runs right after another
                for name, how in order[shift:] + order[:shift]:
                    if isinstance(how, str):
                        wall, cpu, holders[name] = probe.ask(how)
                        samples[name].add(wall, cpu)
                        continue
                    assert isinstance(how, list)
                    run = run_timed(how)
                    samples[name].add(run.wall, run.cpu, run.rss_kib)
                    if name == FUSER:
                        holders[name] = parse_fuser(run.stdout)
                    elif name == LSOF:
                        holders[name] = parse_lsof(run.stdout)
                    else:
                        holders[name] = {int(pid) for pid in run.stdout.split()} & expected
        finally:
            probe.close()
        pre = Samples()
        if gpugate_command is not None:
            for _ in range(min(repeats, 3)):
                run = run_timed(
                    [
                        *gpugate_command,
                        *stage.roots_args(),
                        "pre",
                        UNIT,
                        "--dry-run",
                        "--config",
                        str(stage.config),
                    ],
                    env=stage.env(),
                )
                if run.returncode not in (0, 7):
                    raise RuntimeError(
                        f"gpugate pre --dry-run exited {run.returncode}: {run.stderr}"
                    )
                pre.add(run.wall, run.cpu, run.rss_kib)
                time.sleep(0.05)
    return DiscoveryResult(
        processes=processes,
        on_host=on_host,
        mix=mix.describe(processes),
        samples=samples,
        holders=holders,
        expected=expected,
        pre_dry_run=pre,
    )
