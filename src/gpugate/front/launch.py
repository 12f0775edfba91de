"""`gpugate run [--gpus LIST] [--port N]... [--name NAME] [--config PATH] [--force] -- COMMAND`:
COMMAND as a transient service with gpugate's hooks on it (launch_unit.py builds the unit), so a
hand-started server is tied to a unit: its GPUs leased, its whole cgroup stopped and its GPUs
freed when the terminal goes, Ctrl-C, or `systemctl stop`."""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING

from gpugate.config.models import LoadedConfig, validated
from gpugate.config.toml_text import to_toml
from gpugate.core.discover import as_refs, owned_gpus
from gpugate.errors import (
    ExitCode,
    GateError,
    NvmlUnavailable,
    PermissionDenied,
    StateUnwritable,
)
from gpugate.front.launch_unit import (
    HOOK_TIMEOUT_S,
    Caller,
    LaunchError,
    LaunchPlan,
    caller_environment,
    command_status,
    derive_unit_name,
    parse_uid,
    systemd_run_argv,
)
from gpugate.front.self_command import gpugate_command
from gpugate.host.nvml import Gpu, GpuDriver
from gpugate.host.programs import find_program, run_program
from gpugate.host.roots import HostRoots
from gpugate.host.safe_files import write_atomically
from gpugate.host.systemd import SYSTEMCTL_TIMEOUT_S, active_state, query_unit, unit_active_state
from gpugate.integrations.config_files import load_config
from gpugate.integrations.unit.gpu_source import GpuChoice, parse_visible_devices
from gpugate.integrations.unit.leases import RUNNING_STATES, check_leases
from gpugate.report import lines, reasons
from gpugate.untrusted import COMMAND, echo, shown

if TYPE_CHECKING:
    from gpugate.front.commands import Front

# The unit's stop, then each ExecStopPost=, may take TimeoutStopSec (the drop-in's 300 s).
GONE_DEADLINE_S = 2 * HOOK_TIMEOUT_S + 30
STOPPING_OR_RUNNING = RUNNING_STATES | {"deactivating"}
SAFE_PATH = re.compile(r"[A-Za-z0-9_./+@:,-]+")
RUN_FOLDER = "run"  # lock_dir/run/UNIT.toml: a transient unit's config (--port)


def checked_command(args: argparse.Namespace) -> list[str]:
    """COMMAND and its arguments, once the command line is known to be usable."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError("no COMMAND given: gpugate run [OPTIONS] -- COMMAND [ARGS...]")
    if args.config is not None and not SAFE_PATH.fullmatch(str(args.config.resolve())):
        # it goes on the Exec lines, where systemd splits on blanks and expands $ and quotes
        given = echo(str(args.config), limit=80)
        raise LaunchError(f"--config {given}: use a path of letters, digits and _.+@:,-/")
    return command


def launch_command(args: argparse.Namespace, front: Front) -> int:
    command = checked_command(args)
    program = resolve_command(command[0], front.environ)
    systemd_run = find_program("systemd-run")
    if systemd_run is None:
        raise LaunchError("systemd-run not found in the system folders: gpugate run needs systemd")
    environ = front.environ
    caller, under_sudo = invoking_user(environ)
    unit = derive_unit_name(command, args.name, secrets.token_hex(3))
    refuse_known_unit(unit, explicit=bool(args.name))
    loaded = load_config(unit, args.config)
    gpus = resolve_gpus(args.gpus, environ, front.driver_factory)
    refuse_before_start(loaded, unit, gpus, caller, args.force, front)
    tty = terminal_name()
    started_by = caller.started_by(tty)
    config_path, cleanup = hook_config(loaded, unit, args.config, args.ports)
    plan = LaunchPlan(
        unit=unit,
        command=(program, *command[1:]),
        caller=caller,
        gpus_env=",".join(str(ref) for ref in as_refs(gpus)),
        environment=tuple(caller_environment(environ, caller, under_sudo)),
        pty=sys.stdin.isatty() and sys.stdout.isatty(),
        gpugate=gpugate_command(),
        config=config_path,
        started_by=started_by,
        force=args.force,
        cleanup=cleanup,
        as_root_caller=caller.uid == 0,
        private_shm=loaded.config.private_shm,
        for_uid=None if caller.uid == 0 else caller.uid,
    )
    try:
        return supervise(systemd_run_argv(plan, Path(systemd_run)), unit)
    finally:
        # The unit's last ExecStopPost= removes it; this covers a unit that never started.
        for path in cleanup:
            with contextlib.suppress(OSError):
                path.unlink()


def invoking_user(environ: Mapping[str, str], real_uid: int | None = None) -> tuple[Caller, bool]:
    """The account COMMAND runs as, and that its hooks act for: gpugate's own real uid; under
    sudo (gpugate's real uid 0 and SUDO_UID set) the account that typed sudo. sudo itself
    sets SUDO_UID and SUDO_GID for the command it runs (also under -E, which keeps the rest of
    the caller's environment); an account that is not root gets no say in them: without
    sudo its gpugate runs with its own real uid, and SUDO_UID is not read at all. A SUDO_UID
    that is not a uid in sudo's form is refused, never read as root."""
    uid = os.getuid() if real_uid is None else real_uid
    under_sudo = uid == 0 and "SUDO_UID" in environ
    gid: int | None = None
    if under_sudo:
        found = parse_uid(environ["SUDO_UID"])
        group = parse_uid(environ.get("SUDO_GID", ""))
        if found is None or ("SUDO_GID" in environ and group is None):
            raise LaunchError(
                reasons.sudo_variables_text(
                    {k: environ[k] for k in ("SUDO_UID", "SUDO_GID") if k in environ}
                )
            )
        uid, gid = found, group
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Caller(uid, os.getgid() if gid is None else gid, str(uid)), under_sudo
    gid = entry.pw_gid if gid is None else gid
    return Caller(uid, gid, entry.pw_name, entry.pw_dir, entry.pw_shell), under_sudo


def terminal_name() -> str | None:
    for stream in (sys.stdin, sys.stdout):
        try:
            return os.ttyname(stream.fileno())
        except (OSError, ValueError):
            continue
    return None


def refuse_known_unit(unit: str, *, explicit: bool) -> None:
    """A name systemd already has (loaded, active, or a unit file): systemd-run would fail."""
    state = query_unit(unit)
    if state is None or (state.load_state == "not-found" and state.active_state == "inactive"):
        return
    raise LaunchError(
        f"systemd already has {unit} ({state.load_state}, {state.active_state})"
        + ("; choose another --name" if explicit else "; run it again")
    )


def resolve_gpus(
    wanted: object, environ: Mapping[str, str], driver_factory: Callable[[], GpuDriver]
) -> list[Gpu]:
    """--gpus, else the caller's CUDA_VISIBLE_DEVICES, else every GPU: NVML's GPUs, so that
    the unit names them (and takes a lease on them) even for "all"."""
    if wanted is None and "CUDA_VISIBLE_DEVICES" in environ:
        where = "CUDA_VISIBLE_DEVICES"
        wanted = parse_visible_devices(where, environ[where], "your environment")
    choice = GpuChoice(
        "all" if wanted is None else wanted,  # type: ignore[arg-type]
        "--gpus" if wanted is not None else "all GPUs",
    )
    source = choice.source
    try:
        driver = driver_factory()
    except NvmlUnavailable as exc:
        raise NvmlUnavailable(f"gpugate run: {exc}") from None
    try:
        gpus = owned_gpus(choice.gpus, driver.gpus(), source)
    finally:
        driver.close()
    if not gpus:
        raise LaunchError(f"{source}: names no GPU; gpugate run is for GPU programs")
    return gpus


def refuse_before_start(
    loaded: LoadedConfig, unit: str, gpus: Sequence[Gpu], caller: Caller, force: bool, front: Front
) -> None:
    """What the unit's pre would refuse, found before anything starts: a running lease on the
    GPUs (--force: root's alone), and for a caller that is not root another account's
    process on them."""
    roots = front.host_roots()
    refuse_leased(
        loaded,
        unit,
        gpus,
        force=force,
        caller_is_root=caller.uid == 0,
        unit_state=lambda name: unit_active_state(
            name, roots.cgroup, ask_systemd=roots.ask_systemd
        ),
    )
    if caller.uid != 0:
        refuse_other_accounts(loaded, unit, gpus, caller.uid, roots, front.driver_factory)


def refuse_leased(
    loaded: LoadedConfig,
    unit: str,
    gpus: Sequence[Gpu],
    *,
    force: bool,
    unit_state: Callable[[str], str | None],
    caller_is_root: bool = True,
) -> None:
    """Before systemd-run: a running unit's lease on these GPUs refuses, as its pre would.
    --force overrides it for root alone: a caller that is not root (under sudo, SUDO_UID's)
    may not start onto GPUs another run, unit or container holds, whoever's it is (exit 77),
    and its unit's pre gets no --ignore-leases."""
    config = loaded.config
    check = check_leases(
        config.lock_dir, unit, gpus, share=config.share_gpus, unit_state=unit_state
    )
    if check.conflicts and force and not caller_is_root:
        raise PermissionDenied(
            f"not starting {unit}: {check.refusal()}; --force over a lease is root's alone"
        )
    if check.conflicts and not force:
        raise HeldByOthers(f"not starting {unit}: {check.refusal()}; --force runs it anyway")
    for lease, overlap in check.conflicts:
        print(
            lines.lease_overridden([gpu.index for gpu in overlap], lease.holder_text()),
            file=sys.stderr,
        )


def refuse_other_accounts(
    loaded: LoadedConfig,
    unit: str,
    gpus: Sequence[Gpu],
    uid: int,
    roots: HostRoots,
    driver_factory: Callable[[], GpuDriver],
) -> None:
    """Before systemd-run, for a caller that is not root: a process of another account on
    these GPUs refuses the run (exit 22, one line naming it), as the unit's pre would under
    the GPU locks (`--for-uid`); nothing is started or killed."""
    from gpugate.core.decide import Rule, decide  # noqa: PLC0415
    from gpugate.core.discover import Sought, discover  # noqa: PLC0415
    from gpugate.host.procfs import ProcFs  # noqa: PLC0415
    from gpugate.phase import Phase  # noqa: PLC0415

    procfs = ProcFs(roots.proc)
    driver = driver_factory()
    try:
        found = discover(
            # not started yet: no process is in its cgroup
            Sought(unit, f"/system.slice/{unit}", as_refs(gpus), loaded.source),
            driver=driver,
            procfs=procfs,
            roots=roots,
            containers=loaded.config.containers,
            ports=loaded.config.ports,
        )
    finally:
        driver.close()
    decision = decide(found, loaded.config, Phase.PRE, procfs, for_uid=uid)
    others = [c for c in decision.blockers if c.rule is Rule.OTHER_ACCOUNT]
    if others:
        raise HeldByOthers(
            reasons.other_account_refusal(unit, others)
            if others
            else f"not starting {unit}: another account's process holds its GPUs"
        )


class HeldByOthers(GateError):
    exit_code = ExitCode.HELD_BY_OTHERS


def hook_config(
    loaded: LoadedConfig, unit: str, given: Path | None, ports: Sequence[int] | None
) -> tuple[Path | None, tuple[Path, ...]]:
    """The hooks' --config: with --port, LOCK_DIR/run/UNIT.toml (the effective config and
    the ports; removed after post); else --config PATH as given (absolute), else none: the
    hooks look up /etc/gpugate/UNIT.toml, then default.toml, as for any unit."""
    if not ports:
        return (given.resolve() if given else None), ()
    config = validated(loaded.config).changed(ports=tuple(sorted(set(ports))))
    path = loaded.config.lock_dir / RUN_FOLDER / f"{unit}.toml"
    text = f"# gpugate run {unit}: from {loaded.source}, with --port\n"
    text += to_toml(config.model_dump(mode="json", exclude_defaults=True))
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomically(path, text)
    except PermissionError:
        raise PermissionDenied(
            f"{path}: permission denied writing the run's config (--port): run gpugate run "
            "as root (sudo)"
        ) from None
    except OSError as exc:  # no space, read-only: before anything starts, as a pre would
        raise StateUnwritable(
            path,
            "run-config",
            f"{path}: cannot write gpugate run's config (--port) there: {exc.strerror or str(exc)}",
        ) from None
    return path, (path,)


def resolve_command(program: str, environ: Mapping[str, str]) -> str:
    """COMMAND[0] as an absolute path, found on the caller's PATH as the shell would."""
    import shutil  # noqa: PLC0415

    if "/" in program:
        path = os.path.abspath(program)
        if not os.access(path, os.X_OK) or os.path.isdir(path):
            raise LaunchError(f"{shown(program, COMMAND)}: not an executable file")
        return path
    found = shutil.which(program, path=environ.get("PATH", os.defpath))
    if found is None:
        raise LaunchError(f"{shown(program, COMMAND)}: command not found on PATH")
    return os.path.abspath(found)


def supervise(argv: list[str], unit: str) -> int:
    """Run systemd-run, relay its messages, and return COMMAND's status. A hangup, SIGTERM or
    SIGINT reaching gpugate itself (a closed terminal, kill, Ctrl-C without a pty) stops the
    unit: systemd stops its whole cgroup, then post frees the GPUs."""
    stopped = threading.Event()

    def stop_unit(signum: int, frame: FrameType | None) -> None:
        if not stopped.is_set():
            stopped.set()
            stop_without_waiting(unit)

    previous = {
        sig: signal.signal(sig, stop_unit) for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
    }
    try:
        child = subprocess.Popen(argv, stderr=subprocess.PIPE)
    except OSError as exc:
        raise LaunchError(f"{shown(argv[0], COMMAND)}: cannot run it: {exc.strerror}") from None
    try:
        assert child.stderr is not None
        messages = relay(child.stderr, sys.stderr)
        code = child.wait()
        if stopped.is_set():
            # systemd-run may have ended with us (Ctrl-C reaches the whole process group):
            # return only once the unit is gone, its post done and the GPUs free.
            wait_until_gone(unit, time.monotonic() + GONE_DEADLINE_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0:  # systemd-run itself was killed by a signal
        code = 128 - code
    return command_status(code, messages)


def wait_until_gone(
    unit: str,
    deadline: float,
    state: Callable[[str], str | None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> bool:
    """Poll the unit's ActiveState until it is neither running nor stopping (a collected
    unit reads inactive); False at the deadline."""
    state = state or active_state
    while clock() < deadline:
        if state(unit) not in STOPPING_OR_RUNNING:
            return True
        pause(0.2)
    return False


def relay(source: IO[bytes], target: IO[str]) -> str:
    """Copy systemd-run's stderr through, line by line; return it all."""
    seen: list[str] = []
    for raw in iter(source.readline, b""):
        line = raw.decode("utf-8", "replace")
        seen.append(line)
        try:
            target.write(line)
            target.flush()
        except OSError:
            pass  # the terminal is gone: keep draining, the status is still wanted
    return "".join(seen)


def stop_without_waiting(unit: str) -> None:
    systemctl = find_program("systemctl")
    if systemctl is None:
        return
    # Failing, systemd-run's own end (the pty hung up) still stops a --pty unit.
    with contextlib.suppress(GateError):
        run_program([str(systemctl), "stop", "--no-block", "--", unit], SYSTEMCTL_TIMEOUT_S)
