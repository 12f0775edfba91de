"""The runtime gpugate-oci-runtime runs after its hooks (host/wrapped_runtime.py): the record
install writes, read as root reads a config (another account's, a FIFO, a wrong name:
refused), the choice at fixed paths only, and the wrapper itself run end to end with stand-in
runtimes that record how they were called (NVIDIA's runtime kept in the chain; a chain that
comes back to the wrapper ends at runc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.errors import ConfigError, ExitCode
from gpugate.host import wrapped_runtime as wrapped

needs_root = pytest.mark.root("chown to another account")


def record(tmp_path: Path, text: str, mode: int = 0o644) -> Path:
    path = tmp_path / "etc" / "oci-runtime.toml"
    path.parent.mkdir(mode=0o755, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def test_no_record_is_runc(tmp_path: Path) -> None:
    assert wrapped.read_record(tmp_path / "absent.toml") == wrapped.RUNC


@pytest.mark.parametrize("name", [wrapped.RUNC, wrapped.NVIDIA])
def test_install_s_record_reads_back(tmp_path: Path, name: str) -> None:
    assert wrapped.read_record(record(tmp_path, wrapped.record_text(name))) == name


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('runtime = "/tmp/evil"\n', "RUNTIME_RECORD_VALUE"),
        ('runtime = "crun"\n', "RUNTIME_RECORD_VALUE"),
        ("runtime = 1\n", "RUNTIME_RECORD_VALUE"),
        ("runtime = [\n", "CONFIG_NOT_TOML"),
        ("\udcff", "CONFIG_NOT_TOML"),
    ],
)
def test_a_record_naming_no_known_runtime_is_refused(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "etc" / "oci-runtime.toml"
    path.parent.mkdir()
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError) as caught:
        wrapped.read_record(path)
    assert caught.value.exit_code == ExitCode.CONFIG
    assert "\n" not in caught.value.message


@pytest.mark.parametrize("mode", [0o664, 0o666])
def test_a_record_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    path = record(tmp_path, wrapped.record_text(wrapped.NVIDIA), mode)
    with pytest.raises(ConfigError):
        wrapped.read_record(path)


@needs_root
def test_a_record_of_another_account_is_refused(tmp_path: Path) -> None:
    path = record(tmp_path, wrapped.record_text(wrapped.NVIDIA))
    os.chown(path, 1000, 1000)
    with pytest.raises(ConfigError):
        wrapped.read_record(path)


def test_a_fifo_record_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "oci-runtime.toml"
    os.mkfifo(path, 0o644)
    with pytest.raises(ConfigError):
        wrapped.read_record(path)


def test_a_linked_record_is_not_followed(tmp_path: Path) -> None:
    target = record(tmp_path, wrapped.record_text(wrapped.NVIDIA))
    link = tmp_path / "link.toml"
    link.symlink_to(target)
    with pytest.raises(ConfigError):
        wrapped.read_record(link)


def stand_in(path: Path, log: Path, then: str | None = None) -> Path:
    """A runtime that appends its argv and chain mark to log, then execs `then` (or exits 0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tail = f'exec {then} "$@"' if then else "exit 0"
    path.write_text(
        "#!/bin/sh\n"
        f'printf \'%s %s %s\\n\' "$(basename "$0")" "${{{wrapped.CHAIN}:-}}" "$*" >> {log}\n'
        f"{tail}\n"
    )
    path.chmod(0o755)
    return path


@pytest.fixture
def runtimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    log = tmp_path / "calls.log"
    runc = stand_in(tmp_path / "bin" / "runc", log)
    nvidia = stand_in(tmp_path / "bin" / "nvidia-container-runtime", log, str(runc))
    paths = {wrapped.RUNC: (str(runc),), wrapped.NVIDIA: (str(tmp_path / "none"), str(nvidia))}
    monkeypatch.setattr(wrapped, "PATHS", paths)
    return {"runc": runc, "nvidia": nvidia, "log": log}


def test_nvidia_where_recorded_and_installed(runtimes: dict[str, Path]) -> None:
    chosen = wrapped.choose(wrapped.NVIDIA, {})
    assert (chosen.name, chosen.path) == (wrapped.NVIDIA, str(runtimes["nvidia"]))


def test_runc_where_nvidia_is_gone_or_already_in_the_chain(
    runtimes: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    chained = wrapped.choose(wrapped.NVIDIA, {wrapped.CHAIN: wrapped.NVIDIA})
    assert (chained.name, chained.path) == (wrapped.RUNC, str(runtimes["runc"]))
    runtimes["nvidia"].unlink()
    gone = wrapped.choose(wrapped.NVIDIA, {})
    assert (gone.name, gone.path) == (wrapped.RUNC, str(runtimes["runc"]))


@needs_root
def test_a_runtime_another_account_may_change_is_not_run(runtimes: dict[str, Path]) -> None:
    os.chown(runtimes["nvidia"], 1000, 1000)
    assert wrapped.choose(wrapped.NVIDIA, {}).name == wrapped.RUNC
    runtimes["runc"].chmod(0o777)
    assert wrapped.find(wrapped.RUNC) is None


WRAPPER = """
import sys
from pathlib import Path
from gpugate.host import wrapped_runtime
wrapped_runtime.RECORD = Path(sys.argv[1])
wrapped_runtime.PATHS = {"runc": (sys.argv[2],), "nvidia-container-runtime": (sys.argv[3],)}
from gpugate.front.commands.oci_runtime import main
sys.exit(main(sys.argv[4:]))
"""


def run_wrapper(
    tmp_path: Path, runtimes: dict[str, Path], argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", WRAPPER, str(tmp_path / "etc" / "oci-runtime.toml")]
    command += [str(runtimes["runc"]), str(runtimes["nvidia"]), *argv]
    environment = {k: v for k, v in os.environ.items() if k != wrapped.CHAIN}
    environment.update(env or {})
    return subprocess.run(command, capture_output=True, text=True, env=environment, check=False)


def calls(runtimes: dict[str, Path]) -> list[tuple[str, str, list[str]]]:
    """Each runtime run: its name, the chain's mark, its argv."""
    logged = [line.split(" ", 2) for line in runtimes["log"].read_text().splitlines()]
    return [(name, chain, argv.split()) for name, chain, argv in logged]


def gpu_bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o711)
    device = {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}
    spec = {"process": {"env": []}, "linux": {"devices": [device]}}
    (bundle / "config.json").write_text(json.dumps(spec))
    (bundle / "config.json").chmod(0o600)
    return bundle


@pytest.mark.root("not the host's root, the wrapper adds no hooks")
def test_the_wrapper_keeps_nvidia_s_runtime_in_the_chain(
    tmp_path: Path, runtimes: dict[str, Path]
) -> None:
    record(tmp_path, wrapped.record_text(wrapped.NVIDIA))
    bundle = gpu_bundle(tmp_path)
    argv = ["--root", "/run/x", "create", "--bundle", str(bundle), "abc"]
    done = run_wrapper(tmp_path, runtimes, argv)
    assert done.returncode == 0, done.stderr
    assert calls(runtimes) == [
        ("nvidia-container-runtime", wrapped.NVIDIA, argv),
        ("runc", wrapped.NVIDIA, argv),
    ]
    hooks = json.loads((bundle / "config.json").read_text())["hooks"]
    assert set(hooks) == {"createRuntime", "poststop"}
    assert (bundle / "config.json").stat().st_mode & 0o777 == 0o600  # rewritten, same mode
    assert [path.name for path in bundle.iterdir()] == ["config.json"]  # nothing left beside it


def test_without_a_record_the_wrapper_runs_runc(tmp_path: Path, runtimes: dict[str, Path]) -> None:
    done = run_wrapper(tmp_path, runtimes, ["state", "abc"])
    assert done.returncode == 0, done.stderr
    assert calls(runtimes) == [("runc", "", ["state", "abc"])]


def test_a_chain_back_to_the_wrapper_ends_at_runc(
    tmp_path: Path, runtimes: dict[str, Path]
) -> None:
    """NVIDIA's config naming gpugate's wrapper as its runtime: the wrapper, run again under
    the chain's mark, runs runc."""
    record(tmp_path, wrapped.record_text(wrapped.NVIDIA))
    done = run_wrapper(tmp_path, runtimes, ["delete", "abc"], {wrapped.CHAIN: wrapped.NVIDIA})
    assert done.returncode == 0, done.stderr
    assert calls(runtimes) == [("runc", wrapped.NVIDIA, ["delete", "abc"])]


def test_a_bad_record_fails_the_create_but_not_the_delete(
    tmp_path: Path, runtimes: dict[str, Path]
) -> None:
    record(tmp_path, wrapped.record_text(wrapped.NVIDIA), 0o666)
    bundle = gpu_bundle(tmp_path)
    created = run_wrapper(tmp_path, runtimes, ["create", "--bundle", str(bundle), "abc"])
    assert created.returncode == ExitCode.CONFIG
    assert len(created.stderr.strip().splitlines()) == 1
    assert not runtimes["log"].exists()
    deleted = run_wrapper(tmp_path, runtimes, ["delete", "abc"])
    assert deleted.returncode == 0, deleted.stderr
    assert calls(runtimes) == [("runc", "", ["delete", "abc"])]


def test_config_check_shows_what_the_wrapper_runs(
    tmp_path: Path, runtimes: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from gpugate.front.commands.config_check import show_wrapped_runtime

    show_wrapped_runtime(tmp_path / "absent.toml")
    assert capsys.readouterr().out == ""
    path = record(tmp_path, wrapped.record_text(wrapped.NVIDIA))
    show_wrapped_runtime(path)
    shown = capsys.readouterr().out
    assert shown.startswith("#") and str(runtimes["nvidia"]) in shown and str(path) in shown
    path.chmod(0o666)
    show_wrapped_runtime(path)
    said = capsys.readouterr()
    assert said.out == "" and str(path) in said.err


@pytest.mark.parametrize(("recorded", "hooked"), [(wrapped.NVIDIA, True), (wrapped.RUNC, False)])
@pytest.mark.root("not the host's root, the wrapper adds no hooks")
def test_a_container_without_gpus_yet_is_hooked_where_nvidia_s_runtime_follows(
    tmp_path: Path, runtimes: dict[str, Path], recorded: str, hooked: bool
) -> None:
    """NVIDIA's runtime may add the GPUs after the wrapper (its hook, CDI): the hook then
    reads them at createRuntime, so the wrapper adds it to every container."""
    record(tmp_path, wrapped.record_text(recorded))
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o711)
    (bundle / "config.json").write_text(
        json.dumps({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=1"]}})
    )
    done = run_wrapper(tmp_path, runtimes, ["create", "--bundle", str(bundle), "abc"])
    assert done.returncode == 0, done.stderr
    assert ("hooks" in json.loads((bundle / "config.json").read_text())) is hooked
