"""The discovery benchmark at a tiny scale, as a correctness check: gpugate's discover() and
scan, fuser and lsof must name the same holders of the stand-in GPU files (no timing is
asserted; speed lives in bench/)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
