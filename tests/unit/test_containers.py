"""Containers: runtime and id from the cgroup path, the name from the runtime's CLI (a real
script standing in for `docker`/`podman` in the system folders gpugate searches), the refusal that names the container and
the field to set, and `containers = [...]` making a container's processes the unit's own."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpugate.config.file import parse_config
from gpugate.core.decide import Rule, Verdict, decide
from gpugate.core.discover import Discovery, Holder, Source
from gpugate.core.roles import Role
from gpugate.errors import ConfigError, ExitCode
from gpugate.host import safe_files
from gpugate.host.containers import (
    Container,
    container_names,
    container_of_cgroup,
    container_scopes,
)
from gpugate.host.nvml import Gpu
from gpugate.phase import Phase
from gpugate.report.narrate import reason_text
from tests.fakes import FakeHost, alive
from tests.unit.test_decide import Table, proc

ID = "3f2a1b0c4d5e" + "a" * 52
OTHER_ID = "9" * 64
GPUS = [Gpu(i, f"GPU-{i:08x}-0000", i, "g", 1000) for i in range(8)]

# Answers `inspect` from NAMES/ID files, and `stop` the way the runtime does: it signals
# the container's processes (here, those in its stand-in cgroup) and returns.
FAKE_CLI = textwrap.dedent(
    """\
    #!/bin/sh
    here=$(dirname "$0")
    echo "$(basename "$0") $*" >> "$here/calls.log"
    [ -e "$here/hang" ] && exec sleep 30
    case "$1" in
    inspect)
        shift 4; rc=0
        for id in "$@"; do
            if [ -e "$here/names/$id" ]; then echo "$id /$(cat "$here/names/$id")"
            else echo "Error: No such container: $id" >&2; rc=1; fi
        done
        exit $rc;;
    stop)
        for pid in $(cat "$(cat "$here/cgroup_root")"/*.slice/*-"$4".scope/cgroup.procs); do kill -KILL "$pid"; done
        echo "$4";;
    esac
    """
)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    bin_dir = tmp_path / "cli"
    (bin_dir / "names").mkdir(parents=True)
    for runtime in ("docker", "podman"):
        (bin_dir / runtime).write_text(FAKE_CLI)
        (bin_dir / runtime).chmod(0o755)
    (bin_dir / "cgroup_root").write_text(str(tmp_path / "cgroup"))
    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(bin_dir),))
    yield bin_dir


@pytest.mark.parametrize(
    ("cgroup", "runtime", "scope"),
    [
        (f"/system.slice/docker-{ID}.scope", "docker", f"/system.slice/docker-{ID}.scope"),
        (f"/machine.slice/libpod-{ID}.scope", "podman", f"/machine.slice/libpod-{ID}.scope"),
        (  # crun: one level below the scope
            f"/machine.slice/libpod-{ID}.scope/container",
            "podman",
            f"/machine.slice/libpod-{ID}.scope",
        ),
        (f"/system.slice/docker-{ID}.scope/init", "docker", f"/system.slice/docker-{ID}.scope"),
        (  # kubelet with the systemd cgroup driver (dockershim)
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/docker-{ID}.scope",
            "docker",
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/docker-{ID}.scope",
        ),
        (  # podman --cgroup-parent=machine-gpu.slice
            f"/machine.slice/machine-gpu.slice/libpod-{ID}.scope",
            "podman",
            f"/machine.slice/machine-gpu.slice/libpod-{ID}.scope",
        ),
    ],
)
def test_runtime_and_id_from_the_cgroup(cgroup: str, runtime: str, scope: str) -> None:
    assert container_of_cgroup(cgroup) == Container(runtime, ID, scope)


@pytest.mark.parametrize(
    "cgroup",
    [
        "/system.slice/docker.service",  # dockerd itself
        "/system.slice/containerd.service",
        f"/machine.slice/libpod-conmon-{ID}.scope",  # podman's monitor, not the container
        "/system.slice/docker-abc.scope",  # not a container id
        f"/system.slice/docker-{ID}.scopex",
        f"/system.slice/mydocker-{ID}.service",
        "/user.slice/user-0.slice/session-1.scope",
        "/",
        None,
        # Not anchored under the runtime's own parent (issue 26, rule 4): names an account picks.
        f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope",  # rootless
        f"/user.slice/user-1000.slice/user@1000.service/app.slice/docker-{ID}.scope",
        f"/user.slice/user-1000.slice/docker-{ID}.scope",
        f"/system.slice/vllm.service/docker-{ID}.scope",  # inside a Delegate= unit
        f"/system.slice/vllm.service/sub.slice/docker-{ID}.scope",
        f"/machine.slice/machine-x.scope/libpod-{ID}.scope",
        f"/system.slice/libpod-{ID}.scope",  # podman's scopes are machine.slice's
        f"/machine.slice/docker-{ID}.scope",
        f"/docker-{ID}.scope",
        f"/system.slice/docker-{ID.upper()}.scope",
    ],
)
def test_other_cgroups_are_no_container(cgroup: str | None) -> None:
    assert container_of_cgroup(cgroup) is None


def test_names_ids_and_prefixes_match() -> None:
    named = Container("docker", ID, "/s", "vllm")
    assert named.matches(["vllm"]) and named.matches([ID]) and named.matches([ID[:12]])
    assert not named.matches(["vllm2", ID[:11], "VLLM", OTHER_ID[:12]])
    unnamed = Container("podman", ID, "/s")
    assert unnamed.matches([ID[:16]]) and not unnamed.matches(["vllm"])
    assert (named.handle, unnamed.handle) == ("vllm", ID[:12])


@pytest.mark.message
def test_a_label_names_the_runtime_the_name_and_the_short_id() -> None:
    named, unnamed = Container("docker", ID, "/s", "vllm"), Container("podman", ID, "/s")
    assert (named.label, unnamed.label) == (
        f"docker container vllm ({ID[:12]})",
        f"podman container {ID[:12]}",
    )


def test_names_come_from_one_inspect_per_runtime(cli: Path) -> None:
    (cli / "names" / ID).write_text("vllm")
    containers = [
        Container("docker", ID, "/a"),
        Container("docker", OTHER_ID, "/b"),  # gone already: inspect exits 1, prints the rest
        Container("podman", OTHER_ID[:-1] + "8", "/c"),
    ]
    assert [c.name for c in container_names(containers)] == ["vllm", None, None]
    calls = [line.split() for line in (cli / "calls.log").read_text().splitlines()]
    inspect = ["inspect", "--type", "container", "--format", "{{.Id}}", "{{.Name}}"]
    assert calls == [
        ["docker", *inspect, ID, OTHER_ID],
        ["podman", *inspect, OTHER_ID[:-1] + "8"],
    ]


def test_a_hanging_cli_is_cut_off_and_the_id_shown(
    cli: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (cli / "names" / ID).write_text("vllm")
    (cli / "hang").write_text("")
    monkeypatch.setattr("gpugate.host.containers.INSPECT_TIMEOUT_S", 0.5)
    (found,) = container_names([Container("docker", ID, "/a")])  # ProgramUnavailable: no name
    assert found.name is None and found.label.endswith(ID[:12])  # the id stands for the name


def test_no_cli_no_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(tmp_path),))
    assert container_names([Container("docker", ID, "/a")])[0].name is None


@pytest.mark.message
@pytest.mark.parametrize(
    ("cgroup", "runtime"),
    [
        (f"/system.slice/docker-{ID}.scope", "docker"),
        (f"/machine.slice/libpod-{ID}.scope", "podman"),
        (f"/machine.slice/libpod-{ID}.scope/container", "podman"),
    ],
)
def test_refusal_names_the_container_and_the_field(cgroup: str, runtime: str) -> None:
    table = Table({10: proc(10, 1, cgroup)})
    container = container_of_cgroup(cgroup)
    assert container is not None
    holder = Holder(table.procs[10], {Source.NVML}, {0}, container=container)
    holder.container = Container(container.runtime, container.id, container.scope, "vllm")
    found = Discovery(
        "vllm.service",
        "/system.slice/vllm.service",
        GPUS,
        GPUS[:1],
        {},
        {10: holder},
        frozenset(),
        [],
    )
    decision = decide(found, parse_config("", "-"), Phase.PRE, table)
    (choice,) = decision.blockers
    assert decision.refused and choice.role is Role.OTHER_UNIT
    assert choice.rule is Rule.OTHER_CONTAINER
    # The wording itself: the hint names the setting and the install command.
    reason = reason_text(choice, "vllm.service", "pre")
    assert reason.startswith(f"{runtime} container vllm ({ID[:12]}) holds GPU 0")
    assert 'set containers = ["vllm"]' in reason
    assert "gpugate install vllm.service --container vllm" in reason
    # never the setting that would kill it; the one that would let both run
    assert "kill_other_units" not in reason and "share_gpus = true" in reason
    # named in the config: the unit's own, killed also where it holds another GPU too
    holder.sources.add(Source.CONTAINER)
    holder.gpus.add(5)
    allowed = decide(found, parse_config('containers = ["vllm"]', "-"), Phase.PRE, table)
    (kill,) = allowed.targets
    assert (kill.role, kill.verdict) == (Role.UNIT_CONTAINER, Verdict.KILL)
    assert not allowed.refused


@pytest.mark.parametrize(
    "text",
    [
        'containers = ["-x"]',
        'containers = ["a b"]',
        'containers = ["vllm", "vllm"]',
        'containers = "vllm"',
    ],
)
def test_bad_containers_field_names_file_and_field(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "/etc/gpugate/vllm.service.toml")
    refused = caught.value
    assert (refused.source, refused.field) == ("/etc/gpugate/vllm.service.toml", "containers")
    assert refused.exit_code is ExitCode.CONFIG


def put_in_container(host: FakeHost, pid: int, kind: str, container_id: str) -> str:
    slice_ = "system.slice" if kind == "docker" else "machine.slice"
    scope = f"/{slice_}/{kind}-{container_id}.scope"
    host.put_in_unit(pid, cgroup=scope)
    return scope


@pytest.mark.parametrize("runtime", ["docker", "podman"])
def test_pre_stops_the_units_container_through_its_runtime(
    host: FakeHost, cli: Path, runtime: str
) -> None:
    kind = "docker" if runtime == "docker" else "libpod"
    (cli / "names" / ID).write_text("vllm")
    (cli / "names" / OTHER_ID).write_text("tgi")
    engine, shell = host.pool.holder(host.gpu_files(0, 1), children=1)
    put_in_container(host, engine, kind, ID)
    put_in_container(host, shell, kind, ID)  # holds no GPU: still the container's
    (bystander,) = host.pool.holder([])
    put_in_container(host, bystander, kind, OTHER_ID)
    assert container_scopes(host.cgroup_root)[0].id in {ID, OTHER_ID}

    summary = host.run_phase(
        "pre",
        host.config(containers=["vllm"]),
        host.reporter("pre"),
        driver_factory=lambda: host.memory,
    )

    assert summary.exit_code is ExitCode.OK
    assert not alive(engine) and not alive(shell) and alive(bystander)
    stops = [c for c in (cli / "calls.log").read_text().splitlines() if " stop " in c]
    assert stops == [f"{runtime} stop --time 1 {ID}"]
    (stopped,) = [
        e for e in host.journal.events("signal_sent") if e["GPUGATE_SIGNAL"].endswith("stop")
    ]
    assert stopped["GPUGATE_CONTAINER"] == ID
    assert stopped["GPUGATE_SIGNAL"] == f"{runtime} stop"
    found = host.journal.events("holder_found")
    assert {e["GPUGATE_PID"] for e in found} == {str(engine), str(shell)}
    assert all(e["GPUGATE_CONTAINER_NAME"] == "vllm" for e in found)
    assert all(e["GPUGATE_ROLE"] == "unit-container" for e in found)


def test_post_kills_the_container_by_pinned_signals_only(host: FakeHost, cli: Path) -> None:
    (cli / "names" / ID).write_text("vllm")
    (engine,) = host.pool.holder(host.gpu_files(2))
    put_in_container(host, engine, "docker", ID)
    summary = host.run_phase(
        "post",
        host.config(containers=[ID[:12]]),
        host.reporter("post"),
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.OK and not alive(engine)
    assert " stop " not in (cli / "calls.log").read_text()
    (sent, *_) = host.journal.events("signal_sent")
    assert sent["GPUGATE_SIGNAL"] == "SIGTERM" and sent["GPUGATE_CONTAINER"] == ID


def test_runtime_stop_that_fails_falls_back_to_signals(host: FakeHost, cli: Path) -> None:
    (cli / "names" / ID).write_text("vllm")
    (cli / "docker").write_text(
        "#!/bin/sh\n[ \"$1\" = stop ] && { echo 'daemon down' >&2; exit 1; }\n"
        + FAKE_CLI.split("\n", 1)[1]
    )
    (engine,) = host.pool.holder(host.gpu_files(3))
    put_in_container(host, engine, "docker", ID)
    summary = host.run_phase(
        "pre",
        host.config(containers=["vllm"]),
        host.reporter("pre"),
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.OK and not alive(engine)
    sent = [(e["GPUGATE_SIGNAL"], e.get("GPUGATE_PID")) for e in host.journal.events("signal_sent")]
    # the runtime's stop first (it failed), then the pinned signals to the container's process
    assert sent[0][0] == "docker stop" and ("SIGTERM", str(engine)) in sent[1:]
