"""`scripts/simhost shell`: a person's way into the simulated host, with the Debian package
installed as an operator would (man page, journal catalog, completion), powered off after."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from sandbox import REPO, STATE_ROOT

from gpugate.report.journal import Event

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

SCRIPT = REPO / "scripts" / "simhost"
COMMANDS = """\
pwd
gpugate --version
dpkg-query -W -f='${Status}\\n' gpugate
man -P cat gpugate 2>/dev/null | grep -c 'EXIT STATUS'
journalctl --list-catalog 2>/dev/null | grep -c 'gpugate'
complete -p gpugate
systemctl cat vllm.service | grep -c 'gpugate pre %n'
gpugate status | grep -c protected
exit 7
"""


def test_shell_has_the_package_and_powers_off() -> None:
    for tool in ("dpkg-deb", "dpkg-shlibdeps", "gcc"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} missing: packaging/build-deb cannot run (scripts/setup)")
    before = set(STATE_ROOT.glob("*")) if STATE_ROOT.exists() else set()
    result = subprocess.run(
        ["bash", str(SCRIPT), "shell"],
        input=COMMANDS,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 7, result.stdout + result.stderr  # the shell's own status
    assert lines == [
        "/root",
        "gpugate 0.1.0",
        "install ok installed",
        "1",
        str(len(Event)),  # one catalog entry per event
        "complete -F _gpugate gpugate",
        "1",  # the drop-in `gpugate install vllm` wrote
        "1",  # nvidia-persistenced, protected
    ], result.stdout + result.stderr
    after = set(STATE_ROOT.glob("*")) if STATE_ROOT.exists() else set()
    assert after <= before, f"the simulated host was not powered off: {after - before}"
