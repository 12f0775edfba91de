"""The OCI hook's input: the container state on stdin and the bundle's config.json, in the
shapes runtimes write them and in shapes nobody should (missing fields, huge, hostile). The container's GPUs:
test_container_gpus.py."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from gpugate.errors import BadInput, ExitCode
from gpugate.host.oci import (
    MAX_CONFIG_BYTES,
    ContainerState,
    GpuRequest,
    parse_config,
    parse_state,
    read_config,
    read_stdin_bounded,
)
from gpugate.integrations.container import cgroup_of_spec

ID = "3f2a1b0c4d5e" + "0" * 52


def state(**fields: object) -> bytes:
    base: dict[str, object] = {
        "ociVersion": "1.0.2",
        "id": ID,
        "status": "creating",
        "pid": 4242,
        "bundle": "/run/bundle",
    }
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None}).encode()


def env(*items: str) -> list[str]:
    return ["PATH=/usr/bin", *items]


# ---- the state on stdin ---------------------------------------------------------------


def test_state_as_runc_writes_it() -> None:
    got = parse_state(state(annotations={"io.podman.annotations.name": "vllm"}))
    assert got == ContainerState(ID, 4242, "/run/bundle", {"io.podman.annotations.name": "vllm"})


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"", ""),
        (b"{", ""),
        (b"[]", ""),
        (b'"x"', ""),
        (state(id=None), "id"),
        (state(id=""), "id"),
        (state(id="../../etc"), "id"),
        (state(id="a" * 200), "id"),
        (state(id=5), "id"),
        (state(bundle=None), "bundle"),
        (state(bundle="relative/path"), "bundle"),
        (state(bundle=["/x"]), "bundle"),
        (state(bundle="/a\u0000b"), "bundle"),
        (b"[" * 100000 + b"]" * 100000, ""),
    ],
)
def test_bad_states_are_one_line_errors(raw: bytes, field: str) -> None:
    """Named: the state on stdin and the field refused ("": the state as a whole)."""
    with pytest.raises(BadInput) as caught:
        parse_state(raw)
    named = "the container state on stdin: " + (f"{field}: " if field else "")
    assert caught.value.message.startswith(named), caught.value.message
    assert "\n" not in caught.value.message and len(caught.value.message) < 300
    assert caught.value.exit_code is ExitCode.USAGE


@pytest.mark.parametrize("pid", [None, -1, "12", True, 1.5, 1 << 40])
def test_odd_pids_are_no_pid(pid: object) -> None:
    assert parse_state(state(pid=pid)).pid == 0


def test_hostile_annotations_are_bounded_and_strings_only() -> None:
    annotations = {f"k{i}": "v" * 10000 for i in range(3000)}
    annotations["n"] = 5  # type: ignore[assignment]
    got = parse_state(state(annotations=annotations))
    assert len(got.annotations) <= 1024
    assert all(len(v) <= 256 for v in got.annotations.values())
    assert parse_state(state(annotations="x")).annotations == {}


def test_stdin_read_is_bounded_in_size_and_time() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"x" * 100)
    os.close(write_end)
    assert read_stdin_bounded(read_end) == b"x" * 100
    os.close(read_end)

    read_end, write_end = os.pipe()
    writer = threading.Thread(target=lambda: os.write(write_end, b"y" * 5000))
    writer.start()
    with pytest.raises(BadInput):
        read_stdin_bounded(read_end, limit=1000)
    writer.join()
    os.close(read_end)
    os.close(write_end)

    read_end, write_end = os.pipe()  # a runtime that never closes stdin
    with pytest.raises(BadInput):
        read_stdin_bounded(read_end, timeout_s=0.05)
    os.close(read_end)
    os.close(write_end)


# ---- config.json ----------------------------------------------------------------------


NVIDIA_HOOK = {"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook", "args": []}]}


def spec(**fields: object) -> bytes:
    body: dict[str, object] = {
        "ociVersion": "1.0.2",
        "hooks": NVIDIA_HOOK,
        "process": {"env": env("NVIDIA_VISIBLE_DEVICES=1")},
        "linux": {"cgroupsPath": "machine.slice:libpod:" + ID},
        "annotations": {"io.podman.annotations.name": "vllm"},
    }
    body.update(fields)
    return json.dumps(body).encode()


def test_config_as_podman_writes_it() -> None:
    got = parse_config(spec())
    assert got.gpus == GpuRequest(refs=("1",), origins=("NVIDIA_VISIBLE_DEVICES",))
    assert cgroup_of_spec(got.cgroups_path) == f"/machine.slice/libpod-{ID}.scope"


@pytest.mark.parametrize(
    "fields",
    [
        {"process": None, "linux": None},
        {"process": "x", "linux": 5},
        {"process": {"env": None}, "linux": {"devices": None}},
        {"process": {}, "linux": {}},
    ],
)
def test_missing_or_odd_sections_mean_no_gpu(fields: dict[str, object]) -> None:
    assert not parse_config(spec(**fields)).gpus


@pytest.mark.parametrize(
    ("path", "cgroup"),
    [
        ("system.slice:docker:" + ID, f"/system.slice/docker-{ID}.scope"),
        (":crio:" + ID, f"/system.slice/crio-{ID}.scope"),
        (
            "kubepods-besteffort.slice:cri-containerd:abc",
            "/kubepods.slice/kubepods-besteffort.slice/cri-containerd-abc.scope",
        ),
        ("/docker/" + ID, "/docker/" + ID),
        ("nonsense", None),
        ("a:b", None),
        ("bad/slice.slice:x:y", None),
        ("", None),
        (None, None),
    ],
)
def test_cgroups_path_forms(path: str | None, cgroup: str | None) -> None:
    assert cgroup_of_spec(path) == cgroup


def bundle_dir(tmp_path: Path, content: bytes, mode: int = 0o644) -> str:
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o700)
    (bundle / "config.json").write_bytes(content)
    (bundle / "config.json").chmod(mode)
    return str(bundle)


def test_config_read_from_own_bundle(tmp_path: Path) -> None:
    assert parse_config(read_config(bundle_dir(tmp_path, spec()))).gpus


def test_config_that_is_a_link_is_refused(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o700)
    (tmp_path / "elsewhere.json").write_bytes(spec())
    (bundle / "config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(BadInput):
        read_config(str(bundle))


def test_config_writable_by_others_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadInput):
        read_config(bundle_dir(tmp_path, spec(), mode=0o666))


def test_bundle_writable_by_others_is_refused(tmp_path: Path) -> None:
    bundle = bundle_dir(tmp_path, spec())
    os.chmod(bundle, 0o777)
    with pytest.raises(BadInput):
        read_config(bundle)


def test_missing_bundle_and_config(tmp_path: Path) -> None:
    with pytest.raises(BadInput):
        read_config(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInput):
        read_config(str(empty))


def test_config_that_is_a_folder_or_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    os.mkfifo(bundle / "config.json")
    with pytest.raises(BadInput):
        read_config(str(bundle))
    os.unlink(bundle / "config.json")
    (bundle / "config.json").mkdir()
    with pytest.raises(BadInput):
        read_config(str(bundle))


def test_huge_config_is_refused(tmp_path: Path) -> None:
    bundle = bundle_dir(tmp_path, b" " * (MAX_CONFIG_BYTES + 10))
    with pytest.raises(BadInput) as refused:
        read_config(bundle)
    assert refused.value.exit_code is ExitCode.USAGE
    assert len(read_config(bundle, limit=MAX_CONFIG_BYTES + 10)) == MAX_CONFIG_BYTES + 10


@pytest.mark.root("make a file another user owns")
def test_config_of_another_owner_is_refused(tmp_path: Path) -> None:
    bundle = bundle_dir(tmp_path, spec())
    os.chown(Path(bundle, "config.json"), 1000, 1000)
    with pytest.raises(BadInput):
        read_config(bundle)
