"""The simulated GPU host itself: isolation, systemd behaviour gpugate relies on, cleanup."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sandbox import (
    NVML_CONFIG_PATH,
    NVML_LIB_PATH,
    REPO,
    STATE_ROOT,
    SimHost,
    SimHostBootError,
    SimHostCommandError,
    cgroup2_root,
    cleanup_stale,
)

pytestmark = pytest.mark.simhost

HERE = Path(__file__).resolve().parent


def _unified_line(proc_cgroup: str) -> str:
    """The cgroup2 line ("0::/...") of a /proc/PID/cgroup (hybrid hosts list v1 ones too)."""
    return next(line for line in proc_cgroup.splitlines() if line.startswith("0::"))


def _cgroup_of(host: SimHost, pid: int | str) -> str:
    return _unified_line(host.read_file(f"/proc/{pid}/cgroup"))


# --------------------------------------------------------------------------- boot and PID 1


def test_boots_running(simhost: SimHost) -> None:
    assert simhost.systemctl("is-system-running").stdout.strip() == "running"
    assert simhost.systemctl("--failed", "--no-legend").stdout.strip() == ""
    assert simhost.run("hostname").stdout.strip() == simhost.name


def test_pid1_is_systemd(simhost: SimHost) -> None:
    assert simhost.read_file("/proc/1/comm").strip() == "systemd"
    assert simhost.run("readlink /proc/1/exe").stdout.strip().endswith("/systemd")
    assert _cgroup_of(simhost, 1) == "0::/init.scope"
    # Seen from outside, it is a process of our own machine in a child PID namespace.
    assert simhost.pid1 is not None
    status = Path(f"/proc/{simhost.pid1}/status").read_text()
    nspid = next(line for line in status.splitlines() if line.startswith("NSpid:"))
    assert nspid.split()[-1] == "1"
    assert len(nspid.split()) == 3  # "NSpid: OUTER 1": one level below us
    # journald, logind and dbus run (simhost.md).
    for unit in ("systemd-journald.service", "systemd-logind.service", "dbus.service"):
        assert simhost.systemctl("is-active", unit).stdout.strip() == "active"


def test_run_errors_carry_output(simhost: SimHost) -> None:
    with pytest.raises(SimHostCommandError) as info:
        simhost.run("echo to-stdout; echo to-stderr >&2; exit 3")
    assert info.value.returncode == 3
    assert "to-stdout" in str(info.value)
    assert "to-stderr" in str(info.value)
    assert simhost.run("exit 4", check=False).returncode == 4
    assert simhost.run(["cat"], input="piped").stdout == "piped"
    assert simhost.run("echo $FOO", env={"FOO": "bar"}).stdout.strip() == "bar"


# --------------------------------------------------------------------------- devices


def test_gpu_device_files_inside_only(simhost: SimHost) -> None:
    names = [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
    listing = simhost.run(["stat", "-c", "%n %F %a", *[f"/dev/{n}" for n in names]]).stdout
    assert len(listing.splitlines()) == len(names)
    for name, line in zip(names, listing.splitlines()):
        assert line == f"/dev/{name} regular empty file 666"
    assert not simhost.exists("/dev/nvidia8")
    for name in names:
        outside = Path("/dev") / name
        # On a machine without GPUs they must not leak out; on a real GPU host the host's are
        # character devices, never these plain files.
        assert not outside.exists() or outside.is_char_device()
    for dev in ("null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm"):
        assert simhost.exists(f"/dev/{dev}")
    assert simhost.run("head -c 4 /dev/zero | od -An -tx1").stdout.split() == ["00"] * 4


def test_nvml_lib_and_config_placed(simhost: SimHost, fake_nvml_lib: Path | None) -> None:
    if fake_nvml_lib is None:
        pytest.skip("tests/fake_nvml/build.py not there yet")
    assert simhost.exists(NVML_LIB_PATH)
    assert "libnvidia-ml.so.1" in simhost.run("ldconfig -p").stdout
    assert not Path(NVML_LIB_PATH).exists()
    assert not Path(NVML_CONFIG_PATH).exists() or simhost.exists(NVML_CONFIG_PATH)


# --------------------------------------------------------------------------- isolation


@pytest.mark.parametrize("directory", ["/tmp", "/etc", "/var", "/var/tmp", "/run", "/root"])
def test_writes_inside_stay_inside(simhost: SimHost, directory: str) -> None:
    path = f"{directory}/gpugate-simhost-{uuid.uuid4().hex}"
    simhost.write_file(path, "inside\n", mode=0o600)
    assert simhost.read_file(path) == "inside\n"
    assert simhost.run(["stat", "-c", "%a", path]).stdout.strip() == "600"
    assert not Path(path).exists()


def test_host_tmp_untouched(simhost: SimHost, host_tmp_marker: Path) -> None:
    # The marker was written before boot, and systemd-tmpfiles-setup ran during boot.
    assert simhost.systemctl("is-active", "systemd-tmpfiles-setup.service").stdout.strip() == (
        "active"
    )
    assert host_tmp_marker.read_text() == "the host's /tmp must survive the sandbox\n"
    assert not simhost.exists(str(host_tmp_marker))
    for directory in ("/tmp", "/run"):
        fstype = simhost.run(["findmnt", "-n", "-o", "FSTYPE", directory]).stdout.strip()
        assert fstype == "tmpfs", directory
    assert simhost.run(["findmnt", "-n", "-o", "FSTYPE", "/"]).stdout.strip() == "overlay"
    # Host-global sysctls are out of reach.
    options = simhost.run(["findmnt", "-n", "-o", "OPTIONS", "/proc/sys"]).stdout
    assert options.startswith("ro,")
    assert simhost.run(["findmnt", "-n", "-o", "OPTIONS", "/sys"]).stdout.startswith("ro,")


def test_network_only_loopback(simhost: SimHost) -> None:
    assert simhost.run("ls /sys/class/net").stdout.split() == ["lo"]
    flags = int(simhost.read_file("/sys/class/net/lo/flags").strip(), 16)
    assert flags & 0x1, "lo is not up"
    simhost.run(["python3", "-c", "import socket; socket.create_server(('127.0.0.1', 0))"])


# --------------------------------------------------------------------------- cgroups and units


def test_scope_lands_in_user_slice(simhost: SimHost) -> None:
    unit = simhost.spawn_scope("exec sleep 300")
    try:
        cgroup = simhost.systemctl("show", "-P", "ControlGroup", unit).stdout.strip()
        assert cgroup == f"/user.slice/{unit}"
        pids = simhost.read_file(f"/sys/fs/cgroup{cgroup}/cgroup.procs").split()
        assert len(pids) == 1
        assert simhost.read_file(f"/proc/{pids[0]}/comm").strip() == "sleep"
        assert _cgroup_of(simhost, int(pids[0])) == f"0::/user.slice/{unit}"
    finally:
        simhost.systemctl("stop", unit)
    assert simhost.systemctl("is-active", unit, check=False).stdout.strip() == "inactive"
    # By contrast, a bare nsenter keeps the caller's (outside) cgroup.
    assert "user.slice" not in _cgroup_of(simhost, "self")


def test_exec_stop_post_in_unit_cgroup(simhost: SimHost) -> None:
    unit = f"simhost-stoppost-{uuid.uuid4().hex[:8]}.service"
    out = f"/run/{unit}.out"
    simhost.install_unit(
        unit,
        textwrap.dedent(
            f"""\
            [Service]
            ExecStart=/bin/sleep infinity
            ExecStopPost=/bin/sh -c 'grep ^0:: /proc/self/cgroup >{out}; \\
                echo "$SERVICE_RESULT $EXIT_CODE $EXIT_STATUS" >>{out}'
            """
        ),
    )
    simhost.systemctl("start", unit)
    simhost.systemctl("stop", unit)
    lines = simhost.read_file(out).splitlines()
    assert lines == [f"0::/system.slice/{unit}", "success killed TERM"]
    assert "Deactivated successfully" in simhost.journal("-u", unit)


# --------------------------------------------------------------------------- lifecycle


def test_second_sandbox_and_poweroff_removes_cgroups(
    simhost: SimHost, simhost_factory: Callable[..., SimHost]
) -> None:
    host = simhost_factory(
        gpus=2,
        nvml_config="gpu_count = 2\n",
        files={
            "/etc/simhost-extra.conf": "extra\n",
            "/usr/local/bin/hello": "#!/bin/sh\necho hi\n",
            "/tmp/early": "staged\n",
        },
    )
    assert host.name != simhost.name
    assert host.read_file(NVML_CONFIG_PATH) == "gpu_count = 2\n"
    assert host.read_file("/etc/simhost-extra.conf") == "extra\n"
    assert host.run("hello").stdout == "hi\n"
    # Like a real boot, systemd-tmpfiles-setup emptied /tmp (the private one: see
    # test_host_tmp_untouched for the host's).
    assert not host.exists("/tmp/early")
    # Staging keeps the modes of existing directories.
    modes = host.run(["stat", "-c", "%a", "/", "/etc", "/tmp", "/usr/local/bin"]).stdout.split()
    assert modes == ["755", "755", "1777", "755"]
    assert host.exists("/dev/nvidia1") and not host.exists("/dev/nvidia2")
    assert (host.cgroup / "init.scope").is_dir()
    assert (host.cgroup / "system.slice").is_dir()
    assert host.pid1 is not None
    pid1 = host.pid1
    host.poweroff()
    assert host.poweroff_seconds is not None
    assert not host.cgroup.exists()
    assert not Path(f"/proc/{pid1}").exists() or Path(f"/proc/{pid1}/comm").read_text() != (
        "systemd\n"
    )
    assert not host.state_dir.exists()
    host.poweroff()  # idempotent
    # The session sandbox is untouched.
    assert simhost.systemctl("is-system-running").stdout.strip() == "running"


def test_sandbox_dies_with_its_launcher(simhost: SimHost) -> None:
    """A test process killed with SIGKILL takes its sandbox along (parent-death signals)."""
    code = textwrap.dedent(
        f"""\
        import json, sys, time
        sys.path.insert(0, {str(HERE)!r})
        from sandbox import SimHost
        host = SimHost.boot(gpus=1)
        print(json.dumps({{"name": host.name, "pid1": host.pid1}}), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    root = cgroup2_root()
    assert root is not None
    deadline = time.monotonic() + 10
    while Path(f"/proc/{info['pid1']}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{info['pid1']}").exists()
    deadline = time.monotonic() + 10
    while info["name"] not in cleanup_stale(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (root / info["name"]).exists()
    assert not (STATE_ROOT / info["name"]).exists()


# --------------------------------------------------------------------------- install_gpugate

PROBE_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "gpugate-simhost-probe"
version = "0.0.1"
requires-python = ">=3.11"
dependencies = ["nvidia-ml-py>=12.535", "psutil>=5.9", "pydantic>=2.5,<3", "systemd-python>=234"]

[project.scripts]
gpugate = "gpugate_simhost_probe:main"

[tool.setuptools.packages.find]
where = ["src"]
"""

PROBE_INIT = """\
def main() -> int:
    import psutil, pydantic, pynvml, systemd.journal

    pynvml.nvmlInit()
    print("probe", pydantic.VERSION, pynvml.nvmlDeviceGetCount())
    return 0
"""


def _write_if_changed(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


@pytest.fixture(scope="module")
def probe_host(fake_nvml_lib: Path | None) -> Iterator[SimHost]:
    """A sandbox with a throwaway package that has gpugate's dependencies, installed the
    gpugate way (kept under REPO/.simhost so its wheelhouse is cached between runs)."""
    probe = REPO / ".simhost" / "probe-pkg"
    _write_if_changed(probe / "pyproject.toml", PROBE_PYPROJECT)
    _write_if_changed(probe / "src" / "gpugate_simhost_probe" / "__init__.py", PROBE_INIT)
    with SimHost.boot(nvml_lib=fake_nvml_lib, nvml_config="gpu_count = 4\n", gpus=4) as host:
        host.install_gpugate(probe)
        yield host


def test_install_gpugate_probe_deps_import(probe_host: SimHost) -> None:
    probe_host.run(
        ["/opt/gpugate/bin/python", "-c", "import pynvml, psutil, pydantic, systemd.journal"]
    )
    assert probe_host.run("readlink /usr/bin/gpugate").stdout.strip() == "/opt/gpugate/bin/gpugate"
    assert probe_host.run("head -1 /opt/gpugate/bin/gpugate").stdout.startswith("#!/opt/gpugate/")


def test_install_gpugate_probe_sees_fake_gpus(
    probe_host: SimHost, fake_nvml_lib: Path | None
) -> None:
    if fake_nvml_lib is None:
        pytest.skip("tests/fake_nvml/build.py not there yet")
    words = probe_host.run("gpugate").stdout.split()
    assert words[0] == "probe" and words[-1] == "4"


def test_install_gpugate_again_reinstalls(probe_host: SimHost) -> None:
    site = "/opt/gpugate/lib/python3.11/site-packages/gpugate_simhost_probe/__init__.py"
    probe_host.run(["sh", "-c", 'echo "# stale" >>"$1"', "sh", site])
    probe_host.install_gpugate(REPO / ".simhost" / "probe-pkg")
    assert "# stale" not in probe_host.read_file(site)


def test_install_gpugate_from_repo(simhost: SimHost) -> None:
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("no pyproject.toml in the repository yet")
    simhost.install_gpugate(REPO)
    simhost.run(["/opt/gpugate/bin/python", "-c", "import gpugate, pynvml, psutil, pydantic"])


# --------------------------------------------------------------------------- failures clean up


def _sandbox_cgroups() -> set[str]:
    root = cgroup2_root()
    assert root is not None
    return {p.name for p in root.iterdir() if p.name.startswith("gpugate-sim-")}


def test_failed_boot_cleans_up(simhost: SimHost) -> None:
    before = _sandbox_cgroups()
    with pytest.raises(SimHostBootError, match="must be absolute") as first:
        SimHost.boot(files={"relative/path": "x"})
    assert _sandbox_cgroups() == before
    # A unit that fails at boot: degraded is an error (naming the unit) unless allowed.
    failing = {
        "/etc/systemd/system/simhost-fails.service": (
            "[Service]\nType=oneshot\nExecStart=/bin/false\n"
        ),
        "/etc/systemd/system/multi-user.target.d/simhost-fails.conf": (
            "[Unit]\nWants=simhost-fails.service\n"
        ),
    }
    with pytest.raises(SimHostBootError, match=r"simhost-fails\.service") as second:
        SimHost.boot(files=failing, gpus=1)
    assert _sandbox_cgroups() == before
    # Logs are kept for a post-mortem.
    assert second.value.state_dir is not None
    assert "exec /lib/systemd/systemd" in (second.value.state_dir / "boot.log").read_text()
    for info in (first, second):
        assert info.value.state_dir is not None
        shutil.rmtree(info.value.state_dir, ignore_errors=True)
    with SimHost.boot(files=failing, gpus=1, allow_degraded=True) as host:
        assert host.systemctl("is-system-running", check=False).stdout.strip() == "degraded"
    assert _sandbox_cgroups() == before


def test_poweroff_kills_pid1_when_shutdown_hangs(simhost_factory: Callable[..., SimHost]) -> None:
    host = simhost_factory(gpus=1)
    host.install_unit(
        "simhost-hangs.service",
        "[Service]\nExecStart=/bin/sleep infinity\nExecStop=/bin/sleep infinity\n"
        "TimeoutStopSec=infinity\n",
    )
    host.systemctl("start", "simhost-hangs.service")
    host.poweroff(timeout=2)  # a unit that never stops does not hold the power-off
    assert not host.cgroup.exists()
