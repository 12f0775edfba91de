"""Every process that holds the unit's GPUs and how it was found (the unit's cgroup and
containers, /proc/PID/fd and maps naming /dev/nvidiaN, NVML's lists); the GPUs the unit owns."""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from gpugate.compat import StrEnum
from gpugate.config.values import MIG_PREFIX, GpuRef, GpuSelection, legacy_mig
from gpugate.errors import (
    ConfigError,
    GpuError,
    NvmlNotAnswering,
    NvmlUnavailable,
    PermissionDenied,
)
from gpugate.host.containers import (
    Container,
    container_names,
    container_of_cgroup,
    container_scopes,
)
from gpugate.host.nvml import (
    Gpu,
    GpuDriver,
    GpuFault,
    GpuUsage,
    cap_minor,
    mig_parent,
    slice_of_cap_minor,
)
from gpugate.host.scan import (
    NO_DEADLINE,
    Deadline,
    DeviceScan,
    ProcFs,
    ProcInfo,
    WatchScan,
    listening_sockets,
    scan_device_users,
)
from gpugate.host.shm import ShmArea, ShmFile, find_areas
from gpugate.host.systemd import HostRoots
from gpugate.untrusted import for_error

GPU_DEVICE = re.compile(r"nvidia(\d+)$")


class Source(StrEnum):
    CGROUP = "cgroup"
    CONTAINER = "container"  # in a container the config names as the unit's (`containers`)
    DEVICE_FD = "device-fd"
    DEVICE_MAP = "device-map"
    NVML = "nvml"
    APP_TREE = "app-tree"
    PORT = "port"  # listens on one of the unit's TCP ports


class Holder:
    """A process found holding a GPU (by its device files, a mapping or NVML's list), in the
    unit's cgroup or listening on one of the unit's ports, and how it was found."""

    __slots__ = (
        "container",
        "control_devices",
        "gpus",
        "info",
        "mapped",
        "mps_client",
        "ports",
        "sources",
        "used_mib",
    )

    def __init__(
        self,
        info: ProcInfo,
        sources: set[Source] | None = None,
        gpus: set[int] | None = None,  # indices, from device files or NVML
        used_mib: dict[int, int | None] | None = None,  # per GPU, from NVML
        mapped: set[int] | None = None,  # GPUs whose /dev/nvidiaN it maps (memory)
        ports: set[int] | None = None,  # the unit's TCP ports it listens on
        container: Container | None = None,  # where its cgroup is a container's scope
    ) -> None:
        self.info, self.container = info, container
        self.sources, self.gpus, self.mapped = sources or set(), gpus or set(), mapped or set()
        self.ports, self.used_mib = ports or set(), used_mib or {}
        self.control_devices: set[str] = set()  # nvidiactl, nvidia-uvm, ...
        self.mps_client: set[int] = set()  # GPUs NVML lists it on as an MPS client

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Holder):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # mutable: unhashable

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def using(self) -> set[int]:
        """The GPUs it really uses: NVML's list where it names the process (CUDA opens
        /dev/nvidiaN for every visible GPU), and on a MIG slice the slice, not its GPU."""
        found = set(self.used_mib) or self.gpus
        return found - {mig_parent(key) for key in found}


class Discovery(NamedTuple):
    """What one discovery found: the host's GPUs and the unit's, their usage, every holder."""

    unit: str
    unit_cgroup: str
    gpus: Sequence[Gpu]  # every GPU on the host
    owned: Sequence[Gpu]  # the unit's
    usage: dict[int, GpuUsage]  # by GPU index, every GPU
    holders: dict[int, Holder]  # by PID
    self_chain: frozenset[int]  # gpugate and its ancestors: never targets
    unreadable: Sequence[int]  # PIDs whose fds could not be read
    invisible: Sequence[tuple[int, int]] = ()  # (GPU, PID) NVML lists, /proc not: a PID namespace
    unit_containers: Sequence[Container] = ()  # `containers` found running
    faults: Sequence[GpuFault] = ()  # GPUs NVML cannot read, not owned
    shm: Mapping[int, frozenset[ShmFile]] = {}  # by PID: its shm files
    shm_areas: Sequence[ShmArea] = ()  # /dev/shm (and /run/shm)
    cut_short: Sequence[int] = ()  # PIDs the deadline cut: holders may hide

    @property
    def owned_indices(self) -> set[int]:
        return {gpu.index for gpu in self.owned}

    @property
    def nvml_lists_processes(self) -> bool:
        """NVML's lists are complete and name PIDs this /proc shows (a device holder they
        name nowhere is then a watcher)."""
        listed = all(usage.processes_listed for usage in self.usage.values())
        return bool(self.usage) and not self.invisible and listed


def memory_accounted(
    usage: Mapping[int, GpuUsage], faults: Sequence[GpuFault], free_mib: int
) -> bool:
    """NVML lists every GPU's processes, each with its memory, and on every GPU they account
    for the memory used within free_mib; no GPU it cannot read. Where this holds, a process
    NVML lists nowhere holds no memory of any GPU that NVML does not attribute to another."""
    if faults or not usage:
        return False
    for gpu_usage in usage.values():
        listed = [process.used_mib for process in gpu_usage.processes]
        if not gpu_usage.processes_listed or any(mib is None for mib in listed):
            return False
        if gpu_usage.used_mib - sum(mib or 0 for mib in listed) > free_mib:
            return False
    return True


def self_and_ancestors(procfs: ProcFs) -> frozenset[int]:
    chain: set[int] = set()
    current: int | None = os.getpid()
    while current and current not in chain:
        chain.add(current)
        info = procfs.stat(current)
        current = info.ppid if info else None
    return frozenset(chain)


def cgroup_members(cgroup_root: Path, unit_cgroup: str) -> list[int]:
    """Every PID in the unit's cgroup and its sub-cgroups."""
    top = cgroup_root / unit_cgroup.lstrip("/")
    pids: list[int] = []
    for directory, _, files in os.walk(top):
        if "cgroup.procs" in files:
            procs = Path(directory, "cgroup.procs")
            try:
                text = procs.read_text()
            except FileNotFoundError:
                continue  # removed while we walked
            except PermissionError:
                raise PermissionDenied(f"{procs}: permission denied") from None
            pids.extend(int(line) for line in text.split())
    return pids


class HoldersByPid:
    """The holders found so far, keyed by PID. A process's facts are read from /proc when it
    is first named; gpugate itself, its ancestors and kernel threads are never holders."""

    def __init__(self, procfs: ProcFs, self_chain: frozenset[int]) -> None:
        self.procfs, self.self_chain = procfs, self_chain
        self.by_pid: dict[int, Holder] = {}

    def get(self, pid: int) -> Holder | None:
        if pid not in self.by_pid and pid not in self.self_chain:
            info = self.procfs.info(pid)
            if info is not None and not info.kernel_thread:
                self.by_pid[pid] = Holder(info)
        return self.by_pid.get(pid)


def read_gpus(
    driver: GpuDriver, wanted: GpuSelection | None, unit: str, *, strict_faults: bool
) -> tuple[list[Gpu], dict[int, GpuUsage], list[GpuFault]]:
    """The GPUs NVML can read, their usage, the faults (strict: one of the unit's fails)."""
    gpus = list(driver.gpus())
    faults = list(driver.faults())
    if strict_faults:
        fail_on_owned_faults(wanted, gpus, faults, unit)
    usage: dict[int, GpuUsage] = {}
    for gpu in list(gpus):
        try:
            usage[gpu.index] = driver.usage(gpu)
        except (GpuError, NvmlNotAnswering) as exc:
            if strict_faults and isinstance(exc, NvmlNotAnswering):
                raise
            gpus.remove(gpu)  # status shows one that does not answer as unreadable
            faults.append(GpuFault(gpu.index, exc, gpu.uuid, gpu.minor))
    if strict_faults:
        fail_on_owned_faults(wanted, gpus, faults, unit)
    return gpus, usage, sorted(faults, key=lambda fault: fault.index)


class DiscoveryQuery(NamedTuple):
    """What one discovery looks for: the unit (or the label standing for it), the cgroup
    whose processes are its own, the GPUs its config names and the config that named them."""

    unit: str
    unit_cgroup: str
    wanted: GpuSelection | None
    config_source: str


def discover(
    sought: DiscoveryQuery,
    *,
    driver: GpuDriver,
    procfs: ProcFs,
    roots: HostRoots,
    containers: Sequence[str] = (),
    strict_faults: bool = True,
    ports: Collection[int] = (),
    deadline: Deadline = NO_DEADLINE,
    watch: WatchScan | None = None,
    listed_within_mib: int | None = None,
) -> Discovery:
    """strict_faults: an NVML error on a GPU of the unit's fails the run (`status`: False);
    containers and ports: the config's, whose processes and listeners are the unit's too;
    watch: `status --watch`'s rescans (None: every process on the host, as a watcher, a
    mapped-only holder and a holder of a GPU NVML cannot read are on no NVML list);
    listed_within_mib (the sweep's free_mib): where NVML accounts for every GPU's memory within
    it (`memory_accounted`) and no port is asked, only the fds of the listed and the unit's
    processes are read, unless NVML lists a PID not shown here: then every process's."""
    gpus, usage, faults = read_gpus(driver, sought.wanted, sought.unit, strict_faults=strict_faults)
    listed_only = (
        watch is None
        and listed_within_mib is not None
        and memory_accounted(usage, faults, listed_within_mib)
        and not ports
    )
    listed = {process.pid for each in usage.values() for process in each.processes}
    shm_areas = find_areas(roots.dev, roots.proc)
    with procfs.oneshot():  # one reading of every process for the whole discovery
        table = HoldersByPid(procfs, self_and_ancestors(procfs))
        for pid in cgroup_members(roots.cgroup, sought.unit_cgroup):
            if (found := table.get(pid)) is not None:
                found.sources.add(Source.CGROUP)
        prefix, listening = os.path.join(roots.dev, "nvidia"), listening_sockets(roots.proc, ports)
        if watch is not None:
            scan = watch(roots.proc, prefix, listening, shm_areas, listed, deadline)
        else:
            pids = sorted(listed | set(table.by_pid)) if listed_only else None
            scan = scan_device_users(roots.proc, prefix, listening, shm_areas, deadline, pids=pids)
        _add_device_users(table, roots.proc, gpus, faults, listening, scan)
        invisible = _add_nvml_processes(table, usage)
        if listed_only and invisible:  # memory listed for a PID not seen here: everyone's fds
            scan = scan_device_users(roots.proc, prefix, listening, shm_areas, deadline)
            _add_device_users(table, roots.proc, gpus, faults, listening, scan)
        unit_containers = _containers(table, roots.cgroup, containers)
    return Discovery(
        unit=sought.unit,
        unit_cgroup=sought.unit_cgroup,
        gpus=gpus,
        owned=owned_gpus(sought.wanted, gpus, sought.config_source),
        usage=usage,
        holders=table.by_pid,
        self_chain=table.self_chain,
        unreadable=scan.unreadable,
        invisible=invisible,
        unit_containers=unit_containers,
        faults=faults,
        shm=scan.shm,
        shm_areas=shm_areas,
        cut_short=scan.cut_short,
    )


def _add_device_users(
    table: HoldersByPid,
    proc_root: Path,
    gpus: list[Gpu],
    faults: list[GpuFault],
    listening: dict[int, int],
    scan: DeviceScan,
) -> None:
    """Holders of /dev/nvidia* and listeners on the unit's ports."""
    index_by_minor = {gpu.minor: gpu.index for gpu in gpus if gpu.mig is None}
    for fault in faults:
        # NVML may not even say a lost GPU's minor: the driver numbers them in index order.
        minor = fault.index if fault.minor is None else fault.minor
        index_by_minor.setdefault(minor, fault.index)
    slice_by_cap = slice_of_cap_minor(proc_root, gpus)
    for pid, use in scan.users.items():
        if (found := table.get(pid)) is None:
            continue
        if use.sockets:
            found.sources.add(Source.PORT)
            found.ports.update(listening[inode] for inode in use.sockets)
        if use.fd_paths:
            found.sources.add(Source.DEVICE_FD)
        if use.mapped_paths:
            found.sources.add(Source.DEVICE_MAP)
            mapped = (_gpu_of(path, index_by_minor) for path in use.mapped_paths)
            found.mapped.update(index for index in mapped if index is not None)
        for path in use.paths:
            index, cap = _gpu_of(path, index_by_minor), cap_minor(path)
            if index is not None:
                found.gpus.add(index)
            elif cap is not None and cap in slice_by_cap:
                found.gpus.add(slice_by_cap[cap])  # a MIG slice's capability device
            else:
                found.control_devices.add(os.path.basename(path))


def _gpu_of(path: str, index_by_minor: dict[int, int]) -> int | None:
    match = GPU_DEVICE.fullmatch(os.path.basename(path))
    return index_by_minor.get(int(match.group(1))) if match else None


def _add_nvml_processes(table: HoldersByPid, usage: dict[int, GpuUsage]) -> list[tuple[int, int]]:
    """The processes NVML lists. Returns (GPU, PID) of those this /proc does not show."""
    invisible: list[tuple[int, int]] = []
    for index, gpu_usage in usage.items():
        for process in gpu_usage.processes:
            if process.pid in table.self_chain:
                continue
            if process.on_slice and gpu_usage.gpu.mig is None:
                continue  # a whole GPU's aggregate entry for a process its slice lists
            if (found := table.get(process.pid)) is None:
                invisible.append((index, process.pid))
                continue
            found.sources.add(Source.NVML)
            found.gpus.add(index)
            found.used_mib[index] = process.used_mib
            if process.mps_client:
                found.mps_client.add(index)
    return invisible


def _containers(table: HoldersByPid, cgroup_root: Path, wanted: Sequence[str]) -> list[Container]:
    """Names each holder's container; every process of a container WANTED names is the unit's."""
    holders = table.by_pid
    found: dict[str, Container] = {}
    for container in filter(None, (container_of_cgroup(h.info.cgroup) for h in holders.values())):
        found.setdefault(container.id, container)
    if wanted:
        for container in container_scopes(cgroup_root):
            found.setdefault(container.id, container)
    if not found:
        return []
    named = {c.id: c for c in container_names(list(found.values()))}
    own = [c for c in named.values() if c.matches(wanted)]
    for container in own:
        for pid in cgroup_members(cgroup_root, container.scope):
            if (member := table.get(pid)) is not None:
                member.sources.add(Source.CONTAINER)
                member.container = container
    for each in holders.values():
        if (in_scope := container_of_cgroup(each.info.cgroup)) is not None:
            each.container = named.get(in_scope.id, in_scope)
    return own


def owned_gpus(wanted: GpuSelection | None, gpus: Sequence[Gpu], source: str) -> list[Gpu]:
    """The GPUs a selection names, with each whole GPU's slices; None names none."""
    if wanted is None:
        return []
    whole = [gpu for gpu in gpus if gpu.mig is None]
    if wanted == "all":
        return covered(whole, gpus)
    by_index = {gpu.index: gpu for gpu in whole}  # a GPU NVML cannot read is not among them
    owned: list[Gpu] = []
    for ref in wanted:
        if isinstance(ref, int):
            if ref not in by_index:
                indices = [gpu.index for gpu in whole]
                listed = "GPUs " + ", ".join(map(str, indices)) if indices else "no GPUs"
                if indices and indices == list(range(indices[0], indices[-1] + 1)):
                    listed = f"GPUs {indices[0]}-{indices[-1]}"
                raise ConfigError(
                    source, "gpus", f"GPU index {ref} does not exist; NVML lists {listed}"
                )
            owned.append(by_index[ref])
        else:
            owned.append(_by_uuid(ref, gpus, source))
    return covered(owned, gpus)  # each once


def covered(owned: Sequence[Gpu], gpus: Sequence[Gpu]) -> list[Gpu]:
    """What owning these takes, in the order named: each, then its slices (a whole GPU)."""
    taken = (gpu for mine in owned for gpu in [mine, *filter(mine.covers, gpus)])
    return list(dict.fromkeys(taken))  # each once


def as_refs(gpus: Sequence[Gpu]) -> tuple[GpuRef, ...]:
    """As a config names them: a whole GPU by index, a slice by UUID (unless its GPU is there)."""
    whole = {gpu.index for gpu in gpus if gpu.mig is None}
    return tuple(
        gpu.index if gpu.mig is None else gpu.uuid
        for gpu in gpus
        if gpu.mig is None or gpu.mig.parent not in whole
    )


def _by_uuid(ref: str, gpus: Sequence[Gpu], source: str) -> Gpu:
    """A GPU UUID names a whole GPU, a MIG UUID a slice; either as a prefix too."""
    legacy = legacy_mig(ref)
    if legacy is not None:
        return _by_legacy_mig(ref, legacy, gpus, source)
    is_mig = ref.upper().startswith(MIG_PREFIX)
    among = [gpu for gpu in gpus if (gpu.mig is not None) == is_mig]
    if is_mig and not any(gpu.uuid.lower().startswith(ref.lower()) for gpu in among):
        no_mig = "" if any(gpu.mig_mode for gpu in gpus) else " (no GPU is in MIG mode)"
        raise ConfigError(
            source, "gpus", f"no MIG device has UUID {for_error(ref, quote=False)}{no_mig}"
        )
    return _by_prefix(ref, among, source)


def _by_legacy_mig(ref: str, legacy: tuple[str, int, int], gpus: Sequence[Gpu], source: str) -> Gpu:
    """MIG-GPU-<uuid>/<gi>/<ci>: the slice of that GPU with those instance ids."""
    parent_uuid, gi, ci = legacy
    parent = _by_prefix(parent_uuid, [gpu for gpu in gpus if gpu.mig is None], source)
    shown = for_error(ref, quote=False)
    if not parent.mig_mode:
        raise ConfigError(source, "gpus", f"{shown}: GPU {parent.index} is not in MIG mode")
    slices = [gpu for gpu in gpus if gpu.mig is not None and gpu.mig.parent == parent.index]
    for gpu in slices:
        if gpu.shown == f"{parent.index}/{gi}/{ci}":
            return gpu
    raise ConfigError(
        source,
        "gpus",
        f"{shown}: GPU {parent.index} has no MIG device with GPU instance "
        f"{gi} and compute instance {ci} (it has {', '.join(g.shown for g in slices) or 'none'})",
    )


def _by_prefix(ref: str, gpus: Sequence[Gpu], source: str) -> Gpu:
    """A UUID names its GPU, a prefix the one whose UUID starts with it (CUDA_VISIBLE_DEVICES)."""
    matches = [gpu for gpu in gpus if gpu.uuid.lower().startswith(ref.lower())]
    exact = [gpu for gpu in matches if len(gpu.uuid) == len(ref)]
    shown = for_error(ref, quote=False)
    if not matches:
        raise ConfigError(source, "gpus", f"no GPU has UUID {shown}")
    if len(matches) > 1 and not exact:
        raise ConfigError(source, "gpus", f"{shown} is the start of more than one GPU's UUID")
    return (exact or matches)[0]


def fail_on_owned_faults(
    wanted: GpuSelection | None, gpus: Sequence[Gpu], faults: Sequence[GpuFault], unit: str
) -> None:
    """An NVML error on a GPU the unit owns fails the run; on any other GPU it is a warning."""
    if not faults or wanted is None:
        return
    who = unit or "this run"
    if wanted == "all":
        raise NvmlUnavailable(f"{faults[0].error} (a GPU of {who}: gpus = all)")
    uuids = {gpu.uuid.lower(): gpu.index for gpu in gpus}
    owned_indices = {uuids.get(ref.lower()) if isinstance(ref, str) else ref for ref in wanted}
    owned_uuids = {ref.lower() for ref in wanted if isinstance(ref, str)}
    for fault in faults:
        if fault.index in owned_indices or (fault.uuid or "").lower() in owned_uuids:
            raise NvmlUnavailable(f"{fault.error} (a GPU of {who})")
    unknown = [ref for ref in owned_uuids if not any(uuid.startswith(ref) for uuid in uuids)]
    nameless = [fault for fault in faults if fault.uuid is None]
    if unknown and nameless:
        raise NvmlUnavailable(
            f"{nameless[0].error}; {who}'s GPU {for_error(unknown[0], quote=False)} is not among "
            "those NVML can read"
        )
