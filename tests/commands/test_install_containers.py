"""`gpugate install|uninstall --containers`: hooks.d files and docker's daemon.json in many
shapes (keys kept, other runtimes, invalid JSON refused with one line), idempotent both
ways; and the runtime wrapper's reading of runc's command line and the spec it edits."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from gpugate.errors import BadInput, ExitCode, InstallError
from gpugate.front.commands.oci_runtime import bundle_of, command_of, with_hooks
from gpugate.front.install import Action, Change, apply
from gpugate.front.install_containers import (
    HOOK_FILES,
    ContainerHost,
    hook_file,
    plan_daemon_json,
    plan_hooks,
    podman_hooks_dirs,
)

GPUGATE = "/usr/bin/gpugate"
WRAPPER = "/usr/bin/gpugate-oci-runtime"


def install(host: ContainerHost, *, force: bool = False) -> list[tuple[Action, str]]:
    changes = plan_hooks(host, GPUGATE, install=True, force=force)
    changes += plan_daemon_json(host, WRAPPER, install=True)
    return _applied(changes)


def uninstall(host: ContainerHost, *, force: bool = False) -> list[tuple[Action, str]]:
    changes = plan_hooks(host, GPUGATE, install=False, force=force)
    changes += plan_daemon_json(host, WRAPPER, install=False)
    return _applied(changes)


def _applied(changes: list) -> list[tuple[Action, str]]:  # type: ignore[type-arg]
    apply(changes, reload=lambda: False, out=_Sink())
    return [(c.action, c.path.name) for c in changes]


class _Sink:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@pytest.fixture
def host(tmp_path: Path) -> ContainerHost:
    return ContainerHost((tmp_path / "hooks.d",), tmp_path / "docker" / "daemon.json")


def daemon(host: ContainerHost) -> dict[str, object]:
    assert host.daemon_json is not None
    data: dict[str, object] = json.loads(host.daemon_json.read_text())
    return data


DAEMON_SHAPES = [
    {},
    {"storage-driver": "vfs", "exec-opts": ["native.cgroupdriver=systemd"], "bridge": "none"},
    {"runtimes": {"nvidia": {"path": "nvidia-container-runtime", "runtimeArgs": []}}},
    {
        "default-runtime": "nvidia",
        "runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}},
    },
    {"log-opts": {"max-size": "10m"}, "features": {"buildkit": True}, "registry-mirrors": ["x"]},
    {"runtimes": {}},
    {"runtimes": {"gpugate": {"path": "/old/gpugate-oci-runtime"}}},
]


@pytest.mark.parametrize("before", DAEMON_SHAPES)
def test_daemon_json_keeps_every_key_and_gains_the_runtime(
    host: ContainerHost, before: dict[str, object]
) -> None:
    assert host.daemon_json is not None
    host.daemon_json.parent.mkdir()
    host.daemon_json.write_text(json.dumps(before))
    install(host)
    after = daemon(host)
    for key, value in before.items():
        if key != "runtimes":
            assert after[key] == value
    runtimes = after["runtimes"]
    assert isinstance(runtimes, dict)
    assert runtimes["gpugate"] == {"path": WRAPPER}
    for name, entry in dict(before.get("runtimes", {})).items():  # type: ignore[call-overload]
        if name != "gpugate":
            assert runtimes[name] == entry
    # Again: nothing changes.
    text = host.daemon_json.read_text()
    assert (Action.UNCHANGED, "daemon.json") in install(host)
    assert host.daemon_json.read_text() == text
    # Uninstall: what was there before, less gpugate's runtime.
    uninstall(host)
    expected = {k: v for k, v in before.items() if k != "runtimes"}
    others = {k: v for k, v in dict(before.get("runtimes", {})).items() if k != "gpugate"}  # type: ignore[call-overload]
    if others:
        expected["runtimes"] = others
    assert daemon(host) == expected
    assert (Action.UNCHANGED, "daemon.json") in uninstall(host)


def test_absent_daemon_json_is_made(host: ContainerHost) -> None:
    install(host)
    assert daemon(host) == {"runtimes": {"gpugate": {"path": WRAPPER}}}
    uninstall(host)
    assert daemon(host) == {}


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("{", id="not valid JSON"),
        pytest.param('{"a": 1,}', id="a trailing comma"),
        pytest.param("[1, 2]", id="a list"),
        pytest.param('"runtimes"', id="a string"),
        pytest.param('{"runtimes": ["gpugate"]}', id="runtimes a list"),
        pytest.param('{"runtimes": "x"}', id="runtimes a string"),
        pytest.param(b"\xff\xfe{}".decode("latin-1"), id="not UTF-8"),
    ],
)
def test_bad_daemon_json_is_refused_with_one_line_and_nothing_changes(
    host: ContainerHost, text: str
) -> None:
    assert host.daemon_json is not None
    host.daemon_json.parent.mkdir()
    host.daemon_json.write_text(text)
    with pytest.raises(InstallError) as caught:
        install(host)
    assert str(host.daemon_json) in caught.value.message
    assert "\n" not in caught.value.message
    assert caught.value.exit_code is ExitCode.INSTALL
    assert host.daemon_json.read_text() == text
    assert not host.hooks_dirs[0].exists(), "a hook file was written before the refusal"


def test_uninstall_refuses_while_gpugate_is_the_default_runtime(host: ContainerHost) -> None:
    assert host.daemon_json is not None
    install(host)
    data = daemon(host)
    data["default-runtime"] = "gpugate"
    text = json.dumps(data)
    host.daemon_json.write_text(text)
    hooks = sorted(path.name for path in host.hooks_dirs[0].iterdir())
    with pytest.raises(InstallError) as refused:
        uninstall(host)
    assert refused.value.exit_code is ExitCode.INSTALL
    assert host.daemon_json.read_text() == text, "daemon.json changed by a refused uninstall"
    assert sorted(path.name for path in host.hooks_dirs[0].iterdir()) == hooks


def test_hook_files_idempotent_and_removed(host: ContainerHost) -> None:
    first = install(host)
    assert sorted(first) == sorted((Action.WRITE, n) for n in [*HOOK_FILES, "daemon.json"])
    folder = host.hooks_dirs[0]
    start = json.loads((folder / "gpugate-start.json").read_text())
    assert start == {
        "version": "1.0.0",
        "hook": {"path": GPUGATE, "args": ["gpugate", "oci-hook", "createRuntime"]},
        "when": {"always": True},
        "stages": ["createRuntime"],
    }
    stop = json.loads((folder / "gpugate-stop.json").read_text())
    assert stop["stages"] == ["poststop"] and stop["hook"]["args"][-1] == "poststop"
    assert all(a is Action.UNCHANGED for a, _ in install(host))
    uninstall(host)
    assert not any(folder.glob("gpugate-*.json"))
    assert all(a in (Action.ABSENT, Action.UNCHANGED) for a, _ in uninstall(host))


def test_an_older_gpugate_hook_is_replaced(host: ContainerHost) -> None:
    folder = host.hooks_dirs[0]
    folder.mkdir()
    old = hook_file("/opt/old/bin/gpugate", "createRuntime")
    (folder / "gpugate-start.json").write_text(old)
    install(host)
    assert json.loads((folder / "gpugate-start.json").read_text())["hook"]["path"] == GPUGATE


def test_the_operators_own_file_is_kept_without_force(host: ContainerHost) -> None:
    folder = host.hooks_dirs[0]
    folder.mkdir()
    (folder / "gpugate-start.json").write_text('{"hook": {"path": "/usr/local/bin/mine"}}')
    with pytest.raises(InstallError):
        install(host)
    with pytest.raises(InstallError):
        uninstall(host)
    install(host, force=True)
    assert "oci-hook" in (folder / "gpugate-start.json").read_text()


def test_dry_run_writes_nothing(host: ContainerHost) -> None:
    changes = plan_hooks(host, GPUGATE, install=True, force=False)
    changes += plan_daemon_json(host, WRAPPER, install=True)
    apply(changes, dry_run=True, reload=lambda: False, out=_Sink())
    assert all(c.action is Action.WRITE for c in changes)
    assert not host.hooks_dirs[0].exists()
    assert host.daemon_json is not None and not host.daemon_json.exists()


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        (None, "/usr/share/containers/oci/hooks.d"),
        ('[engine]\nhooks_dir = ["/etc/containers/oci/hooks.d"]\n', "/etc/containers/oci/hooks.d"),
        ('[engine]\nhooks_dir = ["/a", "/b"]\n', "/a"),
        ("[engine]\nhooks_dir = []\n", "/usr/share/containers/oci/hooks.d"),
        ("[containers]\nlog_size_max = 1\n", "/usr/share/containers/oci/hooks.d"),
    ],
)
def test_podman_hooks_folder_follows_containers_conf(
    tmp_path: Path, conf: str | None, expected: str
) -> None:
    path = tmp_path / "containers.conf"
    if conf is not None:
        path.write_text(conf)
    assert podman_hooks_dirs([path]) == [Path(expected)]


def test_unreadable_containers_conf_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "containers.conf"
    path.write_text("[engine\n")
    with pytest.raises(InstallError):
        podman_hooks_dirs([path])


# ---- the runtime wrapper ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["create", "--bundle", "/b", "id"], "create"),
        (["--root", "/run/runc", "--log", "/l", "--log-format", "json", "create", "id"], "create"),
        (["--root=/run/runc", "--systemd-cgroup", "start", "id"], "start"),
        (["--debug", "--log", "create", "delete", "id"], "delete"),
        (["--version"], None),
        ([], None),
    ],
)
def test_runc_command_found_past_global_options(argv: list[str], command: str | None) -> None:
    assert command_of(argv)[0] == command


@pytest.mark.parametrize(
    ("args", "bundle"),
    [
        (["--bundle", "/b", "id"], "/b"),
        (["-b", "/b", "id"], "/b"),
        (["--bundle=/b", "id"], "/b"),
        (["--pid-file", "/p", "id"], None),
    ],
)
def test_create_bundle(
    args: list[str], bundle: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert bundle_of(args) == (bundle or str(tmp_path))


def gpu_spec(env: list[str], hooks: object = None, device: bool = False) -> dict[str, object]:
    nodes = [{"path": "/dev/gpu", "type": "c", "major": 195, "minor": 0}] if device else []
    spec: dict[str, object] = {"process": {"env": env}, "linux": {"devices": nodes}}
    if hooks is not None:
        spec["hooks"] = hooks
    return spec


def test_wrapper_adds_hooks_only_to_gpu_containers() -> None:
    plain = gpu_spec(["PATH=/bin"])
    assert not with_hooks(plain, GPUGATE) and "hooks" not in plain
    nvidia = [{"path": "/usr/bin/nvidia-container-runtime-hook"}]
    assert not with_hooks(gpu_spec(["NVIDIA_VISIBLE_DEVICES=all"]), GPUGATE), "no NVIDIA hook"
    spec = gpu_spec(["NVIDIA_VISIBLE_DEVICES=1"], {"prestart": list(nvidia)})
    assert with_hooks(spec, GPUGATE)
    hooks = spec["hooks"]
    assert isinstance(hooks, dict)
    assert hooks["prestart"] == nvidia
    assert hooks["createRuntime"] == [
        {"path": GPUGATE, "args": ["gpugate", "oci-hook", "createRuntime"]}
    ]
    assert hooks["poststop"][-1]["args"][-1] == "poststop"
    assert not with_hooks(spec, GPUGATE), "added twice"


def test_wrapper_refuses_a_spec_whose_hooks_it_cannot_extend() -> None:
    with pytest.raises(BadInput):
        with_hooks(gpu_spec([], hooks=[1], device=True), GPUGATE)
    with pytest.raises(BadInput):
        with_hooks(gpu_spec([], hooks={"poststop": "x"}, device=True), GPUGATE)


def test_the_packages_hook_files_are_what_install_writes() -> None:
    packaged = Path(__file__).resolve().parents[2] / "packaging" / "oci"
    for name, stage in HOOK_FILES.items():
        assert (packaged / name).read_text() == hook_file(GPUGATE, stage), name


@pytest.mark.parametrize(
    "argv",
    [
        ["install"],
        ["uninstall"],
        ["install", "vllm.service", "--containers"],
        ["uninstall", "vllm.service", "--containers"],
    ],
)
def test_install_takes_a_unit_or_containers(argv: list[str]) -> None:
    from gpugate.front.cli import main

    assert main(argv) == ExitCode.USAGE


def test_a_venv_gpugate_runs_isolated_in_the_hook(host: ContainerHost) -> None:
    """A console script's shebang lacks -I: the hook runs its interpreter -I -m gpugate."""
    command = ("/opt/gpugate/bin/python3", "-I", "-m", "gpugate")
    changes = plan_hooks(host, command, install=True, force=False)
    _applied(changes)
    start = json.loads((host.hooks_dirs[0] / "gpugate-start.json").read_text())
    assert start["hook"] == {
        "path": "/opt/gpugate/bin/python3",
        "args": ["python3", "-I", "-m", "gpugate", "oci-hook", "createRuntime"],
    }
    # Recognised as gpugate's: a later install replaces it, uninstall removes it.
    assert all(a is Action.WRITE for a, _ in install(host))
    uninstall(host)
    assert not any(host.hooks_dirs[0].glob("gpugate-*.json"))


def test_wrapper_hooks_with_a_command() -> None:
    spec = gpu_spec([], device=True)
    assert with_hooks(spec, ("/usr/bin/python3", "-I", "-m", "gpugate"))
    hooks = spec["hooks"]
    assert isinstance(hooks, dict)
    assert hooks["createRuntime"][0]["args"] == [
        "python3", "-I", "-m", "gpugate", "oci-hook", "createRuntime",
    ]  # fmt: skip


@pytest.mark.message
def test_the_daemon_json_notes_are_worded_with_the_runtimes_path() -> None:
    wrapper = "/usr/bin/gpugate-oci-runtime"
    daemon_json = Path("/etc/docker/daemon.json")
    out = io.StringIO()
    apply(
        [Change(daemon_json, Action.WRITE, None, "runtime-added", detail=wrapper)],
        dry_run=True,
        out=out,
    )
    assert out.getvalue() == (
        f"would write /etc/docker/daemon.json (runtime gpugate: {wrapper}; every other key kept)\n"
    )
    out = io.StringIO()
    apply([Change(Path("/x"), Action.UNCHANGED, None, "runtime-absent")], out=out)
    assert out.getvalue() == "unchanged /x (no runtime gpugate)\n"
