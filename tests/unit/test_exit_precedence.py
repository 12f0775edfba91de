"""Exit codes by a stated precedence (one function from the run's facts), values echoed cut
short in every message, and every exit code the documentation names is the one the code uses."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from gpugate.config.file import parse_config
from gpugate.config.values import gpu_refs
from gpugate.errors import RUN_OUTCOMES, ConfigError, ExitCode, InvalidValue, outcome_code
from gpugate.front.cli import main
from gpugate.untrusted import ECHO_MAX
from tests.fakes import FakeHost

REPO = Path(__file__).resolve().parents[2]
ORDER = [
    ExitCode.RESPAWNING,
    ExitCode.UNKILLABLE,
    ExitCode.HELD_BY_OTHERS,
    ExitCode.MEMORY_TIMEOUT,
    ExitCode.SHM_SPACE,
]


@pytest.mark.parametrize("held", list(itertools.product([False, True], repeat=len(ORDER))))
def test_every_combination_of_outcomes_gives_the_most_severe_code(held: tuple[bool, ...]) -> None:
    found = {code for i, code in enumerate(reversed(ORDER)) if held[i]}
    expected = next((code for code in ORDER if code in found), ExitCode.OK)
    assert outcome_code(found) is expected


def test_the_precedence_is_the_order_of_today() -> None:
    assert list(RUN_OUTCOMES) == ORDER


def test_unkillable_beats_memory_timeout() -> None:
    """The case the issue names: a survivor found during the wait, memory still used after."""
    unkillable = ExitCode.UNKILLABLE
    assert outcome_code({ExitCode.MEMORY_TIMEOUT, unkillable}) is unkillable
    assert outcome_code({ExitCode.HELD_BY_OTHERS, unkillable}) is unkillable


def test_a_respawner_is_named_before_the_respawn_it_left_dying() -> None:
    found = {ExitCode.UNKILLABLE, ExitCode.RESPAWNING}
    assert outcome_code(found) is ExitCode.RESPAWNING


def test_an_error_code_is_no_run_outcome() -> None:
    assert outcome_code({ExitCode.CONFIG}) is ExitCode.OK


def test_the_documented_order_is_the_codes() -> None:
    text = (REPO / "docs" / "hardening.md").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("Precedence:")]
    named = [int(n) for n in re.findall(r"\b(\d+) [A-Z_]+", line)]
    assert named == [int(code) for code in RUN_OUTCOMES]


# --- bounded echo --------------------------------------------------------------------------

HUGE = "GPU-" + "a" * 10_000_000


@pytest.mark.message
def test_an_unknown_uuid_in_the_config_is_cut(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    config = host.root / "c.toml"
    # Under the 1 MiB a config file may hold (rule 2 refuses a larger one unread).
    config.write_text(f'gpus = ["{HUGE[:900_000]}"]\nlock_dir = "{host.root}/locks"\n')
    code = main(
        ["pre", "vllm.service", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
        unit_state=lambda _: "inactive",
    )
    err = capsys.readouterr().err
    assert code == ExitCode.CONFIG
    assert err.count("\n") == 1 and len(err) < 300, err[:300]
    assert "no GPU has UUID GPU-aaaa" in err and "…" in err


@pytest.mark.parametrize(
    "items",
    [[HUGE, HUGE], ["GPU-" + "z" * 1000], [{"x": "y" * 1000}]],
)
def test_gpu_list_errors_are_cut(items: list[object]) -> None:
    with pytest.raises(InvalidValue) as raised:
        gpu_refs(items)
    assert len(str(raised.value)) < 2 * ECHO_MAX + 80


@pytest.mark.parametrize(
    "toml",
    [
        f"containers = [{json.dumps('bad name ' * 1000)}]",
        f"lock_dir = {json.dumps('relative/' * 1000)}",
        f"protected_units = [{json.dumps('x' * 10_000)}]",
        f"gpus = [{json.dumps(HUGE[:100_000])}, {json.dumps(HUGE[:100_000])}]",
    ],
)
def test_config_field_errors_are_cut(toml: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(toml + "\n", "c.toml")
    assert len(raised.value.message) < 400, raised.value.message[:400]


# --- every code the documentation names ----------------------------------------------------

DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "packaging" / "gpugate.catalog",
    REPO / "packaging" / "gpugate.1",
]
# "exit 22", "exits 81", "exit code 25", "(exit 21)", "exits 0": the prose's way of naming one.
# Not shell code quoted in the prose (`sh -c 'exit 7'`: the command's status, not gpugate's).
PROSE = re.compile(r"(?<!['\"])\bexit(?:s|ing|ed)?(?: code| status)? (\d{1,3})\b")
# "exit 22 (HELD_BY_OTHERS)", "25 (RESPAWNING)", "`status=73/CANTCREAT`": a code with its name.
NAMED = re.compile(r"\b(\d{1,3}) \(([A-Z][A-Z_]+)\)")
ROW = re.compile(r"^\| (\d+) \| ([A-Z_]+) \|", re.MULTILINE)
# The man page's EXIT STATUS list (".B 73" then "STATE_UNWRITABLE ..."), the catalog's
# "unkillable 20": a name with its code.
MAN_ITEM = re.compile(r"^\.B (\d+)\n([A-Z_]+)", re.MULTILINE)
LOWER = re.compile(r"\b([a-z][a-z_]+) (\d{1,3})\b")


def test_every_code_the_docs_name_is_one_the_code_uses() -> None:
    codes = {int(code) for code in ExitCode}
    for doc in DOCS:
        text = doc.read_text()
        for match in PROSE.finditer(text):
            assert int(match.group(1)) in codes, f"{doc.name}: {match.group(0)!r} is no exit code"
        for number, name in NAMED.findall(text) + ROW.findall(text) + MAN_ITEM.findall(text):
            if name in ExitCode.__members__:
                assert ExitCode[name] == int(number), f"{doc.name}: {number} ({name})"
        for name, number in LOWER.findall(text):
            one_word = name in {"unkillable", "config", "respawning"}  # else an ordinary word
            if name.upper() in ExitCode.__members__ and ("_" in name or one_word):
                assert ExitCode[name.upper()] == int(number), f"{doc.name}: {name} {number}"


def test_the_man_page_lists_every_code_and_no_other() -> None:
    text = (REPO / "packaging" / "gpugate.1").read_text()
    listed = {int(n): name for n, name in MAN_ITEM.findall(text)}
    assert {n: name for n, name in listed.items() if n} == {
        int(code): code.name for code in ExitCode if code
    }


def test_every_code_is_named_in_the_readme_table_and_back() -> None:
    rows = {int(n): name for n, name in ROW.findall((REPO / "README.md").read_text())}
    assert rows == {int(code): code.name for code in ExitCode}


def test_the_prose_names_respawning_as_25() -> None:
    """The issue's case: README once said 226."""
    readme = (REPO / "README.md").read_text()
    assert "226" not in readme
    assert re.search(r"respawning at the deadline: exit 25\b", readme)
