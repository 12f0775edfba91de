"""`gpugate oci-hook STAGE`, the part every container pays for: the standard library alone;
only a container that asks for a GPU loads the rest of gpugate (front/container_hook.py)."""

from __future__ import annotations

import sys

from gpugate.errors import BadInput, ExitCode
from gpugate.host.oci import (
    is_sandbox,
    not_host_root,
    parse_config,
    parse_state,
    read_config,
    read_stdin_bounded,
)

TYPE_CHECKING = False  # typing's own costs the no-GPU path an import
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from gpugate.host.nvml import GpuDriver
    from gpugate.host.oci import ContainerSpec, ContainerState
    from gpugate.host.systemd import HostRoots

# OCI runtime-spec's hook stages; gpugate acts at the first two and the last (container_hook.py).
ACTING = ("createRuntime", "prestart", "poststop")
STAGES = (*ACTING, "createContainer", "startContainer", "poststart")
NOT_ROOT = "not-host-root"  # GPUGATE_REASON of the one line a hook that is not root sends
USAGE = "usage: gpugate oci-hook {" + ",".join(STAGES) + "}  (the container's state on stdin)"


def main(
    argv: Sequence[str],
    *,
    roots: HostRoots | None = None,
    config: Path | None = None,
    driver_factory: Callable[[], GpuDriver] | None = None,
) -> int:
    if len(argv) != 1 or argv[0] not in STAGES:
        helped = argv[:1] in (["-h"], ["--help"])
        print(USAGE, file=sys.stdout if helped else sys.stderr)
        return int(ExitCode.OK if helped else ExitCode.USAGE)
    stage = argv[0]
    # A rootless runtime reads the same hooks.d: its containers are its user's, not gated.
    why = not_host_root()
    try:
        found = read_input(stage) if why is None or stage in ACTING[:2] else None
    except BadInput as exc:
        if why is not None:
            return int(ExitCode.OK)
        from gpugate.report.lines import hook_failed  # noqa: PLC0415 (a failure's words)

        print(hook_failed(stage, exc.message), file=sys.stderr)
        return int(exc.exit_code)
    if found is None or not found[1].gpus:
        return int(ExitCode.OK)  # no GPU asked for, or nothing to do at this stage
    state, spec = found
    if why is not None:
        return not_gated(stage, state.id, why)
    if is_sandbox(state.id, {**spec.annotations, **state.annotations}):
        return int(ExitCode.OK)  # a pod's sandbox: not gpugate's container
    from gpugate.front.container_hook import run_from_hook  # noqa: PLC0415

    return run_from_hook(stage, state, spec, roots=roots, config=config, driver=driver_factory)


def read_input(stage: str) -> tuple[ContainerState, ContainerSpec] | None:
    """The state on stdin and its bundle's spec; None where the stage has nothing to do."""
    state = parse_state(read_stdin_bounded())
    if stage not in ACTING:
        return None
    try:
        raw = read_config(state.bundle)
    except BadInput:
        if stage == "poststop":  # the runtime may have removed the bundle already;
            return None  # the lease is stale once the scope is gone
        raise
    return state, parse_config(raw, f"{state.bundle}/config.json", lenient=stage == "poststop")


def not_gated(stage: str, container_id: str, why: str) -> int:
    """A hook that is not the host's root touches nothing and exits 0; at the start of a
    container that asks for GPUs it sends one journal line saying it is not gated."""
    # Loaded only here: a rootless GPU container's start, not every container's.
    from gpugate.report.journal import PRIORITY_NOTICE, Event, Reporter  # noqa: PLC0415

    fields = {"GPUGATE_OCI_CONTAINER": container_id}
    reporter = Reporter(f"container-{container_id}", stage, echo=False, fields=fields)
    try:
        reporter.event(
            Event.WARNING,
            f"not gated: the container's runtime is not the host's root ({why}); gpugate "
            "gates only containers of root's runtimes (docs/containers.md)",
            priority=PRIORITY_NOTICE,
            reason=NOT_ROOT,
        )
    except Exception:  # noqa: BLE001 - no journal (python-systemd missing): still exit 0
        return int(ExitCode.OK)
    return int(ExitCode.OK)
