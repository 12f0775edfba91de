"""`gpugate nri` with Debian 13's real containerd 1.7.24 (its NRI is containerd/nri v0.6.1), in
a trixie root inside a simulated host, driven over its CRI socket as the kubelet drives it
(cri.py). NRI is on in config.toml (`[plugins."io.containerd.nri.v1.nri"] disable = false`),
no gpugate runtime handler is installed and gpugate writes nothing of containerd's config:
the plugin runs as a service of its own, registers over NRI's socket, and gates containers at
CreateContainer. The node is test_cri_containerd.py's (NVIDIA's legacy runtime as the
stand-in default, its runc wrapper, the locally built images)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from cri import CriClient, CriError, stubs
from realparts import wait_for
from test_cri_containerd import (
    BUSYBOX,
    CDI_SPEC,
    CONFIG,
    ENABLE_CDI,
    HANG_GUARD_S,
    NODE_CONFIG,
    NODES,
    NVIDIA,
    NVIDIA_STAND_IN,
    PAUSE_CMD,
    RUNC_WRAPPER,
    Node,
    boot_release,
    build_images,
    handed,
    restart,
    uuid,
)
from test_real_containers import hold
from test_real_oci_hooks import FAST, NVIDIA_HOOK

from gpugate.errors import ExitCode

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

NRI_ON = """
  [plugins."io.containerd.nri.v1.nri"]
    disable = false
    disable_connections = false
    socket_path = "/var/run/nri/nri.sock"
    plugin_registration_timeout = "5s"
    plugin_request_timeout = "%s"
"""
# Longer than a pre with a stale holder takes here ([pre].wait_timeout_s is FAST's 30 s,
# sigterm_grace_s 1 s): docs/containers.md, "NRI", says how to size it.
REQUEST_TIMEOUT = "35s"


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest, fake_nvml_lib: Path | None) -> Iterator[Node]:
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    stubs()
    sim = boot_release(request, "trixie", fake_nvml_lib)
    cri: CriClient | None = None
    try:
        sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
        sim.run("test -e /usr/sbin/runc || mv /usr/bin/runc /usr/sbin/runc; rm -f /usr/bin/runc")
        sim.write_file("/usr/bin/runc", RUNC_WRAPPER, mode=0o755)
        sim.write_file(NVIDIA, NVIDIA_STAND_IN, mode=0o755)
        sim.write_file(NVIDIA_HOOK, "#!/bin/sh\ncat >/dev/null\n", mode=0o755)
        config = NODE_CONFIG.replace("%(cdi)s", ENABLE_CDI) + NRI_ON % REQUEST_TIMEOUT
        sim.write_file(CONFIG, config)
        sim.write_file("/etc/cdi/nvidia.json", CDI_SPEC)
        sim.run(
            f"mkdir -p {NODES} && for i in 0 1 2 3 4 5 6 7; do "
            f"mknod -m 0666 {NODES}/nvidia$i c 195 $i; done"
        )
        sim.write_file("/etc/gpugate/containers.toml", FAST)
        restart(sim)
        build_images(sim)
        cri = CriClient(f"/proc/{sim.pid1}/root/run/containerd/containerd.sock")
        cri.wait_ready()
        said = sim.run("gpugate install --nri").stdout
        assert "enabled gpugate-nri.service" in said, said
        assert sim.systemctl("is-active", "gpugate-nri.service", check=False).returncode == 0
        wait_for(
            "containerd saying the plugin connected",
            lambda: "99-gpugate" in sim.run("journalctl --no-pager -u containerd").stdout,
            timeout=HANG_GUARD_S,
        )
        yield Node(sim, cri, "trixie")
    finally:
        if cri is not None:
            cri.close()
        sim.poweroff()


def test_a_pod_s_gpu_is_gated_by_the_nri_plugin_at_create_container(node: Node) -> None:
    """Issue 49's "Done when" under the plugin, through the CRI: (a) the stale holder of the
    pod's GPU goes at its CreateContainer; (b) its pause sandbox is not gated; (c) the pod is
    namespace/pod/container in its runs' journal fields, its lease and `gpugate status`; (d) a
    second pod's CreateContainer fails with gpugate's line naming the first, and a unit on that
    GPU is refused while the pod runs, its journal message naming the pod; (e) a containerd restart in the middle
    keeps the lease, and the plugin connects again; (f) StopPodSandbox then RemovePodSandbox
    leave no lease; (g) containerd's config.toml is byte for byte what it was."""
    sim = node.sim
    before = hashlib.sha256(sim.run(f"cat {CONFIG}").stdout.encode()).hexdigest()
    gpu = 1
    stale = node.stale_holder(gpu)
    cursor = node.cursor()
    pod = node.cri.pod("vllm-0", "ml")
    sandbox = node.cri.run_pod_sandbox(pod, "")
    assert node.alive(stale) and not node.leases(), "the pause container was gated"
    cid = node.cri.create_container(
        pod, "server", BUSYBOX, ["/bin/sh", "-c", hold([gpu])], **handed("envvar", gpu, pod)
    )
    assert not node.alive(stale), "the stale holder outlived the pod's CreateContainer"
    (lease,) = node.leases()
    assert "ml/vllm-0/server" in lease["container"] and cid[:12] in lease["container"], lease
    assert lease["unit"] == f"cri-containerd-{cid}.scope" and lease["gpus"] == [gpu], lease
    assert "ml/vllm-0/server" in node.sh("gpugate status")
    node.cri.start_container(cid)
    assert node.cri.container_state(cid) == "CONTAINER_RUNNING"
    node.claim_pid(node.cri.container_pid(cid), [gpu])

    entries = node.gpugate_entries(cursor, cid)
    killed = [e for e in entries if e.get("GPUGATE_SIGNAL") == "SIGTERM"]
    assert [e["GPUGATE_PID"] for e in killed] == [str(stale)], killed
    named = {
        (
            e.get("GPUGATE_OCI_POD_NAMESPACE"),
            e.get("GPUGATE_OCI_POD"),
            e.get("GPUGATE_OCI_POD_CONTAINER"),
        )
        for e in entries
    }
    assert named == {("ml", "vllm-0", "server")}, named
    assert not node.gpugate_entries(cursor, sandbox), "gpugate spoke of the pause container"

    other = node.cri.pod("vllm-1", "ml")
    node.cri.run_pod_sandbox(other, "")
    with pytest.raises(CriError) as refused:
        node.cri.create_container(
            other, "server", BUSYBOX, PAUSE_CMD, **handed("envvar", gpu, other)
        )
    # containerd's words, then gpugate's one line: it names the refused pod and the holder's
    said = refused.value.details
    assert "desc = gpugate pre containerd container ml/vllm-1/server (" in said, said
    assert "ml/vllm-0/server" in refused.value.details, refused.value.details
    assert f"exit status {int(ExitCode.HELD_BY_OTHERS)}" in refused.value.details
    node.teardown(other)
    assert [entry["unit"] for entry in node.leases()] == [lease["unit"]]

    sim.install_unit("tgi.service", "[Service]\nExecStart=/bin/sleep 3600\n")
    node.sh(f"gpugate install tgi.service --gpus {gpu}")
    assert sim.systemctl("start", "tgi.service", check=False).returncode != 0
    said = node.sh("journalctl --no-pager -o cat -u tgi.service | tail -20")
    assert "ml/vllm-0/server" in said, said
    sim.systemctl("reset-failed", "tgi.service", check=False)

    restarted = node.cursor()
    restart(sim, node.cri)
    wait_for(
        "the plugin connected to the restarted containerd",
        lambda: (
            "99-gpugate"
            in node.sh(f"journalctl --no-pager --after-cursor='{restarted}' -u containerd")
        ),
        timeout=HANG_GUARD_S,
    )
    assert node.cri.container_state(cid) == "CONTAINER_RUNNING"
    assert [entry["unit"] for entry in node.leases()] == [lease["unit"]]

    node.teardown(pod)
    wait_for("the lease given up", lambda: not node.leases(), timeout=HANG_GUARD_S)
    assert sandbox not in node.cri.sandboxes() and cid not in node.cri.containers()
    finished = [
        e for e in node.gpugate_entries(cursor, cid) if e.get("GPUGATE_EVENT") == "run_finished"
    ]
    assert sorted((e["GPUGATE_PHASE"], e["GPUGATE_RESULT"]) for e in finished) == [
        ("post", "success"),
        ("pre", "success"),
    ], finished
    after = hashlib.sha256(sim.run(f"cat {CONFIG}").stdout.encode()).hexdigest()
    assert after == before, "gpugate changed containerd's config"


def test_the_pause_sandbox_is_never_gated_even_where_its_spec_names_a_gpu(node: Node) -> None:
    """A pod annotation the runtime passes through (a CDI request of GPU 3) lands in the pause
    container's spec too: NRI's RunPodSandbox is not gated (no kill, no lease, no word from
    gpugate); the pod's container, which inherits it, is gated at CreateContainer."""
    stale = node.stale_holder(3)
    cursor = node.cursor()
    request = {"cdi.k8s.io/gpu-pod": f"nvidia.com/gpu={uuid(3)}"}
    pod = node.cri.pod("annotated-0", "ml", annotations=request)
    sandbox = node.cri.run_pod_sandbox(pod, "")
    annotations = node.cri.sandbox_info(pod)["runtimeSpec"]["annotations"]
    assert annotations["cdi.k8s.io/gpu-pod"] == request["cdi.k8s.io/gpu-pod"], annotations
    assert node.alive(stale) and not node.leases()
    assert not node.gpugate_entries(cursor, sandbox)
    cid = node.cri.create_container(
        pod,
        "server",
        BUSYBOX,
        ["/bin/sh", "-c", hold([3])],
        mounts=[("/dev/nvidia3", "/dev/nvidia3")],
    )
    assert not node.alive(stale), "the pod's container was not gated on its annotation"
    (lease,) = node.leases()
    assert lease["gpus"] == [3] and "ml/annotated-0/server" in lease["container"], lease
    node.teardown(pod)
    wait_for("the lease given up", lambda: not node.leases(), timeout=HANG_GUARD_S)
    assert not node.gpugate_entries(cursor, sandbox) and cid not in node.cri.containers()


def test_under_nri_s_default_bound_a_pod_is_created_at_once_or_at_the_next_try(
    node: Node,
) -> None:
    """containerd restarted with NRI's default plugin_request_timeout (2 s): the plugin
    connects again by itself; a pod whose GPU has a stale holder (one that ends on SIGTERM) is
    created at CreateContainer, or refused for now (exit 27, the pre ended at the bound) and
    created at the kubelet's next try; either way the holder is gone and the pod leases its
    GPU. What the pre took is printed (docs/containers.md cites it), never asserted."""
    sim = node.sim
    cursor = node.cursor()
    config = NODE_CONFIG.replace("%(cdi)s", ENABLE_CDI) + NRI_ON % "2s"
    sim.write_file(CONFIG, config)
    restart(sim, node.cri)
    after = f"--after-cursor={cursor}"
    wait_for(
        "the plugin connected to the restarted containerd",
        lambda: (
            "99-gpugate" in sim.run(["journalctl", "--no-pager", after, "-u", "containerd"]).stdout
        ),
        timeout=HANG_GUARD_S,
    )
    gpu = 5
    stale = node.stale_holder(gpu)
    pod = node.cri.pod("bounded-0", "ml")
    node.cri.run_pod_sandbox(pod, "")
    refusals = []
    for _ in range(5):  # the kubelet's tries
        try:
            cid = node.cri.create_container(
                pod, "server", BUSYBOX, ["/bin/sh", "-c", hold([gpu])], **handed("envvar", gpu, pod)
            )
            break
        except CriError as refused:
            assert f"exit status {int(ExitCode.INTERRUPTED)}" in refused.details, refused.details
            refusals.append(refused.details)
    else:
        raise AssertionError(f"not created in 5 tries: {refusals}")
    assert not node.alive(stale)
    (lease,) = node.leases()
    assert lease["unit"] == f"cri-containerd-{cid}.scope", lease
    runs = node.entries(cursor, "SYSLOG_IDENTIFIER=gpugate", "GPUGATE_PHASE=pre")
    started = [
        int(e["__REALTIME_TIMESTAMP"]) for e in runs if e.get("GPUGATE_EVENT") == "run_started"
    ]
    ended = [
        int(e["__REALTIME_TIMESTAMP"]) for e in runs if e.get("GPUGATE_EVENT") == "run_finished"
    ]
    print(f"\nNRI pre under 2 s: {len(refusals)} refusal(s); runs (ms):",
          [round((b - a) / 1000) for a, b in zip(started, ended)])  # fmt: skip
    node.teardown(pod)
    wait_for("the lease given up", lambda: not node.leases(), timeout=HANG_GUARD_S)
