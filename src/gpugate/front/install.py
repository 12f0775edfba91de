"""`gpugate install|uninstall UNIT`: put gpugate on a unit (a drop-in and a config skeleton)
and take it off again; `--sweep`: gpugate-sweep.timer on or off. A file install wrote records
the SHA-256 of its rest in a header; one that no longer matches is the operator's: kept, or
replaced/removed only with --force. The hook lines run Python -I (docs/hardening.md)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import NamedTuple, TextIO

from gpugate.config import values
from gpugate.config.file import DEFAULT_CONFIG_DIR, parse_config, toml_value
from gpugate.config.schema import DEFAULTS, GateConfig, PhasePolicy
from gpugate.errors import GateError, InstallError, PermissionDenied, UnknownUnit
from gpugate.host.safe_files import (
    SYSTEM_PATH,
    Result,
    find_program,
    run_program,
    write_atomically,
)
from gpugate.host.systemd import (
    Setting,
    UnitSettings,
    UnitState,
    parse_unit_settings,
    query_unit,
    read_unit,
    systemd_running,
    validate_unit_name,
)
from gpugate.report import lines
from gpugate.untrusted import for_error

DEFAULT_GPUGATE = Path("/usr/bin/gpugate")
SHEBANG_BYTES = 256


def gpugate_command(argv0: str | None = None, executable: str | None = None) -> tuple[str, ...]:
    """This gpugate: its launcher where the shebang isolates Python, else `PYTHON -I -m gpugate`."""
    script = os.path.abspath(argv0 if argv0 is not None else sys.argv[0])
    if isolates(script):
        return (script,)
    python = executable if executable is not None else sys.executable
    if not python or not os.path.isabs(python):
        return (str(DEFAULT_GPUGATE),)
    return (python, "-I", "-m", "gpugate")


def command_for(path: str) -> tuple[str, ...]:
    """--gpugate-path: a console script whose shebang lacks -I is run by its interpreter, -I."""
    python = (shebang(path) or [""])[0]
    python_script = os.path.basename(python).startswith("python") and os.path.isabs(python)
    return (python, "-I", path) if python_script and not isolates(path) else (path,)


def shebang(path: str) -> list[str] | None:
    """The words of path's `#!` line; None where it has none or cannot be read."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(SHEBANG_BYTES)
    except OSError:
        return None
    line = head[2:].split(b"\n", 1)[0] if head.startswith(b"#!") else b""
    return line.decode("utf-8", "replace").split() or None


def isolates(path: str) -> bool:
    """The shebang runs Python with -I (alone or among other one-letter flags: -sI, -IS)."""
    words = shebang(path) or []
    return any(w.startswith("-") and not w.startswith("--") and "I" in w for w in words[1:])


# The drop-in (units/gpugate.conf with @GPUGATE@ = /usr/bin/gpugate); every setting means the
# same on systemd 247 to 257 (docs/install.md).
DROPIN_TEMPLATE = """\
# gpugate on a GPU service: before each start and after each stop, find every process that
# holds the unit's GPUs, kill exactly those, and wait until NVML reports the memory freed.
# `gpugate install UNIT` puts it at /etc/systemd/system/UNIT.d/gpugate.conf; settings for the
# unit go to /etc/gpugate/UNIT.toml (`gpugate config check --unit UNIT`; man gpugate).
[Service]
# "+": run with full privileges even when the unit sets User=, ProtectSystem= or
# ProtectProc=: gpugate must see and signal other users' processes. %n: the unit's name.
ExecStartPre=+@GPUGATE@ pre %n
# Runs after every stop, a crash or a failed start included: reaps workers that outlived the
# main process and waits for the driver to release their memory before the unit is "inactive".
ExecStopPost=+@GPUGATE@ post %n
"""


# What follows the hooks, each left out where the unit sets it itself (install says which).
NOTIFY_BLOCK = """\
# Accept sd_notify messages from the hook processes, not only the main one: gpugate sends
# STATUS= (shown by `systemctl status`) and EXTEND_TIMEOUT_USEC= while it waits. (A unit whose
# own children must notify sets NotifyAccess=all itself: install then keeps it.)
NotifyAccess=exec
"""
TIMEOUT_COMMENT = """\
# Each covers a hook: SIGTERM grace + SIGKILL wait + the driver's release (gpugate's
# wait_timeout_s, 120 s by default) with room to spare. gpugate asks systemd for more time
# (EXTEND_TIMEOUT_USEC=) while it works, so a unit's own shorter timeout is kept, not replaced.
"""
SHM_BLOCK = """\
# The unit's own /dev/shm (private_shm in /etc/gpugate/UNIT.toml): the server's segments live
# in a tmpfs the kernel frees when the unit's last process ends, however it ends (a SIGKILL
# after TimeoutStopSec=, systemctl kill, a crash, a restart). private_shm = "off" and
# `gpugate install` again: the unit shares the host's /dev/shm (docs/shared-memory.md).
TemporaryFileSystem=/dev/shm:@OPTIONS@
"""
SHM_OPTIONS = "mode=1777,nosuid,nodev,size={size}"
HOOK_TIMEOUT_S = 300

# The fields the skeleton shows, each with its model's description as the comment above it.
CONFIG_FIELDS = (
    "gpus",
    "ports",
    "free_mib",
    "kill_other_units",
    "share_gpus",
    "protected_executables",
    "protected_units",
    "containers",
    "private_shm",
)

HEADER_TEXT = (
    "# Written by gpugate install (sha256:{digest}).\n"
    "# Edit freely: install and uninstall then leave it alone unless given --force.\n"
)
SAFE_PATH = re.compile(r"^/[A-Za-z0-9_.+/-]+$")
SAFE_FLAG = re.compile(r"^(-I|-m|gpugate)$")  # the words gpugate_command adds


class Ownership(Enum):
    ABSENT = "absent"
    OURS = "ours"  # written by gpugate install, unchanged since
    OPERATORS = "operator's"  # edited since, or never written by gpugate


def render_dropin(
    gpugate: Path | Sequence[str],
    unit: UnitSettings | None = None,
    private_shm: str = values.DEFAULT_PRIVATE_SHM,
) -> str:
    """The hooks, and what the unit does not set itself; its own /dev/shm unless "off"."""
    words = (str(gpugate),) if isinstance(gpugate, Path) else tuple(gpugate)
    for text in words:
        if not (SAFE_PATH.match(text) or SAFE_FLAG.match(text)) or "/../" in text:
            raise InstallError(
                f"--gpugate-path {text!r}: an absolute path of letters, digits and _.+/- only "
                "(it goes into ExecStartPre= unquoted)"
            )
    if not words or not SAFE_PATH.match(words[0]):
        raise InstallError(f"--gpugate-path {' '.join(words)!r}: not an absolute path")
    blocks, _ = dropin_settings(unit or UnitSettings(), private_shm)
    return DROPIN_TEMPLATE.replace("@GPUGATE@", " ".join(words)) + "".join(blocks)


def dropin_settings(unit: UnitSettings, private_shm: str) -> tuple[list[str], list[str]]:
    """The blocks the drop-in adds after its hooks, and install's line for each setting: the
    unit's own kept, or the drop-in's."""

    def kept(setting: Setting, why: str) -> str:
        return f"kept the unit's {setting.key}={setting.value} ({setting.path}): {why}"

    extends = "gpugate asks systemd for more time (EXTEND_TIMEOUT_USEC) only while it works"
    timeouts = {"TimeoutStartSec": unit.start_timeout, "TimeoutStopSec": unit.stop_timeout}
    said = [kept(setting, extends) for setting in timeouts.values() if setting is not None]
    unset = [key for key, setting in timeouts.items() if setting is None]
    blocks = [TIMEOUT_COMMENT, *(f"{key}={HOOK_TIMEOUT_S}\n" for key in unset)] if unset else []
    if unset:
        said.append(f"the unit sets no {' or '.join(unset)}: the drop-in sets {HOOK_TIMEOUT_S}s")
    notify = unit.notify_access
    if notify is not None and notify.value == "all":
        said.append(kept(notify, "it lets the hooks notify too"))
    else:
        blocks.insert(0, NOTIFY_BLOCK)  # before the timeouts
        if notify is not None:
            said.append(
                f"the unit's NotifyAccess={notify.value} ({notify.path}) "
                "is replaced by NotifyAccess=exec: the hooks must notify systemd"
            )
    if unit.own_shm is not None:
        said.append(kept(unit.own_shm, "the unit has a /dev/shm of its own already"))
    elif private_shm == values.PRIVATE_SHM_OFF:
        said.append('private_shm = "off": the unit shares the host\'s /dev/shm')
    else:
        blocks.append(SHM_BLOCK.replace("@OPTIONS@", SHM_OPTIONS.format(size=private_shm)))
        said.append(
            f"the unit gets a /dev/shm of its own (size={private_shm}; private_shm): "
            "its segments go with its last process"
        )
    return blocks, said


def render_config(
    unit: str,
    gpus: values.GpuSelection | None,
    containers: Sequence[str] = (),
    ports: Sequence[int] | None = None,
) -> str:
    """A commented skeleton of the defaults; the GPUs, containers and ports given set."""
    given = {"gpus": "auto" if gpus is None else gpus, "containers": containers, "ports": ports}
    lines = [
        f"# gpugate settings for {unit}. Each commented line shows the built-in default:",
        "# uncomment what you change. Check it: gpugate config check --unit " + unit,
        "",
    ]
    for name in CONFIG_FIELDS:
        value = given.get(name)
        setting = f"{name} = {toml_value(value)}" if name == "gpus" or value else None
        default = f"# {name} = {toml_value(getattr(DEFAULTS, name))}"
        lines += [f"# {GateConfig.model_fields[name].description}", setting or default]
    for phase in ("pre", "post"):
        lines += ["", f"[{phase}]", f"# {GateConfig.model_fields[phase].description}"]
        policy = getattr(DEFAULTS, phase)
        for name, field in PhasePolicy.model_fields.items():
            lines += [f"# {field.description}", f"# {name} = {toml_value(getattr(policy, name))}"]
    return "\n".join(lines) + "\n"


def with_header(body: str) -> str:
    return HEADER_TEXT.format(digest=hashlib.sha256(body.encode()).hexdigest()) + body


def ownership(path: Path) -> Ownership:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Ownership.ABSENT
    except UnicodeDecodeError:
        return Ownership.OPERATORS
    except PermissionError:
        raise PermissionDenied(f"{path}: permission denied reading it (run as root)") from None
    parts = text.split("\n", 2)  # HEADER_TEXT's two lines, and the rest
    first = with_header(parts[-1]).split("\n", 1)[0]  # the digest's line, for that rest
    return Ownership.OURS if len(parts) == 3 and parts[0] == first else Ownership.OPERATORS


DEFAULT_SYSTEMD_DIR = Path("/etc/systemd/system")
DROPIN_NAME = "gpugate.conf"
RELOAD_TIMEOUT_S = 120
PROGRAM_TIMEOUT_S = 60  # systemctl, `containerd config default`


class Action(Enum):
    """What apply does to a file; its value: the verb for a dry run and for the deed."""

    WRITE = ("would write", "wrote")
    UNCHANGED = ("unchanged", "unchanged")
    KEEP = ("would keep", "kept")  # the operator's file, left as it is
    REMOVE = ("would remove", "removed")
    ABSENT = ("not there", "not there")


class Change(NamedTuple):
    path: Path
    action: Action
    content: str | None = None  # what WRITE writes
    note: str = ""  # a code: CHANGE_NOTES words it
    said: tuple[str, ...] = ()  # lines under it (the unit's settings the drop-in keeps)
    detail: str = ""  # the note's fact (the runtime's path)
    keep_folder: bool = False  # REMOVE: leave the folder even where it is left empty


def targets(unit: str, systemd_dir: Path, config_dir: Path) -> tuple[Path, Path]:
    """Where install writes for a service or a service template (`vllm@.service`: the drop-in
    reaches every instance): the drop-in, the config."""
    if not unit.endswith(".service"):
        raise UnknownUnit(f"unit {unit!r}: gpugate installs on .service units (ExecStartPre=)")
    template = unit.endswith("@.service")
    validate_unit_name(unit.removesuffix("@.service") + "@instance.service" if template else unit)
    return systemd_dir / f"{unit}.d" / DROPIN_NAME, config_dir / f"{unit}.toml"


def parse_gpus(value: str) -> values.GpuSelection:
    """`--gpus 0,1,GPU-...` (or `--gpus all`) into the config's `gpus`; InvalidValue."""
    return "all" if value.strip() == "all" else values.parse_gpu_text(value)


def systemctl(*words: str, timeout_s: float = PROGRAM_TIMEOUT_S) -> Result:
    program = find_program("systemctl")
    if program is None:
        raise InstallError(
            f"files written, but no systemctl in {SYSTEM_PATH}: run `systemctl daemon-reload`"
        )
    try:
        return run_program([program, *words], timeout_s)
    except GateError as exc:
        raise InstallError(f"files written, but {exc}; run it yourself") from None


def systemctl_daemon_reload() -> bool:
    """Where systemd runs; elsewhere (an image being built, a chroot) there is nothing to do."""
    if not systemd_running():
        return False
    result = systemctl("daemon-reload", timeout_s=RELOAD_TIMEOUT_S)
    if result.returncode != 0:
        raise InstallError(
            f"files written, but `systemctl daemon-reload` failed: {result.first_line()}; "
            "run it yourself"
        )
    return True


def systemctl_or_fail(*words: str) -> None:
    """systemctl enable|disable of a unit gpugate ships; InstallError where it fails."""
    result = systemctl(*words)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout or "").strip().splitlines()
        said = for_error(detail[-1] if detail else "", quote=False)
        raise InstallError(f"`systemctl {words[0]} {words[-1]}` failed: {said}")


def plan_install(
    unit: str,
    *,
    gpus: values.GpuSelection | None = None,
    containers: Sequence[str] = (),
    ports: Sequence[int] | None = None,
    gpugate_path: Path | Sequence[str] = DEFAULT_GPUGATE,
    force: bool = False,
    systemd_dir: Path = DEFAULT_SYSTEMD_DIR,
    config_dir: Path = DEFAULT_CONFIG_DIR,
    query: Callable[[str], UnitState | None] | None = None,
) -> list[Change]:
    """What install would do; InstallError (nothing done) where it would change the operator's
    files without force. The unit's settings: `systemctl cat` for the real systemd_dir. A unit
    systemd does not know is most likely a typo: a warning with force, else UnknownUnit.
    private_shm comes from the unit's config."""
    dropin_path, config_path = targets(unit, systemd_dir, config_dir)
    real = systemd_dir == DEFAULT_SYSTEMD_DIR
    query = query_unit if query is None and real else query
    # systemd shows instances, not templates; the template's file may be anywhere
    state = query(unit) if query is not None and not unit.endswith("@.service") else None
    if state is not None and state.load_state == "not-found":
        unknown = f"unit {unit}: systemd knows no such unit (systemctl list-unit-files)"
        if not force:
            raise UnknownUnit(f"{unknown}; nothing changed; --force installs anyway")
        print(lines.warning(f"{unknown}; installing anyway (--force)"), file=sys.stderr)
    settings = parse_unit_settings(read_unit(unit, systemd_dir, ask_systemd=real))
    try:
        text = config_path.read_text(encoding="utf-8")
        private_shm = parse_config(text, str(config_path)).private_shm
    except FileNotFoundError:
        private_shm = values.DEFAULT_PRIVATE_SHM
    except OSError as exc:
        raise PermissionDenied(f"{config_path}: cannot read it ({exc.strerror})") from None
    dropin = with_header(render_dropin(gpugate_path, settings, private_shm))
    said = tuple(dropin_settings(settings, private_shm)[1])
    config = with_header(render_config(unit, gpus, containers, ports))
    untouched = gpus is None and not containers and not ports
    planned = {
        dropin_path: file_change(dropin_path, dropin, force=force, keep_edited=False, said=said),
        config_path: file_change(config_path, config, force=force, keep_edited=untouched),
    }
    refused = [str(path) for path, change in planned.items() if change is None]
    if refused:
        raise InstallError(
            f"{', '.join(refused)}: edited by you (or not written by gpugate install); nothing "
            "changed; --force replaces it"
        )
    return [change for change in planned.values() if change is not None]


def file_change(
    path: Path,
    content: str | None,
    *,
    force: bool = False,
    keep_edited: bool = True,
    said: tuple[str, ...] = (),
) -> Change | None:
    """Writing content (None: removing the file); None: the operator's file, refused."""
    owner = ownership(path)
    if owner is Ownership.OPERATORS and not force:
        note = "edited" if content is not None else "edited-removable"
        return Change(path, Action.KEEP, note=note) if keep_edited else None
    if content is None:
        return Change(path, Action.ABSENT if owner is Ownership.ABSENT else Action.REMOVE)
    if owner is Ownership.OURS and path.read_text(encoding="utf-8") == content:
        return Change(path, Action.UNCHANGED, said=said)
    note = "edited-forced" if owner is Ownership.OPERATORS else ""
    return Change(path, Action.WRITE, content, note, said)


def plan_uninstall(
    unit: str,
    *,
    force: bool = False,
    systemd_dir: Path = DEFAULT_SYSTEMD_DIR,
    config_dir: Path = DEFAULT_CONFIG_DIR,
) -> list[Change]:
    """What uninstall would do; InstallError where the drop-in is the operator's (no force)."""
    dropin_path, config_path = targets(unit, systemd_dir, config_dir)
    dropin = file_change(dropin_path, None, force=force, keep_edited=False)
    if dropin is None:
        raise InstallError(
            f"{dropin_path}: edited by you (or not written by gpugate install); nothing changed; "
            "--force removes it"
        )
    config = file_change(config_path, None, force=force)
    assert config is not None  # kept where edited
    return [dropin, config]


def apply(
    changes: Sequence[Change],
    *,
    dry_run: bool = False,
    reload: Callable[[], bool] | None = systemctl_daemon_reload,
    out: TextIO | None = None,
) -> bool:
    """Carry out a plan (dry_run: print it); True when a unit's file changed and reload (None:
    none, and nothing said) was called."""
    stream = out if out is not None else sys.stdout
    for change in changes:
        verb = change.action.value[0 if dry_run else 1]
        noted = CHANGE_NOTES[change.note].format(detail=change.detail) if change.note else ""
        print(f"{verb} {change.path}{f' ({noted})' if noted else ''}", file=stream)
        for said in change.said:
            print(f"  {said}", file=stream)
        shown = change.content if dry_run and change.action is Action.WRITE else None
        for line in (shown or "").splitlines():
            print(f"    {line}", file=stream)
        if dry_run:
            continue
        try:
            if change.action is Action.WRITE:
                mode = 0o644  # a new file
                with contextlib.suppress(OSError):
                    mode = stat.S_IMODE(os.lstat(change.path).st_mode)
                assert change.content is not None
                write_atomically(change.path, change.content, mode)
            elif change.action is Action.REMOVE:
                change.path.unlink(missing_ok=True)
                if not change.keep_folder:  # not empty (other drop-ins, configs): stays
                    with contextlib.suppress(OSError):
                        change.path.parent.rmdir()
        except PermissionError as exc:
            raise PermissionDenied(
                f"{exc.filename or change.path}: permission denied (run as root)"
            ) from None
    written = {c.path.name for c in changes if c.action in (Action.WRITE, Action.REMOVE)}
    if dry_run or reload is None or not written & {DROPIN_NAME, SERVICE, TIMER, NRI_SERVICE}:
        return False
    print(RELOADED[reload()], file=stream)
    return True


RELOADED = {
    True: "reloaded systemd (systemctl daemon-reload)",
    False: "systemd not reloaded (not running here, or --no-reload)",
}


CHANGE_NOTES = {
    "edited": "yours (edited): kept",
    "edited-removable": "yours (edited): kept; --force removes",
    "edited-forced": "replacing your edited file (--force)",
    "runtime-there": "runtime gpugate there",
    "runtime-added": "runtime gpugate: {detail}; every other key kept",
    "runtime-absent": "no runtime gpugate",
    "runtime-removed": "runtime gpugate taken out; every other key kept",
    "containerd-runtime-added": "runtime gpugate with {detail}'s settings; every other line kept",
    "containerd-runtime-default": (
        "runtime gpugate with {detail}'s settings, the CRI default; every other line kept"
    ),
    "containerd-runtime-removed": "runtime gpugate taken out; every other line as it was",
    "containerd-made": "made by gpugate install from `containerd config default`",
    "runs": "gpugate-oci-runtime runs {detail}",
}


SERVICE = "gpugate-sweep.service"
TIMER = "gpugate-sweep.timer"
NRI_SERVICE = "gpugate-nri.service"
PACKAGED_DIR = Path("/usr/lib/systemd/system")

TEMPLATES = {  # the unit files gpugate ships, @GPUGATE@ its command
    SERVICE: """\
# gpugate sweep: between starts, find GPU memory that no unit, job or container owns, say so
# in the journal and the metrics textfile, and reap it where [sweep] reap_after_s allows.
# Started by gpugate-sweep.timer; `gpugate install --sweep` enables that (man gpugate).
[Unit]
# What `systemctl status` shows.
Description=gpugate sweep: GPU memory nobody owns
Documentation=man:gpugate(1)

[Service]
# One sweep, then exit: the timer starts the next.
Type=oneshot
ExecStart=@GPUGATE@ sweep
# The sweep's own STATUS= line (how many unowned holders, on which GPUs).
NotifyAccess=main
# A reap waits as pre does (wait_timeout_s, 120 s by default); a look takes seconds.
TimeoutStartSec=300
""",
    TIMER: f"""\
# Runs gpugate-sweep.service once a minute. reap_after_s and drain_after_s below this
# interval are config errors: a holder must be seen unowned by two sweeps.
[Unit]
# What `systemctl list-timers` shows.
Description=gpugate sweep once a minute
Documentation=man:gpugate(1)

[Timer]
# A minute after boot, then a minute after each sweep began.
OnBootSec={values.SWEEP_INTERVAL_S}
OnUnitActiveSec={values.SWEEP_INTERVAL_S}
# The default AccuracySec= (a minute) would let sweeps drift up to two minutes apart.
AccuracySec=1s

[Install]
# Enabled by `gpugate install --sweep`, not by the package.
WantedBy=timers.target
""",
    NRI_SERVICE: """\
# gpugate's NRI plugin (docs/containers.md, NRI): containerd's (1.7+) or CRI-O's NRI must be
# on; the runtime's config is not touched.
[Unit]
# What `systemctl status` shows.
Description=gpugate NRI plugin: containers' GPUs gated at CreateContainer
Documentation=man:gpugate(1)
# It connects again by itself whenever the runtime restarts.
After=containerd.service crio.service

[Service]
ExecStart=@GPUGATE@ nri
Restart=always
RestartSec=2
# A container's post runs in a child of the plugin, in the background: a stop or restart of
# the plugin lets it finish (each is bounded by [post].wait_timeout_s).
KillMode=process

[Install]
# Enabled by `gpugate install --nri`, not by the package.
WantedBy=multi-user.target
""",
}


SHIPPED = {  # each unit install enables: its files, and what disabling and enabling it say
    TIMER: (
        (SERVICE, TIMER),
        "disabled gpugate-sweep.timer: no more sweeps",
        "enabled gpugate-sweep.timer: a gpugate sweep every minute",
    ),
    NRI_SERVICE: (
        (NRI_SERVICE,),
        "disabled gpugate-nri.service: the runtime's containers are no longer gated",
        "enabled gpugate-nri.service: it gates containers once the runtime's NRI is on "
        "(docs/containers.md, NRI)",
    ),
}


def plan_shipped(
    unit: str, systemd_dir: Path, command: Sequence[str], *, installing: bool
) -> list[Change]:
    """unit's files (the timer's service too) in systemd_dir, running command; none where the
    package carries them. One edited since is kept."""
    if all((PACKAGED_DIR / name).exists() for name in SHIPPED[unit][0]):
        return []
    changes = []
    for name in SHIPPED[unit][0]:
        body = TEMPLATES[name].replace("@GPUGATE@", " ".join(command))
        change = file_change(systemd_dir / name, with_header(body) if installing else None)
        changes += [change] if change is not None else []
    return changes
