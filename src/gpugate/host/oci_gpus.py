"""Which GPUs a container's spec lets it reach (docs/containers.md, "The container's GPUs"), by
device number (major 195), never by a path or name the container's creator chose: its
linux.devices, bind mounts of NVIDIA nodes or of folders holding them, what NVIDIA's prestart
hook will read (volume mounts or NVIDIA_VISIBLE_DEVICES), and CDI annotations. Standard
library only (the hook's fast path)."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gpugate.errors import ExitCode, GateError
from gpugate.untrusted import echo

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


class OciInputError(GateError):
    """The runtime's state or config.json cannot be read as one, or names GPUs gpugate cannot
    resolve (refused, never guessed): the hook fails, the container does not start."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class Toolkit:
    """What of NVIDIA's config.toml decides which list its hook reads (its defaults)."""

    envvar_unprivileged: bool = True
    volume_mounts: bool = False
    note: str = ""  # why the defaults stand in for the file, where they do


@dataclass
class Reach:
    """What a spec reaches: device minors of major 195, NVIDIA indices/UUIDs, all."""

    minors: list[int] = field(default_factory=list)
    refs: list[str] = field(default_factory=list)
    all_gpus: bool = False
    origins: list[str] = field(default_factory=list)

    def minor(self, minor: int, origin: str) -> None:
        if minor not in self.minors:
            self.minors.append(minor)
        if origin not in self.origins:
            self.origins.append(origin)

    def ref(self, ref: str, origin: str) -> None:
        if ref == "all":
            self.all_gpus = True
        elif ref not in self.refs:
            self.refs.append(ref)
        if origin not in self.origins:
            self.origins.append(origin)


def device_number(major: object, minor: object) -> tuple[int, int] | None:
    if not _is_int(major) or not _is_int(minor):
        return None
    return int(major), int(minor)  # type: ignore[call-overload]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


def is_gpu_number(number: tuple[int, int] | None) -> bool:
    return number is not None and number[0] == NVIDIA_MAJOR and number[1] not in NOT_GPU_MINORS


def node_number(info: os.stat_result) -> tuple[int, int] | None:
    if not stat.S_ISCHR(info.st_mode):
        return None
    return os.major(info.st_rdev), os.minor(info.st_rdev)


def devices_reach(devices: object, reach: Reach) -> None:
    """linux.devices: each entry's own major and minor, else its host node's (lstat)."""
    for entry in devices if isinstance(devices, list) else ():
        if not isinstance(entry, dict) or entry.get("type", "c") not in ("c", "u"):
            continue
        number = device_number(entry.get("major"), entry.get("minor"))
        path = entry.get("path")
        if number is None and isinstance(path, str) and path.startswith("/") and "\0" not in path:
            number = _lstat_number(path)
        if is_gpu_number(number):
            reach.minor(number[1], "linux.devices")  # type: ignore[index]


def _lstat_number(path: str) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except (OSError, ValueError):
        return None
    if stat.S_ISLNK(info.st_mode):
        raise OciInputError(
            f"config.json: linux.devices: {echo(path[:256])} has no major and minor, and on the "
            "host it is a symbolic link: which device it is cannot be told"
        )
    return node_number(info)


def mounts_reach(mounts: object, reach: Reach) -> None:
    """Bind mounts whose source is an NVIDIA device node (or a folder holding some)."""
    for entry in mounts if isinstance(mounts, list) else ():
        if not isinstance(entry, dict) or not _is_bind(entry):
            continue
        source = entry.get("source")
        if not isinstance(source, str) or not source.startswith("/") or "\0" in source:
            continue
        for minor in _source_minors(source):
            reach.minor(minor, "mounts")


def _is_bind(entry: dict[object, object]) -> bool:
    options = entry.get("options")
    words = options if isinstance(options, list) else []
    return entry.get("type") == "bind" or "bind" in words or "rbind" in words


def _source_minors(source: str) -> list[int]:
    try:
        info = os.stat(source)  # the mount follows a link as its source: so does this
    except (OSError, ValueError):
        return []
    number = node_number(info)
    if number is not None:
        return [number[1]] if is_gpu_number(number) else []
    if not stat.S_ISDIR(info.st_mode):
        return []
    try:
        dev = os.stat(HOST_DEV)
    except OSError:
        return []
    if _holds_dev(source):
        return _folder_minors(HOST_DEV)
    return _folder_minors(source) if info.st_dev == dev.st_dev else []


def _holds_dev(source: str) -> bool:
    """/dev is this folder or lies below it (a bind of `/` reaches every node in /dev)."""
    try:
        folder = os.path.realpath(source)
    except (OSError, ValueError):
        return False
    return folder in ("/", HOST_DEV) or HOST_DEV.startswith(folder.rstrip("/") + "/")


def _folder_minors(folder: str) -> list[int]:
    found: list[int] = []
    try:
        with os.scandir(folder) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_FOLDER_ENTRIES:
                    raise OciInputError(
                        f"config.json: mounts: {echo(folder[:256])} holds over "
                        f"{MAX_FOLDER_ENTRIES} entries: which GPUs a bind mount of it reaches "
                        "cannot be told"
                    )
                try:
                    number = node_number(entry.stat(follow_symlinks=False))
                except OSError:
                    continue
                if is_gpu_number(number) and number[1] not in found:  # type: ignore[index]
                    found.append(number[1])  # type: ignore[index]
    except OSError:
        return found
    return sorted(found)


def cdi_reach(annotations: object, reach: Reach) -> None:
    """`cdi.k8s.io/*` annotations: comma-separated fully-qualified CDI device names; those
    of kind nvidia.com/gpu name GPUs (an index, a UUID, all), others no GPU."""
    if not isinstance(annotations, dict):
        return
    for key in sorted(k for k in annotations if isinstance(k, str) and k.startswith(CDI_PREFIX)):
        value = annotations[key]
        if not isinstance(value, str):
            continue
        origin = f"annotation {key[:128]}"
        if len(value) > MAX_VALUE:  # refused, not cut: a cut name could be another GPU's
            raise OciInputError(
                f"config.json: annotations: {echo(key[:128])} is over {MAX_VALUE} characters"
            )
        for name in (part.strip() for part in value.split(",")):
            if name:
                _cdi_name(name, origin, reach)


def _cdi_name(name: str, origin: str, reach: Reach) -> None:
    if not CDI_NAME.fullmatch(name):
        raise OciInputError(
            f"config.json: {echo(origin)}: {echo(name[:128])} is not a CDI device name "
            "(vendor/class=device)"
        )
    kind, _, device = name.partition("=")
    if kind == CDI_GPU_KIND:
        reach.ref(_gpu_word(device, origin), origin)


def _gpu_word(word: str, origin: str) -> str:
    """One of NVIDIA's device words: all, an index, a GPU UUID, a MIG device's UUID (its
    `GPU:MIG` index form is refused)."""
    if word == "all" or (word.isascii() and word.isdigit() and len(word) <= 4):
        return word
    if word.startswith("GPU-") and re.fullmatch(r"GPU-[0-9a-fA-F-]{8,64}", word):
        return word
    if word.startswith("MIG-") and re.fullmatch(r"MIG-[0-9A-Za-z][0-9A-Za-z/-]{7,127}", word):
        return word  # a MIG slice: resolved against NVML's slices (integrations/container.py)
    if word.startswith("MIG-") or ":" in word:
        raise OciInputError(
            f"config.json: {echo(origin)}: {echo(word[:128])} is a MIG device: name whole GPUs"
        )
    raise OciInputError(
        f"config.json: {echo(origin)}: {echo(word[:128])} is not a GPU index, a GPU UUID or all"
    )


def has_nvidia_hook(hooks: object) -> bool:
    """NVIDIA's prestart hook is in the spec: it injects devices once gpugate has read it."""
    if not isinstance(hooks, dict):
        return False
    for entries in hooks.values():
        for entry in entries if isinstance(entries, list) else ():
            path = entry.get("path") if isinstance(entry, dict) else None
            if isinstance(path, str) and path.rpartition("/")[2] in NVIDIA_HOOKS:
                return True
    return False


def privileged(process: object) -> bool:
    """NVIDIA's test: CAP_SYS_ADMIN in the bounding set."""
    caps = process.get("capabilities") if isinstance(process, dict) else None
    bounding = caps.get("bounding") if isinstance(caps, dict) else None
    return isinstance(bounding, list) and "CAP_SYS_ADMIN" in bounding


def nvidia_reach(spec: dict[str, object], toolkit: Toolkit, reach: Reach) -> None:
    """What NVIDIA's hook reads, by its precedence: the volume-mounts list (where its config
    accepts it and the list is not empty), else the variable (privileged, or accepted)."""
    if toolkit.volume_mounts:
        listed = volume_mount_devices(spec.get("mounts"))
        if listed:
            origin = "volume-mounts " + DEVICE_LIST_ROOT
            for word in listed:
                if word.startswith("cdi/"):
                    _cdi_name(_cdi_mount_name(word[len("cdi/") :]), origin, reach)
                else:
                    reach.ref(_gpu_word(word, origin), origin)
            return
    process = spec.get("process")
    if not toolkit.envvar_unprivileged and not privileged(process):
        return
    env = process.get("env") if isinstance(process, dict) else None
    for word in visible_words(env):
        reach.ref(_gpu_word(word, VISIBLE), VISIBLE)


def volume_mount_devices(mounts: object) -> list[str]:
    """Mounts of /dev/null at /var/run/nvidia-container-devices/<device> (NVIDIA's
    `requestsFromMounts`; its imex/ entries are no GPU, its cdi/ entries CDI names)."""
    found: list[str] = []
    for entry in mounts if isinstance(mounts, list) else ():
        if not isinstance(entry, dict):
            continue
        source, target = entry.get("source"), entry.get("destination")
        if not isinstance(source, str) or not isinstance(target, str):
            continue
        if os.path.normpath(source) != "/dev/null":
            continue
        target = os.path.normpath(target)
        if not target.startswith(DEVICE_LIST_ROOT + "/"):
            continue
        word = target[len(DEVICE_LIST_ROOT) + 1 :].strip("/")
        if word.startswith("imex/") or word in found:
            continue
        found.append(word)
    return found


def _cdi_mount_name(rest: str) -> str:
    """NVIDIA's `cdiDeviceMountRequest`: `vendor/class=device` or `vendor/class/device`."""
    if "=" in rest:
        return rest
    vendor, _, tail = rest.partition("/")
    kind, _, device = tail.partition("/")
    return f"{vendor}/{kind}={device}"


def visible_words(env: object) -> list[str]:
    """NVIDIA_VISIBLE_DEVICES as NVIDIA's hook reads it (`devicesFromEnvvars`,
    `NewVisibleDevices`): the last setting; unset, empty or any `void`: none; the first `all`
    or `none`: every GPU or none; else its words. A legacy CUDA image (CUDA_VERSION set,
    NVIDIA_REQUIRE_CUDA not) without the variable: all."""
    values: dict[str, str] = {}
    for item in env if isinstance(env, list) else ():
        if isinstance(item, str) and "=" in item:
            name, _, value = item.partition("=")
            values[name] = value
    if VISIBLE not in values:
        legacy = values.get("CUDA_VERSION") and not values.get("NVIDIA_REQUIRE_CUDA")
        return ["all"] if legacy else []
    value = values[VISIBLE]
    if len(value) > MAX_VALUE:
        raise OciInputError(f"config.json: process.env: {VISIBLE} is over {MAX_VALUE} characters")
    words = [word.strip() for word in value.split(",") if word.strip()]
    if not words or "void" in words:
        return []
    for word in words:
        if word in ("all", "none"):
            return ["all"] if word == "all" else []
    return list(dict.fromkeys(words))


# NVIDIA Container Toolkit's config.toml, as far as it decides which list NVIDIA's hook reads
# (api/config/v1/config.go). Read only where root owns it and its folders and no one else may
# write them, at most 1 MiB; otherwise NVIDIA's defaults stand, with a note saying why.
TOOLKIT_CONFIG = Path("/etc/nvidia-container-runtime/config.toml")
ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
MOUNTS_KEY = "accept-nvidia-visible-devices-as-volume-mounts"
UNTRUSTED = "untrusted"  # another account than root may change it or a folder above it
UNREADABLE = "unreadable"  # not a regular file of at most 1 MiB, not UTF-8 TOML
NOT_BOOLEAN = "not-boolean"  # one of the two keys is not true or false


def read_toolkit(path: Path = TOOLKIT_CONFIG) -> Toolkit:
    from gpugate.compat import tomllib  # noqa: PLC0415 (GPU path only)
    from gpugate.host.safe_files import read_capped, untrusted  # noqa: PLC0415

    if not path.exists() and not path.is_symlink():
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
