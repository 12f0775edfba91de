"""Pods as the kubelet runs them, through containerd's CRI: Debian's real containerd 1.6 and runc
inside a simulated host, driven over its CRI socket with gRPC (cri.py: `runtime.v1` of
k8s.io/cri-api v0.25, stubs generated at test time), never with `ctr`. So the CRI plugin itself
makes the pod's sandbox (a pause container), picks the runtime by the pod's runtime handler
(`gpugate`, a RuntimeClass's handler, which `gpugate install --containers` adds), writes the
annotations, turns the device plugin's hand-outs into the spec, and tears down on
StopPodSandbox / RemovePodSandbox.

The node, as on a GPU node with NVIDIA's toolkit: its runtime `nvidia` (the CRI default) is a
stand-in nvidia-container-runtime that does what the legacy one does on `create` (adds
`nvidia-container-runtime-hook prestart` to config.json, then runs runc), with a stand-in hook
that exits 0. What the device plugin hands a container, in each of its modes: the variable
`NVIDIA_VISIBLE_DEVICES=GPU-UUID` (envvar), `/dev/null` mounted at
`/var/run/nvidia-container-devices/GPU-UUID` with NVIDIA's config accepting them
(volume-mounts), a `cdi.k8s.io/…` annotation naming `nvidia.com/gpu=GPU-UUID` (CDI
annotations; containerd 1.6 has no CDI of its own, so the runtime's `container_annotations`
lets the annotation through to the spec). NVIDIA's hook would then put the GPU's device into
the container; here the test mounts the plain /dev/nvidiaN the stand-in NVML reads, and the
container's process holds it.

What this machine needs (/work/shared/real-components.md): locally built OCI image archives
(pause and a busybox container; no registry is reachable) imported with `ctr -n k8s.io images
import --snapshotter native` (the only use of ctr: the kubelet never imports images),
`snapshotter = "native"`, `restrict_oom_score_adj`, `disable_apparmor`, pods on the host network
without a hostname (no CNI), and no CPU shares in a spec (no cpu controller to delegate here):
/usr/bin/runc is a small wrapper that drops `linux.resources.cpu.shares` on `create` and runs
Debian's /usr/sbin/runc.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cri import CriClient, Pod
from incident import REPO
from realparts import install_debs, wait_for
from sandbox import SimHost
from test_real_containers import MIB, ROOTFS
from test_real_oci_hooks import FAST, NVIDIA_HOOK, Box

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

CONFIG = "/etc/containerd/config.toml"
NVIDIA = "/usr/bin/nvidia-container-runtime"
CALLS = "/run/nvidia-runtime-calls"
PAUSE = "gpugate.test/pause:1"
BUSYBOX = "gpugate.test/busybox:1"
CRI = '[plugins."io.containerd.grpc.v1.cri"]'
NODE_CONFIG = f"""\
# containerd on a GPU node (nvidia-ctk runtime configure --set-as-default), for this machine
version = 2
oom_score = -999

[plugins]
  {CRI}
    sandbox_image = "{PAUSE}"
    restrict_oom_score_adj = true
    disable_apparmor = true
    {CRI[:-1]}.containerd]
      snapshotter = "native"
      default_runtime_name = "nvidia"

      {CRI[:-1]}.containerd.runtimes]
        {CRI[:-1]}.containerd.runtimes.nvidia]
          runtime_type = "io.containerd.runc.v2"
          pod_annotations = ["cdi.k8s.io/*"]
          container_annotations = ["cdi.k8s.io/*"]
          {CRI[:-1]}.containerd.runtimes.nvidia.options]
            BinaryName = "{NVIDIA}"
            SystemdCgroup = true
        {CRI[:-1]}.containerd.runtimes.runc]
          runtime_type = "io.containerd.runc.v2"
          {CRI[:-1]}.containerd.runtimes.runc.options]
            BinaryName = "/usr/bin/runc"
            SystemdCgroup = true
"""
# Edits BUNDLE/config.json on `create` (keeping the file's mode), then execs the next runtime.
SPEC_EDITOR = """#!/usr/bin/python3
import json, os, sys

args = sys.argv[1:]


def bundle():
    rest = args[args.index("create") + 1 :]
    for i, arg in enumerate(rest):
        if arg in ("--bundle", "-b") and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith("--bundle="):
            return arg.partition("=")[2]
    return "."


def edit(spec):
%(edit)s


%(before)s
if "create" in args:
    path = os.path.join(bundle(), "config.json")
    with open(path) as handle:
        spec = json.load(handle)
    edit(spec)
    mode = os.stat(path).st_mode & 0o7777
    with open(path + ".edit", "w") as handle:
        json.dump(spec, handle)
    os.chmod(path + ".edit", mode)
    os.replace(path + ".edit", path)
os.execv(%(next)r, [%(next)r, *args])
"""
RUNC_WRAPPER = SPEC_EDITOR % {
    "edit": '    spec.get("linux", {}).get("resources", {}).get("cpu", {}).pop("shares", None)',
    "before": "",
    "next": "/usr/sbin/runc",
}
NVIDIA_STAND_IN = SPEC_EDITOR % {
    "edit": (
        '    hooks = spec.setdefault("hooks", {}).setdefault("prestart", [])\n'
        f'    hooks.append({{"path": "{NVIDIA_HOOK}", '
        '"args": ["nvidia-container-runtime-hook", "prestart"]})'
    ),
    "before": (
        f'with open("{CALLS}", "a") as log:\n'
        '    chain = os.environ.get("GPUGATE_OCI_RUNTIME_CHAIN", "")\n'
        "    log.write(f\"chain={chain} {' '.join(args)}\\n\")"
    ),
    "next": "/usr/bin/runc",
}
# An OCI image layout (oci-layout, index.json, blobs) of ROOT as one uncompressed layer, named
# for containerd's import by the io.containerd.image.name annotation.
IMAGE_BUILDER = """#!/usr/bin/python3
import hashlib, io, json, os, sys, tarfile

root, out, name, *cmd = sys.argv[1:]


def blob(data, media):
    digest = hashlib.sha256(data).hexdigest()
    os.makedirs(f"{out}/blobs/sha256", exist_ok=True)
    with open(f"{out}/blobs/sha256/{digest}", "wb") as handle:
        handle.write(data)
    return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}


buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
    tar.add(root, arcname=".")
layer = buf.getvalue()
config = {
    "architecture": "amd64",
    "os": "linux",
    "config": {"Cmd": cmd, "Env": ["PATH=/bin"]},
    "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
}
manifest = {
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
    "layers": [blob(layer, "application/vnd.oci.image.layer.v1.tar")],
}
entry = blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
entry["annotations"] = {"io.containerd.image.name": name}
with open(f"{out}/index.json", "w") as handle:
    json.dump({"schemaVersion": 2, "manifests": [entry]}, handle)
with open(f"{out}/oci-layout", "w") as handle:
    json.dump({"imageLayoutVersion": "1.0.0"}, handle)
"""
# The pause container: PID 1 of its namespace, ends on SIGTERM.
PAUSE_CMD = ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 2147483647 & wait"]


def uuid(gpu: int) -> str:
    """The stand-in NVML's UUID of GPU gpu (fake_nvml.c's default uuid_prefix)."""
    return f"GPU-fa4e5a11-0000-0000-0000-{gpu:012x}"


class Node(Box):
    def __init__(self, sim: SimHost, cri: CriClient) -> None:
        super().__init__(sim)
        self.cri = cri

    def claim_pid(self, pid: int, gpus: list[int]) -> None:
        """The container's process claims memory on its GPUs, as CUDA's would."""
        start = self.sh(f"sed 's/.*) //' /proc/{pid}/stat | cut -d' ' -f20").strip()
        self.sim.write_file(
            f"/run/fake-nvml/claims/{pid}", f"{MIB} {start} " + ",".join(map(str, gpus)) + "\n"
        )

    def spec(self, container_id: str) -> dict[str, Any]:
        """The OCI spec containerd made for a container or sandbox (its own record)."""
        info = json.loads(self.sh(f"ctr -n k8s.io containers info {container_id}"))
        spec: dict[str, Any] = info["Spec"]
        return spec

    def calls(self, container_id: str) -> list[str]:
        """How NVIDIA's runtime was run for a container: its `create` lines."""
        lines = self.sh(f"cat {CALLS} 2>/dev/null || true").splitlines()
        return [line for line in lines if " create " in line and container_id in line]

    def gpugate_entries(self, cursor: str, container_id: str) -> list[dict[str, Any]]:
        entries = self.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
        return [e for e in entries if e.get("GPUGATE_OCI_CONTAINER") == container_id]

    def teardown(self, pod: Pod) -> None:
        """The kubelet's end of a pod: StopPodSandbox (stops its containers), then
        RemovePodSandbox (removes them and the sandbox)."""
        self.cri.stop_pod_sandbox(pod)
        self.cri.remove_pod_sandbox(pod)


def build_images(sim: SimHost) -> None:
    sim.run(
        f"mkdir -p {ROOTFS}/bin {ROOTFS}/dev {ROOTFS}/proc {ROOTFS}/sys {ROOTFS}/etc "
        f"{ROOTFS}/tmp {ROOTFS}/run {ROOTFS}/var/run && cp /bin/busybox {ROOTFS}/bin/busybox && "
        f"for a in $({ROOTFS}/bin/busybox --list); do "
        f'[ "$a" = busybox ] || ln -sf busybox {ROOTFS}/bin/$a; done'
    )
    sim.write_file("/usr/local/lib/build-oci-image", IMAGE_BUILDER, mode=0o755)
    for name, cmd in ((PAUSE, PAUSE_CMD), (BUSYBOX, ["/bin/sh"])):
        folder = "/var/tmp/oci-" + name.rpartition("/")[2].replace(":", "-")
        build = ["/usr/local/lib/build-oci-image", ROOTFS, folder, name, *cmd]
        sim.run(f"rm -rf {folder} && {shlex.join(build)}", timeout=300)
        sim.run(
            f"tar -C {folder} -cf {folder}.tar . && "
            f"ctr -n k8s.io images import --snapshotter native {folder}.tar",
            timeout=300,
        )


def restart(sim: SimHost, cri: CriClient | None = None) -> None:
    started = sim.systemctl("restart", "containerd.service", check=False)
    if started.returncode:
        said = sim.run("journalctl --no-pager -o cat -u containerd | tail -15")
        raise AssertionError(f"containerd did not start:\n{said.stdout}")
    wait_for("containerd answering", lambda: sim.run("ctr version", check=False).returncode == 0)
    if cri is not None:
        cri.wait_ready()


@pytest.fixture(scope="module")
def node(fake_nvml_lib: Path | None) -> Iterator[Node]:
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    sim = SimHost.boot(nvml_lib=fake_nvml_lib, gpus=8)
    cri: CriClient | None = None
    try:
        sim.install_gpugate(REPO)
        sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
        install_debs(sim, "containerd-cri", ["containerd", "runc", "busybox-static"])
        sim.run("rm /usr/bin/runc")  # Debian's: a link to ../sbin/runc, which stays
        sim.write_file("/usr/bin/runc", RUNC_WRAPPER, mode=0o755)
        sim.write_file(NVIDIA, NVIDIA_STAND_IN, mode=0o755)
        sim.write_file(NVIDIA_HOOK, "#!/bin/sh\ncat >/dev/null\n", mode=0o755)
        sim.write_file(CONFIG, NODE_CONFIG)
        sim.write_file("/etc/gpugate/containers.toml", FAST)
        restart(sim)
        build_images(sim)
        said = sim.run("gpugate install --containers").stdout
        assert CONFIG in said, said
        cri = CriClient(f"/proc/{sim.pid1}/root/run/containerd/containerd.sock")
        restart(sim, cri)
        yield Node(sim, cri)
    finally:
        if cri is not None:
            cri.close()
        sim.poweroff()


def test_the_cri_runs_a_plain_pod_through_the_gpugate_handler(node: Node) -> None:
    """A pod without GPUs: sandbox and container through gpugate's runtime (the chain ran for
    both), running, gated by nothing; its teardown leaves nothing behind."""
    assert node.cri.version().runtime_name == "containerd"
    cursor = node.cursor()
    pod = node.cri.pod("plain-0")
    sandbox = node.cri.run_pod_sandbox(pod, "gpugate")
    assert node.cri.sandbox_ready(pod)
    cid = node.cri.create_container(pod, "main", BUSYBOX, PAUSE_CMD)
    node.cri.start_container(cid)
    assert node.cri.container_state(cid) == "CONTAINER_RUNNING"
    for made in (sandbox, cid):
        assert [c.split()[0] for c in node.calls(made)] == ["chain=nvidia-container-runtime"]
    assert not node.gpugate_entries(cursor, cid) and not node.gpugate_entries(cursor, sandbox)
    assert not node.leases()
    node.teardown(pod)
    assert sandbox not in node.cri.sandboxes() and cid not in node.cri.containers()
