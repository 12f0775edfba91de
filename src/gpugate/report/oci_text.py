"""The words of `gpugate oci-hook` and `install --containers`: a container as operators see
it, where its GPUs came from, the container-lease refusal, and what install did to docker."""

from __future__ import annotations

from collections.abc import Sequence


def container_label(runtime: str, container_id: str, name: str | None) -> str:
    """`podman container vllm (3f2a1b0c4d5e)`, or without a name `podman container 3f2a…`."""
    short = container_id[:12]
    return f"{runtime} container {name} ({short})" if name else f"{runtime} container {short}"


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


def runtime_failed(text: str) -> str:
    return f"gpugate-oci-runtime: {text}"


def runtime_no_runc(paths: Sequence[str]) -> str:
    return runtime_failed(f"no runc in {', '.join(paths)}")


NOTHING_TO_SET_UP = "no podman, CRI-O, docker or containerd here: nothing to do"
CONTAINERD_RESTART = (
    "containerd reads its config only when it starts: systemctl restart containerd "
    "(running containers keep running)"
)
