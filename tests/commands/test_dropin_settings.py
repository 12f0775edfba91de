"""What `gpugate install`'s drop-in adds to a unit (issue 28): only what the unit leaves unset.
Its own TimeoutStartSec=/TimeoutStopSec= (or TimeoutSec=), NotifyAccess=all and a /dev/shm of
its own (TemporaryFileSystem=/dev/shm) are kept and said; a unit that sets none gets gpugate's;
private_shm sizes the unit's own /dev/shm or turns it off. Over many unit shapes, read from
`systemctl cat` text and from unit folders."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gpugate.config.file import parse_config
from gpugate.errors import ConfigError
from gpugate.front.install import DEFAULT_GPUGATE, apply, plan_install, render_dropin
from gpugate.host.systemd import UnitSettings, files_text
from gpugate.host.systemd import parse_unit_settings as parse

UNIT = "vllm.service"
OURS = "# /etc/systemd/system/vllm.service.d/gpugate.conf\n[Service]\nTimeoutStopSec=300\n"


def cat(*files: tuple[str, str]) -> str:
    return "".join(f"# {path}\n{text}\n" for path, text in files)


def unit_file(body: str) -> tuple[str, str]:
    return ("/etc/systemd/system/vllm.service", f"[Unit]\nDescription=x\n[Service]\n{body}")


def dropin(name: str, body: str) -> tuple[str, str]:
    return (f"/etc/systemd/system/vllm.service.d/{name}", f"[Service]\n{body}")


def lines(text: str, key: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(key + "=")]


# (the unit's files, kept start timeout, kept stop timeout)
SHAPES = [
    pytest.param([unit_file("ExecStart=/bin/true\n")], None, None, id="sets-none"),
    pytest.param([unit_file("TimeoutStopSec=3\n")], None, "3", id="stop-only"),
    pytest.param([unit_file("TimeoutStartSec=15min\n")], "15min", None, id="start-only"),
    pytest.param([unit_file("TimeoutSec=20\n")], "20", "20", id="timeoutsec-both"),
    pytest.param(
        [unit_file("TimeoutSec=20\nTimeoutStopSec=infinity\n")],
        "20",
        "infinity",
        id="sec-then-stop",
    ),
    pytest.param(
        [unit_file("TimeoutStopSec=3\n"), dropin("override.conf", "TimeoutStopSec=\n")],
        None,
        None,
        id="reset-in-a-later-dropin",
    ),
    pytest.param(
        [unit_file(""), dropin("10-timeouts.conf", "TimeoutStartSec=600\nTimeoutStopSec=30s\n")],
        "600",
        "30s",
        id="in-an-operators-dropin",
    ),
    pytest.param(
        [unit_file("Environment=A=1 \\\n  TimeoutStopSec=9\nTimeoutStartSec=5\n")],
        "5",
        None,
        id="continuation-line-is-not-a-key",
    ),
    pytest.param(
        [("/etc/systemd/system/vllm.service", "[Unit]\nJobTimeoutSec=3\n[Install]\nX=1\n")],
        None,
        None,
        id="other-sections-ignored",
    ),
    pytest.param(
        [unit_file("# TimeoutStopSec=3\n; TimeoutStartSec=3\n")], None, None, id="comments"
    ),
]


@pytest.mark.parametrize(("files", "start", "stop"), SHAPES)
def test_the_units_own_timeouts_are_kept_and_the_rest_added(
    files: list[tuple[str, str]], start: str | None, stop: str | None
) -> None:
    settings = parse(cat(*files) + OURS)  # gpugate's own drop-in is never the unit's setting
    assert (settings.start_timeout and settings.start_timeout.value) == start
    assert (settings.stop_timeout and settings.stop_timeout.value) == stop
    text = render_dropin(DEFAULT_GPUGATE, settings)
    assert lines(text, "TimeoutStartSec") == ([] if start else ["TimeoutStartSec=300"])
    assert lines(text, "TimeoutStopSec") == ([] if stop else ["TimeoutStopSec=300"])


@pytest.mark.parametrize(
    ("body", "kept"),
    [
        ("TemporaryFileSystem=/dev/shm:size=1M\n", "/dev/shm:size=1M"),
        ("TemporaryFileSystem=/tmp /dev/shm/\n", "/dev/shm/"),
        ("TemporaryFileSystem=-/dev/shm\n", "-/dev/shm"),
        ("TemporaryFileSystem=/dev/shm\nTemporaryFileSystem=\n", None),
        ("TemporaryFileSystem=/dev/shm\nTemporaryFileSystem=/var/x\n", "/dev/shm"),
        ("TemporaryFileSystem=/dev/shmx /devshm\n", None),
        ("PrivateTmp=yes\nPrivateIPC=yes\n", None),
    ],
)
def test_a_unit_with_its_own_dev_shm_keeps_it(body: str, kept: str | None) -> None:
    settings = parse(cat(unit_file(body)))
    assert (settings.own_shm and settings.own_shm.value) == kept
    text = render_dropin(DEFAULT_GPUGATE, settings)
    ours = lines(text, "TemporaryFileSystem")
    assert ours == (
        [] if kept else ["TemporaryFileSystem=/dev/shm:mode=1777,nosuid,nodev,size=50%"]
    )


@pytest.mark.parametrize(("access", "written"), [("all", False), ("main", True), ("exec", True)])
def test_notify_access_all_is_kept(access: str, written: bool) -> None:
    settings = parse(cat(unit_file(f"NotifyAccess={access}\n")))
    text = render_dropin(DEFAULT_GPUGATE, settings)
    assert lines(text, "NotifyAccess") == (["NotifyAccess=exec"] if written else [])


@pytest.mark.parametrize(
    ("private_shm", "line"),
    [
        ("off", None),
        ("64g", "TemporaryFileSystem=/dev/shm:mode=1777,nosuid,nodev,size=64g"),
        ("16384m", "TemporaryFileSystem=/dev/shm:mode=1777,nosuid,nodev,size=16384m"),
        ("100%", "TemporaryFileSystem=/dev/shm:mode=1777,nosuid,nodev,size=100%"),
    ],
)
def test_private_shm_sizes_the_units_dev_shm_or_turns_it_off(
    private_shm: str, line: str | None
) -> None:
    parse_config(f'private_shm = "{private_shm}"\n', "x.toml")
    text = render_dropin(DEFAULT_GPUGATE, UnitSettings(), private_shm)
    assert lines(text, "TemporaryFileSystem") == ([line] if line else [])


@pytest.mark.parametrize(
    "value",
    ['"50%,exec"', '"1g\\nExecStart=/bin/sh"', '"0%"', '"101%"', '"64G "', '"-1g"', "64", '""'],
)
def test_private_shm_takes_a_size_or_off_and_nothing_else(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"private_shm = {value}\n", "/etc/gpugate/vllm.service.toml")
    refused = caught.value
    assert (refused.source, refused.field) == ("/etc/gpugate/vllm.service.toml", "private_shm")
    assert "\n" not in refused.message


def test_files_read_by_hand_as_systemctl_cat_would(tmp_path: Path) -> None:
    """Without systemd: the instance's template and both drop-in folders, by file name."""
    (tmp_path / "vllm@.service").write_text("[Service]\nTimeoutStopSec=7\n")
    (tmp_path / "vllm@.service.d").mkdir()
    (tmp_path / "vllm@.service.d" / "50-a.conf").write_text("[Service]\nTimeoutStartSec=70\n")
    (tmp_path / "vllm@.service.d" / "gpugate.conf").write_text("[Service]\nTimeoutSec=300\n")
    (tmp_path / "vllm@1.service.d").mkdir()
    (tmp_path / "vllm@1.service.d" / "60-b.conf").write_text("[Service]\nTimeoutStopSec=\n")
    settings = parse(files_text("vllm@1.service", [str(tmp_path)]))
    # gpugate.conf's TimeoutSec=300 (own drop-in, read last) is left out
    assert settings.start_timeout is not None and settings.start_timeout.value == "70"
    assert settings.stop_timeout is None  # the instance's 60-b.conf reset it


def install(tmp_path: Path, gpus: list[int | str] | None = None) -> str:
    out = io.StringIO()
    changes = plan_install(
        UNIT, gpus=gpus, systemd_dir=tmp_path / "systemd", config_dir=tmp_path / "gpugate"
    )
    apply(changes, reload=lambda: True, out=out)
    return out.getvalue()


@pytest.mark.message
def test_install_says_what_it_kept_and_follows_the_config(tmp_path: Path) -> None:
    systemd = tmp_path / "systemd"
    systemd.mkdir()
    (systemd / UNIT).write_text("[Service]\nExecStart=/bin/true\nTimeoutStopSec=3\n")
    dropin_path = systemd / f"{UNIT}.d" / "gpugate.conf"

    out = install(tmp_path, [0])

    assert f"kept the unit's TimeoutStopSec=3 ({systemd / UNIT})" in out, out
    assert "sets no TimeoutStartSec: the drop-in sets 300s" in out, out
    assert "a /dev/shm of its own (size=50%" in out
    written = dropin_path.read_text()
    assert lines(written, "TimeoutStopSec") == [] and lines(written, "TimeoutStartSec")
    # Installed again: its own drop-in's TimeoutStartSec=300 is not taken for the unit's.
    again = install(tmp_path)
    assert "unchanged" in again and "sets no TimeoutStartSec" in again, again
    # The off switch: private_shm = "off" in the unit's config, then install again.
    config = tmp_path / "gpugate" / f"{UNIT}.toml"
    config.write_text('private_shm = "off"\n' + config.read_text())
    off = install(tmp_path)
    assert "shares the host's /dev/shm" in off, off
    assert lines(dropin_path.read_text(), "TemporaryFileSystem") == []


def test_install_refuses_a_config_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "systemd").mkdir()
    (tmp_path / "gpugate").mkdir()
    (tmp_path / "gpugate" / f"{UNIT}.toml").write_text('private_shm = "lots"\n')
    with pytest.raises(ConfigError) as refused:
        install(tmp_path)
    assert refused.value.field == "private_shm"
    assert not (tmp_path / "systemd" / f"{UNIT}.d").exists()


def test_a_comment_naming_a_path_is_not_a_file_header() -> None:
    text = cat(
        unit_file(
            "# /etc/systemd/system/vllm.service.d/gpugate.conf is gpugate's\nTimeoutStopSec=4\n"
        )
    )
    settings = parse(text)
    assert settings.stop_timeout is not None and settings.stop_timeout.value == "4"
    assert settings.stop_timeout.path == "/etc/systemd/system/vllm.service"
