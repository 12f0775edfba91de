"""MIG slices as a unit's GPUs: the GPU-list parser, which slice a reference names, whose
holders a slice has (NVML's per-slice lists and the unit's cgroup, never the GPU's device
files alone) and the wait on the slice's own memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpugate.config.file import parse_config
from gpugate.config.values import gpu_ref, legacy_mig, parse_gpu_text
from gpugate.core.discover import as_refs, owned_gpus
from gpugate.core.run import RunScope
from gpugate.errors import BadInput, ConfigError, ExitCode, InvalidValue
from gpugate.front.commands.run import resolve_gpus
from gpugate.front.commands.slurm import job_from_env
from gpugate.host import nvml
from gpugate.host.nvml import mig_key
from gpugate.host.oci import GpuRequest
from gpugate.integrations.container import gpu_selection
from gpugate.integrations.records import read_leases
from gpugate.integrations.unit import parse_visible_devices
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from tests.fakes import FakeGpuMemory, FakeHost, alive, mig_uuid, run_unit_phase

GPU0 = "GPU-fa4e5a11-0000-0000-0000-000000000000"
SLICES = [(1, 0, 20000), (2, 0, 20000), (5, 0, 40000)]


@pytest.mark.parametrize(
    "text",
    [
        "MIG-8e3a9b0c-1d2e-5f60-a1b2-c3d4e5f60718",
        "MIG-8E3A9B0C-1D2E-5F60-A1B2-C3D4E5F60718",
        "MIG-8e3a9b0c",  # a prefix, as CUDA_VISIBLE_DEVICES takes one
        "MIG-GPU-fa4e5a11-0000-0000-0000-000000000000/1/0",
        "MIG-GPU-fa4e5a11/13/2",
    ],
)
def test_mig_references_parse(text: str) -> None:
    assert gpu_ref(text) == text


@pytest.mark.parametrize(
    "text",
    [
        "MIG-",
        "MIG-xyz",
        "MIG-1234",  # too short a prefix
        "MIG-GPU-fa4e5a11/1",  # the legacy form needs GI and CI
        "MIG-GPU-fa4e5a11/1/0/0",
        "MIG-GPU-fa4e5a11/a/0",
        "MIG-GPU-fa4e5a11/1/0 ",
        "MIG-GPU-/1/0",
    ],
)
def test_malformed_mig_references_are_refused(text: str) -> None:
    with pytest.raises(InvalidValue):
        gpu_ref(text)


def test_legacy_form_is_split() -> None:
    assert legacy_mig("MIG-GPU-fa4e5a11-0000/7/1") == ("GPU-fa4e5a11-0000", 7, 1)
    assert legacy_mig(mig_uuid(0, 1, 0)) is None
    assert legacy_mig(GPU0) is None


def test_a_list_may_mix_whole_gpus_and_slices() -> None:
    text = f"0,{GPU0},{mig_uuid(0, 1, 0)},MIG-GPU-fa4e5a11/2/0"
    assert parse_gpu_text(text) == (0, GPU0, mig_uuid(0, 1, 0), "MIG-GPU-fa4e5a11/2/0")
    with pytest.raises(InvalidValue):
        parse_gpu_text(f"{mig_uuid(0, 1, 0)},MIG-{mig_uuid(0, 1, 0)[4:].upper()}")


def mig_host() -> FakeGpuMemory:
    return FakeGpuMemory(count=4, mig={0: list(SLICES), 2: []})


@pytest.mark.parametrize(
    ("ref", "key"),
    [
        (mig_uuid(0, 1, 0), mig_key(0, 0)),
        ("MIG-" + mig_uuid(0, 5, 0)[4:].upper(), mig_key(0, 2)),
        (mig_uuid(0, 2, 0)[:-2], mig_key(0, 1)),  # a unique prefix
        ("MIG-GPU-fa4e5a11-0000-0000-0000-000000000000/2/0", mig_key(0, 1)),
        (f"MIG-{GPU0}/5/0", mig_key(0, 2)),
    ],
)
def test_owned_names_the_slice(ref: int | str, key: int) -> None:
    gpus = mig_host().gpus()
    [owned] = owned_gpus((ref,), gpus, "test.toml")
    assert owned.index == key
    assert owned.mig is not None and owned.mig.parent == 0
    assert owned.minor == 0  # its GPU's device file


WHOLE_0 = [0, mig_key(0, 0), mig_key(0, 1), mig_key(0, 2)]


@pytest.mark.parametrize("ref", [0, GPU0])
def test_a_whole_gpu_owns_its_slices(ref: int | str) -> None:
    gpus = mig_host().gpus()
    assert [gpu.index for gpu in owned_gpus((ref,), gpus, "x")] == WHOLE_0
    # named twice over (the GPU and a slice of it): each once
    both = owned_gpus((mig_uuid(0, 2, 0), ref), gpus, "x")
    assert sorted(gpu.index for gpu in both) == sorted(WHOLE_0)


def test_all_is_every_gpu_and_slice() -> None:
    gpus = mig_host().gpus()
    assert [gpu.index for gpu in owned_gpus("all", gpus, "x")] == [*WHOLE_0, 1, 2, 3]


def test_an_index_never_names_a_slice() -> None:
    gpus = mig_host().gpus()
    with pytest.raises(ConfigError):
        owned_gpus((mig_key(0, 0),), gpus, "x")


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        (mig_uuid(0, 3, 0), "GPU_NO_SUCH_MIG"),  # no slice has it
        (mig_uuid(1, 1, 0), "GPU_NO_SUCH_MIG"),
        ("MIG-fa4e5a11-0000-0000-0000-0000", "GPU_UUID_AMBIGUOUS"),  # all three
        ("MIG-GPU-fa4e5a11-0000-0000-0000-000000000001/1/0", "GPU_NOT_MIG_MODE"),
        ("MIG-GPU-fa4e5a11-0000-0000-0000-000000000000/3/0", "GPU_NO_SUCH_MIG_INSTANCE"),
        ("MIG-GPU-fa4e5a11-0000-0000-0000-000000000000/1/1", "GPU_NO_SUCH_MIG_INSTANCE"),
        ("MIG-GPU-fa4e5a11-0000-0000-0000-000000000002/1/0", "GPU_NO_SUCH_MIG_INSTANCE"),
        ("MIG-GPU-feedface-0000/1/0", "GPU_NO_SUCH_UUID"),  # no such GPU
        ("MIG-GPU-fa4e5a11/1/0", "GPU_UUID_AMBIGUOUS"),  # more than one GPU
    ],
)
def test_unresolved_mig_reference_is_a_config_error(ref: str, problem: str) -> None:
    gpus = mig_host().gpus()
    with pytest.raises(ConfigError) as caught:
        owned_gpus((ref,), gpus, "/etc/gpugate/vllm.toml")
    assert caught.value.exit_code is ExitCode.CONFIG
    assert (caught.value.source, caught.value.field) == ("/etc/gpugate/vllm.toml", "gpus")
    assert "\n" not in str(caught.value)


@pytest.mark.message
def test_no_gpu_in_mig_mode_is_said() -> None:
    gpus = FakeGpuMemory(count=2).gpus()
    with pytest.raises(ConfigError) as caught:
        owned_gpus((mig_uuid(0, 1, 0),), gpus, "x")
    assert str(caught.value).endswith("(no GPU is in MIG mode)")


# ---- holders per slice, with real processes holding GPU 0's stand-in device file ----


def run(host: FakeHost, phase: str = "pre", **config: object):  # type: ignore[no-untyped-def]
    return host.run_phase(
        phase, host.config(**config), host.reporter(phase), driver_factory=lambda: host.memory
    )


def mig_processes(host: FakeHost) -> dict[str, int]:
    """GPU 0 in MIG mode: a stale server on slice 1, another on slice 2, a watcher of the GPU
    (nvidia-smi: its device file, on no slice); each holds /dev/nvidia0, as every CUDA
    process on any slice does."""
    host.memory.mig = {0: list(SLICES)}
    (on_one,) = host.pool.holder(host.gpu_files(0))
    (on_two,) = host.pool.holder(host.gpu_files(0))
    (watcher,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(on_one, {mig_key(0, 0)}, 9000)
    host.memory.claim(on_two, {mig_key(0, 1)}, 7000)
    return {"one": on_one, "two": on_two, "watcher": watcher}


def test_pre_on_a_slice_kills_only_that_slices_holders(host: FakeHost) -> None:
    pids = mig_processes(host)
    summary = run(host, "pre", gpus=[mig_uuid(0, 1, 0)])
    assert summary.exit_code is ExitCode.OK
    assert not alive(pids["one"])
    assert alive(pids["two"])  # on slice 2: NVML lists it there, never a holder of slice 1
    assert alive(pids["watcher"])  # the GPU's device file alone: not slice 1's
    assert {ident.pid for ident in summary.killed} == {pids["one"]}


def test_slice_wait_is_on_the_slices_own_memory(host: FakeHost) -> None:
    pids = mig_processes(host)
    # slice 2's 7000 MiB and GPU 0's are far above free_mib: a slice-1 run does not wait on them
    summary = run(host, "pre", gpus=[mig_uuid(0, 1, 0)], free_mib=100)
    assert summary.exit_code is ExitCode.OK
    assert alive(pids["two"])
    # memory left on slice 1 itself (a leak) is waited on until the deadline
    host.memory.leaked_mib[mig_key(0, 0)] = 500
    held = run(host, "pre", gpus=[mig_uuid(0, 1, 0)], free_mib=100, pre={"wait_timeout_s": 0.5})
    assert held.exit_code is ExitCode.MEMORY_TIMEOUT
    assert [item.gpu.index for item in held.busy] == [mig_key(0, 0)]


def test_legacy_form_in_post_kills_the_units_own_and_spares_the_neighbour(
    host: FakeHost,
) -> None:
    pids = mig_processes(host)
    host.put_in_unit(pids["one"])
    summary = run(host, "post", gpus=[f"MIG-{GPU0}/1/0"])
    assert summary.exit_code is ExitCode.OK
    assert not alive(pids["one"])
    assert alive(pids["two"]) and alive(pids["watcher"])


def test_whole_gpu_takes_every_slice(host: FakeHost) -> None:
    pids = mig_processes(host)
    summary = run(host, "pre", gpus=[0])
    assert summary.exit_code is ExitCode.OK
    assert not alive(pids["one"]) and not alive(pids["two"])
    assert alive(pids["watcher"])  # NVML lists it on no slice: a watcher, as on a whole GPU


def test_two_slices_of_one_unit(host: FakeHost) -> None:
    pids = mig_processes(host)
    summary = run(host, "pre", gpus=[mig_uuid(0, 1, 0), mig_uuid(0, 2, 0)])
    assert summary.exit_code is ExitCode.OK
    assert not alive(pids["one"]) and not alive(pids["two"])
    assert alive(pids["watcher"])


def test_a_process_on_two_slices_straddles(host: FakeHost) -> None:
    pids = mig_processes(host)
    (both,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(both, {mig_key(0, 0), mig_key(0, 2)}, 100)
    summary = run(host, "pre", gpus=[mig_uuid(0, 1, 0)])
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS
    assert alive(both) and alive(pids["two"])


def test_a_slice_holder_unlisted_by_nvml_is_not_taken_by_device_file(host: FakeHost) -> None:
    """A driver that cannot list processes: the device files would be the proof on a whole
    GPU, but /dev/nvidia0 is every slice's: nothing is killed for the slice."""
    pids = mig_processes(host)
    host.memory.lists_processes = False
    summary = run(host, "pre", gpus=[mig_uuid(0, 1, 0)], pre={"wait_timeout_s": 0.5})
    assert all(alive(pid) for pid in pids.values())
    assert summary.killed == []


def test_config_takes_slices() -> None:
    config = parse_config(f'gpus = [1, "{mig_uuid(0, 1, 0)}", "MIG-{GPU0}/2/0"]', "f.toml")
    assert config.gpus == (1, mig_uuid(0, 1, 0), f"MIG-{GPU0}/2/0")


@pytest.mark.parametrize("variable", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"])
def test_a_units_visible_devices_may_name_slices(variable: str) -> None:
    value = f"{mig_uuid(0, 1, 0)},MIG-{GPU0}/2/0"
    assert parse_visible_devices(variable, value, "unit a.service") == (
        mig_uuid(0, 1, 0),
        f"MIG-{GPU0}/2/0",
    )
    with pytest.raises(ConfigError) as caught:
        parse_visible_devices(variable, "MIG-GPU-x/1/0", "unit a.service")
    assert caught.value.exit_code is ExitCode.CONFIG


# ---- leases and locks per slice ----

A, B, WHOLE = "a.service", "b.service", "whole.service"


def unit_run(host: FakeHost, phase: str, unit: str, gpus: list[object], **kwargs: object):  # type: ignore[no-untyped-def]
    reporter = Reporter(unit, phase, journal=host.journal, notifier=host.notifier, echo=False)
    return run_unit_phase(
        RunScope(Phase(phase), unit, lambda: f"/system.slice/{unit}"),
        host.config(gpus=gpus),
        reporter,
        roots=host.roots,
        driver_factory=lambda: host.memory,
        environ={},
        unit_state=lambda _: "active",
        **kwargs,
    )


def leased(host: FakeHost) -> dict[str, tuple[str, ...]]:
    return {lease.unit: lease.uuids for lease in read_leases(host.root / "locks").leases}


def test_units_on_two_slices_start_and_stop_apart(host: FakeHost) -> None:
    host.memory.mig = {0: list(SLICES)}
    assert unit_run(host, "pre", A, [mig_uuid(0, 1, 0)]).exit_code is ExitCode.OK
    assert unit_run(host, "pre", B, [mig_uuid(0, 2, 0)]).exit_code is ExitCode.OK
    assert leased(host) == {A: (mig_uuid(0, 1, 0),), B: (mig_uuid(0, 2, 0),)}
    assert unit_run(host, "post", A, [mig_uuid(0, 1, 0)]).exit_code is ExitCode.OK
    assert leased(host) == {B: (mig_uuid(0, 2, 0),)}
    # the same slice, in the legacy form: refused while b holds it
    again = unit_run(host, "pre", A, [f"MIG-{GPU0}/2/0"])
    assert again.exit_code is ExitCode.HELD_BY_OTHERS


@pytest.mark.parametrize("slice_ref", [mig_uuid(0, 2, 0), f"MIG-{GPU0}/2/0"])
def test_a_whole_gpu_unit_is_refused_while_a_slice_is_leased(
    host: FakeHost, slice_ref: str
) -> None:
    host.memory.mig = {0: list(SLICES)}
    assert unit_run(host, "pre", B, [slice_ref]).exit_code is ExitCode.OK
    (on_two,) = host.pool.holder(host.gpu_files(0))  # b's server, started after its pre
    host.put_in_unit(on_two, cgroup=f"/system.slice/{B}")
    host.memory.claim(on_two, {mig_key(0, 1)}, 7000)
    refused = unit_run(host, "pre", WHOLE, [0])
    assert refused.exit_code is ExitCode.HELD_BY_OTHERS
    assert alive(on_two)  # a refused pre kills nothing
    (event,) = host.journal.events("refused")
    assert event["GPUGATE_REASON"] == "leased"
    assert WHOLE not in leased(host)
    # an unrelated GPU stays free to take
    assert unit_run(host, "pre", WHOLE, [1]).exit_code is ExitCode.OK


def test_a_slice_unit_is_refused_while_its_whole_gpu_is_leased(host: FakeHost) -> None:
    host.memory.mig = {0: list(SLICES), 1: [(1, 0, 1000)]}
    assert unit_run(host, "pre", WHOLE, [0]).exit_code is ExitCode.OK
    whole_lease = leased(host)[WHOLE]
    assert whole_lease == (GPU0, mig_uuid(0, 1, 0), mig_uuid(0, 2, 0), mig_uuid(0, 5, 0))
    for ref in (mig_uuid(0, 1, 0), f"MIG-{GPU0}/5/0"):
        assert unit_run(host, "pre", A, [ref]).exit_code is ExitCode.HELD_BY_OTHERS
    # a slice of another GPU is free
    assert unit_run(host, "pre", A, [mig_uuid(1, 1, 0)]).exit_code is ExitCode.OK
    assert unit_run(host, "post", WHOLE, [0]).exit_code is ExitCode.OK
    assert unit_run(host, "pre", B, [mig_uuid(0, 1, 0)]).exit_code is ExitCode.OK


# ---- gpugate run ----


def test_as_refs_names_slices_by_uuid_and_covered_slices_not_at_all() -> None:
    gpus = mig_host().gpus()
    owned = owned_gpus((1, mig_uuid(0, 2, 0)), gpus, "x")
    assert as_refs(owned) == (1, mig_uuid(0, 2, 0))
    assert as_refs(owned_gpus((0, mig_uuid(0, 2, 0)), gpus, "x")) == (0,)
    # what it names resolves to the same GPUs again
    assert owned_gpus(as_refs(owned), gpus, "x") == owned


def test_gpugate_run_gives_its_unit_the_slices(host: FakeHost) -> None:
    host.memory.mig = {0: list(SLICES)}
    wanted = parse_gpu_text(f"{mig_uuid(0, 1, 0)},MIG-{GPU0}/2/0")
    gpus = resolve_gpus(wanted, {}, lambda: host.memory)
    assert [gpu.index for gpu in gpus] == [mig_key(0, 0), mig_key(0, 1)]
    assert ",".join(map(str, as_refs(gpus))) == f"{mig_uuid(0, 1, 0)},{mig_uuid(0, 2, 0)}"
    from_env = resolve_gpus(None, {"CUDA_VISIBLE_DEVICES": mig_uuid(0, 5, 0)}, lambda: host.memory)
    assert [gpu.index for gpu in from_env] == [mig_key(0, 2)]
    whole = resolve_gpus((0,), {}, lambda: host.memory)
    assert as_refs(whole) == (0,)  # CUDA_VISIBLE_DEVICES=0, not its slices' keys


# ---- a container given a slice ----


def test_a_containers_slice_is_the_slice_not_its_gpu() -> None:
    gpus = list(mig_host().gpus())
    # the container toolkit gives a slice's container its GPU's /dev/nvidia0
    request = GpuRequest(minors=(0, 1), refs=(mig_uuid(0, 2, 0),))
    assert gpu_selection(request, gpus, "oci") == (gpus[-3].uuid, mig_uuid(0, 2, 0))
    assert gpus[-3].index == 1  # /dev/nvidia1: a whole GPU asked by its device
    legacy = GpuRequest(minors=(0,), refs=(f"MIG-{GPU0}/5/0",))
    assert gpu_selection(legacy, gpus, "oci") == (f"MIG-{GPU0}/5/0",)
    whole = GpuRequest(minors=(0,), refs=())
    assert gpu_selection(whole, gpus, "oci") == (GPU0,)
    # a slice NVML does not have: the container's bad input (64), as an unknown index is
    with pytest.raises(BadInput) as caught:
        gpu_selection(GpuRequest(minors=(0,), refs=(mig_uuid(0, 3, 0),)), gpus, "oci")
    assert caught.value.exit_code is ExitCode.USAGE


@pytest.mark.parametrize(
    ("pair", "slice_gi"),
    [("0:0", 1), ("0:1", 2), ("0:2", 5), ("0:0002", 5)],  # NVML's MIG index on GPU 0
)
def test_nvidias_gpu_mig_index_pair_is_that_slice(pair: str, slice_gi: int) -> None:
    gpus = list(mig_host().gpus())
    named = mig_uuid(0, slice_gi, 0)
    assert gpu_selection(GpuRequest(minors=(0,), refs=(pair,)), gpus, "oci") == (named,)
    both = GpuRequest(minors=(0,), refs=(pair, named.upper()))  # one slice, named twice
    assert gpu_selection(both, gpus, "oci") == (named,)
    whole = [gpu for gpu in gpus if gpu.mig is None]
    by_minor, by_index = {g.minor: g.uuid for g in whole}, {g.index: g.uuid for g in whole}
    with_whole = GpuRequest(minors=(0, 1), refs=(pair, "3"))  # minor 0: the slice's GPU
    assert gpu_selection(with_whole, gpus, "oci") == (by_minor[1], named, by_index[3])


@pytest.mark.parametrize(
    "pair",
    [
        "0:3",  # GPU 0 has no MIG device at index 3
        "1:0",  # GPU 1 is not in MIG mode
        "2:0",  # GPU 2 is, with no MIG device
        "9:0",  # no GPU 9
    ],
)
def test_a_pair_nvml_does_not_know_is_refused(pair: str) -> None:
    gpus = list(mig_host().gpus())
    with pytest.raises(BadInput) as caught:
        gpu_selection(GpuRequest(minors=(0,), refs=(pair,)), gpus, "oci")
    assert caught.value.exit_code is ExitCode.USAGE


@pytest.mark.parametrize(
    "ref",
    [
        mig_uuid(0, 3, 0),  # no such slice
        f"MIG-{GPU0[:-1]}1/1/0",  # GPU 1 is not in MIG mode
        f"MIG-{GPU0}/4/0",  # no slice with GPU instance 4
        "MIG-GPU-feedface-0000/1/0",  # no such GPU
    ],
)
def test_an_unresolved_slice_kills_nothing(host: FakeHost, ref: str) -> None:
    pids = mig_processes(host)
    with pytest.raises(ConfigError) as caught:
        run(host, "pre", gpus=[ref])
    assert caught.value.exit_code is ExitCode.CONFIG
    assert "\n" not in str(caught.value)
    assert all(alive(pid) for pid in pids.values())
    assert host.journal.events("signal_sent") == []


# ---- MIG capability devices ----


def capabilities(root: Path, minors: dict[str, int]) -> Path:
    """A stand-in /proc/driver/nvidia/capabilities: path below it -> DeviceFileMinor."""
    for relative, minor in minors.items():
        access = root / relative / "access"
        access.parent.mkdir(parents=True, exist_ok=True)
        access.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    return root


def test_capability_minors_name_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = FakeGpuMemory(count=2, mig={0: [(1, 0, 1), (2, 0, 1), (2, 1, 1)]}).gpus()
    caps = capabilities(
        tmp_path / "caps",
        {
            "gpu0/mig/gi1": 11,
            "gpu0/mig/gi1/ci0": 12,
            "gpu0/mig/gi2": 20,  # two slices in GPU instance 2: names neither
            "gpu0/mig/gi2/ci0": 21,
            "gpu0/mig/gi2/ci1": 22,
            "gpu1/mig/gi1/ci0": 99,  # GPU 1 is not in MIG mode
        },
    )
    monkeypatch.setattr(nvml, "CAPABILITIES", caps)
    assert nvml.slice_of_cap_minor(Path("/proc"), gpus) == {
        11: mig_key(0, 0),
        12: mig_key(0, 0),
        21: mig_key(0, 1),
        22: mig_key(0, 2),
    }
    assert nvml.cap_minor("/dev/nvidia-caps/nvidia-cap12") == 12
    assert nvml.cap_minor("/dev/nvidia-caps/nvidia-cap12x") is None
    assert nvml.cap_minor("/dev/nvidia1") is None
    (caps / "gpu0/mig/gi1/ci0/access").write_text("DeviceFileMode: 292\n")  # no minor line
    assert 12 not in nvml.slice_of_cap_minor(Path("/proc"), gpus)


def test_a_capability_device_ties_an_unlisted_process_to_its_slice(
    host: FakeHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mid-exit: NVML no longer lists the stale process, its slice's memory is not freed yet;
    its capability device says which slice it was on. The neighbour's is spared."""
    host.memory.mig = {0: list(SLICES)}
    caps = capabilities(tmp_path / "caps", {"gpu0/mig/gi1/ci0": 31, "gpu0/mig/gi2/ci0": 32})
    monkeypatch.setattr(nvml, "CAPABILITIES", caps)
    (host.dev / "nvidia-caps").mkdir()
    for minor in (31, 32):
        (host.dev / "nvidia-caps" / f"nvidia-cap{minor}").write_bytes(b"")
    (leaving,) = host.pool.holder([*host.gpu_files(0), host.dev / "nvidia-caps/nvidia-cap31"])
    (neighbour,) = host.pool.holder([*host.gpu_files(0), host.dev / "nvidia-caps/nvidia-cap32"])
    host.memory.leaked_mib[mig_key(0, 0)] = 3000  # until its holder exits (below)
    host.memory.leaked_mib[mig_key(0, 1)] = 3000

    def freed_when_gone(pid: int, key: int) -> None:
        if not alive(pid):
            host.memory.leaked_mib.pop(key, None)

    usage = host.memory.usage

    def usage_then(gpu):  # type: ignore[no-untyped-def]
        freed_when_gone(leaving, mig_key(0, 0))
        return usage(gpu)

    monkeypatch.setattr(host.memory, "usage", usage_then)
    summary = run(host, "pre", gpus=[mig_uuid(0, 1, 0)], free_mib=100)
    assert summary.exit_code is ExitCode.OK
    assert not alive(leaving)
    assert alive(neighbour)


def test_a_slurm_jobs_variables_never_name_slices() -> None:
    """slurmd writes only its own GPU numbers (docs/slurm.md): a MIG UUID in SLURM_JOB_GPUS
    is not slurmd's (exit 64), and CUDA_VISIBLE_DEVICES alone names no GPU (beside
    SLURM_JOB_GPUS it is read for the slices' IDs slurmd writes there: test_slurm.py)."""
    from gpugate.errors import BadInput

    for value in (mig_uuid(0, 1, 0), f"MIG-{GPU0}/2/0"):
        with pytest.raises(BadInput) as caught:
            job_from_env({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": value})
        assert caught.value.exit_code is ExitCode.USAGE
    job = job_from_env({"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": mig_uuid(0, 1, 0)})
    assert (job.gpus, job.visible) == ((), ())
