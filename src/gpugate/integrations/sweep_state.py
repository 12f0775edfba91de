"""What `gpugate sweep` remembers between sweeps: each holder it has seen unowned, pinned by
(pid, start time), and since when. LOCK_DIR/sweep.json, written as the other state is (by the
folder's descriptor, replaced whole, no link followed) and read back as a record (capped,
sane values, or refused: then every unowned holder counts as first seen again, which says
more, never less). At most MAX_ENTRIES holders are remembered: the oldest first."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpugate.host.locks import flock_by
from gpugate.host.procfs import ProcessId
from gpugate.host.safe_files import folder, open_in, write_in
from gpugate.integrations import records
from gpugate.integrations.records import MAX_GPU_INDEX, MAX_PID, MAX_SINCE, BadRecord

STATE_NAME = "sweep.json"
LOCK_NAME = "sweep.lock"
STATE_VERSION = 1
MAX_ENTRIES = 512  # each about 90 bytes: the record stays under records.MAX_RECORD_BYTES
LOCK_TIMEOUT_S = 10.0
MAX_TICKS = 2**63 - 1


@dataclass(frozen=True)
class Seen:
    since: float  # Unix time it was first seen unowned
    gpus: tuple[int, ...]
    drained: bool = False  # the node was drained for it ([sweep] drain_after_s): not again


@dataclass
class SweepState:
    unowned: dict[ProcessId, Seen] = field(default_factory=dict)
    refused: str | None = None  # why the file on disk was not taken (report/'s phrase)


def parse_state(text: str) -> dict[ProcessId, Seen]:
    """BadRecord where the record, or any entry of it, is not what gpugate writes."""
    data = records.parse_record(text)
    records.integer(data, "version", STATE_VERSION, STATE_VERSION)
    entries = data.get("unowned")
    if not isinstance(entries, list):
        raise BadRecord("unowned is not a list")
    if len(entries) > MAX_ENTRIES:
        raise BadRecord(f"unowned has more than {MAX_ENTRIES} items")
    found: dict[ProcessId, Seen] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise BadRecord(f"a JSON {type(entry).__name__}, not an object")
        ident = ProcessId(
            records.integer(entry, "pid", 1, MAX_PID),
            records.integer(entry, "start_time", 0, MAX_TICKS),
        )
        found[ident] = Seen(
            records.number(entry, "since", 0, MAX_SINCE),
            records.integers(entry, "gpus", 0, MAX_GPU_INDEX),
            records.flag({"drained": False, **entry}, "drained"),
        )
    return found


def dump_state(unowned: Mapping[ProcessId, Seen]) -> str:
    kept = sorted(unowned.items(), key=lambda item: (item[1].since, item[0].pid))[:MAX_ENTRIES]
    entries = [
        {
            "pid": ident.pid,
            "start_time": ident.start_time,
            "since": seen.since,
            "gpus": list(seen.gpus),
            "drained": seen.drained,
        }
        for ident, seen in kept
    ]
    data = {"version": STATE_VERSION, "unowned": entries}
    return json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"


def read_state(folder_fd: int) -> SweepState:
    try:
        return SweepState(parse_state(records.read_text(STATE_NAME, dir_fd=folder_fd)))
    except FileNotFoundError:
        return SweepState()
    except BadRecord as exc:
        return SweepState(refused=exc.why)


def read_unowned(lock_dir: Path) -> dict[ProcessId, Seen]:
    """The last sweep's unowned holders, for `status` (no lock, nothing made); {} where none
    is kept or it is not the sweep's."""
    try:
        with folder(lock_dir, make=False) as folder_fd:
            return read_state(folder_fd).unowned
    except OSError:
        return {}


@contextlib.contextmanager
def locked_state(lock_dir: Path) -> Iterator[tuple[int, SweepState]]:
    """lock_dir's descriptor and the state, under the sweep's flock (two sweeps take turns);
    write_state within it. OSError (TimeoutError where another sweep holds it)."""
    with folder(lock_dir) as folder_fd:
        fd = open_in(folder_fd, LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            if not flock_by(fd, time.monotonic() + LOCK_TIMEOUT_S):
                raise TimeoutError(errno.EBUSY, os.strerror(errno.EBUSY), str(lock_dir))
            yield folder_fd, read_state(folder_fd)
        finally:
            os.close(fd)


def write_state(folder_fd: int, unowned: Mapping[ProcessId, Seen]) -> None:
    write_in(folder_fd, STATE_NAME, dump_state(unowned).encode(), 0o600)
