"""An OCI runtime hook's input: the container's state on stdin and its bundle's config.json.

Both come from the runtime, but what is in them comes from whoever made the container
(its environment, its annotations, its name): read bounded in size and time, parsed without
trusting a field's type, and never more than facts. This module is the hook's fast path
(`gpugate oci-hook` for a container without GPUs ends here), so it imports only the standard
library and `gpugate.errors`.

The container's GPUs (docs/containers.md) are the union of what it can reach:
- `linux.devices` entries `/dev/nvidiaN` (`--device`, CDI specs) and `mounts` of
  `/dev/nvidiaN` (`-v /dev/nvidia1:/dev/nvidia1`): device minors;
- `NVIDIA_VISIBLE_DEVICES` in `process.env`, where NVIDIA's hook is in the spec's hooks
  (`docker --gpus`, nvidia-container-runtime, its hooks.d file: the hook injects what the
  variable names): `all`, indices and/or UUIDs comma-separated; `none`, `void` and an empty
  value request no GPU. The last setting of the variable counts, as for execve. Without
  NVIDIA's hook the variable gives the container nothing (every CUDA image sets `all`).
"""

from __future__ import annotations

import json
import os
import re
import select
import stat
import time

from gpugate.errors import ExitCode, GateError
from gpugate.untrusted import FILE, shown

MAX_STATE_BYTES = 1 << 20  # a state is a few hundred bytes; annotations can add some
MAX_CONFIG_BYTES = 16 << 20  # config.json: tens of KiB usually; a huge env is still bounded
STATE_TIMEOUT_S = 5.0
MAX_FIELD = 256  # characters of an id or a name kept
DEVICE = re.compile(r"/dev/nvidia(\d{1,4})")
CONTAINER_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
NVIDIA_HOOKS = ("nvidia-container-runtime-hook", "nvidia-container-toolkit", "nvidia-ctk")
NO_GPU_VALUES = frozenset({"", "none", "void"})
# Where the runtimes put the container's name (podman, CRI-O, containerd's CRI, nerdctl).
NAME_ANNOTATIONS = (
    "io.podman.annotations.name",
    "io.kubernetes.cri-o.ContainerName",
    "io.kubernetes.cri.container-name",
    "nerdctl/name",
    "io.container.manager.name",
)
POD_ANNOTATIONS = ("io.kubernetes.pod.name", "io.kubernetes.cri.sandbox-name")
MANAGER_ANNOTATIONS = {
    "io.podman.annotations.": "podman",
    "io.kubernetes.cri-o.": "cri-o",
    "io.kubernetes.cri.": "containerd",
    "nerdctl/": "nerdctl",
}


class OciInputError(GateError):
    """The runtime's state or config.json cannot be read as one: the hook fails, the
    container does not start."""

    exit_code = ExitCode.USAGE


class _Record:
    """A small immutable record (dataclasses costs the no-GPU path an import)."""

    __slots__ = ()

    def _values(self) -> tuple[object, ...]:
        names: tuple[str, ...] = self.__slots__
        return tuple(getattr(self, name) for name in names)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Record)
            and type(other) is type(self)
            and (other._values() == self._values())
        )

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        names: tuple[str, ...] = self.__slots__
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in names)
        return f"{type(self).__name__}({shown})"


class GpuRequest(_Record):
    """What the container asks for. Empty: no GPU, the hook has nothing to do."""

    __slots__ = ("all_gpus", "minors", "refs")

    def __init__(
        self, minors: tuple[int, ...] = (), refs: tuple[str, ...] = (), all_gpus: bool = False
    ) -> None:
        self.minors = minors  # from linux.devices /dev/nvidiaN
        self.refs = refs  # from NVIDIA_VISIBLE_DEVICES: indices and UUIDs as written
        self.all_gpus = all_gpus  # NVIDIA_VISIBLE_DEVICES=all

    def __bool__(self) -> bool:
        return bool(self.minors or self.refs or self.all_gpus)


class ContainerState(_Record):
    """The OCI state a hook gets on stdin (runtime-spec's state.json)."""

    __slots__ = ("annotations", "bundle", "id", "pid", "status")

    def __init__(
        self,
        id: str,
        pid: int,  # 0 where the runtime gave none (poststop)
        bundle: str,
        status: str,
        annotations: dict[str, str] | None = None,
    ) -> None:
        self.id = id
        self.pid = pid
        self.bundle = bundle
        self.status = status
        self.annotations = annotations or {}


class ContainerSpec(_Record):
    """What gpugate needs from config.json."""

    __slots__ = ("annotations", "cgroups_path", "gpus", "hostname")

    def __init__(
        self,
        gpus: GpuRequest,
        cgroups_path: str | None,  # linux.cgroupsPath, as the runtime wrote it
        annotations: dict[str, str],
        hostname: str | None,
    ) -> None:
        self.gpus = gpus
        self.cgroups_path = cgroups_path
        self.annotations = annotations
        self.hostname = hostname


def read_stdin_bounded(
    fd: int = 0, limit: int = MAX_STATE_BYTES, timeout_s: float = STATE_TIMEOUT_S
) -> bytes:
    """Everything on fd until end of file: at most limit bytes, within timeout_s."""
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise OciInputError(f"the container state on stdin did not end within {timeout_s:g} s")
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise OciInputError(f"the container state on stdin is over {limit} bytes")
        chunks.append(chunk)


def parse_state(raw: bytes) -> ContainerState:
    data = _json_object(raw, "the container state on stdin")
    container_id = data.get("id")
    if not isinstance(container_id, str) or not CONTAINER_ID.fullmatch(container_id):
        raise OciInputError("the container state on stdin: id: missing or not a container id")
    bundle = data.get("bundle")
    if not isinstance(bundle, str) or not bundle.startswith("/") or "\0" in bundle:
        raise OciInputError("the container state on stdin: bundle: missing or not absolute")
    pid = data.get("pid", 0)
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 1 << 22:
        pid = 0
    status = data.get("status")
    return ContainerState(
        id=container_id,
        pid=pid,
        bundle=bundle,
        status=status[:MAX_FIELD] if isinstance(status, str) else "",
        annotations=_string_map(data.get("annotations")),
    )


def read_config(bundle: str, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """BUNDLE/config.json: a regular file, not a link, in a folder and of an owner that is
    this process's user (root's runtime: root's bundle), not writable by others."""
    euid = os.geteuid()
    try:
        dir_fd = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise OciInputError(
            f"{shown(bundle, FILE)}: the bundle cannot be opened: {exc.strerror}"
        ) from None
    try:
        _check_owner(os.fstat(dir_fd), bundle, euid)
        try:
            # O_NONBLOCK: a FIFO in its place must not stall the container's start.
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open("config.json", flags, dir_fd=dir_fd)
        except OSError as exc:
            raise OciInputError(
                f"{shown(bundle, FILE)}/config.json: cannot be opened: {exc.strerror}"
            ) from None
    finally:
        os.close(dir_fd)
    path = f"{bundle}/config.json"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OciInputError(f"{shown(path, FILE)}: not a regular file")
        _check_owner(info, path, euid)
        chunks: list[bytes] = []
        size = 0
        while size <= limit and (chunk := os.read(fd, 1 << 20)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise OciInputError(f"{shown(path, FILE)}: over {limit} bytes")
    return data


def _check_owner(info: os.stat_result, path: str, euid: int) -> None:
    if info.st_uid != euid:
        raise OciInputError(
            f"{shown(path, FILE)}: owned by uid {info.st_uid}, not by this runtime's user"
        )
    if info.st_mode & 0o022:
        raise OciInputError(f"{shown(path, FILE)}: writable by others than its owner")


def parse_config(raw: bytes, source: str = "config.json") -> ContainerSpec:
    data = _json_object(raw, source)
    linux = data.get("linux")
    linux = linux if isinstance(linux, dict) else {}
    cgroups_path = linux.get("cgroupsPath")
    hostname = data.get("hostname")
    return ContainerSpec(
        gpus=spec_gpu_request(data),
        cgroups_path=cgroups_path if isinstance(cgroups_path, str) else None,
        annotations=_string_map(data.get("annotations")),
        hostname=hostname[:MAX_FIELD] if isinstance(hostname, str) else None,
    )


def spec_gpu_request(spec: dict[str, object]) -> GpuRequest:
    """A parsed config.json's GPUs (module docstring)."""
    linux = spec.get("linux")
    process = spec.get("process")
    return gpu_request(
        linux.get("devices") if isinstance(linux, dict) else None,
        process.get("env") if isinstance(process, dict) else None,
        mounts=spec.get("mounts"),
        env_counts=has_nvidia_hook(spec.get("hooks")),
    )


def has_nvidia_hook(hooks: object) -> bool:
    """NVIDIA's hook is in the spec (docker --gpus, nvidia-container-runtime, its hooks.d
    file): NVIDIA_VISIBLE_DEVICES then gives the container those GPUs. Without it the
    variable (every CUDA image sets `all`) gives none."""
    if not isinstance(hooks, dict):
        return False
    for entries in hooks.values():
        for entry in entries if isinstance(entries, list) else ():
            path = entry.get("path") if isinstance(entry, dict) else None
            if isinstance(path, str) and path.rpartition("/")[2].startswith(NVIDIA_HOOKS):
                return True
    return False


def gpu_request(
    devices: object, env: object, *, mounts: object = None, env_counts: bool = True
) -> GpuRequest:
    """The union of the device nodes (linux.devices, and /dev/nvidiaN bind-mounted in) and,
    where env_counts (NVIDIA's hook will act on it), NVIDIA_VISIBLE_DEVICES."""
    minors: list[int] = []
    for minor in _minors(devices, "path") + _minors(mounts, "source", "destination"):
        if minor not in minors:
            minors.append(minor)
    value = visible_devices(env) if env_counts else None
    if value is None or value.strip().lower() in NO_GPU_VALUES:
        return GpuRequest(minors=tuple(minors))
    if value.strip().lower() == "all":
        return GpuRequest(minors=tuple(minors), all_gpus=True)
    refs = tuple(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    return GpuRequest(minors=tuple(minors), refs=refs)


def _minors(entries: object, *keys: str) -> list[int]:
    found: list[int] = []
    for entry in entries if isinstance(entries, list) else ():
        for key in keys:
            path = entry.get(key) if isinstance(entry, dict) else None
            match = DEVICE.fullmatch(path) if isinstance(path, str) else None
            if match is not None:
                found.append(int(match.group(1)))
                break
    return found


def visible_devices(env: object) -> str | None:
    """NVIDIA_VISIBLE_DEVICES's last value in a spec's process.env, or None."""
    found: str | None = None
    if isinstance(env, list):
        for item in env:
            if isinstance(item, str) and item.startswith(VISIBLE + "="):
                found = item[len(VISIBLE) + 1 :]
    if found is not None and len(found) > 4096:  # no list of GPUs is this long
        raise OciInputError(f"config.json: process.env: {VISIBLE} is over 4096 characters")
    return found


def container_name(state: ContainerState, spec: ContainerSpec | None) -> str | None:
    """The name the runtime gave the container, from the annotations it writes."""
    annotations = {**(spec.annotations if spec else {}), **state.annotations}
    for key in NAME_ANNOTATIONS:
        name = annotations.get(key, "").strip().lstrip("/")
        if name:
            pod = next((annotations[k] for k in POD_ANNOTATIONS if annotations.get(k)), None)
            return safe_name(f"{pod}/{name}" if pod else name)
    return None


def safe_name(text: str) -> str | None:
    """A name as gpugate repeats it (journal fields, refusals, lease files): printable
    characters only (others shown as `?`), at most MAX_FIELD; None where nothing is left."""
    shown = "".join(c if c.isprintable() and c not in "\t\r\n" else "?" for c in text[:MAX_FIELD])
    return shown.strip() or None


def manager_of(state: ContainerState, spec: ContainerSpec | None) -> str | None:
    """Which engine made the container, where its annotations say."""
    keys = list(state.annotations) + list(spec.annotations if spec else {})
    for prefix, manager in MANAGER_ANNOTATIONS.items():
        if any(key.startswith(prefix) for key in keys):
            return manager
    return None


def cgroup_of_spec(cgroups_path: str | None, container_id: str) -> str | None:
    """linux.cgroupsPath as a cgroup: `slice:prefix:name` (the systemd driver) is the scope
    `/slice/prefix-name.scope`; an absolute path (cgroupfs) is itself."""
    if not cgroups_path:
        return None
    if cgroups_path.startswith("/"):
        return cgroups_path
    parts = cgroups_path.split(":")
    if len(parts) != 3 or not all(parts[1:]):
        return None
    slice_name, prefix, name = parts
    scope = name if name.endswith(".slice") else f"{prefix}-{name}.scope"
    nested = _slice_path(slice_name or "system.slice")
    return f"{nested}/{scope}" if nested else None


def _slice_path(name: str) -> str | None:
    """`machine.slice` -> `/machine.slice`; `a-b.slice` -> `/a.slice/a-b.slice`."""
    if not name.endswith(".slice") or "/" in name:
        return None
    if name == "-.slice":
        return ""
    parts = name[: -len(".slice")].split("-")
    return "".join("/" + "-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def _json_object(raw: bytes, source: str) -> dict[str, object]:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        detail = _first_line(exc)
        raise OciInputError(
            f"{shown(source, FILE)}: not JSON ({detail})"
            if detail
            else f"{shown(source, FILE)}: not JSON"
        ) from None
    if not isinstance(data, dict):
        raise OciInputError(f"{shown(source, FILE)}: not a JSON object")
    return data


def _string_map(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {
        str(k)[:MAX_FIELD]: v[:MAX_FIELD]
        for k, v in list(value.items())[:1024]
        if isinstance(v, str)
    }


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
