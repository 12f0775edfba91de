"""`gpugate oci-hook` end to end on a stand-in host with real processes: the start gate (a
stale holder killed, another container's lease or a unit's refused), the container's lease
and its journal fields, poststop giving it up, stale container leases, GPUs by device minor;
and the entry's no-GPU path."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.errors import ExitCode, NvmlUnavailable
from gpugate.front.oci_hook import run_container_hook, stage_phase
from gpugate.host.oci import ContainerSpec, ContainerState, parse_config
from gpugate.integrations.unit.leases import read_leases
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from tests.fakes import UNIT, FakeGpuMemory, FakeHost, alive

A_ID, B_ID = "a" * 64, "b" * 64
A_SCOPE, B_SCOPE = f"libpod-{A_ID}.scope", f"libpod-{B_ID}.scope"


def spec(container_id: str, env: list[str], devices: list[str] = ()) -> ContainerSpec:  # type: ignore[assignment]
    body = {
        "hooks": {"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]},
        "process": {"env": env},
        "linux": {
            "cgroupsPath": f"machine.slice:libpod:{container_id}",
            "devices": [{"path": p} for p in devices],
        },
        "annotations": {"io.kubernetes.cri-o.ContainerName": f"c-{container_id[0]}"},
    }
    return parse_config(json.dumps(body).encode())


def state(container_id: str) -> ContainerState:
    return ContainerState(container_id, 0, "/nonexistent/bundle", "creating")


def hook(
    host: FakeHost,
    phase: Phase,
    container_id: str,
    env: list[str],
    running: dict[str, str],
    *,
    devices: list[str] = (),  # type: ignore[assignment]
) -> int:
    def reporter(unit: str, phase: str, *, fields: object = None) -> Reporter:
        return Reporter(
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False, fields=fields
        )  # type: ignore[arg-type]

    return run_container_hook(
        phase,
        state(container_id),
        spec(container_id, env, devices),
        roots=host.roots,
        driver_factory=lambda: host.memory,
        reporter_factory=reporter,  # type: ignore[arg-type]
        loaded=host.config(),
        unit_state=running.get,
        stream=io.StringIO(),
    )


def test_start_kills_the_stale_holder_then_leases_and_refuses_others(host: FakeHost) -> None:
    (stale,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(stale, {1}, 4000)
    running = {A_SCOPE: "active", B_SCOPE: "active", UNIT: "activating"}

    assert hook(host, Phase.PRE, A_ID, ["NVIDIA_VISIBLE_DEVICES=1"], running) == ExitCode.OK
    assert not alive(stale)
    (lease,) = read_leases(host.root / "locks").leases
    assert lease.unit == A_SCOPE and lease.gpus == (1,)
    assert A_ID[:12] in lease.container
    started = host.journal.events("run_started")[0]
    assert started["GPUGATE_OCI_CONTAINER"] == A_ID
    assert started["GPUGATE_OCI_CONTAINER_NAME"] == "c-a"
    assert started["GPUGATE_UNIT"] == A_SCOPE and started["GPUGATE_PHASE"] == "pre"
    assert "NVIDIA_VISIBLE_DEVICES=1" in started["GPUGATE_GPU_SOURCE"]

    # Another container onto GPU 1: refused, naming the first; nothing killed.
    (bystander,) = host.pool.holder(host.gpu_files(5))
    code = hook(host, Phase.PRE, B_ID, ["NVIDIA_VISIBLE_DEVICES=0,1"], running)
    assert code == ExitCode.HELD_BY_OTHERS
    refused = [e for e in host.journal.events("refused") if e["GPUGATE_OCI_CONTAINER"] == B_ID]
    assert refused and refused[0]["GPUGATE_REASON"] == "leased"
    assert alive(bystander)

    # A unit's pre onto GPU 1: refused too.
    summary = host.run_phase(
        "pre",
        host.config(gpus=[1]),
        host.reporter(),
        environ={},
        unit_state=running.get,
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS
    unit_refused = [e for e in host.journal.events("refused") if e["GPUGATE_UNIT"] == UNIT]
    assert unit_refused[-1]["GPUGATE_REASON"] == "leased", unit_refused

    # poststop: the lease goes; then B starts.
    assert hook(host, Phase.POST, A_ID, ["NVIDIA_VISIBLE_DEVICES=1"], running) == ExitCode.OK
    assert not read_leases(host.root / "locks").leases
    assert hook(host, Phase.PRE, B_ID, ["NVIDIA_VISIBLE_DEVICES=0,1"], running) == ExitCode.OK


def test_a_dead_containers_lease_is_stale(host: FakeHost) -> None:
    running = {A_SCOPE: "active"}
    assert hook(host, Phase.PRE, A_ID, ["NVIDIA_VISIBLE_DEVICES=all"], running) == ExitCode.OK
    running[A_SCOPE] = "inactive"  # killed without its poststop: its scope is gone
    running[B_SCOPE] = "active"
    assert hook(host, Phase.PRE, B_ID, ["NVIDIA_VISIBLE_DEVICES=3"], running) == ExitCode.OK
    assert [lease.unit for lease in read_leases(host.root / "locks").leases] == [B_SCOPE]


def test_gpus_by_device_minor_not_index(host: FakeHost) -> None:
    host.memory.minors = [7, 6, 5, 4, 3, 2, 1, 0]
    running = {A_SCOPE: "active"}
    assert hook(host, Phase.PRE, A_ID, [], running, devices=["/dev/nvidia7"]) == ExitCode.OK
    (lease,) = read_leases(host.root / "locks").leases
    assert lease.gpus == (0,)


@pytest.mark.parametrize(
    ("env", "devices", "code"),
    [
        ([], ["/dev/nvidia9"], ExitCode.CONFIG),  # no such GPU
        (["NVIDIA_VISIBLE_DEVICES=12"], [], ExitCode.CONFIG),
        (["NVIDIA_VISIBLE_DEVICES=MIG-1234"], [], ExitCode.USAGE),
        (["NVIDIA_VISIBLE_DEVICES=gpu0"], [], ExitCode.USAGE),
    ],
)
def test_a_gpu_request_nvml_cannot_meet_fails_the_start(
    host: FakeHost, env: list[str], devices: list[str], code: ExitCode
) -> None:
    assert hook(host, Phase.PRE, A_ID, env, {A_SCOPE: "active"}, devices=devices) == code
    assert not read_leases(host.root / "locks").leases


def run_entry(stage: str, stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    code = "import sys; sys.argv[1:] = sys.argv[2:]; from gpugate.front.entry import run; run()"
    return subprocess.run(
        [sys.executable, "-c", code, "-", "oci-hook", stage],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )


def test_entry_leaves_a_container_without_gpus_alone(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o700)
    (bundle / "config.json").write_text(json.dumps({"process": {"env": ["A=1"]}}))
    raw = json.dumps({"id": A_ID, "pid": 0, "bundle": str(bundle)}).encode()
    for stage in ("createRuntime", "prestart", "poststop", "startContainer"):
        done = run_entry(stage, raw)
        assert (done.returncode, done.stderr) == (0, b""), stage


def test_entry_refuses_bad_input_with_one_line() -> None:
    done = run_entry("createRuntime", b"{not json")
    assert done.returncode == ExitCode.USAGE
    assert done.stderr.decode().count("\n") == 1
    assert done.stderr.startswith(b"gpugate: oci-hook createRuntime: ")
    assert run_entry("bogus", b"{}").returncode == ExitCode.USAGE


@pytest.mark.skipif(
    os.geteuid() != 0, reason="as another user the hook leaves every container alone"
)
def test_entry_at_poststop_with_the_bundle_gone_is_quiet() -> None:
    raw = json.dumps({"id": A_ID, "pid": 0, "bundle": "/nonexistent/gone"}).encode()
    assert run_entry("poststop", raw).returncode == 0
    assert run_entry("createRuntime", raw).returncode == ExitCode.USAGE


@pytest.mark.parametrize(
    ("stage", "phase"),
    [
        ("createRuntime", Phase.PRE),
        ("prestart", Phase.PRE),
        ("poststop", Phase.POST),
        ("createContainer", None),
        ("startContainer", None),
        ("poststart", None),
    ],
)
def test_stages_and_what_gpugate_does_at_each(stage: str, phase: Phase | None) -> None:
    assert stage_phase(stage) is phase


def test_entry_as_another_user_leaves_every_container_alone() -> None:
    """A rootless podman reads the same hooks.d: its containers are not gpugate's."""
    raw = json.dumps({"id": A_ID, "pid": 0, "bundle": "/nonexistent/gone"}).encode()
    code = (
        "import os, sys; os.geteuid = lambda: 1000; sys.argv[1:] = sys.argv[2:]; "
        "from gpugate.front.entry import run; run()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "-", "oci-hook", "createRuntime"],
        input=raw,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, b"")


def test_nvml_unusable_fails_the_start_with_one_error_entry(host: FakeHost) -> None:
    def no_nvml() -> FakeGpuMemory:
        raise NvmlUnavailable("NVML: libnvidia-ml.so.1 not found")

    code = run_container_hook(
        Phase.PRE,
        state(A_ID),
        spec(A_ID, ["NVIDIA_VISIBLE_DEVICES=1"]),
        roots=host.roots,
        driver_factory=no_nvml,
        reporter_factory=lambda unit, phase, *, fields=None: Reporter(
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False, fields=fields
        ),
        loaded=host.config(),
        stream=io.StringIO(),
    )
    assert code == ExitCode.NVML_UNAVAILABLE
    (error,) = host.journal.events("error")
    assert error["GPUGATE_OCI_CONTAINER"] == A_ID
    assert not read_leases(host.root / "locks").leases
