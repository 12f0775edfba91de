"""Issue 26, rule 1: what processes say about themselves is untrusted text. Every command line,
comm, executable, cgroup, container name and file name gpugate shows is escaped as systemd
escapes it and bounded (untrusted.py), in every output: journal MESSAGE and fields,
STATUS=, stderr and the dry run, the status table and `status --json`, refusals. Nothing a
process sets can make a run or `status` fail."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpugate.core.decide import Choice, Decision, Rule, Verdict
from gpugate.core.discover import Discovery, Holder, Source
from gpugate.core.kill import Respawner
from gpugate.core.outcome import (
    ContainerStopped,
    Decided,
    Finished,
    Respawned,
    Respawning,
    RunSummary,
    ShmFiles,
    ShmShort,
    SignalSent,
    Stuck,
    Survived,
)
from gpugate.core.roles import Role
from gpugate.core.shm_cleanup import ShmRemoval, SpaceShort
from gpugate.errors import ExitCode
from gpugate.front.cli import main
from gpugate.front.commands.status import as_dict, render_json, render_table
from gpugate.host.containers import Container, StopResult
from gpugate.host.scan import ProcInfo
from gpugate.host.shm import FileFacts, ShmArea, ShmFile, ShmKey, Space
from gpugate.integrations.unit import refusal
from gpugate.report.journal import Event, FieldValue, Reporter
from gpugate.report.narrate import Narrator, describe
from gpugate.untrusted import (
    COMM,
    COMMAND,
    KINDS,
    LINE_CHARS,
    MARK,
    field_bytes,
    printable,
    printable_args,
    safe_line,
)
from tests.fakes import UNIT, FakeHost, RecordingNotifier, alive

SRC = Path(__file__).resolve().parents[2] / "src" / "gpugate"
FORGED = "FAKE LINE gpugate: all GPUs free"
# Clear the screen, home, set the window title, ring the bell; then a forged line of its own.
ESCAPES = f"\x1b[2J\x1b[H\x1b]0;owned\x07\a\n{FORGED}"
# Members of the class: what an account can put in a process's argv, comm, cgroup or a file name.
HOSTILE = [
    "\udcff",  # one byte 0xff, as Python reads it from /proc (surrogateescape)
    ESCAPES,
    "\r\t\v\f\b\x00\x7f",  # the other C0 escapes, NUL, DEL
    "\x85\x9b31m",  # C1: NEL and CSI
    "\u202eevil\u202c \u2028 \u2029 \u200b",  # bidi override, line/paragraph separators
    "\udcc3\udca9 \udce2\udc80",  # a valid é in bytes, then a truncated sequence
    "\ud800 lone surrogate",  # what no byte stands for
    "x" * 1_200_000,  # a 1.2 MB command line
    "\x1b" * 50_000,
]


def no_control(text: str) -> bool:
    """No C0, DEL, C1, no surrogate, no character that is not printable."""
    return text.isprintable() and not any(unicodedata.category(c) == "Cs" for c in text)


# Any str a process could hand gpugate: arbitrary bytes as /proc gives them, any code point
# (surrogates too), and long runs.
raw_bytes = st.binary(max_size=300).map(lambda b: b.decode("utf-8", "surrogateescape"))
any_text = st.text(st.characters(blacklist_categories=()), max_size=300)
long_text = st.tuples(st.sampled_from([*HOSTILE[:7], "a", "é"]), st.integers(1, 3000)).map(
    lambda pair: pair[0] * pair[1]
)
hostile = st.one_of(raw_bytes, any_text, long_text, st.sampled_from(HOSTILE))


@settings(deadline=None)
@given(value=hostile, kind=st.sampled_from(KINDS))
def test_shown_is_printable_bounded_idempotent_and_never_raises(value: str, kind: Any) -> None:
    text = printable(value, kind)
    assert no_control(text)
    text.encode("utf-8")  # strictly
    assert len(text) <= kind.chars
    assert printable(text, kind) == text  # escaping twice reads as escaping once
    if value.isprintable() and len(value) <= kind.chars:
        assert text == value  # plain text passes unchanged
    if len(text) < len(value) and text.endswith(MARK) and not value.endswith(MARK):
        assert len(value) > kind.chars or not value.isprintable()


# Python counts every separator but the ASCII space as unprintable (U+00A0, U+1680, U+2000...):
# printable() escapes those, so the printable alphabet is the space plus every other category.
PRINTABLE = st.one_of(
    st.just(" "),
    st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")),
)


@given(value=st.text(PRINTABLE, max_size=200))
def test_printable_text_passes_unchanged(value: str) -> None:
    assert printable(value, COMMAND) == value


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a\nb", "a\\nb"),
        ("\a\b\t\v\f\r", "\\a\\b\\t\\v\\f\\r"),
        ("\x1b[2J", "\\x1b[2J"),
        ("\x00\x7f", "\\x00\\x7f"),
        ("\udcff", "\\xff"),
        ("\x85", "\\xc2\\x85"),
        ("\u202e", "\\xe2\\x80\\xae"),
        ("C:\\path é 中", "C:\\path é 中"),
    ],
)
def test_escapes_are_systemds(value: str, expected: str) -> None:
    assert printable(value, COMMAND) == expected


def test_a_cut_is_marked_and_never_splits_an_escape() -> None:
    assert printable("x" * 1_200_000, COMMAND) == "x" * 199 + MARK
    cut = printable("\x1b" * 1000, COMMAND)
    assert cut.endswith("\\x1b" + MARK) and len(cut) <= COMMAND.chars
    assert printable("a" * 200, COMMAND) == "a" * 200


@settings(deadline=None)
@given(value=hostile, kind=st.sampled_from(KINDS))
def test_exact_keeps_the_bytes_bounded(value: str, kind: Any) -> None:
    data = field_bytes(value, kind)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    assert len(raw) <= kind.exact_bytes
    try:
        original = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return  # a lone surrogate no byte stands for: no bytes to keep
    assert original.startswith(raw)
    if len(original) <= kind.exact_bytes:
        assert raw == original


@settings(deadline=None)
@given(argv=st.lists(hostile, max_size=40))
def test_shown_args_bounds_the_whole_command(argv: list[str]) -> None:
    args, was_cut = printable_args(argv)
    assert all(no_control(arg) for arg in args)
    assert len(" ".join(args)) <= COMMAND.chars
    if all(a.isprintable() for a in argv) and len(" ".join(argv)) <= COMMAND.chars:
        assert (args, was_cut) == (argv, False)
    if was_cut:
        assert args == [] or args[-1].endswith(MARK)


# -- every output, fed hostile facts --------------------------------------------------------


class StrictJournal:
    """A journal as python-systemd's sendv takes it: a str must encode as UTF-8 (strictly),
    bytes go as they are."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, dict[str, FieldValue]]] = []

    def send(self, message: str, fields: dict[str, FieldValue]) -> None:
        message.encode("utf-8")
        for value in fields.values():
            if isinstance(value, str):
                value.encode("utf-8")
        self.entries.append((message, dict(fields)))


class StrictNotifier(RecordingNotifier):
    def notify(self, state: str) -> None:
        state.encode("utf-8")
        super().notify(state)


def holder_of(text: str, pid: int = 4242) -> Holder:
    info = ProcInfo(
        pid=pid,
        start_time=1,
        comm=text[:15],
        state="S",
        ppid=1,
        pgrp=pid,
        session=pid,
        tty_nr=0,
        kernel_thread=False,
        uid=0,
        cgroup=f"/user.slice/user-1000.slice/{text}.scope",
        cmdline=("/usr/bin/python3", text, "--port", "8000"),
        exe=f"/tmp/{text}",
    )
    container = Container("docker", "ab" * 32, "/system.slice/docker-x.scope", name=text)
    return Holder(info, {Source.DEVICE_FD}, {0}, container=container)


def choices_of(holder: Holder, text: str) -> Decision:
    return Decision(
        [
            Choice(holder, Role.ORPHAN, Verdict.KILL, Rule.ORPHAN, (0,)),
            Choice(holder, Role.OTHER_UNIT, Verdict.BLOCK, Rule.OTHER_UNIT, (0,), (), text),
            Choice(holder, Role.OTHER_UNIT, Verdict.KILL, Rule.OTHER_UNIT, (0,), (), text),
            Choice(holder, Role.UNIT_CONTAINER, Verdict.KILL, Rule.UNIT_CONTAINER, (0,)),
            Choice(holder, Role.PROTECTED, Verdict.SPARE, Rule.PROTECTED, (0,)),
        ]
    )


def narrate_everything(reporter: Reporter, text: str, errors: io.StringIO) -> None:
    """Every narration of a holder with this text, in a dry run (so its lines are printed)."""
    holder = holder_of(text)
    stream, reporter = reporter.stream, reporter.as_dry_run()
    reporter.stream = stream  # not stdout: the test reads it
    narrator = Narrator(reporter)
    decision = choices_of(holder, text)
    narrator.tell(Decided(decision))
    for choice in decision.choices:
        narrator.tell(SignalSent(choice, 15))
        narrator.tell(Stuck(choice, "D", text))
    narrator.tell(Survived(decision.choices))
    assert holder.container is not None
    narrator.tell(ContainerStopped(StopResult(holder.container, False, text)))
    narrator.tell(Respawning([Respawner(holder.info, 3)], 10))
    narrator.tell(Respawned(Respawner(holder.info, 3)))
    facts = FileFacts(f"/dev/shm/{text}", 4096, 4096, 0)
    file = ShmFile(ShmKey(1, 2), (facts.path,))
    narrator.tell(
        ShmFiles([ShmRemoval(file, (4242,), facts), ShmRemoval(file, (4242,), facts, kept=text)])
    )
    space = Space(ShmArea("/dev/shm", 1), 100, 1)
    narrator.tell(ShmShort(SpaceShort(space, 1, 2, [(file.key, facts)]), {file.key: [4242]}, str))
    units = Narrator(reporter)
    units.lease_stale(text, [0], "inactive", dry_run=True)
    units.gpus_shared(text, [0])
    units.lease_refused(text, [0])
    units.start_failed_earlier(text)
    units.lease_unreadable(Path(f"/run/gpugate/leases/{text}.json"), text)
    error = refusal("active", "pre", UNIT, [describe(c) for c in decision.choices])
    Narrator(reporter).failed(error, errors)
    narrator.tell(Finished(RunSummary()))


def check_channels(
    journal: StrictJournal, notifier: RecordingNotifier, stream: io.StringIO, text: str
) -> None:
    assert journal.entries
    for message, fields in journal.entries:
        assert no_control(message) and len(message) <= LINE_CHARS, message[:200]
        assert FORGED not in message.split("\\n")[0] or "\\n" in message or FORGED not in text
        for key in ("GPUGATE_COMMAND", "GPUGATE_COMM", "GPUGATE_SHM_PATH"):
            value = fields.get(key, "")
            assert len(value if isinstance(value, bytes) else value.encode()) <= 4096
    for state in notifier.states:
        assert no_control(state) and len(state) <= LINE_CHARS + 40
    lines = stream.getvalue().split("\n")
    assert lines[-1] == ""
    # One printed line per entry (the error's is on stderr alone): no line of a process's
    # making stands on its own.
    assert len(lines) - 1 == len(journal.entries) - 1
    for printed in lines[:-1]:
        assert no_control(printed) and printed.startswith("gpugate pre vllm.service: ")
        assert not printed.startswith(FORGED)


@pytest.mark.message
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=hostile)
def test_every_narration_escapes_and_bounds_process_text(text: str) -> None:
    journal, notifier, stream = StrictJournal(), StrictNotifier(), io.StringIO()
    reporter = Reporter(UNIT, "pre", journal=journal, notifier=notifier, stream=stream, echo=True)
    errors = io.StringIO()
    narrate_everything(reporter, text, errors)
    check_channels(journal, notifier, stream, text)
    (said,) = errors.getvalue().splitlines()
    assert no_control(said) and said.startswith(
        "gpugate: vllm.service is active and this `gpugate pre`"
    )
    if text.isprintable() and len(text) < 100:
        killed = journal.entries[0][0]
        assert text in killed  # plain text is shown as it is


@settings(
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(text=hostile)
def test_status_table_and_json_escape_and_bound(host: FakeHost, text: str) -> None:
    # In a login scope (no unit: rule 4) and in a system service named by the text (a cgroup's
    # name holds no "/": one would be a folder of cgroups, no unit's).
    for cgroup in (None, f"/system.slice/{text.replace('/', '_')}.service"):
        holder = holder_of(text)
        if cgroup is not None:
            holder.info = holder.info._replace(cgroup=cgroup)
        status_is_clean(host, holder, text)


def status_is_clean(host: FakeHost, holder: Holder, text: str) -> None:
    discovery = Discovery(
        unit="",
        unit_cgroup="/gpugate-status-no-unit",
        gpus=[],
        owned=[],
        usage={},
        holders={holder.pid: holder},
        self_chain=frozenset(),
        unreadable=[],
    )
    data = as_dict(discovery, host.config(), host.roots)
    table, dumped = render_table(data), render_json(data)
    for row in table.split("\n"):
        assert no_control(row)
    assert len(dumped) < 12_000  # however long the process's text (JSON escapes: \\u00e9)
    (entry,) = json.loads(dumped)["holders"]
    assert entry["unit"] is not None or holder.info.cgroup.startswith("/user.slice/")
    for key in ("comm", "cgroup", "unit"):
        assert no_control(entry[key] or "") and len(entry[key] or "") <= 200
    assert len(" ".join(entry["command"])) <= COMMAND.chars and len(entry["comm"]) <= COMM.chars
    assert no_control(entry["container"]["name"] or "")


# -- on a host: real processes with hostile command lines -------------------------------------


def hostile_holder(host: FakeHost, argv: list[bytes], comm: bytes, gpu: int) -> int:
    """A real process holding GPU gpu's device files, with this argv (bytes, any) and comm."""
    ready = host.root / f"ready-hostile-{gpu}"
    script = (
        "import sys, time\n"
        f"handles = [open(p, 'rb') for p in {[str(p) for p in host.gpu_files(gpu)]!r}]\n"
        f"open('/proc/self/comm', 'wb').write({comm!r})\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(3600)\n"
    )
    short = b"import os; exec(os.environ['HOSTILE_SCRIPT'])"
    env = {**os.environ, "HOSTILE_SCRIPT": script}
    proc = host.pool.command([os.fsencode(sys.executable), b"-c", short, *argv], env=env)
    host.pool.until(ready.exists, "the hostile holder did not start")
    return proc.pid


@pytest.fixture
def hostile_host(host: FakeHost) -> Iterator[tuple[FakeHost, list[int]]]:
    pids = [
        hostile_holder(host, [b"\xff", b"serve"], b"\xffworker", 0),
        hostile_holder(host, [ESCAPES.encode(), b"--model", b"x" * 4000], b"\x1b]0;t\x07\n", 1),
    ]
    for gpu, pid in enumerate(pids):
        host.memory.claim(pid, {gpu}, 1000)
    yield host, pids


@pytest.mark.message
def test_status_and_dry_run_of_hostile_holders(
    hostile_host: tuple[FakeHost, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    host, pids = hostile_host
    config = host.root / "c.toml"
    config.write_text(f'lock_dir = "{host.root / "locks"}"\n')
    common = {"driver_factory": lambda: host.memory, "roots": host.roots}
    for args in (["status"], ["status", "--json"]):
        assert main([*args, "--config", str(config)], **common) == 0  # type: ignore[arg-type]
        out, err = capsys.readouterr()
        assert no_control(out.replace("\n", "")) and no_control(err.replace("\n", ""))
        assert FORGED not in [row.strip() for row in out.splitlines()]
    data = json.loads(main_json(host, config, capsys))
    commands = {h["pid"]: h for h in data["holders"]}
    assert commands[pids[0]]["command"][3:] == ["\\xff", "serve"]
    assert commands[pids[0]]["comm"] == "\\xffworker"
    assert commands[pids[1]]["command"][3].startswith("\\x1b[2J\\x1b[H\\x1b]0;owned\\a\\a\\n")
    assert commands[pids[1]]["command_cut"] is True
    assert len(" ".join(commands[pids[1]]["command"])) <= COMMAND.chars

    journal, notifier = StrictJournal(), StrictNotifier()
    reporter = Reporter(UNIT, "pre", journal=journal, notifier=notifier, echo=True)
    summary = host.run_phase(
        "pre",
        host.config(gpus=[0, 1], pre={"kill_orphans": True}),
        reporter,
        dry_run=True,
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.OK
    out = capsys.readouterr().out
    assert all(line.startswith("gpugate pre vllm.service: ") for line in out.splitlines())
    assert all(no_control(line) for line in out.splitlines())
    assert all(alive(pid) for pid in pids)  # a dry run


def main_json(host: FakeHost, config: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(
        ["status", "--json", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )
    assert code == 0
    return capsys.readouterr().out


def test_pre_kills_hostile_holders_and_says_so_escaped(
    hostile_host: tuple[FakeHost, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    host, pids = hostile_host
    journal, notifier = StrictJournal(), StrictNotifier()
    reporter = Reporter(UNIT, "pre", journal=journal, notifier=notifier, echo=True)
    summary = host.run_phase(
        "pre",
        host.config(gpus=[0, 1], pre={"kill_orphans": True}),
        reporter,
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.OK
    assert not any(alive(pid) for pid in pids)
    signals = [fields for _, fields in journal.entries if fields["GPUGATE_EVENT"] == "signal_sent"]
    assert {int(str(f["GPUGATE_PID"])) for f in signals} == set(pids)
    # The structured fields keep the very bytes, bounded.
    commands = {f["GPUGATE_COMMAND"] for f in signals}
    assert any(isinstance(c, bytes) and b"\xff" in c for c in commands)
    assert any(isinstance(c, str) and ESCAPES in c for c in commands)
    for message, _ in journal.entries:
        assert no_control(message)
    assert all(no_control(state) for state in notifier.states)
    assert all(no_control(line) for line in capsys.readouterr().out.splitlines())


def test_the_real_journal_send_takes_bytes_that_are_not_utf8(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """python-systemd's sendv encodes a str strictly (UnicodeEncodeError on a surrogate, the
    exit 70 of issue 26): SystemdJournal hands it bytes there."""
    from systemd import journal as systemd_journal

    sent: list[tuple[Any, ...]] = []

    def strict(*args: str | bytes) -> None:
        for arg in args:
            if isinstance(arg, str):
                arg.encode("utf-8")
        sent.append(args)

    monkeypatch.setattr(systemd_journal, "sendv", strict)
    monkeypatch.setattr(os.path, "exists", lambda path: True)
    reporter = Reporter(UNIT, "pre", notifier=StrictNotifier(), echo=False)
    reporter.event(
        Event.HOLDER_FOUND,
        f"would kill {printable(HOSTILE[0], COMMAND)}",
        command=field_bytes("a\udcff", COMMAND),
        other="also \udcfe here",
    )
    (args,) = sent
    assert b"GPUGATE_COMMAND=a\xff" in args and b"GPUGATE_OTHER=also \xfe here" in args
    assert "MESSAGE=would kill \\xff" in args


# -- hard to forget ------------------------------------------------------------------------

UNTRUSTED = {"command", "cmdline", "comm", "exe", "cgroup"}
CONTAINER_TEXT = {"name", "label", "handle"}
PASSES = {
    "printable",
    "field_bytes",
    "printable_args",
    "container_text",
    "container_handle",
    "quoted",
}
# Functions that take process text as data and return a fact, not a word: their result is
# still text an account may have picked (a unit name), shown through PASSES where it is shown.
AS_DATA = {"unit_of_cgroup"}
# report/, and the commands that word a process's text where they print it (status's table,
# run's refusal, a Slurm node's drain reason).
OUTPUTS = [
    *sorted((SRC / "report").glob("*.py")),
    *(
        SRC / "front" / name
        for name in ("commands/status.py", "commands/run.py", "commands/slurm.py")
    ),
]


def untrusted_reads(tree: ast.AST) -> Iterator[ast.Attribute]:
    """Reads of process text: info.command, holder.info.comm, container.name, ..."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        owner = ast.unparse(node.value)
        if (node.attr in UNTRUSTED and "info" in owner) or (
            node.attr in CONTAINER_TEXT and owner.endswith("container")
        ):
            yield node


@pytest.mark.parametrize("path", OUTPUTS, ids=lambda p: p.name)
def test_process_text_reaches_output_only_through_untrusted(path: Path) -> None:
    """In OUTPUTS, a process's text is read only as the argument of a function of
    untrusted.py (or a helper made of them): it cannot be shown raw by forgetting."""
    tree = ast.parse(path.read_text())
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else ""
            if name in PASSES | AS_DATA:
                for arg in node.args:
                    allowed.update(id(sub) for sub in ast.walk(arg))
        if isinstance(node, ast.FunctionDef) and node.name in PASSES | {"choice_fields"}:
            allowed.update(id(sub) for sub in ast.walk(node))
    raw = [
        f"{path.name}:{node.lineno}: {ast.unparse(node)}"
        for node in untrusted_reads(tree)
        if id(node) not in allowed
    ]
    assert not raw, raw


def test_the_escaping_matches_systemd_escape_where_it_is_there() -> None:
    """systemd's own C escaping (`systemd-escape` escapes more: '/', '-'; journalctl shows the
    control characters of a field as \\xNN): the characters gpugate escapes agree."""
    if not Path("/usr/bin/systemd-escape").exists():
        pytest.skip("systemd-escape not installed")
    done = subprocess.run(
        ["/usr/bin/systemd-escape", "a\x1bb"], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "a\\x1bb" and printable("a\x1bb", COMMAND) == done.stdout.strip()
    assert safe_line("a\nb") == "a\\nb"
