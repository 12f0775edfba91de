"""`gpugate status [UNIT] [--json|--watch]`: every GPU and every process holding one, as a
table or stable JSON (docs/status-json.md)."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpugate.config.file import LoadedConfig
from gpugate.core.decide import decide
from gpugate.core.discover import GPU_DEVICE, Discovery, cgroup_members
from gpugate.core.roles import Owner, Role, config_shares, holder_role, is_mps_server, owner_of
from gpugate.errors import ExitCode, GateError, NvmlNotAnswering
from gpugate.front.hook import HostAccess, collect
from gpugate.host.nvml import GpuDriver, NoGpus
from gpugate.host.scan import HostShm, ProcFs, WatchScan
from gpugate.host.shm import own_shm_of_any
from gpugate.host.systemd import HostRoots, unit_argument, unit_of_cgroup, validate_unit_name
from gpugate.integrations.config_files import load_config
from gpugate.integrations.records import (
    LeaseFiles,
    boot_time,
    leases_by_gpu,
    read_leases,
    read_unowned,
)
from gpugate.phase import Phase
from gpugate.report import lines
from gpugate.report.narrate import (
    cut_short_text,
    size_text,
    unreadable_record_text,
    unreadable_text,
)
from gpugate.untrusted import (
    CGROUP,
    COMM,
    CONTAINER,
    FILE,
    STATE,
    printable,
    printable_args,
    truncate,
)

JSON_VERSION = 1
MAX_SHM_LISTED = 64  # a holder's files in `shm`; shm_bytes sums them all
TICKS = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat's start times count in these


def as_dict(
    discovery: Discovery,
    loaded: LoadedConfig,
    roots: HostRoots | None = None,
    procfs: ProcFs | None = None,
    lease_files: LeaseFiles | None = None,
) -> dict[str, Any]:
    """lease_files: the look's one read of the leases (None: read them now)."""
    roots = roots or HostRoots()
    try:  # seconds since boot, the clock /proc/PID/stat's start times count in
        now: float | None = float((roots.proc / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        now = None
    leases = (read_leases(loaded.config.lock_dir) if lease_files is None else lease_files).leases
    rules: dict[int, str] = {}  # the rule (decide.Rule) the unit's pre would judge each by
    if discovery.unit:
        shared = config_shares(discovery, loaded.config)
        procfs = procfs or ProcFs(roots.proc)
        decision = decide(discovery, loaded.config, Phase.PRE, procfs, shared=shared)
        rules = {choice.holder.pid: choice.rule.value for choice in decision.choices}
    unowned, leased = read_unowned(loaded.config.lock_dir), leases_by_gpu(leases)
    shm_host = HostShm(discovery.shm_areas, roots.proc)
    # Each holder; its owner: core/roles' kind; unowned_s: since when a sweep has seen it nobody's
    holders: list[dict[str, Any]] = []
    for holder in sorted(discovery.holders.values(), key=lambda h: h.pid):
        info = holder.info
        owner = owner_of(holder, discovery, loaded.config)
        seen = unowned.get(info.ident) if owner in (Owner.NOBODY, Owner.SESSION) else None
        role = holder_role(holder, discovery, loaded.config)
        shm = []  # bytes null: unlinked, still mapped (path " (deleted)")
        for file in sorted(discovery.shm.get(info.pid, ()), key=lambda f: f.path):
            found = shm_host.facts(file)
            path = found.path if found else file.names[0]
            shm.append({"path": printable(path, FILE), "bytes": found.bytes if found else None})
        command, command_cut = printable_args(info.cmdline)
        holders.append(
            {
                "pid": info.pid,
                "start_time": info.start_time,
                "user": info.user,
                "uid": info.uid,
                "unit": printable(unit_of_cgroup(info.cgroup or "/"), CGROUP) or None,
                "cgroup": printable(info.cgroup, CGROUP) or None,
                "state": info.state,
                "comm": printable(info.comm, COMM),
                "command": command,
                "command_cut": command_cut,
                "gpus": sorted(holder.gpus),
                "ports": sorted(holder.ports),  # the unit's TCP ports it listens on
                # MiB per GPU, an MPS client's included (docs/mps.md)
                "used_mib": {str(k): v for k, v in sorted(holder.used_mib.items())},
                "mps_server": is_mps_server(holder.info, loaded.config),
                "mps_client": sorted(holder.mps_client),
                "control_devices": sorted(holder.control_devices),
                "sources": sorted(holder.sources),
                "role": str(role) if discovery.unit else None,
                "reason": rules.get(holder.pid),
                "orphan": role is Role.ORPHAN,
                "protected": role is Role.PROTECTED,
                "watcher": role is Role.WATCHER,  # nvidia-smi -l, nvtop, DCGM: never killed
                "shm": shm[:MAX_SHM_LISTED],
                "shm_bytes": sum(item["bytes"] or 0 for item in shm),
                "seconds_held": None if now is None else max(int(now - info.start_time / TICKS), 0),
                "container": None
                if holder.container is None
                else {
                    "runtime": holder.container.runtime,
                    "id": holder.container.id,
                    "name": printable(holder.container.name, CONTAINER) or None,
                },
                "owner": str(owner),
                "unowned_s": None if seen is None else max(int(boot_time() - seen.since), 0),
            }
        )
    return {
        "version": JSON_VERSION,
        "unit": discovery.unit or None,
        "unit_cgroup": printable(discovery.unit_cgroup, CGROUP) if discovery.unit else None,
        "config": loaded.source,
        "free_mib": loaded.config.free_mib,
        "gpus": [
            {
                "index": gpu.index,
                "shown": gpu.shown,
                "uuid": gpu.uuid,
                "minor": gpu.minor,
                "name": gpu.name,
                "used_mib": discovery.usage[gpu.index].used_mib,
                "total_mib": gpu.total_mib,
                "owned": gpu.index in discovery.owned_indices,
                "leased_to": [printable(unit, STATE) for unit in leased.get(gpu.uuid.lower(), [])],
                "mig_mode": gpu.mig_mode,
                "mig": None
                if gpu.mig is None
                else {  # a MIG slice's place and the processes NVML lists on it
                    "gpu": gpu.mig.parent,
                    "gpu_uuid": gpu.mig.parent_uuid,
                    "mig_index": gpu.mig.mig_index,
                    "gpu_instance": gpu.mig.gpu_instance,
                    "compute_instance": gpu.mig.compute_instance,
                    "profile": gpu.mig.profile,
                    "pids": [process.pid for process in discovery.usage[gpu.index].processes],
                },
            }
            for gpu in discovery.gpus
        ],
        "holders": holders,
        "leases": [
            {
                "unit": printable(lease.unit, STATE),
                "gpus": list(lease.gpus),
                "since": lease.since,
                "started_by": printable(lease.started_by, STATE) or None,
                "container": printable(lease.container, STATE) or None,
            }
            for lease in leases
        ],
        "shm": [
            {
                "path": found.area.path,
                "total_bytes": found.total_bytes,
                "free_bytes": found.free_bytes,
            }
            for found in shm_host.spaces()
        ],
        "unit_shm": unit_shm(discovery, roots),
        "invisible": [{"gpu": gpu, "pid": pid} for gpu, pid in discovery.invisible],
        "unreadable_gpus": [
            {"index": fault.index, "uuid": fault.uuid, "error": fault.error.message}
            for fault in discovery.faults
        ],
    }


def unit_shm(discovery: Discovery, roots: HostRoots) -> list[dict[str, Any]]:
    """Each shown unit's own /dev/shm, read through one of its processes (none: the host's)."""
    devs = {area.dev for area in discovery.shm_areas}
    by_unit: dict[str, set[int]] = {}
    if discovery.unit:
        try:
            by_unit[discovery.unit] = set(cgroup_members(roots.cgroup, discovery.unit_cgroup))
        except GateError:
            by_unit[discovery.unit] = set()
    for holder in discovery.holders.values():
        unit = unit_of_cgroup(holder.info.cgroup or "/")
        if unit:
            by_unit.setdefault(unit, set()).add(holder.pid)
    owns = (
        (unit, own_shm_of_any(roots.proc, pids, devs)) for unit, pids in sorted(by_unit.items())
    )
    return [
        {
            "unit": printable(unit, CGROUP),  # a name an account may have picked
            "pid": own.pid,
            "path": "/dev/shm",
            "total_bytes": own.total_bytes,
            "used_bytes": own.used_bytes,
            "files": own.files,
        }
        for unit, own in owns
        if own is not None
    ]


def render_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True)


def gpu_ranges(indices: Iterable[int]) -> str:
    """0,1,2,3,5 as 0-3,5."""
    parts = []
    for _, run in itertools.groupby(enumerate(sorted(indices)), lambda pair: pair[1] - pair[0]):
        span = [index for _, index in run]
        parts.append(str(span[0]) if len(span) == 1 else f"{span[0]}-{span[-1]}")
    return ",".join(parts)


def held_for(seconds: int | None) -> str:
    """1d02h, 3h04m, 5m06s, 7s: the two largest units."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def mib_shown(used: dict[str, int | None]) -> str:
    """`-`: NVML lists it nowhere; `unknown`: the driver does not say; `N+?`: for some GPUs."""
    if not used:
        return "-"
    known = [mib for mib in used.values() if mib is not None]
    if not known:
        return "unknown"
    return str(sum(known)) + ("+?" if len(known) < len(used) else "")


def table_role(holder: dict[str, Any], has_unit: bool) -> str:
    if holder["protected"]:
        return "protected"
    if has_unit and holder["role"] == "unit":
        return "unit"
    if holder["watcher"]:
        return "watcher"
    if holder["orphan"]:
        return "orphan"
    return "other unit" if has_unit else "unit"  # without UNIT, every service is just a unit


def render_table(data: dict[str, Any]) -> str:
    return "\n".join([*gpu_table(data), "", *holder_table(data)])


def gpu_table(data: dict[str, Any]) -> list[str]:
    lines = [f"{'GPU':>3}  {'UUID':<42} {'USED/TOTAL MiB':>16}  {'LEASE':<20} NAME"]
    rows: list[tuple[tuple[int, int], str]] = []
    for gpu in data["gpus"]:
        mark = "*" if data["unit"] and gpu["owned"] else " "
        used = f"{gpu['used_mib']}/{gpu['total_mib']}"
        lease = ",".join(gpu["leased_to"]) or "-"
        mig = gpu.get("mig")
        if mig is None:
            first, name, order = f"{gpu['index']:>3}", gpu["name"], (gpu["index"], -1)
        else:  # a slice, under its GPU
            first, order = "  -", (mig["gpu"], mig["mig_index"])
            pids = ",".join(str(pid) for pid in mig["pids"]) or "-"
            name = f"MIG {gpu['shown']} {mig['profile']} (PIDs {pids})"
        rows.append(
            (order, f"{first}{mark} {gpu['uuid']:<42} {used:>16}  {truncate(lease, 20):<20} {name}")
        )
    for fault in data["unreadable_gpus"]:
        row = f"{fault['index']:>3}! {fault['uuid'] or '?':<42} {'ERR!':>16}  {fault['error']}"
        rows.append(((fault["index"], -1), row))
    lines += [row for _, row in sorted(rows)]
    if data["unit"]:
        lines.append(f"(* = GPUs of {data['unit']}, cgroup {data['unit_cgroup']})")
    for lease in data.get("leases", ()):
        unit, gpus = lease["unit"], gpu_ranges(lease["gpus"])
        if by := lease["started_by"]:
            lines.append(f"({unit}: started by hand with `gpugate run` by {by}, GPU {gpus})")
        if lease.get("container"):
            lines.append(f"({unit}: {lease['container']}, GPU {gpus})")
    if data["unreadable_gpus"]:
        lines.append("(! = NVML cannot read this GPU; its holders come from /dev/nvidiaN)")
    lines += [
        f"{area['path']}: {size_text(area['free_bytes'], column=True)} free of "
        f"{size_text(area['total_bytes'], column=True)} (SHM: each holder's files there)"
        for area in data.get("shm", ())
    ]
    lines += [
        f"/dev/shm of {entry['unit']} (its own, through PID {entry['pid']}): "
        f"{size_text(entry['used_bytes'], column=True)} used of "
        f"{size_text(entry['total_bytes'], column=True)}, {entry['files']} file(s)"
        for entry in data.get("unit_shm", ())
    ]
    return lines


def holder_table(data: dict[str, Any]) -> list[str]:
    lines = [
        f"{'PID':>7} {'USER':<10} {'ROLE':<10} {'UNIT':<28} {'ST':<2} {'GPUS':<10} "
        f"{'MiB':>7} {'SHM':>6} {'HELD':>6} {'PORTS':<11} COMMAND"
        if data["holders"]
        else "no process holds a GPU"
    ]
    slices = {gpu["index"]: gpu["shown"] for gpu in data["gpus"] if gpu.get("mig")}
    for holder in data["holders"]:
        whole = gpu_ranges(index for index in holder["gpus"] if index not in slices)
        on_slices = [slices[index] for index in holder["gpus"] if index in slices]
        gpus = ",".join(filter(None, [whole, *on_slices]))
        gpus = gpus or ("ctl" if holder["control_devices"] else "-")
        gpus += " mps" if holder.get("mps_client") or holder.get("mps_server") else ""
        unit = holder["unit"] or "-"
        if found := holder["container"]:
            unit = f"{found['runtime']}:{found['name'] or found['id'][:12]}"
        command = " ".join(holder["command"]) or f"[{holder['comm']}]"
        ports = ",".join(str(port) for port in holder.get("ports", ())) or "-"
        lines.append(
            f"{holder['pid']:>7} {truncate(holder['user'], 10):<10} "
            f"{table_role(holder, bool(data['unit'])):<10} {truncate(unit, 28):<28} "
            f"{holder['state']:<2} {truncate(gpus, 10):<10} {mib_shown(holder['used_mib']):>7} "
            f"{size_text(holder.get('shm_bytes', 0), column=True):>6} "
            f"{held_for(holder['seconds_held']):>6} {truncate(ports, 11):<11} {command}"
        )
    lines += [
        f"GPU {item['gpu']}: PID {item['pid']} listed by NVML is not in this /proc"
        for item in data["invisible"]
    ]
    lines += [
        f"(PID {holder['pid']}: held by nobody, seen unowned by gpugate sweep for "
        f"{holder['unowned_s']} s)"
        for holder in data["holders"]
        if holder.get("unowned_s") is not None
    ]
    return lines


def unreadable_warning(discovery: Discovery) -> str | None:
    """Not root, or not all read within STATUS_SCAN_S: holders may be missing."""
    if discovery.cut_short:
        return lines.warning(f"{cut_short_text(discovery.cut_short)}: holders may be missing")
    if discovery.unreadable:
        why = f"{unreadable_text(discovery.unreadable)}: GPU holders among them are not shown"
        return lines.warning(f"{why}; run as root")
    return None


def status(
    front: HostAccess,
    unit_given: str | None,
    config: Path | None,
    *,
    as_json: bool = False,
    watch: bool = False,
) -> int:
    roots = front.host_roots()
    unit = validate_unit_name(unit_argument(unit_given)) if unit_given else None
    loaded = load_config(unit, config)
    driver = front.driver_factory()
    try:
        warned: list[str] = []
        scanner = WatchScan() if watch else None
        while True:
            data = snapshot(unit, loaded, driver, roots, warned, scanner)
            hung = driver.not_answering()
            if not watch:
                print(render_json(data) if as_json else render_table(data), flush=True)
                if hung is not None:
                    print(lines.error(hung.message), file=sys.stderr, flush=True)
                    return int(hung.exit_code)
                return int(ExitCode.GPU_UNREADABLE if data["unreadable_gpus"] else ExitCode.OK)
            if hung is not None:
                raise hung  # --watch: no next look can answer
            header = f"every 1 s: gpugate status{' ' + unit if unit else ''}    (Ctrl-C ends)"
            print(f"\x1b[H\x1b[J{header}\n\n{render_table(data)}", flush=True)
            time.sleep(1)
    except KeyboardInterrupt:
        return int(ExitCode.OK)  # how --watch ends
    except BrokenPipeError:
        # `gpugate status | head`: stdout to /dev/null, or the interpreter's last flush fails
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return int(ExitCode.OK)
    finally:
        driver.close()


def snapshot(
    unit: str | None,
    loaded: LoadedConfig,
    driver: GpuDriver,
    roots: HostRoots,
    warned: list[str],
    scanner: WatchScan | None,
) -> dict[str, Any]:
    """Return what `gpugate status` shows at one moment (once, or each --watch tick), read
    in one ProcFs.oneshot(). Each warning is printed once: warned holds those already said."""
    procfs = ProcFs(roots.proc)
    with procfs.oneshot():
        try:
            discovery = collect(unit, loaded, driver, roots, procfs=procfs, watch=scanner)
        except NvmlNotAnswering as exc:
            # Hung before it named a GPU: what /dev and /proc show, without NVML.
            try:  # N of every /dev/nvidiaN: the GPUs' device files
                names = os.listdir(roots.dev)
            except OSError:
                names = []
            minors = sorted(int(name[6:]) for name in names if GPU_DEVICE.fullmatch(name))
            discovery = collect(unit, loaded, NoGpus(exc, minors), roots, procfs=procfs)
        files = read_leases(loaded.config.lock_dir)
        unreadable = [
            lines.warning(unreadable_record_text(path, "a gpugate lease", why))
            for path, why in files.unreadable.items()
        ]
        for warning in [unreadable_warning(discovery), *unreadable]:
            if warning and warning not in warned:
                print(warning, file=sys.stderr, flush=True)
                warned.append(warning)
        return as_dict(discovery, loaded, roots, procfs, files)
