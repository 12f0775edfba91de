"""Real Debian packages inside a simulated host (see /work/shared/real-components.md).

Packages are fetched on the machine with `apt-get install --download-only
--no-install-recommends` into REPO/.simhost/debs/GROUP (one download per machine, reused by
later sessions), never installed on the machine itself: every simulated host overlays its `/`,
and the packages' postinst would enable units there. Inside the host they are copied in
through the host's own mount namespace and installed with `dpkg --force-confold -i`; the
machine's policy-rc.d keeps their services stopped until a test starts them.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from sandbox import REPO, SimHost

DEB_CACHE = REPO / ".simhost" / "debs"
APT_TIMEOUT_S = 600


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _apt(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=APT_TIMEOUT_S, check=False
    )


def fetch_debs(group: str, packages: Sequence[str]) -> list[Path]:
    """The .debs that installing PACKAGES on a host like this machine needs; skips the test
    (with apt's own words) where the registry cannot be reached."""
    folder = DEB_CACHE / group
    done = folder / ".complete"
    with _locked(DEB_CACHE / f".{group}.lock"):
        if not done.exists() or done.read_text() != " ".join(packages):
            shutil.rmtree(folder, ignore_errors=True)
            (folder / "partial").mkdir(parents=True)
            argv = [
                "apt-get",
                "install",
                "--download-only",
                "--no-install-recommends",
                "--yes",
                "-o",
                f"Dir::Cache::archives={folder}/",
                *packages,
            ]
            result = _apt(argv)
            if result.returncode != 0:  # a fresh machine may have no package lists yet
                _apt(["apt-get", "update"])
                result = _apt(argv)
            if result.returncode != 0:
                said = (result.stderr or result.stdout).strip().splitlines()
                pytest.skip(f"apt-get could not fetch {' '.join(packages)}: {said[-1:]}")
            done.write_text(" ".join(packages))
    debs = sorted(folder.glob("*.deb"))
    if not debs:
        pytest.skip(f"{' '.join(packages)}: apt-get fetched nothing (all installed here?)")
    return debs


def install_debs(sim: SimHost, group: str, packages: Sequence[str]) -> float:
    """Install the group's packages inside the host; returns the seconds it took."""
    started = time.monotonic()
    debs = fetch_debs(group, packages)
    inside = f"/var/cache/realparts/{group}"
    for deb in debs:
        sim.write_file(f"{inside}/{deb.name}", deb.read_bytes())
    sim.run(
        f"DEBIAN_FRONTEND=noninteractive dpkg --force-confold -i {inside}/*.deb",
        timeout=APT_TIMEOUT_S,
    )
    return time.monotonic() - started


def wait_for(what: str, probe: object, timeout: float = 60, every: float = 0.2) -> object:
    """probe() until it returns something true; AssertionError naming WHAT otherwise."""
    assert callable(probe)
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not after {timeout:g} s (last: {last!r})")


def hold_gpus_cmd(gpus: Sequence[int], mib: int, state_dir: str = "/run/fake-nvml") -> str:
    """A shell command that holds /dev/nvidiaN open and claims MIB on each with the stand-in
    NVML (claims/PID: "MIB STARTTIME N,..."), then sleeps: the shape of a CUDA process."""
    assert len(gpus) <= 7, "dash redirects file descriptors 3 to 9 only"
    opens = " ".join(f"{3 + i}</dev/nvidia{gpu}" for i, gpu in enumerate(gpus))
    listed = ",".join(map(str, gpus))
    return (
        f"exec {opens}; mkdir -p {state_dir}/claims; "
        "st=$(sed 's/.*) //' /proc/$$/stat | cut -d' ' -f20); "
        f'echo "{mib} $st {listed}" > {state_dir}/claims/$$.tmp && '
        f"mv {state_dir}/claims/$$.tmp {state_dir}/claims/$$; exec sleep 3600"
    )


GPU_GRES_CONF = "Name=gpu File=/dev/nvidia[0-7]\n"


def gpu_device_nodes(sim: SimHost, count: int = 8) -> None:
    """/dev/nvidia0..COUNT-1 as device nodes, as on a Slurm GPU node. slurmd rejects plain
    files as gres ("not a valid character or block device") and then sets no SLURM_JOB_GPUS;
    gpugate resolves slurmd's numbers through gres.conf to a node's device number. Each
    stand-in needs its own number, and one no job needs otherwise: ConstrainDevices denies a
    job the numbers of the GPUs it was not given (with all at 1:3, /dev/null itself). The loop
    block devices 7:0-7:7 open like any file and are not otherwise used by a job; the stand-in
    NVML finds holders by path (/dev/nvidiaN), so it still matches them."""
    sim.run(
        f"for i in $(seq 0 {count - 1}); do rm -f /dev/nvidia$i; "
        "mknod -m 666 /dev/nvidia$i b 7 $i; done"
    )


def gpu_plain_files(sim: SimHost, count: int = 8) -> None:
    """The simulated host's own stand-ins back (boot.sh: empty files, mode 0666)."""
    sim.run(
        f"for i in $(seq 0 {count - 1}); do rm -f /dev/nvidia$i; : > /dev/nvidia$i; "
        "chmod 0666 /dev/nvidia$i; done"
    )


def slurm_gres_conf(sim: SimHost, text: str = GPU_GRES_CONF) -> None:
    """gres.conf beside slurm.conf (/etc/slurm, SLURM_CONF unset), root's, as slurmd reads it."""
    sim.write_file("/etc/slurm/gres.conf", text)
