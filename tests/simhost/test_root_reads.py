"""Issue 26 on the simulated GPU host (real systemd 252, the stand-in driver), rules 2 and 5/6:

(b) /etc/gpugate/UNIT.toml owned by the unit's User= account, saying `gpus = "all"` and
    `kill_other_units = true`: `systemctl start` fails with exit 78 naming the file (systemctl
    status and the journal), and another unit's GPU holder lives; the same for a root file of
    mode 0666;
(f) `gpugate run` by its absolute path in a venv that is not on PATH (and no /usr/bin/gpugate)
    runs its command with gpugate's hooks: the hooks are that very gpugate, isolated.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator

import pytest
from incident import CONFIG, Host, prepare, unit_text
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

ACCOUNT = "mlteam"
OTHER = "other-gpu.service"
STEERED = "vllm-own.service"
STEER = 'gpus = "all"\nkill_other_units = true\n' + CONFIG
HOOKS = "ExecStartPre=/usr/bin/gpugate pre %n\nExecStopPost=/usr/bin/gpugate post %n\n"
VENV = "/opt/gpugate"  # sandbox.install_gpugate's venv; /usr/bin/gpugate links to its script


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    h.sh(f"id {ACCOUNT} >/dev/null 2>&1 || useradd --system --no-create-home {ACCOUNT}")
    yield h
    h.sh(
        f"systemctl stop {OTHER} {STEERED} 2>/dev/null; systemctl reset-failed 2>/dev/null; "
        f"test -e /usr/bin/gpugate || ln -sf {VENV}/bin/gpugate /usr/bin/gpugate",
        check=False,
    )
    h.reset()


def other_unit(host: Host) -> list[int]:
    """Another unit's server on GPU 1, without gpugate (so no lease of its own stands in the
    way: only kill_other_units decides): its processes."""
    host.sim.install_unit(OTHER, unit_text(OTHER, (1,), 8071).replace(HOOKS, ""))
    host.start(OTHER)
    host.wait_ready(f"/run/ready-{OTHER}.json")
    pids = host.cgroup_pids(OTHER)
    assert pids and host.used()[1] > 0
    return pids


@pytest.mark.parametrize("how", ["owned-by-account", "mode-0666"])
def test_an_account_config_is_refused_and_kills_nothing(host: Host, how: str) -> None:
    host.reset()
    holders = other_unit(host)
    path = f"/etc/gpugate/{STEERED}.toml"
    # As `gpugate install`'s drop-in has them: "+", root's hooks on a User= unit.
    text = (
        unit_text(STEERED, (0,), 8072)
        .replace("[Service]\n", f"[Service]\nUser={ACCOUNT}\n")
        .replace("=/usr/bin/gpugate", "=+/usr/bin/gpugate")
    )
    host.install(STEERED, text, STEER)
    if how == "owned-by-account":
        host.sh(f"chown {ACCOUNT} {path} && chmod 0644 {path}")
    else:
        host.sh(f"chown root:root {path} && chmod 0666 {path}")
    try:
        cursor = host.cursor()
        assert host.start(STEERED, check=False) != 0
        shown = host.sh(f"SYSTEMD_COLORS=0 systemctl status --no-pager -n 0 {STEERED}", check=False)
        assert "status=78" in shown, shown  # systemd's line for the hook: exit 78
        logged = host.sh(f"journalctl --no-pager -o cat --after-cursor={shlex.quote(cursor)}")
        refused = [line for line in logged.splitlines() if line.startswith(f"gpugate: {path}:")]
        assert len(refused) == 2 and len(set(refused)) == 1, logged  # pre's and post's line
        assert "status=78/CONFIG" in logged
        assert "status=70" not in logged  # never an internal error (exit 70)
        assert all(host.alive(pid) for pid in holders), "another unit's holder was killed"
        state = host.sim.systemctl("is-active", OTHER, check=False).stdout.strip()
        assert state == "active"
        assert host.events_after(cursor, GPUGATE_EVENT="signal_sent") == []
    finally:
        host.sh(f"systemctl stop {OTHER} {STEERED}; systemctl reset-failed", check=False)


def test_gpugate_run_by_a_path_outside_path_runs_with_its_hooks(host: Host) -> None:
    host.reset()
    unit = "f-run.service"
    host.sim.write_file("/etc/gpugate/f-run.toml", CONFIG)
    host.sh("rm -f /run/f-ran /usr/bin/gpugate")  # only the venv's script, not on PATH
    try:
        cursor = host.cursor()
        ran = host.sim.run(
            [
                f"{VENV}/bin/gpugate",
                "run",
                "--gpus",
                "2",
                "--name",
                unit,
                "--config",
                "/etc/gpugate/f-run.toml",
                "--",
                "/bin/sh",
                "-c",
                "echo ran > /run/f-ran",
            ],
            check=False,
            timeout=180,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert host.sh("cat /run/f-ran", check=False).strip() == "ran"
        entries = host.events_after(cursor, _SYSTEMD_UNIT=unit)
        phases = {e.get("GPUGATE_PHASE") for e in entries}
        assert {"pre", "post"} <= phases, entries
        hooks = host.sh(f"journalctl --no-pager -o cat -u {unit}", check=False)
        assert "203/EXEC" not in hooks, hooks
    finally:
        host.sh(f"ln -sf {VENV}/bin/gpugate /usr/bin/gpugate", check=False)


def test_a_units_pythonpath_imports_nothing_into_roots_hooks(host: Host) -> None:
    """Rule 6: `gpugate install` on a unit whose Environment= sets PYTHONPATH to a folder with
    a planted `gpugate` package and sitecustomize: install warns, and the hooks it writes
    (Python -I) import neither; the unit starts and stops with gpugate's hooks."""
    host.reset()
    unit = "vllm-pp.service"
    evil = "/srv/evil"
    # Each importer leaves its command line (the server itself imports sitecustomize: fine).
    code = (
        "import os\nline = open('/proc/self/cmdline').read().replace(chr(0), ' ')\n"
        "open('/run/steered-%d' % os.getpid(), 'w').write(line)\n"
    )
    host.sh(f"rm -f /run/steered-*; mkdir -p {evil}/gpugate")
    for name in ("gpugate/__init__.py", "gpugate/__main__.py", "sitecustomize.py"):
        host.sim.write_file(f"{evil}/{name}", code)
    text = unit_text(unit, (3,), 8073).replace(
        HOOKS, f"Environment=PYTHONPATH={evil} PYTHONSTARTUP={evil}/sitecustomize.py\n"
    )
    host.sim.install_unit(unit, text)
    try:
        installed = host.sim.run(["gpugate", "install", unit, "--gpus", "3"], check=False)
        assert installed.returncode == 0, installed.stderr
        warned = [line for line in installed.stderr.splitlines() if " sets PYTHON" in line]
        assert {line.split(" sets ")[1].split(":")[0] for line in warned} == {
            "PYTHONPATH",
            "PYTHONSTARTUP",
        }, installed.stderr
        dropin = host.sh(f"cat /etc/systemd/system/{unit}.d/gpugate.conf")
        assert re.search(
            rf"^ExecStartPre=\+{VENV}/bin/python3? -I -m gpugate pre %n$", dropin, re.M
        ), dropin
        host.sim.write_file(f"/etc/gpugate/{unit}.toml", "gpus = [3]\n" + CONFIG)
        cursor = host.cursor()
        assert host.start(unit) == 0
        host.wait_ready(f"/run/ready-{unit}.json")
        host.sim.systemctl("stop", unit)
        phases = {e.get("GPUGATE_PHASE") for e in host.events_after(cursor, _SYSTEMD_UNIT=unit)}
        assert {"pre", "post"} <= phases
        importers = host.sh("cat /run/steered-* 2>/dev/null; echo", check=False)
        assert "gpugate" not in importers, f"imported into root's hook: {importers}"
    finally:
        host.sh(
            f"systemctl stop {unit}; gpugate uninstall {unit} --force --no-reload; "
            "systemctl daemon-reload",
            check=False,
        )
