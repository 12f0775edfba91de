"""A CRI client, as the kubelet talks to containerd: gRPC over containerd's socket, the
`runtime.v1` API of k8s.io/cri-api v0.25 (what containerd 1.6 serves; cri_api/api.proto).

The Python stubs are generated at test time with grpcio-tools from that proto into
REPO/.simhost/cri-stubs/KEY (KEY: the proto's and grpcio-tools' digest), once per change,
serialised by a lock file; nothing generated is committed. Every call has a deadline: a hang
guard only (the tests synchronise on what containerd answers, never on time).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from realparts import _locked
from sandbox import REPO

PROTO = Path(__file__).resolve().parent / "cri_api" / "api.proto"
STUBS = REPO / ".simhost" / "cri-stubs"
# A hang guard for each call: RunPodSandbox and StartContainer run runc, the runtime chain
# and gpugate's hook (whose `pre` may wait for the GPU's memory) on a busy shared machine.
CALL_TIMEOUT_S = 180.0
NETWORK_NODE = 2  # runtime.v1 NamespaceMode.NODE: the host's network, as hostNetwork: true


def generate_stubs(proto: Path = PROTO, into: Path = STUBS) -> Path:
    """The folder holding api_pb2.py and api_pb2_grpc.py generated from PROTO; skips the test
    where grpcio-tools is not installed (scripts/setup installs it with the test extras)."""
    try:
        tools = importlib.import_module("grpc_tools")
        importlib.import_module("grpc")
    except ImportError as missing:
        pytest.skip(f"grpcio-tools is not installed ({missing}): pip install -e '.[test]'")
    version = getattr(importlib.import_module("grpc_tools"), "__version__", "")
    key = hashlib.sha256(proto.read_bytes() + version.encode() + str(tools).encode())
    folder = into / key.hexdigest()[:16]
    with _locked(into / ".lock"):
        if (folder / "api_pb2_grpc.py").exists():
            return folder
        into.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=into, prefix=".gen-"))
        try:
            argv = [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto.parent}"]
            argv += [f"--python_out={scratch}", f"--grpc_python_out={scratch}", str(proto)]
            made = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
            if made.returncode != 0:
                raise AssertionError(f"protoc failed on {proto}: {made.stderr.strip()}")
            os.replace(scratch, folder)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return folder


def stubs() -> tuple[ModuleType, ModuleType]:
    """(api_pb2, api_pb2_grpc), generated where needed and imported."""
    folder = str(generate_stubs())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("api_pb2"), importlib.import_module("api_pb2_grpc")


@dataclass
class Pod:
    """What the kubelet knows of a pod: its sandbox's config, and the id containerd gave it."""

    name: str
    namespace: str
    uid: str
    config: Any
    sandbox_id: str = ""
    containers: dict[str, str] = field(default_factory=dict)  # name -> container id

    @property
    def slice(self) -> str:
        """The pod's cgroup parent as kubelet's systemd driver names a BestEffort pod's."""
        return f"kubepods-besteffort-pod{self.uid.replace('-', '_')}.slice"


class CriError(AssertionError):
    """A CRI call that failed: its method, gRPC status code and containerd's words."""

    def __init__(self, method: str, code: str, details: str) -> None:
        super().__init__(f"{method}: {code}: {details}")
        self.method = method
        self.code = code
        self.details = details


class CriClient:
    """The kubelet's side of containerd's CRI, the calls a pod's life takes."""

    def __init__(self, socket: str, timeout: float = CALL_TIMEOUT_S) -> None:
        import grpc

        self.api, grpc_api = stubs()
        self.timeout = timeout
        self._grpc = grpc
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.runtime = grpc_api.RuntimeServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.runtime, method)(request, timeout=self.timeout)
        except self._grpc.RpcError as error:
            raise CriError(method, error.code().name, error.details() or "") from None

    def ready(self) -> bool:
        """Whether the CRI answers Version (containerd up, its CRI plugin loaded)."""
        try:
            self._call("Version", self.api.VersionRequest(version="v1"))
        except CriError:
            return False
        return True

    def version(self) -> Any:
        return self._call("Version", self.api.VersionRequest(version="v1"))

    def wait_ready(self, deadline_s: float = CALL_TIMEOUT_S) -> None:
        end = time.monotonic() + deadline_s
        while not self.ready():
            if time.monotonic() > end:
                raise AssertionError(f"containerd's CRI did not answer within {deadline_s:g} s")
            time.sleep(0.2)

    def pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        annotations: Mapping[str, str] | None = None,
    ) -> Pod:
        """A pod's sandbox config as the kubelet makes it for a hostNetwork pod: metadata,
        labels, annotations, a log folder, its pod slice as cgroup parent, no hostname."""
        api = self.api
        uid = str(hashlib.sha256(f"{namespace}/{name}/{time.monotonic_ns()}".encode()).hexdigest())
        uid = f"{uid[:8]}-{uid[8:12]}-{uid[12:16]}-{uid[16:20]}-{uid[20:32]}"
        pod = Pod(name, namespace, uid, None)
        pod.config = api.PodSandboxConfig(
            metadata=api.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
            log_directory=f"/var/log/pods/{namespace}_{name}_{uid}",
            labels={
                "io.kubernetes.pod.name": name,
                "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": uid,
            },
            annotations=dict(annotations or {}),
            linux=api.LinuxPodSandboxConfig(
                cgroup_parent=pod.slice,
                security_context=api.LinuxSandboxSecurityContext(
                    namespace_options=api.NamespaceOption(network=NETWORK_NODE)
                ),
            ),
        )
        return pod

    def run_pod_sandbox(self, pod: Pod, runtime_handler: str) -> str:
        said = self._call(
            "RunPodSandbox",
            self.api.RunPodSandboxRequest(config=pod.config, runtime_handler=runtime_handler),
        )
        pod.sandbox_id = said.pod_sandbox_id
        return pod.sandbox_id

    def create_container(
        self,
        pod: Pod,
        name: str,
        image: str,
        command: Sequence[str],
        *,
        envs: Mapping[str, str] | None = None,
        mounts: Sequence[tuple[str, str]] = (),
        annotations: Mapping[str, str] | None = None,
    ) -> str:
        """CreateContainer in POD; MOUNTS are (host path, container path) binds."""
        api = self.api
        config = api.ContainerConfig(
            metadata=api.ContainerMetadata(name=name, attempt=0),
            image=api.ImageSpec(image=image),
            command=list(command),
            envs=[api.KeyValue(key=k, value=v) for k, v in (envs or {}).items()],
            mounts=[api.Mount(host_path=h, container_path=c) for h, c in mounts],
            labels={"io.kubernetes.container.name": name},
            annotations=dict(annotations or {}),
            log_path=f"{name}/0.log",
            linux=api.LinuxContainerConfig(
                security_context=api.LinuxContainerSecurityContext(
                    namespace_options=api.NamespaceOption(network=NETWORK_NODE)
                ),
            ),
        )
        said = self._call(
            "CreateContainer",
            api.CreateContainerRequest(
                pod_sandbox_id=pod.sandbox_id, config=config, sandbox_config=pod.config
            ),
        )
        pod.containers[name] = said.container_id
        return str(said.container_id)

    def start_container(self, container_id: str) -> None:
        self._call("StartContainer", self.api.StartContainerRequest(container_id=container_id))

    def stop_container(self, container_id: str, grace_s: int = 10) -> None:
        self._call(
            "StopContainer",
            self.api.StopContainerRequest(container_id=container_id, timeout=grace_s),
        )

    def remove_container(self, container_id: str) -> None:
        self._call("RemoveContainer", self.api.RemoveContainerRequest(container_id=container_id))

    def container_state(self, container_id: str) -> str:
        """CONTAINER_CREATED, CONTAINER_RUNNING, CONTAINER_EXITED or CONTAINER_UNKNOWN."""
        said = self._call(
            "ContainerStatus", self.api.ContainerStatusRequest(container_id=container_id)
        )
        return str(self.api.ContainerState.Name(said.status.state))

    def container_info(self, container_id: str) -> dict[str, Any]:
        """containerd's verbose ContainerStatus `info`: its pid, the OCI spec it made."""
        said = self._call(
            "ContainerStatus",
            self.api.ContainerStatusRequest(container_id=container_id, verbose=True),
        )
        info: dict[str, Any] = json.loads(said.info["info"])
        return info

    def container_pid(self, container_id: str) -> int:
        """The container's first process, as containerd knows it."""
        return int(self.container_info(container_id)["pid"])

    def sandbox_info(self, pod: Pod) -> dict[str, Any]:
        """containerd's verbose PodSandboxStatus `info`: the pause container's spec, its pid."""
        said = self._call(
            "PodSandboxStatus",
            self.api.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox_id, verbose=True),
        )
        info: dict[str, Any] = json.loads(said.info["info"])
        return info

    def stop_pod_sandbox(self, pod: Pod) -> None:
        self._call("StopPodSandbox", self.api.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id))

    def remove_pod_sandbox(self, pod: Pod) -> None:
        self._call(
            "RemovePodSandbox", self.api.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id)
        )

    def sandbox_ready(self, pod: Pod) -> bool:
        said = self._call(
            "PodSandboxStatus", self.api.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox_id)
        )
        return bool(said.status.state == self.api.SANDBOX_READY)

    def sandboxes(self) -> list[str]:
        said = self._call("ListPodSandbox", self.api.ListPodSandboxRequest())
        return [item.id for item in said.items]

    def containers(self) -> list[str]:
        said = self._call("ListContainers", self.api.ListContainersRequest())
        return [item.id for item in said.containers]
