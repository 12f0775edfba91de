"""An NRI container as `gpugate oci-hook` sees one: the ContainerState and ContainerSpec its
run takes, made from NRI's PodSandbox and Container (what the runtime generated for the
container's OCI spec: env, mounts, devices, annotations, hooks, cgroups path), so that the
container's GPUs are read by the same rules (host/oci.py's `spec_gpu_request`).

At CreateContainer the container has no process yet (pid 0): its cgroup is its spec's
`linux.cgroupsPath`, as the OCI hook reads it when the state gives no pid. Its names are
the runtime's own NRI fields (the pod's namespace and name, the container's name), given
to the run as the CRI annotations containerd and CRI-O write, over any the pod set itself."""

from __future__ import annotations

from gpugate.errors import BadInput
from gpugate.host.nri_api import api_pb2
from gpugate.host.oci import (
    CONTAINER_ID,
    CRI_KEYS,
    ContainerSpec,
    ContainerState,
    GpuRequest,
    Toolkit,
    spec_gpu_request,
)
from gpugate.integrations.container import RUNTIME_NAME_ANNOTATIONS
from gpugate.untrusted import for_error

# The path NVIDIA's runtime gives the prestart hook it adds at `create` (after NRI), standing
# for it where the pod's runtime handler is NVIDIA's: its lists then count.
NVIDIA_HOOK = "/usr/bin/nvidia-container-runtime-hook"
NO_BUNDLE = "/"  # NRI names no bundle: no runtime record beside one is read
MAX_ITEMS = 65536  # env entries, mounts, devices: a spec's lists are far shorter


def is_pod_sandbox(pod: api_pb2.PodSandbox, container: api_pb2.Container) -> bool:
    """The pod's own (pause) container: NRI gives a pod apart from its containers, so a
    CreateContainer of one is no runtime's; never gated."""
    return container.id in (pod.id, container.pod_sandbox_id)


def oci_view(
    pod: api_pb2.PodSandbox,
    container: api_pb2.Container,
    *,
    nvidia_runtime: bool,
    toolkit: Toolkit | None = None,
    lenient: bool = False,
) -> tuple[ContainerState, ContainerSpec]:
    """nvidia_runtime: the pod's runtime handler runs NVIDIA's runtime, which adds its hook to
    the spec after NRI saw it. lenient (after the stop): a GPU request that cannot be resolved
    is kept as such, for the lease to answer (host/oci.py's parse_config)."""
    if not CONTAINER_ID.fullmatch(container.id):
        raise BadInput(f"NRI: container id {for_error(container.id)} is no container id")
    spec = spec_of(container, nvidia_runtime=nvidia_runtime)
    try:
        gpus = spec_gpu_request(spec, toolkit)
    except BadInput as exc:
        if not lenient:
            raise
        gpus = GpuRequest(unresolved=exc)
    cgroups_path = container.linux.cgroups_path or None
    state = ContainerState(container.id, 0, NO_BUNDLE, runtime_names(pod, container))
    return state, ContainerSpec(gpus, cgroups_path, dict(container.annotations))


def spec_of(container: api_pb2.Container, *, nvidia_runtime: bool) -> dict[str, object]:
    """The parts of an OCI config.json that say which GPUs a container reaches."""
    hooks: dict[str, list[dict[str, object]]] = {
        "prestart": [{"path": hook.path} for hook in container.hooks.prestart],
        "createRuntime": [{"path": hook.path} for hook in container.hooks.create_runtime],
    }
    if nvidia_runtime:
        hooks["prestart"].append({"path": NVIDIA_HOOK})
    _bounded(len(container.env), "env")
    _bounded(len(container.mounts), "mounts")
    _bounded(len(container.linux.devices), "linux.devices")
    return {
        "process": {"env": list(container.env)},
        "mounts": [
            {
                "destination": mount.destination,
                "type": mount.type,
                "source": mount.source,
                "options": list(mount.options),
            }
            for mount in container.mounts
        ],
        "linux": {
            "devices": [
                {"path": dev.path, "type": dev.type, "major": dev.major, "minor": dev.minor}
                for dev in container.linux.devices
            ],
            "cgroupsPath": container.linux.cgroups_path,
        },
        "annotations": dict(container.annotations),
        "hooks": hooks,
    }


def runtime_names(pod: api_pb2.PodSandbox, container: api_pb2.Container) -> dict[str, str]:
    """The pod's and container's names as containerd's and CRI-O's own annotations, from NRI's
    fields (the runtime's: a pod cannot set them)."""
    names: dict[str, str] = {}
    for kind, sandbox_id, namespace, pod_key, container_key in CRI_KEYS:
        names.update(
            {
                kind: "container",
                sandbox_id: container.pod_sandbox_id,
                namespace: pod.namespace,
                pod_key: pod.name,
                container_key: container.name,
            }
        )
    for name_key, pod_key in RUNTIME_NAME_ANNOTATIONS.values():
        names.update({name_key: container.name, pod_key: pod.name})
    return {key: value for key, value in names.items() if value}


def _bounded(count: int, field: str) -> None:
    if count > MAX_ITEMS:
        raise BadInput(f"NRI: the container's {field} has {count} entries, over {MAX_ITEMS}")
