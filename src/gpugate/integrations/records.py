"""gpugate's own state (GPU leases, failed-start records, the sweep's and metrics' counters):
written whole, read back capped; a record gpugate did not write is a `BadRecord`, said once."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from gpugate.config.file import DEFAULT_CONFIG_DIR
from gpugate.errors import BadRecord, NotRegularFile, PermissionDenied, StateUnwritable, TooLarge
from gpugate.host.locks import flock_by
from gpugate.host.nvml import Gpu
from gpugate.host.safe_files import folder, open_in, read_capped, write_atomically, write_in
from gpugate.host.scan import ProcessId
from gpugate.report.narrate import lease_refusal_text
from gpugate.untrusted import STATE, printable

MAX_RECORD_BYTES = 64 * 1024  # what gpugate writes is under 2 KiB
MAX_DIGITS = 20  # a JSON number longer than this is no count, PID or time of gpugate's
MAX_ITEMS = 1024  # a list in a record: GPUs, UUIDs
MAX_GPU_INDEX = 4095
MAX_PID = 2**22  # the kernel's largest pid_max
MAX_SINCE = 2.0**40  # Unix time: some 30000 years from now
LOCK_TIMEOUT_S = 10.0

LEASE_FOLDER = "leases"
FAILED_FOLDER = "failed"
# Set by `gpugate run` on its transient unit, read by the unit's pre from the environment
# systemd gives it. A forced run only skips the lease refusal; it widens no kill.
STARTED_BY_VARIABLE = "GPUGATE_STARTED_BY"
CONTAINERS_CONFIG = str(DEFAULT_CONFIG_DIR / "containers.toml")  # the OCI hook's config
RUNNING_STATES = frozenset({"active", "activating", "reloading", "refreshing"})


@contextlib.contextmanager
def flocked(folder_fd: int, name: str, what: object) -> Iterator[None]:
    """name in the folder, made where missing, flocked (TimeoutError after LOCK_TIMEOUT_S)."""
    fd = open_in(folder_fd, name, os.O_RDWR | os.O_CREAT)
    try:
        if not flock_by(fd, time.monotonic() + LOCK_TIMEOUT_S):
            raise TimeoutError(errno.EBUSY, os.strerror(errno.EBUSY), str(what))
        yield
    finally:
        os.close(fd)


def _constant(name: str) -> float:
    raise BadRecord(f"{name} is not a number gpugate writes")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise BadRecord(f"a number of {len(text)} digits")
    return int(text)


def _real(text: str) -> float:
    if len(text) > 2 * MAX_DIGITS:
        raise BadRecord(f"a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise BadRecord(f"{text} is out of range")
    return value


def parse_record(text: str) -> dict[str, Any]:
    """A JSON object with sane numbers, or BadRecord."""
    try:
        data = json.loads(text, parse_constant=_constant, parse_int=_integer, parse_float=_real)
    except RecursionError:
        raise BadRecord("nested too deeply") from None
    except BadRecord:
        raise
    except ValueError as exc:  # JSONDecodeError is one
        raise BadRecord(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(data, dict):
        raise BadRecord(f"a JSON {type(data).__name__}, not an object")
    return data


def read_record(path: Path | str, dir_fd: int | None = None) -> dict[str, Any]:
    """FileNotFoundError, or BadRecord: not a capped regular file of UTF-8 sane JSON."""
    try:
        data = read_capped(path, MAX_RECORD_BYTES, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except NotRegularFile:
        raise BadRecord("not a regular file") from None
    except TooLarge:
        raise BadRecord(f"larger than {MAX_RECORD_BYTES // 1024} KiB") from None
    except OSError as exc:
        raise BadRecord(f"cannot be read ({exc.strerror or str(exc)})") from None
    try:
        return parse_record(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8") from None


def _json(record: Lease | FailedPre) -> str:
    return json.dumps(record._asdict(), sort_keys=True) + "\n"


def text(data: Mapping[str, Any], key: str, limit: int, *, optional: bool = False) -> str | None:
    value = data.get(key)
    if optional and (value is None or value == ""):
        return None
    if not isinstance(value, str):
        raise BadRecord(f"{key} is not a string")
    if len(value) > limit:
        raise BadRecord(f"{key} is longer than {limit} characters")
    return value


def integer(
    data: Mapping[str, Any], key: str, low: int, high: int, default: int | None = None
) -> int:
    value: object = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRecord(f"{key} is not an integer from {low} to {high}")
    return value


def number(data: Mapping[str, Any], key: str, low: float, high: float) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRecord(f"{key} is not a number from {low:g} to {high:g}")
    return float(value)


def flag(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key)
    if not isinstance(value, bool):
        raise BadRecord(f"{key} is not true or false")
    return value


def integers(data: Mapping[str, Any], key: str, low: int, high: int) -> tuple[int, ...]:
    return tuple(integer({key: item}, key, low, high) for item in _items(data, key))


def texts(data: Mapping[str, Any], key: str, limit: int) -> tuple[str, ...]:
    return tuple(str(text({key: item}, key, limit)) for item in _items(data, key))


def _items(data: Mapping[str, Any], key: str, limit: int = MAX_ITEMS) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list):
        raise BadRecord(f"{key} is not a list")
    if len(value) > limit:
        raise BadRecord(f"{key} has more than {limit} items")
    return value


class Lease(NamedTuple):
    unit: str
    gpus: tuple[int, ...]  # NVML indices when the lease was taken
    uuids: tuple[str, ...]  # what overlap is decided on: indices move when a GPU falls off
    share: bool  # the unit's share_gpus
    since: float  # Unix time
    invocation_id: str | None = None
    pid: int = 0  # the gpugate pre that took it
    started_by: str | None = None  # `gpugate run`'s caller ("alice (uid 1000)")
    container: str | None = None  # an OCI hook's container in words; the unit is its scope

    def share_place(self) -> str:
        """Where the lease holder's share_gpus is set, in words."""
        if self.container:
            return CONTAINERS_CONFIG
        return "its gpugate run (--share-gpus)" if self.started_by else "its gpugate config"

    def holder_text(self) -> str:
        """The lease's unit in words, for refusals: who started it and when."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        by = f"`gpugate run` by {printable(self.started_by, STATE)}, " if self.started_by else ""
        return f"{printable(self.container or self.unit, STATE)} ({by}since {when})"


def lease_path(lock_dir: Path, unit: str) -> Path:
    return lock_dir / LEASE_FOLDER / f"{unit}.json"


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


def lease_from(data: dict[str, object]) -> Lease:
    started_by = text(data, "started_by", 4096, optional=True)
    return Lease(
        unit=str(text(data, "unit", 256)),
        gpus=integers(data, "gpus", 0, MAX_GPU_INDEX),
        uuids=texts(data, "uuids", 128),
        share=flag(data, "share"),
        since=number(data, "since", 0, MAX_SINCE),
        invocation_id=text(data, "invocation_id", 128, optional=True),
        pid=integer(data, "pid", 0, MAX_PID, default=0),
        started_by=started_by[:200] if started_by else None,
        container=text(data, "container", 300, optional=True),
    )


class LeaseFiles(NamedTuple):
    leases: list[Lease]
    unreadable: dict[Path, str]  # not a lease, why: said, ignored


def read_leases(lock_dir: Path) -> LeaseFiles:
    found = LeaseFiles([], {})
    try:
        entries = sorted((lock_dir / LEASE_FOLDER).glob("*.json"))
    except OSError:
        return found
    for path in entries:
        try:
            lease = lease_from(read_record(path))
            if path.name != f"{lease.unit}.json":
                raise BadRecord(f"its unit is not {path.name[: -len('.json')]}")
        except FileNotFoundError:
            continue  # released while we listed
        except BadRecord as exc:
            found.unreadable[path] = str(exc)
        else:
            found.leases.append(lease)
    return found


def workload_words(lock_dir: Path) -> Callable[[str], str | None]:
    """A unit's words where its lease names a container (a pod as namespace/pod/container,
    not its scope), for the refusals that name it; the leases read once, when first asked."""

    @functools.cache
    def found() -> dict[str, str]:
        leases = read_leases(lock_dir).leases
        return {x.unit: printable(x.container, STATE) for x in leases if x.container}

    return lambda unit: found().get(unit)


def write_lease(lock_dir: Path, lease: Lease) -> None:
    target = lease_path(lock_dir, lease.unit)
    try:
        write_atomically(target, _json(lease))
    except PermissionError:
        raise PermissionDenied(f"{target}: permission denied writing the GPU lease there") from None
    except OSError as exc:  # no space, read-only, a file where the folder should be
        raise _unwritable(target, exc) from None


def release_lease(lock_dir: Path, unit: str) -> None:
    path = lease_path(lock_dir, unit)
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise _unwritable(path, exc) from None


def _unwritable(path: Path, exc: OSError) -> StateUnwritable:
    return StateUnwritable(
        path, "gpu-lease", f"{path}: cannot write the GPU lease there: {exc.strerror or str(exc)}"
    )


class LeaseCheck(NamedTuple):
    """What the leases of other units say about a run on `gpus`."""

    conflicts: list[tuple[Lease, list[Gpu]]]  # live leases on our GPUs: the run refuses
    shared: list[tuple[Lease, list[Gpu]]]  # live leases both sides agreed to share
    stale: list[tuple[Lease, str]]  # leases of units no longer running, with their state
    unreadable: dict[Path, str]
    share: bool = False  # the run's own share_gpus

    def conflicted(self) -> list[int]:
        return sorted({gpu.index for _, gpus in self.conflicts for gpu in gpus})

    def refusal(
        self, place: str | None = None, ours: str | None = None, *, container: bool = False
    ) -> str:
        """place: where this workload's share_gpus is set; ours: how it would share, in words
        (default: set share_gpus = true in place), None: both sides' configs, unnamed;
        container: this workload is a container (containers read one config)."""
        conflicts = [
            ([gpu.index for gpu in gpus], lease.holder_text()) for lease, gpus in self.conflicts
        ]
        containers = all(lease.container for lease, _ in self.conflicts)
        if place is None:
            return lease_refusal_text(conflicts, containers=containers)
        places = {lease.share_place() for lease, _ in self.conflicts}
        where = places.pop() if len(places) == 1 else "their configs"
        return lease_refusal_text(
            conflicts,
            containers=containers,
            theirs=tuple(lease.share for lease, _ in self.conflicts),
            ours=ours or f"set share_gpus = true in {place}",
            sharing=self.share,
            where=where,
            one_place=where == place or (container and containers),
        )


def check_leases(
    lock_dir: Path,
    unit: str,
    gpus: Sequence[Gpu],
    *,
    share: bool,
    unit_state: Callable[[str], str | None],
    around: str | None = None,
) -> LeaseCheck:
    """unit_state: the unit's ActiveState (None: unknown, taken as still running); around: a
    container's enclosing system unit, whose lease is not looked at."""
    files = read_leases(lock_dir)
    check = LeaseCheck([], [], [], files.unreadable, share=share)
    for lease in files.leases:
        leased = {uuid.lower() for uuid in lease.uuids}
        overlap = [gpu for gpu in gpus if gpu.uuid.lower() in leased]
        if lease.unit in (unit, around) or not overlap:
            continue  # the unit's own, from an earlier start, is replaced
        state = unit_state(lease.unit)
        if state is not None and state not in RUNNING_STATES:
            check.stale.append((lease, state))
        elif share and lease.share:
            check.shared.append((lease, overlap))
        else:
            check.conflicts.append((lease, overlap))
    return check


def leases_by_gpu(leases: Sequence[Lease]) -> dict[str, list[str]]:
    """UUID (lower case) to the units leasing it, for `status`."""
    by_uuid: dict[str, list[str]] = {}
    for lease in leases:
        for uuid in lease.uuids:
            by_uuid.setdefault(uuid.lower(), []).append(lease.unit)
    return by_uuid


class FailedPre(NamedTuple):
    unit: str
    invocation_id: str | None
    reason: str  # one line: the GPU, the MiB, the PIDs
    exit_code: int
    busy_uuids: tuple[str, ...]  # GPUs pre waited on in vain


def failure_path(lock_dir: Path, unit: str) -> Path:
    return lock_dir / FAILED_FOLDER / f"{unit}.json"


def record_failed_pre(lock_dir: Path, failed: FailedPre) -> None:
    """Best effort: without it post waits again."""
    with contextlib.suppress(OSError):
        write_atomically(failure_path(lock_dir, failed.unit), _json(failed))


def clear_failed_pre(lock_dir: Path, unit: str) -> None:
    with contextlib.suppress(OSError):
        failure_path(lock_dir, unit).unlink()


def failed_pre_from(data: dict[str, object]) -> FailedPre:
    return FailedPre(
        unit=str(text(data, "unit", 256)),
        invocation_id=text(data, "invocation_id", 128, optional=True),
        reason=str(text(data, "reason", 4096)),
        exit_code=integer(data, "exit_code", 0, 255),
        busy_uuids=texts(data, "busy_uuids", 128),
    )


def failed_pre_of_this_start(
    lock_dir: Path, unit: str, environ: Mapping[str, str], unreadable: Callable[[Path, str], None]
) -> FailedPre | None:
    """pre's failure record of the start this post ends: the same INVOCATION_ID, and
    SERVICE_RESULT not success. unreadable(path, why): told of a record that is not sane."""
    path = failure_path(lock_dir, unit)
    try:
        failed = failed_pre_from(read_record(path))
    except FileNotFoundError:
        return None
    except BadRecord as exc:
        unreadable(path, str(exc))
        return None
    ours = failed.unit == unit and failed.invocation_id == (environ.get("INVOCATION_ID") or None)
    # SERVICE_RESULT=success: not this start's failure, the start began after pre succeeded
    return failed if ours and environ.get("SERVICE_RESULT") != "success" else None


# What `gpugate sweep` remembers between sweeps (LOCK_DIR/sweep.json): each holder it has seen
# unowned, pinned by (pid, start time), and since when; the oldest MAX_ENTRIES. A record it
# refuses makes every unowned holder count as first seen again, which says more, never less.

STATE_NAME = "sweep.json"
LOCK_NAME = "sweep.lock"
STATE_VERSION = 2  # 1: since in Unix time, before unowned time was counted in boot time
MAX_ENTRIES = 512  # each about 90 bytes: the record stays under MAX_RECORD_BYTES
MAX_TICKS = 2**63 - 1


class Seen(NamedTuple):
    since: float  # when it was first seen unowned: seconds after boot (boot_time)
    gpus: tuple[int, ...]
    drained: bool = False  # the node was drained for it ([sweep] drain_after_s): not again


class SweepState(NamedTuple):
    unowned: dict[ProcessId, Seen]
    refused: str | None = None  # why the file on disk was not taken (report/'s phrase)


def boot_time() -> float:
    """Seconds since boot, suspend included (CLOCK_BOOTTIME): no wall-clock step moves it."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def read_state(folder_fd: int) -> SweepState:
    """The state, or refused: the record, or an entry of it, is not what gpugate writes."""
    found: dict[ProcessId, Seen] = {}
    try:
        data = read_record(STATE_NAME, dir_fd=folder_fd)
        if data.get("version") == 1:
            raise BadRecord("version 1, counted in Unix time, not in time since boot")
        integer(data, "version", STATE_VERSION, STATE_VERSION)
        for entry in _items(data, "unowned", MAX_ENTRIES):
            if not isinstance(entry, dict):
                raise BadRecord(f"a JSON {type(entry).__name__}, not an object")
            ident = ProcessId(
                integer(entry, "pid", 1, MAX_PID), integer(entry, "start_time", 0, MAX_TICKS)
            )
            found[ident] = Seen(
                number(entry, "since", 0, MAX_SINCE),
                integers(entry, "gpus", 0, MAX_GPU_INDEX),
                flag({"drained": False, **entry}, "drained"),
            )
    except FileNotFoundError:
        return SweepState({})
    except BadRecord as exc:
        return SweepState({}, str(exc))
    return SweepState(found)


def read_unowned(lock_dir: Path) -> dict[ProcessId, Seen]:
    """The last sweep's unowned holders, for `status` (no lock, nothing made), or {}."""
    try:
        with folder(lock_dir, make=False) as folder_fd:
            return read_state(folder_fd).unowned
    except OSError:
        return {}


@contextlib.contextmanager
def locked_state(lock_dir: Path) -> Iterator[tuple[int, SweepState]]:
    """lock_dir's descriptor and the sweep's state, under its flock (OSError, TimeoutError)."""
    with folder(lock_dir) as folder_fd, flocked(folder_fd, LOCK_NAME, lock_dir):
        yield folder_fd, read_state(folder_fd)


def write_state(folder_fd: int, unowned: Mapping[ProcessId, Seen]) -> None:
    """The oldest MAX_ENTRIES, compact JSON."""
    kept = sorted(unowned.items(), key=lambda item: (item[1].since, item[0].pid))[:MAX_ENTRIES]
    entries = [
        {"pid": ident.pid, "start_time": ident.start_time, **seen._asdict()} for ident, seen in kept
    ]
    data = {"version": STATE_VERSION, "unowned": entries}
    text = json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"
    write_in(folder_fd, STATE_NAME, text.encode(), 0o600)
