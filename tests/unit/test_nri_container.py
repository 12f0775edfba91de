"""An NRI container as the OCI hook's state and spec (integrations/nri_container.py): the GPUs it
reaches by the hook's rules, its cgroup from its cgroups path, its pod named from NRI's own
fields over what the pod wrote, the pod's sandbox told apart."""

from __future__ import annotations

import pytest

from gpugate.errors import BadInput
from gpugate.host.oci import Toolkit
from gpugate.host.scan import ProcFs
from gpugate.integrations.container import identify, pod_name, runtime_name
from gpugate.integrations.nri_container import is_pod_sandbox, oci_view
from tests.nri_runtime import container, pod

A_ID = "a" * 64
UUID = "GPU-fa4e5a11-0000-0000-0000-000000000001"
DEFAULTS = Toolkit()


def test_a_device_node_of_major_195_is_its_gpu() -> None:
    _, spec = oci_view(pod(), container(A_ID, devices=[(195, 3), (195, 255), (1, 3)]),
                       nvidia_runtime=False, toolkit=DEFAULTS)  # fmt: skip
    assert spec.gpus.minors == (3,)


@pytest.mark.parametrize("nvidia", [True, False])
def test_nvidia_visible_devices_counts_only_where_nvidia_s_runtime_adds_its_hook(
    nvidia: bool,
) -> None:
    made = container(A_ID, env=[f"NVIDIA_VISIBLE_DEVICES={UUID}", "PATH=/bin"])
    _, spec = oci_view(pod(), made, nvidia_runtime=nvidia, toolkit=DEFAULTS)
    assert spec.gpus.refs == ((UUID,) if nvidia else ())


def test_the_volume_mounts_list_counts_where_nvidia_s_config_accepts_it() -> None:
    made = container(
        A_ID,
        env=["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"],
        mounts=[("/dev/null", f"/var/run/nvidia-container-devices/{UUID}")],
    )
    toolkit = Toolkit(volume_mounts=True)
    _, spec = oci_view(pod(), made, nvidia_runtime=True, toolkit=toolkit)
    assert spec.gpus.refs == (UUID,)


def test_a_cdi_annotation_names_its_gpu() -> None:
    made = container(A_ID, annotations={"cdi.k8s.io/gpu": f"nvidia.com/gpu={UUID}"})
    _, spec = oci_view(pod(), made, nvidia_runtime=False, toolkit=DEFAULTS)
    assert spec.gpus.refs == (UUID,)


def test_an_unresolvable_request_is_bad_input_before_and_kept_after_the_stop() -> None:
    made = container(A_ID, env=["NVIDIA_VISIBLE_DEVICES=ALL"])  # NVIDIA fails on it too
    with pytest.raises(BadInput):
        oci_view(pod(), made, nvidia_runtime=True, toolkit=DEFAULTS)
    _, spec = oci_view(pod(), made, nvidia_runtime=True, toolkit=DEFAULTS, lenient=True)
    assert spec.gpus.unresolved is not None and spec.gpus


def test_the_pod_is_named_from_nri_s_fields_over_the_pod_s_own_annotations() -> None:
    lying = {
        "io.kubernetes.cri.sandbox-namespace": "kube-system",
        "io.kubernetes.cri.sandbox-name": "other",
        "io.kubernetes.cri.container-name": "other",
    }
    made = container(A_ID, devices=[(195, 1)], annotations=lying)
    state, spec = oci_view(pod("vllm-0", "ml"), made, nvidia_runtime=False, toolkit=DEFAULTS)
    annotations = {**spec.annotations, **state.annotations}  # as identify merges them
    found = pod_name(annotations)
    assert found is not None and found.text == "ml/vllm-0/server"
    assert runtime_name(annotations, "containerd") == "vllm-0/server"
    assert runtime_name(annotations, "cri-o") == "vllm-0/server"


def test_before_its_start_its_cgroup_is_its_spec_s_scope(tmp_path: object) -> None:
    """No process yet (pid 0): identify takes the cgroups path, kubelet's systemd driver's."""
    state, spec = oci_view(pod(), container(A_ID, devices=[(195, 1)]),
                           nvidia_runtime=False, toolkit=DEFAULTS)  # fmt: skip
    assert state.pid == 0
    identity = identify(state, spec, ProcFs(f"{tmp_path}/proc"))
    assert identity.unit == f"cri-containerd-{A_ID}.scope"
    assert identity.runtime == "containerd" and identity.pod is not None
    assert identity.pod.text == "ml/vllm-0/server"


def test_a_container_without_a_cgroup_of_its_own_is_refused(tmp_path: object) -> None:
    state, spec = oci_view(pod(), container(A_ID, devices=[(195, 1)], cgroups_path=""),
                           nvidia_runtime=False, toolkit=DEFAULTS)  # fmt: skip
    with pytest.raises(BadInput):
        identify(state, spec, ProcFs(f"{tmp_path}/proc"))


def test_the_pod_s_own_container_is_its_sandbox() -> None:
    assert is_pod_sandbox(pod(), container("f" * 64))
    assert not is_pod_sandbox(pod(), container(A_ID))


@pytest.mark.parametrize("bad", ["", "../x", "a" * 200, "a b"])
def test_an_id_that_is_no_container_id_is_bad_input(bad: str) -> None:
    with pytest.raises(BadInput):
        oci_view(pod(), container(bad), nvidia_runtime=False, toolkit=DEFAULTS)
