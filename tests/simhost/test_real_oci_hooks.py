"""gpugate as an OCI hook in real podman 4.3 (runc, vfs; hooks.d files) and real docker.io
20.10 (the `gpugate` runtime wrapping runc), inside one simulated host of this module's own,
after `gpugate install --containers`. The evidence is the runtimes' own (`podman ps -a`,
`docker ps -a`), gpugate's journal entries, and which processes are still alive."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from incident import REPO
from realparts import hold_gpus_cmd, install_debs, wait_for
from sandbox import SimHost
from test_real_containers import DAEMON_JSON, MIB, ROOTFS, STORAGE_CONF, hold, volumes

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

HOOKS_D = "/usr/share/containers/oci/hooks.d"
# The GPUs as device numbers: 195:N at /dev/gpunodes/nvidiaN (no driver behind them here, so
# nothing opens them); holding a GPU is the plain /dev/nvidiaN the stand-in NVML reads.
NODES = "/dev/gpunodes"
NVIDIA_HOOK = "/usr/bin/nvidia-container-runtime-hook"
NVIDIA_CONFIG = "/etc/nvidia-container-runtime/config.toml"
FAST = "[pre]\nsigterm_grace_s = 1.0\nwait_timeout_s = 30\n[post]\nwait_timeout_s = 30\n"


class Box:
    def __init__(self, sim: SimHost) -> None:
        self.sim = sim

    def sh(self, cmd: str, check: bool = True) -> str:
        return self.sim.run(cmd, check=check, timeout=180).stdout

    def cursor(self) -> str:
        out = self.sh("journalctl -n 0 --show-cursor --no-pager | sed -n 's/^-- cursor: //p'")
        return out.strip()

    def entries(self, cursor: str, *matches: str) -> list[dict[str, Any]]:
        after = f"--after-cursor={shlex.quote(cursor)} " if cursor else ""
        out = self.sh(f"journalctl --no-pager -o json {after}" + " ".join(matches))
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def stale_holder(self, gpu: int) -> int:
        """A hand-started server from a login (user.slice) holding GPU gpu, ready."""
        scope = self.sim.spawn_scope(hold_gpus_cmd([gpu], MIB))
        pid = int(wait_for("the stale holder", lambda: self._main_pid(scope)))
        wait_for("its claim", lambda: self.sim.exists(f"/run/fake-nvml/claims/{pid}"))
        return pid

    def _main_pid(self, scope: str) -> int:
        out = self.sh(f"cat /sys/fs/cgroup/user.slice/{scope}/cgroup.procs", check=False)
        pids = [int(p) for p in out.split()]
        for pid in pids:
            if "sleep" in self.sh(f"cat /proc/{pid}/comm", check=False):
                return pid
        return 0

    def alive(self, pid: int) -> bool:
        return self.sh(f"test -d /proc/{pid} && echo y || echo n").strip() == "y"

    def claim(self, runtime: str, name: str, gpus: list[int]) -> int:
        pid = int(self.sh(f"{runtime} inspect --format '{{{{.State.Pid}}}}' {name}").strip())
        start = self.sh(f"sed 's/.*) //' /proc/{pid}/stat | cut -d' ' -f20").strip()
        self.sim.write_file(
            f"/run/fake-nvml/claims/{pid}", f"{MIB} {start} " + ",".join(map(str, gpus)) + "\n"
        )
        return pid

    def leases(self) -> list[dict[str, Any]]:
        data = json.loads(self.sim.run(["gpugate", "status", "--json"]).stdout)
        found: list[dict[str, Any]] = data["leases"]
        return found


def node(gpu: int, inside: str | None = None) -> list[str]:
    """`--device` of GPU gpu's node (195:gpu), under the path inside (default: the same)."""
    return ["--device", f"{NODES}/nvidia{gpu}:{inside or f'{NODES}/nvidia{gpu}'}"]


def podman_run(name: str, gpu: int | None, *extra: str) -> str:
    gpu_args = [*volumes([gpu]), *node(gpu)] if gpu is not None else []
    argv = [
        "podman", "run", "-d", "--name", name, "--network", "none", "--pids-limit=-1",
        *gpu_args, *extra, "gpustub", "/bin/sh", "-c",
        hold([gpu]) if gpu is not None else "trap 'exit 143' TERM; sleep 3600 & wait",
    ]  # fmt: skip
    return shlex.join(argv)


def docker_run(name: str, gpu: int) -> str:
    argv = [
        "docker", "run", "-d", "--runtime", "gpugate", "--name", name, "--network", "none",
        *volumes([gpu]), *node(gpu), "gpustub", "sh", "-c", hold([gpu]),
    ]  # fmt: skip
    return shlex.join(argv)


@pytest.fixture(scope="module")
def box(fake_nvml_lib: Path | None) -> Iterator[Box]:
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    sim = SimHost.boot(nvml_lib=fake_nvml_lib, gpus=8)
    try:
        sim.install_gpugate(REPO)
        sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
        install_debs(sim, "containers", ["docker.io", "podman", "runc", "busybox-static"])
        sim.run("rm -f /usr/local/bin/docker")
        sim.write_file("/etc/docker/daemon.json", DAEMON_JSON)
        sim.write_file("/etc/containers/storage.conf", STORAGE_CONF)
        sim.write_file("/etc/gpugate/containers.toml", FAST)
        sim.run(
            f"mkdir -p {NODES} && for i in 0 1 2 3 4 5 6 7; do "
            f"mknod -m 0666 {NODES}/nvidia$i c 195 $i; done"
        )
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
        sim.run(f"tar -C {ROOTFS} -c . | podman import - gpustub", timeout=120)
        yield Box(sim)
    finally:
        sim.poweroff()


def test_install_containers_writes_hooks_and_keeps_daemon_json(box: Box) -> None:
    said = box.sh("gpugate install --containers")
    assert box.sim.exists(f"{HOOKS_D}/gpugate-start.json"), said
    daemon = json.loads(box.sim.read_file("/etc/docker/daemon.json"))
    for key, value in json.loads(DAEMON_JSON).items():
        assert daemon[key] == value, key
    assert daemon["runtimes"]["gpugate"]["path"].endswith("/gpugate-oci-runtime")
    hook = json.loads(box.sim.read_file(f"{HOOKS_D}/gpugate-start.json"))
    assert hook["stages"] == ["createRuntime"]
    again = box.sh("gpugate install --containers")
    assert "wrote" not in again and "unchanged /etc/docker/daemon.json" in again, again
    assert "gpugate" in box.sh("docker info --format '{{json .Runtimes}}'")


def test_podman_container_kills_stale_holder_leases_gpu_then_unit_starts(box: Box) -> None:
    sim = box.sim
    stale = box.stale_holder(1)
    cursor = box.cursor()
    box.sh(podman_run("gpu-one", 1))
    (first,) = [c for c in json.loads(box.sh("podman ps -a --format json"))]
    assert first["State"] == "running", first
    assert not box.alive(stale), "the stale holder on GPU 1 outlived the container's start"
    entries = box.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
    assert entries, "gpugate said nothing"
    assert all(e.get("GPUGATE_OCI_CONTAINER") == first["Id"] for e in entries), entries[0]
    bundle = box.sh("podman inspect --format '{{.StaticDir}}' gpu-one").strip()
    assert {e.get("GPUGATE_OCI_CONTAINER_NAME") for e in entries} == {"gpu-one"}, bundle
    killed = [e for e in entries if e.get("GPUGATE_SIGNAL") == "SIGTERM"]
    assert [e["GPUGATE_PID"] for e in killed] == [str(stale)], killed
    (lease,) = box.leases()
    assert "gpu-one" in lease["container"] and first["Id"][:12] in lease["container"], lease
    assert lease["gpus"] == [1]
    box.claim("podman", "gpu-one", [1])

    # A second container onto GPU 1 is refused: it does not run, nothing is killed.
    refused = sim.run(podman_run("gpu-two", 1), check=False)
    assert refused.returncode != 0
    assert "gpu-one" in refused.stderr, refused.stderr
    states = {c["Names"][0]: c["State"] for c in json.loads(box.sh("podman ps -a --format json"))}
    assert states["gpu-one"] == "running" and states.get("gpu-two") != "running", states
    box.sh("podman rm -f gpu-two", check=False)

    # So is a unit's start on GPU 1.
    sim.install_unit("tgi.service", "[Service]\nExecStart=/bin/sleep 3600\n")
    box.sh("gpugate install tgi.service --gpus 1")
    assert sim.systemctl("start", "tgi.service", check=False).returncode != 0
    said = box.sh("journalctl --no-pager -o cat -u tgi.service | tail -20")
    assert "gpu-one" in said, said
    assert running(box, "podman", "gpu-one")

    # Stopped, its poststop gives the lease up; the unit starts.
    box.sh("podman stop --time 1 gpu-one")
    wait_for("the lease given up", lambda: not box.leases())
    sim.systemctl("reset-failed", "tgi.service", check=False)
    sim.systemctl("start", "tgi.service")
    assert sim.systemctl("is-active", "tgi.service", check=False).stdout.strip() == "active"
    sim.systemctl("stop", "tgi.service")
    box.sh("podman rm -f gpu-one")


def test_podman_container_without_gpu_runs_as_before(box: Box) -> None:
    """Also with NVIDIA_VISIBLE_DEVICES=all, as every CUDA image sets it: without NVIDIA's
    hook and without a device node it reaches no GPU, and gpugate leaves it alone."""
    cursor = box.cursor()
    box.sh(podman_run("no-gpu", None, "-e", "NVIDIA_VISIBLE_DEVICES=all"))
    assert running(box, "podman", "no-gpu")
    assert not box.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
    box.sh("podman rm -f --time 1 no-gpu")


def test_docker_runtime_kills_stale_holder_and_refuses_second(box: Box) -> None:
    stale = box.stale_holder(2)
    cursor = box.cursor()
    box.sh(docker_run("dgpu", 2))
    wait_for("dgpu running", lambda: box.sh("docker ps -q --filter name=^dgpu$").strip())
    assert not box.alive(stale)
    entries = box.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
    ids = {e.get("GPUGATE_OCI_CONTAINER") for e in entries}
    full = box.sh("docker inspect --format '{{.Id}}' dgpu").strip()
    assert ids == {full}, ids
    assert {e.get("GPUGATE_OCI_CONTAINER_NAME") for e in entries} == {"dgpu"}
    box.claim("docker", "dgpu", [2])
    refused = box.sim.run(docker_run("dgpu2", 2), check=False)
    assert refused.returncode != 0, refused.stdout
    assert "dgpu" in refused.stderr, refused.stderr
    assert running(box, "docker", "dgpu")
    box.sh("docker rm -f dgpu dgpu2", check=False)
    # Through the same runtime, a container without GPUs runs as before.
    plain = box.sh("docker run --rm --runtime gpugate --network none gpustub echo plain")
    assert plain.strip() == "plain"


def running(box: Box, runtime: str, name: str) -> bool:
    status = box.sh(f"{runtime} inspect --format '{{{{.State.Status}}}}' {name}", check=False)
    return status.strip() == "running"


def lease_gpus(box: Box) -> dict[str, list[int]]:
    """Each container lease's holder (its name) and its GPU indices."""
    return {lease["container"].split()[2]: lease["gpus"] for lease in box.leases()}


def test_a_renumbered_renamed_or_bind_mounted_node_is_gated_on_the_gpu_it_reaches(
    box: Box,
) -> None:
    """GPU 1's node called nvidia0 inside is GPU 1: its stale holder dies, alice's orphan on
    GPU 0 lives; called gpu1 it is still GPU 1 (refused beside the first); a bind mount of
    GPU 2's node under any name is GPU 2."""
    orphan = box.stale_holder(0)
    stale = box.stale_holder(1)
    try:
        box.sh(podman_run("renumbered", None, *node(1, "/dev/nvidia0")))
        assert running(box, "podman", "renumbered")
        assert box.alive(orphan), "the orphan on GPU 0 was killed for a container on GPU 1"
        assert not box.alive(stale), "GPU 1's stale holder outlived the container's start"
        assert lease_gpus(box) == {"renumbered": [1]}

        refused = box.sim.run(podman_run("renamed", None, *node(1, "/dev/gpu1")), check=False)
        assert refused.returncode != 0, refused.stdout
        assert "renumbered" in refused.stderr, refused.stderr
        assert not running(box, "podman", "renamed")

        box.sh(podman_run("bound", None, "-v", f"{NODES}/nvidia2:/dev/x"))
        assert lease_gpus(box) == {"renumbered": [1], "bound": [2]}
        assert box.alive(orphan)
    finally:
        box.sh("podman rm -f --time 1 renumbered renamed bound", check=False)
        box.sh(f"kill {orphan} {stale}", check=False)
    wait_for("the leases given up", lambda: not box.leases())


def test_docker_renumbered_node_is_gated_on_the_gpu_it_reaches(box: Box) -> None:
    orphan = box.stale_holder(0)
    base = "docker run -d --runtime gpugate --network none"
    try:
        box.sh(f"{base} --name drenum {shlex.join(node(1, '/dev/nvidia0'))} gpustub sleep 3600")
        wait_for("drenum running", lambda: running(box, "docker", "drenum"))
        assert lease_gpus(box) == {"drenum": [1]}
        assert box.alive(orphan)
        renamed = f"{base} --name drenamed {shlex.join(node(1, '/dev/gpu1'))} gpustub sleep 3600"
        refused = box.sim.run(renamed, check=False)
        assert refused.returncode != 0, refused.stdout
        assert "drenum" in refused.stderr, refused.stderr
        assert box.alive(orphan)
    finally:
        box.sh("docker rm -f drenum drenamed", check=False)
        box.sh(f"kill {orphan}", check=False)
    wait_for("the lease given up", lambda: not box.leases())


def test_nvidias_lists_count_as_nvidias_hook_reads_them(box: Box) -> None:
    """A stand-in nvidia-container-runtime-hook, registered as the toolkit registers it: with
    the unprivileged rule in force the image's NVIDIA_VISIBLE_DEVICES=all is nothing (as
    NVIDIA's hook ignores it), the device plugin's volume-mounts list and a CDI annotation
    are their GPUs, and without the rule the variable is."""
    sim = box.sim
    ran = "/run/nvidia-hook-states"
    sim.write_file(NVIDIA_HOOK, f"#!/bin/sh\ncat >>{ran}\necho >>{ran}\n", mode=0o755)
    hook = {
        "version": "1.0.0",
        "hook": {"path": NVIDIA_HOOK, "args": ["nvidia-container-runtime-hook", "prestart"]},
        "when": {"always": True, "commands": [".*"]},
        "stages": ["prestart"],
    }
    sim.write_file(f"{HOOKS_D}/oci-nvidia-hook.json", json.dumps(hook))
    sim.systemctl("restart", "docker.service")  # dockerd looks for NVIDIA's hook at its start
    sim.run(f"mkdir -p {Path(NVIDIA_CONFIG).parent}")
    sim.write_file(
        NVIDIA_CONFIG,
        "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
        "accept-nvidia-visible-devices-as-volume-mounts = true\n",
    )
    orphan = box.stale_holder(0)
    try:
        cursor = box.cursor()
        box.sh(podman_run("cuda-image", None, "-e", "NVIDIA_VISIBLE_DEVICES=all"))
        assert running(box, "podman", "cuda-image")
        cid = box.sh("podman inspect --format '{{.Id}}' cuda-image").strip()
        assert cid in box.sim.read_file(ran), "NVIDIA's stand-in hook did not run"
        assert not box.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
        assert not box.leases() and box.alive(orphan)

        listed = ("-v", "/dev/null:/var/run/nvidia-container-devices/3")
        box.sh(podman_run("listed", None, *listed, "-e", "NVIDIA_VISIBLE_DEVICES=/var/run/x"))
        box.sh(podman_run("cdi", None, "--annotation", "cdi.k8s.io/gpu=nvidia.com/gpu=4"))
        assert lease_gpus(box) == {"listed": [3], "cdi": [4]}

        sim.run(f"rm -f {NVIDIA_CONFIG}")  # NVIDIA's defaults: the variable counts
        box.sh(podman_run("variable", None, "-e", "NVIDIA_VISIBLE_DEVICES=5"))
        assert lease_gpus(box) == {"listed": [3], "cdi": [4], "variable": [5]}
        # docker --gpus: dockerd adds NVIDIA's hook (found on PATH) and the variable.
        gpus = "docker run -d --runtime gpugate --network none --gpus device=6 --name dgpus"
        box.sh(f"{gpus} gpustub sleep 3600")
        wait_for("dgpus running", lambda: running(box, "docker", "dgpus"))
        assert lease_gpus(box) == {"listed": [3], "cdi": [4], "variable": [5], "dgpus": [6]}
        assert box.alive(orphan)
    finally:
        box.sh("docker rm -f dgpus", check=False)
        box.sh("podman rm -f --time 1 cuda-image listed cdi variable", check=False)
        sim.run(f"rm -f {NVIDIA_HOOK} {HOOKS_D}/oci-nvidia-hook.json {NVIDIA_CONFIG}")
        box.sh(f"kill {orphan}", check=False)
    wait_for("the leases given up", lambda: not box.leases())


def test_a_container_in_a_units_cgroup_neither_takes_nor_frees_its_lease(box: Box) -> None:
    """Issue 34, rule 3: podman --cgroups=split (Quadlet's default) in a gated unit puts the
    container in the unit's cgroup. It is gated under its own id beside the unit's lease; its
    stop gives back its own lease, never the unit's, while the unit runs."""
    sim = box.sim
    unit = "split.service"
    sim.write_file("/run/split-run.sh", podman_run("split-gpu", 6, "--cgroups=split") + "\n")
    sim.install_unit(
        unit,
        "[Service]\nType=oneshot\nRemainAfterExit=yes\nDelegate=yes\n"
        "ExecStartPre=/usr/bin/gpugate pre %n\nExecStopPost=/usr/bin/gpugate post %n\n"
        "ExecStart=/bin/sh /run/split-run.sh\n",
    )
    sim.write_file(f"/etc/gpugate/{unit}.toml", 'gpus = [6]\nprivate_shm = "off"\n' + FAST)
    try:
        started = sim.systemctl("start", unit, check=False)
        said = box.sh(f"journalctl --no-pager -o cat -u {unit} | tail -20", check=False)
        assert started.returncode == 0, said
        full = box.sh("podman inspect --format '{{.Id}}' split-gpu").strip()
        pid = box.sh("podman inspect --format '{{.State.Pid}}' split-gpu").strip()
        cgroup = box.sh(f"cat /proc/{pid}/cgroup").strip()
        assert f"/system.slice/{unit}/" in cgroup and full in cgroup, cgroup
        leases = {lease["unit"]: lease for lease in box.leases()}
        assert set(leases) == {unit, f"container-{full}"}, leases
        assert leases[unit]["container"] is None, leases[unit]
        assert leases[f"container-{full}"]["gpus"] == [6]

        box.sh("podman stop --time 1 split-gpu")
        wait_for("its own lease given up", lambda: len(box.leases()) == 1)
        assert [lease["unit"] for lease in box.leases()] == [unit]
        assert sim.systemctl("is-active", unit, check=False).stdout.strip() == "active"
    finally:
        sim.systemctl("stop", unit, check=False)
        box.sh("podman rm -f --time 1 split-gpu", check=False)


ALICE = "runuser -u alice -- env HOME=/home/alice XDG_RUNTIME_DIR=/run/user/1500 podman"
ROOTLESS_CONF = "[containers]\ndefault_sysctls = []\n"
ROOTLESS = "--storage-driver vfs --cgroup-manager cgroupfs --events-backend file --runtime runc"


def test_a_rootless_podman_users_gpu_container_starts_as_without_gpugate(box: Box) -> None:
    """Issue 34, rule 2: rootless podman reads the same hooks.d and runs the hook as uid 0 of
    alice's user namespace; the hook says so in one journal entry and lets the container be."""
    sim = box.sim
    box.sh("gpugate install --containers")  # as the module's first test does; again is a no-op
    install_debs(sim, "rootless", ["uidmap"])
    box.sh(
        "id alice >/dev/null 2>&1 || useradd -m -u 1500 alice; "
        "grep -q '^alice:' /etc/subuid || echo alice:200000:65536 >> /etc/subuid; "
        "grep -q '^alice:' /etc/subgid || echo alice:200000:65536 >> /etc/subgid; "
        "mkdir -p /run/user/1500 && chown alice: /run/user/1500 && chmod 700 /run/user/1500"
    )
    # This machine's /proc is not fully visible to a user namespace: no fresh proc (--pid host
    # bind-mounts the host's) and a read-only /proc/sys (no default sysctls).
    sim.write_file("/home/alice/.config/containers/containers.conf", ROOTLESS_CONF)
    box.sh("chown -R alice: /home/alice/.config")
    alice = f"{ALICE} {ROOTLESS}"
    plain = sim.run(
        f"tar -C {ROOTFS} -c . | {alice} import - gpustub && "
        f"{alice} run --rm --network none --pid host gpustub echo plain",
        check=False,
        timeout=180,
    )
    if plain.returncode != 0 or "plain" not in plain.stdout:
        pytest.skip(f"rootless podman cannot run here: {(plain.stderr or plain.stdout)[-300:]}")
    # A GPU is its device number (195:6), not the stand-in file /dev/nvidia6: a container
    # given only that file asks for no GPU, and its hook rightly says nothing.
    ran = sim.run(
        f"{alice} run --name rootless-gpu --network none --pid host "
        f"-v {NODES}/nvidia6:/dev/nvidia6 gpustub echo gpu-ran",
        check=False,
        timeout=180,
    )
    assert (ran.returncode, ran.stdout.strip()) == (0, "gpu-ran"), ran.stderr
    full = box.sh(f"{alice} inspect --format '{{{{.Id}}}}' rootless-gpu").strip()
    box.sh(f"{alice} rm rootless-gpu")
    # The hook ran to its end before `podman run` returned; --sync returns once journald has
    # written what was queued to it by then. Found by the container's id, in every journal
    # file (the entry is alice's uid's).
    box.sh("journalctl --sync")
    said = box.entries("", f"GPUGATE_OCI_CONTAINER={full}")
    assert [e.get("GPUGATE_REASON") for e in said] == ["not-host-root"], said
    assert "uid_map" in said[0]["MESSAGE"], said[0]
    assert not box.leases()


def test_uninstall_containers_takes_it_back(box: Box) -> None:
    said = box.sh("gpugate uninstall --containers")
    assert f"{HOOKS_D}/gpugate-start.json" in said, said
    assert not box.sim.exists(f"{HOOKS_D}/gpugate-start.json")
    daemon = json.loads(box.sim.read_file("/etc/docker/daemon.json"))
    assert "gpugate" not in daemon.get("runtimes", {})
    assert daemon == json.loads(DAEMON_JSON)
