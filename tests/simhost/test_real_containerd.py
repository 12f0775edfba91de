"""gpugate on a Kubernetes GPU node's containerd: Debian's real containerd (1.6 on Debian 12)
and runc inside a simulated host, config.toml set up as a GPU node (NVIDIA's runtime as the CRI
default, oom_score, sandbox_image) with a stand-in nvidia-container-runtime at its fixed path
that records its calls and runs runc. `gpugate install --containers --default` adds the runtime
gpugate and keeps every other setting (`containerd config dump` parses it); a container run
through that runtime's binary (`ctr run --runc-binary`, the runc shim path the CRI plugin takes
through `BinaryName`) on GPU 1 kills a stale holder, NVIDIA's runtime still runs for it, a
second container and a unit on GPU 1 are refused naming the pod, containerd restarted keeps
both the container and its lease, `ctr task kill -s KILL` and delete release it, and so does a
SIGKILLed shim; a container without GPUs runs as before; uninstall leaves the file as it
was. docker's runtime gpugate on the same node runs NVIDIA's runtime in turn too. Debian
packages no crictl: `ctr run` gives what the CRI plugin would. Its containers have 64-hex ids;
their cgroup is the CRI's (`getCgroupsPath`: the pod's slice, `cri-containerd`, the id, which
runc's systemd driver makes `/kubepods.slice/kubepods-besteffort.slice/
kubepods-besteffort-podUID.slice/cri-containerd-ID.scope`); the annotations are the CRI's
(`--annotation`); a GPU is its 195:N node in linux.devices (`--device`, as the device plugin's
DeviceSpecs are), beside the plain /dev/nvidiaN its process holds for the stand-in NVML."""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from incident import REPO
from realparts import install_debs, wait_for
from sandbox import SimHost
from test_real_containers import DAEMON_JSON, MIB, ROOTFS, hold
from test_real_oci_hooks import FAST, NODES, Box
from test_real_oci_hooks import node as gpu_node

from gpugate.compat import tomllib

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

CONFIG = "/etc/containerd/config.toml"
NVIDIA = "/usr/bin/nvidia-container-runtime"
CALLS = "/run/nvidia-runtime-calls"
GPU_NODE = """\
# containerd on a GPU node, as nvidia-ctk runtime configure --set-as-default leaves it
version = 2
oom_score = -999

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "nvidia"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
          privileged_without_host_devices = false
          runtime_type = "io.containerd.runc.v2"
          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
            BinaryName = "/usr/bin/nvidia-container-runtime"
            SystemdCgroup = true
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
          runtime_type = "io.containerd.runc.v2"
          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
            SystemdCgroup = true
"""
# NVIDIA's runtime in one line: records how it was called, then runs runc (as it does after
# editing the spec).
STAND_IN = f"""#!/bin/sh
echo "chain=${{GPUGATE_OCI_RUNTIME_CHAIN:-}} $*" >> {CALLS}
exec /usr/bin/runc "$@"
"""
POD = {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.sandbox-namespace": "ml",
    "io.kubernetes.cri.sandbox-name": "vllm-0",
    "io.kubernetes.cri.container-name": "server",
}


def container_id(name: str) -> str:
    """A container id as containerd's CRI makes them: 64 hex digits."""
    return hashlib.sha256(name.encode()).hexdigest()


A_ID, B_ID, C_ID, D_ID, E_ID = map(container_id, ("gpu-a", "gpu-b", "plain-c", "gpu-d", "gpu-e"))
F_ID, G_ID = map(container_id, ("sliced-f", "sliced-g"))
# kubelet's cgroup parent of a BestEffort pod (systemd driver: the pod UID's dashes as
# underscores); the CRI plugin passes its last slice to runc as `SLICE:cri-containerd:ID`.
POD_SLICE = "kubepods-besteffort-pod6b1f0c52_9a3e_4d7b_8f21_0c4d5e6f7a8b.slice"
POD_CGROUP = "/kubepods.slice/kubepods-besteffort.slice/" + POD_SLICE + "/cri-containerd-{id}.scope"
# docker on the same node, NVIDIA's runtime registered as nvidia-ctk registers it.
DOCKER_NVIDIA = json.dumps({**json.loads(DAEMON_JSON), "runtimes": {"nvidia": {"path": NVIDIA}}})


class Node(Box):
    wrapper = ""

    def ctr_run(
        self, cid: str, gpu: int | None, *, detach: bool = True, pod: dict[str, str] = POD
    ) -> list[str]:
        argv = ["ctr", "run", "-d" if detach else "--rm", "--runc-binary", self.wrapper]
        argv += ["--runc-systemd-cgroup", "--cgroup", f"{POD_SLICE}:cri-containerd:{cid}"]
        argv += ["--cpu-shares", "0"]  # runc and this machine's hybrid cgroups: no cpu.weight
        if gpu is not None:
            argv += ["--device", f"{NODES}/nvidia{gpu}"]
            argv += [
                "--mount",
                f"type=bind,src=/dev/nvidia{gpu},dst=/dev/nvidia{gpu},options=rbind:rw",
            ]
            argv += [
                arg for key, value in pod.items() for arg in ("--annotation", f"{key}={value}")
            ]
        command = hold([gpu]) if gpu is not None else "echo plain"
        return [*argv, "--rootfs", ROOTFS, cid, "/bin/sh", "-c", command]

    def task(self, cid: str) -> tuple[int, str]:
        """(PID, STATUS) of the container's task; (0, "") where it has none."""
        for line in self.sh("ctr task ls").splitlines()[1:]:
            words = line.split()
            if words and words[0] == cid:
                return int(words[1]), words[2]
        return 0, ""

    def cgroup(self, cid: str) -> str:
        """The cgroup of the container's task, as the kernel says it."""
        return self.sh(f"cat /proc/{self.task(cid)[0]}/cgroup").strip().partition("::")[2]

    def claim_task(self, cid: str, gpus: list[int]) -> None:
        pid = self.task(cid)[0]
        start = self.sh(f"sed 's/.*) //' /proc/{pid}/stat | cut -d' ' -f20").strip()
        self.sim.write_file(
            f"/run/fake-nvml/claims/{pid}", f"{MIB} {start} " + ",".join(map(str, gpus)) + "\n"
        )


@pytest.fixture(scope="module")
def node(fake_nvml_lib: Path | None) -> Iterator[Node]:
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    sim = SimHost.boot(nvml_lib=fake_nvml_lib, gpus=8)
    try:
        sim.install_gpugate(REPO)
        sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
        install_debs(sim, "containerd", ["containerd", "runc", "busybox-static", "docker.io"])
        sim.run("rm -f /usr/local/bin/docker")
        sim.write_file(CONFIG, GPU_NODE)
        sim.write_file("/etc/docker/daemon.json", DOCKER_NVIDIA)
        sim.write_file(NVIDIA, STAND_IN, mode=0o755)
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
        restart(sim)
        sim.systemctl("start", "docker.service")
        sim.run(f"tar -C {ROOTFS} -c . | docker import - gpustub", timeout=120)
        yield Node(sim)
    finally:
        sim.poweroff()


def restart(sim: SimHost) -> None:
    started = sim.systemctl("restart", "containerd.service", check=False)
    if started.returncode:
        said = sim.run("journalctl --no-pager -o cat -u containerd | tail -15")
        raise AssertionError(f"containerd did not start:\n{said.stdout}")
    wait_for("containerd answering", lambda: sim.run("ctr version", check=False).returncode == 0)


def test_install_adds_the_runtime_and_keeps_the_gpu_node_s_settings(node: Node) -> None:
    said = node.sh("gpugate install --containers --default")
    assert CONFIG in said, said
    record = tomllib.loads(node.sim.read_file("/etc/gpugate/oci-runtime.toml"))
    assert record == {"runtime": "nvidia-container-runtime"}
    text = node.sim.read_file(CONFIG)
    assert text.startswith(GPU_NODE.partition('      default_runtime_name = "nvidia"')[0])
    restart(node.sim)
    dumped = tomllib.loads(node.sh("containerd config dump"))
    assert dumped["oom_score"] == -999
    cri = dumped["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.9"
    assert cri["containerd"]["default_runtime_name"] == "gpugate"
    runtimes = cri["containerd"]["runtimes"]
    assert runtimes["nvidia"]["options"]["BinaryName"] == NVIDIA
    gpugate = runtimes["gpugate"]
    assert gpugate["runtime_type"] == "io.containerd.runc.v2"
    assert gpugate["options"]["SystemdCgroup"] is True
    node.wrapper = gpugate["options"]["BinaryName"]
    assert node.wrapper.endswith("/gpugate-oci-runtime")
    checked = node.sh("gpugate config check")
    assert NVIDIA in checked, checked
    again = node.sh("gpugate install --containers --default")
    assert "wrote" not in again and f"unchanged {CONFIG}" in again, again


def test_a_pod_s_gpu_container_is_gated_through_the_runtime_s_binary(node: Node) -> None:
    sim = node.sim
    assert node.wrapper, "the install test ran first"
    stale = node.stale_holder(1)
    cursor = node.cursor()
    node.sh(shlex.join(node.ctr_run(A_ID, 1)))
    wait_for("the pod's container running", lambda: node.task(A_ID)[1] == "RUNNING")
    assert node.cgroup(A_ID) == POD_CGROUP.format(id=A_ID)
    assert not node.alive(stale), "the stale holder on GPU 1 outlived the container's start"
    calls = node.sh(f"cat {CALLS}")
    assert any(" create " in line and A_ID in line for line in calls.splitlines()), calls
    assert "chain=nvidia-container-runtime" in calls, calls
    entries = node.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
    assert entries and all(e.get("GPUGATE_OCI_CONTAINER") == A_ID for e in entries), entries[:1]
    assert {e.get("GPUGATE_OCI_POD") for e in entries} == {"vllm-0"}
    assert {e.get("GPUGATE_OCI_POD_NAMESPACE") for e in entries} == {"ml"}
    assert {e.get("GPUGATE_OCI_POD_CONTAINER") for e in entries} == {"server"}
    killed = [e for e in entries if e.get("GPUGATE_SIGNAL") == "SIGTERM"]
    assert [e["GPUGATE_PID"] for e in killed] == [str(stale)], killed
    (lease,) = node.leases()
    assert "ml/vllm-0/server" in lease["container"] and A_ID[:12] in lease["container"], lease
    assert lease["unit"] == f"cri-containerd-{A_ID}.scope", lease
    assert lease["gpus"] == [1]
    node.claim_task(A_ID, [1])

    # A second container onto GPU 1: refused, naming the pod; the first runs on.
    refused = sim.run(shlex.join(node.ctr_run(B_ID, 1)), check=False)
    assert refused.returncode != 0, refused.stdout
    assert "ml/vllm-0/server" in refused.stderr, refused.stderr
    assert node.task(B_ID)[1] != "RUNNING"
    node.sh(f"ctr task delete -f {B_ID}; ctr container delete {B_ID}", check=False)

    # So is a unit's start on GPU 1.
    sim.install_unit("tgi.service", "[Service]\nExecStart=/bin/sleep 3600\n")
    node.sh("gpugate install tgi.service --gpus 1")
    assert sim.systemctl("start", "tgi.service", check=False).returncode != 0
    said = node.sh("journalctl --no-pager -o cat -u tgi.service | tail -20")
    assert "ml/vllm-0/server" in said, said
    assert node.task(A_ID)[1] == "RUNNING"

    # containerd restarted under it: the container runs on, and so does its lease.
    restart(sim)
    assert node.task(A_ID)[1] == "RUNNING" and len(node.leases()) == 1

    # SIGKILLed and deleted: runc's delete runs the poststop, the lease goes, the unit starts.
    node.sh(f"ctr task kill -s KILL {A_ID}")
    wait_for("the task stopped", lambda: node.task(A_ID)[1] == "STOPPED")
    node.sh(f"ctr task delete {A_ID} && ctr container delete {A_ID}")
    wait_for("the lease given up", lambda: not node.leases())
    sim.systemctl("reset-failed", "tgi.service", check=False)
    sim.systemctl("start", "tgi.service")
    assert sim.systemctl("is-active", "tgi.service", check=False).stdout.strip() == "active"
    sim.systemctl("stop", "tgi.service")


def test_a_killed_shim_leaves_no_lease_behind(node: Node) -> None:
    """containerd cleans up after a shim that died (`shim delete`: runc delete --force, which
    runs the poststop): the container goes, and with it its lease; the next one starts."""
    node.sh(shlex.join(node.ctr_run(D_ID, 3)))
    wait_for("gpu-d running", lambda: node.task(D_ID)[1] == "RUNNING")
    assert len(node.leases()) == 1
    node.claim_task(D_ID, [3])
    shims = node.sh(f"ps -eo pid=,args= | grep '[c]ontainerd-shim-runc-v2 .*-id {D_ID}'")
    (shim,) = [int(line.split()[0]) for line in shims.splitlines()]
    node.sh(f"kill -KILL {shim}")
    wait_for("gpu-d's task gone", lambda: node.task(D_ID)[1] in ("", "STOPPED"))
    wait_for("its lease gone", lambda: not node.leases())
    node.sh(f"ctr task delete {D_ID}; ctr container delete {D_ID}", check=False)
    node.sh(shlex.join(node.ctr_run(E_ID, 3)))
    wait_for("gpu-e running", lambda: node.task(E_ID)[1] == "RUNNING")
    node.sh(f"ctr task kill -s KILL {E_ID}")
    wait_for("gpu-e stopped", lambda: node.task(E_ID)[1] == "STOPPED")
    node.sh(f"ctr task delete {E_ID} && ctr container delete {E_ID}")
    wait_for("no lease left", lambda: not node.leases())


def test_a_container_without_gpus_runs_as_before(node: Node) -> None:
    cursor = node.cursor()
    plain = node.sh(shlex.join(node.ctr_run(C_ID, None, detach=False)))
    assert plain.strip() == "plain"
    assert not [
        e for e in node.entries(cursor, "SYSLOG_IDENTIFIER=gpugate") if e.get("GPUGATE_PHASE")
    ]


def test_docker_s_gpugate_runtime_keeps_nvidia_s_runtime_in_the_chain(node: Node) -> None:
    stale = node.stale_holder(2)
    before = len(node.sh(f"cat {CALLS}").splitlines())
    argv = ["docker", "run", "-d", "--runtime", "gpugate", "--name", "dgpu", "--network", "none"]
    argv += ["-v", "/dev/nvidia2:/dev/nvidia2", *gpu_node(2), "gpustub", "sh", "-c", hold([2])]
    node.sh(shlex.join(argv))
    wait_for("dgpu running", lambda: node.sh("docker ps -q --filter name=^dgpu$").strip())
    assert not node.alive(stale)
    full = node.sh("docker inspect --format '{{.Id}}' dgpu").strip()
    calls = node.sh(f"cat {CALLS}").splitlines()[before:]
    created = [c for c in calls if " create " in c and full in c]
    assert created and all(c.startswith("chain=nvidia-container-runtime ") for c in created), calls
    (lease,) = node.leases()
    assert "dgpu" in lease["container"] and full[:12] in lease["container"], lease
    node.sh("docker rm -f dgpu")
    wait_for("the lease given up", lambda: not node.leases())


def test_two_time_sliced_pods_share_a_gpu_across_restarts(node: Node) -> None:
    """containers.toml's share_gpus = true beside the device plugin's time-slicing: two pods
    given GPU 5 both start, each restarts (delete, then a new create) and stops without
    touching the other, a stale orphan there is freed at the start that finds it, and each
    poststop exits 0 (issue 46, item 3)."""
    sim = node.sim
    assert node.wrapper, "the install test ran first"
    pods = {
        F_ID: {**POD, "io.kubernetes.cri.sandbox-name": "sliced-0"},
        G_ID: {**POD, "io.kubernetes.cri.sandbox-name": "sliced-1"},
    }

    def start(cid: str) -> int:
        node.sh(shlex.join(node.ctr_run(cid, 5, pod=pods[cid])))
        wait_for(f"{cid[:12]} running", lambda: node.task(cid)[1] == "RUNNING")
        node.claim_task(cid, [5])
        return node.task(cid)[0]

    def stop(cid: str) -> None:
        node.sh(f"ctr task kill -s KILL {cid}")
        wait_for(f"{cid[:12]} stopped", lambda: node.task(cid)[1] == "STOPPED")
        node.sh(f"ctr task delete {cid} && ctr container delete {cid}")

    def leased() -> set[str]:
        return {lease["unit"] for lease in node.leases()}

    sim.write_file("/etc/gpugate/containers.toml", "share_gpus = true\n" + FAST)
    try:
        stale = node.stale_holder(5)
        cursor = node.cursor()
        f_pid = start(F_ID)
        assert not node.alive(stale), "the stale orphan on the time-sliced GPU outlived F's start"
        g_pid = start(G_ID)
        assert node.alive(f_pid) and node.task(F_ID) == (f_pid, "RUNNING")
        assert leased() == {f"cri-containerd-{F_ID}.scope", f"cri-containerd-{G_ID}.scope"}
        spared = [
            e
            for e in node.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
            if e.get("GPUGATE_OCI_CONTAINER") == G_ID and e.get("GPUGATE_REASON") == "sharer"
        ]
        assert str(f_pid) in {e.get("GPUGATE_PID") for e in spared}, spared

        # F restarts, with a new stale orphan on the GPU meanwhile: G untouched throughout.
        cursor = node.cursor()
        stop(F_ID)
        wait_for("F's lease given up", lambda: leased() == {f"cri-containerd-{G_ID}.scope"})
        stale = node.stale_holder(5)
        f_pid = start(F_ID)
        assert not node.alive(stale)
        assert node.task(G_ID) == (g_pid, "RUNNING")
        entries = node.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
        finished = [e for e in entries if e.get("GPUGATE_EVENT") == "run_finished"]
        assert {(e["GPUGATE_PHASE"], e["GPUGATE_RESULT"]) for e in finished} == {
            ("post", "success"),
            ("pre", "success"),
        }, finished
        killed = {e["GPUGATE_PID"] for e in entries if e.get("GPUGATE_SIGNAL") == "SIGTERM"}
        assert str(g_pid) not in killed and str(stale) in killed, killed

        # G stops: F runs on, its lease kept.
        stop(G_ID)
        wait_for("G's lease given up", lambda: leased() == {f"cri-containerd-{F_ID}.scope"})
        assert node.task(F_ID) == (f_pid, "RUNNING")
    finally:
        for cid in (F_ID, G_ID):
            node.sh(f"ctr task delete -f {cid}; ctr container delete {cid}", check=False)
        sim.write_file("/etc/gpugate/containers.toml", FAST)
    wait_for("no lease left", lambda: not node.leases())


def test_uninstall_leaves_the_file_as_it_was(node: Node) -> None:
    said = node.sh("gpugate uninstall --containers")
    assert CONFIG in said, said
    assert node.sim.read_file(CONFIG) == GPU_NODE
    assert json.loads(node.sim.read_file("/etc/docker/daemon.json")) == json.loads(DOCKER_NVIDIA)
    assert not node.sim.exists("/etc/gpugate/oci-runtime.toml")
    restart(node.sim)
