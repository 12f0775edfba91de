"""containerd's config.toml with the runtime gpugate (front/install_containers.py and
install_containers.plan_containerd): versions 2 and 3, a GPU node's config (NVIDIA's runtime
as the CRI default), comments, quoting, no trailing newline, a missing file; every variant
installs idempotently, keeps every other setting, and uninstalls to the very bytes it had;
inline tables, version 1, an operator's own gpugate runtime, a hostile file: refused with one
line and nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpugate.compat import tomllib
from gpugate.errors import ExitCode, InstallError
from gpugate.front import install_containers as cc
from gpugate.front.install import Action, apply
from gpugate.front.install_containers import (
    ContainerHost,
    nvidia_in_place,
    plan_containerd,
    plan_record,
)
from gpugate.host import wrapped_runtime

WRAPPER = "/usr/bin/gpugate-oci-runtime"
V2 = ("plugins", "io.containerd.grpc.v1.cri", "containerd")
V3 = ("plugins", "io.containerd.cri.v1.runtime", "containerd")

GPU_NODE_V2 = """\
# containerd on a GPU node (nvidia-ctk runtime configure --set-as-default)
version = 2
oom_score = -999
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"   # kubeadm's
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "nvidia"
      snapshotter = "overlayfs"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
          privileged_without_host_devices = false
          runtime_type = "io.containerd.runc.v2"
          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
            BinaryName = "/usr/bin/nvidia-container-runtime"
            SystemdCgroup = true
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
          runtime_type = "io.containerd.runc.v2"
          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
            SystemdCgroup = true
"""

V3_RUNC = """\
version = 3
[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes]
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
          runtime_type = 'io.containerd.runc.v2'
          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
            SystemdCgroup = true
            NoNewKeyring = false
  [plugins.'io.containerd.grpc.v1.cri']
    [plugins.'io.containerd.grpc.v1.cri'.registry]
      config_path = '/etc/containerd/certs.d'
"""

MINIMAL = "version = 2\n"
NO_EOL = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "pause:3.9"'
SPACED = """\
version = 2
[ plugins . "io.containerd.grpc.v1.cri" . containerd ]
  # the runtime the kubelet gets when a pod names none
  default_runtime_name="runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = false
    Root = "/run/containerd/runc"
"""
KATA_DEFAULT = """\
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "kata"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]
  runtime_type = "io.containerd.kata.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true
"""
VARIANTS = {
    "gpu-node-v2": (GPU_NODE_V2, V2),
    "v3": (V3_RUNC, V3),
    "minimal": (MINIMAL, V2),
    "no-eol": (NO_EOL, V2),
    "spaced-and-commented": (SPACED, V2),
    "kata-default": (KATA_DEFAULT, V2),
}
PATH = Path("/etc/containerd/config.toml")


def no_default() -> str:
    raise AssertionError("the file exists: containerd's default is not asked for")


def install(text: str | None, *, default: bool = False) -> tuple[str, str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cc, "containerd_default_config", no_default)
        return cc.installed(text, WRAPPER, path=PATH, default=default)


def at(data: dict[str, object], keys: tuple[str, ...]) -> dict[str, object]:
    return cc.table_at(data, keys)


@pytest.mark.parametrize("default", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_install_adds_only_the_runtime_and_uninstall_restores_the_bytes(
    variant: str, default: bool
) -> None:
    original, cri = VARIANTS[variant]
    text, _ = install(original, default=default)
    before, after = tomllib.loads(original), tomllib.loads(text)
    runtime = at(after, (*cri, "runtimes", "gpugate"))
    assert isinstance(runtime, dict)
    assert runtime["runtime_type"] == "io.containerd.runc.v2"
    assert runtime["options"]["BinaryName"] == WRAPPER
    wanted = "gpugate" if default else at(before, cri).get("default_runtime_name")
    assert at(after, cri).get("default_runtime_name") == wanted
    assert default or text.startswith(original)  # appended: not a byte before it moves
    assert install(text, default=default)[0] == text  # idempotent
    assert cc.uninstalled(text, path=PATH) == original
    assert cc.uninstalled(original, path=PATH) == original


def test_a_gpu_node_keeps_nvidia_s_runtime_in_the_chain(
    tmp_path: Path, nvidia_installed: Path
) -> None:
    text, wrapped = install(GPU_NODE_V2, default=True)
    assert wrapped == "nvidia"
    data = tomllib.loads(text)
    runtime = at(data, (*V2, "runtimes", "gpugate"))
    assert runtime == {
        "runtime_type": "io.containerd.runc.v2",
        "privileged_without_host_devices": False,
        "options": {"BinaryName": WRAPPER, "SystemdCgroup": True},
    }
    nvidia = at(data, (*V2, "runtimes", "nvidia"))
    assert nvidia["options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"  # type: ignore[index]
    assert data["oom_score"] == -999
    assert data["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"].endswith("pause:3.9")
    config = tmp_path / "config.toml"
    config.write_text(text)
    assert nvidia_in_place(ContainerHost(containerd_config=config))
    config.write_text(text.replace("/usr/bin/nvidia-container-runtime", "/usr/bin/runc"))
    assert not nvidia_in_place(ContainerHost(containerd_config=config))


def test_a_default_that_is_not_runc_s_shim_is_not_copied() -> None:
    _, wrapped = install(KATA_DEFAULT)
    assert wrapped == "runc"


def test_v3_options_are_runc_s() -> None:
    text, _ = install(V3_RUNC)
    options = at(tomllib.loads(text), (*V3, "runtimes", "gpugate", "options"))
    assert options == {"SystemdCgroup": True, "NoNewKeyring": False, "BinaryName": WRAPPER}


def test_a_missing_file_is_containerd_s_default_and_uninstall_removes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cc, "containerd_default_config", lambda: GPU_NODE_V2)
    made, _ = cc.installed(None, WRAPPER, path=PATH, default=True)
    assert made.startswith(cc.MADE)
    assert at(tomllib.loads(made), V2)["default_runtime_name"] == "gpugate"  # type: ignore[index]
    assert install(made, default=True)[0] == made
    assert cc.uninstalled(made, path=PATH) is None
    edited = made.replace("oom_score = -999", "oom_score = -500")
    kept = cc.uninstalled(edited, path=PATH)
    assert kept == GPU_NODE_V2.replace("oom_score = -999", "oom_score = -500")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "INSTALL_CONTAINERD_VERSION"),
        ("version = 1\n", "INSTALL_CONTAINERD_VERSION"),
        ('version = "2"\n', "INSTALL_CONTAINERD_VERSION"),
        ("version = true\n", "INSTALL_CONTAINERD_VERSION"),
        ("version = 2\n[plugins\n", "INSTALL_NOT_TOML"),
        (
            'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
            'runtimes = { runc = { runtime_type = "io.containerd.runc.v2" } }\n',
            "INSTALL_CONTAINERD_EDIT",
        ),
        (
            'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n'
            'containerd.runtimes.runc.runtime_type = "io.containerd.runc.v2"\n',
            "INSTALL_CONTAINERD_EDIT",
        ),
        (
            'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpugate]\n'
            'runtime_type = "io.containerd.runc.v2"\n',
            "INSTALL_CONTAINERD_RUNTIME_THERE",
        ),
        (f"version = 2\n{cc.BEGIN}\n", "INSTALL_MARK_UNCLOSED"),
    ],
)
def test_a_config_it_cannot_edit_by_table_is_refused(text: str, problem: str) -> None:
    with pytest.raises(InstallError) as caught:
        install(text, default=True)
    assert caught.value.exit_code == ExitCode.INSTALL
    message = caught.value.message
    assert "\n" not in message and str(PATH) in message


def test_uninstall_refuses_while_the_operator_made_gpugate_the_default() -> None:
    text, _ = install(GPU_NODE_V2)
    by_hand = text.replace('default_runtime_name = "nvidia"', 'default_runtime_name = "gpugate"')
    with pytest.raises(InstallError):
        cc.uninstalled(by_hand, path=PATH)


def test_lines_the_operator_added_after_install_are_kept_by_uninstall() -> None:
    text, _ = install(GPU_NODE_V2, default=True)
    later = text + '[plugins."io.containerd.grpc.v1.cri".registry]\n  config_path = "/x"\n'
    assert cc.uninstalled(later, path=PATH) == GPU_NODE_V2 + (
        '[plugins."io.containerd.grpc.v1.cri".registry]\n  config_path = "/x"\n'
    )


# The whole of install --containers for containerd: files read, written, modes kept.


@pytest.fixture
def host(tmp_path: Path) -> ContainerHost:
    etc = tmp_path / "etc"
    (etc / "containerd").mkdir(parents=True)
    return ContainerHost(
        containerd_config=etc / "containerd" / "config.toml",
        runtime_record=etc / "gpugate" / "oci-runtime.toml",
    )


class _Sink:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def run(host: ContainerHost, *, install: bool, default: bool = False) -> list[Action]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cc, "containerd_default_config", lambda: GPU_NODE_V2)
        changes = plan_containerd(host, WRAPPER, install=install, default=default)
    changes += plan_record(host, install=install, nvidia=nvidia_in_place(host) and install)
    apply(changes, reload=lambda: False, out=_Sink())
    return [c.action for c in changes]


@pytest.fixture
def nvidia_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    program = tmp_path / "usr" / "bin" / "nvidia-container-runtime"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    paths = {**wrapped_runtime.PATHS, wrapped_runtime.NVIDIA: (str(program),)}
    monkeypatch.setattr(wrapped_runtime, "PATHS", paths)
    return program


def test_install_on_a_gpu_node_records_nvidia_and_uninstall_restores_all(
    host: ContainerHost, nvidia_installed: Path
) -> None:
    config = host.containerd_config
    assert config is not None
    config.write_text(GPU_NODE_V2)
    config.chmod(0o600)
    assert run(host, install=True, default=True) == [Action.WRITE, Action.WRITE]
    assert wrapped_runtime.read_record(host.runtime_record) == wrapped_runtime.NVIDIA
    assert os.stat(config).st_mode & 0o777 == 0o600
    assert run(host, install=True, default=True) == [Action.UNCHANGED, Action.UNCHANGED]
    assert run(host, install=False) == [Action.WRITE, Action.REMOVE]
    assert config.read_text() == GPU_NODE_V2
    assert not host.runtime_record.exists()
    assert run(host, install=False) == [Action.UNCHANGED, Action.ABSENT]


def test_without_nvidia_s_program_the_record_is_runc(host: ContainerHost) -> None:
    assert host.containerd_config is not None
    host.containerd_config.write_text(GPU_NODE_V2)
    run(host, install=True)
    assert wrapped_runtime.read_record(host.runtime_record) in (
        wrapped_runtime.RUNC,
        # this machine has NVIDIA's runtime at its fixed path
        wrapped_runtime.NVIDIA if wrapped_runtime.find(wrapped_runtime.NVIDIA) else None,
    )


def test_a_missing_config_is_made_and_removed_again(host: ContainerHost) -> None:
    config = host.containerd_config
    assert config is not None
    assert run(host, install=True)[0] is Action.WRITE
    assert config.read_text().startswith(cc.MADE)
    assert run(host, install=False)[0] is Action.REMOVE
    assert not config.exists() and config.parent.is_dir()


@pytest.mark.parametrize("mode", [0o664, 0o666])
def test_a_config_others_may_write_is_refused(host: ContainerHost, mode: int) -> None:
    config = host.containerd_config
    assert config is not None
    config.write_text(GPU_NODE_V2)
    config.chmod(mode)
    with pytest.raises(InstallError):
        run(host, install=True)
    assert config.read_text() == GPU_NODE_V2 and not host.runtime_record.exists()


@pytest.mark.root("chown to another account")
def test_a_config_of_another_account_is_refused(host: ContainerHost) -> None:
    config = host.containerd_config
    assert config is not None
    config.write_text(GPU_NODE_V2)
    os.chown(config, 1000, 1000)
    with pytest.raises(InstallError):
        run(host, install=True)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_a_config_that_is_no_regular_file_is_refused(host: ContainerHost, kind: str) -> None:
    config = host.containerd_config
    assert config is not None
    if kind == "symlink":
        (config.parent / "real.toml").write_text(GPU_NODE_V2)
        config.symlink_to("real.toml")
    elif kind == "fifo":
        os.mkfifo(config, 0o644)
    else:
        config.mkdir()
    with pytest.raises(InstallError):
        run(host, install=True)
    assert not host.runtime_record.exists()


@pytest.mark.parametrize(
    ("daemon", "nvidia"),
    [
        ({"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}, True),
        (
            {
                "default-runtime": "nvidia",
                "runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}},
            },
            True,
        ),
        ({"runtimes": {"other": {"path": "/usr/bin/crun"}}}, False),
        ({}, False),
    ],
)
def test_docker_s_nvidia_runtime_is_recorded_where_it_is_set_up(
    tmp_path: Path, nvidia_installed: Path, daemon: dict[str, object], nvidia: bool
) -> None:
    import json

    host = ContainerHost(
        daemon_json=tmp_path / "daemon.json", runtime_record=tmp_path / "gpugate" / "rec.toml"
    )
    host.daemon_json.write_text(json.dumps(daemon))  # type: ignore[union-attr]
    assert nvidia_in_place(host) is nvidia
    apply(plan_record(host, install=True, nvidia=nvidia_in_place(host)), out=_Sink())
    wanted = wrapped_runtime.NVIDIA if nvidia else wrapped_runtime.RUNC
    assert wrapped_runtime.read_record(host.runtime_record) == wanted


def test_nvidia_registered_but_not_installed_is_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = {**wrapped_runtime.PATHS, wrapped_runtime.NVIDIA: (str(tmp_path / "none"),)}
    monkeypatch.setattr(wrapped_runtime, "PATHS", paths)
    host = ContainerHost(containerd_config=tmp_path / "config.toml")
    host.containerd_config.write_text(GPU_NODE_V2)  # type: ignore[union-attr]
    assert nvidia_in_place(host) is False
