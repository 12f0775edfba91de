"""`share_gpus` as co-tenancy (issue 46 items 1, 3 and 5; docs/what-gets-killed.md, "GPUs
shared on purpose") for units, containers and pods through their real hooks' runs, with real
processes on stand-in device files: sharers spared at start and stop, the orphan on a shared
GPU killed, a sharer's post exit 0, a workload that does not share kept off (both ways) with
the setting that would let it share named (never kill_other_units), pods named as pods."""

from __future__ import annotations

import io
import json

import pytest

from gpugate.config.file import LoadedConfig
from gpugate.core.outcome import RunSummary
from gpugate.core.run import RunScope
from gpugate.errors import ExitCode
from gpugate.front.container_hook import run_container_hook
from gpugate.host.oci import ContainerState, parse_config
from gpugate.host.scan import ProcFs
from gpugate.integrations.records import read_leases
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from tests.fakes import FakeHost, alive, run_unit_phase

A, B = "a.service", "b.service"
POD_A, POD_B = "a" * 64, "b" * 64
PODS = "/kubepods.slice/kubepods-besteffort.slice"


# The kernel's word on which cgroup a test's process is in (/proc/PID/cgroup): the processes
# these tests start stay in the test's own cgroup; this says another workload's.
PLACED: dict[int, str] = {}


@pytest.fixture(autouse=True)
def placed(monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    read = ProcFs._read

    def placed_read(self: ProcFs, pid: int, name: str) -> str | None:
        if name == "cgroup" and pid in PLACED:
            return f"0::{PLACED[pid]}\n"
        return read(self, pid, name)

    PLACED.clear()
    monkeypatch.setattr(ProcFs, "_read", placed_read)
    return PLACED


def scope(pod: str) -> str:
    return f"cri-containerd-{pod}.scope"


def annotations(pod: str, name: str) -> dict[str, str]:
    return {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": "f" * 64,
        "io.kubernetes.cri.sandbox-namespace": "ml",
        "io.kubernetes.cri.sandbox-name": name,
        "io.kubernetes.cri.container-name": "server",
    }


def unit(  # type: ignore[no-untyped-def]
    host: FakeHost,
    phase: str,
    name: str,
    loaded: LoadedConfig,
    running: dict[str, str],
    environ: dict[str, str] | None = None,
):
    reporter = Reporter(name, phase, journal=host.journal, notifier=host.notifier, echo=False)
    return run_unit_phase(
        RunScope(Phase(phase), name, lambda: f"/system.slice/{name}"),
        loaded,
        reporter,
        roots=host.roots,
        driver_factory=lambda: host.memory,
        environ=environ or {},
        unit_state=running.get,
    )


def pod(
    host: FakeHost,
    phase: Phase,
    pod_id: str,
    loaded: LoadedConfig,
    running: dict[str, str],
    name: str = "vllm-0",
    stream: io.StringIO | None = None,
) -> int:
    """stream: where the run's stderr lines go (the runtime's, which the kubelet shows)."""

    def reporter(unit: str, phase: str, *, fields: object = None) -> Reporter:
        return Reporter(
            unit,
            phase,
            journal=host.journal,
            notifier=host.notifier,
            stream=stream,
            echo=stream is not None,
            fields=fields,  # type: ignore[arg-type]
        )

    spec = {
        "process": {"env": []},
        "linux": {
            "cgroupsPath": f"kubepods-besteffort.slice:cri-containerd:{pod_id}",
            "devices": [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}],
        },
        "annotations": annotations(pod_id, name),
    }
    return run_container_hook(
        phase,
        ContainerState(pod_id, 0, "/nonexistent/bundle"),
        parse_config(json.dumps(spec).encode()),
        roots=host.roots,
        driver_factory=lambda: host.memory,
        reporter_factory=reporter,  # type: ignore[arg-type]
        loaded=loaded,
        unit_state=running.get,
        stream=stream or io.StringIO(),
    )


def serving(host: FakeHost, cgroup: str, gpus: set[int], mib: int = 6000) -> int:
    """A workload's server: a real process in its cgroup, NVML listing it with memory."""
    (pid,) = host.pool.holder(host.gpu_files(*gpus))
    host.put_in_unit(pid, cgroup=cgroup)
    PLACED[pid] = cgroup
    host.memory.claim(pid, gpus, mib)
    return pid


def orphan(host: FakeHost, gpus: set[int], mib: int = 2000) -> int:
    (pid,) = host.pool.holder(host.gpu_files(*gpus))
    host.memory.claim(pid, gpus, mib)
    return pid


def leases(host: FakeHost) -> list[str]:
    return sorted(lease.unit for lease in read_leases(host.root / "locks").leases)


def messages(host: FakeHost, event: str, unit: str) -> list[str]:
    return [e["MESSAGE"] for e in host.journal.events(event) if e["GPUGATE_UNIT"] == unit]


def refusals(host: FakeHost, unit: str) -> list[tuple[str, str, str]]:
    """The run's refusals as (GPUGATE_REASON, GPUGATE_PID, GPUGATE_GPU): a holder it will not
    kill (`other-unit`, its PID) or a lease it will not run beside (`leased`, no PID)."""
    return [
        (e["GPUGATE_REASON"], e.get("GPUGATE_PID", ""), e["GPUGATE_GPU"])
        for e in host.journal.events("refused")
        if e["GPUGATE_UNIT"] == unit
    ]


# --- units --------------------------------------------------------------------------------


def test_two_sharing_units_restart_independently_and_the_orphan_between_them_dies(
    host: FakeHost,
) -> None:
    running = {A: "active", B: "active"}
    shared = host.config(gpus=[1], share_gpus=True)
    assert unit(host, "pre", A, shared, running).exit_code is ExitCode.OK
    server_a = serving(host, f"/system.slice/{A}", {1})
    stale = orphan(host, {1})

    start_b = unit(host, "pre", B, shared, running)
    assert start_b.exit_code is ExitCode.OK
    assert alive(server_a), "a sharer is never killed"
    assert not alive(stale), "the orphan on the shared GPU is freed"
    assert leases(host) == [A, B]
    spared = [e for e in host.journal.events("process_spared") if e["GPUGATE_UNIT"] == B]
    assert any(
        e["GPUGATE_REASON"] == "sharer" and e["GPUGATE_PID"] == str(server_a) for e in spared
    )
    server_b = serving(host, f"/system.slice/{B}", {1})

    # a's restart: its post kills its own server only and exits 0; its pre starts beside b's.
    assert unit(host, "post", A, shared, running).exit_code is ExitCode.OK
    assert not alive(server_a) and alive(server_b)
    assert leases(host) == [B]
    assert unit(host, "pre", A, shared, running).exit_code is ExitCode.OK
    assert alive(server_b) and leases(host) == [A, B]

    # b's stop: exit 0 (it was 22), a's lease and processes untouched.
    running[B] = "deactivating"
    assert unit(host, "post", B, shared, running).exit_code is ExitCode.OK
    assert not alive(server_b)
    assert leases(host) == [A]


def test_a_sharers_memory_is_not_waited_for(host: FakeHost) -> None:
    running = {A: "active", B: "active"}
    shared = host.config(gpus=[1], share_gpus=True, pre={"wait_timeout_s": 60.0})
    unit(host, "pre", A, shared, running)
    server_a = serving(host, f"/system.slice/{A}", {1}, mib=30000)
    summary = unit(host, "pre", B, shared, running)
    assert summary.exit_code is ExitCode.OK and not summary.busy
    assert alive(server_a)


def kept_off(host: FakeHost, *, first: bool, second: bool) -> tuple[RunSummary, int]:
    """a starts (sharing or not), an orphan takes GPU 1, then b starts on it."""
    running = {A: "active", B: "active"}
    unit(host, "pre", A, host.config(gpus=[1], share_gpus=first), running)
    stale = orphan(host, {1})
    return unit(host, "pre", B, host.config(gpus=[1], share_gpus=second), running), stale


@pytest.mark.parametrize(("first", "second"), [(True, False), (False, True)])
def test_a_workload_that_does_not_share_is_kept_off_both_ways(
    host: FakeHost, *, first: bool, second: bool
) -> None:
    summary, stale = kept_off(host, first=first, second=second)
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS
    assert alive(stale), "a refused start kills nothing"
    assert ("leased", "", "1") in refusals(host, B)
    assert leases(host) == [A]


@pytest.mark.message
@pytest.mark.parametrize(("first", "second"), [(True, False), (False, True)])
def test_the_lease_refusal_names_the_setting_that_would_let_it_share(
    host: FakeHost, *, first: bool, second: bool
) -> None:
    """The operator's hint: whose share_gpus would let b in, never kill_other_units."""
    kept_off(host, first=first, second=second)
    (refused,) = [m for m in messages(host, "refused", B) if "leased" in m]
    assert "kill_other_units" not in refused
    if first:  # a shares, b does not: b's own setting is what would let it in
        assert "set share_gpus = true in test.toml" in refused
    else:  # b shares, a does not: a's
        assert "does not share them" in refused and "its gpugate config" in refused


@pytest.mark.message
def test_another_units_process_on_an_unshared_gpu_refuses_with_the_share_hint(
    host: FakeHost,
) -> None:
    running = {A: "active", B: "active"}
    server_a = serving(host, f"/system.slice/{A}", {1})  # a, not gated: no lease
    summary = unit(host, "pre", B, host.config(gpus=[1]), running)
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS and alive(server_a)
    assert refusals(host, B) == [("other-unit", str(server_a), "1")]
    (refused,) = messages(host, "refused", B)
    # the one pin of a held refusal's words: whose process it is, and the setting to share
    assert "active unit a.service holds GPU 1" in refused
    assert "share_gpus = true" in refused and "kill_other_units" not in refused


def test_a_workload_straddling_a_shared_gpu_and_one_the_run_does_not_own(host: FakeHost) -> None:
    running = {A: "active", B: "active"}
    server_a = serving(host, f"/system.slice/{A}", {1, 5})
    straddler = orphan(host, {1, 6})
    shared = host.config(gpus=[1], share_gpus=True)
    summary = unit(host, "pre", B, shared, running)
    # a's server is a sharer wherever else it runs; the orphan reaching GPU 6 is not b's to kill.
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS
    assert alive(server_a) and alive(straddler)
    held = {(h.pid, h.rule) for h in summary.held}
    assert held == {(straddler, "straddles")}


@pytest.mark.parametrize("share", [True, False])
def test_a_gpugate_run_beside_a_sharing_unit(host: FakeHost, *, share: bool) -> None:
    """A `gpugate run` unit's hooks (GPUGATE_STARTED_BY in its environment, --share-gpus in
    its config): beside a sharing unit with --share-gpus; without, refused naming the option."""
    run_unit = "gpugate-run-vllm-3f9a1c.service"
    running = {A: "active", run_unit: "activating"}
    environ = {"GPUGATE_STARTED_BY": "alice (uid 1000)", "INVOCATION_ID": "1"}
    unit(host, "pre", A, host.config(gpus=[1], share_gpus=True), running)
    server_a = serving(host, f"/system.slice/{A}", {1})
    summary = unit(host, "pre", run_unit, host.config(gpus=[1], share_gpus=share), running, environ)
    assert alive(server_a)
    if share:
        assert summary.exit_code is ExitCode.OK
        running[run_unit] = "deactivating"
        post = unit(
            host, "post", run_unit, host.config(gpus=[1], share_gpus=True), running, environ
        )
        assert post.exit_code is ExitCode.OK and alive(server_a)
        return
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS
    assert ("leased", "", "1") in refusals(host, run_unit)


# --- containers and pods ---------------------------------------------------------------------


def test_two_time_sliced_pods_start_and_stop_side_by_side(host: FakeHost) -> None:
    running = {scope(POD_A): "active", scope(POD_B): "active"}
    sliced = host.config(share_gpus=True)  # containers.toml: the device plugin's time-slicing
    stale = orphan(host, {1})
    assert pod(host, Phase.PRE, POD_A, sliced, running) == ExitCode.OK
    assert not alive(stale)
    server_a = serving(host, f"{PODS}/{scope(POD_A)}", {1})

    assert pod(host, Phase.PRE, POD_B, sliced, running, name="vllm-1") == ExitCode.OK
    assert alive(server_a)
    server_b = serving(host, f"{PODS}/{scope(POD_B)}", {1})
    assert leases(host) == sorted([scope(POD_A), scope(POD_B)])

    # a's container restarts (kubelet: delete, then create): b untouched both times.
    assert pod(host, Phase.POST, POD_A, sliced, running) == ExitCode.OK
    assert not alive(server_a) and alive(server_b)
    late = orphan(host, {1})
    assert pod(host, Phase.PRE, POD_A, sliced, running) == ExitCode.OK
    assert alive(server_b) and not alive(late)
    assert pod(host, Phase.POST, POD_B, sliced, running, name="vllm-1") == ExitCode.OK
    assert leases(host) == [scope(POD_A)]


@pytest.mark.message
def test_a_pod_that_does_not_share_is_refused_naming_the_pod_not_its_scope(
    host: FakeHost,
) -> None:
    running = {scope(POD_A): "active", scope(POD_B): "active"}
    assert pod(host, Phase.PRE, POD_A, host.config(), running) == ExitCode.OK
    server_a = serving(host, f"{PODS}/{scope(POD_A)}", {1})
    assert pod(host, Phase.PRE, POD_B, host.config(), running, name="vllm-1") == 22
    assert alive(server_a)
    assert refusals(host, scope(POD_B)) == [
        ("other-unit", str(server_a), "1"),
        ("leased", "", "1"),
    ]
    pods = {e["GPUGATE_OCI_POD"] for e in host.journal.events("refused")}
    assert pods == {"vllm-1"}  # the refused run is named as its pod
    held, leased = messages(host, "refused", scope(POD_B))
    assert f"containerd container ml/vllm-0/server ({POD_A[:12]}) holds GPU 1" in held
    assert f"leased to containerd container ml/vllm-0/server ({POD_A[:12]})" in leased
    for refused in (held, leased):
        assert "kill_other_units" not in refused and "share_gpus = true" in refused
        assert "cri-containerd-" not in refused.split("(scope")[0]


@pytest.mark.message
def test_a_refused_pod_s_stderr_lines_name_the_pod_not_its_scope(host: FakeHost) -> None:
    running = {scope(POD_A): "active", scope(POD_B): "active"}
    assert pod(host, Phase.PRE, POD_A, host.config(), running) == ExitCode.OK
    serving(host, f"{PODS}/{scope(POD_A)}", {1})
    stderr = io.StringIO()
    assert pod(host, Phase.PRE, POD_B, host.config(), running, "vllm-1", stderr) == 22
    said = stderr.getvalue().splitlines()
    named = f"gpugate pre containerd container ml/vllm-1/server ({POD_B[:12]}): "
    echoed = [line for line in said if line.startswith("gpugate pre ")]
    assert echoed and all(line.startswith(named) for line in echoed)
    assert not any(line.startswith(f"gpugate pre {scope(POD_B)}") for line in said)


def test_a_unit_and_a_time_sliced_pod_share_when_both_say_so(host: FakeHost) -> None:
    running = {scope(POD_A): "active", A: "active"}
    assert pod(host, Phase.PRE, POD_A, host.config(share_gpus=True), running) == ExitCode.OK
    server_a = serving(host, f"{PODS}/{scope(POD_A)}", {1})
    summary = unit(host, "pre", A, host.config(gpus=[1], share_gpus=True), running)
    assert summary.exit_code is ExitCode.OK and alive(server_a)
    server = serving(host, f"/system.slice/{A}", {1})
    # the pod's restart beside the unit, and the unit's stop beside the pod
    assert pod(host, Phase.POST, POD_A, host.config(share_gpus=True), running) == ExitCode.OK
    assert alive(server) and not alive(server_a)
    assert pod(host, Phase.PRE, POD_A, host.config(share_gpus=True), running) == ExitCode.OK
    assert unit(host, "post", A, host.config(gpus=[1], share_gpus=True), running).exit_code == 0
    assert leases(host) == [scope(POD_A)]


def test_a_unit_that_does_not_share_is_refused_by_a_time_sliced_pods_lease(
    host: FakeHost,
) -> None:
    running = {scope(POD_A): "active", A: "active"}
    assert pod(host, Phase.PRE, POD_A, host.config(share_gpus=True), running) == ExitCode.OK
    summary: RunSummary = unit(host, "pre", A, host.config(gpus=[1]), running)
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS
    assert ("leased", "", "1") in refusals(host, A)
    assert leases(host) == [scope(POD_A)]
