"""What a failed `pre` leaves for the `post` of the same start.

systemd runs ExecStopPost= after a failed ExecStartPre= too, with the same INVOCATION_ID.
`pre` records why it failed (the GPUs, the MiB, the PIDs) in LOCK_DIR/failed/UNIT.json; that
start's `post` then kills what is in the cgroup but does not wait again on the memory `pre`
already waited for, and repeats pre's reason last, where `systemctl status` shows it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpugate.host.safe_files import write_atomically
from gpugate.integrations import records
from gpugate.integrations.records import BadRecord

FOLDER = "failed"


@dataclass(frozen=True)
class FailedPre:
    unit: str
    invocation_id: str | None
    reason: str  # one line: the GPU, the MiB, the PIDs
    exit_code: int
    busy_uuids: tuple[str, ...]  # GPUs pre waited on in vain

    def as_json(self) -> dict[str, object]:
        return {
            "unit": self.unit,
            "invocation_id": self.invocation_id,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "busy_uuids": list(self.busy_uuids),
        }


def failure_path(lock_dir: Path, unit: str) -> Path:
    return lock_dir / FOLDER / f"{unit}.json"


def record_failed_pre(lock_dir: Path, failed: FailedPre) -> None:
    """Best effort: without it post waits again, as it did before."""
    with contextlib.suppress(OSError):
        text = json.dumps(failed.as_json(), sort_keys=True) + "\n"
        write_atomically(failure_path(lock_dir, failed.unit), text)


def clear_failed_pre(lock_dir: Path, unit: str) -> None:
    with contextlib.suppress(OSError):
        failure_path(lock_dir, unit).unlink()


def failed_pre_from(data: dict[str, object]) -> FailedPre:
    """A failed-start record's fields, checked (records.BadRecord where one is not sane)."""
    return FailedPre(
        unit=str(records.text(data, "unit", 256)),
        invocation_id=records.text(data, "invocation_id", 128, optional=True),
        reason=str(records.text(data, "reason", 4096)),
        exit_code=records.integer(data, "exit_code", 0, 255),
        busy_uuids=records.texts(data, "busy_uuids", 128),
    )


def failed_pre_of_this_start(
    lock_dir: Path,
    unit: str,
    environ: Mapping[str, str],
    unreadable: Callable[[Path, str], None] = lambda path, why: None,
) -> FailedPre | None:
    """pre's failure record, where it belongs to the start this post ends: the same
    INVOCATION_ID, and systemd saying the start did not succeed (SERVICE_RESULT).
    unreadable(path, why): told of a record that is not sane, which is then ignored."""
    path = failure_path(lock_dir, unit)
    try:
        failed = failed_pre_from(records.read_record(path))
    except FileNotFoundError:
        return None
    except BadRecord as exc:
        unreadable(path, exc.why)
        return None
    if failed.unit != unit or failed.invocation_id != (environ.get("INVOCATION_ID") or None):
        return None
    if environ.get("SERVICE_RESULT", "") == "success":
        return None  # not this start's: it began after pre succeeded
    return failed
