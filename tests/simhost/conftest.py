"""Fixtures for the simulated GPU host (see sandbox.py and README.md here).

``simhost``: one sandbox for the whole session (8 GPUs, the stand-in libnvidia-ml.so.1 when
tests/fake_nvml/build.py exists), always powered off at the end.
``simhost_factory``: boots extra sandboxes for one test (``simhost_factory(gpus=2, ...)``,
same arguments as SimHost.boot) and powers them all off after it.
``host_tmp_marker``: a file put in the host's real /tmp before the session sandbox boots.
``built_deb``: the .deb packaging/build-deb builds from this checkout, once per session.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from sandbox import REPO, SimHost, preflight  # noqa: E402

BUILD_DEB = REPO / "packaging" / "build-deb"
FAKE_NVML_BUILD = HERE.parent / "fake_nvml" / "build.py"
FAKE_NVML_OUT = REPO / ".simhost" / "fake-nvml"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "simhost: end-to-end tests on the simulated GPU host (root, real systemd in namespaces)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.simhost)


def _skip_unless_possible() -> None:
    reason = preflight()
    if reason is not None:
        pytest.skip(f"simhost sandbox unavailable: {reason}")


def build_fake_nvml_lib() -> Path | None:
    """tests/fake_nvml/build.py's build_fake_nvml(), imported by path; None if absent."""
    if not FAKE_NVML_BUILD.is_file():
        return None
    spec = importlib.util.spec_from_file_location("simhost_fake_nvml_build", FAKE_NVML_BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Path(module.build_fake_nvml(FAKE_NVML_OUT))


@pytest.fixture(scope="session")
def host_tmp_marker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A file in the host's real /tmp, created before the session sandbox boots."""
    marker = Path("/tmp") / f"gpugate-simhost-marker-{tmp_path_factory.getbasetemp().name}"
    marker.write_text("the host's /tmp must survive the sandbox\n")
    try:
        yield marker
    finally:
        marker.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def fake_nvml_lib() -> Path | None:
    _skip_unless_possible()
    return build_fake_nvml_lib()


@pytest.fixture(scope="session")
def simhost(host_tmp_marker: Path, fake_nvml_lib: Path | None) -> Iterator[SimHost]:
    _skip_unless_possible()
    host = SimHost.boot(nvml_lib=fake_nvml_lib, gpus=8)  # cleans up after itself on failure
    atexit.register(host.poweroff)  # last resort; poweroff() is idempotent
    try:
        yield host
    finally:
        host.poweroff()


@pytest.fixture
def simhost_factory() -> Iterator[Callable[..., SimHost]]:
    _skip_unless_possible()
    hosts: list[SimHost] = []

    def boot(**kwargs: Any) -> SimHost:
        host = SimHost.boot(**kwargs)
        hosts.append(host)
        atexit.register(host.poweroff)
        return host

    try:
        yield boot
    finally:
        errors = []
        for host in hosts:
            try:
                host.poweroff()
            except Exception as err:  # noqa: BLE001 - power off the others, then report
                errors.append(err)
        if errors:
            raise errors[0]


def missing_build_tools() -> str | None:
    """Why packaging/build-deb cannot pack here, or None."""
    for tool in ("dpkg-deb", "dpkg-shlibdeps"):
        if shutil.which(tool) is None:
            return f"{tool} not found (scripts/setup installs dpkg-dev)"
    return None


@pytest.fixture(scope="session")
def built_deb(tmp_path_factory: pytest.TempPathFactory, staged_tree: Path) -> Path:
    reason = missing_build_tools()
    if reason:
        pytest.skip(reason)
    dist = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        ["bash", str(BUILD_DEB)],
        capture_output=True,
        text=True,
        env={**os.environ, "DIST": str(dist), "STAGED": str(staged_tree)},
        timeout=1800,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = dist.glob("gpugate_*_amd64.deb")
    assert result.stdout.strip() == str(built)
    return built
