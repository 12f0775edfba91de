"""`gpugate oci-hook` end to end on a stand-in host with real processes: the start gate (a
stale holder killed, another container's lease or a unit's refused), the container's lease
and its journal fields, poststop giving it up, stale container leases, GPUs by device minor;
and the entry's no-GPU path."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.errors import BadInput, ExitCode, NvmlUnavailable
from gpugate.front.container_hook import STAGE_PHASES, run_container_hook
from gpugate.host.nvml import mig_key
from gpugate.host.oci import ContainerSpec, ContainerState, parse_config
from gpugate.integrations.records import read_leases
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from tests.fakes import UNIT, FakeGpuMemory, FakeHost, alive

A_ID, B_ID = "a" * 64, "b" * 64
A_SCOPE, B_SCOPE = f"libpod-{A_ID}.scope", f"libpod-{B_ID}.scope"


def spec(container_id: str, env: list[str], devices: list[int] = ()) -> ContainerSpec:  # type: ignore[assignment]
    body = {
        "hooks": {"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]},
        "process": {"env": env},
        "linux": {
            "cgroupsPath": f"machine.slice:libpod:{container_id}",
            # Device numbers (195:minor), under a path of the container's choosing.
            "devices": [
                {"path": f"/dev/x{m}", "type": "c", "major": 195, "minor": m} for m in devices
            ],
        },
        "annotations": {"io.kubernetes.cri-o.ContainerName": f"c-{container_id[0]}"},
    }
    return parse_config(json.dumps(body).encode())


def state(container_id: str) -> ContainerState:
    return ContainerState(container_id, 0, "/nonexistent/bundle")


def hook(
    host: FakeHost,
    phase: Phase,
    container_id: str,
    env: list[str],
    running: dict[str, str],
    *,
    devices: list[int] = (),  # type: ignore[assignment]
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
    # CRI-O's name annotation on podman's container: its author's word, marked as such.
    assert A_ID[:12] in lease.container and '"c-a"' in lease.container
    started = host.journal.events("run_started")[0]
    assert started["GPUGATE_OCI_CONTAINER"] == A_ID
    assert started["GPUGATE_OCI_ANNOTATED_NAME"] == "c-a"
    assert "GPUGATE_OCI_CONTAINER_NAME" not in started
    assert started["GPUGATE_UNIT"] == A_SCOPE and started["GPUGATE_PHASE"] == "pre"
    assert started["GPUGATE_GPU_SOURCE"].endswith("1; from NVIDIA_VISIBLE_DEVICES)")

    # Another container onto GPU 1: refused, naming the first; nothing killed.
    (bystander,) = host.pool.holder(host.gpu_files(5))
    code = hook(host, Phase.PRE, B_ID, ["NVIDIA_VISIBLE_DEVICES=0,1"], running)
    assert code == ExitCode.HELD_BY_OTHERS
    refused = [e for e in host.journal.events("refused") if e["GPUGATE_OCI_CONTAINER"] == B_ID]
    assert refused and refused[0]["GPUGATE_REASON"] == "leased"
    assert refused[0]["GPUGATE_LEASE_UNIT"] == A_SCOPE
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
    assert unit_refused[-1]["GPUGATE_LEASE_UNIT"] == A_SCOPE

    # poststop: the lease goes; then B starts.
    assert hook(host, Phase.POST, A_ID, ["NVIDIA_VISIBLE_DEVICES=1"], running) == ExitCode.OK
    assert not read_leases(host.root / "locks").leases
    assert hook(host, Phase.PRE, B_ID, ["NVIDIA_VISIBLE_DEVICES=0,1"], running) == ExitCode.OK


def unresolvable(container_id: str) -> ContainerSpec:
    """What parse_config(lenient=True) gives after the stop for a request that no longer
    resolves (NVIDIA's config changed meanwhile)."""
    text = json.dumps(
        {
            "hooks": {"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]},
            "process": {"env": ["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"]},
            "linux": {"cgroupsPath": f"machine.slice:libpod:{container_id}"},
        }
    )
    with pytest.raises(BadInput):
        parse_config(text.encode())
    got = parse_config(text.encode(), lenient=True)
    assert got.gpus and got.gpus.unresolved is not None
    return got


def test_after_the_stop_the_lease_says_which_gpus(host: FakeHost) -> None:
    running = {A_SCOPE: "active"}
    assert hook(host, Phase.PRE, A_ID, ["NVIDIA_VISIBLE_DEVICES=1"], running) == ExitCode.OK
    (lease,) = read_leases(host.root / "locks").leases
    assert lease.gpus == (1,)
    code = run_container_hook(
        Phase.POST,
        state(A_ID),
        unresolvable(A_ID),
        roots=host.roots,
        driver_factory=lambda: host.memory,
        reporter_factory=lambda unit, phase, fields=None: Reporter(  # type: ignore[arg-type]
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False, fields=fields
        ),
        loaded=host.config(),
        unit_state=running.get,
        stream=io.StringIO(),
    )
    assert code == ExitCode.OK
    assert not read_leases(host.root / "locks").leases
    # Without a lease to answer, it is refused as at the start.
    code = run_container_hook(
        Phase.POST,
        state(B_ID),
        unresolvable(B_ID),
        roots=host.roots,
        driver_factory=lambda: host.memory,
        reporter_factory=lambda unit, phase, fields=None: Reporter(  # type: ignore[arg-type]
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False, fields=fields
        ),
        loaded=host.config(),
        unit_state=running.get,
        stream=io.StringIO(),
    )
    assert code == ExitCode.USAGE


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
    assert hook(host, Phase.PRE, A_ID, [], running, devices=[7]) == ExitCode.OK
    (lease,) = read_leases(host.root / "locks").leases
    assert lease.gpus == (0,)


@pytest.mark.parametrize(
    ("env", "devices"),
    [
        ([], [9]),  # 195:9: no GPU NVML knows
        (["NVIDIA_VISIBLE_DEVICES=12"], []),
        (["NVIDIA_VISIBLE_DEVICES=GPU-ffffffff-0000"], []),
    ],
)
def test_a_gpu_request_nvml_cannot_meet_fails_the_start(
    host: FakeHost, env: list[str], devices: list[int]
) -> None:
    code = hook(host, Phase.PRE, A_ID, env, {A_SCOPE: "active"}, devices=devices)
    assert code == ExitCode.USAGE
    assert not read_leases(host.root / "locks").leases


def test_a_slice_named_by_its_gpu_mig_index_pair_is_gated_alone(host: FakeHost) -> None:
    # GPU 0 in MIG mode, its MIG devices at NVML's indexes 0 and 1; the container is given the
    # second, with its GPU's /dev/nvidia0 as CDI gives every slice's container.
    host.memory.mig = {0: [(1, 0, 20000), (2, 0, 20000)]}
    (on_first,) = host.pool.holder(host.gpu_files(0))
    (on_second,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(on_first, {mig_key(0, 0)}, 9000)
    host.memory.claim(on_second, {mig_key(0, 1)}, 7000)
    env = ["NVIDIA_VISIBLE_DEVICES=0:1"]
    assert hook(host, Phase.PRE, A_ID, env, {A_SCOPE: "active"}, devices=[0]) == ExitCode.OK
    assert not alive(on_second)
    assert alive(on_first)  # the other slice's: GPU 0 itself is not the container's
    (lease,) = read_leases(host.root / "locks").leases
    assert lease.gpus == (mig_key(0, 1),)


@pytest.mark.parametrize("ref", ["0:2", "1:0", "9:0"])
def test_a_pair_nvml_does_not_know_fails_the_start(host: FakeHost, ref: str) -> None:
    host.memory.mig = {0: [(1, 0, 20000), (2, 0, 20000)]}
    (holder,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(holder, {mig_key(0, 0)}, 9000)
    code = hook(host, Phase.PRE, A_ID, [f"NVIDIA_VISIBLE_DEVICES={ref}"], {A_SCOPE: "active"})
    assert code == ExitCode.USAGE
    assert alive(holder)
    assert not read_leases(host.root / "locks").leases


@pytest.mark.parametrize(
    "ref",
    [
        "MIG-zzzzzzzz-not-a-uuid",  # malformed: the container's bad input, not gpugate's config
        "MIG-12345678-1234-1234-1234-123456789abc",  # well formed, no such slice
        "MIG-GPU-99999999-0000-0000-0000-000000000000/1/0",  # no such GPU
    ],
)
@pytest.mark.message
def test_a_mig_reference_nvml_cannot_resolve_is_the_containers_bad_input(
    host: FakeHost, ref: str
) -> None:
    """issue 47: exit 64 naming the container's variable, never 78 naming a config's gpus."""
    host.memory.mig = {0: [(1, 0, 20000), (2, 0, 20000)]}
    (holder,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(holder, {mig_key(0, 0)}, 9000)
    code = hook(host, Phase.PRE, A_ID, [f"NVIDIA_VISIBLE_DEVICES={ref}"], {A_SCOPE: "active"})
    assert code == ExitCode.USAGE
    (error,) = host.journal.events("error")
    assert error["GPUGATE_EXIT_CODE"] == str(int(ExitCode.USAGE))
    assert error["MESSAGE"].startswith("config.json: 'NVIDIA_VISIBLE_DEVICES': "), error
    assert ": gpus:" not in error["MESSAGE"] and "built-in" not in error["MESSAGE"]
    assert alive(holder)
    assert not read_leases(host.root / "locks").leases


@pytest.mark.parametrize("value", ["MIG-1234", "gpu0", "0:1:0", "ALL"])
def test_a_gpu_request_gpugate_cannot_read_is_refused_before_nvml(value: str) -> None:
    with pytest.raises(BadInput) as caught:
        spec(A_ID, [f"NVIDIA_VISIBLE_DEVICES={value}"])
    assert caught.value.exit_code == ExitCode.USAGE


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


@pytest.mark.parametrize(
    "spec_body",
    [
        # Only nvidiactl, nvidia-uvm and a GPU's name on /dev/null's numbers: no GPU.
        {
            "linux": {
                "devices": [
                    {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
                    {"path": "/dev/nvidia-uvm", "type": "c", "major": 508, "minor": 0},
                    {"path": "/dev/nvidia0", "type": "c", "major": 1, "minor": 3},
                ]
            }
        },
        # The image's NVIDIA_VISIBLE_DEVICES=all without NVIDIA's hook.
        {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all", "CUDA_VERSION=12.2"]}},
    ],
)
@pytest.mark.root("as another user the hook leaves every one alone")
def test_entry_leaves_a_container_that_reaches_no_gpu_alone(
    tmp_path: Path, spec_body: dict[str, object]
) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o700)
    (bundle / "config.json").write_text(json.dumps(spec_body))
    raw = json.dumps({"id": A_ID, "pid": 0, "bundle": str(bundle)}).encode()
    done = run_entry("createRuntime", raw)
    assert (done.returncode, done.stderr) == (0, b"")


@pytest.mark.message
@pytest.mark.root("as another user the hook leaves it alone")
def test_entry_refuses_a_gpu_request_it_cannot_resolve_with_one_line(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o700)
    body = {"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=MIG-1"}}
    (bundle / "config.json").write_text(json.dumps(body))
    raw = json.dumps({"id": A_ID, "pid": 0, "bundle": str(bundle)}).encode()
    done = run_entry("createRuntime", raw)
    assert done.returncode == ExitCode.USAGE
    assert done.stderr.decode().count("\n") == 1
    assert done.stderr.startswith(b"gpugate: oci-hook createRuntime: config.json: ")


@pytest.mark.root("as another user the hook leaves every container alone")
def test_entry_refuses_bad_input_with_one_line() -> None:
    done = run_entry("createRuntime", b"{not json")
    assert done.returncode == ExitCode.USAGE
    assert done.stderr.decode().count("\n") == 1
    assert done.stderr.startswith(b"gpugate: oci-hook createRuntime: ")
    assert run_entry("bogus", b"{}").returncode == ExitCode.USAGE


@pytest.mark.root("as another user the hook leaves every container alone")
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
    assert STAGE_PHASES.get(stage) is phase


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
