"""Pods as the kubelet runs them, through containerd's CRI: Debian's real containerd and runc
(Debian 12's 1.6 over this machine's root, Debian 13's 1.7 in a trixie root) inside a
simulated host, driven over its CRI socket with gRPC (cri.py: `runtime.v1` of
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
annotations: the runtime's `container_annotations` lets it through to the spec; containerd 1.6
has no CDI of its own, 1.7 with `enable_cdi` also resolves it against a stand-in of
nvidia-ctk's CDI spec in /etc/cdi and adds the GPU's node, 195:N, to the spec). NVIDIA's hook
would then put the GPU's device into the container; here the test mounts the plain
/dev/nvidiaN the stand-in NVML reads, and the container's process holds it.

What this machine needs (/work/shared/real-components.md): locally built OCI image archives
(pause and a busybox container; no registry is reachable) imported with `ctr -n k8s.io images
import --snapshotter native` (ctr only imports them and polls containerd after a restart),
`snapshotter = "native"`, `restrict_oom_score_adj`, `disable_apparmor`, pods on the host network
without a hostname (no CNI), and no CPU shares in a spec (no cpu controller to delegate here):
/usr/bin/runc is a small wrapper that drops `linux.resources.cpu.shares` on `create` and runs
Debian's /usr/sbin/runc.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cri import CriClient, CriError, Pod, stubs
from incident import REPO
from realparts import install_debs, wait_for
from roots import RootBuildError, debian_root, missing_tools
from sandbox import SimHost
from test_real_containers import MIB, ROOTFS, hold
from test_real_oci_hooks import FAST, NVIDIA_CONFIG, NVIDIA_HOOK, Box

from gpugate.errors import ExitCode

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

CONFIG = "/etc/containerd/config.toml"
NVIDIA = "/usr/bin/nvidia-container-runtime"
CALLS = "/run/nvidia-runtime-calls"
TASKS = "/run/containerd/io.containerd.runtime.v2.task/k8s.io"  # the bundles
PAUSE = "gpugate.test/pause:1"
# How long a poll may wait for what a call set off (a poststop, its NVML wait): a hang guard.
HANG_GUARD_S = 300
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
%(cdi)s    {CRI[:-1]}.containerd]
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


# The device plugin's modes: what it hands a container given GPU N (its UUID).
# containerd 1.7's own CDI (`enable_cdi`): it resolves a container's cdi.k8s.io annotations
# against the specs in /etc/cdi at CreateContainer and puts their device nodes in the spec.
# A stand-in of what `nvidia-ctk cdi generate` writes: each GPU by UUID, its node 195:N.
ENABLE_CDI = '    enable_cdi = true\n    cdi_spec_dirs = ["/etc/cdi"]\n'
NODES = "/dev/gpunodes"
CDI_SPEC = json.dumps(
    {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {
                "name": f"GPU-fa4e5a11-0000-0000-0000-{gpu:012x}",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": f"{NODES}/nvidia{gpu}", "type": "c", "major": 195, "minor": gpu}
                    ]
                },
            }
            for gpu in range(8)
        ],
    }
)
VOLUME_MOUNTS = "/var/run/nvidia-container-devices"


def handed(mode: str, gpu: int, pod: Pod) -> dict[str, Any]:
    """CreateContainer's envs, mounts and annotations for a container the device plugin gave
    GPU gpu in MODE, plus the plain /dev/nvidiaN the stand-in NVML reads (what NVIDIA's hook
    would inject: the GPU's device)."""
    mounts = [(f"/dev/nvidia{gpu}", f"/dev/nvidia{gpu}")]
    if mode == "envvar":
        return {"envs": {"NVIDIA_VISIBLE_DEVICES": uuid(gpu)}, "mounts": mounts}
    if mode == "volume-mounts":
        return {
            "envs": {"NVIDIA_VISIBLE_DEVICES": VOLUME_MOUNTS},
            "mounts": [*mounts, ("/dev/null", f"{VOLUME_MOUNTS}/{uuid(gpu)}")],
        }
    assert mode == "cdi-annotations", mode
    key = f"cdi.k8s.io/nvidia-device-plugin_{pod.uid}"
    return {"annotations": {key: f"nvidia.com/gpu={uuid(gpu)}"}, "mounts": mounts}


def uuid(gpu: int) -> str:
    """The stand-in NVML's UUID of GPU gpu (fake_nvml.c's default uuid_prefix)."""
    return f"GPU-fa4e5a11-0000-0000-0000-{gpu:012x}"


class Node(Box):
    def __init__(self, sim: SimHost, cri: CriClient, release: str) -> None:
        super().__init__(sim)
        self.cri = cri
        self.release = release

    def claim_pid(self, pid: int, gpus: list[int]) -> None:
        """The container's process claims memory on its GPUs, as CUDA's would."""
        start = self.sh(f"sed 's/.*) //' /proc/{pid}/stat | cut -d' ' -f20").strip()
        self.sim.write_file(
            f"/run/fake-nvml/claims/{pid}", f"{MIB} {start} " + ",".join(map(str, gpus)) + "\n"
        )

    def calls(self, container_id: str) -> list[str]:
        """How NVIDIA's runtime was run for a container: its `create` lines."""
        lines = self.sh(f"cat {CALLS} 2>/dev/null || true").splitlines()
        return [line for line in lines if " create " in line and container_id in line]

    def gpugate_entries(self, cursor: str, container_id: str) -> list[dict[str, Any]]:
        entries = self.entries(cursor, "SYSLOG_IDENTIFIER=gpugate")
        return [e for e in entries if e.get("GPUGATE_OCI_CONTAINER") == container_id]

    def unit_entries(self, cursor: str, unit: str) -> list[dict[str, Any]]:
        return self.entries(cursor, "SYSLOG_IDENTIFIER=gpugate", f"GPUGATE_UNIT={unit}")

    def status_text(self) -> str:
        return self.sh("gpugate status")

    def start_refused(self, unit: str) -> int:
        """systemctl start UNIT, which must fail: its ExecStartPre's (gpugate pre's) exit status."""
        assert self.sim.systemctl("start", unit, check=False).returncode != 0, unit
        shown = self.sh(f"systemctl show -p ExecStartPre -p ActiveState -p SubState {unit}")
        assert "ActiveState=failed" in shown, shown  # the main process never ran
        found = re.search(r"status=(\d+)", shown)
        assert found is not None, shown
        self.sim.systemctl("reset-failed", unit, check=False)
        return int(found.group(1))

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


# The releases: Debian 12's containerd 1.6 over this machine's own root, and Debian 13's
# containerd 1.7 in a debootstrapped trixie root (roots.py) with gpugate's .deb.
RELEASES = {"bookworm": "1.6.", "trixie": "1.7."}


def boot_release(request: pytest.FixtureRequest, release: str, nvml: Path) -> SimHost:
    """A booted host of RELEASE with gpugate, containerd, runc and busybox-static installed."""
    if release == "bookworm":
        sim = SimHost.boot(nvml_lib=nvml, gpus=8)
        try:
            sim.install_gpugate(REPO)
            install_debs(sim, "containerd-cri", ["containerd", "runc", "busybox-static"])
        except BaseException:
            sim.poweroff()
            raise
        return sim
    reason = missing_tools()
    if reason is not None:
        pytest.skip(reason)
    deb: Path = request.getfixturevalue("built_deb")
    try:
        root = debian_root(release, extra=("busybox-static", "containerd", "runc"))
    except RootBuildError as err:
        pytest.skip(f"no {release} root with its containerd: {err}")
    sim = SimHost.boot(root=root, nvml_lib=nvml, gpus=8)
    try:
        sim.write_file(f"/var/cache/gpugate-deb/{deb.name}", deb.read_bytes())
        installed = sim.run(
            "cd /var/cache/gpugate-deb && apt-get install -y --no-install-recommends ./gpugate_*.deb",
            env={"DEBIAN_FRONTEND": "noninteractive"},
            timeout=300,
            check=False,
        )
        assert "Setting up gpugate" in installed.stdout, installed.stdout + installed.stderr
    except BaseException:
        sim.poweroff()
        raise
    return sim


@pytest.fixture(scope="module", params=sorted(RELEASES))
def node(request: pytest.FixtureRequest, fake_nvml_lib: Path | None) -> Iterator[Node]:
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    stubs()  # skips here, before any boot, where grpcio-tools is missing
    release: str = request.param
    sim = boot_release(request, release, fake_nvml_lib)
    cri: CriClient | None = None
    try:
        sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
        # Debian's /usr/bin/runc may be a link to /usr/sbin/runc, which stays the real one.
        sim.run("test -e /usr/sbin/runc || mv /usr/bin/runc /usr/sbin/runc; rm -f /usr/bin/runc")
        sim.write_file("/usr/bin/runc", RUNC_WRAPPER, mode=0o755)
        sim.write_file(NVIDIA, NVIDIA_STAND_IN, mode=0o755)
        sim.write_file(NVIDIA_HOOK, "#!/bin/sh\ncat >/dev/null\n", mode=0o755)
        cdi = ENABLE_CDI if release == "trixie" else ""
        sim.write_file(CONFIG, NODE_CONFIG.replace("%(cdi)s", cdi))
        sim.write_file("/etc/cdi/nvidia.json", CDI_SPEC)
        sim.run(
            f"mkdir -p {NODES} && for i in 0 1 2 3 4 5 6 7; do "
            f"mknod -m 0666 {NODES}/nvidia$i c 195 $i; done"
        )
        sim.write_file("/etc/gpugate/containers.toml", FAST)
        restart(sim)
        build_images(sim)
        said = sim.run("gpugate install --containers").stdout
        assert CONFIG in said, said
        cri = CriClient(f"/proc/{sim.pid1}/root/run/containerd/containerd.sock")
        restart(sim, cri)
        version = cri.version()
        assert version.runtime_version.startswith(RELEASES[release]), version
        yield Node(sim, cri, release)
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


def pod_label(pod: Pod, container_id: str, name: str = "server") -> str:
    """How gpugate names a pod's container: the lease's words, the prefix of its lines."""
    return f"containerd container {pod.namespace}/{pod.name}/{name} ({container_id[:12]})"


def refused_lines(details: str) -> list[str]:
    """gpugate's lines in a refused StartContainer's error: the hook's stderr, as runc quotes
    it after `stderr: `."""
    said = details.partition("stderr: ")[2]
    return [line for line in said.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("mode", "gpu"), [("envvar", 1), ("volume-mounts", 2), ("cdi-annotations", 4)]
)
def test_a_pod_s_gpu_is_gated_through_the_runtime_handler(node: Node, mode: str, gpu: int) -> None:
    """(a) the stale holder of the pod's GPU goes at its container's start, not before; (b) a
    second pod onto that GPU fails StartContainer (runc's create: with the runtime handler,
    CreateContainer makes no task) with gpugate's exit status and lines that name that pod,
    its journal's refusal names the first pod's scope; (c) the pod is namespace/pod/container
    in the journal's fields, in its lease and in `gpugate status` (text and --json); (d) its
    pause container went through gpugate's runtime and was not gated; (e) containerd
    restarted under the pod loses no lease: the lease is the same and still refuses a unit
    (gpugate pre in ExecStartPre) onto the GPU, killing nothing of the pod; (f) its teardown
    (StopContainer first, or StopPodSandbox at once) and RemovePodSandbox leave no lease."""
    sim = node.sim
    if mode == "volume-mounts":
        sim.write_file(NVIDIA_CONFIG, "accept-nvidia-visible-devices-as-volume-mounts = true\n")
    try:
        stale = node.stale_holder(gpu)
        cursor = node.cursor()
        pod = node.cri.pod("vllm-0", "ml")
        sandbox = node.cri.run_pod_sandbox(pod, "gpugate")
        assert node.calls(sandbox), "the pause container did not go through the runtime chain"
        assert node.alive(stale) and not node.leases(), "the pause container was gated"
        cid = node.cri.create_container(
            pod, "server", BUSYBOX, ["/bin/sh", "-c", hold([gpu])], **handed(mode, gpu, pod)
        )
        assert node.alive(stale), "CreateContainer makes no task: nothing may run yet"
        node.cri.start_container(cid)
        assert node.cri.container_state(cid) == "CONTAINER_RUNNING"
        assert not node.alive(stale), "the stale holder outlived the pod's start"
        # What runc ran: the bundle's spec, with NVIDIA's prestart hook added by its runtime.
        bundle = json.loads(node.sh(f"cat {TASKS}/{cid}/config.json"))
        hooks = [h["path"] for h in bundle["hooks"]["prestart"]]
        assert NVIDIA_HOOK in hooks, hooks
        # containerd 1.7's CDI put the GPU's node in; 1.6 has no CDI and passes the request on.
        devices = {(d["major"], d["minor"]) for d in bundle["linux"].get("devices", [])}
        cdi = mode == "cdi-annotations" and node.release == "trixie"
        assert ((195, gpu) in devices) == cdi, devices

        entries = node.gpugate_entries(cursor, cid)
        killed = [e for e in entries if e.get("GPUGATE_SIGNAL") == "SIGTERM"]
        assert [e["GPUGATE_PID"] for e in killed] == [str(stale)], killed
        named = {
            (
                e.get("GPUGATE_OCI_POD_NAMESPACE"),
                e.get("GPUGATE_OCI_POD"),
                e.get("GPUGATE_OCI_POD_CONTAINER"),
                e.get("GPUGATE_OCI_RUNTIME"),
            )
            for e in entries
        }
        assert named == {("ml", "vllm-0", "server", "containerd")}, named
        assert not node.gpugate_entries(cursor, sandbox), "gpugate spoke of the pause container"
        scope = f"cri-containerd-{cid}.scope"
        (lease,) = node.leases()
        assert lease["unit"] == scope and lease["gpus"] == [gpu], lease
        assert lease["container"] == pod_label(pod, cid), lease
        status = json.loads(node.sh("gpugate status --json"))
        assert [g["leased_to"] for g in status["gpus"] if g["index"] == gpu] == [[scope]], status
        assert f"({scope}: {pod_label(pod, cid)}, GPU {gpu})" in node.status_text().splitlines()
        pid = node.cri.container_pid(cid)
        node.claim_pid(pid, [gpu])

        # (b) A second pod given the same GPU: its sandbox runs, its container does not start.
        other = node.cri.pod("vllm-1", "ml")
        node.cri.run_pod_sandbox(other, "gpugate")
        second = node.cri.create_container(
            other, "server", BUSYBOX, ["/bin/sh", "-c", hold([gpu])], **handed(mode, gpu, other)
        )
        second_cursor = node.cursor()
        with pytest.raises(CriError) as refused:
            node.cri.start_container(second)
        details = refused.value.details
        assert f"exit status {int(ExitCode.HELD_BY_OTHERS)}" in details, details
        said = refused_lines(details)
        assert said and all(
            line.startswith(f"gpugate pre {pod_label(other, second)}: ") for line in said
        ), said
        assert pod_label(pod, cid) in details, "the refusal does not name the pod holding it"
        assert node.cri.container_state(second) != "CONTAINER_RUNNING"
        assert node.cri.container_state(cid) == "CONTAINER_RUNNING" and node.alive(pid)
        theirs = node.gpugate_entries(second_cursor, second)
        assert {
            (e["GPUGATE_OCI_POD_NAMESPACE"], e["GPUGATE_OCI_POD"], e["GPUGATE_OCI_POD_CONTAINER"])
            for e in theirs
        } == {("ml", "vllm-1", "server")}, theirs
        leased = [e for e in theirs if e.get("GPUGATE_REASON") == "leased"]
        assert [(e["GPUGATE_PHASE"], e["GPUGATE_LEASE_UNIT"]) for e in leased] == [("pre", scope)]
        assert not [e for e in theirs if e.get("GPUGATE_SIGNAL")], "the refused pod killed"
        node.teardown(other)
        assert node.leases() == [lease]

        # (e) containerd restarted under the pod: it runs on, and its lease stays and holds.
        restart(sim, node.cri)
        assert node.cri.container_state(cid) == "CONTAINER_RUNNING" and node.alive(pid)
        assert node.leases() == [lease], "containerd's restart lost or changed the lease"
        unit = f"tgi-{gpu}.service"
        sim.install_unit(unit, "[Service]\nExecStart=/bin/sleep 3600\n")
        node.sh(f"gpugate install {unit} --gpus {gpu}")
        unit_cursor = node.cursor()
        assert node.start_refused(unit) == int(ExitCode.HELD_BY_OTHERS)
        pre = [e for e in node.unit_entries(unit_cursor, unit) if e["GPUGATE_PHASE"] == "pre"]
        leased = [e for e in pre if e.get("GPUGATE_REASON") == "leased"]
        assert [(e["GPUGATE_GPU"], e["GPUGATE_LEASE_UNIT"]) for e in leased] == [
            (str(gpu), scope)
        ], pre
        assert not [e for e in pre if e.get("GPUGATE_SIGNAL")], "the refused unit killed"
        assert node.alive(pid) and node.leases() == [lease]

        if mode == "envvar":
            # The kubelet's order: StopContainer, StopPodSandbox, then (GC) the removals.
            node.cri.stop_container(cid, grace_s=30)
            wait_for("the lease given up", lambda: not node.leases(), timeout=HANG_GUARD_S)
            node.cri.remove_container(cid)
            node.teardown(pod)
        else:
            # The pod deleted at once: StopPodSandbox stops its running container.
            node.teardown(pod)
            wait_for("the lease given up", lambda: not node.leases(), timeout=HANG_GUARD_S)
        assert sandbox not in node.cri.sandboxes() and cid not in node.cri.containers()
        for folder in ("leases", "failed"):  # nor a failed-start record of the refused pod
            left = node.sh(f"ls -A /run/gpugate/{folder} 2>/dev/null || true").split()
            assert not left, f"/run/gpugate/{folder} outlived the pods: {left}"
        assert f"({scope}:" not in node.status_text()
        finished = [
            e for e in node.gpugate_entries(cursor, cid) if e.get("GPUGATE_EVENT") == "run_finished"
        ]
        assert sorted((e["GPUGATE_PHASE"], e["GPUGATE_RESULT"]) for e in finished) == [
            ("post", "success"),
            ("pre", "success"),
        ], finished
    finally:
        sim.run(f"rm -f {NVIDIA_CONFIG}")


def test_the_pause_container_is_never_gated_even_where_its_spec_names_a_gpu(node: Node) -> None:
    """A pod annotation the runtime passes through (`pod_annotations`, here a CDI request of
    GPU 3) lands in the pause container's spec too: the sandbox is still not gated (no
    kill, no lease, no word from gpugate), its container (which inherits it) is."""
    stale = node.stale_holder(3)
    cursor = node.cursor()
    request = {"cdi.k8s.io/gpu-pod": f"nvidia.com/gpu={uuid(3)}"}
    pod = node.cri.pod("annotated-0", "ml", annotations=request)
    sandbox = node.cri.run_pod_sandbox(pod, "gpugate")
    annotations = node.cri.sandbox_info(pod)["runtimeSpec"]["annotations"]
    assert annotations["cdi.k8s.io/gpu-pod"] == request["cdi.k8s.io/gpu-pod"], annotations
    assert annotations["io.kubernetes.cri.container-type"] == "sandbox", annotations
    assert node.calls(sandbox), "the pause container did not go through the runtime chain"
    assert node.alive(stale) and not node.leases()
    assert not node.gpugate_entries(cursor, sandbox)
    cid = node.cri.create_container(
        pod,
        "server",
        BUSYBOX,
        ["/bin/sh", "-c", hold([3])],
        mounts=[("/dev/nvidia3", "/dev/nvidia3")],
    )
    node.cri.start_container(cid)
    assert not node.alive(stale), "the pod's container was not gated on its annotation"
    (lease,) = node.leases()
    assert lease["gpus"] == [3] and "ml/annotated-0/server" in lease["container"], lease
    node.teardown(pod)
    wait_for("the lease given up", lambda: not node.leases(), timeout=HANG_GUARD_S)
