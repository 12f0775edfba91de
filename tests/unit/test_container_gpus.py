"""A container's GPUs are the NVIDIA devices it can reach, by device number (195:minor),
never by a path or a name it chose (host/oci.py, docs/containers.md): linux.devices,
bind mounts of device nodes (real nodes made with mknod, as root), NVIDIA's own lists by
NVIDIA's precedence, CDI annotations; and what gpugate cannot resolve is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpugate.errors import BadInput, ExitCode
from gpugate.front.commands.oci_runtime import with_hooks
from gpugate.host import oci
from gpugate.host.nvml import Gpu
from gpugate.host.oci import (
    NOT_BOOLEAN,
    UNREADABLE,
    UNTRUSTED,
    GpuRequest,
    Toolkit,
    read_toolkit,
    spec_gpu_request,
)
from gpugate.integrations.container import gpu_selection

ROOT = pytest.mark.root("mknod of a 195:N node")
HOOK = {"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["prestart"]}]}
DEFAULTS = Toolkit()
STRICT = Toolkit(envvar_unprivileged=False)
MOUNTS = Toolkit(envvar_unprivileged=False, volume_mounts=True)
UUIDS = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-00000000000{i}" for i in range(4)]
# Minor is not the index on this host: index i has minor 3 - i.
GPUS = [Gpu(index=i, uuid=UUIDS[i], minor=3 - i, name="A100", total_mib=80) for i in range(4)]


def node(major: int, minor: int, path: str = "/dev/nvidia0", kind: str = "c") -> dict[str, object]:
    return {"path": path, "type": kind, "major": major, "minor": minor}


def request(toolkit: Toolkit = DEFAULTS, **spec: object) -> GpuRequest:
    return spec_gpu_request(spec, toolkit)


def refusal(toolkit: Toolkit = DEFAULTS, **spec: object) -> bool:
    """Refused as bad input (exit 64, one line); the class is the code, not the words."""
    with pytest.raises(BadInput) as caught:
        spec_gpu_request(spec, toolkit)
    assert caught.value.exit_code == ExitCode.USAGE
    return bool(caught.value.message) and "\n" not in caught.value.message


# ---- linux.devices: the device number, whatever the path inside ------------------------


@pytest.mark.parametrize(
    ("devices", "minors"),
    [
        ([node(195, 1, "/dev/nvidia0")], (1,)),  # renumbered: GPU 1's node called nvidia0
        ([node(195, 1, "/dev/gpu1")], (1,)),  # renamed
        ([node(195, 2, "/weird/../path with space")], (2,)),
        ([node(195, 3, "relative/nvidia0")], (3,)),
        ([node(195, 0, "/dev/nvidia0"), node(195, 0, "/dev/again")], (0,)),  # duplicates
        ([node(195, 5), node(195, 4, "/x")], (5, 4)),
        ([node(195, 255, "/dev/nvidiactl"), node(195, 254, "/dev/nvidia-modeset")], ()),
        ([node(508, 0, "/dev/nvidia-uvm"), node(508, 1, "/dev/nvidia-uvm-tools")], ()),
        ([node(511, 1, "/dev/nvidia-caps/nvidia-cap1")], ()),
        ([node(1, 3, "/dev/nvidia0")], ()),  # /dev/null's numbers under a GPU's name
        ([node(7, 1, "/dev/nvidia1")], ()),  # a loop device so named
        ([node(195, 1, "/dev/nvidia1", kind="b")], ()),  # block 195 is not NVIDIA's
        ([node(195, 6, "/dev/nvidia6", kind="u")], (6,)),
        ([{"path": "/dev/x", "major": 195, "minor": 2}], (2,)),  # type left out: c
        ([node(195, True), {"major": "195", "minor": "1"}, None, 5, "x"], ()),  # type: ignore[list-item]
    ],
)
def test_devices_by_number(devices: list[object], minors: tuple[int, ...]) -> None:
    assert request(linux={"devices": devices}).minors == minors


@pytest.mark.parametrize("hostile", ["x", {"path": "/dev/nvidia0"}, [[node(195, 0)]], None])
def test_hostile_device_lists_reach_nothing(hostile: object) -> None:
    assert not request(linux={"devices": hostile})


@ROOT
def test_an_entry_without_numbers_is_its_host_node(tmp_path: Path) -> None:
    os.mknod(tmp_path / "card", 0o600 | 0o020000, os.makedev(195, 2))
    os.mknod(tmp_path / "ctl", 0o600 | 0o020000, os.makedev(195, 255))
    (tmp_path / "plain").write_text("")
    got = request(
        linux={
            "devices": [
                {"path": str(tmp_path / n), "type": "c"} for n in ("card", "ctl", "plain", "absent")
            ]
        }
    )
    assert got.minors == (2,)


@ROOT
def test_an_entry_without_numbers_at_a_link_is_refused(tmp_path: Path) -> None:
    os.mknod(tmp_path / "card", 0o600 | 0o020000, os.makedev(195, 2))
    (tmp_path / "link").symlink_to(tmp_path / "card")
    devices = [{"path": str(tmp_path / "link"), "type": "c"}]
    assert refusal(linux={"devices": devices})


# ---- bind mounts: what the source on the host is ----------------------------------------


@pytest.fixture
def dev(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the host's /dev: nvidia0..2 as 195:0..2, nvidiactl, a null-like node."""
    if os.geteuid() != 0:
        pytest.skip("mknod of a 195:N node")
    folder = tmp_path / "host" / "dev"
    folder.mkdir(parents=True)
    for minor in range(3):
        os.mknod(folder / f"nvidia{minor}", 0o666 | 0o020000, os.makedev(195, minor))
    os.mknod(folder / "nvidiactl", 0o666 | 0o020000, os.makedev(195, 255))
    os.mknod(folder / "null", 0o666 | 0o020000, os.makedev(1, 3))
    (folder / "gpu-link").symlink_to(folder / "nvidia2")
    monkeypatch.setattr(oci, "HOST_DEV", str(folder))
    return folder


def bind(source: str, target: str = "/x", **extra: object) -> dict[str, object]:
    return {"source": source, "destination": target, "type": "bind", **extra}


@pytest.mark.parametrize(
    ("mounts", "minors"),
    [
        ([bind("{dev}/nvidia2", "/dev/x")], (2,)),  # bind-mounted under another name
        ([bind("{dev}/nvidia1", "/dev/nvidia0")], (1,)),  # renumbered by the mount
        ([{"source": "{dev}/nvidia1", "destination": "/y", "options": ["rbind"]}], (1,)),
        (
            [{"source": "{dev}/nvidia1", "destination": "/y", "type": "none", "options": ["bind"]}],
            (1,),
        ),
        ([{"source": "{dev}/nvidia1", "destination": "/y", "type": "tmpfs"}], ()),  # not a bind
        ([bind("{dev}/gpu-link")], (2,)),  # a link as source: the mount follows it
        ([bind("{dev}/nvidiactl"), bind("{dev}/null", "/dev/nvidia0")], ()),
        ([bind("{dev}/nvidia0"), bind("{dev}/nvidia0", "/z")], (0,)),  # duplicates
        ([bind("{dev}"), bind("{dev}/nvidia1")], (0, 1, 2)),  # a bind of the whole /dev
        ([bind("{dev}/..")], (0, 1, 2)),  # a folder /dev lies in
        ([bind("{dev}/absent"), bind("relative"), {"source": 7}, None], ()),
    ],
)
@pytest.mark.root("mknod of a 195:N node")
def test_bind_mounts_by_their_source(
    dev: Path, mounts: list[object], minors: tuple[int, ...]
) -> None:
    shaped = [
        {k: v.format(dev=dev) if isinstance(v, str) else v for k, v in m.items()}
        if isinstance(m, dict)
        else m
        for m in mounts
    ]
    assert request(mounts=shaped).minors == minors


@pytest.mark.root("mknod of a 195:N node")
def test_a_folder_elsewhere_on_devs_filesystem_is_read_one_level(dev: Path) -> None:
    sub = dev / "dri"
    sub.mkdir()
    os.mknod(sub / "card", 0o666 | 0o020000, os.makedev(195, 1))
    (sub / "deeper").mkdir()
    os.mknod(sub / "deeper" / "card", 0o666 | 0o020000, os.makedev(195, 2))
    assert request(mounts=[bind(str(sub))]).minors == (1,)


@pytest.mark.root("mknod of a 195:N node")
def test_a_huge_folder_is_refused(dev: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oci, "MAX_FOLDER_ENTRIES", 3)
    assert refusal(mounts=[bind(str(dev))])


# ---- NVIDIA's lists: only where its hook will inject them, by its precedence -----------


def env(*items: str) -> dict[str, object]:
    return {"env": ["PATH=/bin", *items]}


PRIVILEGED = {"bounding": ["CAP_CHOWN", "CAP_SYS_ADMIN"]}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", GpuRequest(refs=("0",))),
        (" 1 , 3 ,", GpuRequest(refs=("1", "3"))),
        ("3,3", GpuRequest(refs=("3",))),
        (UUIDS[1], GpuRequest(refs=(UUIDS[1],))),
        ("0," + UUIDS[2], GpuRequest(refs=("0", UUIDS[2]))),
        ("0:1", GpuRequest(refs=("0:1",))),  # a MIG device by NVIDIA's GPU:MIG index pair
        ("1,0:0,12:3", GpuRequest(refs=("1", "0:0", "12:3"))),
        ("all", GpuRequest(all_gpus=True)),
        ("0,all", GpuRequest(all_gpus=True)),  # NVIDIA: the first all or none decides
        ("none,all", GpuRequest()),
        ("0,void", GpuRequest()),  # any void: none
        ("none", GpuRequest()),
        ("void", GpuRequest()),
        ("", GpuRequest()),
        (" , ", GpuRequest()),
    ],
)
def test_the_variable_as_nvidias_hook_reads_it(value: str, expected: GpuRequest) -> None:
    got = request(hooks=HOOK, process=env(f"NVIDIA_VISIBLE_DEVICES={value}"))
    assert (got.minors, got.refs, got.all_gpus) == (
        expected.minors,
        expected.refs,
        expected.all_gpus,
    )


@pytest.mark.parametrize(
    ("hooks", "counts"),
    [
        (HOOK, True),
        ({"prestart": [{"path": "/usr/local/bin/nvidia-container-toolkit"}]}, True),
        ({"createContainer": [{"path": "/usr/bin/nvidia-ctk", "args": ["hook"]}]}, False),
        ({"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook-x"}]}, False),
        ({"prestart": [{"path": "/usr/bin/gpugate", "args": ["gpugate", "oci-hook"]}]}, False),
        (None, False),
        ({"prestart": "x"}, False),
        ([HOOK], False),
        ({"prestart": [None, 1, {"path": 5}]}, False),
    ],
)
def test_the_variable_counts_only_with_nvidias_hook(hooks: object, counts: bool) -> None:
    """Every CUDA image sets NVIDIA_VISIBLE_DEVICES=all: without NVIDIA's hook nothing
    injects it, and it must not gate every GPU."""
    assert bool(request(hooks=hooks, process=env("NVIDIA_VISIBLE_DEVICES=all"))) is counts


def test_the_last_setting_counts() -> None:
    process = env("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=2")
    assert request(hooks=HOOK, process=process).refs == ("2",)


def test_a_legacy_cuda_image_without_the_variable_is_all() -> None:
    assert request(hooks=HOOK, process=env("CUDA_VERSION=9.0")).all_gpus
    assert not request(hooks=HOOK, process=env("CUDA_VERSION=9.0", "NVIDIA_REQUIRE_CUDA=x"))


@pytest.mark.parametrize(
    ("toolkit", "caps", "counts"),
    [
        (DEFAULTS, None, True),  # NVIDIA's default accepts the variable
        (STRICT, None, False),  # the unprivileged rule in force: ignored
        (STRICT, {"bounding": ["CAP_CHOWN"], "effective": ["CAP_SYS_ADMIN"]}, False),
        (STRICT, PRIVILEGED, True),  # privileged: NVIDIA reads it
        (STRICT, {"bounding": "CAP_SYS_ADMIN"}, False),
    ],
)
def test_the_unprivileged_rule(toolkit: Toolkit, caps: object, counts: bool) -> None:
    process = {**env("NVIDIA_VISIBLE_DEVICES=all"), "capabilities": caps}
    assert bool(request(toolkit, hooks=HOOK, process=process)) is counts


def devices_list(*words: str, source: str = "/dev/null") -> list[dict[str, object]]:
    return [
        {"source": source, "destination": f"/var/run/nvidia-container-devices/{w}", "type": "bind"}
        for w in words
    ]


def test_the_volume_mounts_list_wins_where_accepted() -> None:
    """The device plugin's recommended mode: the list as mounts, the variable its folder."""
    spec = {
        "hooks": HOOK,
        "process": env("NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"),
        "mounts": devices_list(UUIDS[1], "2", UUIDS[1], "imex/channel0"),
    }
    got = spec_gpu_request(spec, MOUNTS)
    assert (got.refs, got.all_gpus) == ((UUIDS[1], "2"), False)
    # Not accepted, and the variable ignored for an unprivileged container: nothing.
    assert not spec_gpu_request(spec, STRICT)
    # Accepted, but the variable is NVIDIA's fallback only where the list is empty.
    fallback = {**spec, "mounts": [], "process": env("NVIDIA_VISIBLE_DEVICES=3")}
    assert spec_gpu_request(fallback, Toolkit(volume_mounts=True)).refs == ("3",)


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("cdi/nvidia.com/gpu=1", ("1",)),
        ("cdi/nvidia.com/gpu/2", ("2",)),
        ("cdi/nvidia.com/gpu=0:1", ("0:1",)),
        ("0:2", ("0:2",)),
        ("cdi/vendor.com/fpga/0", ()),
    ],
)
def test_cdi_names_in_the_volume_mounts_list(word: str, expected: tuple[str, ...]) -> None:
    got = request(MOUNTS, hooks=HOOK, mounts=devices_list(word), process=env())
    assert got.refs == expected


def test_a_junk_cdi_name_in_the_list_is_refused() -> None:
    mounts = devices_list("cdi/nvidia.com/gpu/MIG-1")
    assert refusal(MOUNTS, hooks=HOOK, mounts=mounts, process=env())


def test_only_dev_null_mounts_under_the_folder_are_the_list() -> None:
    mounts = [*devices_list("1", source="/srv/x"), bind("/dev/null", "/elsewhere/2")]
    assert not request(MOUNTS, hooks=HOOK, mounts=mounts, process=env())


# ---- CDI annotations -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({"cdi.k8s.io/nvidia": "nvidia.com/gpu=0"}, GpuRequest(refs=("0",))),
        (
            {"cdi.k8s.io/a": f"nvidia.com/gpu=1,nvidia.com/gpu={UUIDS[2]}"},
            GpuRequest(refs=("1", UUIDS[2])),
        ),
        ({"cdi.k8s.io/a": "nvidia.com/gpu=all"}, GpuRequest(all_gpus=True)),
        ({"cdi.k8s.io/a": "nvidia.com/gpu=0:1"}, GpuRequest(refs=("0:1",))),  # nvidia-ctk's name
        (
            {"cdi.k8s.io/a": "nvidia.com/gpu=1", "cdi.k8s.io/b": "nvidia.com/gpu=1"},
            GpuRequest(refs=("1",)),
        ),
        ({"cdi.k8s.io/a": "vendor.com/fpga=1,nvidia.com/imex-channel=0"}, GpuRequest()),
        ({"other/a": "nvidia.com/gpu=1", "cdi.k8s.io/n": 5}, GpuRequest()),
    ],
)
def test_cdi_annotations(annotations: dict[str, object], expected: GpuRequest) -> None:
    got = request(annotations=annotations)  # no NVIDIA hook needed: the engine injects them
    assert (got.refs, got.all_gpus) == (expected.refs, expected.all_gpus)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("gpu0", "OCI_CDI_NAME"),
        ("nvidia.com/gpu", "OCI_CDI_NAME"),
        ("nvidia.com/gpu=", "OCI_CDI_NAME"),
        ("nvidia.com/gpu=0:1:0", "OCI_GPU_MIG"),
        ("nvidia.com/gpu=0:", "OCI_GPU_MIG"),
        ("nvidia.com/gpu=MIG-1234", "OCI_GPU_MIG"),
        ("nvidia.com/gpu=first", "OCI_GPU_WORD"),
        ("nvidia.com/gpu=1," * 400 + "nvidia.com/gpu=12", "OCI_ANNOTATION_TOO_LONG"),
    ],
)
def test_junk_cdi_names_are_refused(value: str, problem: str) -> None:
    assert refusal(annotations={"cdi.k8s.io/x": value})


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("gpu0", "OCI_GPU_WORD"),
        ("ALL", "OCI_GPU_WORD"),  # NVIDIA's `all` is exact: this is a device it fails on
        ("MIG-1234", "OCI_GPU_MIG"),
        ("0:1:2", "OCI_GPU_MIG"),
        (":1", "OCI_GPU_MIG"),
        ("1:", "OCI_GPU_MIG"),
        ("0:x", "OCI_GPU_MIG"),
        ("0:-1", "OCI_GPU_MIG"),
        ("12345:0", "OCI_GPU_MIG"),
        ("0:\u0661", "OCI_GPU_MIG"),  # an Arabic-Indic one: a digit to Python, not to NVIDIA
        ("GPU-1:0", "OCI_GPU_MIG"),
        ("/var/run/nvidia-container-devices", "OCI_GPU_WORD"),
        ("1," * 3000, "OCI_ENV_TOO_LONG"),
    ],
)
def test_junk_variable_values_are_refused(value: str, problem: str) -> None:
    assert refusal(hooks=HOOK, process=env(f"NVIDIA_VISIBLE_DEVICES={value}"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=30), st.integers(), st.none()), max_size=20))
def test_any_env_list_resolves_or_is_refused_with_one_line(items: list[object]) -> None:
    try:
        got = request(hooks=HOOK, process={"env": items})
    except BadInput as exc:
        assert "\n" not in exc.message
    else:
        assert all(ref.strip() == ref and ref for ref in got.refs)


# ---- the union, and NVML resolving it --------------------------------------------------


def test_every_way_is_a_union() -> None:
    got = request(
        hooks=HOOK,
        process=env("NVIDIA_VISIBLE_DEVICES=0"),
        linux={"devices": [node(195, 2, "/dev/gpu")]},
        annotations={"cdi.k8s.io/x": f"nvidia.com/gpu={UUIDS[3]}"},
    )
    assert (got.minors, got.refs) == ((2,), (UUIDS[3], "0"))
    assert set(got.origins) == {
        "linux.devices",
        "annotation cdi.k8s.io/x",
        "NVIDIA_VISIBLE_DEVICES",
    }
    # 195:2 is index 1 here (minor 3 - index); UUIDS[3] index 3; "0" index 0.
    assert gpu_selection(got, GPUS, "s") == (UUIDS[1], UUIDS[3], UUIDS[0])


def test_the_same_gpu_by_every_name_is_one() -> None:
    got = GpuRequest(minors=(3,), refs=("0", UUIDS[0].lower()))
    assert gpu_selection(got, GPUS, "s") == (UUIDS[0],)


@pytest.mark.parametrize(
    ("got", "problem"),
    [
        (GpuRequest(minors=(9,)), "OCI_DEVICE_NOT_GPU"),
        (GpuRequest(refs=("4",)), "OCI_GPU_UNKNOWN"),
        (GpuRequest(refs=("GPU-ffffffff-0000",)), "OCI_GPU_UNKNOWN"),
        (GpuRequest(refs=(UUIDS[0][:12],)), "OCI_GPU_UNKNOWN"),  # a prefix: not guessed
    ],
)
def test_what_nvml_does_not_know_is_refused(got: GpuRequest, problem: str) -> None:
    with pytest.raises(BadInput) as caught:
        gpu_selection(got, GPUS, "s")
    assert caught.value.exit_code == ExitCode.USAGE


def test_all_is_all() -> None:
    assert gpu_selection(GpuRequest(minors=(1,), all_gpus=True), GPUS, "s") == "all"


# ---- NVIDIA's config.toml --------------------------------------------------------------


def test_toolkit_config_absent_is_nvidias_defaults(tmp_path: Path) -> None:
    got = read_toolkit(tmp_path / "config.toml")
    assert (got.envvar_unprivileged, got.volume_mounts, got.note) == (True, False, "")


def test_toolkit_config_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
        "accept-nvidia-visible-devices-as-volume-mounts = true\n"
        "[nvidia-container-runtime]\nmode = 'legacy'\n"
    )
    got = read_toolkit(path)
    assert (got.envvar_unprivileged, got.volume_mounts, got.note) == (False, True, "")


@pytest.mark.parametrize(
    ("text", "mode", "note"),
    [
        ("accept-nvidia-visible-devices-envvar-when-unprivileged = false\n", 0o666, UNTRUSTED),
        ("not toml [[[", 0o644, UNREADABLE),
        ("accept-nvidia-visible-devices-as-volume-mounts = 'yes'\n", 0o644, NOT_BOOLEAN),
    ],
)
def test_a_toolkit_config_not_to_trust_is_the_defaults_said(
    tmp_path: Path, text: str, mode: int, note: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    path.chmod(mode)
    got = read_toolkit(path)
    assert (got.envvar_unprivileged, got.volume_mounts, got.note) == (True, False, note)


def test_a_toolkit_config_link_or_fifo_is_the_defaults(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    for name in ("fifo", "link"):
        assert read_toolkit(tmp_path / name).note == UNREADABLE


# ---- the runc wrapper asks the same question -------------------------------------------


def test_the_wrapper_gates_what_the_hook_gates() -> None:
    renamed = {"linux": {"devices": [node(195, 1, "/dev/gpu1")]}, "process": env()}
    assert with_hooks(renamed, ("/usr/bin/gpugate",))
    image_only = {"process": env("NVIDIA_VISIBLE_DEVICES=all")}
    assert not with_hooks(image_only, ("/usr/bin/gpugate",))
    ctl_only = {"linux": {"devices": [node(195, 255, "/dev/nvidiactl")]}}
    assert not with_hooks(ctl_only, ("/usr/bin/gpugate",))
