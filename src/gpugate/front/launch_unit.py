"""`gpugate run`'s transient unit, as data: its name, the environment passed to it, and the
systemd-run command line that starts it. Pure functions; launch.py does the I/O."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpugate.config.values import DEFAULT_PRIVATE_SHM, PRIVATE_SHM_OFF
from gpugate.errors import ExitCode, GateError
from gpugate.front.install_files import SHM_OPTIONS
from gpugate.host.systemd import ENV_NAME, unit_argument
from gpugate.integrations.records import STARTED_BY_VARIABLE
from gpugate.phase import Phase
from gpugate.untrusted import echo

RM = Path("/bin/rm")
PREFIX = "gpugate-run-"
BASE_MAX = 40  # characters of the command's name kept in a derived unit name
# The drop-in's timeouts (units/gpugate.conf): each covers a hook's grace, kill and wait.
HOOK_TIMEOUT_S = 300

# Not passed to the unit (the rest of the caller's environment is):
# - set by systemd for each service, or describing the caller's own service or terminal
#   (wrong in another unit; systemd-run --pty sets TERM itself);
# - GPUGATE_* (gpugate sets its own: GPUGATE_STARTED_BY, recorded in the lease, is not the
#   caller's to choose);
# - what changes the programs root's `+` hooks load, or how they start (they run with the
#   unit's environment): LOADER_NAMES and LOADER_PREFIXES below;
# - sudo's and the shell's bookkeeping.
NOT_PASSED = frozenset(
    {
        "INVOCATION_ID",
        "JOURNAL_STREAM",
        "NOTIFY_SOCKET",
        "LISTEN_PID",
        "LISTEN_FDS",
        "LISTEN_FDNAMES",
        "WATCHDOG_PID",
        "WATCHDOG_USEC",
        "MANAGERPID",
        "SYSTEMD_EXEC_PID",
        "MAINPID",
        "SERVICE_RESULT",
        "EXIT_CODE",
        "EXIT_STATUS",
        "TERM",
        "TMUX",
        "TMUX_PANE",
        "STY",
        "WINDOW",
        "SSH_TTY",
        "SSH_AUTH_SOCK",
        "SSH_AGENT_PID",
        "XDG_SESSION_ID",
        "XDG_SESSION_TYPE",
        "XDG_SESSION_CLASS",
        "XDG_VTNR",
        "XDG_SEAT",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        "SUDO_COMMAND",
        "SUDO_USER",
        "SUDO_UID",
        "SUDO_GID",
        "SUDO_PS1",
        "MAIL",
        "PS1",
        "PS2",
        "PS4",
        "PROMPT_COMMAND",
        "COLUMNS",
        "LINES",
        "CUDA_VISIBLE_DEVICES",  # set from --gpus (or the caller's, resolved) by gpugate
    }
)
# The dynamic loader's and glibc's: every LD_* (LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, ...),
# GLIBC_TUNABLES, MALLOC_*, GCONV_*, and the rest of glibc's own list of what it drops for a
# setuid program (sysdeps/generic/unsecvars.h); an interpreter's start-up: PYTHON* (the hooks
# run Python -I, which reads none of them, but not every interpreter a hook may run does),
# a shell's, Perl's, Ruby's, Node's.
LOADER_PREFIXES = ("LD_", "GLIBC_", "MALLOC_", "GCONV_", "PYTHON", "PERL", "RUBY", "NODE_")
LOADER_NAMES = frozenset(
    {
        "GETCONF_DIR",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TMPDIR",
        "TZDIR",
        "BASH_ENV",
        "ENV",
    }
)
NOT_PASSED_PREFIXES = ("GPUGATE_", "BASH_FUNC_", *LOADER_PREFIXES)
NAME_CHAR = re.compile(r"[^A-Za-z0-9_.-]+")
# systemd's unit name grammar (unit_name_is_valid, a plain name: no "@") without its escape
# character: systemd-run unescapes the Exec lines the name is written on, so `prod\x2dvllm`
# would make the hooks act for prod-vllm.service. Nor may it start with "-" (an option to the
# hooks' command line) or ".". 255 characters at most, as systemd allows.
PLAIN_SERVICE = re.compile(r"[A-Za-z0-9:_][A-Za-z0-9:_.-]{0,246}\.service")
UID_TEXT = re.compile(r"(?:0|[1-9][0-9]{0,9})")
NO_UID = 2**32 - 1  # (uid_t)-1: "no uid" to the kernel, never an account


class LaunchError(GateError):
    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class Caller:
    """Whom the command runs as: the invoking user (SUDO_UID's under sudo)."""

    uid: int
    gid: int
    user: str
    home: str | None = None
    shell: str | None = None

    def started_by(self, tty: str | None) -> str:
        return f"{self.user} (uid {self.uid}{', ' + tty if tty else ''})"


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the systemd-run call needs; `systemd_run_argv` turns it into argv."""

    unit: str
    command: tuple[str, ...]  # COMMAND[0] resolved to an absolute path
    caller: Caller
    gpus_env: str  # CUDA_VISIBLE_DEVICES for the unit
    environment: tuple[tuple[str, str], ...]  # the caller's variables passed on
    pty: bool
    gpugate: tuple[str, ...]  # self_command.gpugate_command(): this very gpugate, -I
    config: Path | None = None  # the hooks' --config
    started_by: str = ""
    force: bool = False
    cleanup: tuple[Path, ...] = field(default=())  # files removed after post (root's)
    as_root_caller: bool = False  # the caller is root itself: no --uid/--gid
    private_shm: str = DEFAULT_PRIVATE_SHM  # the unit's own /dev/shm: its size, or "off"
    for_uid: int | None = None  # the hooks' --for-uid: a caller that is not root


def sanitise(name: str) -> str:
    """A command's basename as a piece of a unit name: systemd's characters only."""
    base = NAME_CHAR.sub("_", os.path.basename(name.rstrip("/"))).strip("._-")
    return base[:BASE_MAX].strip("._-") or "command"


def derive_unit_name(command: Sequence[str], name: str | None, short_id: str) -> str:
    """--name NAME (a service; `.service` added as systemctl does), else
    gpugate-run-<command's basename>-<short id>.service."""
    if name:
        unit = unit_argument(name)
        given = echo(str(name), limit=80)
        if not unit.endswith(".service"):
            raise LaunchError(f"--name {given}: gpugate run makes a service; name it NAME.service")
        if "@" in unit:
            raise LaunchError(f"--name {given}: a transient unit cannot be a template instance")
        if not PLAIN_SERVICE.fullmatch(unit):
            raise LaunchError(
                f"--name {given}: not a plain unit name (letters, digits and :_.- "
                "only, not first a - or ., no \\ escapes; at most 255 characters with .service)"
            )
        return unit
    if not command:
        raise LaunchError("no COMMAND given: gpugate run [OPTIONS] -- COMMAND [ARGS...]")
    return f"{PREFIX}{sanitise(command[0])}-{short_id}.service"


def parse_uid(text: str) -> int | None:
    """A uid written in decimal ASCII digits, as sudo writes SUDO_UID: no sign, blank, leading
    zero or other script's digits (str.isdigit and int() take Arabic-Indic ones), and not
    (uid_t)-1."""
    if not UID_TEXT.fullmatch(text):
        return None
    uid = int(text)
    return uid if uid < NO_UID else None


def passed_environment(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The caller's variables that make sense in the unit (NOT_PASSED says which do not)."""
    kept = []
    for key in sorted(environ):
        value = environ[key]
        if key in NOT_PASSED or key in LOADER_NAMES or key.startswith(NOT_PASSED_PREFIXES):
            continue
        if not ENV_NAME.fullmatch(key) or "\n" in value or "\0" in value:
            continue  # systemd would refuse it (an exported function, a multi-line value)
        kept.append((key, value))
    return kept


def caller_environment(
    environ: Mapping[str, str], caller: Caller, under_sudo: bool
) -> list[tuple[str, str]]:
    """passed_environment, and under sudo the invoking user's HOME, USER, LOGNAME, SHELL
    (sudo's own would name root)."""
    kept = dict(passed_environment(environ))
    if under_sudo:
        kept["USER"] = kept["LOGNAME"] = caller.user
        if caller.home:
            kept["HOME"] = caller.home
        if caller.shell:
            kept["SHELL"] = caller.shell
    return sorted(kept.items())


def hook_line(plan: LaunchPlan, phase: Phase) -> str:
    config = f" --config {plan.config}" if plan.config else ""
    # --force: pre warns about a lease instead of refusing. On the command line, which only
    # root writes, never in the environment, which the unit's own files may set.
    # Root's alone: a caller that is not root (--for-uid) never overrides a lease.
    overrides = plan.force and plan.for_uid is None
    force = " --ignore-leases" if overrides and phase.traits.takes_lease else ""
    # A caller that is not root: the hooks kill only its processes (rule 5, hardening.md).
    account = f" --for-uid {plan.for_uid}" if plan.for_uid is not None else ""
    return f"+{' '.join(plan.gpugate)} {phase} {plan.unit}{config}{force}{account}"


def systemd_run_argv(plan: LaunchPlan, systemd_run: Path) -> list[str]:
    """The systemd-run command line for the plan (a pure function: tests check it whole)."""
    argv = [
        str(systemd_run),
        f"--unit={plan.unit}",
        "--pty" if plan.pty else "--pipe",
        "--same-dir",
        "--wait",
        "--collect",
        "--service-type=exec",
        f"--description=gpugate run by {plan.started_by}: {' '.join(plan.command)[:200]}",
    ]
    if not plan.as_root_caller:
        argv += [f"--uid={plan.caller.uid}", f"--gid={plan.caller.gid}"]
    # %n is not expanded in properties set over D-Bus: the name is written out.
    argv += [
        f"--property=ExecStartPre={hook_line(plan, Phase.PRE)}",
        f"--property=ExecStopPost={hook_line(plan, Phase.POST)}",
    ]
    for path in plan.cleanup:
        argv.append(f"--property=ExecStopPost=+{RM} -f -- {path}")
    argv += [
        "--property=NotifyAccess=exec",
        f"--property=TimeoutStartSec={HOOK_TIMEOUT_S}",
        f"--property=TimeoutStopSec={HOOK_TIMEOUT_S}",
        "--property=KillMode=control-group",
    ]
    if plan.private_shm != PRIVATE_SHM_OFF:  # the same own /dev/shm as install's drop-in
        options = SHM_OPTIONS.format(size=plan.private_shm)
        argv.append(f"--property=TemporaryFileSystem=/dev/shm:{options}")
    setenv = [*plan.environment, ("CUDA_VISIBLE_DEVICES", plan.gpus_env)]
    setenv.append((STARTED_BY_VARIABLE, plan.started_by))
    argv += [f"--setenv={key}={value}" for key, value in setenv]
    # systemd substitutes $NAME and ${NAME} in a service's command line; $$ is a literal $.
    argv += ["--", *(arg.replace("$", "$$") for arg in plan.command)]
    return argv


MAIN_EXIT = re.compile(r"Main processes terminated with: code=(\w+)/status=(\w+)")
SIGNALS = {
    "HUP": 1,
    "INT": 2,
    "QUIT": 3,
    "ILL": 4,
    "TRAP": 5,
    "ABRT": 6,
    "BUS": 7,
    "FPE": 8,
    "KILL": 9,
    "USR1": 10,
    "SEGV": 11,
    "USR2": 12,
    "PIPE": 13,
    "ALRM": 14,
    "TERM": 15,
}


def command_status(systemd_run_code: int, messages: str) -> int:
    """COMMAND's exit status as a shell reports it: its code, or 128 + N for a signal.

    systemd-run --wait returns the service's exit code, but 0 for the signals systemd counts
    as a clean end (SIGHUP, SIGINT, SIGTERM, SIGPIPE) and 255 for any other signal; its last
    lines ("Main processes terminated with: code=killed/status=INT") say what happened."""
    found = MAIN_EXIT.findall(messages)
    if not found:
        return systemd_run_code
    code, status = found[-1]
    if code == "exited":
        return int(status) if status.isdigit() else systemd_run_code
    if status.isdigit():
        return 128 + int(status)
    number = SIGNALS.get(status.upper().removeprefix("SIG"))
    return 128 + number if number else systemd_run_code
