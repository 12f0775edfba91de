"""`gpugate install|uninstall --sweep`: the gpugate-sweep.timer on, or off again.

The packages carry gpugate-sweep.service and .timer in /usr/lib/systemd/system, disabled.
Without them (gpugate from pip), install writes both into the systemd folder, marked as
install's own (install_files' header), and uninstall removes them where unchanged. Then the
timer is enabled (--now where systemd runs), or disabled and stopped."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpugate.config.values import SWEEP_INTERVAL_S
from gpugate.errors import ExitCode, GateError, InstallError
from gpugate.front import install
from gpugate.front.install import Action, Change
from gpugate.front.install_files import Ownership, ownership, with_header
from gpugate.front.self_command import command_for, gpugate_command
from gpugate.host.safe_files import SYSTEM_PATH, find_program, run_program
from gpugate.host.systemd import systemd_running
from gpugate.report import lines
from gpugate.untrusted import echo

SERVICE = "gpugate-sweep.service"
TIMER = "gpugate-sweep.timer"
PACKAGED_DIR = Path("/usr/lib/systemd/system")
SYSTEMCTL_TIMEOUT_S = 60

SERVICE_TEMPLATE = """\
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
"""

TIMER_TEMPLATE = f"""\
# Runs gpugate-sweep.service once a minute. reap_after_s and drain_after_s below this
# interval are config errors: a holder must be seen unowned by two sweeps.
[Unit]
# What `systemctl list-timers` shows.
Description=gpugate sweep once a minute
Documentation=man:gpugate(1)

[Timer]
# A minute after boot, then a minute after each sweep began.
OnBootSec={SWEEP_INTERVAL_S}
OnUnitActiveSec={SWEEP_INTERVAL_S}
# The default AccuracySec= (a minute) would let sweeps drift up to two minutes apart.
AccuracySec=1s

[Install]
# Enabled by `gpugate install --sweep`, not by the package.
WantedBy=timers.target
"""


def render_service(command: Sequence[str]) -> str:
    return SERVICE_TEMPLATE.replace("@GPUGATE@", " ".join(command))


def render_timer() -> str:
    return TIMER_TEMPLATE


def plan(systemd_dir: Path, command: Sequence[str], *, installing: bool) -> list[Change]:
    """The unit files in systemd_dir: none where the package carries them."""
    if (PACKAGED_DIR / TIMER).exists() and (PACKAGED_DIR / SERVICE).exists():
        return []
    changes = []
    for name, body in ((SERVICE, render_service(command)), (TIMER, render_timer())):
        path = systemd_dir / name
        owner = ownership(path)
        if installing:
            text = with_header(body)
            if owner is Ownership.OPERATORS:
                changes.append(Change(path, Action.KEEP, note="edited"))
            else:
                same = owner is Ownership.OURS and path.read_text() == text
                changes.append(Change(path, Action.UNCHANGED if same else Action.WRITE, text))
        elif owner is Ownership.OURS:
            changes.append(Change(path, Action.REMOVE))
        elif owner is Ownership.ABSENT:
            changes.append(Change(path, Action.ABSENT))
        else:
            changes.append(Change(path, Action.KEEP, note="edited-removable"))
    return changes


def systemctl(*words: str) -> None:
    program = find_program("systemctl")
    if program is None:
        raise InstallError(
            f"files written, but no systemctl in {SYSTEM_PATH}: run `systemctl daemon-reload`"
        )
    try:
        result = run_program([program, *words], SYSTEMCTL_TIMEOUT_S)
    except GateError as exc:
        raise InstallError(f"files written, but {exc}; run it yourself") from None
    if result.returncode != 0:
        detail = (result.stderr or result.stdout or "").strip().splitlines()
        said = echo(detail[-1] if detail else "", quote=False)
        raise InstallError(f"`systemctl {words[0]} gpugate-sweep.timer` failed: {said}")


def sweep_setup(
    installing: bool,
    *,
    systemd_dir: Path,
    dry_run: bool = False,
    no_reload: bool = False,
    gpugate_path: Path | None = None,
) -> int:
    command = command_for(str(gpugate_path)) if gpugate_path else gpugate_command()
    changes = plan(systemd_dir, command, installing=installing)
    now = ["--now"] if systemd_running() else []
    there = any((folder / TIMER).exists() for folder in (PACKAGED_DIR, systemd_dir))
    if not installing and not dry_run and there:  # none there: nothing to disable
        systemctl("disable", *now, TIMER)
        print(lines.sweep_timer(enabled=False))
    install.apply(changes, dry_run=dry_run, reload=lambda: False)
    if dry_run:
        return int(ExitCode.OK)
    written = any(c.action in (Action.WRITE, Action.REMOVE) for c in changes)
    if written and not no_reload:
        print(lines.reloaded(install.systemctl_daemon_reload()))
    if installing:
        systemctl("enable", *now, TIMER)
        print(lines.sweep_timer(enabled=True))
    return int(ExitCode.OK)
