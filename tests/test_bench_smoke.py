"""The discovery benchmark at a tiny scale, as a correctness check: gpugate's discover() and
scan, fuser and lsof must name the same holders of the stand-in GPU files (no timing is
asserted; speed lives in bench/)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench import nri_cost, pre_cost
from bench.crowd import REPO
from bench.discovery import FUSER, GPUGATE, GPUGATE_SCAN, LSOF, measure_discovery
from bench.stage import Stage


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the sleepers")
@pytest.mark.skipif(shutil.which("fuser") is None, reason="needs fuser (psmisc)")
def test_gpugate_and_fuser_find_the_same_holders(tmp_path: Path) -> None:
    with_lsof = shutil.which("lsof") is not None
    result = measure_discovery(Stage(tmp_path), 50, 1, with_lsof=with_lsof, with_floor=False)
    assert len(result.expected) == 9  # one fd holder per GPU file, one that only maps nvidia3
    assert result.holders[GPUGATE] == result.expected
    assert result.holders[GPUGATE_SCAN] == result.expected
    assert result.holders[FUSER] == result.expected
    if with_lsof:
        assert result.holders[LSOF] == result.expected
    assert result.on_host >= 50 + len(result.expected)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the sleepers")
@pytest.mark.skipif(shutil.which("fuser") is None, reason="needs fuser (psmisc)")
@pytest.mark.skipif(
    not (REPO / ".venv" / "bin" / "gpugate").exists(),
    reason="needs the tree's .venv (scripts/setup) with its gpugate console script",
)
def test_pre_cost_runs_every_command_on_a_clean_stand_in_host() -> None:
    cpu = pre_cost.measure(5, 1)  # raises where a command fails or pre kills anything
    assert set(cpu) == {
        pre_cost.FLOOR,
        pre_cost.PRE,
        pre_cost.EDITED,
        pre_cost.FUSER,
        pre_cost.PYNVML,
    }
    assert all(len(values) == 1 and values[0] > 0 for values in cpu.values())


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the stand-in NVML")
def test_nri_cost_gates_each_gpu_pod_and_answers_each_gpu_less_one() -> None:
    """bench/nri_cost.py against the plugin on a stand-in host: every GPU-less call answered,
    every pod with a GPU leased at CreateContainer and given back after StopContainer (measure
    raises where one is not)."""
    got = nri_cost.measure(0.0, 3, 2)
    assert len(got.trips) == 3 and len(got.gpu_trips) == 2
    assert got.connected_kib > 0 and got.per_gpu_pod_s > 0
