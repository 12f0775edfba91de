"""The simulated GPU host: a real systemd booted as PID 1 of private namespaces.

``SimHost.boot()`` follows tests/simhost/README.md: a cgroup under the unified hierarchy
(``/sys/fs/cgroup/unified/NAME``) holds the launcher; ``tests/simhost/boot.sh`` unshares PID,
mount, cgroup, network, UTS and IPC namespaces, builds an overlay root (lower: the host's ``/``,
upper: a private tmpfs) with a private ``/dev`` (``nvidia0..N``, ``nvidiactl``, ``nvidia-uvm*``),
``/proc`` (``/proc/sys`` read-only), read-only ``/sys``, a cgroup2 mount, tmpfs ``/run`` and
``/tmp``, masks the units that reach outside or are slow, pivots into it and execs
``/lib/systemd/systemd``.  Everything else runs inside with ``nsenter -t PID1 -a``.

The host's ``/tmp``, ``/etc``, ``/var`` and ``/run`` are never visible to the sandbox's systemd
(tmpfs and overlay), its sysctls are out of reach (read-only ``/proc/sys``), and the whole
sandbox dies with the launching Python process (parent-death signals on the launcher chain).

systemd's own console (``/dev/console`` inside) is a pty whose output is saved to
``STATE_DIR/console.log``; ``boot.sh``'s output goes to ``STATE_DIR/boot.log``.  STATE_DIR is
``REPO/.simhost/run/NAME`` and is removed by a clean ``poweroff()``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import io
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final

from typing_extensions import Self

from gpugate.compat import tomllib

__all__ = [
    "DEFAULT_MASKS",
    "SimHost",
    "SimHostBootError",
    "SimHostCommandError",
    "SimHostError",
    "build_wheelhouse",
    "cgroup2_root",
    "cleanup_stale",
    "preflight",
]

log = logging.getLogger("simhost")

HERE: Final = Path(__file__).resolve().parent
REPO: Final = HERE.parents[1]
BOOT_SH: Final = HERE / "boot.sh"
STATE_ROOT: Final = REPO / ".simhost" / "run"
NAME_PREFIX: Final = "gpugate-sim-"
NVML_LIB_PATH: Final = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
NVML_CONFIG_PATH: Final = "/etc/fake-nvml.conf"
SYSTEMD: Final = "/lib/systemd/systemd"
INSIDE_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_ENV: Final[Mapping[str, str]] = {
    "PATH": INSIDE_PATH,
    "HOME": "/root",
    "USER": "root",
    "LOGNAME": "root",
    "SHELL": "/bin/sh",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PAGER": "cat",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
    "SYSTEMD_LESS": "",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}

# Units masked (symlinked to /dev/null in R/etc/systemd/system) before systemd starts.
DEFAULT_MASKS: Final[tuple[str, ...]] = (
    # Named in simhost.md: they reach outside the sandbox or take long.
    "systemd-timesyncd.service",
    "getty@.service",
    "serial-getty@.service",
    "console-getty.service",
    "cron.service",
    "ssh.service",
    "systemd-networkd.service",
    "postgresql.service",
    "postgresql@.service",
    # Network and logins: nothing to do in a loopback-only namespace.
    "systemd-networkd.socket",
    "systemd-networkd-wait-online.service",
    "systemd-resolved.service",
    "networking.service",
    "container-getty@.service",
    "autovt@.service",
    # Would touch host-global kernel state (modules, sysctls, binfmt, entropy, pstore,
    # debugfs/tracefs/configfs/fusectl) if their conditions let them run.
    "systemd-modules-load.service",
    "modprobe@.service",
    "kmod-static-nodes.service",
    "systemd-sysctl.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    "systemd-random-seed.service",
    "systemd-pstore.service",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-kernel-config.mount",
    "sys-fs-fuse-connections.mount",
    "systemd-udevd.service",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    "systemd-hwdb-update.service",
    # Periodic housekeeping: apt reaches the network, the rest is slow and pointless here.
    "apt-daily.timer",
    "apt-daily.service",
    "apt-daily-upgrade.timer",
    "apt-daily-upgrade.service",
    "man-db.timer",
    "man-db.service",
    "dpkg-db-backup.timer",
    "dpkg-db-backup.service",
    "e2scrub_all.timer",
    "e2scrub_all.service",
    "e2scrub_reap.service",
    "fstrim.timer",
    "fstrim.service",
    "packagekit.service",
)

_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")
_UNIT_RE: Final = re.compile(r"[A-Za-z0-9:_.\\@-]+")
_STALE_RE: Final = re.compile(re.escape(NAME_PREFIX) + r"(\d+)-\d+")


class SimHostError(RuntimeError):
    """The sandbox could not be driven as asked."""


class SimHostBootError(SimHostError):
    """The sandbox did not boot (the message carries the launcher's and systemd's logs).

    ``state_dir`` (boot.log, console.log) is kept for a post-mortem; the next boot by another
    process removes it (cleanup_stale), or remove it yourself.
    """

    state_dir: Path | None = None


class SimHostCommandError(subprocess.CalledProcessError):
    """A command inside the sandbox exited non-zero; str() shows its stdout and stderr."""

    def __str__(self) -> str:
        def text(value: object) -> str:
            if isinstance(value, bytes):
                return value.decode("utf-8", "replace")
            return "" if value is None else str(value)

        return (
            f"{super().__str__()}\n--- stdout ---\n{text(self.stdout).rstrip()}"
            f"\n--- stderr ---\n{text(self.stderr).rstrip()}"
        )


# --------------------------------------------------------------------------- host checks


def cgroup2_root() -> Path | None:
    """The host's cgroup2 mount: /sys/fs/cgroup/unified (hybrid) or /sys/fs/cgroup (unified)."""
    mounts: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3:
                mounts[fields[1]] = fields[2]
    for candidate in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if mounts.get(candidate) == "cgroup2":
            return Path(candidate)
    return None


def preflight() -> str | None:
    """Why a sandbox cannot boot on this machine, or None when it can."""
    if os.geteuid() != 0:
        return f"simhost needs root (unshare, mounts, cgroups); running as uid {os.geteuid()}"
    if not sys.platform.startswith("linux"):
        return f"simhost needs Linux, this is {sys.platform}"
    if cgroup2_root() is None:
        return "no cgroup2 mount at /sys/fs/cgroup/unified or /sys/fs/cgroup"
    for tool in ("unshare", "nsenter", "setpriv", "pivot_root", "ldconfig", "tar"):
        if shutil.which(tool) is None:
            return f"{tool} not found on PATH (util-linux / libc-bin / tar)"
    if not os.access(SYSTEMD, os.X_OK):
        return f"{SYSTEMD} is missing (apt-get install systemd)"
    if not BOOT_SH.is_file():
        return f"{BOOT_SH} is missing"
    return None


def _own_nspid_depth() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) - 1
    return 1


def _is_sandbox_init(pid: int, depth: int) -> bool:
    """pid is PID 1 of a PID namespace one level below ours."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            fields = line.split()[1:]
            return len(fields) == depth + 1 and fields[-1] == "1"
    return False


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cgroup_pids(cgroup: Path) -> list[int]:
    pids: list[int] = []
    for dirpath, _dirs, _files in os.walk(cgroup):
        with contextlib.suppress(OSError):
            pids.extend(int(p) for p in (Path(dirpath) / "cgroup.procs").read_text().split())
    return pids


def _remove_cgroup_tree(cgroup: Path, timeout: float) -> None:
    """rmdir cgroup and everything below it, deepest first; retries while it drains."""
    deadline = time.monotonic() + timeout
    while True:
        if not cgroup.exists():
            return
        for dirpath, _dirs, _files in os.walk(cgroup, topdown=False):
            with contextlib.suppress(FileNotFoundError, OSError):
                Path(dirpath).rmdir()
        if not cgroup.exists():
            return
        if time.monotonic() > deadline:
            left = {str(p): _comm(p) for p in _cgroup_pids(cgroup)}
            raise SimHostError(f"could not remove cgroup {cgroup}; processes left: {left}")
        time.sleep(0.05)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(root: Path | None = None) -> list[str]:
    """Remove empty gpugate-sim-<PID>-<N> cgroups left by launchers (PID) that no longer exist.

    Such leftovers come from a test process killed with SIGKILL: the parent-death signals take
    the sandbox down with it, but nobody is left to rmdir its cgroups.  A cgroup that still holds
    a process, or whose owner PID is alive, is never touched.
    """
    root = root or cgroup2_root()
    removed: list[str] = []
    if root is None:
        return removed
    for entry in sorted(root.iterdir()):
        match = _STALE_RE.fullmatch(entry.name)
        if not match or not entry.is_dir() or _pid_alive(int(match.group(1))):
            continue
        if _cgroup_pids(entry):
            continue
        try:
            _remove_cgroup_tree(entry, timeout=1.0)
        except SimHostError:
            continue
        removed.append(entry.name)
    # State dirs (logs kept after a failed boot) of dead launchers whose cgroup is gone.
    if STATE_ROOT.is_dir():
        for entry in sorted(STATE_ROOT.iterdir()):
            match = _STALE_RE.fullmatch(entry.name)
            if match and not _pid_alive(int(match.group(1))) and not (root / entry.name).exists():
                shutil.rmtree(entry, ignore_errors=True)
    return removed


# --------------------------------------------------------------------------- wheelhouse


def _project_name(repo: Path) -> str:
    data = tomllib.loads((repo / "pyproject.toml").read_text())
    name = data.get("project", {}).get("name")
    if not isinstance(name, str):
        raise SimHostError(f"{repo}/pyproject.toml has no [project] name")
    return name


def _newest_source_mtime(repo: Path) -> float:
    newest = (repo / "pyproject.toml").stat().st_mtime
    src = repo / "src"
    if src.is_dir():
        for path in src.rglob("*"):
            # folders too: a module deleted changes its folder's mtime, nothing else's
            if "__pycache__" in path.parts or path.name.endswith(".egg-info"):
                continue
            newest = max(newest, path.stat().st_mtime)
    return newest


def build_wheelhouse(repo: Path, wheelhouse: Path | None = None) -> Path:
    """Wheels of REPO and all its dependencies, built outside the sandbox (it has no network).

    ``python -m pip wheel --wheel-dir WHEELHOUSE REPO`` into ``REPO/.simhost/wheelhouse``; skipped
    when the wheelhouse's stamp is newer than every file under REPO/src and REPO/pyproject.toml.
    Serialised between processes with a lock file next to the wheelhouse.
    """
    repo = repo.resolve()
    wheelhouse = (wheelhouse or repo / ".simhost" / "wheelhouse").resolve()
    wheelhouse.parent.mkdir(parents=True, exist_ok=True)
    stamp = wheelhouse / ".built"
    with (wheelhouse.parent / "wheelhouse.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.stat().st_mtime > _newest_source_mtime(repo):
            return wheelhouse
        wheelhouse.mkdir(parents=True, exist_ok=True)
        stamp.unlink(missing_ok=True)
        # Drop the project's own old wheels (dependencies stay cached): a stale wheel with a
        # higher version would win inside.
        normalized = re.sub(r"[-_.]+", "_", _project_name(repo)).lower()
        for old in wheelhouse.glob("*.whl"):
            if old.name.lower().startswith(normalized + "-"):
                old.unlink()
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="gpugate-wheel-") as scratch:
            # From a clean copy, as packaging/stage builds: setuptools reuses the checkout's
            # build/lib and keeps in the wheel every module deleted since it was filled.
            source = Path(scratch)
            for top in repo.iterdir():  # pyproject.toml, the readme it names, a licence
                if top.is_file():
                    shutil.copy2(top, source / top.name)
            shutil.copytree(
                repo / "src",
                source / "src",
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
            )
            result = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--wheel-dir", str(wheelhouse), str(source)],
                capture_output=True,
                text=True,
                check=False,
            )
        if result.returncode != 0:
            raise SimHostError(
                f"pip wheel {repo} failed ({result.returncode}):\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        stamp.write_text(f"{repo}\n")
        log.info("built wheelhouse %s in %.1fs", wheelhouse, time.monotonic() - started)
        return wheelhouse


# --------------------------------------------------------------------------- the sandbox


class _Console:
    """A pty whose slave is the sandbox's /dev/console; a thread copies its output to a file."""

    def __init__(self, path: Path) -> None:
        self.master, self.slave = os.openpty()
        self.slave_path = os.ttyname(self.slave)
        self.path = path
        self._thread = threading.Thread(target=self._drain, name=f"console {path}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        with self.path.open("ab", buffering=0) as out:
            while True:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: every slave fd is closed
                    return
                if not data:
                    return
                out.write(data.replace(b"\r\n", b"\n"))

    def close(self) -> None:
        # Our slave fd keeps reads from failing between systemd's opens of /dev/console;
        # closing it (after the sandbox is gone) makes the drain thread's read() fail.
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1
        self._thread.join(timeout=2)
        if self.master >= 0 and not self._thread.is_alive():
            os.close(self.master)
            self.master = -1


_LIVE: set[SimHost] = set()
_LIVE_LOCK = threading.Lock()
_COUNTER = 0


def _poweroff_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for host in live:
        with contextlib.suppress(Exception):
            host.poweroff(timeout=15)


atexit.register(_poweroff_all)


def _next_name(root: Path) -> str:
    global _COUNTER  # noqa: PLW0603
    with _LIVE_LOCK:
        while True:
            name = f"{NAME_PREFIX}{os.getpid()}-{_COUNTER}"
            _COUNTER += 1
            if not (root / name).exists():
                return name


def _tail(path: Path, limit: int = 6000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return f"({path} unreadable)"
    text = data[-limit:].decode("utf-8", "replace")
    return text if len(data) <= limit else "...\n" + text


class SimHost:
    """A booted sandbox.  Use ``SimHost.boot()``; always ``poweroff()`` (or ``with``)."""

    def __init__(self, name: str, cgroup: Path, state_dir: Path, gpus: int) -> None:
        self.name = name
        self.cgroup = cgroup
        self.state_dir = state_dir
        self.gpus = gpus
        self.lower = Path("/")  # the overlay's lower layer: the root the host boots over
        self.pid1: int | None = None
        self.boot_seconds: float | None = None
        self.poweroff_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._console: _Console | None = None
        self._spawned: list[subprocess.Popen[bytes]] = []
        self._scope_counter = 0
        self._closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "off" if self._closed else f"pid1={self.pid1}"
        return f"<SimHost {self.name} {state}>"

    # ------------------------------------------------------------------ boot

    @classmethod
    def boot(
        cls,
        name: str | None = None,
        nvml_lib: Path | None = None,
        nvml_config: str | None = None,
        files: Mapping[str, str | bytes] | None = None,
        gpus: int = 8,
        timeout: float = 60,
        *,
        extra_masks: Iterable[str] = (),
        allow_degraded: bool = False,
        root: Path | None = None,
    ) -> SimHost:
        """Boot a sandbox and wait until systemd says ``running``.

        files: path inside -> content, written into the root before systemd starts (mode 0644,
        0755 when the content starts with ``#!``); systemd-tmpfiles empties /tmp at boot, as on
        a real host, so files staged there are gone.  extra_masks: more units to mask.
        allow_degraded: accept ``degraded`` (failed units are logged) instead of failing.
        root: the overlay's lower layer, a whole root file system (one of tests/simhost/roots.py,
        another Debian release); default this machine's ``/``.
        On any failure the half-booted sandbox is powered off and its cgroups removed before
        SimHostBootError is raised.

        The sandbox is tied to the calling *thread* (parent-death signal on the launcher): boot
        it from a thread that outlives it, e.g. the main thread, not a short-lived worker.
        """
        reason = preflight()
        if reason is not None:
            raise SimHostError(reason)
        lower = Path("/") if root is None else Path(root).resolve()
        # /lib is a relative link to usr/lib in a merged-/usr root: checked in both places.
        if not any((lower / d / "lib/systemd/systemd").is_file() for d in (".", "usr")):
            raise SimHostError(f"{lower} has no {SYSTEMD}: not a root with systemd")
        cgroups = cgroup2_root()
        assert cgroups is not None
        cleanup_stale(cgroups)
        name = name or _next_name(cgroups)
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"sandbox name {name!r}: use 1-63 letters, digits and '-'")
        if gpus < 0:
            raise ValueError("gpus must be >= 0")
        masks = (*DEFAULT_MASKS, *extra_masks)
        for unit in masks:
            if not _UNIT_RE.fullmatch(unit):
                raise ValueError(f"bad unit name {unit!r}")

        cgroup = cgroups / name
        state_dir = STATE_ROOT / name
        cgroup.mkdir()  # FileExistsError: that name is in use
        host = cls(name, cgroup, state_dir, gpus)
        host.lower = lower
        with _LIVE_LOCK:
            _LIVE.add(host)
        started = time.monotonic()
        try:
            host._stage(nvml_lib, nvml_config, files or {}, masks)
            host._launch()
            host._wait_booted(started + timeout, allow_degraded)
        except BaseException as err:
            logs = host._logs()
            with contextlib.suppress(Exception):
                host.poweroff(timeout=15, keep_state=True)
            if isinstance(err, SimHostBootError):
                err.state_dir = state_dir
                raise
            if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit
                raise
            boot_error = SimHostBootError(f"{name}: boot failed: {err}\n{logs}")
            boot_error.state_dir = state_dir
            raise boot_error from err
        host.boot_seconds = time.monotonic() - started
        log.info("%s booted in %.2fs (pid1 %s)", name, host.boot_seconds, host.pid1)
        return host

    def _stage(
        self,
        nvml_lib: Path | None,
        nvml_config: str | None,
        files: Mapping[str, str | bytes],
        masks: Sequence[str],
    ) -> None:
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        stage_root = self.state_dir / "root"
        (self.state_dir / "scratch").mkdir(parents=True)
        stage_root.mkdir(mode=0o755)
        stage_root.chmod(0o755)

        def put(inside: str, content: str | bytes, mode: int = 0o644) -> Path:
            rel = Path(inside)
            if not rel.is_absolute() or ".." in rel.parts:
                raise ValueError(f"file path inside the sandbox must be absolute: {inside!r}")
            target = stage_root / rel.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode() if isinstance(content, str) else content
            target.unlink(missing_ok=True)  # may be a mask (a symlink to /dev/null)
            target.write_bytes(data)
            target.chmod(mode)
            return target

        for unit in masks:
            link = stage_root / "etc/systemd/system" / unit
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/dev/null")
        put("/etc/hostname", self.name + "\n")
        put("/etc/machine-id", uuid.uuid4().hex + "\n", 0o444)
        if nvml_lib is not None:
            put(NVML_LIB_PATH, Path(nvml_lib).read_bytes(), 0o755)
        if nvml_config is not None:
            put(NVML_CONFIG_PATH, nvml_config)
        for inside, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            put(inside, data, 0o755 if data.startswith(b"#!") else 0o644)

    def _launch(self) -> None:
        self._console = _Console(self.state_dir / "console.log")
        with (self.state_dir / "boot.log").open("ab") as boot_log:
            self._proc = subprocess.Popen(
                [
                    "/bin/sh",
                    str(BOOT_SH),
                    "outer",
                    self.name,
                    str(self.cgroup),
                    str(self.state_dir),
                    str(self.gpus),
                    self._console.slave_path,
                    str(self.lower),
                ],
                stdin=subprocess.DEVNULL,
                stdout=boot_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(BASE_ENV),
            )

    def _find_pid1(self) -> int | None:
        """The sandbox's PID 1, looked up in the sandbox's cgroup tree (never anywhere else)."""
        depth = _own_nspid_depth()
        for pid in _cgroup_pids(self.cgroup):
            if _is_sandbox_init(pid, depth):
                return pid
        return None

    def _wait_booted(self, deadline: float, allow_degraded: bool) -> None:
        assert self._proc is not None
        while True:
            if self._proc.poll() is not None:
                raise SimHostBootError(
                    f"{self.name}: the launcher exited ({self._proc.returncode}) before systemd "
                    f"started\n{self._logs()}"
                )
            pid = self._find_pid1()
            if pid is not None and _comm(pid) == "systemd":
                self.pid1 = pid
                break
            if time.monotonic() > deadline:
                raise SimHostBootError(f"{self.name}: systemd did not start\n{self._logs()}")
            time.sleep(0.02)

        state = ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SimHostBootError(
                    f"{self.name}: not running after the boot timeout (last state {state!r})\n"
                    f"{self._diagnostics()}\n{self._logs()}"
                )
            try:
                result = self.run(
                    ["systemctl", "is-system-running", "--wait"],
                    check=False,
                    timeout=remaining,
                )
            except subprocess.TimeoutExpired:
                continue
            state = result.stdout.strip()
            if state == "running":
                return
            if state == "degraded":
                failed = self._diagnostics()
                if allow_degraded:
                    log.warning("%s booted degraded:\n%s", self.name, failed)
                    return
                raise SimHostBootError(
                    f"{self.name}: booted degraded (mask these units or fix them):\n{failed}"
                    f"\n{self._logs()}"
                )
            if state in ("maintenance", "stopping"):
                raise SimHostBootError(
                    f"{self.name}: system state {state!r}\n{self._diagnostics()}\n{self._logs()}"
                )
            if self._proc.poll() is not None:
                raise SimHostBootError(f"{self.name}: systemd exited\n{self._logs()}")
            time.sleep(0.05)  # "starting"/"initializing", or the bus is not up yet

    def _diagnostics(self) -> str:
        parts = []
        for argv in (
            ["systemctl", "--failed", "--no-legend", "--plain"],
            ["systemctl", "list-jobs", "--no-legend"],
            ["journalctl", "--no-pager", "-b", "-p", "warning", "-n", "60"],
        ):
            try:
                result = self.run(argv, check=False, timeout=10)
                parts.append(f"$ {' '.join(argv)}\n{result.stdout}{result.stderr}")
            except (subprocess.SubprocessError, OSError, SimHostError) as err:
                parts.append(f"$ {' '.join(argv)}\n({err})")
        return "\n".join(parts)

    def _logs(self) -> str:
        return (
            f"--- {self.state_dir / 'boot.log'} ---\n{_tail(self.state_dir / 'boot.log')}\n"
            f"--- {self.state_dir / 'console.log'} ---\n{_tail(self.state_dir / 'console.log')}"
        )

    # ------------------------------------------------------------------ running things inside

    def _nsenter(self, argv: Sequence[str]) -> list[str]:
        if self._closed or self.pid1 is None:
            raise SimHostError(f"{self.name} is not running")
        return ["nsenter", "-t", str(self.pid1), "-a", "--", *argv]

    def _exec(
        self,
        argv: Sequence[str],
        *,
        input: bytes | None,
        timeout: float,
        env: Mapping[str, str] | None,
        check: bool,
    ) -> subprocess.CompletedProcess[bytes]:
        full = self._nsenter(argv)
        environment = {**BASE_ENV, **(env or {})}
        with subprocess.Popen(
            full,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=environment,
        ) as proc:
            try:
                stdout, stderr = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired as err:
                # nsenter forked the command into the sandbox's PID namespace: kill it too.
                self._kill_children(proc.pid)
                proc.kill()
                stdout, stderr = proc.communicate()
                raise subprocess.TimeoutExpired(
                    list(argv), timeout, output=stdout, stderr=stderr
                ) from err
        result = subprocess.CompletedProcess(list(argv), proc.returncode, stdout, stderr)
        if check and result.returncode != 0:
            raise SimHostCommandError(result.returncode, list(argv), stdout, stderr)
        return result

    @staticmethod
    def _kill_children(pid: int) -> None:
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(child), signal.SIGKILL)

    def run(
        self,
        cmd: str | Sequence[str],
        check: bool = True,
        timeout: float = 120,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run cmd inside (``nsenter -t PID1 -a``); a str runs under ``/bin/sh -c``.

        The environment is a clean root login's (PATH, HOME, LANG=C.UTF-8, no pager, no colors)
        plus env.  The process keeps the caller's (outside) cgroup: use spawn_scope() for a
        process that must live in a unit.  check: raise SimHostCommandError (with stdout and
        stderr) on a non-zero exit.
        """
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        raw = self._exec(
            argv,
            input=None if input is None else input.encode(),
            timeout=timeout,
            env=env,
            check=False,
        )
        result = subprocess.CompletedProcess(
            raw.args,
            raw.returncode,
            raw.stdout.decode("utf-8", "replace"),
            raw.stderr.decode("utf-8", "replace"),
        )
        if check and result.returncode != 0:
            raise SimHostCommandError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def write_file(self, path: str, content: str | bytes, mode: int = 0o644) -> None:
        """Write a file inside (parents created), through the sandbox's own mount namespace."""
        data = content.encode() if isinstance(content, str) else content
        self._exec(
            [
                "/bin/sh",
                "-c",
                'mkdir -p "$(dirname "$1")" && cat >"$1" && chmod "$2" "$1"',
                "sh",
                path,
                f"{mode:o}",
            ],
            input=data,
            timeout=60,
            env=None,
            check=True,
        )

    def read_file(self, path: str) -> str:
        return self.run(["cat", "--", path], timeout=60).stdout

    def exists(self, path: str) -> bool:
        return (
            self.run(
                ["sh", "-c", 'test -e "$1" || test -L "$1"', "sh", path], check=False
            ).returncode
            == 0
        )

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", *args], check=check)

    def journal(self, *args: str) -> str:
        return self.run(["journalctl", "--no-pager", *args]).stdout

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def install_unit(self, name: str, text: str) -> None:
        """Write /etc/systemd/system/NAME inside and reload systemd."""
        if not _UNIT_RE.fullmatch(name) or "/" in name:
            raise ValueError(f"bad unit name {name!r}")
        self.write_file(f"/etc/systemd/system/{name}", text)
        self.daemon_reload()

    def spawn_scope(
        self,
        cmd: str | Sequence[str],
        unit: str | None = None,
        slice: str = "user.slice",
        timeout: float = 30,
    ) -> str:
        """Start cmd in the background the way an ssh login would: in a scope under ``slice``.

        ``systemd-run --scope --slice=SLICE --unit=UNIT`` (processes started with a bare nsenter
        keep their outside cgroup).  Returns the scope's name (``UNIT.scope``) once it is
        active.  Its output goes to STATE_DIR/scopes/UNIT.log.  It dies with the sandbox.
        """
        if unit is None:
            self._scope_counter += 1
            unit = f"hand-started-{self._scope_counter}.scope"
        if not unit.endswith(".scope"):
            unit += ".scope"
        if not _UNIT_RE.fullmatch(unit):
            raise ValueError(f"bad unit name {unit!r}")
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        self._spawned = [p for p in self._spawned if p.poll() is None]  # reap finished ones
        logs = self.state_dir / "scopes"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{unit}.log").open("ab") as out:
            proc = subprocess.Popen(
                self._nsenter(
                    [
                        "systemd-run",
                        "--scope",
                        "--quiet",
                        f"--slice={slice}",
                        f"--unit={unit}",
                        "--",
                        *argv,
                    ]
                ),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(BASE_ENV),
                start_new_session=True,
            )
        self._spawned.append(proc)
        deadline = time.monotonic() + timeout
        while True:
            state = self.systemctl("is-active", unit, check=False).stdout.strip()
            if state == "active":
                return unit
            if proc.poll() is not None and state != "active":
                raise SimHostError(
                    f"{unit}: systemd-run exited ({proc.returncode}) before the scope was "
                    f"active ({state}):\n{_tail(logs / f'{unit}.log')}"
                )
            if time.monotonic() > deadline:
                raise SimHostError(f"{unit} not active after {timeout}s ({state})")
            time.sleep(0.05)

    # ------------------------------------------------------------------ gpugate

    def install_gpugate(
        self,
        repo: Path,
        *,
        python: str | None = None,
        wheelhouse: Path | None = None,
        venv: str = "/opt/gpugate",
    ) -> str:
        """Install the package at repo inside, the way an operator would from source.

        Builds the wheelhouse outside (build_wheelhouse), copies it into the sandbox at
        /var/cache/gpugate-wheelhouse, then inside::

            PYTHON -m venv VENV
            VENV/bin/pip install --no-index --find-links /var/cache/gpugate-wheelhouse NAME
            ln -sf VENV/bin/gpugate /usr/bin/gpugate       (when that script exists)

        python: the interpreter inside; default /usr/bin/python3 when it has the same X.Y as the
        one that built the wheels, else that very interpreter (via the overlay).
        Returns VENV.
        """
        repo = Path(repo).resolve()
        house = build_wheelhouse(repo, wheelhouse)
        inside_house = "/var/cache/gpugate-wheelhouse"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for whl in sorted(house.glob("*.whl")):
                tar.add(whl, arcname=whl.name)
        self._exec(
            [
                "/bin/sh",
                "-c",
                'rm -rf "$1" && mkdir -p "$1" && tar -xf - -C "$1"',
                "sh",
                inside_house,
            ],
            input=buf.getvalue(),
            timeout=120,
            env=None,
            check=True,
        )
        python = python or self._default_python()
        project = _project_name(repo)
        pip = f"{venv}/bin/pip"
        if self.exists(pip):
            # Installed before (same version number, maybe other code): pip would keep it.
            self.run([pip, "uninstall", "--yes", project], check=False, timeout=300)
        else:
            self.run([python, "-m", "venv", venv], timeout=300)
        self.run([pip, "install", "--no-index", "--find-links", inside_house, project], timeout=600)
        self.run(
            [
                "/bin/sh",
                "-c",
                'if [ -x "$1/bin/gpugate" ]; then ln -sf "$1/bin/gpugate" /usr/bin/gpugate; fi',
                "sh",
                venv,
            ]
        )
        return venv

    def _default_python(self) -> str:
        wanted = f"{sys.version_info.major}.{sys.version_info.minor}"
        probe = self.run(
            [
                "/usr/bin/python3",
                "-c",
                "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])",
            ],
            check=False,
        )
        if probe.returncode == 0 and probe.stdout.strip() == wanted:
            return "/usr/bin/python3"
        return str(Path(sys.executable).resolve())

    # ------------------------------------------------------------------ shutdown

    def poweroff(self, timeout: float = 30, *, keep_state: bool = False) -> None:
        """``systemctl poweroff`` inside, wait for PID 1 to exit (SIGKILL it after timeout),
        then remove the sandbox's cgroups deepest first.  Idempotent.

        keep_state: keep STATE_DIR (boot.log, console.log) for a post-mortem.
        """
        with self._lock:
            if self._closed:
                return
            started = time.monotonic()
            try:
                self._stop(timeout)
            finally:
                self._closed = True
                self._reap_spawned()
                try:
                    _remove_cgroup_tree(self.cgroup, timeout=10)
                finally:
                    if self._console is not None:
                        self._console.close()
                    with _LIVE_LOCK:
                        _LIVE.discard(self)
                    if not keep_state:
                        shutil.rmtree(self.state_dir, ignore_errors=True)
                self.poweroff_seconds = time.monotonic() - started
                log.info("%s powered off in %.2fs", self.name, self.poweroff_seconds)

    def _stop(self, timeout: float) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._kill_pid1()
            return
        if self.pid1 is not None and _is_sandbox_init(self.pid1, _own_nspid_depth()):
            with contextlib.suppress(subprocess.SubprocessError, OSError, SimHostError):
                self.run(["systemctl", "poweroff", "--no-block"], check=False, timeout=10)
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            log.warning("%s: poweroff took over %ss, killing its PID 1", self.name, timeout)
        self._kill_pid1()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()  # the launcher (unshare) is our own child
            proc.wait(timeout=10)

    def _kill_pid1(self) -> None:
        """SIGKILL the sandbox's PID 1 (found in its cgroup): the kernel kills the namespace."""
        pid = self._find_pid1()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self._find_pid1() is not None and time.monotonic() < deadline:
            time.sleep(0.02)

    def _reap_spawned(self) -> None:
        for proc in self._spawned:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._spawned.clear()

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.poweroff()
