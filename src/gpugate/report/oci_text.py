"""The words of `gpugate oci-hook` and `install --containers`: a container as operators see
it, where its GPUs came from, the container-lease refusal, and what install did to docker."""

from __future__ import annotations

from collections.abc import Sequence

from gpugate.untrusted import escape


def container_label(runtime: str, container_id: str, name: str | None) -> str:
    """`podman container vllm (3f2a1b0c4d5e)`, or without a name `podman container 3f2a…`."""
    short = container_id[:12]
    return f"{runtime} container {name} ({short})" if name else f"{runtime} container {short}"


# Why NVIDIA's config defaults stood in for its file (host/nvidia_toolkit.py's codes).
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


def runtime_failed(text: str) -> str:
    return f"gpugate-oci-runtime: {text}"


def runtime_no_runc(paths: Sequence[str]) -> str:
    return runtime_failed(f"no runc in {', '.join(paths)}")


NOTHING_TO_SET_UP = "no podman, CRI-O, docker or containerd here: nothing to do"
CONTAINERD_RESTART = (
    "containerd reads its config only when it starts: systemctl restart containerd "
    "(running containers keep running)"
)
