"""`gpus = "auto"`: the unit's own CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES, from
`systemctl show` output and the EnvironmentFile=s it names, as systemd resolves them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from gpugate.config.file import LoadedConfig, parse_config
from gpugate.config.schema import GateConfig
from gpugate.config.values import BUILTIN_SOURCE
from gpugate.errors import ConfigError, UnknownUnit
from gpugate.host.systemd import (
    ENVIRONMENT_FILE_MAX_BYTES,
    UnitEnvironment,
    parse_environment_file,
    unit_environment,
)
from gpugate.integrations.unit import (
    choose_gpus,
    parse_visible_devices,
    with_chosen_gpus,
)
from tests.fakes import raises_error

UUID = "GPU-fa4e5a11-0000-0000-0000-000000000004"


def env_of(show: str):  # type: ignore[no-untyped-def]
    return lambda unit: unit_environment(unit, show=lambda _: show)


def loaded(source: str = "/etc/gpugate/a.service.toml", **fields: object) -> LoadedConfig:
    return LoadedConfig(GateConfig.model_validate(fields), source)


def test_auto_is_the_default_and_written_by_name() -> None:
    assert GateConfig().gpus == "auto"
    assert parse_config('gpus = "auto"', "x.toml").gpus == "auto"
    with pytest.raises(ConfigError, match='"all", "auto"'):
        parse_config('gpus = "some"', "x.toml")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("4,5", (4, 5)),
        (" 0 ", (0,)),
        (f"{UUID},1", (UUID, 1)),
        ("", ()),
        ("-1", ()),
        ("-1,2", ()),
    ],
)
def test_cuda_visible_devices_values(value: str, expected: tuple[object, ...]) -> None:
    assert parse_visible_devices("CUDA_VISIBLE_DEVICES", value, "unit x") == expected


@pytest.mark.parametrize(
    ("value", "expected"), [("all", "all"), ("none", ()), ("void", ()), ("2,3", (2, 3))]
)
def test_nvidia_visible_devices_values(value: str, expected: object) -> None:
    assert parse_visible_devices("NVIDIA_VISIBLE_DEVICES", value, "unit x") == expected


@pytest.mark.parametrize("value", ["0,gpu1", "1,1", "0,,1", "GPU-xyz", "4;5", "9999"])
def test_bad_values_name_the_unit_and_variable(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        choose_gpus("a.service", loaded(), env_of(f"Environment=CUDA_VISIBLE_DEVICES={value}\n"))
    assert (info.value.source, info.value.field) == (
        "unit a.service: Environment=",
        "CUDA_VISIBLE_DEVICES",
    )


def test_environment_line_wins_and_files_override_it(tmp_path: Path) -> None:
    env_file = tmp_path / "a.env"
    env_file.write_text("# comment\nexport CUDA_VISIBLE_DEVICES='4,5'\nOTHER=1\n")
    show = (
        'Environment="PYTHONPATH=/x y" CUDA_VISIBLE_DEVICES=0,1\n'
        f"EnvironmentFiles={env_file} (ignore_errors=no)\n"
        f"EnvironmentFiles={tmp_path}/missing.env (ignore_errors=yes)\n"
    )
    choice = choose_gpus("a.service", loaded(), env_of(show))
    assert choice.gpus == (4, 5)
    assert choice.source == f"CUDA_VISIBLE_DEVICES of a.service (EnvironmentFile={env_file})"
    only_line = choose_gpus("a.service", loaded(), env_of(show.split("\n", maxsplit=1)[0]))
    assert only_line.gpus == (0, 1) and "(Environment=)" in only_line.source


def test_a_missing_required_environment_file_is_an_error(tmp_path: Path) -> None:
    show = f"Environment=\nEnvironmentFiles={tmp_path}/gone.env (ignore_errors=no)\n"
    with pytest.raises(UnknownUnit, match=r"gone\.env"):
        choose_gpus("a.service", loaded(), env_of(show))


@pytest.mark.parametrize("kind", ["fifo", "huge", "folder", "socket"])
def test_an_environment_file_that_is_no_small_file_is_refused_at_once(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO would block the hook (nobody writes to it), a huge file would be read whole: the
    unit's EnvironmentFile= is read as systemd reads it, but bounded: an error naming it."""
    path = tmp_path / "a.env"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_bytes(b"X=1\n" * (ENVIRONMENT_FILE_MAX_BYTES // 4 + 1))
    elif kind == "folder":
        path.mkdir()
    else:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))  # the socket file stays once the socket is closed
    show = f"Environment=\nEnvironmentFiles={path} (ignore_errors=no)\n"
    with raises_error(UnknownUnit):
        choose_gpus("a.service", loaded(), env_of(show))
    ignored = f"Environment=\nEnvironmentFiles={path} (ignore_errors=yes)\n"
    assert choose_gpus("a.service", loaded(), env_of(ignored)).gpus == "all"


def test_an_environment_file_is_read_through_its_links_as_systemd_does(tmp_path: Path) -> None:
    real = tmp_path / "real.env"
    real.write_text("CUDA_VISIBLE_DEVICES=3\n")
    (tmp_path / "link.env").symlink_to(real)
    show = f"Environment=\nEnvironmentFiles={tmp_path}/link.env (ignore_errors=no)\n"
    assert choose_gpus("a.service", loaded(), env_of(show)).gpus == (3,)


def test_cuda_wins_over_nvidia_then_all() -> None:
    both = "Environment=NVIDIA_VISIBLE_DEVICES=1 CUDA_VISIBLE_DEVICES=2\n"
    assert choose_gpus("a.service", loaded(), env_of(both)).gpus == (2,)
    nvidia = "Environment=NVIDIA_VISIBLE_DEVICES=1\n"
    assert choose_gpus("a.service", loaded(), env_of(nvidia)).gpus == (1,)
    neither = choose_gpus("a.service", loaded(), env_of("Environment=\nEnvironmentFiles=\n"))
    assert neither.gpus == "all" and not neither.warn


def test_fall_back_to_all_without_a_config_file_warns() -> None:
    choice = choose_gpus("a.service", loaded(BUILTIN_SOURCE), env_of("Environment=\n"))
    assert choice.gpus == "all" and choice.warn
    no_systemd = choose_gpus("a.service", loaded(BUILTIN_SOURCE), lambda _: None)
    assert no_systemd.gpus == "all" and no_systemd.warn


def test_explicit_gpus_are_kept_and_the_choice_applies() -> None:
    fixed = loaded(gpus=[3])
    choice = choose_gpus("a.service", fixed, env_of("Environment=CUDA_VISIBLE_DEVICES=4\n"))
    assert choice.gpus == (3,) and fixed.source in choice.source
    auto = choose_gpus("a.service", loaded(), env_of("Environment=CUDA_VISIBLE_DEVICES=4\n"))
    applied = with_chosen_gpus(loaded(), auto)
    assert applied.config.gpus == (4,) and applied.source == loaded().source


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A=1\nB=2", {"A": "1", "B": "2"}),
        ("A = 1", {"A": "1"}),
        ('A="x y"\n', {"A": "x y"}),
        ("A='$B'", {"A": "$B"}),
        ("A=1\nB=${A},2", {"A": "1", "B": "1,2"}),
        ("A=0,\\\n1", {"A": "0,1"}),
        ("; c\n# c\nexport A=3", {"A": "3"}),
        ("not a line\n1A=2\nA=4 # c", {"A": "4"}),
    ],
)
def test_environment_file_syntax(text: str, expected: dict[str, str]) -> None:
    assert parse_environment_file(text) == expected


def test_unit_environment_records_where_each_came_from(tmp_path: Path) -> None:
    env_file = tmp_path / "e"
    env_file.write_text("A=2\n")
    env = unit_environment(
        "a.service",
        show=lambda _: f"Environment=A=1 B=1\nEnvironmentFiles={env_file} (ignore_errors=no)",
    )
    assert isinstance(env, UnitEnvironment)
    assert env.variables == {"A": "2", "B": "1"}
    assert env.origin("A") == f"EnvironmentFile={env_file}" and env.origin("B") == "Environment="
    assert unit_environment("a.service", show=lambda _: None) is None
