"""A CRI container as Kubernetes names it (namespace/pod/container), and its pod's sandbox,
from the annotations its runtime writes into the spec: containerd's CRI plugin
(`io.kubernetes.cri.*`) and CRI-O (`io.kubernetes.pod.*`, `io.kubernetes.cri-o.*`).

The names are the pod author's text (a namespace, a pod's and a container's name) and are
shown only escaped (untrusted.py), beside the container's id, never in its place.
The sandbox (the pause container that holds a pod's namespaces) is the container whose
annotations say `sandbox` *and* whose sandbox id is its own id: the runtime sets both (the
sandbox's container id is the pod's id), and no one who starts a container can know its id
in advance to forge it. Standard library only: `gpugate oci-hook`'s first step reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SANDBOX = "sandbox"


@dataclass(frozen=True)
class CriKeys:
    kind: str  # "sandbox" or "container"
    sandbox_id: str
    namespace: str
    pod: str
    container: str


CONTAINERD = CriKeys(
    kind="io.kubernetes.cri.container-type",
    sandbox_id="io.kubernetes.cri.sandbox-id",
    namespace="io.kubernetes.cri.sandbox-namespace",
    pod="io.kubernetes.cri.sandbox-name",
    container="io.kubernetes.cri.container-name",
)
CRIO = CriKeys(
    kind="io.kubernetes.cri-o.ContainerType",
    sandbox_id="io.kubernetes.cri-o.SandboxID",
    namespace="io.kubernetes.pod.namespace",
    pod="io.kubernetes.pod.name",
    container="io.kubernetes.container.name",
)
RUNTIMES = (CONTAINERD, CRIO)


@dataclass(frozen=True)
class PodName:
    """Raw, as the annotations have it: escape before showing."""

    namespace: str
    pod: str
    container: str  # "" where the runtime names none

    @property
    def text(self) -> str:
        """`ml/vllm-0/server`, as kubectl names a pod's container."""
        parts = (self.namespace, self.pod, self.container)
        return "/".join(part for part in parts if part)


def pod_name(annotations: Mapping[str, str]) -> PodName | None:
    """The pod a CRI container belongs to; None where no runtime's annotations name one."""
    for keys in RUNTIMES:
        namespace = annotations.get(keys.namespace, "")
        pod = annotations.get(keys.pod, "")
        if namespace and pod:
            return PodName(namespace, pod, annotations.get(keys.container, ""))
    return None


def is_sandbox(container_id: str, annotations: Mapping[str, str]) -> bool:
    """A pod's sandbox (pause) container: never gated, it holds no GPU."""
    return any(
        annotations.get(keys.kind) == SANDBOX and annotations.get(keys.sandbox_id) == container_id
        for keys in RUNTIMES
    )
