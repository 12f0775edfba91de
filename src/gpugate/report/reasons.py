"""A choice's rule in words: what the journal's holder entries say after the holder."""

from __future__ import annotations

from collections.abc import Mapping

from gpugate.core.decide import Choice, Rule, Verdict
from gpugate.host.safe_files import account
from gpugate.report.holder_text import container_handle, container_text
from gpugate.untrusted import CGROUP, COMM, shown


def held_text(choice: Choice) -> str:
    gpus = ", ".join(map(str, choice.on_owned))
    ports = ", ".join(map(str, sorted(choice.holder.ports)))
    parts = (f"GPU {gpus}" if gpus else "", f"port {ports}" if ports else "")
    return " and ".join(part for part in parts if part)


def reason_text(choice: Choice, unit: str, phase: str) -> str:
    """unit: the run's unit; phase: its phase (named in the setting that blocked)."""
    held = held_text(choice)
    holder = choice.holder
    rule = choice.rule
    if rule is Rule.PROTECTED:
        return "protected by configuration"
    if rule is Rule.WATCHER:
        return "a watcher: NVML lists it on no GPU, with no memory"
    if rule is Rule.CGROUP:
        return f"in {unit}'s cgroup"
    if rule is Rule.UNIT_CONTAINER and holder.container is not None:
        return f"in {container_text(holder.container)}, one of {unit}'s (containers)"
    if rule is Rule.NOT_OWNED:
        why = "holds only control devices" if holder.control_devices else "holds no GPU"
        return f"{why} of {unit}"
    if rule is Rule.STRADDLES:
        foreign = ", ".join(map(str, choice.foreign))
        return f"holds {held or 'no GPU of it'} but also GPU {foreign}, which {unit} does not own"
    if rule is Rule.APP_TREE:
        return f"same application as PID {choice.seed_pid}"
    if rule is Rule.OTHER_ACCOUNT:
        return other_account(choice, held)
    if rule is Rule.ORPHAN:
        kept = choice.verdict is Verdict.BLOCK
        return f"orphan holding {held}" + (f" ({phase}.kill_orphans = false)" if kept else "")
    return other_unit_text(choice, unit, held)


def other_unit_text(choice: Choice, unit: str, held: str) -> str:
    container, other = choice.holder.container, shown(choice.other_unit, CGROUP)
    if choice.verdict is Verdict.KILL:
        return f"{container_text(container) if container else other} holds {held}"
    if container is None:
        return f"active unit {other} holds {held} (kill_other_units = false)"
    handle = container_handle(container)
    return (
        f"{container_text(container)} holds {held} (scope {other}; kill_other_units = false); "
        f'if it is {unit}\'s, set containers = ["{handle}"] in its gpugate config '
        f"(gpugate install {unit} --container {handle})"
    )


def other_account(choice: Choice, held: str) -> str:
    return (
        f"{account(choice.holder.info.uid)}'s process holds {held or 'them'}; this "
        f"`gpugate run` acts for {account(choice.for_uid)} and kills only its processes"
    )


def other_account_refusal(unit: str, choices: list[Choice]) -> str:
    """gpugate run's one line before it starts anything (exit 22)."""
    first = choices[0]
    holder = first.holder
    more = f" (and {len(choices) - 1} more)" if len(choices) > 1 else ""
    return (
        f"not starting {unit}: PID {holder.pid} ({shown(holder.info.comm, COMM)}) of "
        f"{account(holder.info.uid)} holds {held_text(first) or 'its GPUs'}{more}; "
        f"`gpugate run` acts for {account(first.for_uid)} and kills only its processes: "
        "nothing was killed; ask that account (or root) to stop it"
    )


def sudo_variables_text(environ: Mapping[str, str]) -> str:
    """gpugate run under root with SUDO_UID or SUDO_GID that sudo would not have written."""
    shown = ", ".join(
        f"{name}={environ[name][:20]!r}" for name in ("SUDO_UID", "SUDO_GID") if name in environ
    )
    return (
        f"{shown}: not a uid and gid as sudo sets them (decimal digits); gpugate run under "
        "root acts for the account SUDO_UID names and will not guess: unset them, or run it "
        "through sudo"
    )
