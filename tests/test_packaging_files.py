"""packaging/: the journal catalog, man page, bash completion and RPM spec agree with the code
and are well-formed for the tools that read them (journalctl, groff, bash, rpm)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
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
PYENV = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv"))
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
    assert set(entries) == {event.value for event in Event}
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
    assert {line.split()[0] for line in listed.splitlines()} == {e.value for e in Event}


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
            if option.startswith("--") and a.help != argparse.SUPPRESS  # hidden: not offered
        }
        assert set(complete(command, "--")) == options, command
    assert "all" in complete("install", "vllm.service", "--gpus", "")
    run_options = {
        option
        for a in action.choices["run"]._actions
        for option in a.option_strings
        if option.startswith("--")
    }
    assert set(complete("run", "--")) == run_options | {"--"}
    assert "all" in complete("run", "--gpus", "")
    assert "bash" in complete("run", "--gpus", "0", "--", "bas")
    assert complete("run", "--name", "") == []


def missing_rpm_tools() -> str | None:
    for tool in ("rpmbuild", "rpm", "objdump"):
        if shutil.which(tool) is None:
            return f"{tool} not found (scripts/setup installs rpm, binutils)"
    return None


@pytest.fixture(scope="module")
def rpm_and_tree(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, Path]:
    """packaging/build-rpm's package, and its files installed with `rpm --root TREE --nodeps -i`
    (--noscripts: the tree has no /bin/sh for %post's catalog update)."""
    reason = missing_rpm_tools()
    if reason:
        pytest.skip(reason)
    if sys.base_prefix != "/usr":
        # scripts/test-pythons: the package (built for every Python by the same tools) does not
        # depend on the interpreter running the tests; the main run (Debian's python3) checks it.
        pytest.skip(f"the RPM is built and checked in the main run, not on {sys.base_prefix}")
    staged: Path = request.getfixturevalue("staged_tree")
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        ["bash", str(PACKAGING / "build-rpm")],
        capture_output=True,
        text=True,
        env={**os.environ, "DIST": str(dist), "STAGED": str(staged)},
        timeout=1800,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    rpm = Path(built.stdout.strip().splitlines()[-1])
    assert rpm == dist / f"gpugate-{VERSION}-1.x86_64.rpm" and rpm.is_file()
    tree = tmp_path_factory.mktemp("rpmroot")
    subprocess.run(["rpm", "--root", str(tree), "--initdb"], check=True)
    installed = subprocess.run(
        ["rpm", "--root", str(tree), "--nodeps", "--noscripts", "-i", str(rpm)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    return rpm, tree


def rpm_query(rpm: Path, *args: str) -> list[str]:
    result = subprocess.run(
        ["rpm", "-qp", *args, str(rpm)], capture_output=True, text=True, check=True
    )
    return result.stdout.splitlines()


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


# RHEL 9 (and Rocky, Alma 9): what the family has, for every dependency the RPM states.
EL9 = {"python3": "3.9.18", "systemd-libs": "252", "glibc": "2.34", "libstdc++": "11.5.0"}


def test_rpm_requires_what_the_rhel9_family_has(rpm_and_tree: tuple[Path, Path]) -> None:
    rpm, _tree = rpm_and_tree
    requires = [line for line in rpm_query(rpm, "-R") if not line.startswith("rpmlib(")]
    stated = {}
    for line in requires:
        if line == "/bin/sh":  # the scriptlets' shell: bash on every RHEL
            continue
        name, op, version = line.split()
        assert name in EL9, f"{line}: not a dependency RHEL 9 is known to satisfy"
        stated.setdefault(name, []).append((op, version))
    assert set(stated) == set(EL9), requires
    assert ("<", "3.14") in stated["python3"] and (">=", "3.9") in stated["python3"]
    for name, constraints in stated.items():
        have = version_tuple(EL9[name])
        for op, version in constraints:
            want = version_tuple(version)
            assert (have >= want) if op == ">=" else (have < want), f"{name} {op} {version}"
    (arch,) = rpm_query(rpm, "--qf", "%{ARCH}\n")
    assert arch == "x86_64"


def test_rpm_installs_the_tree_the_deb_has(rpm_and_tree: tuple[Path, Path]) -> None:
    rpm, tree = rpm_and_tree
    files = set(rpm_query(rpm, "-l"))
    for path in (
        "/usr/bin/gpugate",
        "/usr/bin/gpugate-oci-runtime",
        "/usr/share/gpugate/oci/gpugate-start.json",
        "/usr/share/gpugate/oci/gpugate-stop.json",
        "/usr/lib/gpugate/common/gpugate/front/cli.py",
        "/usr/lib/gpugate/common/pydantic/__init__.py",
        # `gpugate nri`'s protobuf modules, generated by setup.py as the package is built
        "/usr/lib/gpugate/common/gpugate/host/nri_api/api_pb2.py",
        "/usr/lib/gpugate/common/gpugate/host/nri_api/ttrpc_pb2.py",
        "/usr/lib/gpugate/common/google/protobuf/__init__.py",
        "/usr/lib/systemd/catalog/gpugate.catalog",
        "/usr/share/man/man1/gpugate.1.gz",
        "/usr/share/bash-completion/completions/gpugate",
        "/usr/share/gpugate/units/vllm.service",
        "/usr/lib/systemd/system/gpugate-sweep.service",
        "/usr/lib/systemd/system/gpugate-sweep.timer",
        "/usr/share/doc/gpugate/copyright",
    ):
        assert path in files, path
        assert (tree / path.lstrip("/")).is_file(), f"{path} not installed into the rpm root"
    for minor in range(9, 14):
        carried = tree / f"usr/lib/gpugate/cp3{minor}"
        assert list(carried.glob(f"pydantic_core/*.cpython-3{minor}-x86_64-linux-gnu.so"))
        assert list(carried.glob(f"systemd/_journal.cpython-3{minor}-x86_64-linux-gnu.so"))
    launcher = (tree / "usr/bin/gpugate").read_text()
    assert launcher.startswith("#!/usr/bin/python3 -I\n")
    assert "from gpugate.front.entry import run" in launcher
    wrapper = (tree / "usr/bin/gpugate-oci-runtime").read_text()
    assert "from gpugate.front.entry import oci_runtime" in wrapper
    owner = subprocess.run(
        ["rpm", "--root", str(tree), "-qf", "/usr/bin/gpugate"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert owner == f"gpugate-{VERSION}-1.x86_64"


def needed_versions(objects: list[Path], prefix: str) -> list[str]:
    """`objdump -T FILE | grep -o 'PREFIX_[0-9.]*' | sort -uV`, over every object."""
    found: set[str] = set()
    for path in objects:
        dynamic = subprocess.run(
            ["objdump", "-T", str(path)], capture_output=True, text=True, check=True
        ).stdout
        found.update(re.findall(rf"\b{prefix}_([0-9][0-9.]*)", dynamic))
    return sorted(found, key=version_tuple)


def test_compiled_parts_load_on_the_oldest_target(rpm_and_tree: tuple[Path, Path]) -> None:
    """Debian 11 is the oldest target: glibc 2.31 and systemd 247 (whose libsystemd.so.0 has
    symbol versions up to LIBSYSTEMD_247). Every compiled part, for every Python, must need no
    newer; psutil's abi3 module is shared by all."""
    _rpm, tree = rpm_and_tree
    objects = sorted((tree / "usr/lib/gpugate").rglob("*.so"))
    assert len(objects) >= 5 * 6 + 1, objects  # per Python: pydantic-core + 5 systemd modules
    glibc = needed_versions(objects, "GLIBC")
    assert glibc and version_tuple(glibc[-1]) <= (2, 31), glibc
    libsystemd = needed_versions(objects, "LIBSYSTEMD")
    assert libsystemd and int(libsystemd[-1]) <= 247, libsystemd
    for path in objects:
        needed = subprocess.run(
            ["objdump", "-p", str(path)], capture_output=True, text=True, check=True
        ).stdout
        libraries = set(re.findall(r"NEEDED\s+(\S+)", needed))
        if "google/_upb" in path.as_posix():
            # protobuf's C module (`gpugate nri` alone imports it): the .deb depends on
            # libstdc++6 (dpkg-shlibdeps), the .rpm requires libstdc++ (gpugate.spec).
            libraries -= {"libstdc++.so.6"}
        # Only libraries every target has (glibc's, libgcc's, systemd's own).
        assert libraries <= {
            "ld-linux-x86-64.so.2",
            "libc.so.6",
            "libm.so.6",
            "libdl.so.2",
            "libpthread.so.0",
            "librt.so.1",
            "libgcc_s.so.1",
            "libsystemd.so.0",
        }, (path, libraries)


def test_rpm_spec_parses_with_pyprojects_version() -> None:
    """rpm parses the spec; its default version (build-rpm passes pyproject's) is pyproject's."""
    if shutil.which("rpmspec") is None:
        pytest.skip("rpmspec missing (apt: rpm)")
    queried = subprocess.run(
        [
            "rpmspec",
            "-q",
            "--define",
            "stage /nonexistent",
            "--qf",
            "%{name} %{version}\n",
            str(SPEC),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert queried.strip() == f"gpugate {VERSION}"


def test_launcher_refuses_a_python_it_does_not_carry(rpm_and_tree: tuple[Path, Path]) -> None:
    """A python3 the package has no compiled parts for (3.8 here; 3.14 on a future host) gets
    one line naming it and what is carried, exit 70, and nothing imported."""
    _rpm, tree = rpm_and_tree
    pythons = sorted(PYENV.glob("versions/3.8.*/bin/python3.8"))
    if not pythons:
        pytest.skip(f"no Python 3.8 under {PYENV} to stand for an uncarried Python")
    result = subprocess.run(
        [str(pythons[-1]), "-I", str(tree / "usr/bin/gpugate"), "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 70, result
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert "is Python 3.8, but this package carries Python 3.9, 3.10, 3.11, 3.12, 3.13 only" in line
    assert "/usr/lib/gpugate/cp38 is missing" in line


def test_the_packaged_launcher_runs_python_isolated(tmp_path: Path) -> None:
    """packaging/stage's /usr/bin/gpugate (the .deb's and the RPM's) says `#!PYTHON -I`: a
    unit's PYTHONPATH imports nothing into root's hook, and `gpugate install` and `gpugate run`
    put that very launcher on the hook lines (front/install.py: it already isolates)."""
    from gpugate.front.install import gpugate_command

    stage = (PACKAGING / "stage").read_text()
    # One launcher for each of pyproject's scripts (gpugate, gpugate-oci-runtime).
    (shebang,) = re.findall(r'"\$stage/usr/bin/\$script" <<LAUNCHER\n(#!.*)\n', stage)
    assert shebang == "#!$launcher_python -I"
    launcher = tmp_path / "gpugate"
    launcher.write_text(shebang.replace("$launcher_python", "/usr/bin/python3") + "\n")
    assert gpugate_command(str(launcher), "/usr/bin/python3") == (str(launcher),)
    assert "/usr/bin/gpugate" in (PACKAGING / "gpugate.spec").read_text()
