"""How a refusal names another workload (issue 46): a pod's scope by its pod, from its lease;
the setting that would let both run, never kill_other_units; a sharer in words."""

from __future__ import annotations

import pytest

from gpugate.config.schema import GateConfig
from gpugate.core.decide import Rule, Verdict, decide
from gpugate.core.discover import Holder, Source
from gpugate.phase import Phase
from gpugate.report.narrate import reason_text
from tests.unit.test_decide import Table, discovery, proc

POD = "/kubepods.slice/kubepods-besteffort.slice/cri-containerd-" + "a" * 64 + ".scope"
SCOPE = "cri-containerd-" + "a" * 64 + ".scope"
LABEL = "containerd container ml/vllm-0/server (aaaaaaaaaaaa)"
pytestmark = pytest.mark.message


def refusal(cgroup: str, shared: frozenset[int] = frozenset()):  # type: ignore[no-untyped-def]
    table = Table({10: proc(10, 1, cgroup)})
    found = discovery(table, {10: Holder(table.procs[10], {Source.NVML}, {0})}, [0])
    (choice,) = decide(found, GateConfig(), Phase.PRE, table, shared=shared).choices
    return choice


def test_a_pods_scope_is_named_as_its_pod_where_its_lease_says() -> None:
    choice = refusal(POD)
    assert choice.verdict is Verdict.BLOCK and choice.rule is Rule.OTHER_UNIT
    named = reason_text(choice, "b.service", "pre", {SCOPE: LABEL}.get)
    assert named.startswith(f"{LABEL} holds GPU 0 (scope {SCOPE}); ")
    assert "share_gpus = true" in named and "kill_other_units" not in named
    unnamed = reason_text(choice, "b.service", "pre", {}.get)
    assert unnamed.startswith(f"active unit {SCOPE} holds GPU 0; ")
    assert "kill_other_units" not in unnamed


def test_a_sharer_is_said_to_share_on_purpose() -> None:
    choice = refusal(POD, frozenset({0}))
    assert (choice.verdict, choice.rule) == (Verdict.SPARE, Rule.SHARER)
    words = reason_text(choice, "b.service", "pre", {SCOPE: LABEL}.get)
    assert words == f"{LABEL} shares GPU 0 with b.service on purpose: a sharer, left alone"
