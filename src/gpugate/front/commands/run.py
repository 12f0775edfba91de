"""`gpugate run [OPTIONS] -- COMMAND`: COMMAND as a transient service with gpugate's hooks on
it (docs/gpugate-run.md)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NamedTuple

from gpugate.config.file import LoadedConfig, replaced, to_toml
from gpugate.config.values import DEFAULT_PRIVATE_SHM, PRIVATE_SHM_OFF
from gpugate.core.discover import as_refs, owned_gpus
from gpugate.core.roles import config_shares
from gpugate.errors import (
    BadInput,
    GateError,
    HeldByOthers,
    NvmlUnavailable,
    PermissionDenied,
    StateUnwritable,
)
from gpugate.front.hook import collect, parse_uid
from gpugate.front.install import HOOK_TIMEOUT_S, SHM_OPTIONS, gpugate_command
from gpugate.host.nvml import Gpu, GpuDriver
from gpugate.host.safe_files import account, find_program, run_program, write_atomically
from gpugate.host.systemd import (
    ENV_NAME,
    SYSTEMCTL_TIMEOUT_S,
    active_state,
    query_unit,
    unit_active_state,
    unit_argument,
)
from gpugate.integrations.config_files import load_config
from gpugate.integrations.records import RUNNING_STATES, STARTED_BY_VARIABLE, check_leases
from gpugate.integrations.unit import parse_visible_devices
from gpugate.phase import Phase
from gpugate.report import lines
from gpugate.report.narrate import held_text
from gpugate.untrusted import COMM, COMMAND, for_error, printable

if TYPE_CHECKING:
    from gpugate.front.hook import HostAccess

SHARE_OPTION = "--share-gpus"
SAFE_PATH = re.compile(r"[A-Za-z0-9_./+@:,-]+")

# Not passed to the unit (besides GPUGATE_*, GPUGATE_STARTED_BY being gpugate's to set).
NOT_PASSED = frozenset({
    # systemd's per-service variables, of the caller's own service
    "INVOCATION_ID", "JOURNAL_STREAM", "NOTIFY_SOCKET", "LISTEN_PID", "LISTEN_FDS",
    "LISTEN_FDNAMES", "WATCHDOG_PID", "WATCHDOG_USEC", "MANAGERPID", "SYSTEMD_EXEC_PID",
    "MAINPID", "SERVICE_RESULT", "EXIT_CODE", "EXIT_STATUS",
    # the caller's terminal, sudo's and the shell's
    "TERM", "TMUX", "TMUX_PANE", "STY", "WINDOW", "SSH_TTY", "SSH_AUTH_SOCK", "SSH_AGENT_PID",
    "XDG_SESSION_ID", "XDG_SESSION_TYPE", "XDG_SESSION_CLASS", "XDG_VTNR", "XDG_SEAT", "PWD",
    "OLDPWD", "SHLVL", "_", "SUDO_COMMAND", "SUDO_USER", "SUDO_UID", "SUDO_GID", "SUDO_PS1",
    "MAIL", "PS1", "PS2", "PS4", "PROMPT_COMMAND", "COLUMNS", "LINES",
    "CUDA_VISIBLE_DEVICES",  # set from --gpus (or the caller's, resolved) by gpugate
    # What changes what root's `+` hooks load (they run with the unit's environment): the
    # loader's and glibc's (LD_*, glibc's setuid list in sysdeps/generic/unsecvars.h), and
    # interpreters' start-up variables (not every program a hook runs is Python -I).
    "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "NIS_PATH", "NLSPATH",
    "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR", "BASH_ENV", "ENV",
})  # fmt: skip
LOADER_PREFIXES = ("LD_", "GLIBC_", "MALLOC_", "GCONV_", "PYTHON", "PERL", "RUBY", "NODE_")
NOT_PASSED_PREFIXES = ("GPUGATE_", "BASH_FUNC_", *LOADER_PREFIXES)
NAME_CHAR = re.compile(r"[^A-Za-z0-9_.-]+")
# systemd's unit name grammar (unit_name_is_valid, a plain name: no "@") without its escape
# character: systemd-run unescapes the Exec lines the name is written on, so `prod\x2dvllm`
# would make the hooks act for prod-vllm.service. Nor may it start with "-" (an option to the
# hooks' command line) or ".". 255 characters at most, as systemd allows.
PLAIN_SERVICE = re.compile(r"[A-Za-z0-9:_][A-Za-z0-9:_.-]{0,246}\.service")


def launch_command(args: argparse.Namespace, front: HostAccess) -> int:
    command = list(args.command)[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        raise BadInput("no COMMAND given: gpugate run [OPTIONS] -- COMMAND [ARGS...]")
    if args.config is not None and not SAFE_PATH.fullmatch(str(args.config.resolve())):
        # on the Exec lines, where systemd splits on blanks and expands $ and quotes
        given = for_error(str(args.config), limit=80)
        raise BadInput(f"--config {given}: use a path of letters, digits and _.+@:,-/")
    environ = front.environ
    program = resolve_command(command[0], environ)
    systemd_run = find_program("systemd-run")
    if systemd_run is None:
        raise BadInput("systemd-run not found in the system folders: gpugate run needs systemd")
    caller, under_sudo = invoking_user(environ)
    unit = derive_unit_name(command, args.name, secrets.token_hex(3))
    known = query_unit(unit)  # loaded, active, or a unit file: systemd-run would fail
    if known is not None and (known.load_state, known.active_state) != ("not-found", "inactive"):
        again = "; choose another --name" if args.name else "; run it again"
        raise BadInput(
            f"systemd already has {unit} ({known.load_state}, {known.active_state})" + again
        )
    loaded = load_config(unit, args.config)
    share = args.share_gpus and not loaded.config.share_gpus
    if share:  # written into the hooks' config below
        loaded = LoadedConfig(replaced(loaded.config, share_gpus=True), loaded.source)
    gpus = resolve_gpus(args.gpus, environ, front.driver_factory)
    refuse_before_start(loaded, unit, gpus, caller, args.force, front)
    config_path, cleanup = hook_config(loaded, unit, args.config, args.ports, share=share)
    plan = LaunchPlan(
        unit=unit,
        command=(program, *command[1:]),
        caller=caller,
        gpus_env=",".join(str(ref) for ref in as_refs(gpus)),
        environment=tuple(caller_environment(environ, caller, under_sudo)),
        pty=sys.stdin.isatty() and sys.stdout.isatty(),
        gpugate=gpugate_command(),
        config=config_path,
        started_by=caller.started_by(),
        force=args.force,
        cleanup=cleanup,
        private_shm=loaded.config.private_shm,
    )
    try:
        return supervise(systemd_run_argv(plan, Path(systemd_run)), unit)
    finally:
        for path in cleanup:
            with contextlib.suppress(OSError):
                path.unlink()


def invoking_user(environ: Mapping[str, str], real_uid: int | None = None) -> tuple[Caller, bool]:
    """The account COMMAND runs as: the real uid, or under sudo (real uid 0) SUDO_UID's, which
    is read only then and refused unless in sudo's form."""
    uid = os.getuid() if real_uid is None else real_uid
    under_sudo = uid == 0 and "SUDO_UID" in environ
    gid: int | None = None
    if under_sudo:
        found = parse_uid(environ["SUDO_UID"])
        group = parse_uid(environ.get("SUDO_GID", ""))
        if found is None or ("SUDO_GID" in environ and group is None):
            given = ", ".join(
                f"{name}={environ[name][:20]!r}"
                for name in ("SUDO_UID", "SUDO_GID")
                if name in environ
            )
            raise BadInput(
                f"{given}: not a uid and gid as sudo sets them (decimal digits); gpugate run "
                "under root acts for the account SUDO_UID names and will not guess: unset them, "
                "or run it through sudo"
            )
        uid, gid = found, group
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Caller(uid, os.getgid() if gid is None else gid, str(uid)), under_sudo
    gid = entry.pw_gid if gid is None else gid
    return Caller(uid, gid, entry.pw_name, entry.pw_dir, entry.pw_shell), under_sudo


def resolve_gpus(
    wanted: object, environ: Mapping[str, str], driver_factory: Callable[[], GpuDriver]
) -> list[Gpu]:
    """--gpus, else the caller's CUDA_VISIBLE_DEVICES, else all: NVML's GPUs, to lease."""
    if wanted is None and "CUDA_VISIBLE_DEVICES" in environ:
        where = "CUDA_VISIBLE_DEVICES"
        wanted = parse_visible_devices(where, environ[where], "your environment")
    source = "--gpus" if wanted is not None else "all GPUs"
    try:
        driver = driver_factory()
    except NvmlUnavailable as exc:
        raise NvmlUnavailable(f"gpugate run: {exc}") from None
    with contextlib.closing(driver):
        selection = "all" if wanted is None else wanted
        gpus = owned_gpus(selection, driver.gpus(), source)  # type: ignore[arg-type]
    if not gpus:
        raise BadInput(f"{source}: names no GPU; gpugate run is for GPU programs")
    return gpus


def refuse_before_start(
    loaded: LoadedConfig,
    unit: str,
    gpus: Sequence[Gpu],
    caller: Caller,
    force: bool,
    front: HostAccess,
) -> None:
    """What the unit's pre would refuse, before the start: a lease on the GPUs, and for a
    caller that is not root another account's process on them (exit 22)."""
    roots, is_root = front.host_roots(), caller.uid == 0
    state = functools.partial(
        unit_active_state, cgroup_root=roots.cgroup, ask_systemd=roots.ask_systemd
    )
    refuse_leased(loaded, unit, gpus, force=force, unit_state=state, caller_is_root=is_root)
    if is_root:
        return
    from gpugate.core.decide import Rule, decide  # noqa: PLC0415
    from gpugate.host.scan import ProcFs  # noqa: PLC0415

    procfs = ProcFs(roots.proc)
    with contextlib.closing(front.driver_factory()) as driver:
        found = collect(unit, loaded, driver, roots, procfs=procfs, starting=gpus)
    # With share_gpus or an MPS server there, another workload's process is a sharer (its pre).
    shared = config_shares(found, loaded.config)
    decision = decide(found, loaded.config, Phase.PRE, procfs, for_uid=caller.uid, shared=shared)
    others = [c for c in decision.blockers if c.rule is Rule.OTHER_ACCOUNT]
    if not others:
        return
    first, holder = others[0], others[0].holder
    more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
    raise HeldByOthers(
        f"not starting {unit}: PID {holder.pid} ({printable(holder.info.comm, COMM)}) of "
        f"{account(holder.info.uid)} holds {held_text(first) or 'its GPUs'}{more}; "
        f"`gpugate run` acts for {account(first.for_uid)} and kills only its processes: "
        "nothing was killed; ask that account (or root) to stop it"
    )


def refuse_leased(
    loaded: LoadedConfig,
    unit: str,
    gpus: Sequence[Gpu],
    *,
    force: bool,
    unit_state: Callable[[str], str | None],
    caller_is_root: bool = True,
) -> None:
    """A running unit's lease on these GPUs refuses, as pre would; --force is root's alone."""
    config = loaded.config
    check = check_leases(
        config.lock_dir, unit, gpus, share=config.share_gpus, unit_state=unit_state
    )
    refusal = check.refusal(SHARE_OPTION, f"start it with gpugate run {SHARE_OPTION}")
    if check.conflicts and force and not caller_is_root:
        raise PermissionDenied(
            f"not starting {unit}: {refusal}; --force over a lease is root's alone"
        )
    if check.conflicts and not force:
        raise HeldByOthers(f"not starting {unit}: {refusal}; --force runs it anyway")
    for lease, overlap in check.conflicts:
        gpus_text = ", ".join(str(gpu.index) for gpu in overlap)
        warning = f"GPU {gpus_text} leased to {lease.holder_text()}; --force: running anyway"
        print(lines.warning(warning), file=sys.stderr)


def hook_config(
    loaded: LoadedConfig,
    unit: str,
    given: Path | None,
    ports: Sequence[int] | None,
    *,
    share: bool = False,
) -> tuple[Path | None, tuple[Path, ...]]:
    """The hooks' --config: with --port or --share-gpus, LOCK_DIR/run/UNIT.toml (the effective
    config, its ports and share_gpus; removed after post); else --config PATH as given
    (absolute), else none."""
    if not ports and not share:
        return (given.resolve() if given else None), ()
    changes: dict[str, object] = {"share_gpus": True} if share else {}
    if ports:
        changes["ports"] = tuple(sorted(set(ports)))
    config = loaded.config.changed(**changes)
    path = loaded.config.lock_dir / "run" / f"{unit}.toml"
    why = " and ".join(name for name, on in (("--port", ports), (SHARE_OPTION, share)) if on)
    text = f"# gpugate run {unit}: from {loaded.source}, with {why}\n"
    text += to_toml(config.model_dump(exclude_defaults=True))
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomically(path, text)
    except PermissionError:
        raise PermissionDenied(
            f"{path}: permission denied writing the run's config ({why}): run gpugate run "
            "as root (sudo)"
        ) from None
    except OSError as exc:
        raise StateUnwritable(
            path,
            "run-config",
            f"{path}: cannot write gpugate run's config ({why}) there: {exc.strerror or str(exc)}",
        ) from None
    return path, (path,)


def resolve_command(program: str, environ: Mapping[str, str]) -> str:
    """COMMAND[0] as an absolute path, found on the caller's PATH as the shell would."""
    if "/" in program:
        path = os.path.abspath(program)
        if not os.access(path, os.X_OK) or os.path.isdir(path):
            raise BadInput(f"{printable(program, COMMAND)}: not an executable file")
        return path
    found = shutil.which(program, path=environ.get("PATH", os.defpath))
    if found is None:
        raise BadInput(f"{printable(program, COMMAND)}: command not found on PATH")
    return os.path.abspath(found)


def supervise(argv: list[str], unit: str) -> int:
    """systemd-run, relayed; a hangup, SIGTERM or SIGINT reaching gpugate stops the unit."""
    stopped = threading.Event()

    def stop_unit(signum: int, frame: FrameType | None) -> None:
        if stopped.is_set():
            return
        stopped.set()
        systemctl = find_program("systemctl")
        with contextlib.suppress(GateError):
            if systemctl is not None:
                run_program([systemctl, "stop", "--no-block", "--", unit], SYSTEMCTL_TIMEOUT_S)

    previous = {
        sig: signal.signal(sig, stop_unit) for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
    }
    try:
        child = subprocess.Popen(argv, stderr=subprocess.PIPE)
    except OSError as exc:
        raise BadInput(f"{printable(argv[0], COMMAND)}: cannot run it: {exc.strerror}") from None
    try:
        assert child.stderr is not None
        seen: list[str] = []
        for raw in iter(child.stderr.readline, b""):
            seen.append(raw.decode("utf-8", "replace"))
            with contextlib.suppress(OSError):  # the terminal is gone: the status is still wanted
                sys.stderr.write(seen[-1])
                sys.stderr.flush()
        code = child.wait()
        if stopped.is_set():
            # systemd-run may have ended with us (Ctrl-C reaches the whole process group):
            # return only once the unit is gone, its post done and the GPUs free.
            # The unit's stop, then each ExecStopPost=, may take TimeoutStopSec (300 s).
            wait_until_gone(unit, time.monotonic() + 2 * HOOK_TIMEOUT_S + 30)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0:  # systemd-run itself was killed by a signal
        code = 128 - code
    return command_status(code, "".join(seen))


def wait_until_gone(unit: str, deadline: float) -> bool:
    """Poll until the unit is neither running nor stopping; False at the deadline."""
    while time.monotonic() < deadline:
        if active_state(unit) not in RUNNING_STATES | {"deactivating"}:
            return True
        time.sleep(0.2)
    return False


class Caller(NamedTuple):
    uid: int
    gid: int
    user: str
    home: str | None = None
    shell: str | None = None

    def started_by(self) -> str:
        for stream in (sys.stdin, sys.stdout):
            with contextlib.suppress(OSError, ValueError):
                return f"{self.user} (uid {self.uid}, {os.ttyname(stream.fileno())})"
        return f"{self.user} (uid {self.uid})"


class LaunchPlan(NamedTuple):
    unit: str
    command: tuple[str, ...]  # COMMAND[0] resolved to an absolute path
    caller: Caller  # root: no --uid/--gid; another account: the hooks act --for-uid it
    gpus_env: str  # CUDA_VISIBLE_DEVICES for the unit
    environment: tuple[tuple[str, str], ...]  # the caller's variables passed on
    pty: bool
    gpugate: tuple[str, ...]  # install.gpugate_command(): this very gpugate, -I
    config: Path | None = None  # the hooks' --config
    started_by: str = ""
    force: bool = False
    cleanup: tuple[Path, ...] = ()  # files removed after post (root's)
    private_shm: str = DEFAULT_PRIVATE_SHM  # the unit's own /dev/shm: its size, or "off"


def derive_unit_name(command: Sequence[str], name: str | None, short_id: str) -> str:
    """--name NAME (a service; `.service` added as systemctl does), else
    gpugate-run-<command's basename>-<short id>.service."""
    if name:
        unit = unit_argument(name)
        given = for_error(str(name), limit=80)
        if not unit.endswith(".service"):
            raise BadInput(f"--name {given}: gpugate run makes a service; name it NAME.service")
        if "@" in unit:
            raise BadInput(f"--name {given}: a transient unit cannot be a template instance")
        if not PLAIN_SERVICE.fullmatch(unit):
            raise BadInput(
                f"--name {given}: not a plain unit name (letters, digits and :_.- "
                "only, not first a - or ., no \\ escapes; at most 255 characters with .service)"
            )
        return unit
    base = NAME_CHAR.sub("_", os.path.basename(command[0].rstrip("/"))).strip("._-")
    base = base[:40].strip("._-") or "command"  # 40 characters of the name at most
    return f"gpugate-run-{base}-{short_id}.service"


def passed_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        key: value
        for key, value in environ.items()
        if key not in NOT_PASSED
        and not key.startswith(NOT_PASSED_PREFIXES)
        # what systemd would refuse: an exported function, a multi-line value
        and ENV_NAME.fullmatch(key)
        and "\n" not in value
        and "\0" not in value
    }


def caller_environment(
    environ: Mapping[str, str], caller: Caller, under_sudo: bool
) -> list[tuple[str, str]]:
    """The environment passed on; under sudo the caller's HOME, USER, LOGNAME, SHELL."""
    kept = passed_environment(environ)
    if under_sudo:
        kept["USER"] = kept["LOGNAME"] = caller.user
        if caller.home:
            kept["HOME"] = caller.home
        if caller.shell:
            kept["SHELL"] = caller.shell
    return sorted(kept.items())


def hook_line(plan: LaunchPlan, phase: Phase) -> str:
    config = f" --config {plan.config}" if plan.config else ""
    uid = plan.caller.uid
    # --force on the command line, which only root writes, never in the environment, which
    # the unit's own files may set; root's alone.
    force = " --ignore-leases" if plan.force and uid == 0 and phase.traits.takes_lease else ""
    account = f" --for-uid {uid}" if uid != 0 else ""
    return f"+{' '.join(plan.gpugate)} {phase} {plan.unit}{config}{force}{account}"


def systemd_run_argv(plan: LaunchPlan, systemd_run: Path) -> list[str]:
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
    if plan.caller.uid != 0:
        argv += [f"--uid={plan.caller.uid}", f"--gid={plan.caller.gid}"]
    # %n is not expanded in properties set over D-Bus: the name is written out.
    argv += [
        f"--property=ExecStartPre={hook_line(plan, Phase.PRE)}",
        f"--property=ExecStopPost={hook_line(plan, Phase.POST)}",
        *(f"--property=ExecStopPost=+/bin/rm -f -- {path}" for path in plan.cleanup),
        "--property=NotifyAccess=exec",
        f"--property=TimeoutStartSec={HOOK_TIMEOUT_S}",
        f"--property=TimeoutStopSec={HOOK_TIMEOUT_S}",
        "--property=KillMode=control-group",
    ]
    if plan.private_shm != PRIVATE_SHM_OFF:  # the same own /dev/shm as install's drop-in
        options = SHM_OPTIONS.format(size=plan.private_shm)
        argv.append(f"--property=TemporaryFileSystem=/dev/shm:{options}")
    setenv = [("CUDA_VISIBLE_DEVICES", plan.gpus_env), (STARTED_BY_VARIABLE, plan.started_by)]
    argv += [f"--setenv={key}={value}" for key, value in [*plan.environment, *setenv]]
    # systemd substitutes $NAME and ${NAME} in a service's command line; $$ is a literal $.
    argv += ["--", *(arg.replace("$", "$$") for arg in plan.command)]
    return argv


MAIN_EXIT = re.compile(r"Main processes terminated with: code=(\w+)/status=(\w+)")


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
    number = getattr(signal.Signals, "SIG" + status.upper().removeprefix("SIG"), None)
    return 128 + number if number and number <= signal.SIGTERM else systemd_run_code
