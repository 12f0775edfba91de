"""The command line: exit codes and one-line errors, through `main` and as a real process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.config.file import parse_config
from gpugate.errors import ExitCode, NvmlUnavailable
from gpugate.front.cli import main
from tests.fakes import FakeHost, alive


def gpugate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpugate", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
        check=False,
    )


@pytest.mark.message
def test_bad_config_exits_config_with_one_line_and_kills_nothing(
    host: FakeHost, tmp_path: Path
) -> None:
    (orphan,) = host.pool.holder(host.gpu_files(0))
    bad = tmp_path / "bad.toml"
    bad.write_text("[pre]\nsigterm_grace_s = -1\n")
    result = gpugate("pre", "vllm.service", "--config", str(bad))
    assert result.returncode == ExitCode.CONFIG
    # one line naming the file and the field
    assert result.stderr.startswith(f"gpugate: {bad}: pre.sigterm_grace_s: ")
    assert result.stderr.count("\n") == 1
    assert alive(orphan)


@pytest.mark.message
def test_nvml_missing_exits_unavailable(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'lock_dir = "{tmp_path}"\n')
    result = gpugate(
        "--host-roots",
        f"cgroup={tmp_path},run={tmp_path}",
        "--nvml-library",
        str(tmp_path / "libnvidia-ml.so.1"),
        "pre",
        "vllm.service",
        "--config",
        str(config),
        env={"LD_LIBRARY_PATH": str(tmp_path)},
    )
    assert result.returncode == ExitCode.NVML_UNAVAILABLE, result.stderr
    assert "libnvidia-ml.so.1" in result.stderr
    assert result.stderr.count("\n") == 1
    missing = ["--nvml-library", str(tmp_path / "libnvidia-ml.so.1")]
    status = gpugate(*missing, "status", env={"LD_LIBRARY_PATH": str(tmp_path)})
    assert status.returncode == ExitCode.NVML_UNAVAILABLE


def test_unknown_unit_exits_unknown_unit() -> None:
    assert gpugate("pre", "not a unit").returncode == ExitCode.UNKNOWN_UNIT
    result = gpugate("pre")  # not running inside a service's cgroup here
    assert result.returncode == ExitCode.UNKNOWN_UNIT


def test_usage_error_exits_64() -> None:
    assert gpugate("explode").returncode == ExitCode.USAGE


def test_config_check_prints_effective_config(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text("gpus = [1, 2]\n[post]\nwait_timeout_s = 19\n")
    result = gpugate("config", "check", str(path))
    assert result.returncode == 0
    printed = parse_config(result.stdout, "printed")  # the effective config, valid TOML again
    assert printed.gpus == (1, 2) and printed.post.wait_timeout_s == 19.0
    from gpugate.compat import tomllib

    assert tomllib.loads(result.stdout)["post"]["kill_orphans"] is False


def test_main_with_injected_driver_runs_pre(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    (orphan,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(orphan, {1}, 500)
    config = host.root / "c.toml"
    config.write_text(f'lock_dir = "{host.root}/locks"\n[pre]\nsigterm_grace_s = 1\n')
    code = main(
        ["pre", "vllm.service", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
        reporter_factory=lambda unit, phase: host.reporter(phase),
    )
    assert code == 0
    assert not alive(orphan)


def test_status_json_lists_holders(host: FakeHost, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    (holder,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(holder, {2}, 1234)
    config = host.root / "c.toml"
    config.write_text("")
    code = main(
        ["status", "--json", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == 1
    assert len(data["gpus"]) == 8
    (entry,) = [h for h in data["holders"] if h["pid"] == holder]
    assert entry["gpus"] == [2]
    assert entry["used_mib"] == {"2": 1234}
    assert entry["orphan"] is True
    assert set(entry["sources"]) == {"device-fd", "nvml"}


@pytest.mark.message
def test_nvml_error_from_injected_driver_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> object:
        raise NvmlUnavailable("NVML: GPU 3 is lost\x1b[2J\nsecond line")

    code = main(["status"], driver_factory=broken)  # type: ignore[arg-type]
    assert code == ExitCode.NVML_UNAVAILABLE
    assert capsys.readouterr().err == "gpugate: NVML: GPU 3 is lost\\x1b[2J\\nsecond line\n"


MODULES_AFTER = """
import json, sys
from gpugate.front.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.__stdout__)
"""
HEAVY = ("pydantic", "pydantic_core", "pynvml", "psutil", "systemd")


def _modules_after(*argv: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-c", MODULES_AFTER, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    last = result.stdout.strip().splitlines()[-1]
    return set(json.loads(last))


def _packages_after(*argv: str) -> set[str]:
    return {name.split(".")[0] for name in _modules_after(*argv)}


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["status", "--help"],
        ["pre", "--help"],
        ["config", "check", "--help"],
        ["install", "--help"],
        ["run", "--help"],
        ["slurm", "prolog", "--help"],
        ["no-such-command"],
        ["status", "--no-such-option"],
    ],
)
def test_help_version_and_usage_errors_import_no_heavy_module(argv: list[str]) -> None:
    """Issue 30: what needs no config, no GPU and no process table imports none of them."""
    assert not _packages_after(*argv) & set(HEAVY)


def test_reading_a_config_builds_the_models(tmp_path: Path) -> None:
    """The other side: pydantic's engine comes in with the first config read (pydantic_core
    alone: the one model is validated by its SchemaValidator, not by BaseModel's)."""
    config = tmp_path / "gate.toml"
    config.write_text("free_mib = 2048\n")
    loaded = _packages_after("config", "check", str(config))
    assert "pydantic_core" in loaded
    assert "pydantic" not in loaded


def test_the_hidden_roots_option_is_the_one_host_roots_parses() -> None:
    from gpugate.front import cli
    from gpugate.host import systemd

    assert cli.HOST_ROOTS_OPTION == systemd.HOST_ROOTS_OPTION


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for sub in subs for child in sub.choices.values() for leaf in _leaf_parsers(child)]


def test_every_command_carries_the_function_that_runs_it() -> None:
    """Each command's parser holds the function that runs it."""
    from gpugate.front.cli import build_parser

    leaves = _leaf_parsers(build_parser())
    assert len(leaves) >= 10
    for leaf in leaves:
        assert callable(leaf.get_default("run")), leaf.prog


PRE_MODULES = """
import json, sys
from gpugate.front.cli import main
from gpugate.host.nvml import NoGpus
code = main(sys.argv[1:], driver_factory=NoGpus)
print(json.dumps([code, sorted(sys.modules)]), file=sys.__stdout__)
"""
# What `pre` imports is what operators pay on every start (a promise with figures in
# docs/benchmarks.md): issue 40 set 45 (76 were loaded then); 38 today, packages included,
# with this test's config file. It may only go down.
PRE_MODULE_BUDGET = 38


def _pre_modules(tmp_path: Path) -> tuple[int, list[str]]:
    """A whole `gpugate pre` on a stand-in host (its /run in tmp_path): its exit code and the
    modules it loaded."""
    (tmp_path / "dev" / "shm").mkdir(parents=True, exist_ok=True)
    unit_cgroup = tmp_path / "cgroup" / "system.slice" / "m.service"
    unit_cgroup.mkdir(parents=True, exist_ok=True)
    (unit_cgroup / "cgroup.procs").write_text("")
    roots = f"dev={tmp_path / 'dev'},cgroup={tmp_path / 'cgroup'},run={tmp_path}"
    argv = ["--host-roots", roots, "pre", "m.service", "--config", str(tmp_path / "c.toml")]
    result = subprocess.run(
        [sys.executable, "-c", PRE_MODULES, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    code, modules = json.loads(result.stdout.strip().splitlines()[-1])
    return code, modules


def test_a_pre_run_loads_few_of_gpugates_modules(tmp_path: Path) -> None:
    """What `pre` imports of gpugate stays in budget, and what only errors, interruptions, post
    or `status` need is not among it."""
    (tmp_path / "c.toml").write_text(f'lock_dir = "{tmp_path / "locks"}"\n')
    code, modules = _pre_modules(tmp_path)
    loaded = [name for name in modules if name.split(".")[0] == "gpugate"]
    assert code == ExitCode.OK
    assert len(loaded) <= PRE_MODULE_BUDGET, loaded
    unneeded_here = ("report.lines", "front.commands.status", "front.commands.run")
    for unneeded in unneeded_here:
        assert f"gpugate.{unneeded}" not in loaded


def test_a_start_whose_config_is_unchanged_parses_and_validates_nothing(tmp_path: Path) -> None:
    """The config cache on the path operators run: the second `pre` with the same file loads
    neither a TOML parser nor pydantic_core; an edit is validated again (a bad value: 78)."""
    config = tmp_path / "c.toml"
    config.write_text(f'lock_dir = "{tmp_path / "locks"}"\nfree_mib = 64\n')
    parsers = {"pydantic_core", "tomllib", "tomli"}
    code, modules = _pre_modules(tmp_path)
    assert code == ExitCode.OK
    assert "pydantic_core" in modules
    code, modules = _pre_modules(tmp_path)
    assert code == ExitCode.OK
    assert parsers.isdisjoint(modules)
    assert "dataclasses" not in modules  # nor what pydantic_core brought (issue 50)
    config.write_text(f'lock_dir = "{tmp_path / "locks"}"\nfree_mib = -64\n')
    code, modules = _pre_modules(tmp_path)
    assert code == ExitCode.CONFIG


PRE_DATACLASSES = """
import json, sys
from pathlib import Path
import gpugate.config.values
gpugate.config.values.DEFAULT_LOCK_DIR = Path(sys.argv[1])  # the built-in one, under tmp_path
from gpugate.front.cli import main
from gpugate.host.nvml import NoGpus
code = main(sys.argv[2:], driver_factory=NoGpus)
ours = [module for name, module in list(sys.modules.items()) if name.split(".")[0] == "gpugate"]
defined = sorted(
    f"{value.__module__}.{value.__qualname__}"
    for module in ours
    for value in vars(module).values()
    if isinstance(value, type)
    and value.__module__.split(".")[0] == "gpugate"
    and "__dataclass_fields__" in vars(value)
)
loaded = [name in sys.modules for name in ("dataclasses", "pydantic_core")]
print(json.dumps([code, defined, *loaded]), file=sys.__stdout__)
"""


@pytest.mark.parametrize("sets_lock_dir", [False, True])
def test_a_pre_run_defines_no_dataclass(tmp_path: Path, sets_lock_dir: bool) -> None:
    """Issue 50: defining a dataclass costs pre its exec'd methods, and importing dataclasses
    (inspect, ast, tokenize...) more. A config file that sets nothing (the built-in defaults:
    no pydantic_core) loads no dataclasses module at all; one that sets a field loads
    pydantic_core, and still no gpugate module defines a dataclass."""
    (tmp_path / "dev" / "shm").mkdir(parents=True)
    unit_cgroup = tmp_path / "cgroup" / "system.slice" / "m.service"
    unit_cgroup.mkdir(parents=True)
    (unit_cgroup / "cgroup.procs").write_text("")
    config = tmp_path / "c.toml"
    config.write_text(f'lock_dir = "{tmp_path / "locks"}"\n' if sets_lock_dir else "")
    roots = f"dev={tmp_path / 'dev'},cgroup={tmp_path / 'cgroup'},run={tmp_path}"
    argv = ["--host-roots", roots, "pre", "m.service", "--config", str(config)]
    built_in_locks = str(tmp_path / "built-in-locks")
    result = subprocess.run(
        [sys.executable, "-c", PRE_DATACLASSES, built_in_locks, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    code, defined, dataclasses_loaded, pydantic_core_loaded = json.loads(
        result.stdout.strip().splitlines()[-1]
    )
    assert code == ExitCode.OK, result.stderr
    assert defined == []
    assert pydantic_core_loaded is sets_lock_dir
    if not pydantic_core_loaded:
        assert not dataclasses_loaded
    assert (tmp_path / ("locks" if sets_lock_dir else "built-in-locks")).is_dir()
