"""The Debian package, end to end: built from this checkout by packaging/build-deb, installed
with `apt-get install ./gpugate_*.deb` on a fresh simulated GPU host (no network there: every
Depends must already be satisfied), put on a unit with `gpugate install`, and then the
incident's first scenario: a server started by hand from a login session holds every GPU,
and `systemctl start vllm.service` must replace it. Then uninstall and purge leave nothing.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from incident import ALL, MIB_PER_GPU, SIGNAL_SENT_ID, Host, server_cmd, stage_incident
from sandbox import SimHost
from test_sweep import timer_cycle

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

INSIDE = "/var/cache/gpugate-deb"


@pytest.fixture(scope="module")
def deb(built_deb: Path) -> Path:
    return built_deb


def control(deb: Path) -> dict[str, str]:
    text = subprocess.run(
        ["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line[0].isspace() and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def test_deb_contents(deb: Path) -> None:
    listing = subprocess.run(
        ["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    paths = {line.split()[-1].removeprefix(".") for line in listing.splitlines()}
    for path in (
        "/usr/bin/gpugate",
        "/usr/lib/gpugate/common/gpugate/front/cli.py",
        "/usr/lib/gpugate/common/pydantic/__init__.py",
        # `gpugate nri`: the protobuf modules setup.py generates at build, and protobuf itself
        "/usr/lib/gpugate/common/gpugate/host/nri_api/api_pb2.py",
        "/usr/lib/gpugate/common/gpugate/host/nri_api/ttrpc_pb2.py",
        "/usr/lib/gpugate/common/google/protobuf/__init__.py",
        "/usr/lib/systemd/catalog/gpugate.catalog",
        "/usr/share/man/man1/gpugate.1.gz",
        "/usr/share/bash-completion/completions/gpugate",
        "/usr/share/gpugate/units/gpugate.conf",
        "/usr/share/gpugate/units/vllm.service",
        "/usr/share/gpugate/units/vllm@.service",
        "/usr/share/doc/gpugate/copyright",
    ):
        assert path in paths, path
    for minor in range(9, 14):
        abi = f"cp3{minor}"
        for package in ("pydantic_core", "systemd"):
            assert any(
                p.startswith(f"/usr/lib/gpugate/{abi}/{package}/")
                and p.endswith(f".cpython-3{minor}-x86_64-linux-gnu.so")
                for p in paths
            ), (abi, package)
        # Bytecode is shipped for every Python, never written at run time.
        assert f"/usr/lib/gpugate/common/gpugate/__pycache__/__init__.cpython-3{minor}.pyc" in paths
    assert not any(p.endswith(".so") and "cpython-3" in p for p in paths if "/common/" in p)
    fields = control(deb)
    assert fields["Architecture"] == "amd64"
    depends = fields["Depends"]
    # One package for Debian 11-13 and Ubuntu 22.04/24.04: python3 3.9 to 3.13, and no library
    # newer than Debian 11's (glibc 2.31, systemd 247).
    assert "python3 (>= 3.9)" in depends and "python3 (<< 3.14)" in depends
    versions = dict(re.findall(r"(libc6|libsystemd0) \(>= ([0-9.]+)\)", depends))
    assert set(versions) == {"libc6", "libsystemd0"}, depends
    assert [int(n) for n in versions["libc6"].split(".")] <= [2, 31], depends
    assert int(versions["libsystemd0"]) <= 247, depends
    assert "libstdc++6" in depends, depends  # protobuf's C module links it (gpugate nri)
    assert "pydantic" not in depends, "python3-pydantic is v1 before Debian 13: pydantic is carried"


@pytest.fixture
def packaged(
    deb: Path, simhost_factory: Callable[..., SimHost], fake_nvml_lib: Path | None
) -> Iterator[Host]:
    """A fresh simulated host (not the session's, which has gpugate from source) with the
    .deb installed, the workload and the driver's bystanders of tests/simhost/incident.py."""
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    sim = simhost_factory(nvml_lib=fake_nvml_lib, gpus=8)
    assert not sim.exists("/usr/bin/gpugate"), "the fresh host must not have gpugate yet"
    sim.write_file(f"{INSIDE}/{deb.name}", deb.read_bytes())
    # No package lists, no network: apt can only take Depends from what is installed.
    installed = sim.run(
        f"rm -rf /var/lib/apt/lists/* && cd {INSIDE} && "
        "apt-get install -y --no-install-recommends ./gpugate_*.deb",
        env={"DEBIAN_FRONTEND": "noninteractive"},
        timeout=300,
    )
    assert "Setting up gpugate" in installed.stdout, installed.stdout + installed.stderr
    yield stage_incident(sim)


def test_packaged_gpugate_replaces_hand_started_server(packaged: Host) -> None:
    host, sim = packaged, packaged.sim
    assert sim.run(["dpkg-query", "-S", "/usr/bin/gpugate"]).stdout.startswith("gpugate: ")
    assert sim.run(["gpugate", "--version"]).stdout.strip() == "gpugate 0.1.0"
    assert (
        "pydantic 2."
        in sim.run(
            [
                "/usr/bin/python3",
                "-I",
                "-c",
                "import sys; sys.path.insert(0, '/usr/lib/gpugate/common'); "
                "sys.path.insert(0, '/usr/lib/gpugate/cp%d%d' % sys.version_info[:2]); import pydantic; "
                "print('pydantic', pydantic.VERSION)",
            ]
        ).stdout
    )
    # journalctl -x explains gpugate's events: dpkg's trigger compiled the catalog.
    assert SIGNAL_SENT_ID in sim.run(["journalctl", "--list-catalog"]).stdout

    old, shell = host.hand_start(ALL, 8000, "hand-vllm")
    assert all(used == MIB_PER_GPU for used in host.used().values())
    # The operator's unit knows nothing of gpugate; `gpugate install` adds it.
    sim.install_unit(
        "vllm.service",
        "[Unit]\nDescription=vLLM-like server\n[Service]\nType=simple\n"
        f"ExecStart={server_cmd(ALL, 8000, '/run/ready-vllm.service.json')}\n",
    )
    sim.run(["gpugate", "install", "vllm.service"])
    assert sim.exists("/etc/systemd/system/vllm.service.d/gpugate.conf")
    assert sim.exists("/etc/gpugate/vllm.service.toml")
    shown = sim.systemctl("show", "-p", "ExecStartPre", "-p", "NotifyAccess", "vllm.service").stdout
    assert "path=/usr/bin/gpugate" in shown and "NotifyAccess=exec" in shown, shown
    again = sim.run(["gpugate", "install", "vllm.service"]).stdout
    assert again.count("unchanged") == 2, again

    cursor = host.cursor()
    assert host.start("vllm.service", check=False) == 0
    new = host.wait_ready("/run/ready-vllm.service.json")
    assert sim.systemctl("is-active", "vllm.service", check=False).stdout.strip() == "active"
    for pid in [old["api_server"], old["engine_core"], *old["workers"]]:
        assert not host.alive(pid), f"old server process {pid} survived"
    assert host.alive(shell), "the login session's shell was killed"
    assert "/system.slice/vllm.service" in host.sh(f"cat /proc/{new['api_server']}/cgroup")
    status = host.status()
    assert all(gpu["used_mib"] == MIB_PER_GPU for gpu in status["gpus"]), status["gpus"]
    assert {h["unit"] for h in status["holders"] if h["used_mib"]} == {"vllm.service"}
    for bystander in ("nvidia-persistenced.service", "python-bystander.scope"):
        assert sim.systemctl("is-active", bystander, check=False).stdout.strip() == "active"
    # Filtered here, not by journalctl: journalctl 252 given --after-cursor and a match skips
    # the first matching entry.
    entries = host.journal_json(f"--after-cursor={cursor}")
    kills = [e for e in entries if e.get("MESSAGE_ID") == SIGNAL_SENT_ID]
    assert {int(e["GPUGATE_PID"]) for e in kills} >= set(old["workers"])
    explained = host.sh(
        shlex.join(["journalctl", "-x", "--no-pager", f"GPUGATE_PID={old['workers'][0]}"])
    )
    assert "pinned through a pidfd" in explained, explained

    sim.systemctl("stop", "vllm.service")
    assert all(used == 0 for used in host.used().values())
    removed = sim.run(["gpugate", "uninstall", "vllm.service"]).stdout
    assert "removed /etc/systemd/system/vllm.service.d/gpugate.conf" in removed
    assert not sim.exists("/etc/systemd/system/vllm.service.d")
    assert not sim.exists("/etc/gpugate")
    shown = sim.systemctl("show", "-p", "ExecStartPre", "vllm.service").stdout
    assert "gpugate" not in shown, shown


def test_shipped_units_verify_and_template_dropins_do_not_double(packaged: Host) -> None:
    sim = packaged.sim
    sim.write_file("/opt/vllm/bin/vllm", "#!/bin/sh\nexec sleep infinity\n", mode=0o755)
    for unit in ("vllm.service", "vllm@.service"):
        sim.run(["cp", f"/usr/share/gpugate/units/{unit}", f"/etc/systemd/system/{unit}"])
    sim.run(["gpugate", "install", "vllm.service", "--gpus", "0,1,2,3,4,5,6,7"])
    sim.run(["gpugate", "install", "vllm@.service"])
    sim.run(["gpugate", "install", "vllm@a.service", "--gpus", "0,1,2,3"])
    # The shipped files, unchanged, with the real /usr/bin/gpugate.
    for unit in ("vllm.service", "vllm@a.service"):
        verified = sim.run(["systemd-analyze", "verify", "--man=no", unit], check=False)
        assert verified.returncode == 0 and not verified.stderr, verified.stderr
    # The instance's drop-in has the template's file name: it replaces it, never adds to it.
    shown = sim.systemctl("show", "-p", "ExecStartPre", "-p", "DropInPaths", "vllm@a.service")
    assert shown.stdout.count("path=/usr/bin/gpugate") == 1, shown.stdout
    assert "/etc/systemd/system/vllm@a.service.d/gpugate.conf" in shown.stdout
    assert "vllm@.service.d/gpugate.conf" not in shown.stdout
    for unit in ("vllm@a.service", "vllm@.service", "vllm.service"):
        sim.run(["gpugate", "uninstall", unit])
    assert not sim.exists("/etc/gpugate")
    sim.run(["rm", "/etc/systemd/system/vllm.service", "/etc/systemd/system/vllm@.service"])
    for unit in ("vllm.service", "vllm@.service", "vllm@a.service"):
        assert not sim.exists(f"/etc/systemd/system/{unit}.d"), unit

    purged = sim.run(
        ["apt-get", "purge", "-y", "gpugate"], env={"DEBIAN_FRONTEND": "noninteractive"}
    )
    assert "Removing gpugate" in purged.stdout, purged.stdout + purged.stderr
    for path in ("/usr/bin/gpugate", "/usr/lib/gpugate", "/usr/share/gpugate"):
        assert not sim.exists(path), f"{path} left behind by the purge"


def test_the_package_carries_the_sweep_timer_disabled(packaged: Host) -> None:
    timer_cycle(packaged, packaged=True)
