"""Issue 34, rule 3: names shown come from the runtime's own fields first (docker's and
containers/storage's records, the annotations CRI-O and containerd's CRI write, read only
where the container's cgroup says it is theirs); a name its author may set is shown escaped,
as the author's, and never replaces the id, which stays the identity (lease, journal)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpugate.host.nvml import Gpu
from gpugate.host.oci import ContainerState, parse_config
from gpugate.integrations import container
from gpugate.integrations.container import ContainerIdentity, identify
from gpugate.integrations.records import new_lease, read_leases, write_lease

A = "a" * 64
KUBE = "/kubepods.slice/kubepods-pod1.slice"
EVIL = "evil\nGPUGATE_EVENT=x\x1b[2J\u202e"


class NoProcs:
    def info(self, pid: int) -> None:
        return None


def who(
    cgroups_path: str, annotations: dict[str, str], bundle: str = "/nonexistent"
) -> ContainerIdentity:
    body = {"linux": {"cgroupsPath": cgroups_path}, "annotations": annotations}
    spec = parse_config(json.dumps(body).encode())
    state = ContainerState(A, 0, bundle, annotations)
    return identify(state, spec, NoProcs())  # type: ignore[arg-type]


def storage_bundle(tmp_path: Path, names: list[str]) -> str:
    """containers/storage's layout: DRIVER-containers/containers.json, ID/userdata."""
    top = tmp_path / "overlay-containers"
    (top / A / "userdata").mkdir(parents=True)
    (top / "containers.json").write_text(json.dumps([{"id": A, "names": names}]))
    return str(top / A / "userdata")


def test_podman_name_from_its_storage_record_over_any_annotation(tmp_path: Path) -> None:
    bundle = storage_bundle(tmp_path, ["vllm"])
    identity = who(
        f"machine.slice:libpod:{A}", {"io.podman.annotations.name": "bob-s-server"}, bundle
    )
    assert identity.name == "vllm"
    assert identity.fields()["GPUGATE_OCI_CONTAINER_NAME"] == "vllm"
    assert identity.fields()["GPUGATE_OCI_ANNOTATED_NAME"] == "bob-s-server"
    assert identity.unit == f"libpod-{A}.scope"


def test_docker_name_from_dockerds_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / A).mkdir()
    (tmp_path / A / "config.v2.json").write_text(json.dumps({"Name": "/dgpu"}))
    real = container.docker_name
    monkeypatch.setattr(container, "docker_name", lambda i: real(i, root=tmp_path))
    for path in (f"system.slice:docker:{A}", f"/docker/{A}"):
        identity = who(path, {"nerdctl/name": "other"})
        assert (identity.runtime, identity.name) == ("docker", "dgpu"), path


@pytest.mark.parametrize("shape", ["folder", "fifo", "link", "oversized", "not json"])
def test_a_runtime_record_that_is_no_plain_json_file_gives_no_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """A folder, a FIFO or a link where the record should be, or a record past its cap: the
    container goes on without a name (no error, no exit 70)."""
    record = tmp_path / A / "config.v2.json"
    bundle = tmp_path / "overlay-containers" / A / "userdata"
    bundle.mkdir(parents=True)
    listing = tmp_path / "overlay-containers" / "containers.json"
    (tmp_path / A).mkdir()
    good = {record: {"Name": "/dgpu"}, listing: [{"id": A, "names": ["vllm"]}]}
    for path, body in good.items():
        text = json.dumps(body)
        if shape == "folder":
            path.mkdir()
        elif shape == "fifo":
            os.mkfifo(path)
        elif shape == "link":
            (tmp_path / f"real-{path.name}").write_text(text)
            path.symlink_to(tmp_path / f"real-{path.name}")
        else:
            path.write_text(text if shape == "oversized" else text[:-1])
    monkeypatch.setattr(container, "MAX_DOCKER_CONFIG", 8 if shape == "oversized" else 1 << 20)
    monkeypatch.setattr(container, "MAX_STORAGE_RECORDS", 8 if shape == "oversized" else 1 << 20)
    assert container.docker_name(A, root=tmp_path) is None
    assert container.storage_name(A, str(bundle)) is None


@pytest.mark.root("give a record to another account")
def test_a_runtime_record_another_account_may_change_gives_no_name(tmp_path: Path) -> None:
    bundle = storage_bundle(tmp_path, ["vllm"])
    assert container.storage_name(A, bundle) == "vllm"
    listing = tmp_path / "overlay-containers" / "containers.json"
    listing.chmod(0o666)  # another account may rewrite it
    assert container.storage_name(A, bundle) is None
    listing.chmod(0o644)
    os.chown(listing, 65534, 65534)
    assert container.storage_name(A, bundle) is None


def test_the_runtime_records_read_when_plain(tmp_path: Path) -> None:
    """The control for the shapes above: the same records as plain files give the names."""
    (tmp_path / A).mkdir()
    (tmp_path / A / "config.v2.json").write_text(json.dumps({"Name": "/dgpu"}))
    assert container.docker_name(A, root=tmp_path) == "dgpu"
    assert container.storage_name(A, storage_bundle(tmp_path, ["vllm"])) == "vllm"


@pytest.mark.parametrize(
    ("scope", "annotations", "name"),
    [
        (
            f"{KUBE}/crio-{A}.scope",
            {"io.kubernetes.cri-o.ContainerName": "server", "io.kubernetes.pod.name": "llm-0"},
            "llm-0/server",
        ),
        (f"{KUBE}/crio-{A}.scope", {"io.kubernetes.cri-o.ContainerName": "/server"}, "server"),
        (
            f"{KUBE}/cri-containerd-{A}.scope",
            {"io.kubernetes.cri.container-name": "server", "io.kubernetes.cri.sandbox-name": "p"},
            "p/server",
        ),
    ],
)
def test_cri_names_are_read_only_for_their_own_runtime(
    scope: str, annotations: dict[str, str], name: str
) -> None:
    assert who(scope, annotations).name == name
    # The same annotations on podman's container are its author's word.
    podman = who(f"/machine.slice/libpod-{A}.scope", annotations)
    assert podman.name is None and podman.claimed is not None


@pytest.mark.message
@pytest.mark.parametrize(
    "annotations",
    [
        {"io.podman.annotations.name": "vllm"},
        {"nerdctl/name": "vllm"},
        {"io.kubernetes.cri-o.ContainerName": "vllm"},
        {"io.kubernetes.cri.container-name": "vllm"},
        {"io.container.manager.name": "vllm"},
    ],
)
def test_an_authors_name_is_marked_and_never_the_identity(annotations: dict[str, str]) -> None:
    identity = who(f"machine.slice:libpod:{A}", annotations)
    (key,) = annotations
    assert identity.name is None
    assert identity.label == f'podman container {A[:12]} ("vllm" by its annotation {key})'
    assert identity.unit == f"libpod-{A}.scope"
    assert identity.fields()["GPUGATE_OCI_CONTAINER"] == A
    assert "GPUGATE_OCI_CONTAINER_NAME" not in identity.fields()


@pytest.mark.parametrize(
    "hostile",
    [EVIL, "x" * 100_000, "\u2028line\u2029", "\\x1b[31m", "\udcff", "a\x00b", " \t\n "],
)
def test_hostile_names_are_shown_escaped_on_one_line(tmp_path: Path, hostile: str) -> None:
    for given, bundle in (
        ({"io.podman.annotations.name": hostile}, "/nonexistent"),
        ({}, storage_bundle(tmp_path / str(len(hostile)), [hostile])),
    ):
        identity = who(f"machine.slice:libpod:{A}", given, bundle)
        label = identity.label
        assert A[:12] in label
        assert label.isprintable(), label
        assert len(label) < 200
        for field in identity.fields().values():
            assert len(field) <= 256 * 4


def test_an_empty_or_blank_name_is_no_name() -> None:
    identity = who(f"machine.slice:libpod:{A}", {"io.podman.annotations.name": "   "})
    assert (identity.name, identity.claimed) == (None, None)


@pytest.mark.parametrize("hostile", [EVIL, "x" * 100_000, '"quoted" \\ back'])
def test_a_marked_name_survives_the_lease_file(tmp_path: Path, hostile: str) -> None:
    identity = who(f"machine.slice:libpod:{A}", {"io.podman.annotations.name": hostile})
    gpu = Gpu(index=0, uuid="GPU-0", minor=0, name="stand-in", total_mib=1)
    write_lease(tmp_path, new_lease(identity.unit, [gpu], share=False, container=identity.label))
    files = read_leases(tmp_path)
    assert files.unreadable == {}
    (lease,) = files.leases
    assert lease.container == identity.label and lease.unit == f"libpod-{A}.scope"
