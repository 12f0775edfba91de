"""Real docker.io 20.10 and podman 4.3 (runc, vfs storage; Debian's packages, inside one
simulated host of this module's own) running containers of a busybox-static root
filesystem that hold stand-in GPUs. The evidence is the runtimes' own: `docker ps -a`,
`podman ps -a`, `docker inspect`."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from incident import REPO
from realparts import install_debs, wait_for
from sandbox import SimHost

from gpugate.errors import ExitCode

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

UNIT = "vllm-docker.service"
ROOTFS = "/opt/rootfs"
DAEMON_JSON = json.dumps(
    {
        "iptables": False,
        "ip-forward": False,  # /proc/sys is read-only in the simulated host
        "ip-masq": False,
        "bridge": "none",
        "storage-driver": "vfs",
        "exec-opts": ["native.cgroupdriver=systemd"],
    }
)
STORAGE_CONF = (
    '[storage]\ndriver = "vfs"\nrunroot = "/run/containers/storage"\n'
    'graphroot = "/var/lib/containers/storage"\n'
)
MIB = 6000


def hold(gpus: list[int]) -> str:
    """The container's first process: holds /dev/nvidiaN open, as CUDA does, and sleeps.
    It is PID 1 of its namespace: without a handler SIGTERM would not reach it."""
    opens = " ".join(f"{3 + i}</dev/nvidia{gpu}" for i, gpu in enumerate(gpus))
    return f"exec {opens}; trap 'exit 143' TERM; sleep 3600 & wait"


def volumes(gpus: list[int]) -> list[str]:
    return [arg for gpu in gpus for arg in ("-v", f"/dev/nvidia{gpu}:/dev/nvidia{gpu}")]


def docker_unit(gpus: list[int]) -> str:
    """`ExecStart=docker run --name vllm ...`, the common way vLLM is deployed. A container
    stopped through its runtime is removed by --rm a moment later: the start waits for it."""
    run = shlex.join(
        [
            "docker",
            "run",
            "--rm",
            "--name",
            "vllm",
            "--network",
            "none",
            *volumes(gpus),
            "gpustub",
            "sh",
            "-c",
            hold(gpus),
        ]
    )
    script = (
        "for i in $(seq 50); do docker inspect vllm >/dev/null 2>&1 || break; "
        f"docker rm vllm >/dev/null 2>&1; sleep 0.2; done; exec {run}"
    )
    return (
        "[Unit]\nDescription=vLLM in docker\n[Service]\n"
        f"ExecStart=/bin/sh -c {shlex.quote(script.replace('$', '$$'))}\n"
        "TimeoutStartSec=120\nTimeoutStopSec=20\n"
    )


class Box:
    def __init__(self, sim: SimHost) -> None:
        self.sim = sim

    def sh(self, cmd: str, check: bool = True) -> str:
        return self.sim.run(cmd, check=check, timeout=180).stdout

    def claim(self, runtime: str, name: str, gpus: list[int]) -> int:
        """Tell the stand-in NVML the container's process uses MIB on each GPU (the driver
        would know); returns its host PID."""
        pid = int(self.sh(f"{runtime} inspect --format '{{{{.State.Pid}}}}' {name}").strip())
        assert pid > 0, f"{name} is not running"
        start = self.sh(f"sed 's/.*) //' /proc/{pid}/stat | cut -d' ' -f20").strip()
        listed = ",".join(map(str, gpus))
        self.sim.write_file(f"/run/fake-nvml/claims/{pid}", f"{MIB} {start} {listed}\n")
        return pid

    def ps(self, runtime: str) -> list[dict[str, Any]]:
        """`docker ps -a` (one JSON object a line: ID, Names, State) or `podman ps -a` (a
        JSON list: Id, Names, State, ExitCode)."""
        if runtime == "podman":
            found: list[dict[str, Any]] = json.loads(self.sh("podman ps -a --format json"))
            return found
        out = self.sh("docker ps -a --no-trunc --format '{{json .}}'")
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def status(self, unit: str | None = None) -> dict[str, Any]:
        argv = ["gpugate", "status", "--json", *([unit] if unit else [])]
        data: dict[str, Any] = json.loads(self.sim.run(argv).stdout)
        return data

    def used(self, gpu: int) -> int:
        used: int = self.status()["gpus"][gpu]["used_mib"]
        return used


@pytest.fixture(scope="module")
def box(fake_nvml_lib: Path | None) -> Iterator[Box]:
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    sim = SimHost.boot(nvml_lib=fake_nvml_lib, gpus=8)
    try:
        sim.install_gpugate(REPO)
        sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
        install_debs(sim, "containers", ["docker.io", "podman", "runc", "busybox-static"])
        # This machine has its own docker CLI in /usr/local/bin, first on PATH: the host's
        # must be Debian's, the one docker.io installs.
        sim.run("rm -f /usr/local/bin/docker")
        sim.write_file("/etc/docker/daemon.json", DAEMON_JSON)
        sim.write_file("/etc/containers/storage.conf", STORAGE_CONF)
        sim.run(
            f"mkdir -p {ROOTFS}/bin {ROOTFS}/dev {ROOTFS}/proc {ROOTFS}/sys {ROOTFS}/etc "
            f"{ROOTFS}/tmp && cp /bin/busybox {ROOTFS}/bin/busybox && "
            f"for a in $({ROOTFS}/bin/busybox --list); do "
            f'[ "$a" = busybox ] || ln -sf busybox {ROOTFS}/bin/$a; done'
        )
        started = sim.systemctl("start", "containerd.service", "docker.service", check=False)
        if started.returncode:
            said = sim.run("journalctl --no-pager -o cat -u docker -u containerd | tail -15")
            raise AssertionError(f"dockerd did not start:\n{said.stdout}")
        sim.run(f"tar -C {ROOTFS} -c . | docker import - gpustub", timeout=120)
        yield Box(sim)
    finally:
        sim.poweroff()


def test_docker_container_of_the_unit_outlives_its_client_then_restarts_cleanly(
    box: Box,
) -> None:
    sim = box.sim
    sim.install_unit(UNIT, docker_unit([0, 1]))
    fast = (
        "sed -i 's/^# sigterm_grace_s = .*/sigterm_grace_s = 1.0/' /etc/gpugate/" + UNIT + ".toml"
    )
    box.sh(f"gpugate install {UNIT} --gpus 0,1 && {fast}")
    sim.systemctl("start", UNIT)
    wait_for("the vllm container running", lambda: box.sh("docker ps -q --filter name=^vllm$"))
    first = box.ps("docker")[0]["ID"]
    pid = box.claim("docker", "vllm", [0, 1])
    wait_for("the container's memory on GPU 0", lambda: box.used(0) == MIB)

    # The docker client dies by SIGKILL; the container, a child of containerd, lives on.
    sim.systemctl("kill", "--signal=SIGKILL", UNIT)
    wait_for(
        "the unit down",
        lambda: (
            box.sh(f"systemctl is-active {UNIT}", check=False).strip() in ("failed", "inactive")
        ),
        timeout=120,
    )
    (alive,) = box.ps("docker")
    assert alive["ID"] == first and alive["State"] == "running", alive
    # gpugate status names the holder's runtime, container and name
    holder = next(h for h in box.status()["holders"] if h["pid"] == pid)
    assert holder["container"] == {"runtime": "docker", "id": first, "name": "vllm"}
    assert holder["unit"] == f"docker-{first}.scope"
    table = box.sh("gpugate status")
    assert "docker:vllm" in table

    # Without `containers`, the start is refused, naming the container and the field.
    sim.systemctl("reset-failed", UNIT, check=False)
    cursor = box.sh("journalctl -n 0 --show-cursor --no-pager | sed -n 's/^-- cursor: //p'")
    assert sim.systemctl("start", UNIT, check=False).returncode != 0
    journal = box.sh(
        f"journalctl --no-pager -o cat --after-cursor={shlex.quote(cursor.strip())}"
        f" GPUGATE_EVENT=refused GPUGATE_UNIT={UNIT}"
    )
    assert journal.strip(), "the refusal is in the journal"
    (still,) = box.ps("docker")
    assert still["ID"] == first and still["State"] == "running"

    # With it, the start stops that container through docker, then starts a new one.
    box.sh(f"gpugate install {UNIT} --gpus 0,1 --container vllm --force && {fast}")
    assert 'containers = ["vllm"]' in sim.read_file(f"/etc/gpugate/{UNIT}.toml")
    sim.systemctl("reset-failed", UNIT, check=False)
    sim.systemctl("start", UNIT)
    entries = [
        json.loads(line)
        for line in box.sh(
            f"journalctl --no-pager -o json --after-cursor={shlex.quote(cursor.strip())}"
            f" GPUGATE_UNIT={UNIT} GPUGATE_PHASE=pre"
        ).splitlines()
    ]
    stops = [e for e in entries if e.get("GPUGATE_SIGNAL") == "docker stop"]
    assert len(stops) == 1 and stops[0]["GPUGATE_CONTAINER"] == first
    assert stops[0]["MESSAGE"].endswith(": stopped")
    wait_for(
        "the new vllm container running",
        lambda: [c for c in box.ps("docker") if c["ID"] != first and c["State"] == "running"],
    )
    (now,) = box.ps("docker")
    assert now["Names"] == "vllm" and now["State"] == "running" and now["ID"] != first
    assert sim.systemctl("is-active", UNIT, check=False).stdout.strip() == "active"
    assert box.sh(f"test -d /proc/{pid} && echo alive || echo gone").strip() == "gone"
    sim.systemctl("stop", UNIT)
    wait_for("no container left", lambda: not box.ps("docker"))


def test_podman_container_refused_then_stopped_through_podman(box: Box) -> None:
    sim = box.sim
    run = shlex.join(
        [
            "podman",
            "run",
            "-d",
            "--name",
            "pod-llm",
            "--network",
            "none",
            "--pids-limit=-1",
            *volumes([3]),
            "--rootfs",
            ROOTFS,
            "/bin/sh",
            "-c",
            hold([3]),
        ]
    )
    box.sh(run)
    (container,) = box.ps("podman")
    assert container["State"] == "running", container
    pid = box.claim("podman", "pod-llm", [3])
    cgroup = box.sh(f"cat /proc/{pid}/cgroup").strip().splitlines()[-1]
    assert cgroup == f"0::/machine.slice/libpod-{container['Id']}.scope", cgroup
    holder = next(h for h in box.status()["holders"] if h["pid"] == pid)
    assert holder["container"] == {"runtime": "podman", "id": container["Id"], "name": "pod-llm"}

    sim.install_unit("tgi.service", "[Service]\nExecStart=/bin/sleep 3600\n")
    config = "gpus = [3]\n[pre]\nsigterm_grace_s = 1\nwait_timeout_s = 20\n"
    sim.write_file("/etc/gpugate/tgi.service.toml", config)
    refused = sim.run(["gpugate", "pre", "tgi.service"], check=False)
    assert refused.returncode == ExitCode.HELD_BY_OTHERS, refused.stderr
    assert box.ps("podman")[0]["State"] == "running"

    sim.write_file("/etc/gpugate/tgi.service.toml", 'containers = ["pod-llm"]\n' + config)
    done = sim.run(["gpugate", "pre", "tgi.service"], check=False)
    assert done.returncode == 0, done.stderr
    (stopped,) = box.ps("podman")
    assert stopped["State"] == "exited" and stopped["ExitCode"] == 143, stopped
    assert box.used(3) == 0
    box.sh("podman rm pod-llm")
