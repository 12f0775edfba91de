"""packaging/: the journal catalog, man page, bash completion and RPM spec agree with the code
and are well-formed for the tools that read them (journalctl, groff, bash, rpm)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from gpugate.compat import tomllib
from gpugate.errors import ExitCode
from gpugate.front.cli import build_parser
from gpugate.report.journal import Event

REPO = Path(__file__).resolve().parents[1]
PACKAGING = REPO / "packaging"
CATALOG = PACKAGING / "gpugate.catalog"
MAN = PACKAGING / "gpugate.1"
COMPLETION = PACKAGING / "gpugate.bash-completion"
SPEC = PACKAGING / "gpugate.spec"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def subcommands() -> list[str]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    assert action.choices is not None
    return sorted(action.choices)


def catalog_entries() -> dict[str, str]:
    entries: dict[str, str] = {}
    for block in re.split(r"^-- ", CATALOG.read_text(), flags=re.MULTILINE)[1:]:
        header, _, body = block.partition("\n")
        entries[header.strip()] = body
    return entries


def test_catalog_explains_every_event() -> None:
    entries = catalog_entries()
    assert set(entries) == {event.message_id for event in Event}
    for message_id, body in entries.items():
        fields = dict(
            line.split(": ", 1) for line in body.split("\n\n")[0].splitlines() if ": " in line
        )
        assert fields.get("Defined-By") == "gpugate", message_id
        assert {"Subject", "Support"} <= set(fields), message_id
        assert len(body.split("\n\n", 1)) == 2, f"{message_id}: no explanation text"


@pytest.mark.skipif(shutil.which("journalctl") is None, reason="journalctl missing")
def test_catalog_compiles_and_lists(tmp_path: Path) -> None:
    """What dpkg's trigger runs (`journalctl --update-catalog`), against a private root."""
    target = tmp_path / "usr/lib/systemd/catalog/gpugate.catalog"
    target.parent.mkdir(parents=True)
    shutil.copy(CATALOG, target)
    subprocess.run(["journalctl", f"--root={tmp_path}", "--update-catalog"], check=True)
    listed = subprocess.run(
        ["journalctl", f"--root={tmp_path}", "--list-catalog"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert {line.split()[0] for line in listed.splitlines()} == {e.message_id for e in Event}


def test_man_page_names_every_command_exit_code_and_event() -> None:
    text = MAN.read_text().replace("\\-", "-")
    for command in subcommands():
        assert re.search(rf"^\.B[IR]? \"?{command}\b", text, re.MULTILINE), command
    for code in ExitCode:
        assert f".B {int(code)}\n{code.name}" in text, code.name
    for event in Event:
        assert event.name.lower() in text, event.name
    assert f'"gpugate {VERSION}"' in text


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff missing (groff-base)")
def test_man_page_renders_without_warnings() -> None:
    result = subprocess.run(
        ["groff", "-man", "-ww", "-z", "-Tutf8", str(MAN)], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr


def complete(*words: str) -> list[str]:
    """Run the completion function as bash would for `gpugate WORDS...` (last one typed)."""
    script = (
        f"source {COMPLETION}; COMP_WORDS=(gpugate {' '.join(repr(w) for w in words)}); "
        f"COMP_CWORD={len(words)}; _gpugate; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    result = subprocess.run(
        ["bash", "--norc", "-c", script], capture_output=True, text=True, check=True
    )
    return [line for line in result.stdout.splitlines() if line]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash missing")
def test_bash_completion_offers_every_command_and_option() -> None:
    assert set(complete("")) >= set(subcommands())
    assert complete("ins") == ["install"]
    assert complete("config", "") == ["check"]
    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    assert action.choices is not None
    for command in ("pre", "post", "status", "install", "uninstall"):
        options = {
            option
            for a in action.choices[command]._actions
            for option in a.option_strings
            if option.startswith("--")
        }
        assert set(complete(command, "--")) == options, command
    assert "all" in complete("install", "vllm.service", "--gpus", "")


@pytest.mark.skipif(shutil.which("rpmbuild") is None, reason="rpmbuild missing (apt: rpm)")
def test_rpm_spec_builds_a_source_rpm(tmp_path: Path) -> None:
    """rpm parses the spec and packs the source; its version is pyproject's. (The binary build
    needs Fedora's pyproject and systemd macros, which Debian's rpm does not have.)"""
    queried = subprocess.run(
        ["rpmspec", "-q", "--srpm", "--qf", "%{name} %{version}\n", str(SPEC)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert queried.strip() == f"gpugate {VERSION}"
    name = f"gpugate-{VERSION}"
    with tarfile.open(tmp_path / f"{name}.tar.gz", "w:gz") as tar:
        for part in ("pyproject.toml", "README.md", "src", "units", "packaging"):
            tar.add(REPO / part, arcname=f"{name}/{part}")
    built = subprocess.run(
        [
            "rpmbuild",
            "-bs",
            "--define",
            f"_topdir {tmp_path / 'top'}",
            "--define",
            f"_sourcedir {tmp_path}",
            str(SPEC),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "top" / "SRPMS" / f"{name}-1.src.rpm").is_file()
    # Every file the spec installs exists in the source.
    spec = SPEC.read_text()
    for source in re.findall(r"install -Dpm 0644 (\S+)", spec):
        if "$unit" in source:
            for unit in ("gpugate.conf", "vllm.service", "vllm@.service"):
                assert (REPO / source.replace("$unit", unit)).is_file()
        else:
            assert (REPO / source).is_file(), source
