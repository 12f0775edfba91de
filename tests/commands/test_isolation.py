"""Rule 6 (docs/hardening.md): interpreter and libraries from fixed places. The hook command
(front/install.py) runs Python isolated, so a unit's PYTHONPATH imports nothing into root's
hook; NVML is loaded by the driver's own path, never through LD_LIBRARY_PATH; a stand-in is
given by the hidden --nvml-library, never by the environment."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpugate.errors import NvmlUnavailable
from gpugate.front.install import command_for, gpugate_command, render_dropin
from gpugate.host.nvml import find_nvml_library, load_nvml_library
from tests.fake_nvml.build import BuildError, build_fake_nvml

OTHER = 65534
MARK = "steered"


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_fake_nvml(tmp_path_factory.mktemp("nvml"))
    except BuildError as exc:
        pytest.skip(f"cannot build the stand-in NVML: {exc}")


def script(path: Path, first_line: str) -> Path:
    path.write_text(f"{first_line}\nimport sys\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(
    ("first_line", "isolating"),
    [
        ("#!/usr/bin/python3 -I", True),
        ("#!/usr/bin/python3 -sI", True),
        ("#!/usr/bin/python3 -IS", True),
        ("#!/opt/venv/bin/python", False),
        ("#!/opt/venv/bin/python3 -s", False),
        ("#!/usr/bin/env python3", False),
        ("import sys", False),
        ("#!/usr/bin/python3 --isolated-please", False),
    ],
)
def test_the_command_is_the_launcher_only_where_it_isolates(
    tmp_path: Path, first_line: str, isolating: bool
) -> None:
    launcher = script(tmp_path / "gpugate", first_line)
    command = gpugate_command(str(launcher), "/opt/venv/bin/python")
    if isolating:
        assert command == (str(launcher),)
    else:
        assert command == ("/opt/venv/bin/python", "-I", "-m", "gpugate")


def test_the_command_is_this_very_gpugate_whatever_path_says(tmp_path: Path) -> None:
    """As `gpugate run` and `install` call it: the interpreter this process runs on (a venv
    that is not on PATH), never /usr/bin/gpugate found or not found on PATH."""
    command = gpugate_command()
    assert command[0] in {sys.executable, os.path.abspath(sys.argv[0])}
    assert "-I" in command or command == (os.path.abspath(sys.argv[0]),)
    assert gpugate_command("/nonexistent/gpugate", "") == ("/usr/bin/gpugate",)


def test_an_operators_console_script_is_run_isolated(tmp_path: Path) -> None:
    pip_script = script(tmp_path / "pip-gpugate", "#!/opt/venv/bin/python3")
    assert command_for(str(pip_script)) == ("/opt/venv/bin/python3", "-I", str(pip_script))
    packaged = script(tmp_path / "pkg-gpugate", "#!/usr/bin/python3 -I")
    assert command_for(str(packaged)) == (str(packaged),)
    assert command_for("/usr/local/bin/gpugate-binary") == ("/usr/local/bin/gpugate-binary",)


def test_the_dropin_carries_the_isolated_command() -> None:
    text = render_dropin(("/opt/venv/bin/python", "-I", "-m", "gpugate"))
    assert "ExecStartPre=+/opt/venv/bin/python -I -m gpugate pre %n" in text
    assert "ExecStopPost=+/opt/venv/bin/python -I -m gpugate post %n" in text


def steering_tree(tmp_path: Path) -> Path:
    """A folder a unit's PYTHONPATH names: its own gpugate package and sitecustomize, each
    leaving a mark when imported."""
    evil = tmp_path / "evil"
    (evil / "gpugate").mkdir(parents=True)
    marker = tmp_path / MARK
    code = f"open({str(marker)!r}, 'w').write('imported')\n"
    (evil / "gpugate" / "__init__.py").write_text(code)
    (evil / "gpugate" / "__main__.py").write_text(code)
    (evil / "sitecustomize.py").write_text(code)
    (evil / "usercustomize.py").write_text(code)
    return evil


def test_the_hook_command_imports_nothing_from_the_units_environment(tmp_path: Path) -> None:
    evil = steering_tree(tmp_path)
    env = {
        **os.environ,
        "PYTHONPATH": str(evil),
        "PYTHONSTARTUP": str(evil / "sitecustomize.py"),
        "PYTHONHOME": os.environ.get("PYTHONHOME", sys.base_prefix),
        "LD_LIBRARY_PATH": str(evil),
    }
    marker = tmp_path / MARK
    # Without -I (a console script's shebang), the unit's PYTHONPATH wins: the test can fail.
    plain = subprocess.run(
        [sys.executable, "-m", "gpugate", "--version"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert marker.exists(), plain.stderr
    marker.unlink()
    isolated = subprocess.run(
        [*gpugate_command(sys.argv[0], sys.executable), "--version"],
        capture_output=True,
        text=True,
        env=env,
        cwd=evil,  # not even the current folder is on the path
        timeout=60,
        check=False,
    )
    assert isolated.returncode == 0, isolated.stderr
    assert isolated.stdout.startswith("gpugate ")
    assert not marker.exists()


def test_nvml_is_found_in_fixed_folders_only_where_root_owns_it(
    tmp_path: Path, fake_lib: Path
) -> None:
    good = tmp_path / "lib"
    good.mkdir()
    (good / "libnvidia-ml.so.1").write_bytes(fake_lib.read_bytes())
    assert find_nvml_library((str(good),)) == str(good / "libnvidia-ml.so.1")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        (theirs / "libnvidia-ml.so.1").write_bytes(fake_lib.read_bytes())
        os.chown(theirs / "libnvidia-ml.so.1", OTHER, -1)
        assert find_nvml_library((str(theirs), str(good))) == str(good / "libnvidia-ml.so.1")


def test_nvml_is_loaded_by_its_path_into_pynvmls_handle(fake_lib: Path) -> None:
    nv = SimpleNamespace(libLoadLock=threading.Lock(), nvmlLib=None)
    load_nvml_library(nv, str(fake_lib))
    assert nv.nvmlLib is not None and nv.nvmlLib._name == str(fake_lib)
    with pytest.raises(NvmlUnavailable):
        load_nvml_library(SimpleNamespace(libLoadLock=threading.Lock(), nvmlLib=None), "/x/none")


def test_ld_library_path_does_not_choose_nvml(tmp_path: Path, fake_lib: Path) -> None:
    """The stand-in in LD_LIBRARY_PATH (where a bare-name dlopen would find it) is not what
    gpugate loads: here, with no driver installed, NVML is not found; with the stand-in by
    its path (--nvml-library), it is."""
    if find_nvml_library() is not None:
        pytest.skip("this machine has a driver's libnvidia-ml.so.1: it would be loaded")
    code = (
        "import sys\nfrom gpugate.host.nvml import NvmlDriver\n"
        "d = NvmlDriver(library=sys.argv[1] or None)\n"
        "try:\n    d.gpus()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "print(open('/proc/self/maps').read().count('libnvidia-ml'))\n"
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_lib.parent)}
    env["FAKE_NVML_CONFIG"] = str(tmp_path / "none.conf")
    by_env = subprocess.run(
        [sys.executable, "-c", code, ""], capture_output=True, text=True, env=env, timeout=60
    )
    assert by_env.stdout.startswith("NvmlUnavailable "), by_env.stderr  # not the planted one
    assert by_env.stdout.splitlines()[-1] == "0"
    by_path = subprocess.run(
        [sys.executable, "-c", code, str(fake_lib)],
        capture_output=True,
        text=True,
        env={**env, "LD_LIBRARY_PATH": ""},
        timeout=60,
    )
    assert by_path.stdout.splitlines()[-1] != "0", by_path.stdout + by_path.stderr


@pytest.mark.message
def test_install_warns_about_a_units_steering_environment(tmp_path: Path) -> None:
    from gpugate.integrations.env_files import unit_environment_warnings

    env_file = tmp_path / "vllm.env"
    env_file.write_text("LD_LIBRARY_PATH=/usr/local/cuda/lib64\nHF_HOME=/srv/hf\n")
    env_file.chmod(0o644)
    shown = (
        'Environment="PYTHONPATH=/opt/vllm/lib" LD_PRELOAD=/opt/x.so CUDA_VISIBLE_DEVICES=0 '
        "PYTHONSTARTUP=/srv/s.py\n"
        f"EnvironmentFiles={env_file} (ignore_errors=no)\n"
    )
    lines = unit_environment_warnings("vllm.service", lambda unit: shown)
    named = {line.split(" sets ")[1].split(":")[0]: line for line in lines if " sets " in line}
    assert set(named) == {"PYTHONPATH", "LD_PRELOAD", "PYTHONSTARTUP", "LD_LIBRARY_PATH"}
    assert f"EnvironmentFile={env_file} sets LD_LIBRARY_PATH" in named["LD_LIBRARY_PATH"]
    assert "Environment= sets LD_PRELOAD" in named["LD_PRELOAD"]
    assert all(line.startswith("warning: vllm.service: ") for line in lines)
    quiet = "Environment=CUDA_VISIBLE_DEVICES=0 HF_HOME=/srv/hf\n"
    assert unit_environment_warnings("vllm.service", lambda unit: quiet) == []
