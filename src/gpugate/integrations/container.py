"""A container's surroundings for `gpugate oci-hook`: a unit's, with the container's own
systemd scope (`libpod-ID.scope`, ...) as the unit and its lease's name (`container-ID` where
its cgroup is no such scope); one in no cgroup of its own is refused (docs/containers.md)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from gpugate.config.file import DEFAULT_CONFIG_DIR, LoadedConfig
from gpugate.config.values import GpuSelection, gpu_ref
from gpugate.core.discover import owned_gpus
from gpugate.errors import BadInput, ConfigError, InvalidValue
from gpugate.host.containers import own_cgroup
from gpugate.host.nvml import Gpu
from gpugate.host.oci import (
    CRI_KEYS,
    MAX_FIELD,
    NVIDIA_MAJOR,
    TOOLKIT_CONFIG,
    ContainerSpec,
    ContainerState,
    GpuRequest,
    check_owner,
)
from gpugate.host.safe_files import read_capped
from gpugate.host.scan import ProcFs
from gpugate.host.systemd import system_unit_of_cgroup
from gpugate.integrations.config_files import load_config
from gpugate.untrusted import CGROUP, CONTAINER, escape, field_bytes, for_error, printable

CONFIG_NAME = "containers.toml"
DOCKER_CONFIG = Path("/var/lib/docker/containers")
MAX_DOCKER_CONFIG = 4 << 20
MAX_STORAGE_RECORDS = 32 << 20  # one record per container on the host
# Before it starts a container owns no process: its runtime's init waiting in its scope is
# not a holder to kill. A cgroup below the scope that never exists stands for "none yet".
NOT_STARTED = "gpugate-before-start"
OWN_LEASE_PREFIX = "container-"  # never a unit's name: a unit's has a suffix
# The container's name as the runtime itself writes it into the spec's annotations (with its
# pod's): read only where the container's cgroup says the runtime is that one, for elsewhere
# anyone may set these keys.
RUNTIME_NAME_ANNOTATIONS = {
    "cri-o": ("io.kubernetes.cri-o.ContainerName", "io.kubernetes.pod.name"),
    "containerd": ("io.kubernetes.cri.container-name", "io.kubernetes.cri.sandbox-name"),
}
# Names a container's author may set (`podman --annotation`, `nerdctl --label`, a pod's own
# annotations): shown escaped, as the author's, never in place of the id.
CLAIMED_NAME_ANNOTATIONS = (
    "io.podman.annotations.name",
    "nerdctl/name",
    "io.kubernetes.cri-o.ContainerName",
    "io.kubernetes.cri.container-name",
    "io.container.manager.name",
)


class PodName(NamedTuple):
    """Raw, as the annotations have it: escape before showing."""

    namespace: str
    pod: str
    container: str  # "" where the runtime names none

    @property
    def text(self) -> str:
        """`ml/vllm-0/server`, as kubectl names a pod's container."""
        return "/".join(part for part in (self.namespace, self.pod, self.container) if part)


def pod_name(annotations: Mapping[str, str]) -> PodName | None:
    for _, _, namespace_key, pod_key, container_key in CRI_KEYS:
        namespace = annotations.get(namespace_key, "")
        pod = annotations.get(pod_key, "")
        if namespace and pod:
            return PodName(namespace, pod, annotations.get(container_key, ""))
    return None


class ContainerIdentity(NamedTuple):
    id: str  # the identity everywhere: a name only says it in words
    name: str | None  # from the runtime's own fields (its record, the annotations it writes)
    runtime: str  # podman, docker, cri-o, containerd, nerdctl, or "container" where none says
    cgroup: str | None  # its own cgroup
    unit: str  # what its lease is named after: its own systemd scope, else container-ID
    claimed: tuple[str, str] | None = None  # (annotation, name) its author may have set
    # The system unit its own cgroup lies in (podman --cgroups=split in a Quadlet unit,
    # --cgroup-parent below a service): the container is part of it, by the kernel's tree.
    around: str | None = None
    pod: PodName | None = None  # a CRI container's namespace/pod/container

    @property
    def label(self) -> str:
        """`podman container vllm (3f2a1b0c4d5e)`, `containerd container ml/vllm-0/server
        (3f2a1b0c4d5e)`, `podman container 3f2a1b0c4d5e ("vllm" by its annotation KEY)`."""
        short, runtime = self.id[:12], f"{self.runtime} container"
        name = self.pod.text if self.pod is not None else self.name
        if name:
            return f"{runtime} {printable(name, CONTAINER)} ({short})"
        if self.claimed and self.pod is None:
            key, said = self.claimed
            return f'{runtime} {short} ("{printable(said, CONTAINER)}" by its annotation {key})'
        return f"{runtime} {short}"

    def fields(self) -> dict[str, str | bytes]:
        """The journal fields of every entry of this run (GPUGATE_CONTAINER is a holder's)."""
        found: dict[str, str | bytes] = {
            "GPUGATE_OCI_CONTAINER": self.id,
            "GPUGATE_OCI_RUNTIME": self.runtime,
        }
        if self.name:
            found["GPUGATE_OCI_CONTAINER_NAME"] = field_bytes(self.name, CONTAINER)
        if self.claimed:
            found["GPUGATE_OCI_ANNOTATED_NAME"] = field_bytes(self.claimed[1], CONTAINER)
        if self.pod is not None:
            named = {
                "GPUGATE_OCI_POD_NAMESPACE": self.pod.namespace,
                "GPUGATE_OCI_POD": self.pod.pod,
                "GPUGATE_OCI_POD_CONTAINER": self.pod.container,
            }
            found.update(
                (key, printable(value, CONTAINER)) for key, value in named.items() if value
            )
        return found


def identify(state: ContainerState, spec: ContainerSpec, procfs: ProcFs) -> ContainerIdentity:
    """The container's cgroup from its init's /proc/PID/cgroup, else the spec's cgroupsPath,
    one of its own, else BadInput: a container is never its enclosing unit, whose lease
    it would take. Its name from the runtime's annotations, else its own record of it."""
    info = procfs.info(state.pid) if state.pid > 0 else None
    cgroup = info.cgroup if info is not None else None
    cgroup = cgroup if cgroup and cgroup != "/" else cgroup_of_spec(spec.cgroups_path)
    own = own_cgroup(cgroup, state.id)
    if own is None:
        where = f"cgroup {printable(cgroup, CGROUP)}" if cgroup else "no cgroup the hook can read"
        raise BadInput(
            f"container {state.id[:12]} runs in {where}, not in one of its own (a runtime's "
            "scope or folder named after its id): gated, it would be the unit around it; not "
            "started (docs/containers.md)",
            code="oci-no-own-cgroup",
        )
    runtime = own.runtime
    annotations = {**spec.annotations, **state.annotations}
    name = runtime_name(annotations, runtime) if runtime else None
    if name is None and runtime in (None, "docker"):
        name = docker_name(state.id)
        runtime = runtime or ("docker" if name else None)
    if name is None and runtime in (None, "podman", "cri-o"):
        name = storage_name(state.id, state.bundle)
    return ContainerIdentity(
        id=state.id,
        name=name,
        runtime=runtime or "container",
        cgroup=own.cgroup,
        unit=own.unit or f"{OWN_LEASE_PREFIX}{state.id}",
        claimed=claimed_name(annotations),
        around=None if own.unit else system_unit_of_cgroup(own.cgroup),
        pod=pod_name(annotations) if runtime in ("containerd", "cri-o") else None,
    )


def runtime_name(annotations: Mapping[str, str], runtime: str) -> str | None:
    """The name (`pod/container`) runtime itself wrote; None for a runtime that writes none."""
    keys = RUNTIME_NAME_ANNOTATIONS.get(runtime)
    if keys is None:
        return None
    name = bounded(annotations.get(keys[0], "").lstrip("/"))
    pod = bounded(annotations.get(keys[1], ""))
    return bounded(f"{pod}/{name}") if name and pod else name


def claimed_name(annotations: Mapping[str, str]) -> tuple[str, str] | None:
    """(annotation, name) of the first name the container's author may have set."""
    named = ((key, bounded(annotations.get(key, ""))) for key in CLAIMED_NAME_ANNOTATIONS)
    return next(((key, name) for key, name in named if name), None)


def bounded(text: str) -> str | None:
    """At most MAX_FIELD characters, without the blanks around them; None where none is left."""
    return text[:MAX_FIELD].strip() or None


def cgroup_of_spec(cgroups_path: str | None) -> str | None:
    """linux.cgroupsPath as a cgroup: `slice:prefix:name` (the systemd driver) is the scope
    `/slice/prefix-name.scope` (`a-b.slice` nests as `/a.slice/a-b.slice`); an absolute path
    (cgroupfs) is itself."""
    if not cgroups_path or cgroups_path.startswith("/"):
        return cgroups_path or None
    parts = cgroups_path.split(":")
    if len(parts) != 3 or not all(parts[1:]):
        return None
    slice_name, prefix, name = parts[0] or "system.slice", parts[1], parts[2]
    if not slice_name.endswith(".slice") or "/" in slice_name or slice_name == "-.slice":
        return None
    words = slice_name[: -len(".slice")].split("-")
    nested = "".join("/" + "-".join(words[: i + 1]) + ".slice" for i in range(len(words)))
    return nested + "/" + (name if name.endswith(".slice") else f"{prefix}-{name}.scope")


def docker_name(container_id: str, root: Path = DOCKER_CONFIG) -> str | None:
    """The name dockerd recorded at create (config.v2.json, root's, before the start)."""
    data = _owned_json(root / container_id / "config.v2.json", MAX_DOCKER_CONFIG)
    name = data.get("Name") if isinstance(data, dict) else None
    return bounded(name.strip("/")) if isinstance(name, str) else None


def storage_name(container_id: str, bundle: str) -> str | None:
    """podman's and CRI-O's: containers/storage's DRIVER-containers/containers.json, two
    folders above the bundle (DRIVER-containers/ID/userdata), lists each container's names."""
    folder = Path(bundle)
    if folder.name != "userdata" or folder.parent.name != container_id:
        return None
    records = _owned_json(folder.parent.parent / "containers.json", MAX_STORAGE_RECORDS)
    for record in records if isinstance(records, list) else ():
        if isinstance(record, dict) and record.get("id") == container_id:
            names = record.get("names")
            if isinstance(names, list) and names and isinstance(names[0], str):
                return bounded(names[0])
    return None


def _owned_json(path: Path, limit: int) -> object:
    """A JSON file this process's user owns and alone may write, not a link, at most limit
    bytes; None if not."""
    try:  # a text that is not UTF-8 is a ValueError too
        return json.loads(read_capped(path, limit, check=lambda info: check_owner(info, str(path))))
    except (OSError, ValueError, RecursionError, BadInput):
        return None


def container_config(config_dir: Path = DEFAULT_CONFIG_DIR) -> LoadedConfig:
    """/etc/gpugate/containers.toml, else the lookup's default."""
    path = config_dir / CONFIG_NAME
    return load_config(None, path if path.exists() else None, config_dir)


def gpu_selection(request: GpuRequest, gpus: list[Gpu], source: str) -> GpuSelection:
    """The UUIDs of the GPUs the container reaches; one NVML does not know is refused."""
    if request.all_gpus:
        return "all"
    whole = [gpu for gpu in gpus if gpu.mig is None]
    by_minor = {gpu.minor: gpu for gpu in whole}
    by_ref = {**{str(gpu.index): gpu for gpu in whole}, **{gpu.uuid.lower(): gpu for gpu in whole}}
    where = for_error(", ".join(request.origins) or "config.json")
    refs = [_indexed_slice(ref, gpus, where) if ":" in ref else ref for ref in request.refs]
    slices = {ref: _slice(ref, gpus, where) for ref in refs if ref.upper().startswith("MIG-")}
    # A slice's container gets its GPU's /dev/nvidiaN too: the slice is what it asks for.
    sliced = {gpu.minor for found in slices.values() for gpu in found}
    chosen: dict[str, str] = {}
    for minor in request.minors:
        if minor in sliced:
            continue
        gpu = by_minor.get(minor)
        if gpu is None:
            raise BadInput(
                f"{source}: the device {NVIDIA_MAJOR}:{minor} it reaches is no GPU NVML knows"
            )
        chosen.setdefault(gpu.uuid.lower(), gpu.uuid)
    for ref in refs:
        if ref in slices:
            chosen.setdefault(ref.lower(), ref)
            continue
        gpu = by_ref.get(ref.lower())
        if gpu is None:
            raise BadInput(f"config.json: {where}: {for_error(ref)} is no GPU NVML knows")
        chosen.setdefault(gpu.uuid.lower(), gpu.uuid)
    return tuple(chosen.values())


def _indexed_slice(ref: str, gpus: list[Gpu], where: str) -> str:
    """NVIDIA's `GPU:MIG` pair as its MIG device's UUID: the GPU at that NVML index, the MIG
    device at that index of nvmlDeviceGetMigDeviceHandleByIndex on it (what the toolkit's
    libnvidia-container and its CDI specs both mean by it)."""
    parent, _, index = ref.partition(":")
    for gpu in gpus:
        if gpu.mig is not None and (gpu.mig.parent, gpu.mig.mig_index) == (int(parent), int(index)):
            return gpu.uuid
    raise BadInput(f"config.json: {where}: {for_error(ref)} is no MIG device NVML knows")


def _slice(ref: str, gpus: list[Gpu], where: str) -> list[Gpu]:
    """A MIG device's UUID (either form) as NVML's slice: bad input from the container (64,
    naming its variable) where it is malformed or names no MIG device NVML has."""
    try:
        gpu_ref(ref)
        return owned_gpus((ref,), gpus, where)
    except InvalidValue as exc:
        raise BadInput(f"config.json: {where}: {exc}") from None
    except ConfigError:
        raise BadInput(
            f"config.json: {where}: {for_error(ref)} is no MIG device NVML knows"
        ) from None


def request_text(request: GpuRequest) -> str:
    """`the container's config.json (devices 195:1; NVIDIA's list 0; from linux.devices)`."""
    parts = []
    if request.minors:
        parts.append("devices " + ", ".join(f"195:{m}" for m in request.minors))
    if request.all_gpus:
        parts.append("NVIDIA's list: all")
    elif request.refs:
        parts.append("NVIDIA's list: " + ",".join(escape(ref) for ref in request.refs))
    if request.origins:
        parts.append("from " + ", ".join(escape(origin) for origin in request.origins))
    if request.note:
        parts.append(f"NVIDIA's defaults assumed: {TOOLKIT_CONFIG}: {request.note}")
    return "the container's config.json (" + "; ".join(parts) + ")"
