"""The benchmark's tables (Markdown, printed and written to docs/benchmarks.md) and the
verdict on each target."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from bench.discovery import FLOOR, FUSER, GPUGATE, GPUGATE_SCAN, LSOF, DiscoveryResult
from bench.simulated import SimResult
from bench.startup import ALL_IMPORTS, CONFIG_IMPORT, INTERPRETER, PRE, StartupResult
from bench.timing import Samples, ms, ratio

TARGET_FUSER = 5.0
TARGET_LSOF = 10.0
TARGET_STARTUP_MS = 150.0
TARGET_RECLAIM_MS = 50.0
TARGET_RSS_MIB = 64.0


@dataclass
class Report:
    machine: dict[str, str]
    command: str  # how it was run
    load_before: str
    load_after: str = ""
    discovery: list[DiscoveryResult] = field(default_factory=list)
    startup: StartupResult | None = None
    gpugate_install: str = ""
    simulated: SimResult | None = None
    simulated_skipped: str = ""
    verdicts: list[str] = field(default_factory=list)
    bounds: list[str] = field(default_factory=list)


def _cell(samples: Samples | None) -> str:
    if samples is None or not samples.wall:
        return "-"
    return f"{ms(samples.wall_ms)} / {ms(samples.cpu_ms)}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _verdict(report: Report, met: bool, text: str) -> None:
    report.verdicts.append(f"- {'met' if met else '**NOT met**'}: {text}")


def discovery_section(report: Report) -> list[str]:
    out = [
        "## 1. Discovery",
        "",
        "Every holder of the stand-in `nvidia0`..`nvidia7` (plus a holder of `nvidiactl`, and one "
        "that only maps `nvidia3`) on this host with N extra processes. Each cell: median wall "
        "time / median CPU time (user + system) of the repeats, all tools interleaved in the "
        "same run. gpugate's figures are in-process calls of its real code; fuser and lsof are "
        "whole commands. `C floor` (bench/floor_scan.c) makes the same reads of /proc as "
        "gpugate and nothing else. Ratios are wall over wall.",
        "",
    ]
    header = [
        "extra processes (on host)",
        GPUGATE,
        GPUGATE_SCAN,
        FUSER,
        LSOF,
        FLOOR,
        "fuser ÷ gpugate",
        "lsof ÷ gpugate",
        "gpugate per 1,000 on host",
        "`gpugate pre --dry-run` whole / peak RSS",
        "same holders",
    ]
    rows = []
    for result in report.discovery:
        s = result.samples
        ours = s[GPUGATE].wall_ms
        agree = all(result.holders.get(name) == result.expected for name in s)
        pre = result.pre_dry_run
        rows.append(
            [
                f"{result.processes:,} ({result.on_host:,})",
                _cell(s.get(GPUGATE)),
                _cell(s.get(GPUGATE_SCAN)),
                _cell(s.get(FUSER)),
                _cell(s.get(LSOF)),
                _cell(s.get(FLOOR)),
                ratio(s[FUSER].wall_ms, ours),
                ratio(s[LSOF].wall_ms, ours) if LSOF in s else "-",
                ms(ours / result.on_host * 1000),
                f"{ms(pre.wall_ms)} / {pre.peak_rss_mib:.1f} MiB" if pre.wall else "-",
                "yes" if agree else "NO",
            ]
        )
    out += _table(header, rows)
    if report.discovery:
        out += [
            "",
            f"Crowd: {report.discovery[-1].mix}; the holders are a small application of "
            "their own (a leader and its 10 workers).",
        ]
    return out


def judge_discovery(report: Report) -> None:
    if not report.discovery:
        return
    at = min(report.discovery, key=lambda r: abs(r.processes - 5000))
    s = at.samples
    ours = s[GPUGATE].wall_ms
    fuser = s[FUSER].wall_ms / ours
    missed = fuser < TARGET_FUSER or (LSOF in s and s[LSOF].wall_ms / ours < TARGET_LSOF)
    _verdict(
        report,
        fuser >= TARGET_FUSER,
        f"discovery at {at.processes:,} processes is "
        f"{fuser:.1f}x faster than `fuser -v` (target {TARGET_FUSER:g}x)",
    )
    if LSOF in s:
        lsof = s[LSOF].wall_ms / ours
        _verdict(
            report,
            lsof >= TARGET_LSOF,
            f"discovery at {at.processes:,} processes is "
            f"{lsof:.1f}x faster than `lsof` (target {TARGET_LSOF:g}x)",
        )
    per = [(r.on_host, r.samples[GPUGATE].wall_ms / r.on_host * 1000) for r in report.discovery]
    if len(per) > 1:
        growth = per[-1][1] / per[0][1]
        _verdict(
            report,
            growth <= 1.25,
            "cost grows no worse than linearly: "
            + ", ".join(f"{cost:.0f} ms per 1,000 at {n:,}" for n, cost in per)
            + f" (x{growth:.2f} from the smallest to the largest)",
        )
    largest = report.discovery[-1]
    if largest.pre_dry_run.rss_kib:
        rss = largest.pre_dry_run.peak_rss_mib
        _verdict(
            report,
            rss < TARGET_RSS_MIB,
            f"peak RSS of `gpugate pre --dry-run` at "
            f"{largest.processes:,} processes: {rss:.1f} MiB (target < {TARGET_RSS_MIB:g})",
        )
    if FLOOR in s and missed:
        floor = s[FLOOR].wall_ms
        report.bounds.append(
            f"- Discovery: at {at.processes:,} processes the bare reads of /proc, in C "
            f"(`C floor`), take {ms(floor)}: {floor / ours:.0%} of gpugate's discover() "
            f"({ms(ours)}), and fuser takes {s[FUSER].wall_ms / floor:.1f}x that floor. "
            "fuser makes the same reads (every fd's target, every maps file), so no reader of "
            f"/proc can be {TARGET_FUSER:g}x faster than fuser on this machine: the cost is "
            "the kernel's, one syscall per fd and per page of maps, not gpugate's; gpugate's "
            "own share is discover() minus the floor. Going below the floor means reading "
            "less (skipping maps would miss a process that mapped a device and closed its fd) "
            "or reading in the kernel (an eBPF task_file iterator), or reading on many cores "
            "at once (big GPU hosts have them; two Python threads gained nothing on these "
            "2 vCPUs when tried)."
        )


def startup_section(report: Report) -> list[str]:
    result = report.startup
    out = ["## 2. Start-up", ""]
    if result is None:
        return [*out, "Not run."]
    out += [
        f"`gpugate pre {'bench.service'}` on a clean host (nothing to kill; stand-in NVML, "
        f"device files and cgroup tree), end to end, with {result.processes:,} extra processes "
        f"({result.mix}); gpugate installed as the README says ({report.gpugate_install}). "
        "Next to it, on the same interpreter: its floor, and the imports gpugate needs "
        "(ending with `os._exit`, as gpugate does). Medians of "
        f"{len(result.samples[PRE].wall)} runs, interleaved.",
        "",
    ]
    rows = [
        [name, ms(samples.wall_ms), ms(samples.cpu_ms), f"{samples.peak_rss_mib:.1f} MiB"]
        for name, samples in result.samples.items()
    ]
    sim = report.simulated
    if sim is not None and sim.startup:
        rows.append(
            [
                "gpugate pre on the clean simulated host (real systemd, journald)",
                ms(statistics.median(sim.startup) * 1000),
                "-",
                f"{max(sim.startup_rss_kib) / 1024:.1f} MiB",
            ]
        )
    out += _table(["case", "wall", "CPU", "peak RSS"], rows)
    out += [
        "",
        f"Of the whole run, discovery (gpugate's own count, `discover N ms` in its last line): "
        f"{ms(result.discover_median_ms)} median.",
    ]
    return out


def judge_startup(report: Report) -> None:
    result = report.startup
    if result is None:
        return
    s = result.samples
    pre = s[PRE].wall_ms
    _verdict(
        report,
        pre <= TARGET_STARTUP_MS,
        f"`gpugate pre` on a clean host with "
        f"{result.processes:,} extra processes: {ms(pre)} median (target "
        f"{TARGET_STARTUP_MS:g} ms)",
    )
    _verdict(
        report,
        s[PRE].peak_rss_mib < TARGET_RSS_MIB,
        f"peak RSS of that run: {s[PRE].peak_rss_mib:.1f} MiB (target < {TARGET_RSS_MIB:g})",
    )
    if pre <= TARGET_STARTUP_MS:
        return
    interpreter, config, imports = (s[k].wall_ms for k in (INTERPRETER, CONFIG_IMPORT, ALL_IMPORTS))
    without_pydantic = pre - (config - interpreter)
    outcome = (
        "within the target"
        if without_pydantic <= TARGET_STARTUP_MS
        else "still over it, by the discovery the crowd costs"
    )
    report.bounds.append(
        f"- Start-up: of {ms(pre)}, the interpreter takes {ms(interpreter)}, importing "
        f"gpugate.config.schema (pydantic, and gpugate's models built with it) "
        f"{ms(config - interpreter)} more, the other imports (pynvml, python-systemd, "
        f"gpugate's modules) "
        f"{ms(imports - config)}, and the run itself {ms(pre - imports)}, of which discovery "
        f"over the crowd {ms(result.discover_median_ms)}, near the kernel's floor (see 1). "
        "pydantic's share alone is "
        f"{ms(config - interpreter)} on this machine; a config validator without pydantic "
        f"would bring the run to about {ms(without_pydantic)}: {outcome}."
    )


def simulated_section(report: Report) -> list[str]:
    out = ["## 3. Reclaim latency (simulated GPU host)", ""]
    sim = report.simulated
    if sim is None:
        return [*out, f"Not run: {report.simulated_skipped}"]
    rec = sim.reclaim
    out += [
        "A server started by hand on all 8 GPUs (~88 GiB each); the stand-in driver frees a "
        "process's memory a delay after it dies and logs that moment (an independent NVML "
        "client polls it every millisecond, so the moment is the driver's, not the next "
        "question gpugate asks). From that moment to gpugate's exit, and to the exit of the "
        "hand cleanup operators run today: `kill -9` the server, then "
        "`until <no GPU above 1024 MiB>; do sleep 5; done` with `gpugate status --json` as the "
        "probe (nvidia-smi's role); its runs' driver delays are spread evenly over 0.5-5.5 s, so "
        "the releases fall all over the loop's period.",
        "",
    ]
    rows = []
    if rec.gpugate_ms:
        rows.append(["gpugate pre: driver's release to exit", *_spread(rec.gpugate_ms)])
    if rec.hand_ms:
        rows.append(["hand cleanup, `sleep 5` loop: release to loop exit", *_spread(rec.hand_ms)])
    if rec.probe_ms:
        model = 2500 + statistics.median(rec.probe_ms)
        rows.append(["model of the loop: 5 s / 2 + one probe", ms(model), "", "", ""])
    out += _table(["", "median", "min", "max", "runs"], rows)
    if rec.gpugate_ms and rec.hand_ms:
        quicker = ratio(statistics.median(rec.hand_ms), statistics.median(rec.gpugate_ms))
        rss = max(rec.gpugate_rss_kib) / 1024
        out += [
            "",
            f"gpugate notices the release {quicker} sooner than the hand loop (median against "
            f"median). Peak RSS of gpugate in these runs (11 processes killed): {rss:.1f} MiB.",
        ]
    out += ["", "## 4. Whole incident (simulated GPU host)", ""]
    if not sim.incidents:
        return [*out, "Not run."]
    out += [
        "A server started by hand on all 8 GPUs, worker 3 ignoring SIGTERM; then "
        "`systemctl start vllm.service` (gpugate on `ExecStartPre=`, `sigterm_grace_s = 2`; "
        "the driver frees memory 2 s after a process dies) until systemctl returns with the "
        "unit active. Split by systemd's ExecStartPre= timestamps, gpugate's journal entries, "
        f"the driver's log and the NVML poller; median of {len(sim.incidents)} run(s).",
        "",
    ]
    names = list(sim.incidents[0].parts)
    rows = [
        [name, f"{statistics.median([i.parts[name] for i in sim.incidents]):.3f} s"]
        for name in names
    ]
    rows.append(
        [
            "**total: `systemctl start` to active**",
            f"**{statistics.median([i.total_s for i in sim.incidents]):.3f} s**",
        ]
    )
    out += _table(["part", "time"], rows)
    own = [i.parts[names[1]] + i.parts[names[3]] + i.parts[names[5]] for i in sim.incidents]
    out += [
        "",
        f"gpugate's own time (start-up and discovery, kill, freed to exit): "
        f"{statistics.median(own):.3f} s; the rest is the grace the policy gives, the "
        "driver's delay, and systemd.",
    ]
    return out


def _spread(values: list[float]) -> list[str]:
    return [ms(statistics.median(values)), ms(min(values)), ms(max(values)), str(len(values))]


def judge_simulated(report: Report) -> None:
    sim = report.simulated
    if sim is None or not sim.reclaim.gpugate_ms:
        return
    latency = statistics.median(sim.reclaim.gpugate_ms)
    _verdict(
        report,
        latency <= TARGET_RECLAIM_MS,
        f"reclaim latency: {ms(latency)} median from "
        f"the driver's release to gpugate's exit (target {TARGET_RECLAIM_MS:g} ms)",
    )
    if latency > TARGET_RECLAIM_MS:
        report.bounds.append(
            "- Reclaim latency: gpugate polls NVML at most every 50 ms (wait.py), so half of "
            "that is expected; the rest is the last poll, the journal entries and the exit."
        )
    rss = max(sim.reclaim.gpugate_rss_kib) / 1024
    _verdict(report, rss < TARGET_RSS_MIB, f"peak RSS in the reclaim runs: {rss:.1f} MiB")


def render(report: Report) -> str:
    judge_discovery(report)
    judge_startup(report)
    judge_simulated(report)
    machine = "; ".join(f"{key} {value}" for key, value in report.machine.items())
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python3 bench/run.py` (CONTRIBUTING.md, Benchmarks); rerun it to refresh "
        "this file (as root, for the simulated host; `--quick` for a one-minute run that writes to "
        "`.bench/` instead).",
        "",
        f"Machine: {machine}. Load average before: {report.load_before}, after: "
        f"{report.load_after}. Run: `{report.command}`.",
        "",
        "This machine is shared and small: the wall times carry other work's noise, the CPU "
        "times much less of it.",
        "",
        *discovery_section(report),
        "",
        *startup_section(report),
        "",
        *simulated_section(report),
        "",
        "## Targets",
        "",
        *report.verdicts,
        "",
        "## What bounds the targets not met",
        "",
        *(report.bounds or ["Nothing: every target is met."]),
        "",
    ]
    return "\n".join(lines)
