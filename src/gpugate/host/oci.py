"""An OCI runtime hook's input (the state on stdin, the bundle's config.json) and which GPUs the
spec lets the container reach, by device number (major 195), never by a path or name its creator
chose (docs/containers.md). All of it untrusted: read bounded in size and time, never trusting a
field's type. The hook's fast path: the standard library and safe_files only."""

from __future__ import annotations

import json
import os
import re
import select
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from gpugate.errors import BadInput, NotRegularFile, TooLarge
from gpugate.host.safe_files import read_capped, untrusted
from gpugate.untrusted import FILE, for_error, printable

NVIDIA_MAJOR = 195
NOT_GPU_MINORS = frozenset({254, 255})  # nvidia-modeset, nvidiactl
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
# NVIDIA's prestart hook, as docker --gpus, nvidia-container-runtime (legacy mode) and the
# toolkit's hooks.d file name it (nvidia-container-toolkit is its alias). nvidia-ctk's hooks
# come with CDI devices already in linux.devices and inject none.
NVIDIA_HOOKS = frozenset({"nvidia-container-runtime-hook", "nvidia-container-toolkit"})
DEVICE_LIST_ROOT = "/var/run/nvidia-container-devices"
CDI_PREFIX = "cdi.k8s.io/"
CDI_GPU_KIND = "nvidia.com/gpu"
CDI_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*=[A-Za-z0-9_.:-]+")
HOST_DEV = "/dev"
MAX_FOLDER_ENTRIES = 65536
MAX_VALUE = 4096  # no list of GPUs is this long
# A MIG slice (by UUID or GPU:MIG index pair) is resolved against NVML's (container.py).
GPU_WORD = (
    r"all|[0-9]{1,4}|[0-9]{1,4}:[0-9]{1,4}|GPU-[0-9a-fA-F-]{8,64}|"
    r"MIG-[0-9A-Za-z][0-9A-Za-z/-]{7,127}"
)


class Toolkit(NamedTuple):
    """What of NVIDIA's config.toml decides which list its hook reads (its defaults)."""

    envvar_unprivileged: bool = True
    volume_mounts: bool = False
    note: str = ""  # why the defaults stand in for the file, where they do


def is_gpu_number(number: tuple[int, int] | None) -> bool:
    return number is not None and number[0] == NVIDIA_MAJOR and number[1] not in NOT_GPU_MINORS


def node_number(info: os.stat_result) -> tuple[int, int] | None:
    return (os.major(info.st_rdev), os.minor(info.st_rdev)) if stat.S_ISCHR(info.st_mode) else None


def devices_reach(devices: object, found: list[tuple[int | str, str]]) -> None:
    """linux.devices: each entry's own major and minor, else its host node's (lstat)."""
    for entry in devices if isinstance(devices, list) else ():
        if not isinstance(entry, dict) or entry.get("type", "c") not in ("c", "u"):
            continue
        number, path = _device_number(entry), entry.get("path")
        if number is None and isinstance(path, str) and path.startswith("/") and "\0" not in path:
            try:
                info = os.lstat(path)
            except (OSError, ValueError):
                continue
            if stat.S_ISLNK(info.st_mode):
                raise BadInput(
                    f"config.json: linux.devices: {for_error(path[:256])} has no major and minor, "
                    "and on the host it is a symbolic link: which device it is cannot be told"
                )
            number = node_number(info)
        if is_gpu_number(number):
            found.append((number[1], "linux.devices"))  # type: ignore[index]


def _device_number(entry: dict[object, object]) -> tuple[int, int] | None:
    numbers = (entry.get("major"), entry.get("minor"))
    if all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 32 for n in numbers):
        return numbers  # type: ignore[return-value]
    return None


def mounts_reach(mounts: object, found: list[tuple[int | str, str]]) -> None:
    """Bind mounts whose source is an NVIDIA device node (or a folder holding some)."""
    for entry in mounts if isinstance(mounts, list) else ():
        if not isinstance(entry, dict):
            continue
        options, source = entry.get("options"), entry.get("source")
        words = options if isinstance(options, list) else []
        if entry.get("type") != "bind" and "bind" not in words and "rbind" not in words:
            continue
        if isinstance(source, str) and source.startswith("/") and "\0" not in source:
            found.extend((minor, "mounts") for minor in _source_minors(source))


def _source_minors(source: str) -> list[int]:
    try:
        info = os.stat(source)  # the mount follows a link as its source: so does this
        dev = os.stat(HOST_DEV) if stat.S_ISDIR(info.st_mode) else None
        # /dev is this folder or lies below it (a bind of `/` reaches every node in /dev).
        folder = os.path.realpath(source) if dev else ""
    except (OSError, ValueError):
        return []
    if dev is None:  # not a folder: a GPU's node or nothing
        number = node_number(info)
        return [number[1]] if is_gpu_number(number) else []  # type: ignore[index]
    if folder in ("/", HOST_DEV) or HOST_DEV.startswith(folder.rstrip("/") + "/"):
        return _folder_minors(HOST_DEV)
    return _folder_minors(source) if info.st_dev == dev.st_dev else []


def _folder_minors(folder: str) -> list[int]:
    found: set[int] = set()
    try:
        with os.scandir(folder) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_FOLDER_ENTRIES:
                    raise BadInput(
                        f"config.json: mounts: {for_error(folder[:256])} holds over "
                        f"{MAX_FOLDER_ENTRIES} entries: which GPUs a bind mount of it reaches "
                        "cannot be told"
                    )
                try:
                    number = node_number(entry.stat(follow_symlinks=False))
                except OSError:
                    continue
                if is_gpu_number(number):
                    found.add(number[1])  # type: ignore[index]
    except OSError:
        pass
    return sorted(found)


def cdi_reach(annotations: object, found: list[tuple[int | str, str]]) -> None:
    """`cdi.k8s.io/*` annotations: CDI device names; those of kind nvidia.com/gpu name GPUs."""
    if not isinstance(annotations, dict):
        return
    for key in sorted(k for k in annotations if isinstance(k, str) and k.startswith(CDI_PREFIX)):
        value = annotations[key]
        if not isinstance(value, str):
            continue
        if len(value) > MAX_VALUE:  # refused, not cut: a cut name could be another GPU's
            raise BadInput(
                f"config.json: annotations: {for_error(key[:128])} is over {MAX_VALUE} characters"
            )
        for name in [part.strip() for part in value.split(",") if part.strip()]:
            _cdi_name(name, f"annotation {key[:128]}", found)


def _cdi_name(name: str, origin: str, found: list[tuple[int | str, str]]) -> None:
    if not CDI_NAME.fullmatch(name):
        raise BadInput(
            f"config.json: {for_error(origin)}: {for_error(name[:128])} is not a CDI device name "
            "(vendor/class=device)"
        )
    kind, _, device = name.partition("=")
    if kind == CDI_GPU_KIND:
        found.append((_gpu_word(device, origin), origin))


def _gpu_word(word: str, origin: str) -> str:
    """all, an index, a GPU UUID, a MIG device's UUID (either form) or `GPU:MIG` pair."""
    if re.fullmatch(GPU_WORD, word):
        return word
    what = "a GPU index, a GPU UUID or all"
    if word.startswith("MIG-") or ":" in word:
        what = "a MIG device's UUID (MIG-...) or GPU:MIG index pair (0:1)"
    raise BadInput(f"config.json: {for_error(origin)}: {for_error(word[:128])} is not {what}")


def has_nvidia_hook(hooks: object) -> bool:
    """NVIDIA's prestart hook is in the spec: it injects devices once gpugate has read it."""
    stages = hooks.values() if isinstance(hooks, dict) else ()
    entries = [entry for entries in stages if isinstance(entries, list) for entry in entries]
    paths = [entry.get("path") for entry in entries if isinstance(entry, dict)]
    return any(isinstance(path, str) and path.rpartition("/")[2] in NVIDIA_HOOKS for path in paths)


def nvidia_reach(
    spec: dict[str, object], toolkit: Toolkit, found: list[tuple[int | str, str]]
) -> None:
    """What NVIDIA's hook reads, by its precedence: the volume-mounts list (where its config
    accepts it and the list is not empty), else the variable (privileged, or accepted)."""
    listed = volume_mount_devices(spec.get("mounts")) if toolkit.volume_mounts else []
    origin = "volume-mounts " + DEVICE_LIST_ROOT
    for word in listed:
        if word.startswith("cdi/"):
            # NVIDIA's `cdiDeviceMountRequest`: `vendor/class=device` or `vendor/class/device`.
            name = word[len("cdi/") :]
            if "=" not in name:
                vendor, _, tail = name.partition("/")
                kind, _, device = tail.partition("/")
                name = f"{vendor}/{kind}={device}"
            _cdi_name(name, origin, found)
        else:
            found.append((_gpu_word(word, origin), origin))
    if listed:
        return
    process = spec.get("process")
    caps = process.get("capabilities") if isinstance(process, dict) else None
    bounding = caps.get("bounding") if isinstance(caps, dict) else None
    privileged = isinstance(bounding, list) and "CAP_SYS_ADMIN" in bounding  # NVIDIA's test
    if not toolkit.envvar_unprivileged and not privileged:
        return
    env = process.get("env") if isinstance(process, dict) else None
    found.extend((_gpu_word(word, VISIBLE), VISIBLE) for word in visible_words(env))


def volume_mount_devices(mounts: object) -> list[str]:
    """Mounts of /dev/null at /var/run/nvidia-container-devices/<device> (NVIDIA's
    `requestsFromMounts`; its imex/ entries are no GPU, its cdi/ entries CDI names)."""
    found: list[str] = []
    root = DEVICE_LIST_ROOT + "/"
    for entry in mounts if isinstance(mounts, list) else ():
        source = entry.get("source") if isinstance(entry, dict) else None
        target = entry.get("destination") if isinstance(entry, dict) else None
        if not isinstance(source, str) or not isinstance(target, str):
            continue
        target = os.path.normpath(target)
        if os.path.normpath(source) == "/dev/null" and target.startswith(root):
            found.append(target[len(root) :].strip("/"))
    return list(dict.fromkeys(word for word in found if not word.startswith("imex/")))


def visible_words(env: object) -> list[str]:
    """NVIDIA_VISIBLE_DEVICES as NVIDIA's hook reads it (`devicesFromEnvvars`,
    `NewVisibleDevices`): the last setting; unset, empty or any `void`: none; the first `all`
    or `none`: every GPU or none; else its words. A legacy CUDA image (CUDA_VERSION set,
    NVIDIA_REQUIRE_CUDA not) without the variable: all."""
    items = env if isinstance(env, list) else ()
    values = dict(item.split("=", 1) for item in items if isinstance(item, str) and "=" in item)
    if VISIBLE not in values:
        legacy = values.get("CUDA_VERSION") and not values.get("NVIDIA_REQUIRE_CUDA")
        return ["all"] if legacy else []
    value = values[VISIBLE]
    if len(value) > MAX_VALUE:
        raise BadInput(f"config.json: process.env: {VISIBLE} is over {MAX_VALUE} characters")
    words = [word.strip() for word in value.split(",") if word.strip()]
    first = next((word for word in words if word in ("all", "none")), "")
    if not words or "void" in words or first == "none":
        return []
    return ["all"] if first == "all" else list(dict.fromkeys(words))


# NVIDIA Container Toolkit's config.toml, as far as it decides which list NVIDIA's hook reads
# (api/config/v1/config.go). Read only where root owns it and its folders and no one else may
# write them, at most 1 MiB; otherwise NVIDIA's defaults stand, with a note saying why.
TOOLKIT_CONFIG = Path("/etc/nvidia-container-runtime/config.toml")
ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
MOUNTS_KEY = "accept-nvidia-visible-devices-as-volume-mounts"
UNTRUSTED = "another account than root may change it"
UNREADABLE = "not a regular file of at most 1 MiB of TOML"
NOT_BOOLEAN = "its accept-nvidia-visible-devices-* keys are not true or false"


def read_toolkit(path: Path = TOOLKIT_CONFIG) -> Toolkit:
    from gpugate.compat import tomllib  # noqa: PLC0415 (GPU path only)

    if not os.path.lexists(path):
        return Toolkit()
    if untrusted(path) is not None:
        return Toolkit(note=UNTRUSTED)
    try:
        data = tomllib.loads(read_capped(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return Toolkit(note=UNREADABLE)
    envvar, mounts = data.get(ENVVAR_KEY, True), data.get(MOUNTS_KEY, False)
    if not isinstance(envvar, bool) or not isinstance(mounts, bool):
        return Toolkit(note=NOT_BOOLEAN)
    return Toolkit(envvar_unprivileged=envvar, volume_mounts=mounts)


MAX_STATE_BYTES = 1 << 20  # a state is a few hundred bytes; annotations can add some
MAX_CONFIG_BYTES = 16 << 20  # config.json: tens of KiB usually; a huge env is still bounded
STATE_TIMEOUT_S = 5.0
MAX_FIELD = 256  # characters of an id or a name kept
CONTAINER_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")


class GpuRequest(NamedTuple):
    """What the container reaches. Empty: no GPU, the hook has nothing to do."""

    minors: tuple[int, ...] = ()  # minors of the 195:N device nodes it reaches
    refs: tuple[str, ...] = ()  # indices and UUIDs of NVIDIA's lists, as written
    all_gpus: bool = False  # NVIDIA's `all`
    origins: tuple[str, ...] = ()  # where in the spec each came from
    note: str = ""  # why NVIDIA's config defaults stood in (read_toolkit's words)
    # After the stop (parse_config's lenient): why the request could not be resolved; the
    # container's lease then says which GPUs it had.
    unresolved: BadInput | None = None

    def __bool__(self) -> bool:
        return bool(self.minors or self.refs or self.all_gpus or self.unresolved)


class ContainerState(NamedTuple):
    """The OCI state a hook gets on stdin (runtime-spec's state.json)."""

    id: str
    pid: int  # 0 where the runtime gave none (poststop)
    bundle: str
    annotations: Mapping[str, str] = {}  # never changed: one shared empty map


class ContainerSpec(NamedTuple):
    gpus: GpuRequest
    cgroups_path: str | None  # linux.cgroupsPath, as the runtime wrote it
    annotations: dict[str, str]


def read_stdin_bounded(
    fd: int = 0, limit: int = MAX_STATE_BYTES, timeout_s: float = STATE_TIMEOUT_S
) -> bytes:
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise BadInput(f"the container state on stdin did not end within {timeout_s:g} s")
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if sum(map(len, chunks)) > limit:
            raise BadInput(f"the container state on stdin is over {limit} bytes")


def parse_state(raw: bytes) -> ContainerState:
    data = json_object(raw, "the container state on stdin")
    container_id = data.get("id")
    if not isinstance(container_id, str) or not CONTAINER_ID.fullmatch(container_id):
        raise BadInput("the container state on stdin: id: missing or not a container id")
    bundle = data.get("bundle")
    if not isinstance(bundle, str) or not bundle.startswith("/") or "\0" in bundle:
        raise BadInput("the container state on stdin: bundle: missing or not absolute")
    pid = data.get("pid", 0)
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 1 << 22:
        pid = 0
    return ContainerState(container_id, pid, bundle, _string_map(data.get("annotations")))


def read_config(bundle: str, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """BUNDLE/config.json: a regular file, it and its folder this user's, not others'."""
    try:
        dir_fd = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInput(
            f"{printable(bundle, FILE)}: the bundle cannot be opened: {exc.strerror}"
        ) from None
    path = f"{bundle}/config.json"
    try:
        check_owner(os.fstat(dir_fd), bundle)
        return read_capped(
            "config.json", limit, dir_fd=dir_fd, check=lambda info: check_owner(info, path)
        )
    except (NotRegularFile, TooLarge) as exc:
        raise BadInput(f"{printable(path, FILE)}: {exc.strerror}") from None
    except OSError as exc:
        raise BadInput(f"{printable(path, FILE)}: cannot be opened: {exc.strerror}") from None
    finally:
        os.close(dir_fd)


def check_owner(info: os.stat_result, path: str) -> None:
    """BadInput unless this user's and writable by no one else (a runtime's file)."""
    if info.st_uid != os.geteuid():
        raise BadInput(
            f"{printable(path, FILE)}: owned by uid {info.st_uid}, not by this runtime's user"
        )
    if info.st_mode & 0o022:
        raise BadInput(f"{printable(path, FILE)}: writable by others than its owner")


def parse_config(
    raw: bytes, source: str = "config.json", *, lenient: bool = False
) -> ContainerSpec:
    """lenient (after the stop): a GPU request that cannot be resolved (NVIDIA's config may
    have changed since the start) is kept as such, for the lease to answer."""
    data = json_object(raw, source)
    linux = data.get("linux")
    cgroups_path = linux.get("cgroupsPath") if isinstance(linux, dict) else None
    try:
        gpus = spec_gpu_request(data)
    except BadInput as exc:
        if not lenient:
            raise
        gpus = GpuRequest(unresolved=exc)
    path = cgroups_path if isinstance(cgroups_path, str) else None
    return ContainerSpec(gpus, path, _string_map(data.get("annotations")))


def spec_gpu_request(spec: dict[str, object], toolkit: Toolkit | None = None) -> GpuRequest:
    """A parsed config.json's GPUs (docs/containers.md); NVIDIA's config read where needed."""
    found: list[tuple[int | str, str]] = []
    linux = spec.get("linux")
    devices_reach(linux.get("devices") if isinstance(linux, dict) else None, found)
    mounts_reach(spec.get("mounts"), found)
    cdi_reach(spec.get("annotations"), found)
    note = ""
    if has_nvidia_hook(spec.get("hooks")):
        toolkit = toolkit or read_toolkit()
        note = toolkit.note
        nvidia_reach(spec, toolkit, found)
    values = list(dict.fromkeys(value for value, _ in found))
    return GpuRequest(
        minors=tuple(value for value in values if isinstance(value, int)),
        refs=tuple(value for value in values if isinstance(value, str) and value != "all"),
        all_gpus="all" in values,
        origins=tuple(dict.fromkeys(origin for _, origin in found)),
        note=note,
    )


def json_object(raw: bytes, source: str) -> dict[str, object]:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        said = f" ({detail})" if detail else ""
        raise BadInput(f"{printable(source, FILE)}: not JSON{said}") from None
    if not isinstance(data, dict):
        raise BadInput(f"{printable(source, FILE)}: not a JSON object")
    return data


def _string_map(value: object) -> dict[str, str]:
    items = list(value.items())[:1024] if isinstance(value, dict) else []
    return {str(k)[:MAX_FIELD]: v[:MAX_FIELD] for k, v in items if isinstance(v, str)}


# A CRI container's names as Kubernetes has them (the pod author's text: shown escaped), from
# the annotations of containerd's CRI plugin, then CRI-O's: (the container's type, `sandbox` or
# `container`; its sandbox's id; its pod's namespace; its pod; its own name). A pod's sandbox
# (pause) container says `sandbox` *and* has its own id as the sandbox's: the runtime sets both,
# and no one can know an id in advance.
SANDBOX = "sandbox"
CRI_KEYS = (
    (
        "io.kubernetes.cri.container-type",
        "io.kubernetes.cri.sandbox-id",
        "io.kubernetes.cri.sandbox-namespace",
        "io.kubernetes.cri.sandbox-name",
        "io.kubernetes.cri.container-name",
    ),
    (
        "io.kubernetes.cri-o.ContainerType",
        "io.kubernetes.cri-o.SandboxID",
        "io.kubernetes.pod.namespace",
        "io.kubernetes.pod.name",
        "io.kubernetes.container.name",
    ),
)


def is_sandbox(container_id: str, annotations: Mapping[str, str]) -> bool:
    """A pod's sandbox (pause) container: never gated, it holds no GPU."""
    return any(
        annotations.get(kind) == SANDBOX and annotations.get(sandbox_id) == container_id
        for kind, sandbox_id, *_ in CRI_KEYS
    )


# A rootless runtime (podman run by alice, rootless docker) runs its hooks and its runtime
# wrapper as uid 0 of a user namespace it made, owning nothing of the host's: the euid alone
# cannot tell. The initial user namespace, and only it in practice, maps every uid onto itself
# (`0 0 4294967295`); a user's maps a small range (`0 1000 1`). Where root made one with the
# full identity map, `/proc/self/ns/user` differing from PID 1's still says so.
INITIAL_UID_MAP = ("0", "0", "4294967295")
MAX_UID_MAP = 4096  # the kernel allows 340 lines of at most 36 bytes


def not_host_root(proc: str = "/proc") -> str | None:
    """None where this process is the host's root; else why not (`euid 1000`, ...)."""
    euid = os.geteuid()
    if euid != 0:
        return f"euid {euid}"
    try:
        with open(f"{proc}/self/uid_map", encoding="ascii", errors="replace") as stream:
            fields = stream.read(MAX_UID_MAP).split()
    except OSError:
        return None
    if tuple(fields) != INITIAL_UID_MAP:
        return "user namespace, uid_map " + " ".join(fields[:6])
    try:
        mine, init = os.stat(f"{proc}/self/ns/user"), os.stat(f"{proc}/1/ns/user")
    except OSError:
        return None
    return None if os.path.samestat(mine, init) else "user namespace other than PID 1's"


def hook_entry(gpugate: str | Sequence[str], stage: str) -> dict[str, object]:
    """gpugate's hook at stage, as a spec's hooks list (the runtime wrapper) and hooks.d
    files (install) write it."""
    command = (gpugate,) if isinstance(gpugate, str) else tuple(gpugate)
    args = [os.path.basename(command[0]), *command[1:], "oci-hook", stage]
    return {"path": command[0], "args": args}
