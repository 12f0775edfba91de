"""The shipped units (units/): `systemd-analyze verify` passes on each, with gpugate's drop-in.

verify also checks that every Exec*= binary exists and is executable. This machine has neither
vLLM at /opt/vllm/bin/vllm nor gpugate at /usr/bin/gpugate, so the copies verified here point
those two paths at stand-in executables; nothing else in the files is changed. The packaging
test (tests/simhost/test_packaging.py) verifies them unchanged where the .deb is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpugate.front.install import DEFAULT_GPUGATE, render_dropin

UNITS = Path(__file__).resolve().parents[1] / "units"
VLLM = "/opt/vllm/bin/vllm"
SERVICES = sorted(p.name for p in UNITS.glob("*.service"))


def test_shipped_dropin_is_what_install_writes() -> None:
    assert (UNITS / "gpugate.conf").read_text() == render_dropin(DEFAULT_GPUGATE)


def test_every_unit_line_is_commented() -> None:
    """Each directive (or run of related directives) has a comment above it saying why."""
    for path in [UNITS / "gpugate.conf", *(UNITS / name for name in SERVICES)]:
        commented = False
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                commented = True
            elif not line.strip() or line.startswith("["):
                commented = False
            else:
                assert commented, f"{path.name}: {line!r} has no comment above it"


def stage(tmp_path: Path) -> Path:
    """units/ laid out as in /etc/systemd/system, each service with the drop-in."""
    stand_in = tmp_path / "bin" / "stand-in"
    stand_in.parent.mkdir()
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    directory = tmp_path / "system"
    directory.mkdir()
    for name in [*SERVICES, "gpugate.conf"]:
        text = (UNITS / name).read_text()
        text = text.replace(str(DEFAULT_GPUGATE), str(stand_in)).replace(VLLM, str(stand_in))
        if name == "gpugate.conf":
            for service in SERVICES:
                (directory / f"{service}.d").mkdir()
                (directory / f"{service}.d" / name).write_text(text)
        else:
            (directory / name).write_text(text)
    return directory


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
@pytest.mark.parametrize("service", SERVICES)
def test_systemd_analyze_verify(service: str, tmp_path: Path) -> None:
    directory = stage(tmp_path)
    # A template is verified through an instance; its unit file comes from the same folder.
    name = service.replace("@.", "@a.")
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(directory / name)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # verify warns on stderr and still exits 0


def test_verify_reads_the_dropin(tmp_path: Path) -> None:
    """Proof the drop-in is part of what verify checks: a broken line in it fails."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze missing")
    directory = stage(tmp_path)
    dropin = directory / "vllm.service.d" / "gpugate.conf"
    dropin.write_text(dropin.read_text().replace("+/", "+/nowhere/"))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(directory / "vllm.service")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "/nowhere/" in result.stderr
