"""Issue 26, rule 4: a unit name decides something only where PID 1 made that unit. Over many
cgroup paths (nested slices, escaped and templated names, Delegate= subtrees, user managers'
units with system units' names, container scopes anywhere): the unit of a cgroup is the first
component below the slices; nothing under user.slice is protected by its name or counts as
another unit; container scopes count only under their runtime's own parent slice."""

from __future__ import annotations

from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpugate.config.schema import GateConfig
from gpugate.core.decide import Rule, Verdict, decide
from gpugate.core.discover import Holder, Source
from gpugate.core.roles import Role, role_of
from gpugate.host.containers import container_of_cgroup
from gpugate.host.systemd import (
    find_unit_cgroup,
    is_user_cgroup,
    own_unit,
    system_unit_of_cgroup,
    unit_of_cgroup,
)
from gpugate.phase import Phase
from tests.unit.test_decide import Table, discovery, proc

ID = "3f2a1b0c4d5e" + "a" * 52
PROTECTED = ("nvidia-persistenced.service", "nvidia-fabricmanager.service", "dcgm.service")
# Names a unit may have: plain, escaped (systemd-escape), templated instances, scopes.
UNIT_NAMES = st.sampled_from(
    [
        *PROTECTED,
        "vllm.service",
        r"prod\x2dvllm.service",
        "vllm@0.service",
        r"vllm@a\x2db.service",
        "run-u12.scope",
        "session-3.scope",
        "init.scope",
        f"docker-{ID}.scope",
        f"libpod-{ID}.scope",
        "user@1000.service",
    ]
)
SLICE_WORDS = st.text("abcdefgh0123456789", min_size=1, max_size=6)


@st.composite
def slice_chain(draw: st.DrawFn, top: str | None = None) -> list[str]:
    """Nested slices as systemd names them: a.slice/a-b.slice/a-b-c.slice."""
    first = top or draw(st.sampled_from(["system", "machine", "kubepods", "app", "gpu"]))
    chain = [first]
    for _ in range(draw(st.integers(0, 3))):
        chain.append(chain[-1] + "-" + draw(SLICE_WORDS))
    return [name + ".slice" for name in chain]


SUBTREE = st.lists(
    st.one_of(
        UNIT_NAMES, SLICE_WORDS.map(lambda w: w + ".slice"), SLICE_WORDS, st.just(".control")
    ),
    max_size=4,
)


def path(*parts: str) -> str:
    return "/" + "/".join(parts)


@settings(max_examples=300, deadline=None)
@given(slice_chain(), UNIT_NAMES, SUBTREE)
@example(["system.slice"], "vllm.service", [".control"])
@example(["system.slice"], "vllm.service", ["payload", "nvidia-persistenced.service"])
def test_the_unit_is_the_first_component_below_the_slices(
    slices: list[str], unit: str, below: list[str]
) -> None:
    cgroup = path(*slices, unit, *below)
    assert unit_of_cgroup(cgroup) == unit
    assert system_unit_of_cgroup(cgroup) == (None if unit == "user@1000.service" else unit)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**31), UNIT_NAMES, SUBTREE, st.booleans())
@example(1000, "nvidia-persistenced.service", [], True)
def test_nothing_under_user_slice_names_a_system_unit(
    uid: int, unit: str, below: list[str], in_manager: bool
) -> None:
    """A login session's scope and a user manager's units: the account picks those names."""
    top = ["user.slice", f"user-{uid}.slice"]
    parts = [*top, f"user@{uid}.service", "app.slice", unit] if in_manager else [*top, unit]
    cgroup = path(*parts, *below)
    assert is_user_cgroup(cgroup)
    assert system_unit_of_cgroup(cgroup) is None
    assert container_of_cgroup(cgroup) is None
    config = GateConfig(protected_units=PROTECTED)
    info = proc(10, 1, cgroup, uid=uid)
    found = discovery(Table({10: info}), {}, [0])
    assert role_of(info, found, config) is Role.ORPHAN


def test_a_user_unit_named_like_a_protected_one_is_killed_as_a_stale_server() -> None:
    """Issue 26's case: `systemd-run --user --unit=nvidia-persistenced vllm serve ...`."""
    user_unit = (
        "/user.slice/user-1000.slice/user@1000.service/app.slice/nvidia-persistenced.service"
    )
    table = Table(
        {
            10: proc(10, 1, user_unit, uid=1000),
            20: proc(20, 1, "/system.slice/nvidia-persistenced.service"),
        }
    )
    holders = {
        10: Holder(table.procs[10], {Source.NVML}, {0}),
        20: Holder(table.procs[20], {Source.DEVICE_FD}, {0}),
    }
    decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
    by_pid = {choice.holder.pid: choice for choice in decision.choices}
    assert (by_pid[10].verdict, by_pid[10].rule) == (Verdict.KILL, Rule.ORPHAN)
    assert (by_pid[20].verdict, by_pid[20].rule) == (Verdict.SPARE, Rule.PROTECTED)


@settings(max_examples=200, deadline=None)
@given(slice_chain(top="system"), st.sampled_from(PROTECTED), SUBTREE)
def test_a_protected_name_inside_another_unit_protects_nothing(
    slices: list[str], name: str, below: list[str]
) -> None:
    """A Delegate= unit (or any unit's own sub-cgroups) may make folders of any name: the
    process is that unit's, refused as another unit's, never protected."""
    cgroup = path(*slices, "batch.service", *below, name)
    info = proc(10, 1, cgroup, uid=1000)
    found = discovery(Table({10: info}), {}, [0])
    assert role_of(info, found, GateConfig()) is Role.OTHER_UNIT
    holder = Holder(info, {Source.NVML}, {0})
    decision = decide(
        discovery(Table({10: info}), {10: holder}, [0]), GateConfig(), Phase.PRE, Table({10: info})
    )
    (choice,) = decision.choices
    assert (choice.verdict, choice.other_unit) == (Verdict.BLOCK, "batch.service")


@settings(max_examples=200, deadline=None)
@given(slice_chain(top="system"), st.sampled_from(PROTECTED), SUBTREE)
def test_a_system_unit_is_protected_by_its_name_with_any_subtree(
    slices: list[str], name: str, below: list[str]
) -> None:
    info = proc(10, 1, path(*slices, name, *below))
    found = discovery(Table({10: info}), {}, [0])
    assert role_of(info, found, GateConfig(protected_units=PROTECTED)) is Role.PROTECTED


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["docker", "libpod"]),
    st.lists(
        st.sampled_from(
            [
                "system.slice",
                "machine.slice",
                "kubepods.slice",
                "user.slice",
                "user-1000.slice",
                "user@1000.service",
                "app.slice",
                "vllm.service",
                "x.scope",
                "payload",
            ]
        ),
        max_size=4,
    ),
    st.lists(SLICE_WORDS, max_size=2),
)
def test_container_scopes_count_only_under_their_runtime_parent(
    kind: str, above: list[str], below: list[str]
) -> None:
    cgroup = path(*above, f"{kind}-{ID}.scope", *below)
    found = container_of_cgroup(cgroup)
    parents = {"docker": {"system.slice", "kubepods.slice"}, "libpod": {"machine.slice"}}
    anchored = (
        bool(above)
        and all(p.endswith(".slice") for p in above)
        and above[0] in parents[kind]
        and not is_user_cgroup(cgroup)
    )
    assert (found is not None) == anchored
    if found is not None:
        assert found.scope == path(*above, f"{kind}-{ID}.scope") and found.id == ID


def tree(root: Path, *cgroups: str) -> None:
    for cgroup in cgroups:
        (root / cgroup.lstrip("/")).mkdir(parents=True)


def test_find_unit_cgroup_takes_the_system_unit_only(tmp_path: Path) -> None:
    name = "nvidia-persistenced.service"
    tree(
        tmp_path,
        f"/user.slice/user-1000.slice/user@1000.service/app.slice/{name}",
        f"/system.slice/batch.service/{name}",
    )
    assert find_unit_cgroup(name, tmp_path) is None
    tree(tmp_path, f"/system.slice/system-nvidia.slice/{name}")
    assert find_unit_cgroup(name, tmp_path) == f"/system.slice/system-nvidia.slice/{name}"
    assert find_unit_cgroup("vllm@0.service", tmp_path) is None
    tree(tmp_path, "/system.slice/system-vllm.slice/vllm@0.service")
    assert find_unit_cgroup("vllm@0.service", tmp_path) == (
        "/system.slice/system-vllm.slice/vllm@0.service"
    )


def test_own_unit_is_a_system_service(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    for line, unit in [
        ("0::/system.slice/vllm.service/.control", "vllm.service"),
        ("0::/system.slice/system-vllm.slice/vllm@0.service", "vllm@0.service"),
        ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service", None),
        ("0::/system.slice/batch.service/inner/vllm.service", "batch.service"),
    ]:
        (tmp_path / "self" / "cgroup").write_text(line + "\n")
        assert own_unit(tmp_path) == unit, line
