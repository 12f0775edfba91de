"""The programs gpugate runs (systemctl, docker, podman, scontrol): found in a fixed list of
system folders, never through the caller's PATH, and run with a clean environment under a
deadline.

gpugate runs as root with the environment of the unit it guards (`ExecStartPre=+`), and Slurm
gives its hooks the job's. A PATH, LD_PRELOAD, LD_LIBRARY_PATH or PYTHONPATH set there must not
choose what root runs, so neither the search nor the child sees any of it.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from gpugate.errors import ProgramNotAnswering, ProgramNotFound
from gpugate.host.safe_files import first_root_executable

# Root-owned folders where Debian, Ubuntu, RHEL, Slurm's and Docker's packages put their
# programs, searched in this order. Nothing a unit sets adds to them.
SYSTEM_DIRS: tuple[str, ...] = (
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/opt/slurm/bin",
    "/snap/bin",
)
SYSTEM_PATH = ":".join(SYSTEM_DIRS[:6])


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str

    def first_line(self) -> str:
        """What the program said first (stderr, else stdout): for a one-line error."""
        said = (self.stderr or self.stdout).strip().splitlines()
        return said[0] if said else ""


def find_program(name: str, dirs: Sequence[str] | None = None) -> str | None:
    """NAME's absolute path in the first of the system folders that has it as an executable
    file; as root, only one owned by root that no other account may rewrite. None if none."""
    folders = SYSTEM_DIRS if dirs is None else dirs
    return first_root_executable(os.path.join(folder, name) for folder in folders)


def clean_environment() -> dict[str, str]:
    """All a child gets: the system folders as PATH, the C locale (its output is parsed), and
    the home of the account gpugate runs as (docker's and podman's configuration)."""
    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        home = "/"
    return {"PATH": SYSTEM_PATH, "LC_ALL": "C", "HOME": home}


def run_program(argv: Sequence[str], timeout_s: float) -> Result:
    """Run argv (argv[0] an absolute path, from find_program) with the clean environment, no
    stdin, and its output captured. ProgramNotAnswering where it outlives timeout_s (it is
    killed); ProgramNotFound where it cannot be started. A non-zero exit is the caller's to
    judge."""
    if not os.path.isabs(argv[0]):
        raise ValueError(f"{argv[0]!r}: not an absolute path (find_program)")
    name = os.path.basename(argv[0])
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
            env=clean_environment(),
        )
    except subprocess.TimeoutExpired:
        raise ProgramNotAnswering(
            f"{name} {' '.join(argv[1:2])} did not answer within {timeout_s:g} s (killed)"
        ) from None
    except OSError as exc:
        raise ProgramNotFound(f"{argv[0]}: cannot run it: {exc.strerror or str(exc)}") from None
    return Result(done.returncode, done.stdout, done.stderr)
