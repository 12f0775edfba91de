"""CUDA MPS (docs/mps.md): the control daemon and server protected by default, an MPS server
told by its protected executable, the GPUs it holds shared on purpose for every run (rule (c)
of docs/what-gets-killed.md), NVML's MPS client list merged into a GPU's processes; a client
unit starts beside the server and other units' clients, and a stale client is freed."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pynvml

from gpugate.config.schema import DEFAULTS, GateConfig
from gpugate.config.values import MPS_CONTROL, MPS_SERVER
from gpugate.core.decide import Rule, Verdict, decide
from gpugate.core.discover import Holder, Source
from gpugate.core.roles import (
    Owner,
    Role,
    config_shares,
    is_mps_server,
    mps_served,
    owner_of,
    role_of,
)
from gpugate.errors import ExitCode
from gpugate.host.nvml import MIB, NOT_AVAILABLE, GpuProcess, NvmlDriver, _merged
from gpugate.phase import Phase
from tests.fakes import HOLDER_SCRIPT, FakeHost, alive
from tests.unit.test_decide import Table, discovery, proc

OTHER = "/system.slice/other-client.service"
SERVICE = "/system.slice/nvidia-mps.service"
LOGIN = "/user.slice/user-1000.slice/session-4.scope"


def test_the_mps_daemon_and_server_are_protected_by_default() -> None:
    table = Table(
        {10: proc(10, 1, SERVICE, exe=MPS_SERVER), 11: proc(11, 1, SERVICE, exe=MPS_CONTROL)}
    )
    found = discovery(table, {}, [0])
    for config in (DEFAULTS, GateConfig()):
        assert {MPS_CONTROL, MPS_SERVER} <= set(config.protected_executables)
        assert all(p.startswith("/usr/bin/") for p in (MPS_CONTROL, MPS_SERVER))
        for pid in (10, 11):
            assert role_of(table.procs[pid], found, config) is Role.PROTECTED


def test_an_mps_server_is_a_protected_executable_of_the_servers_name() -> None:
    relocated = "/opt/nvidia/bin/nvidia-cuda-mps-server"
    moved = GateConfig(protected_executables=[relocated])
    for exe, config, server in (
        (MPS_SERVER, GateConfig(), True),
        (relocated, moved, True),  # root protected where this host installs it
        (relocated, GateConfig(), False),  # a copy nobody protected
        ("/home/eve/nvidia-cuda-mps-server", GateConfig(), False),
        (MPS_SERVER, moved, False),  # a config that no longer protects the default path
        (MPS_CONTROL, GateConfig(), False),  # the control daemon holds no GPU's contexts
        ("/usr/bin/nvidia-persistenced", GateConfig(), False),
        (None, GateConfig(), False),  # an exe the kernel would not show
    ):
        info = proc(10, 1, SERVICE)._replace(exe=exe)
        assert is_mps_server(info, config) is server, (exe, server)


def holders(table: Table, on: dict[int, set[int]]) -> dict[int, Holder]:
    return {
        pid: Holder(table.procs[pid], {Source.NVML}, set(gpus), used_mib=dict.fromkeys(gpus, 100))
        for pid, gpus in on.items()
    }


def test_the_gpus_an_mps_server_holds_are_shared_among_those_the_run_owns() -> None:
    table = Table({10: proc(10, 1, SERVICE, exe=MPS_SERVER), 20: proc(20, 1, OTHER)})
    for server_on, owned, shared in (
        ({0}, [0], {0}),
        ({0, 1}, [1, 2], {1}),
        ({3}, [0, 1], set()),
        (set(), [0], set()),
    ):
        found = discovery(table, holders(table, {10: server_on, 20: {0}}), owned)
        assert mps_served(found, GateConfig()) == frozenset(shared), (server_on, owned)
    # NVML's list names the GPUs it uses, before the device files CUDA opens for every GPU
    server = Holder(
        table.procs[10], {Source.NVML, Source.DEVICE_FD}, set(range(8)), used_mib={2: 30}
    )
    found = discovery(table, {10: server}, [1, 2])
    assert mps_served(found, GateConfig()) == frozenset({2})
    # no protected server: an unprotected copy shares nothing
    table.procs[10] = proc(10, 1, SERVICE, exe="/tmp/nvidia-cuda-mps-server")
    found = discovery(table, holders(table, {10: {0}}), [0])
    assert mps_served(found, GateConfig()) == frozenset()


def test_on_a_gpu_the_server_holds_clients_of_other_units_are_sharers_and_stale_ones_go() -> None:
    table = Table(
        {
            10: proc(10, 1, SERVICE, exe=MPS_SERVER),
            20: proc(20, 1, OTHER),  # another unit's client
            21: proc(21, 1, "/system.slice/pod.service"),  # a third unit's client
            30: proc(30, 1, LOGIN),  # a stale client: its unit is gone
            40: proc(40, 1, "/system.slice/vllm.service/x"),  # the run's own
        }
    )
    on = {10: {0, 1}, 20: {0}, 21: {0, 1}, 30: {0}, 40: {0}}
    found = discovery(table, holders(table, on), [0, 1])
    for kill_other in (False, True):
        config = GateConfig(kill_other_units=kill_other)
        decision = decide(found, config, Phase.PRE, table, shared=mps_served(found, config))
        chosen = {c.holder.pid: (c.verdict, c.rule) for c in decision.choices}
        assert chosen[10] == (Verdict.SPARE, Rule.PROTECTED)
        assert chosen[20] == chosen[21] == (Verdict.SPARE, Rule.SHARER)
        assert chosen[30] == (Verdict.KILL, Rule.ORPHAN)
        assert chosen[40] == (Verdict.KILL, Rule.CGROUP)
        assert not decision.refused
    # without the server there, the whole-GPU rule: another unit's process refuses
    del table.procs[10]
    found = discovery(table, holders(table, {20: {0}}), [0])
    decision = decide(found, GateConfig(), Phase.PRE, table, shared=mps_served(found, GateConfig()))
    assert decision.refused


def test_an_orphaned_client_is_owned_by_nobody_with_its_mib() -> None:
    left = "/user.slice/user-1000.slice/user@1000.service/app.slice/app-client.scope"
    table = Table({30: proc(30, 1, left), 10: proc(10, 1, SERVICE, exe=MPS_SERVER)})
    found = discovery(table, holders(table, {30: {0}, 10: {0}}), [])._replace(unit="")
    assert owner_of(found.holders[30], found, GateConfig()) is Owner.NOBODY
    assert owner_of(found.holders[10], found, GateConfig()) is Owner.PROTECTED


def entry(pid: int, mib: int | None, instance: int = NOT_AVAILABLE) -> SimpleNamespace:
    return SimpleNamespace(
        pid=pid, usedGpuMemory=None if mib is None else mib * MIB, gpuInstanceId=instance
    )


def test_nvmls_lists_merge_by_pid() -> None:
    lists = [
        ([entry(1, 30), entry(2, 500), entry(3, None)], False),  # compute: server, C+G, M+C
        ([entry(2, 20)], False),  # graphics: the same process's graphics context adds
        ([entry(3, 4000), entry(4, 7000, instance=3), entry(5, None)], True),  # MPS
        ([entry(3, 4000), entry(1, None)], True),  # the same client listed twice
    ]
    assert _merged(lists) == (
        GpuProcess(1, 30, mps_client=True),
        GpuProcess(2, 520),
        GpuProcess(3, 4000, mps_client=True),  # M+C: one context listed twice, not 8000
        GpuProcess(4, 7000, on_slice=True, mps_client=True),
        GpuProcess(5, None, mps_client=True),
    )


def start_server(host: FakeHost, tmp: Path, gpus: tuple[int, ...]) -> int:
    """A process whose /proc/PID/exe is a copy of this Python named nvidia-cuda-mps-server."""
    exe = tmp / "bin" / "nvidia-cuda-mps-server"
    exe.parent.mkdir(exist_ok=True)
    shutil.copy(os.path.realpath(sys.executable), exe)
    ready = tmp / "server-ready"
    paths = ",".join(str(p) for p in host.gpu_files(*gpus))
    child = host.pool.command([str(exe), "-c", HOLDER_SCRIPT, paths, "0", "0", str(ready)])
    host.pool.until((tmp / f"server-ready.{child.pid}").exists, "the server's start")
    return child.pid


def test_a_start_beside_the_server_frees_a_stale_client_and_never_signals_the_server(
    host: FakeHost, tmp_path: Path
) -> None:
    """Another unit's client is a sharer in the decision test above: here every test process
    is in the same (real) cgroup, so the stale client is an orphan beside the server."""
    server = start_server(host, tmp_path, (0,))
    host.memory.claim(server, {0}, 30000)  # more than free_mib: the wait is not for it
    (stale,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(stale, {0}, 9000)
    host.memory.mps_clients.add(stale)
    exe = str(tmp_path / "bin" / "nvidia-cuda-mps-server")
    loaded = host.config(gpus=[0], protected_executables=[exe], pre={"wait_timeout_s": 5.0})

    summary = host.run_phase(
        "pre", loaded, host.reporter("pre"), driver_factory=lambda: host.memory
    )

    assert summary.exit_code is ExitCode.OK
    assert alive(server) and not alive(stale)
    assert {int(e["GPUGATE_PID"]) for e in host.journal.events("signal_sent")} == {stale}
    (found,) = host.journal.events("holder_found")
    assert (found["GPUGATE_PID"], found["GPUGATE_MPS_CLIENT"]) == (str(stale), "0")
    assert found["GPUGATE_USED_MIB"] == "9000"
    (spared,) = host.journal.events("process_spared")
    assert (spared["GPUGATE_PID"], spared["GPUGATE_REASON"]) == (str(server), "protected")


def test_what_a_config_alone_shares_is_share_gpus_and_the_servers_gpus() -> None:
    table = Table({10: proc(10, 1, SERVICE, exe=MPS_SERVER)})
    found = discovery(table, holders(table, {10: {1}}), [0, 1, 2])
    assert config_shares(found, GateConfig()) == frozenset({1})
    assert config_shares(found, GateConfig(share_gpus=True)) == frozenset({0, 1, 2})
    del table.procs[10]
    assert config_shares(discovery(table, {}, [0]), GateConfig()) == frozenset()


def driver_with(**functions: object) -> NvmlDriver:
    """gpugate's NVML driver over pynvml with these functions in place of pynvml's own."""
    driver = NvmlDriver()
    driver._nv = SimpleNamespace(**{**vars(pynvml), **functions})
    return driver


def test_an_older_driver_lists_clients_through_v2_and_one_without_any_lists_none() -> None:
    def missing(_handle: object) -> list[object]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def unsupported(_handle: object) -> list[object]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def listed(_handle: object) -> list[object]:
        return [entry(7, 300)]

    name = "nvmlDeviceGetMPSComputeRunningProcesses"
    for v3, v2, expected in (
        (listed, missing, [7]),
        (missing, listed, [7]),  # a driver older than v3
        (missing, missing, []),  # older than the MPS call: no client
        (unsupported, listed, []),  # the GPU does not support it
    ):
        driver = driver_with(**{f"{name}_v3": v3, f"{name}_v2": v2})
        assert [p.pid for p in driver._mps_clients(0, object())] == expected
