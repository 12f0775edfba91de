"""Issue 26, rule 5: `gpugate run` by another account acts for that account. Over SUDO_*
environments and real uids (who gpugate takes the caller to be), uids as text, unit names
with escapes, the hook lines root's gpugate writes (--for-uid), decisions over process tables
(it only narrows: nothing another account owns is killed, and such a holder refuses the run),
and real processes of two accounts through a phase run."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpugate.config.schema import GateConfig
from gpugate.core.decide import Rule, decide
from gpugate.core.discover import Holder, Source
from gpugate.errors import BadInput, ExitCode
from gpugate.front.cli import build_parser
from gpugate.front.commands.run import (
    Caller,
    LaunchPlan,
    derive_unit_name,
    hook_line,
    invoking_user,
    systemd_run_argv,
)
from gpugate.front.hook import parse_uid
from gpugate.phase import Phase
from tests.fakes import FakeHost, alive
from tests.unit.test_decide import CGROUPS, UNIT_CG, Table, discovery, proc

ARABIC_1000 = "\u0661\u0660\u0660\u0660"  # str.isdigit() and int() take it
needs_root = pytest.mark.root("drops to other accounts")
ALICE, BOB = 64031, 64032  # accounts no one on the machine has

UID_LIKE = st.one_of(
    st.integers(0, 2**32 + 5).map(str),
    st.text("0123456789", max_size=12),
    st.text("0123456789 +-x\n\t\u0661\u0660\u0662\u0663", max_size=8),
    st.sampled_from(
        ["", "0", "00", "01", "1000\n", " 1000", "+1000", "-1", "4294967295", ARABIC_1000]
    ),
)


@settings(max_examples=500)
@given(UID_LIKE)
def test_a_uid_is_sudos_decimal_digits_only(text: str) -> None:
    found = parse_uid(text)
    plain = text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))
    if plain and len(text) <= 10 and int(text) < 2**32 - 1:
        assert found == int(text)
    else:
        assert found is None


SUDO_ENV = st.dictionaries(
    st.sampled_from(["SUDO_UID", "SUDO_GID", "SUDO_USER", "SUDO_COMMAND", "USER", "HOME"]),
    UID_LIKE,
    max_size=5,
)


@settings(max_examples=400)
@given(SUDO_ENV, st.sampled_from([0, 1000, ALICE, 65534]))
@example({"SUDO_UID": "0"}, ALICE)  # an account that passes root's uid itself
@example({"SUDO_UID": str(BOB)}, ALICE)  # or another account's
@example({"SUDO_UID": str(ALICE), "SUDO_GID": str(ALICE)}, 0)  # what sudo sets
def test_the_caller_is_sudos_only_under_root(environ: dict[str, str], real_uid: int) -> None:
    """An account that is not root is itself, whatever SUDO_* say (it may set them; sudo -E
    keeps them); gpugate under root (sudo's child) acts for SUDO_UID when sudo's digits, and
    refuses anything else rather than run as root."""
    expected_uid = real_uid
    if real_uid == 0 and "SUDO_UID" in environ:
        uid, gid = parse_uid(environ["SUDO_UID"]), parse_uid(environ.get("SUDO_GID", "0"))
        if uid is None or gid is None:
            with pytest.raises(BadInput) as raised:
                invoking_user(environ, real_uid=real_uid)
            assert raised.value.exit_code is ExitCode.USAGE
            return
        expected_uid = uid
    caller, under_sudo = invoking_user(environ, real_uid=real_uid)
    assert caller.uid == expected_uid
    assert under_sudo == (real_uid == 0 and "SUDO_UID" in environ)


def plan(uid: int, *, force: bool = False) -> LaunchPlan:
    return LaunchPlan(
        unit="gpugate-run-x-000000.service",
        command=("/usr/bin/x",),
        caller=Caller(uid, uid, "alice"),
        gpus_env="0",
        environment=(),
        pty=False,
        gpugate=("/usr/bin/python3", "-I", "-m", "gpugate"),
        force=force,
    )


@given(st.integers(0, 2**32 - 2), st.booleans())
def test_both_hook_lines_name_the_account_of_a_caller_that_is_not_root(
    uid: int, force: bool
) -> None:
    argv = systemd_run_argv(plan(uid, force=force), Path("/usr/bin/systemd-run"))
    lines = [
        arg
        for arg in argv
        if arg.startswith(("--property=ExecStartPre=", "--property=ExecStopPost="))
    ]
    assert len(lines) == 2
    for line in lines:
        assert line.endswith(f" --for-uid {uid}") is (uid != 0)
        assert ("--for-uid" in line) is (uid != 0)
    planned = plan(uid)
    pre = hook_line(planned, Phase.PRE)
    parsed = build_parser().parse_args(pre.lstrip("+").split()[len(planned.gpugate) :])
    assert parsed.for_uid == (None if uid == 0 else uid)


@pytest.mark.parametrize("value", ["-1", "x", "1000x", "4294967295", "", ARABIC_1000, "+5"])
def test_a_bad_for_uid_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["pre", "vllm.service", "--for-uid", value])
    assert raised.value.code == int(ExitCode.USAGE)


NAME_CHARS = st.text("abcXYZ019:_.-@\\%$ /x", min_size=1, max_size=30)


@settings(max_examples=500)
@given(NAME_CHARS)
@example(r"prod\x2dvllm")
@example("-x")
@example("--for-uid=0")
@example(".hidden")
@example("a" * 248)
def test_a_name_is_a_plain_unit_name(name: str) -> None:
    """systemd's grammar for a plain unit name (letters, digits, `:_.-`), without its escape
    `\\` (systemd-run unescapes the Exec lines the name is written on), not first a `-` or `.`,
    at most 255 characters with `.service`."""
    unit = name if name.endswith(".service") else name + ".service"
    prefix = unit[: -len(".service")]
    plain = (
        bool(prefix)
        and all(c.isascii() and (c.isalnum() or c in ":_.-") for c in prefix)
        and prefix[0] not in "-."
        and len(unit) <= 255
    )
    if plain:
        assert derive_unit_name(["x"], name, "000000") == unit
    else:
        with pytest.raises(BadInput) as raised:
            derive_unit_name(["x"], name, "000000")
        assert raised.value.exit_code is ExitCode.USAGE


UIDS = st.sampled_from([0, ALICE, BOB])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(CGROUPS), UIDS, st.sets(st.integers(0, 3), max_size=2)),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)
def test_acting_for_an_account_only_narrows(
    rows: list[tuple[str, int, set[int]]], kill_other_units: bool
) -> None:
    table = Table(
        {
            10 + n: proc(10 + n, 1, cgroup, uid=uid, session=10 + n)
            for n, (cgroup, uid, _) in enumerate(rows)
        }
    )
    holders = {
        pid: Holder(info, {Source.NVML}, set(rows[pid - 10][2]) or {0})
        for pid, info in table.procs.items()
    }
    config = GateConfig(kill_other_units=kill_other_units)
    found = discovery(table, holders, [0, 1])
    wide = decide(found, config, Phase.PRE, table)
    narrow = decide(found, config, Phase.PRE, table, for_uid=ALICE)
    wide_kill = {c.holder.pid for c in wide.targets}
    narrow_kill = {c.holder.pid for c in narrow.targets}
    assert narrow_kill <= wide_kill
    for choice in narrow.targets:
        assert choice.holder.info.uid == ALICE or choice.rule is Rule.CGROUP
    others = [c for c in narrow.blockers if c.rule is Rule.OTHER_ACCOUNT]
    assert {c.holder.pid for c in others} == {
        c.holder.pid
        for c in wide.targets
        if c.rule is not Rule.CGROUP and c.holder.info.uid != ALICE
    }
    if others:
        assert narrow.refused


def test_the_units_own_cgroup_stays_the_units() -> None:
    table = Table({10: proc(10, 1, UNIT_CG, uid=0), 11: proc(11, 1, UNIT_CG + "/sub", uid=BOB)})
    holders = {pid: Holder(info, {Source.CGROUP}, {0}) for pid, info in table.procs.items()}
    decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table, for_uid=ALICE)
    assert {c.holder.pid for c in decision.targets} == {10, 11} and not decision.refused


SERVER = textwrap.dedent(
    """
    import os, sys, time
    ready, uid, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    held = os.open(device, os.O_RDONLY)
    signal = open(ready, "w")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    signal.write("ok")
    signal.close()
    time.sleep(3600)
    """
)


def server(host: FakeHost, uid: int, gpu: int) -> int:
    ready = host.root / f"server-{len(host.pool.popens)}"
    argv = [sys.executable, "-c", SERVER, str(ready), str(uid), str(host.dev / f"nvidia{gpu}")]
    proc = host.pool.command(argv)
    deadline = time.monotonic() + 15
    while not (ready.exists() and ready.read_text() == "ok"):
        assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
        time.sleep(0.01)
    host.memory.claim(proc.pid, {gpu}, 20000)
    return proc.pid


def run(host: FakeHost, for_uid: int | None) -> ExitCode:
    summary = host.run_phase(
        "pre",
        host.config(gpus=[0, 1]),
        host.reporter("pre"),
        driver_factory=lambda: host.memory,
        for_uid=for_uid,
    )
    return summary.exit_code


@needs_root
def test_bobs_server_is_refused_for_alice_and_alices_own_stale_one_is_killed(
    host: FakeHost,
) -> None:
    """Issue 26's case: alice's `sudo gpugate run --gpus 0,1` must not kill bob's live server;
    her own stale one on the same GPUs goes once bob's is gone."""
    bobs = server(host, BOB, 0)
    alices = server(host, ALICE, 1)
    assert run(host, ALICE) is ExitCode.HELD_BY_OTHERS
    assert alive(bobs) and alive(alices)  # refused: nothing killed at all
    (refusal,) = [e for e in host.journal.events("refused") if e["GPUGATE_PID"] == str(bobs)]
    assert refusal["GPUGATE_REASON"] == "other-account"
    (bobs_proc,) = [proc for proc in host.pool.popens if proc.pid == bobs]
    bobs_proc.kill()  # bob stops his own server
    bobs_proc.wait()
    assert run(host, ALICE) is ExitCode.OK
    assert not alive(alices)


@needs_root
def test_a_run_config_another_account_may_write_is_refused(tmp_path: Path) -> None:
    """`sudo gpugate run --config ~alice/x.toml`: gpugate run reads it with the checked
    load_config (integrations.config_files), as root; a file alice owns must be refused
    (exit 78), not followed."""
    from gpugate.errors import ConfigError
    from gpugate.front.commands import run as launch
    from gpugate.integrations.config_files import load_config

    assert launch.load_config is load_config

    home = tmp_path / "alice"
    home.mkdir()
    given = home / "x.toml"
    given.write_text('kill_other_units = true\nmetrics_textfile = "/etc/victim.conf"\n')
    os.chown(home, ALICE, ALICE)
    os.chown(given, ALICE, ALICE)
    with pytest.raises(ConfigError) as raised:
        load_config("gpugate-run-x-000000.service", given)
    assert raised.value.exit_code is ExitCode.CONFIG
