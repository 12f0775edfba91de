"""`gpugate install|uninstall --containers`: gpugate's OCI hook where podman and CRI-O
(hooks.d files), docker (a `gpugate` runtime in daemon.json) and containerd (a marked block
in config.toml, edited as text so the operator's comments stay) find it (docs/containers.md)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from gpugate.compat import tomllib
from gpugate.config.file import toml_value
from gpugate.errors import GateError, InstallError
from gpugate.front.install import PROGRAM_TIMEOUT_S, Action, Change
from gpugate.host import safe_files, wrapped_runtime
from gpugate.host.oci import hook_entry
from gpugate.host.safe_files import find_program, read_capped, run_program, untrusted
from gpugate.untrusted import for_error

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
CONTAINERD_CONFIG = Path("/etc/containerd/config.toml")


class ContainerHost(NamedTuple):
    hooks_dirs: tuple[Path, ...] = ()  # where podman / CRI-O read hook files
    daemon_json: Path | None = None  # docker's, where docker is installed
    containerd_config: Path | None = None  # containerd's config.toml, where it is installed
    runtime_record: Path = wrapped_runtime.RECORD  # what gpugate-oci-runtime runs


def detect() -> ContainerHost:
    dirs = podman_hooks_dirs(CONTAINERS_CONFS) if find_program("podman") is not None else []
    if find_program("crio") is not None and CRIO_HOOKS not in dirs:
        dirs.append(CRIO_HOOKS)
    return ContainerHost(
        tuple(dirs),
        DAEMON_JSON if find_program("dockerd") is not None else None,
        CONTAINERD_CONFIG if find_program("containerd") is not None else None,
    )


def podman_hooks_dirs(confs: Sequence[Path]) -> list[Path]:
    """containers.conf's [engine] hooks_dir (the first that sets it), else podman's own."""
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


def hook_file(gpugate: str | Sequence[str], stage: str) -> str:
    """oci-hooks(5), version 1.0.0: every container, at one stage (the hook itself leaves a
    container without GPUs at once). gpugate: a path, or the command that runs it."""
    hook = hook_entry(gpugate, stage)
    body = {"version": "1.0.0", "hook": hook, "when": {"always": True}, "stages": [stage]}
    return json.dumps(body, indent=2) + "\n"


def plan_hooks(
    host: ContainerHost, gpugate: str | Sequence[str], *, install: bool, force: bool
) -> list[Change]:
    changes: list[Change] = []
    for folder in host.hooks_dirs:
        for name, stage in HOOK_FILES.items():
            path = folder / name
            if path.exists() and not force:  # refused unless it is gpugate's own
                try:
                    args = json.loads(path.read_text(encoding="utf-8"))["hook"]["args"]
                except (OSError, ValueError, KeyError, TypeError):
                    args = None
                if not (isinstance(args, list) and "oci-hook" in args and "gpugate" in str(args)):
                    raise InstallError(
                        f"{path}: not gpugate's hook file; nothing changed; --force replaces it"
                    )
            changes.append(changing(path, hook_file(gpugate, stage) if install else None))
    return changes


def read_daemon_json(path: Path) -> dict[str, object]:
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if text.strip() else {}
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise InstallError(f"{path}: cannot read it ({exc}); nothing changed") from None
    except ValueError as exc:  # after UnicodeDecodeError, one of its kind
        where = f"line {exc.lineno}" if hasattr(exc, "lineno") else "it"
        raise InstallError(f"{path}: not valid JSON ({where}); nothing changed") from None
    if not isinstance(data, dict):
        raise InstallError(f"{path}: not a JSON object; nothing changed")
    if not isinstance(data.get("runtimes", {}), dict):
        raise InstallError(f"{path}: runtimes: not a JSON object; nothing changed")
    return data


def plan_daemon_json(host: ContainerHost, wrapper: str, *, install: bool) -> list[Change]:
    path = host.daemon_json
    if path is None:
        return []
    data = read_daemon_json(path)
    runtimes = dict(data.get("runtimes", {}))  # type: ignore[call-overload]
    if install:
        if runtimes.get(RUNTIME_NAME) == {"path": wrapper}:
            return [Change(path, Action.UNCHANGED, note="runtime-there")]
        data["runtimes"] = {**runtimes, RUNTIME_NAME: {"path": wrapper}}
        text = json.dumps(data, indent=2) + "\n"
        return [Change(path, Action.WRITE, text, "runtime-added", detail=wrapper)]
    if RUNTIME_NAME not in runtimes:
        return [Change(path, Action.UNCHANGED, note="runtime-absent")]
    if data.get("default-runtime") == RUNTIME_NAME:
        raise InstallError(
            f'{path}: "default-runtime" is {RUNTIME_NAME}: set another first; nothing changed'
        )
    del runtimes[RUNTIME_NAME]
    data["runtimes"] = runtimes  # where it was
    if not runtimes:
        del data["runtimes"]
    return [Change(path, Action.WRITE, json.dumps(data, indent=2) + "\n", "runtime-removed")]


def containerd_default_config() -> str:
    """`containerd config default`: the config containerd runs with where the file is missing."""
    failed = f"{CONTAINERD_CONFIG} is missing and `containerd config default` failed"
    containerd = find_program("containerd")
    if containerd is None:
        raise InstallError(f"{failed}: no containerd in the system folders; nothing changed")
    try:
        result = run_program([containerd, "config", "default"], PROGRAM_TIMEOUT_S)
    except GateError as exc:
        raise InstallError(f"{failed}: {exc}; nothing changed") from None
    if result.returncode != 0:
        raise InstallError(f"{failed}: {result.first_line()}; nothing changed")
    return result.stdout


def plan_containerd(
    host: ContainerHost, wrapper: str, *, install: bool, default: bool = False
) -> list[Change]:
    path = host.containerd_config
    if path is None:
        return []
    current = read_containerd_config(path)
    if not install:
        if current is None:
            return [Change(path, Action.ABSENT)]
        text = uninstalled(current, path=path)
        if text is None:
            return [Change(path, Action.REMOVE, note="containerd-made", keep_folder=True)]
        if text == current:
            return [Change(path, Action.UNCHANGED, note="runtime-absent")]
        return [Change(path, Action.WRITE, text, "containerd-runtime-removed")]
    text, wrapped = installed(current, wrapper, path=path, default=default)
    if text == current:
        return [Change(path, Action.UNCHANGED, note="runtime-there")]
    note = "containerd-runtime-default" if default else "containerd-runtime-added"
    return [Change(path, Action.WRITE, text, note, detail=wrapped)]


def nvidia_in_place(host: ContainerHost) -> bool:
    """NVIDIA's runtime installed and set up as a runtime of docker's or containerd's CRI."""
    if wrapped_runtime.find(wrapped_runtime.NVIDIA) is None:
        return False
    programs: list[str] = []
    if host.daemon_json is not None:
        runtimes = read_daemon_json(host.daemon_json).get("runtimes", {})
        for entry in runtimes.values() if isinstance(runtimes, dict) else ():
            programs.append(str(entry.get("path", "")) if isinstance(entry, dict) else "")
    if host.containerd_config is not None:
        text = read_containerd_config(host.containerd_config)
        if text is not None:
            programs += nvidia_binaries(parse(text, host.containerd_config))
    return any(os.path.basename(p) == wrapped_runtime.NVIDIA for p in programs)


def nvidia_binaries(data: Table) -> list[str]:
    found = []
    for cri in CRI.values():
        for runtime in table_at(data, (*cri, "runtimes")).values():
            options = runtime.get("options") if isinstance(runtime, dict) else None
            binary = options.get("BinaryName") if isinstance(options, dict) else None
            if isinstance(binary, str) and binary:
                found.append(binary)
    return found


def plan_record(host: ContainerHost, *, install: bool, nvidia: bool) -> list[Change]:
    if host.daemon_json is None and host.containerd_config is None:
        return []
    name = wrapped_runtime.NVIDIA if nvidia else wrapped_runtime.RUNC
    text = wrapped_runtime.record_text(name) if install else None
    return [changing(host.runtime_record, text, "runs", name)]


def wrapper_beside(gpugate: str) -> str:
    """gpugate-oci-runtime from the same installation as gpugate (a venv's bin/, /usr/bin)."""
    for folder in (Path(gpugate).parent, Path(os.path.realpath(gpugate)).parent):
        candidate = folder / WRAPPER
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise InstallError(f"no {WRAPPER} beside {gpugate}: install gpugate's package whole")


def reload_docker() -> str:
    systemctl = find_program("systemctl")
    if systemctl is None:
        return "docker not reloaded (no systemctl): run `systemctl reload docker`"
    try:
        active = run_program([systemctl, "is-active", "--quiet", "docker.service"], 10)
        if active.returncode != 0:
            return "docker is not running: it reads daemon.json when it starts"
        result = run_program([systemctl, "reload", "docker.service"], PROGRAM_TIMEOUT_S)
    except GateError as exc:
        detail = str(exc)
    else:
        if result.returncode == 0:
            return "reloaded docker (systemctl reload docker)"
        detail = f"`systemctl reload docker` failed: {result.first_line()}"
    raise InstallError(f"daemon.json written, but {detail}; run `systemctl reload docker`")


def changing(path: Path, text: str | None, note: str = "", detail: str = "") -> Change:
    """Writing text to path (None: removing it), unless it is so already."""
    if text is None:
        return Change(path, Action.REMOVE if path.exists() else Action.ABSENT)
    try:
        same = path.read_text(encoding="utf-8") == text
    except (OSError, UnicodeDecodeError):
        same = False
    return Change(path, Action.UNCHANGED if same else Action.WRITE, text, note, detail=detail)


RUNC_V2 = "io.containerd.runc.v2"
CRI: dict[int, tuple[str, ...]] = {
    2: ("plugins", "io.containerd.grpc.v1.cri", "containerd"),
    3: ("plugins", "io.containerd.cri.v1.runtime", "containerd"),
}
BEGIN = "# >>> gpugate: runtime gpugate (gpugate install --containers; uninstall takes it out)"
NO_EOL = " [the file ended without a newline]"
END = "# <<< gpugate"
WAS = "# gpugate install --default replaced: "
WAS_NONE = "# gpugate install --default added the next line"
MADE = "# gpugate install --containers made this file from `containerd config default` (sha256:"
DEFAULT_KEY = re.compile(r"^(\s*)default_runtime_name\s*=")
BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_CONFIG = 1 << 20

Table = dict[str, object]


def read_containerd_config(path: Path) -> str | None:
    """The config's text; None where missing; refused where untrusted, odd, large, not UTF-8."""
    found = untrusted(path)
    if found is not None:
        raise InstallError(f"{path}: {safe_files.untrusted_text(found)}")
    try:
        return read_capped(path, MAX_CONFIG).decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise InstallError(f"{path}: cannot read it ({exc}); nothing changed") from None


def parse(text: str, path: Path) -> Table:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InstallError(f"{path}: cannot be read as TOML ({exc}); nothing changed") from None


def cri_keys(data: Table, path: Path) -> tuple[str, ...]:
    version = data.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version not in CRI:
        raise InstallError(
            f"{path}: config version {for_error(str(version))}: gpugate edits versions 2 "
            "(containerd 1.6, 1.7) and 3 (2.x); `containerd config migrate` converts it; nothing "
            "changed"
        )
    return CRI[version]


def table_at(data: Table, keys: tuple[str, ...], *, make: bool = False) -> Table:
    here = data
    for key in keys:
        found = here.get(key)
        if not isinstance(found, dict):
            if not make:
                return {}
            found = here[key] = {}
        here = found
    return here


def strip(text: str, path: Path) -> str:
    """The text without gpugate's marks: its block taken out, a replaced line put back."""
    kept: list[str] = []
    lines = enumerate(text.splitlines(keepends=True), 1)
    for number, line in lines:
        if line.startswith(BEGIN):
            if not any(rest.rstrip("\n") == END for _, rest in lines):  # to the block's end
                raise InstallError(
                    f"{path}: line {number}: gpugate's block is opened and never closed "
                    f"(`{END}`); mend it by hand; nothing changed"
                )
            if NO_EOL in line and kept and kept[-1].endswith("\n"):
                kept[-1] = kept[-1][:-1]
        elif line.startswith(WAS):
            kept.append(line[len(WAS) :])
            next(lines, None)
        elif line.rstrip("\n") == WAS_NONE:
            next(lines, None)
        else:
            kept.append(line)
    return "".join(kept)


def header_of(line: str) -> tuple[str, ...] | None:
    """A `[table]` line's keys, as TOML reads them (quotes, spaces); None for any other line."""
    stripped = line.strip()
    if not stripped.startswith("[") or stripped.startswith("[["):
        return None
    try:
        data: object = tomllib.loads(stripped)
    except tomllib.TOMLDecodeError:
        return None
    keys: list[str] = []
    while isinstance(data, dict) and len(data) == 1:
        key, data = next(iter(data.items()))
        keys.append(key)
    return tuple(keys)


def wrapped_of(cri: Table, wrapper: str) -> tuple[str, Table]:
    """The CRI default runtime where it is runc's shim (NVIDIA's runtime is), else `runc`, and
    the runtime gpugate's table: a copy of it that runs the wrapper."""
    runtimes = table_at(cri, ("runtimes",))
    name = cri.get("default_runtime_name") or "runc"
    source = runtimes.get(str(name))
    if not isinstance(source, dict) or source.get("runtime_type", RUNC_V2) != RUNC_V2:
        name, source = "runc", runtimes.get("runc")
    source = source if isinstance(source, dict) else {}
    table: Table = {"runtime_type": RUNC_V2}
    table.update({k: v for k, v in source.items() if k not in ("runtime_type", "options")})
    options = source.get("options")
    table["options"] = {**(options if isinstance(options, dict) else {}), "BinaryName": wrapper}
    return str(name), table


def dotted(keys: tuple[str, ...]) -> str:
    return ".".join(k if BARE_KEY.match(k) else toml_value(k) for k in keys)


def value_text(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{dotted((k,))} = {value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(value_text(item) for item in value) + "]"
    return toml_value(value)


def block(cri: tuple[str, ...], table: Table, *, default_table: bool, no_eol: bool) -> str:
    name = (*cri, "runtimes", RUNTIME_NAME)
    lines = ["\n" if no_eol else "", BEGIN + (NO_EOL if no_eol else "") + "\n"]
    if default_table:
        lines += [f"[{dotted(cri)}]\n", f'  default_runtime_name = "{RUNTIME_NAME}"\n']
    lines.append(f"[{dotted(name)}]\n")
    options = table.get("options")
    lines += [f"  {dotted((k,))} = {value_text(v)}\n" for k, v in table.items() if k != "options"]
    lines.append(f"[{dotted((*name, 'options'))}]\n")
    if isinstance(options, dict):
        lines += [f"  {dotted((k,))} = {value_text(v)}\n" for k, v in options.items()]
    return "".join(lines) + END + "\n"


def set_default(lines: list[str], cri: tuple[str, ...]) -> bool:
    """`default_runtime_name = "gpugate"` in the CRI table's own text, the line it replaces
    kept in a mark; False where the file has no `[...containerd]` header."""
    start = next((n for n, line in enumerate(lines) if header_of(line) == cri), None)
    if start is None:
        return False
    end = next((n for n in range(start + 1, len(lines)) if header_of(lines[n])), len(lines))
    indent = re.match(r"^\s*", lines[start]).group(0) + "  "  # type: ignore[union-attr]
    for number in range(start + 1, end):
        found = DEFAULT_KEY.match(lines[number])
        if found:
            original = lines[number] if lines[number].endswith("\n") else lines[number] + "\n"
            new = f'{found.group(1)}default_runtime_name = "{RUNTIME_NAME}"\n'
            lines[number : number + 1] = [WAS + original, new]
            return True
    lines[start + 1 : start + 1] = [
        WAS_NONE + "\n",
        f'{indent}default_runtime_name = "{RUNTIME_NAME}"\n',
    ]
    return True


def pruned(data: object) -> object:
    """Without empty tables (containerd reads a missing table and an empty one alike)."""
    if not isinstance(data, dict):
        return data
    kept = {k: pruned(v) for k, v in data.items()}
    return {k: v for k, v in kept.items() if v != {}}


def installed(current: str | None, wrapper: str, *, path: Path, default: bool) -> tuple[str, str]:
    """The config with the runtime gpugate (idempotent), and the runtime that one wraps."""
    base = containerd_default_config() if current is None else strip(current, path)
    data = parse(base, path)
    cri = cri_keys(data, path)
    cri_table = table_at(data, cri)
    if RUNTIME_NAME in table_at(cri_table, ("runtimes",)):
        raise InstallError(
            f"{path}: a runtime {RUNTIME_NAME} that gpugate install did not write is there; take "
            "it out first; nothing changed"
        )
    wrapped, table = wrapped_of(cri_table, wrapper)
    lines = base.splitlines(keepends=True)
    default_table = default and not set_default(lines, cri)
    body = "".join(lines)
    no_eol = bool(body) and not body.endswith("\n")
    text = body + block(cri, table, default_table=default_table, no_eol=no_eol)
    if current is None:
        text = f"{MADE}{hashlib.sha256(base.encode()).hexdigest()})\n{text}"
    table_at(data, (*cri, "runtimes"), make=True)[RUNTIME_NAME] = table  # as it should read
    if default:
        table_at(data, cri, make=True)["default_runtime_name"] = RUNTIME_NAME
    try:
        same = pruned(tomllib.loads(text)) == pruned(data)
    except tomllib.TOMLDecodeError:  # a table the file defined inline or by dotted keys
        same = False
    if not same:
        raise not_as_tables(path, cri)
    return text, wrapped


def uninstalled(current: str, *, path: Path) -> str | None:
    """The config as before install; None: install made it, remove it."""
    base = strip(current, path)
    data = parse(current, path)
    cri = cri_keys(data, path)
    before = parse(base, path)
    default = table_at(before, cri).get("default_runtime_name")
    if default == RUNTIME_NAME:
        raise InstallError(
            f"{path}: default_runtime_name is {RUNTIME_NAME}, not set by gpugate install: set "
            "another first (containerd would not start its pods); nothing changed"
        )
    if base == current:
        return current
    table_at(data, (*cri, "runtimes")).pop(RUNTIME_NAME, None)  # as before should read
    cri_table = table_at(data, cri)
    cri_table.pop("default_runtime_name", None)
    if default is not None:
        cri_table["default_runtime_name"] = default
    if pruned(before) != pruned(data):
        raise not_as_tables(path, cri)
    first, _, rest = base.partition("\n")
    if first.startswith(MADE):
        return None if first == f"{MADE}{hashlib.sha256(rest.encode()).hexdigest()})" else rest
    return base


def not_as_tables(path: Path, cri: tuple[str, ...]) -> InstallError:
    return InstallError(
        f"{path}: adding {dotted(cri)} as a table would change other settings (inline or "
        "dotted tables there); add it by hand (docs/containers.md); nothing changed"
    )
