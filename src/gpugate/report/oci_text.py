"""The words of `gpugate oci-hook` and `install --containers`: a container as operators see
it, where its GPUs came from, the container-lease refusal, and what install did to docker."""

from __future__ import annotations

from collections.abc import Sequence

from gpugate.report.untrusted import CGROUP, CONTAINER, shown


def container_label(
    runtime: str, container_id: str, name: str | None, claimed: tuple[str, str] | None = None
) -> str:
    """`podman container vllm (3f2a1b0c4d5e)` with the runtime's own name; with only a name
    its author set, `podman container 3f2a1b0c4d5e ("vllm" by its annotation KEY)`; else
    `podman container 3f2a1b0c4d5e`. Names shown escaped."""
    short = container_id[:12]
    if name:
        return f"{runtime} container {shown(name, CONTAINER)} ({short})"
    if claimed:
        key, said = claimed
        return f'{runtime} container {short} ("{shown(said, CONTAINER)}" by its annotation {key})'
    return f"{runtime} container {short}"


def request_text(minors: Sequence[int], refs: Sequence[str], all_gpus: bool) -> str:
    """Where a container's GPUs came from, for the run's first entry."""
    parts = []
    if minors:
        parts.append("device nodes " + ", ".join(f"/dev/nvidia{m}" for m in minors))
    if all_gpus:
        parts.append("NVIDIA_VISIBLE_DEVICES=all")
    elif refs:
        parts.append("NVIDIA_VISIBLE_DEVICES=" + ",".join(refs))
    return "the container's config.json (" + "; ".join(parts) + ")"


def hook_failed(stage: str, text: str) -> str:
    """`gpugate oci-hook STAGE`'s one line on stderr: the runtime shows it as the hook's error."""
    return f"gpugate: oci-hook {stage}: {text}"


def no_own_cgroup(cgroup: str, container_id: str) -> str:
    """The refusal of a container whose cgroup its runtime did not make for it alone."""
    where = f"cgroup {shown(cgroup, CGROUP)}" if cgroup else "no cgroup the hook can read"
    return (
        f"container {container_id[:12]} runs in {where}, not in one of its own (a runtime's "
        "scope or folder named after its id): gated, it would be the unit around it; not "
        "started (docs/containers.md)"
    )


def not_gated_text(why: str) -> str:
    """The one journal line of a hook run by a runtime that is not the host's root."""
    return (
        f"not gated: the container's runtime is not the host's root ({why}); gpugate gates "
        "only containers of root's runtimes (docs/containers.md)"
    )


def runtime_failed(text: str) -> str:
    return f"gpugate-oci-runtime: {text}"


def runtime_no_runc(paths: Sequence[str]) -> str:
    return runtime_failed(f"no runc in {', '.join(paths)}")


NOTHING_TO_SET_UP = "no podman, CRI-O or docker here: nothing to do"
DOCKER_RELOADED = "reloaded docker (systemctl reload docker)"
DOCKER_NOT_RUNNING = "docker is not running: it reads daemon.json when it starts"
DOCKER_NO_SYSTEMCTL = "docker not reloaded (no systemctl): run `systemctl reload docker`"


def docker_reload_failed(detail: str) -> str:
    return f"daemon.json written, but {detail}; run `systemctl reload docker`"
