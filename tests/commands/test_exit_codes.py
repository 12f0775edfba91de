"""Exit codes: every label systemd prints for one is true, and each is documented."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpugate.errors import SYSEXITS_NAMES, ExitCode
from gpugate.front.cli import EPILOG, main

REPO = Path(__file__).resolve().parents[2]
# What each sysexits code gpugate uses means, and the gpugate outcome it stands for.
SAME_MEANING = {
    "SUCCESS": ExitCode.OK,
    "USAGE": ExitCode.USAGE,
    "UNAVAILABLE": ExitCode.NVML_UNAVAILABLE,
    "SOFTWARE": ExitCode.INTERNAL,
    "CANTCREAT": ExitCode.STATE_UNWRITABLE,
    "TEMPFAIL": ExitCode.LOCK_TIMEOUT,
    "NOPERM": ExitCode.PERMISSION,
    "CONFIG": ExitCode.CONFIG,
}


def systemd_names() -> dict[int, str]:
    """systemd's own table (`systemd-analyze exit-status`): code -> the name it prints."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze missing (apt: systemd)")
    out = subprocess.run(
        ["systemd-analyze", "exit-status"], capture_output=True, text=True, check=True
    ).stdout
    names: dict[int, str] = {}
    for line in out.splitlines()[1:]:
        name, status, _ = line.split()
        names[int(status)] = name
    return names


def test_every_label_systemd_prints_is_true() -> None:
    names = systemd_names()
    for code in ExitCode:
        label = names.get(int(code))
        if label is None:
            assert code.systemd_label == f"{int(code)}/n/a"
            continue
        assert SAME_MEANING.get(label) is code, f"systemd calls {int(code)} {label}: {code.name}"
        assert code.systemd_label == f"{int(code)}/{label}"
    assert {names[c] for c in SYSEXITS_NAMES} == set(SAME_MEANING)


def test_no_code_is_an_lsb_code_nor_systemds_own() -> None:
    for code in ExitCode:
        assert int(code) == 0 or not 1 <= code <= 7, code  # LSB: NOTRUNNING, NOTCONFIGURED...
        assert not 200 <= code <= 255, code  # systemd's own (EXEC, CHDIR, ...)
    assert len({int(c) for c in ExitCode}) == len(ExitCode)


def test_every_code_is_in_help_readme_and_meanings() -> None:
    readme = (REPO / "README.md").read_text()
    for code in ExitCode:
        assert f"{int(code)} {code.meaning}" in " ".join(EPILOG.split())
        row = f"| {int(code)} | {code.name} | `status={code.systemd_label}` |"
        assert row in readme, row


@pytest.mark.parametrize(
    "argv",
    [["install"], ["uninstall"], ["install", "vllm.service", "--containers"]],
)
def test_install_needs_a_unit_or_containers(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """UNIT is optional in the parser since --containers; neither or both is still exit 64."""
    assert main(argv) == ExitCode.USAGE == 64
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["explode"],
        [],
        ["pre", "--bogus"],
        ["config"],
        ["slurm"],
        ["slurm", "prolog", "--nope"],
        ["install", "--bogus"],
        ["install", "vllm.service", "--gpus", "0,,1"],
        ["status", "--json", "extra", "words"],
    ],
)
def test_bad_command_lines_exit_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == ExitCode.USAGE == 64
    assert capsys.readouterr().err  # argparse's usage on stderr
