"""`gpugate install|uninstall --containers`: gpugate's OCI hook where the host's container
runtimes find it (docs/containers.md).

- podman (and CRI-O) read hook files from hooks.d folders: `gpugate-start.json`
  (createRuntime) and `gpugate-stop.json` (poststop) go in the folder the host's podman reads
  (containers.conf's `hooks_dir`, else /usr/share/containers/oci/hooks.d) and CRI-O's
  (/etc/containers/oci/hooks.d), where those runtimes are installed;
- docker runs only the hooks in a container's spec: a runtime named `gpugate` in
  /etc/docker/daemon.json (every other key kept as it is), the wrapper that adds them, then
  `systemctl reload docker` where docker runs.

Each change is planned first (install.Change), then applied and said; a second install
changes nothing. A file of the operator's (not gpugate's hook) is not replaced without
--force; a daemon.json that is not a JSON object stops the install before anything changes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpugate.compat import tomllib
from gpugate.errors import GateError, InstallError
from gpugate.front import containerd_config
from gpugate.front.install import Action, Change
from gpugate.host import wrapped_runtime
from gpugate.host.safe_files import find_program, run_program

PODMAN_HOOKS = Path("/usr/share/containers/oci/hooks.d")
CRIO_HOOKS = Path("/etc/containers/oci/hooks.d")
CONTAINERS_CONFS = (
    Path("/etc/containers/containers.conf"),
    Path("/usr/share/containers/containers.conf"),
)
DAEMON_JSON = Path("/etc/docker/daemon.json")
RUNTIME_NAME = "gpugate"
WRAPPER = "gpugate-oci-runtime"
HOOK_FILES = {"gpugate-start.json": "createRuntime", "gpugate-stop.json": "poststop"}
RELOAD_TIMEOUT_S = 60


@dataclass(frozen=True)
class ContainerHost:
    """What the host has, and where things go; tests point these elsewhere."""

    hooks_dirs: tuple[Path, ...] = ()  # where podman / CRI-O read hook files
    daemon_json: Path | None = None  # docker's, where docker is installed
    notes: list[str] = field(default_factory=list)
    containerd_config: Path | None = None  # containerd's config.toml, where it is installed
    runtime_record: Path = wrapped_runtime.RECORD  # what gpugate-oci-runtime runs


def detect(root: Path = Path("/")) -> ContainerHost:
    """The runtimes installed here: podman's hooks folders, CRI-O's, docker's daemon.json."""
    dirs: list[Path] = []
    if find_program("podman") is not None:
        dirs.extend(podman_hooks_dirs(CONTAINERS_CONFS))
    if find_program("crio") is not None and CRIO_HOOKS not in dirs:
        dirs.append(CRIO_HOOKS)
    docker = find_program("dockerd") is not None
    containerd = containerd_config.CONFIG if find_program("containerd") else None
    return ContainerHost(tuple(dirs), DAEMON_JSON if docker else None, containerd_config=containerd)


def podman_hooks_dirs(confs: Sequence[Path]) -> list[Path]:
    """containers.conf's [engine] hooks_dir (the first file that sets it), else podman's
    built-in folder."""
    for conf in confs:
        try:
            data = tomllib.loads(conf.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise InstallError(f"{conf}: cannot be read as TOML ({exc}); nothing changed") from None
        engine = data.get("engine")
        hooks = engine.get("hooks_dir") if isinstance(engine, dict) else None
        if isinstance(hooks, list) and hooks and all(isinstance(h, str) for h in hooks):
            return [Path(hooks[0])]
    return [PODMAN_HOOKS]


def hook_args(command: Sequence[str], stage: str) -> list[str]:
    """The hook's argv: this very gpugate (front/self_command.py: isolated), `oci-hook STAGE`."""
    return [os.path.basename(command[0]), *command[1:], "oci-hook", stage]


def hook_file(gpugate: str | Sequence[str], stage: str) -> str:
    """oci-hooks(5), version 1.0.0: every container, at one stage (the hook itself leaves a
    container without GPUs at once). gpugate: a path, or the command that runs it."""
    command = (gpugate,) if isinstance(gpugate, str) else tuple(gpugate)
    body = {
        "version": "1.0.0",
        "hook": {"path": command[0], "args": hook_args(command, stage)},
        "when": {"always": True},
        "stages": [stage],
    }
    return json.dumps(body, indent=2) + "\n"


def is_our_hook(path: Path) -> bool:
    """A hook file gpugate wrote (any version, any path to gpugate)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        args = data["hook"]["args"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(args, list) and "oci-hook" in args and "gpugate" in str(args)


def plan_hooks(
    host: ContainerHost, gpugate: str | Sequence[str], *, install: bool, force: bool
) -> list[Change]:
    changes: list[Change] = []
    for folder in host.hooks_dirs:
        for name, stage in HOOK_FILES.items():
            path = folder / name
            text = hook_file(gpugate, stage)
            exists = path.exists()
            ours = is_our_hook(path)
            if exists and not ours and not force:
                raise InstallError(
                    f"{path}: not gpugate's hook file; nothing changed; --force replaces it"
                )
            if install:
                same = exists and _read(path) == text
                changes.append(Change(path, Action.UNCHANGED if same else Action.WRITE, text))
            else:
                changes.append(Change(path, Action.REMOVE if exists else Action.ABSENT))
    return changes


def read_daemon_json(path: Path) -> dict[str, object]:
    """docker's daemon.json as an object ({} where absent); InstallError where it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise InstallError(f"{path}: cannot read it ({exc}); nothing changed") from None
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        where = f"line {exc.lineno}" if hasattr(exc, "lineno") else "it"
        raise InstallError(f"{path}: not valid JSON ({where}); nothing changed") from None
    if not isinstance(data, dict):
        raise InstallError(f"{path}: not a JSON object; nothing changed")
    runtimes = data.get("runtimes", {})
    if not isinstance(runtimes, dict):
        raise InstallError(f"{path}: runtimes: not a JSON object; nothing changed")
    return data


def plan_daemon_json(host: ContainerHost, wrapper: str, *, install: bool) -> list[Change]:
    path = host.daemon_json
    if path is None:
        return []
    data = read_daemon_json(path)
    runtimes = dict(data.get("runtimes", {}))  # type: ignore[call-overload]
    wanted = {"path": wrapper}
    if install:
        if runtimes.get(RUNTIME_NAME) == wanted:
            return [Change(path, Action.UNCHANGED, note="runtime-there")]
        runtimes[RUNTIME_NAME] = wanted
        data["runtimes"] = runtimes
        text = json.dumps(data, indent=2) + "\n"
        return [Change(path, Action.WRITE, text, "runtime-added", detail=wrapper)]
    if RUNTIME_NAME not in runtimes:
        return [Change(path, Action.UNCHANGED, note="runtime-absent")]
    if data.get("default-runtime") == RUNTIME_NAME:
        raise InstallError(
            f'{path}: "default-runtime" is {RUNTIME_NAME}: set another first; nothing changed'
        )
    del runtimes[RUNTIME_NAME]
    if runtimes:
        data["runtimes"] = runtimes
    else:
        data.pop("runtimes", None)
    return [Change(path, Action.WRITE, json.dumps(data, indent=2) + "\n", "runtime-removed")]


def containerd_default_config() -> str:
    """`containerd config default`: the config containerd runs with where the file is missing."""
    containerd = find_program("containerd")
    path = containerd_config.CONFIG
    if containerd is None:
        raise InstallError(
            f"{path} is missing and `containerd config default` failed: no containerd in the "
            "system folders; nothing changed"
        )
    try:
        result = run_program([containerd, "config", "default"], RELOAD_TIMEOUT_S)
    except GateError as exc:
        raise InstallError(
            f"{path} is missing and `containerd config default` failed: "
            + (f"{exc}" if exc else "")
            + "; nothing changed"
        ) from None
    if result.returncode != 0:
        said = result.first_line()
        raise InstallError(
            f"{path} is missing and `containerd config default` failed: "
            + f"{said}"
            + "; nothing changed"
        )
    return result.stdout


def plan_containerd(
    host: ContainerHost,
    wrapper: str,
    *,
    install: bool,
    default: bool = False,
    default_config: Callable[[], str] = containerd_default_config,
) -> list[Change]:
    """containerd's config with (or without) the runtime gpugate."""
    path = host.containerd_config
    if path is None:
        return []
    current = containerd_config.read_text(path)
    if not install:
        if current is None:
            return [Change(path, Action.ABSENT)]
        text = containerd_config.uninstalled(current, path=path)
        if text is None:
            return [Change(path, Action.REMOVE, note="containerd-made", keep_folder=True)]
        if text == current:
            return [Change(path, Action.UNCHANGED, note="runtime-absent")]
        return [Change(path, Action.WRITE, text, "containerd-runtime-removed")]
    text, wrapped = containerd_config.installed(
        current, wrapper, path=path, default=default, default_config=default_config
    )
    if text == current:
        return [Change(path, Action.UNCHANGED, note="runtime-there")]
    note = "containerd-runtime-default" if default else "containerd-runtime-added"
    return [Change(path, Action.WRITE, text, note, detail=wrapped.name)]


def uses_wrapper(host: ContainerHost) -> bool:
    return host.daemon_json is not None or host.containerd_config is not None


def nvidia_in_place(host: ContainerHost) -> bool:
    """NVIDIA's runtime installed at its fixed path and set up as a runtime of docker's or of
    containerd's CRI plugin (gpugate's own runtime aside)."""
    if wrapped_runtime.find(wrapped_runtime.NVIDIA) is None:
        return False
    programs: list[str] = []
    if host.daemon_json is not None:
        runtimes = read_daemon_json(host.daemon_json).get("runtimes", {})
        for entry in runtimes.values() if isinstance(runtimes, dict) else ():
            programs.append(str(entry.get("path", "")) if isinstance(entry, dict) else "")
    if host.containerd_config is not None:
        text = containerd_config.read_text(host.containerd_config)
        if text is not None:
            data = containerd_config.parse(text, host.containerd_config)
            programs += containerd_config.nvidia_binaries(data)
    return any(os.path.basename(p) == wrapped_runtime.NVIDIA for p in programs)


def plan_record(host: ContainerHost, *, install: bool, nvidia: bool) -> list[Change]:
    """The record of what gpugate-oci-runtime runs, where docker or containerd use it."""
    if host.daemon_json is None and host.containerd_config is None:
        return []
    path = host.runtime_record
    if not install:
        return [Change(path, Action.REMOVE if path.exists() else Action.ABSENT)]
    name = wrapped_runtime.NVIDIA if nvidia else wrapped_runtime.RUNC
    text = wrapped_runtime.record_text(name)
    same = _read(path) == text
    return [Change(path, Action.UNCHANGED if same else Action.WRITE, text, "runs", detail=name)]


def wrapper_beside(gpugate: str) -> str:
    """gpugate-oci-runtime from the same installation as gpugate (a venv's bin/, /usr/bin)."""
    for folder in (Path(gpugate).parent, Path(os.path.realpath(gpugate)).parent):
        candidate = folder / WRAPPER
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise InstallError(f"no {WRAPPER} beside {gpugate}: install gpugate's package whole")


def reload_docker() -> str:
    """`systemctl reload docker` where docker runs; what was done, in words."""
    systemctl = find_program("systemctl")
    if systemctl is None:
        return "docker not reloaded (no systemctl): run `systemctl reload docker`"
    try:
        active = run_program([systemctl, "is-active", "--quiet", "docker.service"], 10)
        if active.returncode != 0:
            return "docker is not running: it reads daemon.json when it starts"
        result = run_program([systemctl, "reload", "docker.service"], RELOAD_TIMEOUT_S)
    except GateError as exc:
        raise InstallError(_reload_failed(str(exc))) from None
    if result.returncode != 0:
        raise InstallError(
            _reload_failed(f"`systemctl reload docker` failed: {result.first_line()}")
        )
    return "reloaded docker (systemctl reload docker)"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _reload_failed(detail: str) -> str:
    return f"daemon.json written, but {detail}; run `systemctl reload docker`"
