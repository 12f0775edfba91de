"""Root file systems of other Debian releases for the simulated host, built with debootstrap.

``debian_root("bullseye")`` returns ``REPO/.simhost/roots/bullseye``: a ``--variant=minbase``
root with systemd, dbus, python3 and libsystemd0 (what gpugate's .deb depends on: there is no
network inside the simulated host, so apt can only take dependencies from what is installed).
Built once, then cached: a root is complete when its stamp file exists; a half-built one (a
run killed midway) is removed and built again. Builds are serialised between processes by a
lock file next to the roots.

The mirror is the one apt on this machine already uses (its deb822 or one-line sources),
never a host name written here: CI builds from the same Debian archive as everything else.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Final

from sandbox import REPO

log = logging.getLogger("simhost")

ROOTS: Final = REPO / ".simhost" / "roots"
STAMP: Final = ".gpugate-root-complete"
APT_SOURCES: Final = Path("/etc/apt")
# What the incident needs inside besides minbase: systemd as PID 1 with logind and dbus
# (systemd-run --scope, loginctl), python3 (gpugate and the workload), libsystemd0 (gpugate's
# compiled journal module), ps/kill/fuser/ip, and the terminal the hand-started server is typed in.
INCLUDE: Final = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "libpam-systemd",
    "python3",
    "libsystemd0",
    "procps",
    "psmisc",
    "util-linux",
    "iproute2",
)
# The suites the tests boot, with what each carries (checked after the build).
SUITES: Final = {"bullseye": ("247", "3.9"), "trixie": ("257", "3.13")}


class RootBuildError(RuntimeError):
    """debootstrap could not build a root (its log tail is in the message)."""


def apt_mirror(apt_dir: Path = APT_SOURCES) -> str | None:
    """The first Debian archive URI apt uses here (not the security archive), or None."""
    sources_d = apt_dir / "sources.list.d"
    candidates = _deb822_uris(sources_d) + _one_line_uris(apt_dir, sources_d)
    for uri in candidates:
        if uri.startswith(("http://", "https://", "file:/")):
            return uri
    return None


def _deb822_uris(sources_d: Path) -> list[str]:
    """URIs of enabled `deb` stanzas with `main` for a suite other than -security."""
    uris: list[str] = []
    for path in sorted(sources_d.glob("*.sources")) if sources_d.is_dir() else []:
        for stanza in path.read_text().split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.strip()
            suites = fields.get("suites", "").split()
            if fields.get("enabled", "yes") == "no" or "deb" not in fields.get("types", ""):
                continue
            if "main" in fields.get("components", "").split() and any(
                not s.endswith("-security") for s in suites
            ):
                uris.extend(fields.get("uris", "").split())
    return uris


def _one_line_uris(apt_dir: Path, sources_d: Path) -> list[str]:
    """URIs of one-line `deb URI SUITE COMPONENT...` entries for a suite other than -security."""
    uris: list[str] = []
    lists = [apt_dir / "sources.list"]
    if sources_d.is_dir():
        lists += sorted(sources_d.glob("*.list"))
    for path in lists:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = [w for w in line.split() if not w.startswith("[")]
            if len(words) >= 4 and words[0] == "deb" and not words[2].endswith("-security"):
                uris.append(words[1])
    return uris


def missing_tools() -> str | None:
    if shutil.which("debootstrap") is None:
        return "debootstrap not found (scripts/setup installs it)"
    if apt_mirror() is None:
        return "no Debian archive in apt's sources here to debootstrap from"
    return None


def debian_root(suite: str, roots: Path = ROOTS, extra: tuple[str, ...] = ()) -> Path:
    """The cached root of SUITE, built with debootstrap first if absent (about a minute).
    extra: more of the release's own packages in it (a root of its own, `SUITE+PKG+...`), for
    a test of that release's daemons (its containerd)."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    name = "+".join((suite, *sorted(extra)))
    target = roots / name
    roots.mkdir(parents=True, exist_ok=True)
    with (roots / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / STAMP).is_file():
            return target
        reason = missing_tools()
        if reason is not None:
            raise RootBuildError(reason)
        mirror = apt_mirror()
        assert mirror is not None
        if target.exists():
            shutil.rmtree(target)
        started = time.monotonic()
        logfile = roots / f"{name}.log"
        with logfile.open("w") as out:
            result = subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join((*INCLUDE, *extra))}",
                    suite,
                    str(target),
                    mirror,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                check=False,
                timeout=1800,
            )
        if result.returncode != 0:
            tail = logfile.read_text(errors="replace")[-3000:]
            raise RootBuildError(
                f"debootstrap {suite} {mirror} failed ({result.returncode}):\n{tail}"
            )
        # The root's apt lists are the archive's of today: dropped, as on the packaging test's
        # host (no network inside; apt takes dependencies from what is installed).
        shutil.rmtree(target / "var/lib/apt/lists", ignore_errors=True)
        (target / "var/lib/apt/lists/partial").mkdir(parents=True)
        shutil.rmtree(target / "var/cache/apt/archives", ignore_errors=True)
        (target / "var/cache/apt/archives/partial").mkdir(parents=True)
        seconds = time.monotonic() - started
        (target / STAMP).write_text(f"{suite} from {mirror} in {seconds:.0f}s\n")
        log.info("debootstrap %s: %.0fs", suite, seconds)
        return target
