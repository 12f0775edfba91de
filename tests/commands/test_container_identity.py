"""Issue 34, rule 3: a container is a container only in a cgroup of its own, a folder its
runtime named after its id; its lease is its own scope's, else `container-ID`, never the unit
around it; a container in no cgroup of its own is refused before its start, and its poststop
gives back nothing (host/containers.own_cgroup, integrations/container.identify)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import pytest

from gpugate.errors import BadInput, ExitCode
from gpugate.front.container_hook import run_container_hook
from gpugate.host.containers import OwnCgroup, own_cgroup
from gpugate.host.oci import ContainerState, parse_config
from gpugate.integrations.container import identify
from gpugate.integrations.records import new_lease, read_leases, write_lease
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from tests.fakes import UNIT, FakeHost

A, B = "a" * 64, "b" * 64
KUBE = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice"


@pytest.mark.parametrize(
    ("cgroup", "own"),
    [
        # The systemd driver's scopes: a unit of its own (only slices above it).
        (f"/machine.slice/libpod-{A}.scope", ("/machine.slice/libpod-{A}.scope", "podman", True)),
        (f"/machine.slice/libpod-{A}.scope/container", ("/machine.slice/libpod-{A}.scope", "podman", True)),  # crun
        (f"/system.slice/docker-{A}.scope", ("/system.slice/docker-{A}.scope", "docker", True)),
        (f"{KUBE}/crio-{A}.scope", (f"{KUBE}/crio-{A}.scope", "cri-o", True)),
        (f"{KUBE}/cri-containerd-{A}.scope", (f"{KUBE}/cri-containerd-{A}.scope", "containerd", True)),
        (f"{KUBE}/docker-{A}.scope", (f"{KUBE}/docker-{A}.scope", "docker", True)),
        (f"/system.slice/nerdctl-{A}.scope", ("/system.slice/nerdctl-{A}.scope", "nerdctl", True)),
        (f"/gpu.slice/libpod-{A}.scope", ("/gpu.slice/libpod-{A}.scope", "podman", True)),
        # The cgroupfs driver's folders: its own, but no unit.
        (f"/docker/{A}", ("/docker/{A}", None, False)),
        (f"/libpod_parent/libpod-{A}", ("/libpod_parent/libpod-{A}", "podman", False)),
        (f"/libpod_parent/libpod-{A}/container", ("/libpod_parent/libpod-{A}", "podman", False)),
        (f"/kubepods/burstable/pod1234/{A}", ("/kubepods/burstable/pod1234/{A}", None, False)),
        (f"/kubepods/besteffort/pod9/crio-{A}", ("/kubepods/besteffort/pod9/crio-{A}", "cri-o", False)),
        # Below a service: its own folder, never the service.
        (f"/system.slice/vllm.service/{A}", ("/system.slice/vllm.service/{A}", None, False)),
        (f"/system.slice/vllm.service/libpod-payload-{A}", ("/system.slice/vllm.service/libpod-payload-{A}", "podman", False)),  # --cgroups=split, Quadlet
        (f"/system.slice/vllm.service/docker-{A}.scope", ("/system.slice/vllm.service/docker-{A}.scope", "docker", False)),
        # Nested: B's own scope below A's; A's is the unit only for A.
        (f"/machine.slice/libpod-{B}.scope/libpod-{A}.scope", ("/machine.slice/libpod-{B}.scope/libpod-{A}.scope", "podman", False)),
        # A user's tree: the account names what it likes there; no unit of gpugate's.
        (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{A}.scope", ("/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{A}.scope", "podman", False)),
    ],
)  # fmt: skip
def test_a_cgroup_of_its_own(cgroup: str, own: tuple[str, str | None, bool]) -> None:
    path, runtime, is_unit = own
    path = path.replace("{A}", A).replace("{B}", B)
    found = own_cgroup(cgroup, A)
    assert found == OwnCgroup(path, runtime, path.rpartition("/")[2] if is_unit else None)


@pytest.mark.parametrize(
    "cgroup",
    [
        None,
        "",
        "/",
        "/system.slice/vllm.service",  # --cgroups=disabled from a unit: the unit's own cgroup
        "/system.slice/vllm.service/payload",
        "/machine.slice",
        f"/machine.slice/libpod-{B}.scope",  # a runtime's scope, another id
        f"/machine.slice/libpod-{B}.scope/container",
        f"/machine.slice/libpod-{A[:12]}.scope",  # a short id
        f"/machine.slice/libpod-{A.upper()}.scope",
        f"/machine.slice/libpod-{A}x.scope",
        f"/machine.slice/libpod-{A}.scope.bak",
        f"/machine.slice/libpod-{A}.service",
        f"/machine.slice/crio-conmon-{A}.scope",  # CRI-O's monitor, not the container
        f"/machine.slice/runc-{A}.scope",
        f"/machine.slice/libpod-{A}.scope/../../system.slice/vllm.service",
        f"/system.slice/vllm.service/./libpod-{A}.scope",
        f"/system.slice/vllm.service/{A}\n",
    ],
)
def test_no_cgroup_of_its_own(cgroup: str | None) -> None:
    assert own_cgroup(cgroup, A) is None


@dataclass
class Info:
    cgroup: str | None


class Procs:
    def __init__(self, cgroups: dict[int, str]) -> None:
        self.cgroups = cgroups

    def info(self, pid: int) -> Info | None:
        return Info(self.cgroups[pid]) if pid in self.cgroups else None


def spec_with(cgroups_path: str | None, *, minor: int = 1, annotations: object = None) -> bytes:
    body: dict[str, object] = {
        "linux": {
            "devices": [{"path": f"/dev/nvidia{minor}", "type": "c", "major": 195, "minor": minor}]
        },
        "annotations": annotations or {},
    }
    if cgroups_path is not None:
        body["linux"]["cgroupsPath"] = cgroups_path  # type: ignore[index]
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("kernel", "spec_path", "unit", "cgroup"),
    [
        (f"/machine.slice/libpod-{A}.scope/container", None, f"libpod-{A}.scope", f"/machine.slice/libpod-{A}.scope"),
        (None, f"machine.slice:libpod:{A}", f"libpod-{A}.scope", f"/machine.slice/libpod-{A}.scope"),
        (None, f"system.slice:docker:{A}", f"docker-{A}.scope", f"/system.slice/docker-{A}.scope"),
        (None, f"/docker/{A}", f"container-{A}", f"/docker/{A}"),
        (f"/system.slice/vllm.service/libpod-payload-{A}", None, f"container-{A}", f"/system.slice/vllm.service/libpod-payload-{A}"),
        (f"/system.slice/vllm.service/{A}", f"machine.slice:libpod:{A}", f"container-{A}", f"/system.slice/vllm.service/{A}"),
    ],
)  # fmt: skip
def test_identity_from_the_kernel_first_then_the_spec(
    kernel: str | None, spec_path: str | None, unit: str, cgroup: str
) -> None:
    procs = Procs({42: kernel} if kernel else {})
    state = ContainerState(A, 42 if kernel else 0, "/nonexistent")
    identity = identify(state, parse_config(spec_with(spec_path)), procs)  # type: ignore[arg-type]
    assert (identity.unit, identity.cgroup) == (unit, cgroup)


@pytest.mark.parametrize(
    ("kernel", "spec_path"),
    [
        ("/system.slice/vllm.service", f"machine.slice:libpod:{A}"),  # the kernel decides
        (None, "/system.slice/vllm.service"),
        (None, f"machine.slice:libpod:{B}"),
        (None, None),
        (f"/machine.slice/libpod-{B}.scope", None),
    ],
)
def test_identity_refused_without_a_cgroup_of_its_own(
    kernel: str | None, spec_path: str | None
) -> None:
    procs = Procs({42: kernel} if kernel else {})
    state = ContainerState(A, 42 if kernel else 0, "/nonexistent")
    with pytest.raises(BadInput) as caught:
        identify(state, parse_config(spec_with(spec_path)), procs)  # type: ignore[arg-type]
    assert caught.value.code == "oci-no-own-cgroup"
    assert caught.value.exit_code == ExitCode.USAGE


@pytest.mark.message
def test_the_refusal_shows_a_hostile_cgroup_escaped_on_one_line() -> None:
    cgroup = "/system.slice/\x1b[2J\nvllm.service"
    with pytest.raises(BadInput) as caught:
        identify(
            ContainerState(A, 0, "/nonexistent"),
            parse_config(spec_with(cgroup)),
            Procs({}),  # type: ignore[arg-type]
        )
    text = caught.value.message
    assert "\n" not in text and "\x1b" not in text
    assert "\\x1b[2J\\nvllm.service" in text and A[:12] in text


def hook(host: FakeHost, phase: Phase, cgroups_path: str, running: dict[str, str]) -> int:
    def reporter(unit: str, phase: str, *, fields: object = None) -> Reporter:
        return Reporter(
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False, fields=fields
        )  # type: ignore[arg-type]

    return run_container_hook(
        phase,
        ContainerState(A, 0, "/nonexistent/bundle"),
        parse_config(spec_with(cgroups_path)),
        roots=host.roots,
        driver_factory=lambda: host.memory,
        reporter_factory=reporter,  # type: ignore[arg-type]
        loaded=host.config(),
        unit_state=running.get,
        stream=io.StringIO(),
    )


def units_leases(host: FakeHost) -> dict[str, tuple[int, ...]]:
    return {lease.unit: lease.gpus for lease in read_leases(host.root / "locks").leases}


def lease_the_unit(host: FakeHost, gpus: list[int]) -> None:
    owned = [gpu for gpu in host.memory.gpus() if gpu.index in gpus]
    write_lease(host.root / "locks", new_lease(UNIT, owned, share=False))


BELOW_UNIT = [
    f"/system.slice/{UNIT}/{A}",  # docker cgroupfs, --cgroup-parent=/system.slice/vllm.service
    f"/system.slice/{UNIT}/libpod-payload-{A}",  # podman --cgroups=split in the unit (Quadlet)
]


@pytest.mark.parametrize("cgroups_path", BELOW_UNIT)
def test_a_container_below_a_unit_neither_takes_nor_frees_its_lease(
    host: FakeHost, cgroups_path: str
) -> None:
    """Its own lease beside the unit's, which it neither replaces, nor is refused by (the
    container is part of the unit, by the kernel's tree), nor removes at its stop."""
    running = {UNIT: "active"}
    lease_the_unit(host, [1])
    assert hook(host, Phase.PRE, cgroups_path, running) == ExitCode.OK
    assert units_leases(host) == {UNIT: (1,), f"container-{A}": (1,)}
    assert hook(host, Phase.POST, cgroups_path, running) == ExitCode.OK
    assert units_leases(host) == {UNIT: (1,)}
    # The unit stopped: its lease is stale for others, but never the container's to remove.
    running[UNIT] = "inactive"
    assert hook(host, Phase.PRE, cgroups_path, running) == ExitCode.OK
    assert units_leases(host) == {UNIT: (1,), f"container-{A}": (1,)}


@pytest.mark.parametrize("cgroups_path", BELOW_UNIT)
def test_a_container_below_a_unit_is_refused_by_another_units_lease(
    host: FakeHost, cgroups_path: str
) -> None:
    running = {UNIT: "active", "other.service": "active"}
    owned = [gpu for gpu in host.memory.gpus() if gpu.index == 1]
    write_lease(host.root / "locks", new_lease("other.service", owned, share=False))
    assert hook(host, Phase.PRE, cgroups_path, running) == ExitCode.HELD_BY_OTHERS
    assert units_leases(host) == {"other.service": (1,)}


def test_a_container_in_the_units_own_cgroup_is_refused_and_its_stop_gives_back_nothing(
    host: FakeHost,
) -> None:
    running = {UNIT: "active"}
    lease_the_unit(host, [3])
    assert hook(host, Phase.PRE, f"/system.slice/{UNIT}", running) == ExitCode.USAGE
    (error,) = host.journal.events("error")
    assert error["GPUGATE_PROBLEM"] == "oci-no-own-cgroup"
    assert error["GPUGATE_OCI_CONTAINER"] == A
    assert hook(host, Phase.POST, f"/system.slice/{UNIT}", running) == ExitCode.OK
    assert units_leases(host) == {UNIT: (3,)}
