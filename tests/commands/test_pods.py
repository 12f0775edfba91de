"""Pods named as Kubernetes names them (host/oci.py): containerd's and CRI-O's annotations
into namespace/pod/container in the journal fields, the lease and the refusal, escaped and
bounded whatever a pod author wrote; the sandbox (pause) container never gated, and a
container that only claims to be one still gated."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.errors import ExitCode
from gpugate.front.container_hook import run_container_hook
from gpugate.host.oci import ContainerState, is_sandbox, parse_config
from gpugate.host.scan import ProcFs
from gpugate.integrations.container import PodName, identify, pod_name
from gpugate.integrations.records import read_leases
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from gpugate.untrusted import CONTAINER
from tests.fakes import FakeHost, alive

A_ID, B_ID = "a" * 64, "b" * 64

CONTAINERD = {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.sandbox-id": B_ID,
    "io.kubernetes.cri.sandbox-namespace": "ml",
    "io.kubernetes.cri.sandbox-name": "vllm-0",
    "io.kubernetes.cri.container-name": "server",
}
CRIO = {
    "io.kubernetes.cri-o.ContainerType": "container",
    "io.kubernetes.cri-o.SandboxID": B_ID,
    "io.kubernetes.pod.namespace": "ml",
    "io.kubernetes.pod.name": "vllm-0",
    "io.kubernetes.container.name": "server",
}


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        (CONTAINERD, PodName("ml", "vllm-0", "server")),
        (CRIO, PodName("ml", "vllm-0", "server")),
        ({**CONTAINERD, "io.kubernetes.cri.container-name": ""}, PodName("ml", "vllm-0", "")),
        ({"io.kubernetes.cri.sandbox-name": "vllm-0"}, None),  # no namespace: no pod
        ({"io.kubernetes.pod.namespace": "ml"}, None),
        ({"nerdctl/name": "vllm"}, None),
        ({}, None),
    ],
)
def test_pod_names_from_each_runtime_s_annotations(
    annotations: dict[str, str], expected: PodName | None
) -> None:
    assert pod_name(annotations) == expected


@pytest.mark.parametrize(
    ("annotations", "sandbox"),
    [
        (
            {"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-id": A_ID},
            True,
        ),
        (
            {"io.kubernetes.cri-o.ContainerType": "sandbox", "io.kubernetes.cri-o.SandboxID": A_ID},
            True,
        ),
        # claims to be a sandbox, but the sandbox it names is another container: gated
        (
            {"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-id": B_ID},
            False,
        ),
        ({"io.kubernetes.cri.container-type": "sandbox"}, False),
        (
            {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": A_ID},
            False,
        ),
        (
            {"io.kubernetes.cri.container-type": "SANDBOX", "io.kubernetes.cri.sandbox-id": A_ID},
            False,
        ),
        # one runtime's type with the other's id
        (
            {"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri-o.SandboxID": A_ID},
            False,
        ),
        ({}, False),
    ],
)
def test_the_sandbox_is_the_container_the_runtime_made_for_the_pod(
    annotations: dict[str, str], sandbox: bool
) -> None:
    assert is_sandbox(A_ID, annotations) is sandbox


def spec_with(annotations: dict[str, str], container_id: str = A_ID) -> bytes:
    return json.dumps(
        {
            "process": {"env": []},
            "linux": {
                "cgroupsPath": f"kubepods-besteffort.slice:cri-containerd:{container_id}",
                "devices": [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}],
            },
            "annotations": annotations,
        }
    ).encode()


HOSTILE = [
    "ml\nGPUGATE_UNIT=vllm.service",
    "\x1b[31mred\x1b[0m",
    "\u202eevil\u202c",
    "x" * 10_000,
    "\udcff\ud800",
    "a\u2028b\x00c",
]


@pytest.mark.message
@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_pod_names_are_escaped_and_bounded(text: str) -> None:
    annotations = {
        **CONTAINERD,
        "io.kubernetes.cri.sandbox-namespace": text,
        "io.kubernetes.cri.sandbox-name": text,
        "io.kubernetes.cri.container-name": text,
    }
    spec = parse_config(spec_with(annotations))
    state = ContainerState(A_ID, 0, "/nonexistent", annotations)
    identity = identify(state, spec, ProcFs(Path("/proc")))
    assert identity.id == A_ID and identity.unit == f"cri-containerd-{A_ID}.scope"
    label = identity.label
    assert label.isprintable() and A_ID[:12] in label
    assert len(label) <= len("containerd container  (123456789012)") + CONTAINER.chars
    fields = identity.fields()
    assert fields["GPUGATE_OCI_CONTAINER"] == A_ID
    for field in ("GPUGATE_OCI_POD_NAMESPACE", "GPUGATE_OCI_POD", "GPUGATE_OCI_POD_CONTAINER"):
        assert fields[field].isprintable() and len(fields[field]) <= CONTAINER.chars


def test_a_pod_s_container_is_named_in_its_lease_journal_and_refusals(host: FakeHost) -> None:
    (stale,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(stale, {1}, 4000)
    unit_a, unit_b = f"cri-containerd-{A_ID}.scope", f"cri-containerd-{B_ID}.scope"
    running = {unit_a: "active", unit_b: "active"}

    def hook(container_id: str, annotations: dict[str, str]) -> int:
        def reporter(unit: str, phase: str, *, fields: object = None) -> Reporter:
            return Reporter(
                unit, phase, journal=host.journal, notifier=host.notifier, echo=False, fields=fields
            )  # type: ignore[arg-type]

        return run_container_hook(
            Phase.PRE,
            ContainerState(container_id, 0, "/nonexistent/bundle"),
            parse_config(spec_with(annotations, container_id)),
            roots=host.roots,
            driver_factory=lambda: host.memory,
            reporter_factory=reporter,  # type: ignore[arg-type]
            loaded=host.config(),
            unit_state=running.get,
            stream=io.StringIO(),
        )

    assert hook(A_ID, CONTAINERD) == ExitCode.OK
    assert not alive(stale)
    (lease,) = read_leases(host.root / "locks").leases
    assert lease.unit == unit_a
    assert "ml/vllm-0/server" in lease.container and A_ID[:12] in lease.container
    started = host.journal.events("run_started")[0]
    assert started["GPUGATE_OCI_POD_NAMESPACE"] == "ml"
    assert started["GPUGATE_OCI_POD"] == "vllm-0"
    assert started["GPUGATE_OCI_POD_CONTAINER"] == "server"
    assert started["GPUGATE_OCI_RUNTIME"] == "containerd"

    other = {**CRIO, "io.kubernetes.pod.name": "other-0", "io.kubernetes.container.name": "c"}
    assert hook(B_ID, other) == ExitCode.HELD_BY_OTHERS
    refused = [e for e in host.journal.events("refused") if e["GPUGATE_OCI_CONTAINER"] == B_ID]
    assert refused and refused[0]["GPUGATE_OCI_POD"] == "other-0"
    assert [(e["GPUGATE_REASON"], e["GPUGATE_LEASE_UNIT"]) for e in refused] == [
        ("leased", unit_a)
    ]  # a's lease


def test_the_hook_leaves_a_pod_s_sandbox_alone_at_once(tmp_path: Path) -> None:
    """A sandbox that asks for a GPU (NVIDIA's runtime as the default, say): exit 0, nothing
    read beyond its config.json."""
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o700)
    annotations = {
        "io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-id": A_ID,
    }
    (bundle / "config.json").write_bytes(spec_with(annotations))
    raw = json.dumps({"id": A_ID, "pid": 0, "bundle": str(bundle)}).encode()
    code = "import sys; sys.argv[1:] = sys.argv[2:]; from gpugate.front.entry import run; run()"
    done = subprocess.run(
        [sys.executable, "-c", code, "-", "oci-hook", "createRuntime"],
        input=raw,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, b"")
