"""`scripts/simhost shell`: a root shell on the simulated GPU host, for a person.

Boots the host (real systemd 252 as PID 1 of private namespaces, 8 stand-in GPUs), builds the
Debian package from this checkout (packaging/build-deb; kept in .simhost/deb until a source
file changes) and installs it inside with apt, as an operator would: /usr/bin/gpugate, the man
page, the journal catalog (dpkg's trigger compiles it) and bash completion at the package's
paths. It adds the stand-in vLLM workload and the driver's bystanders (tests/simhost/incident.py)
so that `gpugate status` has something to show, then gives a root shell inside. The host is
powered off when the shell exits. Without a terminal, the shell reads commands from stdin.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fake_nvml

from fake_nvml.build import build_fake_nvml
from incident import ALL, server_cmd, stage_incident, unit_text
from sandbox import BASE_ENV, REPO, SimHost, preflight

DEB_CACHE = REPO / ".simhost" / "deb"
SOURCES = ("src", "packaging", "units", "pyproject.toml")
INSIDE = "/var/cache/gpugate-deb"
# bash-completion (the package that loads completions) is not installed on this host:
# the shell's rc file sources gpugate's completion from where the package put it.
BASHRC = """\
. /etc/bash.bashrc 2>/dev/null
. /usr/share/bash-completion/completions/gpugate
PS1='simhost:\\w# '
"""
WELCOME = """\
== simulated GPU host: systemd {systemd}, 8 stand-in GPUs, gpugate from {deb} ==
Try:  gpugate status            man gpugate          gpugate <TAB><TAB>
      systemctl start vllm      (a vLLM-like unit on GPUs 0-7; `gpugate install vllm` is on it)
      journalctl -t gpugate -x  (the catalog explains each entry)
      bash /root/hand-start     (a server started by hand, as from an ssh login)
The host powers off when this shell exits.
"""


def newest_source(repo: Path) -> float:
    newest = 0.0
    for name in SOURCES:
        path = repo / name
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        newest = max([newest, *(p.stat().st_mtime for p in files)])
    return newest


def build_deb(repo: Path = REPO) -> Path:
    """The .deb of this checkout, built once per change of its sources."""
    built = sorted(DEB_CACHE.glob("gpugate_*_amd64.deb"))
    if built and built[-1].stat().st_mtime >= newest_source(repo):
        return built[-1]
    DEB_CACHE.mkdir(parents=True, exist_ok=True)
    for old in built:
        old.unlink()
    print("building the Debian package (packaging/build-deb)...", file=sys.stderr, flush=True)
    result = subprocess.run(
        ["bash", str(repo / "packaging" / "build-deb")],
        # The shell's host is this machine's root: its own Python is the only one needed.
        env={**os.environ, "DIST": str(DEB_CACHE), "PYTHONS": "/usr/bin/python3"},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"packaging/build-deb failed:\n{result.stdout}{result.stderr}")
    return Path(result.stdout.strip())


def install_deb(sim: SimHost, deb: Path) -> None:
    sim.write_file(f"{INSIDE}/{deb.name}", deb.read_bytes())
    # No network inside: apt takes every Depends from what is installed already.
    sim.run(
        f"rm -rf /var/lib/apt/lists/* && apt-get install -y -qq --no-install-recommends "
        f"{INSIDE}/{deb.name}",
        env={"DEBIAN_FRONTEND": "noninteractive"},
        timeout=300,
    )


def stage_demo(sim: SimHost) -> None:
    stage_incident(sim)
    # The unit without hooks of its own: `gpugate install` puts them on, as an operator would.
    text = unit_text("vllm.service", ALL, 8000)
    bare = [
        line
        for line in text.splitlines()
        if not line.startswith(("ExecStartPre=", "ExecStopPost="))
    ]
    sim.install_unit("vllm.service", "\n".join(bare) + "\n")
    sim.run(["gpugate", "install", "vllm", "--gpus", "all"], timeout=60)
    sim.write_file(
        "/root/hand-start",
        "# a vLLM-like server started by hand from a login session, holding GPUs 0-7\n"
        "systemd-run --quiet --scope --slice=user.slice --unit=hand-vllm.scope "
        f"setsid {server_cmd(ALL, 8100, '/run/ready-hand.json')} >/dev/null 2>&1 &\n",
    )
    sim.write_file("/root/.bashrc", BASHRC)


def shell(sim: SimHost, deb: Path, command: list[str]) -> int:
    systemd = sim.run(["systemctl", "--version"]).stdout.split()[1]
    interactive = sys.stdin.isatty()
    if interactive:
        print(WELCOME.format(systemd=systemd, deb=deb.name), flush=True)
    env = {**BASE_ENV, "TERM": os.environ.get("TERM", "dumb"), "SHELL": "/bin/bash"}
    if interactive:
        argv = ["/bin/bash", "--rcfile", "/root/.bashrc", "-i"]
    else:  # a non-interactive bash reads BASH_ENV, not the rc file
        env["BASH_ENV"] = "/root/.bashrc"
        argv = ["/bin/bash", "-c", " ".join(command)] if command else ["/bin/bash", "-s"]
    # nsenter -a also enters PID 1's working directory; env -C starts the shell in /root.
    nsenter = ["nsenter", "-t", str(sim.pid1), "-a", "--", "env", "-C", "/root", *argv]
    return subprocess.run(nsenter, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/simhost", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("shell", help="a root shell on the simulated host (poweroff on exit)")
    sub.add_argument("--deb", type=Path, help="install this .deb (default: build this checkout's)")
    sub.add_argument("run", nargs=argparse.REMAINDER, help="a command to run instead of a shell")
    args = parser.parse_args(argv)
    reason = preflight()
    if reason:
        print(f"scripts/simhost: cannot boot the simulated host: {reason}", file=sys.stderr)
        return 69
    deb = args.deb or build_deb()
    lib = build_fake_nvml(REPO / ".simhost" / "fake-nvml")
    started = time.monotonic()
    with SimHost.boot(nvml_lib=lib, gpus=8) as sim:
        install_deb(sim, deb)
        stage_demo(sim)
        if sys.stdin.isatty():
            print(f"(booted and installed in {time.monotonic() - started:.0f} s)", flush=True)
        code = shell(sim, deb, args.run)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
