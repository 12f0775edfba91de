"""Docker and podman containers: which container a cgroup belongs to (a `docker-ID.scope` or
`libpod-ID.scope` directly under the runtime's slices), a container's own cgroup for its OCI
hook, its name from the runtime's CLI (one bounded call per runtime), and its stop."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from gpugate.errors import GateError
from gpugate.host.safe_files import find_program, run_program
from gpugate.host.systemd import cgroup_parts, is_user_cgroup, system_unit_of_cgroup

SCOPE = re.compile(r"(?P<kind>docker|libpod)-(?P<id>[0-9a-f]{64})\.scope")
# The top slice each runtime puts its scopes under (its default cgroup parent, and kubelet's).
PARENTS = {"docker": ("system.slice", "kubepods.slice"), "libpod": ("machine.slice",)}
INSPECT_TIMEOUT_S = 3.0
STOP_MARGIN_S = 5.0


class Container(NamedTuple):
    runtime: str  # "docker" or "podman"
    id: str  # 64 hex digits
    scope: str  # the cgroup that holds all its processes, "/system.slice/docker-ID.scope"
    name: str | None = None  # from the runtime's CLI; None where it could not be asked

    @property
    def short_id(self) -> str:
        return self.id[:12]

    @property
    def label(self) -> str:  # `docker container vllm (3f2a1b0c4d5e)`
        named = f"{self.name} ({self.short_id})" if self.name else self.short_id
        return f"{self.runtime} container {named}"

    @property
    def handle(self) -> str:  # what to write in `containers = [...]`
        return self.name or self.short_id

    def matches(self, wanted: Iterable[str]) -> bool:
        """Named in `containers`: by name, by full id, or by an id prefix of 12 or more."""
        return any(
            item in (self.name, self.id) or (len(item) >= 12 and self.id.startswith(item.lower()))
            for item in wanted
        )


# A container's own cgroup, for its OCI hook (docs/containers.md, "Which cgroup is the
# container's"): a folder its runtime named after the container's 64-hex id: the systemd
# driver's scopes (`libpod-ID.scope`, `docker-ID.scope`, `crio-ID.scope`,
# `cri-containerd-ID.scope`, `nerdctl-ID.scope`), the cgroupfs driver's folders (`/docker/ID`,
# `libpod-ID`, `crio-ID`, `.../podUID/ID`), podman's `--cgroups=split`
# (`.../NAME.service/libpod-payload-ID`). Not `crio-conmon-ID.scope`: CRI-O's monitor.
OWN_FOLDER = re.compile(
    r"(?:(?P<kind>libpod-payload|libpod|docker|crio|cri-containerd|nerdctl)-)?"
    r"(?P<id>[0-9a-f]{64})(?P<scope>\.scope)?"
)
OWN_RUNTIMES = {
    "libpod": "podman",
    "libpod-payload": "podman",
    "docker": "docker",
    "crio": "cri-o",
    "cri-containerd": "containerd",
    "nerdctl": "nerdctl",
}


class OwnCgroup(NamedTuple):
    cgroup: str  # "/machine.slice/libpod-ID.scope"; what is below it is the container's too
    runtime: str | None  # from the folder's prefix; None for a bare ID
    # The folder is a systemd scope of its own (only slices above it): a unit that systemd
    # calls active exactly while the container runs. None for every other own folder.
    unit: str | None


def own_cgroup(cgroup: str | None, container_id: str) -> OwnCgroup | None:
    """The first folder of cgroup named after container_id (OWN_FOLDER), else None."""
    if not cgroup:
        return None
    parts = cgroup_parts(cgroup)
    if "." in parts or ".." in parts:  # the spec's path as written: not the kernel's form
        return None
    for depth, part in enumerate(parts):
        match = OWN_FOLDER.fullmatch(part)
        if match is None or match.group("id") != container_id:
            continue
        kind = match.group("kind")
        above_are_slices = all(p.endswith(".slice") for p in parts[:depth])
        scope = bool(match.group("scope")) and kind is not None and above_are_slices
        return OwnCgroup(
            cgroup="/" + "/".join(parts[: depth + 1]),
            runtime=OWN_RUNTIMES[kind] if kind else None,
            unit=part if scope and not is_user_cgroup(cgroup) else None,
        )
    return None


def container_of_cgroup(cgroup: str | None) -> Container | None:
    unit = system_unit_of_cgroup(cgroup) if cgroup else None
    match = SCOPE.fullmatch(unit or "")
    parts = cgroup_parts(cgroup or "")
    if match is None or parts[0] not in PARENTS[match.group("kind")]:
        return None  # also a scope at the top: none of the runtimes' parents
    return Container(
        runtime=OWN_RUNTIMES[match.group("kind")],
        id=match.group("id"),
        scope="/" + "/".join(parts[: parts.index(match.group(0)) + 1]),
    )


def container_scopes(cgroup_root: Path) -> list[Container]:
    globs = ("*.slice/docker-*.scope", "*.slice/libpod-*.scope")
    paths = [path for pattern in globs for path in sorted(cgroup_root.glob(pattern))]
    found = [container_of_cgroup("/" + str(path.relative_to(cgroup_root))) for path in paths]
    return [container for container in found if container is not None]


def container_names(containers: Sequence[Container]) -> list[Container]:
    """containers with the names their runtime's CLI gives them: one bounded `inspect` per
    runtime; a CLI that is missing, fails or does not answer in time leaves names unknown."""
    known: dict[str, str] = {}
    for runtime in sorted({c.runtime for c in containers}):
        ids = [c.id for c in containers if c.runtime == runtime]
        found = find_program(runtime)
        if found is None:
            continue
        argv = [found, "inspect", "--type", "container", "--format", "{{.Id}} {{.Name}}", *ids]
        try:
            result = run_program(argv, INSPECT_TIMEOUT_S)
        except GateError:  # did not answer in time, or could not be started
            continue
        # Exit 1 where one of the ids is gone already; the others are still printed.
        for line in result.stdout.splitlines():
            full_id, _, name = line.strip().partition(" ")
            if full_id in ids and name.strip("/"):
                known[full_id] = name.strip().lstrip("/")
    return [c._replace(name=known.get(c.id)) for c in containers]


class StopResult(NamedTuple):
    container: Container
    ok: bool
    detail: str = ""  # the runtime's own words where it failed
    error: GateError | None = None  # where the runtime did not answer, or could not be run
    no_cli: bool = False  # no CLI of the runtime in the system folders


def stop_containers(containers: Sequence[Container], grace_s: float) -> list[StopResult]:
    """`docker stop --time N ID` / `podman stop`: the runtime signals, waits, SIGKILLs, and
    records the container as stopped (its restart policy does not bring it back)."""
    results: list[StopResult] = []
    seconds = max(int(grace_s + 0.999), 1)
    for container in containers:
        found = find_program(container.runtime)
        if found is None:
            results.append(StopResult(container, False, no_cli=True))
            continue
        argv = [found, "stop", "--time", str(seconds), container.id]
        try:
            result = run_program(argv, seconds + STOP_MARGIN_S)
        except GateError as exc:  # did not answer in time, or could not be started
            results.append(StopResult(container, False, error=exc))
            continue
        detail = result.first_line() if result.returncode else ""
        results.append(StopResult(container, result.returncode == 0, detail))
    return results
