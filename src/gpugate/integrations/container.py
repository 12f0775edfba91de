"""A container's surroundings for `gpugate oci-hook`: who the container is, its cgroup, its
GPUs as config, and its GPU lease (a unit's surroundings, with the container's scope as
the unit).

The lease is named after the container's scope (`libpod-ID.scope`, `docker-ID.scope`): the
systemd cgroup driver makes that a transient unit, active exactly while the container runs,
so every unit's pre, `gpugate run` and other container reads it as it reads a unit's lease,
and one whose container died without its poststop is stale as soon as the scope is gone.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpugate.config.file import DEFAULT_CONFIG_DIR
from gpugate.config.models import GpuSelection, LoadedConfig
from gpugate.core.run import RunScope
from gpugate.host.containers import container_of_cgroup
from gpugate.host.nvml import Gpu
from gpugate.host.oci import (
    ContainerSpec,
    ContainerState,
    GpuRequest,
    cgroup_of_spec,
    container_name,
    manager_of,
    safe_name,
)
from gpugate.host.oci_gpus import NVIDIA_MAJOR, OciInputError
from gpugate.host.pods import PodName, pod_name
from gpugate.host.procfs import ProcFs
from gpugate.host.systemd import unit_of_cgroup
from gpugate.integrations.config_files import load_config
from gpugate.integrations.unit.gpu_source import GpuChoice
from gpugate.integrations.unit.leases import Lease, new_lease
from gpugate.integrations.unit.shared_host import UnitContext, UnitSurroundings
from gpugate.integrations.unit.start_failure import failed_pre_of_this_start
from gpugate.report import oci_text
from gpugate.report.journal import Reporter
from gpugate.report.narrate_unit import UnitNarration
from gpugate.report.oci_text import container_label
from gpugate.untrusted import CONTAINER, echo, shown

CONFIG_NAME = "containers.toml"
DOCKER_CONFIG = Path("/var/lib/docker/containers")
MAX_DOCKER_CONFIG = 4 << 20
MAX_STORAGE_RECORDS = 32 << 20  # one record per container on the host
# Before it starts a container owns no process: its runtime's init waiting in its scope is
# not a holder to kill. A cgroup below the scope that never exists stands for "none yet".
NOT_STARTED = "gpugate-before-start"


@dataclass(frozen=True)
class ContainerIdentity:
    id: str
    name: str | None
    runtime: str  # podman, docker, cri-o, containerd, or "container" where nothing says
    cgroup: str | None  # the scope its processes run in
    unit: str  # the scope's unit name, what its lease is named after
    pod: PodName | None = None  # a CRI container's namespace/pod/container (host/pods.py)

    @property
    def label(self) -> str:
        """`podman container vllm (3f2a1b0c4d5e)`; a pod's `containerd container
        ml/vllm-0/server (3f2a1b0c4d5e)`."""
        if self.pod is not None:
            return container_label(self.runtime, self.id, shown(self.pod.text, CONTAINER))
        return container_label(self.runtime, self.id, self.name)

    def fields(self) -> dict[str, str]:
        """The journal fields every entry of this run carries (docs/journal.md)."""
        # Not GPUGATE_CONTAINER: that is a holder's container, in the entries about holders.
        found = {"GPUGATE_OCI_CONTAINER": self.id, "GPUGATE_OCI_RUNTIME": self.runtime}
        if self.name:
            found["GPUGATE_OCI_CONTAINER_NAME"] = self.name
        if self.pod is not None:
            found.update(pod_fields(self.pod))
        return found


def pod_fields(pod: PodName) -> dict[str, str]:
    """GPUGATE_OCI_POD_*: the pod author's names, escaped as every untrusted text is."""
    named = {
        "GPUGATE_OCI_POD_NAMESPACE": pod.namespace,
        "GPUGATE_OCI_POD": pod.pod,
        "GPUGATE_OCI_POD_CONTAINER": pod.container,
    }
    return {field: shown(value, CONTAINER) for field, value in named.items() if value}


def identify(state: ContainerState, spec: ContainerSpec, procfs: ProcFs) -> ContainerIdentity:
    """The container's cgroup from its init's /proc/PID/cgroup (the runtime made it before
    the hook), else from the spec's cgroupsPath; its name from the runtime's annotations,
    else (docker) from docker's own record of it."""
    cgroup = None
    if state.pid > 0:
        info = procfs.info(state.pid)
        cgroup = info.cgroup if info is not None else None
    cgroup = cgroup if cgroup and cgroup != "/" else cgroup_of_spec(spec.cgroups_path, state.id)
    scope = container_of_cgroup(cgroup)
    runtime = scope.runtime if scope else manager_of(state, spec) or "container"
    if scope is not None and scope.id == state.id:
        cgroup = scope.scope
    name = container_name(state, spec)
    if name is None and runtime == "docker":
        name = docker_name(state.id)
    if name is None:
        name = storage_name(state.id, state.bundle)
    unit = unit_of_cgroup(cgroup) if cgroup else None
    return ContainerIdentity(
        id=state.id,
        name=name,
        runtime=runtime,
        cgroup=cgroup,
        unit=unit or f"container-{state.id[:64]}",
        pod=pod_name({**spec.annotations, **state.annotations}),
    )


def docker_name(container_id: str, root: Path = DOCKER_CONFIG) -> str | None:
    """The name dockerd recorded at create (config.v2.json, root's, before the start)."""
    data = _owned_json(root / container_id / "config.v2.json", MAX_DOCKER_CONFIG)
    name = data.get("Name") if isinstance(data, dict) else None
    return safe_name(name.strip("/")) if isinstance(name, str) else None


def storage_name(container_id: str, bundle: str) -> str | None:
    """podman's (and CRI-O's) name for it: containers/storage records every container with
    its names in DRIVER-containers/containers.json, two folders above the bundle
    (DRIVER-containers/ID/userdata)."""
    folder = Path(bundle)
    if folder.name != "userdata" or folder.parent.name != container_id:
        return None
    records = _owned_json(folder.parent.parent / "containers.json", MAX_STORAGE_RECORDS)
    for record in records if isinstance(records, list) else ():
        if isinstance(record, dict) and record.get("id") == container_id:
            names = record.get("names")
            if isinstance(names, list) and names and isinstance(names[0], str):
                return safe_name(names[0])
    return None


def _owned_json(path: Path, limit: int) -> object:
    """A JSON file this process's user owns, not a link, at most limit bytes; None if not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as stream:
        info = os.fstat(stream.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        raw = stream.read(limit + 1)
    if len(raw) > limit:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def container_config(config_dir: Path = DEFAULT_CONFIG_DIR) -> LoadedConfig:
    """/etc/gpugate/containers.toml, read and checked as a unit's file is; the built-in
    defaults where it is absent."""
    path = config_dir / CONFIG_NAME
    return load_config(None, path if path.exists() else None, config_dir)


def gpu_selection(request: GpuRequest, gpus: list[Gpu], source: str) -> GpuSelection:
    """The container's GPUs as the config's `gpus`: the UUIDs of the GPUs it reaches. A device
    minor, index or UUID NVML does not know is refused (exit 64), never guessed."""
    if request.all_gpus:
        return "all"
    by_minor = {gpu.minor: gpu for gpu in gpus}
    by_ref: dict[str, Gpu] = {str(gpu.index): gpu for gpu in gpus}
    by_ref.update((gpu.uuid.lower(), gpu) for gpu in gpus)
    chosen: dict[str, str] = {}
    for minor in request.minors:
        gpu = by_minor.get(minor)
        if gpu is None:
            raise OciInputError(
                f"{source}: the device {NVIDIA_MAJOR}:{minor} it reaches is no GPU NVML knows"
            )
        chosen.setdefault(gpu.uuid.lower(), gpu.uuid)
    for ref in request.refs:
        gpu = by_ref.get(ref.lower())
        if gpu is None:
            where = ", ".join(request.origins) or "config.json"
            raise OciInputError(f"config.json: {echo(where)}: {echo(ref)} is no GPU NVML knows")
        chosen.setdefault(gpu.uuid.lower(), gpu.uuid)
    return tuple(chosen.values())


def request_text(request: GpuRequest) -> str:
    """Where the GPUs came from, for the run's first entry."""
    return oci_text.request_text(
        request.minors, request.refs, request.all_gpus, request.origins, request.note
    )


@dataclass
class ContainerSurroundings(UnitSurroundings):
    """A unit's surroundings where the unit is the container's scope: its lease carries the
    container in words; no manual-run guard (the runtime runs the hook), no environment."""

    identity: ContainerIdentity | None = None

    def _lease(self, owned: Sequence[Gpu]) -> Lease:
        return new_lease(
            self.unit,
            owned,
            share=self.loaded.config.share_gpus,
            container=self.identity.label if self.identity else None,
        )


def container_surroundings(
    identity: ContainerIdentity, choice: GpuChoice, context: UnitContext
) -> Callable[[RunScope, LoadedConfig, Reporter], ContainerSurroundings]:
    """How the hook's surroundings are made once the run's scope and config are known: the
    config already has the container's GPUs (choice)."""

    def make(scope: RunScope, loaded: LoadedConfig, reporter: Reporter) -> ContainerSurroundings:
        surroundings = ContainerSurroundings(
            scope, loaded, context, choice, UnitNarration(reporter), identity=identity
        )
        if scope.phase.traits.reads_failed_start:
            lock_dir = loaded.config.lock_dir
            surroundings.failed_pre = failed_pre_of_this_start(lock_dir, scope.unit, {})
        return surroundings

    return make
