"""The words of `gpugate oci-hook` and `install --containers`: a container as operators see
it, where its GPUs came from, the container-lease refusal, and what install did to docker."""

from __future__ import annotations

from collections.abc import Sequence

from gpugate.untrusted import CGROUP, CONTAINER, escape, shown


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


# Why NVIDIA's config defaults stood in for its file (host/oci_gpus.py's codes).
TOOLKIT_NOTES = {
    "untrusted": "another account than root may change it",
    "unreadable": "not a regular file of at most 1 MiB of TOML",
    "not-boolean": "its accept-nvidia-visible-devices-* keys are not true or false",
}


def request_text(
    minors: Sequence[int],
    refs: Sequence[str],
    all_gpus: bool,
    origins: Sequence[str] = (),
    note: str = "",
) -> str:
    """Where a container's GPUs came from, for the run's first entry: `the container's
    config.json (devices 195:1, 195:2; NVIDIA's list 0,GPU-…; from linux.devices, mounts)`."""
    parts = []
    if minors:
        parts.append("devices " + ", ".join(f"195:{m}" for m in minors))
    if all_gpus:
        parts.append("NVIDIA's list: all")
    elif refs:
        parts.append("NVIDIA's list: " + ",".join(escape(ref) for ref in refs))
    if origins:
        parts.append("from " + ", ".join(escape(origin) for origin in origins))
    if note in TOOLKIT_NOTES:
        parts.append(
            "NVIDIA's defaults assumed: /etc/nvidia-container-runtime/config.toml: "
            + TOOLKIT_NOTES[note]
        )
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


NOTHING_TO_SET_UP = "no podman, CRI-O, docker or containerd here: nothing to do"
CONTAINERD_RESTART = (
    "containerd reads its config only when it starts: systemctl restart containerd "
    "(running containers keep running)"
)
