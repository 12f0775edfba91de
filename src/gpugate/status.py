"""`gpugate status`: every GPU and every process holding one, as a table or stable JSON."""

from __future__ import annotations

import json
from typing import Any

from gpugate.config import LoadedConfig
from gpugate.decide import holder_role
from gpugate.discover import Discovery, discover
from gpugate.gpu_source import choose_gpus, selection, with_chosen_gpus
from gpugate.host import HostRoots
from gpugate.leases import leases_by_gpu, read_leases
from gpugate.nvml import GpuDriver
from gpugate.procfs import ProcFs
from gpugate.units import resolve_unit_cgroup, unit_of_cgroup

JSON_VERSION = 1
NO_UNIT_CGROUP = "/gpugate-status-no-unit"


def collect(
    unit: str | None, loaded: LoadedConfig, driver: GpuDriver, roots: HostRoots | None = None
) -> Discovery:
    """Like nvidia-smi, a GPU NVML cannot read does not hide the others: it is listed in
    `faults`, and its device files still name its holders."""
    roots = roots or HostRoots()
    if unit is not None:
        environment = None if roots.ask_systemd else (lambda _: None)
        loaded = with_chosen_gpus(loaded, choose_gpus(unit, loaded, environment))
    if unit is None:
        cgroup = NO_UNIT_CGROUP
    else:
        cgroup = resolve_unit_cgroup(unit, roots.cgroup, ask_systemd=roots.ask_systemd)
    return discover(
        unit=unit or "",
        unit_cgroup=cgroup,
        wanted="all" if unit is None else selection(loaded.config),
        config_source=loaded.source,
        driver=driver,
        procfs=ProcFs(roots.proc),
        roots=roots,
        containers=loaded.config.containers,
        strict_faults=False,
    )


def as_dict(discovery: Discovery, loaded: LoadedConfig) -> dict[str, Any]:
    owned = discovery.owned_indices
    leased = leases_by_gpu(read_leases(loaded.config.lock_dir).leases)
    holders = []
    for holder in sorted(discovery.holders.values(), key=lambda h: h.pid):
        info = holder.info
        role = holder_role(holder, discovery, loaded.config)
        container = holder.container
        holders.append(
            {
                "pid": info.pid,
                "start_time": info.start_time,
                "user": info.user,
                "uid": info.uid,
                "unit": unit_of_cgroup(info.cgroup or "/"),
                "cgroup": info.cgroup,
                "state": info.state,
                "comm": info.comm,
                "command": list(info.cmdline),
                "gpus": sorted(holder.gpus),
                "used_mib": {str(k): v for k, v in sorted(holder.used_mib.items())},
                "control_devices": sorted(holder.control_devices),
                "sources": sorted(holder.sources),
                "role": str(role) if discovery.unit else None,
                "orphan": role.value == "orphan",
                "container": None
                if container is None
                else {"runtime": container.runtime, "id": container.id, "name": container.name},
            }
        )
    return {
        "version": JSON_VERSION,
        "unit": discovery.unit or None,
        "unit_cgroup": discovery.unit_cgroup if discovery.unit else None,
        "config": loaded.source,
        "free_mib": loaded.config.free_mib,
        "gpus": [
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "minor": gpu.minor,
                "name": gpu.name,
                "used_mib": discovery.usage[gpu.index].used_mib,
                "total_mib": gpu.total_mib,
                "owned": gpu.index in owned,
                "leased_to": leased.get(gpu.uuid.lower(), []),
            }
            for gpu in discovery.gpus
        ],
        "holders": holders,
        "invisible": [{"gpu": gpu, "pid": pid} for gpu, pid in discovery.invisible],
        "unreadable_gpus": [
            {"index": fault.index, "uuid": fault.uuid, "error": fault.error}
            for fault in discovery.faults
        ],
    }


def render_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True)


def render_table(data: dict[str, Any]) -> str:
    lines = [f"{'GPU':>3}  {'UUID':<42} {'USED/TOTAL MiB':>16}  {'LEASE':<20} NAME"]
    rows: list[tuple[int, str]] = []
    for gpu in data["gpus"]:
        mark = "*" if data["unit"] and gpu["owned"] else " "
        used = f"{gpu['used_mib']}/{gpu['total_mib']}"
        lease = ",".join(gpu["leased_to"]) or "-"
        rows.append(
            (
                gpu["index"],
                f"{gpu['index']:>3}{mark} {gpu['uuid']:<42} {used:>16}  {lease[:20]:<20} "
                f"{gpu['name']}",
            )
        )
    for fault in data["unreadable_gpus"]:
        uuid = fault["uuid"] or "?"
        rows.append(
            (fault["index"], f"{fault['index']:>3}! {uuid:<42} {'ERR!':>16}  {fault['error']}")
        )
    lines += [row for _, row in sorted(rows)]
    if data["unit"]:
        lines.append(f"(* = GPUs of {data['unit']}, cgroup {data['unit_cgroup']})")
    if data["unreadable_gpus"]:
        lines.append("(! = NVML cannot read this GPU; its holders come from /dev/nvidiaN)")
    lines.append("")
    if not data["holders"]:
        lines.append("no process holds a GPU")
    else:
        lines.append(
            f"{'PID':>7} {'USER':<10} {'UNIT':<28} {'ST':<2} {'GPUS':<10} {'MiB':>7}  COMMAND"
        )
    for holder in data["holders"]:
        unit = holder["unit"] or "-"
        if holder["container"]:
            found = holder["container"]
            unit = f"{found['runtime']}:{found['name'] or found['id'][:12]}"
        if holder["orphan"]:
            unit = f"{unit} (orphan)" if unit != "-" else "(orphan)"
        gpus = ",".join(str(i) for i in holder["gpus"]) or (
            "ctl" if holder["control_devices"] else "-"
        )
        mib = sum(v or 0 for v in holder["used_mib"].values())
        command = " ".join(holder["command"]) or f"[{holder['comm']}]"
        lines.append(
            f"{holder['pid']:>7} {holder['user'][:10]:<10} {unit[:28]:<28} {holder['state']:<2} "
            f"{gpus[:10]:<10} {mib:>7}  {command[:100]}"
        )
    for item in data["invisible"]:
        lines.append(f"GPU {item['gpu']}: PID {item['pid']} listed by NVML is not in this /proc")
    return "\n".join(lines)
