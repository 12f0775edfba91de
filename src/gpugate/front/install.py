"""`gpugate install|uninstall UNIT`: put gpugate on a unit (a drop-in and a config skeleton)
and take it off again.

Plans the changes and applies them. The texts and their ownership header are `install_files`:
a file that is the operator's is never replaced or removed without `force` (the drop-in), and
the config (meant to be edited) is kept.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TextIO

from gpugate.config.file import DEFAULT_CONFIG_DIR, parse_config
from gpugate.config.gpulist import parse_gpu_text
from gpugate.config.values import CONTAINER_NAME, DEFAULT_PRIVATE_SHM
from gpugate.errors import (
    GateError,
    InstallError,
    InvalidValue,
    PermissionDenied,
    UnknownUnit,
)
from gpugate.front.install_files import (
    DEFAULT_GPUGATE,
    HOOK_TIMEOUT_S,
    Gpus,
    Ownership,
    ownership,
    render_config,
    render_dropin,
    with_header,
)
from gpugate.host.safe_files import SYSTEM_PATH, find_program, run_program, write_atomically
from gpugate.host.systemd import (
    UnitState,
    parse_unit_settings,
    query_unit,
    read_unit,
    systemd_running,
    validate_unit_name,
)
from gpugate.report import lines
from gpugate.report.narrate_install import kept_lines
from gpugate.untrusted import echo

DEFAULT_SYSTEMD_DIR = Path("/etc/systemd/system")
DROPIN_NAME = "gpugate.conf"
RELOAD_TIMEOUT_S = 120


class Action(Enum):
    WRITE = "write"
    UNCHANGED = "unchanged"
    KEEP = "keep"  # the operator's file, left as it is
    REMOVE = "remove"
    ABSENT = "absent"


@dataclass(frozen=True)
class Change:
    path: Path
    action: Action
    content: str | None = None  # what WRITE writes
    note: str = ""  # a code: report.lines.CHANGE_NOTES words it
    said: tuple[str, ...] = ()  # lines under it (the unit's settings the drop-in keeps)
    detail: str = ""  # the note's fact (the runtime's path)
    keep_folder: bool = False  # REMOVE: leave the folder even where it is left empty


@dataclass(frozen=True)
class Targets:
    """Where install writes for one unit."""

    dropin: Path
    config: Path

    @classmethod
    def of(cls, unit: str, systemd_dir: Path, config_dir: Path) -> Targets:
        return cls(systemd_dir / f"{unit}.d" / DROPIN_NAME, config_dir / f"{unit}.toml")


def validate_install_unit(unit: str) -> str:
    """A service or a service template (`vllm@.service`: the drop-in reaches every instance)."""
    if not unit.endswith(".service"):
        raise UnknownUnit(f"unit {unit!r}: gpugate installs on .service units (ExecStartPre=)")
    if unit.endswith("@.service"):
        validate_unit_name(unit.removesuffix("@.service") + "@instance.service")
    else:
        validate_unit_name(unit)
    return unit


def parse_gpus(value: str) -> Gpus:
    """`--gpus 0,1,GPU-...` (or `--gpus all`) into the config's `gpus`. Raises InvalidValue
    (a ValueError)."""
    if value.strip() == "all":
        return "all"
    return list(parse_gpu_text(value))


def parse_container(value: str) -> str:
    """`--container vllm` (a name or id) into one item of the config's `containers`."""
    if not CONTAINER_NAME.fullmatch(value):
        raise InvalidValue(f"{echo(value)} is not a container name or id (letters, digits, _.-)")
    return value


def systemctl_daemon_reload() -> bool:
    """Where systemd runs; elsewhere (an image being built, a chroot) there is nothing to do."""
    if not systemd_running():
        return False
    systemctl = find_program("systemctl")
    if systemctl is None:
        raise InstallError(
            f"files written, but no systemctl in {SYSTEM_PATH}: run `systemctl daemon-reload`"
        )
    try:
        result = run_program([systemctl, "daemon-reload"], RELOAD_TIMEOUT_S)
    except GateError as exc:
        raise InstallError(f"files written, but {exc}; run it yourself") from None
    if result.returncode != 0:
        raise InstallError(
            f"files written, but `systemctl daemon-reload` failed: {result.first_line()}; "
            "run it yourself"
        )
    return True


def plan_install(
    unit: str,
    *,
    gpus: Gpus | None = None,
    containers: Sequence[str] = (),
    ports: Sequence[int] | None = None,
    gpugate_path: Path | Sequence[str] = DEFAULT_GPUGATE,
    force: bool = False,
    systemd_dir: Path = DEFAULT_SYSTEMD_DIR,
    config_dir: Path = DEFAULT_CONFIG_DIR,
    query: Callable[[str], UnitState | None] | None = None,
    stream: TextIO | None = None,
) -> list[Change]:
    """What install would do; InstallError (nothing done) where it would replace the
    operator's drop-in, or change the GPUs or containers of the operator's config, without
    force. What the unit sets itself is read from systemd (`systemctl cat`) where systemd_dir
    is the real one, else from the files in systemd_dir (tests, an image's tree)."""
    validate_install_unit(unit)
    if query is None and systemd_dir == DEFAULT_SYSTEMD_DIR:
        query = query_unit
    if query is not None:
        refuse_unknown_unit(unit, force=force, query=query, stream=stream)
    targets = Targets.of(unit, systemd_dir, config_dir)
    dropin, said = planned_dropin(unit, gpugate_path, systemd_dir, targets.config)
    wanted = {
        targets.dropin: dropin,
        targets.config: with_header(render_config(unit, gpus, containers, ports)),
    }
    changes: list[Change] = []
    refused: list[str] = []
    for path, content in wanted.items():
        owner = ownership(path)
        if owner is Ownership.OPERATORS and not force:
            if path == targets.config and gpus is None and not containers and not ports:
                changes.append(Change(path, Action.KEEP, note="edited"))
                continue
            refused.append(str(path))
            continue
        shown = said if path == targets.dropin else ()
        if owner is Ownership.OURS and path.read_text(encoding="utf-8") == content:
            changes.append(Change(path, Action.UNCHANGED, said=shown))
        else:
            note = "edited-forced" if owner is Ownership.OPERATORS else ""
            changes.append(Change(path, Action.WRITE, content, note, shown))
    if refused:
        raise InstallError(
            f"{', '.join(refused)}: edited by you (or not written by gpugate install); nothing "
            "changed; --force replaces it"
        )
    return changes


def planned_dropin(
    unit: str,
    gpugate_path: Path | Sequence[str],
    systemd_dir: Path,
    config: Path,
) -> tuple[str, tuple[str, ...]]:
    """The drop-in for what the unit sets itself and the config's private_shm, with the lines
    that say which of the unit's settings it keeps."""
    text = read_unit(unit, systemd_dir, ask_systemd=systemd_dir == DEFAULT_SYSTEMD_DIR)
    settings = parse_unit_settings(text, DROPIN_NAME)
    private_shm = configured_private_shm(config)
    said = tuple(kept_lines(settings, private_shm, HOOK_TIMEOUT_S))
    return with_header(render_dropin(gpugate_path, settings, private_shm)), said


def configured_private_shm(config: Path) -> str:
    """private_shm from the unit's config where it has one (the operator's: `"off"` takes the
    private /dev/shm away at the next install), else the default. A config that does not
    parse: its one-line error, nothing changed."""
    try:
        text = config.read_text(encoding="utf-8")
    except FileNotFoundError:
        return DEFAULT_PRIVATE_SHM
    except OSError as exc:
        raise PermissionDenied(f"{config}: cannot read it ({exc.strerror})") from None
    return parse_config(text, str(config)).private_shm


def refuse_unknown_unit(
    unit: str,
    *,
    force: bool,
    query: Callable[[str], UnitState | None],
    stream: TextIO | None = None,
) -> None:
    """A drop-in for a unit systemd does not know is most likely a typo: warn, and refuse
    without --force (a unit file installed later would still pick the drop-in up)."""
    if unit.endswith("@.service"):
        return  # systemd shows instances, not templates; the template's file may be anywhere
    state = query(unit)
    if state is None or state.load_state != "not-found":
        return
    if not force:
        raise UnknownUnit(
            f"unit {unit}: systemd knows no such unit (systemctl list-unit-files); nothing "
            "changed; --force installs anyway"
        )
    said = (
        f"unit {unit}: systemd knows no such unit (systemctl list-unit-files); installing "
        "anyway (--force)"
    )
    print(lines.warning(said), file=stream or sys.stderr)


def plan_uninstall(
    unit: str,
    *,
    force: bool = False,
    systemd_dir: Path = DEFAULT_SYSTEMD_DIR,
    config_dir: Path = DEFAULT_CONFIG_DIR,
) -> list[Change]:
    """What uninstall would do; InstallError (nothing done) where the drop-in is the
    operator's and not force. An edited config is kept (it does nothing without the hooks)."""
    validate_install_unit(unit)
    targets = Targets.of(unit, systemd_dir, config_dir)
    changes: list[Change] = []
    for path in (targets.dropin, targets.config):
        owner = ownership(path)
        if owner is Ownership.ABSENT:
            changes.append(Change(path, Action.ABSENT))
        elif owner is Ownership.OURS or force:
            changes.append(Change(path, Action.REMOVE))
        elif path == targets.config:
            changes.append(Change(path, Action.KEEP, note="edited-removable"))
        else:
            raise InstallError(
                f"{path}: edited by you (or not written by gpugate install); nothing changed; "
                "--force removes it"
            )
    return changes


def apply(
    changes: Sequence[Change],
    *,
    dry_run: bool = False,
    reload: Callable[[], bool] = systemctl_daemon_reload,
    out: TextIO | None = None,
) -> bool:
    """Carry out a plan (or, with dry_run, print it). True when the drop-in changed.

    reload: reloads systemd; False where there was none to reload."""
    stream = out if out is not None else sys.stdout
    for change in changes:
        _describe(change, dry_run, stream)
        if dry_run:
            continue
        try:
            if change.action is Action.WRITE:
                assert change.content is not None
                write_atomically(change.path, change.content, _mode_of(change.path))
            elif change.action is Action.REMOVE:
                change.path.unlink(missing_ok=True)
                if not change.keep_folder:
                    _remove_empty_dir(change.path.parent)
        except PermissionError as exc:
            raise PermissionDenied(
                f"{exc.filename or change.path}: permission denied (run as root)"
            ) from None
    unit_files_changed = any(
        c.action in (Action.WRITE, Action.REMOVE) and c.path.name == DROPIN_NAME for c in changes
    )
    if dry_run or not unit_files_changed:
        return False
    print(lines.reloaded(reload()), file=stream)
    return True


def _describe(change: Change, dry_run: bool, stream: TextIO) -> None:
    shown = lines.change(
        change.action.value, change.path, change.note, dry_run=dry_run, detail=change.detail
    )
    print(shown, file=stream)
    for said in change.said:
        print(f"  {said}", file=stream)
    if dry_run and change.action is Action.WRITE and change.content is not None:
        print("".join(f"    {line}\n" for line in change.content.splitlines()), end="", file=stream)


def _mode_of(path: Path) -> int:
    """A file's permissions, kept where it is replaced (0644 for a new one)."""
    try:
        return stat.S_IMODE(os.lstat(path).st_mode)
    except OSError:  # missing: a new file
        return 0o644


def _remove_empty_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (other drop-ins, other configs): stays
        directory.rmdir()
