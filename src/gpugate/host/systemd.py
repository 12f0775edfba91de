"""systemd units: names, cgroups, environment, and what a unit sets itself, from `systemctl cat`
(`systemctl show` cannot tell a unit's own value from a default). Where gpugate looks (tests: the
hidden `--host-roots`, never the environment, which the unit sets), and the cgroup2 tree systemd
tracks units in: unified or hybrid; a v1-only host is refused before anything is killed."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from gpugate.errors import ConfigError, GateError, HostUnsupported, UnknownUnit
from gpugate.host.safe_files import find_program, read_capped, run_program
from gpugate.untrusted import CGROUP, FILE, for_error, printable

UNIT_SUFFIXES = (".service", ".scope")
# systemd's allowed unit name characters; anything else arrives \xNN-escaped.
# \Z, not $: $ also matches before a final newline, and "vllm.service\n" is no unit name.
UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.\\@-]+\.(service|scope)\Z")
USER_SLICE_NAME = re.compile(r"user-[0-9]+\.slice")
USER_MANAGER = re.compile(r"user@[0-9]+\.service")
# Every unit type systemd knows: a name ending in none of them is a service to systemctl.
UNIT_TYPES = "service socket target device mount automount swap timer path slice scope"
UNIT_TYPE_SUFFIXES = tuple(f".{kind}" for kind in UNIT_TYPES.split())


def unit_argument(name: str) -> str:
    """A unit named on the command line, as systemctl reads it: `vllm` is `vllm.service`."""
    return name + ".service" if name and not name.endswith(UNIT_TYPE_SUFFIXES) else name


def validate_unit_name(name: str) -> str:
    given = for_error(name, limit=CGROUP.chars)  # what the caller typed, escaped and bounded
    if len(name) > 255 or not UNIT_NAME.match(name):
        raise UnknownUnit(
            f"unit {given}: not a valid service or scope unit name (pass %n from the unit file)"
        )
    if name.startswith("@") or name.count("@") > 1:
        raise UnknownUnit(f"unit {given}: not a valid unit name")
    prefix, at, instance = name.rpartition(".")[0].partition("@")
    if at and not instance:
        raise UnknownUnit(f"unit {given}: a template; name an instance, e.g. {prefix}@0.service")
    return name


def cgroup_parts(cgroup: str) -> list[str]:
    return [part for part in cgroup.split("/") if part]


def parse_cgroup(text: str) -> str | None:
    """The cgroup v2 path of a /proc/PID/cgroup text (its `0::` line)."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].removesuffix(" (deleted)")
    return None


def unit_of_cgroup(cgroup: str) -> str | None:
    """The system unit whose cgroup holds this one: the first component that is not a slice.
    Only PID 1 makes slices and the units in them; below a unit the tree is the unit's own (its
    Delegate= subtree, a user manager's units): a name there names no system unit."""
    for part in cgroup_parts(cgroup):
        if not part.endswith(".slice"):
            return part if part.endswith(UNIT_SUFFIXES) else None
    return None


def is_user_cgroup(cgroup: str) -> bool:
    """Login sessions and user managers (`user.slice`, `user-UID.slice`, `user@UID.service`)."""
    for part in cgroup_parts(cgroup):
        if part == "user.slice" or USER_SLICE_NAME.fullmatch(part):
            return True
        if not part.endswith(".slice"):
            return USER_MANAGER.fullmatch(part) is not None
    return False


def system_unit_of_cgroup(cgroup: str) -> str | None:
    """unit_of_cgroup for a cgroup outside every account's own tree (None under user.slice)."""
    return None if is_user_cgroup(cgroup) else unit_of_cgroup(cgroup)


def own_unit(proc_root: Path = Path("/proc")) -> str | None:
    """The service whose cgroup this process runs in (systemd runs ExecStartPre= there)."""
    try:
        text = (proc_root / "self" / "cgroup").read_text()
    except OSError:
        return None
    unit = system_unit_of_cgroup(parse_cgroup(text) or "/")
    return unit if unit and unit.endswith(".service") else None


def systemd_running() -> bool:
    return os.path.isdir("/run/systemd/system")


class UnitState(NamedTuple):
    load_state: str  # loaded, not-found, masked, ...
    active_state: str
    control_group: str | None


SYSTEMCTL_TIMEOUT_S = 30
ENVIRONMENT_FILE_MAX_BYTES = 1 << 20  # an EnvironmentFile= read for its warnings: capped


def systemctl_show(name: str, properties: str) -> str | None:
    """`systemctl show --property=PROPERTIES -- NAME`'s output; None where no systemd runs,
    systemctl is missing, or it failed. An unknown unit is `LoadState=not-found`, exit 0."""
    return _systemctl("show", f"--property={properties}", "--", name)


def _systemctl(*args: str) -> str | None:
    systemctl = find_program("systemctl")
    if not systemd_running() or systemctl is None:
        return None
    result = run_program([systemctl, *args], SYSTEMCTL_TIMEOUT_S)
    return result.stdout if result.returncode == 0 else None


def query_unit(name: str) -> UnitState | None:
    shown = systemctl_show(name, "LoadState,ActiveState,ControlGroup")
    if shown is None:
        return None
    props = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    # An inactive unit's "ControlGroup=" (named with --property) and a missing line: unset.
    group = props.get("ControlGroup") or None
    return UnitState(props.get("LoadState", ""), props.get("ActiveState", ""), group)


def active_state(name: str) -> str | None:
    state = query_unit(name)
    return state.active_state if state is not None else None


def find_unit_cgroup(name: str, cgroup_root: Path) -> str | None:
    """The system unit's cgroup, searched through slices only (where systemd is not there to
    ask), so no cgroup below a unit (a user manager's unit of the same name) is taken for it."""
    pending = [cgroup_root]
    while pending:
        folder = pending.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError:
            continue
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            relative = "/" + os.path.relpath(entry.path, cgroup_root)
            if entry.name == name and system_unit_of_cgroup(relative) == name:
                return relative
            if entry.name.endswith(".slice") and not is_user_cgroup(relative):
                pending.append(Path(entry.path))
    return None


def resolve_unit_cgroup(name: str, cgroup_root: Path, *, ask_systemd: bool = True) -> str:
    """The unit's cgroup path (it may not exist while the unit is inactive)."""
    state = query_unit(name) if ask_systemd else None
    if state is not None:
        if state.load_state == "not-found":
            raise UnknownUnit(f"unit {name}: systemd knows no such unit", code="unit-unknown")
        if state.control_group:
            return state.control_group
    found = find_unit_cgroup(name, cgroup_root)
    if found:
        return found
    if name.endswith(".service") and "@" in name:
        return f"/system.slice/system-{name.split('@', 1)[0]}.slice/{name}"
    return f"/system.slice/{name}"


def unit_active_state(name: str, cgroup_root: Path, *, ask_systemd: bool = True) -> str | None:
    """systemd's ActiveState; unasked, "active" while its cgroup holds a process."""
    state = query_unit(name) if ask_systemd else None
    if state is not None:
        return "not-found" if state.load_state == "not-found" else state.active_state
    found = find_unit_cgroup(name, cgroup_root)
    if found is None:
        return "inactive"
    for directory, _, files in os.walk(cgroup_root / found.lstrip("/")):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                if Path(directory, "cgroup.procs").read_text().split():
                    return "active"
    return "inactive"


class UnitEnvironment(NamedTuple):
    """The environment systemd gives the unit's processes: Environment=, then each
    EnvironmentFile= in order (later settings win), as `systemctl show` resolves them."""

    variables: dict[str, str]
    origins: Mapping[str, str] = {}  # variable -> its EnvironmentFile=

    def origin(self, variable: str) -> str:
        return self.origins.get(variable, "Environment=")


def environment_files(shown: str) -> list[tuple[str, bool]]:
    """(path, ignore_errors) of each EnvironmentFile= in `systemctl show`'s "PATH
    (ignore_errors=no)" lines; a leading "-" in the unit shows as ignore_errors=yes."""
    found = []
    for line in shown.splitlines():
        key, _, value = line.partition("=")
        if key == "EnvironmentFiles" and value:
            path, _, flags = value.rpartition(" (ignore_errors=")
            found.append((path or value, flags.startswith("yes")))
    return found


def unit_environment(
    name: str, show: Callable[[str], str | None] | None = None
) -> UnitEnvironment | None:
    """From `systemctl show`; None where systemd cannot be asked. show: its output (tests')."""
    text = show(name) if show else systemctl_show(name, "Environment,EnvironmentFiles")
    if text is None:
        return None
    import shlex  # noqa: PLC0415 - a unit's own GPU list only (gpus = "auto")

    variables: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key != "Environment":
            continue
        try:  # systemctl show quotes an assignment holding spaces or quotes, C-style (246+)
            items = shlex.split(value, posix=True)
        except ValueError:
            items = value.split()
        for variable, eq, setting in (item.partition("=") for item in items):
            if eq and variable:
                variables[variable] = setting
    origins: dict[str, str] = {}
    for path, ignore in environment_files(text):
        try:
            # systemd follows the file's links; a FIFO or a huge file is refused, not read.
            data = read_capped(path, ENVIRONMENT_FILE_MAX_BYTES, follow_links=True)
            parsed = parse_environment_file(data.decode("utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            if ignore:
                continue
            raise UnknownUnit(
                f"unit {name}: EnvironmentFile={printable(str(path), FILE)}: cannot read it "
                f"({exc}); systemd would not start the unit either"
            ) from None
        variables.update(parsed)
        origins.update(dict.fromkeys(parsed, f"EnvironmentFile={path}"))
    return UnitEnvironment(variables, origins)


def parse_environment_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd reads an EnvironmentFile=: comments (# ;), an optional
    `export `, single or double quotes, a backslash at the end of a line continues it, and
    ${KEY} or $KEY naming a variable set earlier in the same file."""
    variables: dict[str, str] = {}
    pending = ""
    for raw in [*text.splitlines(), ""]:  # the "": a last line left continued ends there
        if raw.endswith("\\") and not raw.endswith("\\\\"):
            pending += raw[:-1]
            continue
        line = (pending + raw).strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        key, eq, value = line.removeprefix("export ").lstrip().partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not ENV_NAME.fullmatch(key):
            continue
        if len(value) >= 2 and value[0] == value[-1] == "'":
            variables[key] = value[1:-1]
            continue
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r'\\(["\\`$])', r"\1", value[1:-1])
        else:
            value = value.split(" #", 1)[0].rstrip()
        variables[key] = ENV_REFERENCE.sub(lambda m: variables.get(m[1] or m[2], ""), value)
    return variables


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


# Where systemd looks for system units, highest priority first (systemd.unit(5)).
UNIT_DIRS = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/run/systemd/transient",
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
)
OWN_DROPIN = "gpugate.conf"
DEV_SHM = "/dev/shm"


class Setting(NamedTuple):
    key: str
    value: str
    path: str


class UnitSettings(NamedTuple):
    """The [Service] assignments of the unit that gpugate's drop-in would otherwise set."""

    start_timeout: Setting | None = None  # TimeoutStartSec= or TimeoutSec=
    stop_timeout: Setting | None = None  # TimeoutStopSec= or TimeoutSec=
    notify_access: Setting | None = None
    own_shm: Setting | None = None  # a TemporaryFileSystem= entry on /dev/shm


SETTING_FIELDS = {  # the UnitSettings fields each key sets
    "TimeoutStartSec": ("start_timeout",),
    "TimeoutStopSec": ("stop_timeout",),
    "TimeoutSec": ("start_timeout", "stop_timeout"),
    "NotifyAccess": ("notify_access",),
}


def parse_unit_settings(text: str) -> UnitSettings:
    """The settings in `systemctl cat` text. Later assignments win, an empty one resets;
    gpugate's own drop-in (OWN_DROPIN in a `.d` folder) is left out."""
    found: dict[str, Setting | None] = {}
    for path, key, value in _assignments(text):
        for name in SETTING_FIELDS.get(key, ()):
            found[name] = Setting(key, value, path) if value else None
        if key != "TemporaryFileSystem":
            continue
        if not value:  # a list: an empty assignment clears it, others add to it
            found["own_shm"] = None
        for entry in value.split():
            if os.path.normpath(entry.split(":", 1)[0].lstrip("-")) == DEV_SHM:
                found["own_shm"] = Setting(key, entry, path)
                break
    return UnitSettings(**found)


def _assignments(text: str) -> Iterator[tuple[str, str, str]]:
    """(file, key, value) of each [Service] assignment, continuation lines joined."""
    path, section, skip, pending, previous = "", "", False, "", ""
    for raw in text.splitlines():
        header = raw.startswith("# /") and " " not in raw[2:] and not previous.strip()
        previous = raw
        if header and not pending:  # systemctl cat's file header: after a blank line
            path, section = raw[2:].strip(), ""
            skip = os.path.basename(path) == OWN_DROPIN and path.rsplit("/", 2)[-2].endswith(".d")
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if skip or not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service" and "=" in line:
            key, _, value = line.partition("=")
            yield path, key.strip(), value.strip()


def read_unit(unit: str, systemd_dir: Path, *, ask_systemd: bool) -> str:
    """The unit's files as `systemctl cat` shows them: systemd's answer where it runs, else
    the files in every unit folder; without ask_systemd, the files in systemd_dir only."""
    if not ask_systemd:
        return files_text(unit, [str(systemd_dir)])
    with contextlib.suppress(GateError):
        answer = _systemctl("cat", "--no-pager", "--", unit)
        if answer is not None:
            return answer
    return files_text(unit, UNIT_DIRS)


def files_text(unit: str, dirs: Sequence[str]) -> str:
    """`systemctl cat` made by hand: the first unit file found (else an instance's
    template's), then the drop-ins of UNIT.d/ and the template's, by file name, a name in an
    earlier folder hiding the same name in later ones."""
    names = [unit]
    if "@" in unit and not unit.endswith("@.service"):
        names.append(unit.split("@", 1)[0] + "@.service")
    mains = [f"{d}/{n}" for n in names for d in dirs if os.path.isfile(f"{d}/{n}")]
    chunks = [_chunk(main) for main in mains[:1]]
    dropins: dict[str, str] = {}
    for name in reversed(names):  # the template's drop-ins apply before the instance's
        for folder in dirs:
            for path in sorted(Path(folder, name + ".d").glob("*.conf")):
                dropins.setdefault(f"{name}/{path.name}", str(path))
    ordered = sorted(dropins.items(), key=lambda item: item[0].rsplit("/", 1)[1])
    chunks.extend(_chunk(path) for _, path in ordered)
    return "".join(chunks)


def _chunk(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return f"# {path}\n{text}\n"


SYSTEM_CGROUP_ROOT = Path("/sys/fs/cgroup")
HYBRID_UNIFIED_ROOT = SYSTEM_CGROUP_ROOT / "unified"
HOST_ROOTS_OPTION = "--host-roots"


class HostRoots(NamedTuple):
    dev: Path = Path("/dev")
    proc: Path = Path("/proc")
    cgroup: Path = SYSTEM_CGROUP_ROOT
    run: Path = Path("/run")  # where the config cache is kept (integrations.config_files)

    @property
    def ask_systemd(self) -> bool:
        """systemd's answers (a unit's ControlGroup) name paths in the real tree only."""
        return self.cgroup in (SYSTEM_CGROUP_ROOT, HYBRID_UNIFIED_ROOT)

    @classmethod
    def parse(cls, text: str) -> HostRoots:
        """`dev=DIR,proc=DIR,cgroup=DIR,run=DIR` (any of them; the rest stay the real ones)."""
        roots: dict[str, Path] = {}
        for item in text.split(","):
            name, eq, value = item.partition("=")
            if not eq or name not in cls._fields:
                shown = f"{for_error(item)}: not dev=DIR, proc=DIR, cgroup=DIR or run=DIR"
                raise ConfigError(HOST_ROOTS_OPTION, "", shown)
            path = Path(value)
            if not path.is_absolute():
                raise ConfigError(
                    HOST_ROOTS_OPTION, name, f"{for_error(value)} is not an absolute path"
                )
            roots[name] = path
        found = cls(**roots)
        for name, root in found._asdict().items():  # not there: a config error, not a crash
            if not root.is_dir():
                raise ConfigError(
                    HOST_ROOTS_OPTION, name, f"{for_error(str(root), quote=False)}: no such folder"
                )
        return found


UNIFIED = "unified"
HYBRID = "hybrid"
LEGACY = "legacy"


class CgroupLayout(NamedTuple):
    kind: str  # UNIFIED, HYBRID or LEGACY
    unified_mount: PurePosixPath | None  # where systemd's unit tree is; None on a legacy host


def mount_table(mountinfo: str) -> dict[str, str]:
    """Mount point -> file system type of each mountinfo line (a later mount on the same point
    hides an earlier one). Points are unescaped: mountinfo writes space, tab, newline and
    backslash as octal (\\040, \\011, \\012, \\134)."""
    table: dict[str, str] = {}
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, fstype = before.split(), after.split()[:1]
        if len(fields) < 5 or not fstype:
            continue
        point = fields[4]
        for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            point = point.replace(code, char)
        table[point] = fstype[0]
    return table


def cgroup_layout(mountinfo: str) -> CgroupLayout:
    """A cgroup2 mounted anywhere else (by hand, by a container runtime) is no tree systemd puts
    units in: its paths would name no unit."""
    fstype_at = mount_table(mountinfo)
    for kind, root in ((UNIFIED, SYSTEM_CGROUP_ROOT), (HYBRID, HYBRID_UNIFIED_ROOT)):
        if fstype_at.get(str(root)) == "cgroup2":
            return CgroupLayout(kind, PurePosixPath(root))
    return CgroupLayout(LEGACY, None)


def host_cgroup_layout(roots: HostRoots) -> CgroupLayout | None:
    """This host's layout where the cgroup root is the real one; None for a stand-in tree."""
    if roots.cgroup != SYSTEM_CGROUP_ROOT:
        return None
    mountinfo = roots.proc / "self" / "mountinfo"
    try:
        text = mountinfo.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise HostUnsupported(
            f"cannot read {mountinfo} ({exc.strerror}): gpugate cannot tell which cgroup tree "
            "this host tracks its units in; nothing was killed"
        ) from None
    return cgroup_layout(text)


def on_units_tree(
    roots: HostRoots, layout: Callable[[HostRoots], CgroupLayout | None] = host_cgroup_layout
) -> HostRoots:
    """roots with the cgroup root moved to the tree systemd tracks units in (hybrid: `unified`);
    a stand-in tree (no layout) as it is."""
    found = layout(roots)
    if found is None:
        return roots
    if found.unified_mount is None:  # LEGACY
        raise HostUnsupported(
            f"this host's cgroups are v1 only (no cgroup2 at {SYSTEM_CGROUP_ROOT} or "
            f"{HYBRID_UNIFIED_ROOT}): gpugate finds a unit's processes in the unified hierarchy "
            "(cgroup v2), which this host lacks; nothing was killed. Boot with "
            "systemd.unified_cgroup_hierarchy=1 on the kernel command line (RHEL 8: grubby "
            '--update-kernel=ALL --args="systemd.unified_cgroup_hierarchy=1"), then reboot'
        )
    unified = roots.cgroup / found.unified_mount.relative_to(SYSTEM_CGROUP_ROOT)
    if not unified.is_dir():
        raise HostUnsupported(
            f"this host's cgroup2 tree {found.unified_mount} is not at {unified}: gpugate "
            "cannot find its units' processes; nothing was killed"
        )
    return roots._replace(cgroup=unified)
