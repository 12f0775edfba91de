"""GPU leases: from a unit's successful `pre` until its `post`, the unit holds its GPUs.

One JSON file per unit in LOCK_DIR/leases/, replaced atomically (a temporary file in the same
folder, fsync, rename), so a crash of gpugate leaves the old lease or the new one, never half
of one; lock_dir is on /run, a tmpfs, so a reboot clears them all. Readers and writers on
overlapping GPUs hold the per-GPU flock locks (locks.py), so a lease is checked and written in
one turn. A lease whose unit systemd no longer calls active or activating is stale.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpugate.errors import PermissionDenied, StateUnwritable
from gpugate.host.nvml import Gpu
from gpugate.host.safe_files import write_atomically
from gpugate.integrations import records
from gpugate.integrations.records import BadRecord
from gpugate.report.narrate import lease_refusal_text
from gpugate.untrusted import STATE, shown

LEASE_FOLDER = "leases"
# Set by `gpugate run` on its transient unit (front/launch.py), read by the unit's pre
# from the environment systemd gives it. Neither widens what gpugate kills: a forced run only
# skips the lease refusal; another running unit's processes stay spared by the cgroup rule.
STARTED_BY_VARIABLE = "GPUGATE_STARTED_BY"
RUNNING_STATES = frozenset({"active", "activating", "reloading", "refreshing"})


@dataclass(frozen=True)
class Lease:
    unit: str
    gpus: tuple[int, ...]  # NVML indices when the lease was taken
    uuids: tuple[str, ...]  # what overlap is decided on: indices move when a GPU falls off
    share: bool  # the unit's share_gpus: it may hold the GPUs together with other sharers
    since: float  # Unix time the lease was taken
    invocation_id: str | None = None  # the unit's INVOCATION_ID at its pre
    pid: int = 0  # the gpugate pre that took it
    # Who started the unit by hand (`gpugate run` sets GPUGATE_STARTED_BY on its transient
    # unit: "alice (uid 1000)"); None for units systemd starts. Old lease files lack it.
    started_by: str | None = None
    # A container's lease (`gpugate oci-hook`): the unit is its scope (libpod-ID.scope),
    # active while it runs; this is the container in words ("podman container vllm (3f2a…)").
    container: str | None = None

    def overlap(self, gpus: Sequence[Gpu]) -> list[Gpu]:
        mine = {uuid.lower() for uuid in self.uuids}
        return [gpu for gpu in gpus if gpu.uuid.lower() in mine]

    def as_json(self) -> dict[str, object]:
        return {
            "unit": self.unit,
            "gpus": list(self.gpus),
            "uuids": list(self.uuids),
            "share": self.share,
            "since": self.since,
            "invocation_id": self.invocation_id,
            "pid": self.pid,
            "started_by": self.started_by,
            "container": self.container,
        }

    def holder_text(self) -> str:
        """The lease's unit in words, for refusals: who started it and when."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        by = f"`gpugate run` by {shown(self.started_by, STATE)}, " if self.started_by else ""
        who = self.container or self.unit
        return f"{shown(who, STATE)} ({by}since {when})"


def lease_dir(lock_dir: Path) -> Path:
    return lock_dir / LEASE_FOLDER


def lease_path(lock_dir: Path, unit: str) -> Path:
    return lease_dir(lock_dir) / f"{unit}.json"


def new_lease(
    unit: str,
    gpus: Sequence[Gpu],
    *,
    share: bool,
    invocation_id: str | None = None,
    started_by: str | None = None,
    container: str | None = None,
) -> Lease:
    return Lease(
        unit=unit,
        gpus=tuple(gpu.index for gpu in gpus),
        uuids=tuple(gpu.uuid for gpu in gpus),
        share=share,
        since=time.time(),
        invocation_id=invocation_id or None,
        pid=os.getpid(),
        started_by=started_by or None,
        container=container,
    )


MAX_GPU_INDEX = 4095
MAX_PID = 2**22  # the kernel's largest pid_max
MAX_SINCE = 2.0**40  # Unix time: some 30000 years from now


def lease_from(data: dict[str, object]) -> Lease:
    """A lease record's fields, checked (records.BadRecord where one is not sane)."""
    started_by = records.text(data, "started_by", 4096, optional=True)
    return Lease(
        unit=str(records.text(data, "unit", 256)),
        gpus=records.integers(data, "gpus", 0, MAX_GPU_INDEX),
        uuids=records.texts(data, "uuids", 128),
        share=records.flag(data, "share"),
        since=records.number(data, "since", 0, MAX_SINCE),
        invocation_id=records.text(data, "invocation_id", 128, optional=True),
        pid=records.integer(data, "pid", 0, MAX_PID, default=0),
        started_by=started_by[:200] if started_by else None,
        container=records.text(data, "container", 300, optional=True),
    )


def parse_lease(text: str) -> Lease | None:
    """A lease file's content, or None where it is not one (edited or foreign)."""
    try:
        return lease_from(records.parse_record(text))
    except BadRecord:
        return None


@dataclass
class LeaseFiles:
    leases: list[Lease] = field(default_factory=list)
    unreadable: list[Path] = field(default_factory=list)  # not a lease: reported, ignored
    why: dict[Path, str] = field(default_factory=dict)  # each unreadable one's fault


def read_leases(lock_dir: Path) -> LeaseFiles:
    found = LeaseFiles()
    try:
        entries = sorted(lease_dir(lock_dir).glob("*.json"))
    except OSError:
        return found
    for path in entries:
        try:
            lease = lease_from(records.read_record(path))
            if path.name != f"{lease.unit}.json":
                raise BadRecord(f"its unit is not {path.name[: -len('.json')]}")
        except FileNotFoundError:
            continue  # released while we listed
        except BadRecord as exc:
            found.unreadable.append(path)
            found.why[path] = exc.why
        else:
            found.leases.append(lease)
    return found


def write_lease(lock_dir: Path, lease: Lease) -> Path:
    """Replace the unit's lease atomically."""
    target = lease_path(lock_dir, lease.unit)
    try:
        write_atomically(target, json.dumps(lease.as_json(), sort_keys=True) + "\n")
    except PermissionError:
        raise PermissionDenied(f"{target}: permission denied writing the GPU lease there") from None
    except OSError as exc:  # no space, read-only, a file where the folder should be
        raise StateUnwritable(
            target,
            "gpu-lease",
            f"{target}: cannot write the GPU lease there: {exc.strerror or str(exc)}",
        ) from None
    return target


def release_lease(lock_dir: Path, unit: str) -> bool:
    """Remove the unit's lease; False where it held none. StateUnwritable where it cannot be
    removed (a folder in its place, a read-only file system)."""
    path = lease_path(lock_dir, unit)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StateUnwritable(
            path,
            "gpu-lease",
            f"{path}: cannot write the GPU lease there: {exc.strerror or str(exc)}",
        ) from None
    return True


@dataclass(frozen=True)
class LeaseCheck:
    """What the leases of other units say about a run on `gpus`."""

    conflicts: list[tuple[Lease, list[Gpu]]]  # live leases on our GPUs: the run refuses
    shared: list[tuple[Lease, list[Gpu]]]  # live leases both sides agreed to share
    stale: list[tuple[Lease, str]]  # leases of units no longer running, with their state
    unreadable: list[Path]
    why: dict[Path, str] = field(default_factory=dict)  # each unreadable one's fault

    def refusal(self) -> str:
        """The refusal in words (report/'s): which GPUs are leased to whom."""
        conflicts = [
            ([gpu.index for gpu in gpus], lease.holder_text()) for lease, gpus in self.conflicts
        ]
        containers = all(lease.container for lease, _ in self.conflicts)
        return lease_refusal_text(conflicts, containers=containers)


def check_leases(
    lock_dir: Path,
    unit: str,
    gpus: Sequence[Gpu],
    *,
    share: bool,
    unit_state: Callable[[str], str | None],
) -> LeaseCheck:
    """unit_state: the unit's ActiveState (None: unknown, taken as still running)."""
    files = read_leases(lock_dir)
    conflicts: list[tuple[Lease, list[Gpu]]] = []
    shared: list[tuple[Lease, list[Gpu]]] = []
    stale: list[tuple[Lease, str]] = []
    for lease in files.leases:
        if lease.unit == unit:
            continue  # the unit's own, from an earlier start: replaced
        overlap = lease.overlap(gpus)
        if not overlap:
            continue
        state = unit_state(lease.unit)
        if state is not None and state not in RUNNING_STATES:
            stale.append((lease, state))
        elif share and lease.share:
            shared.append((lease, overlap))
        else:
            conflicts.append((lease, overlap))
    return LeaseCheck(conflicts, shared, stale, files.unreadable, files.why)


def leases_by_gpu(leases: Sequence[Lease]) -> dict[str, list[str]]:
    """UUID (lower case) to the units leasing it, for `status`."""
    by_uuid: dict[str, list[str]] = {}
    for lease in leases:
        for uuid in lease.uuids:
            by_uuid.setdefault(uuid.lower(), []).append(lease.unit)
    return by_uuid
