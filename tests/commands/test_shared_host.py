"""Units that share a host, end to end through run_phase and the CLI, with real processes on
stand-in device files: GPU leases, gpus = "auto", NVML faults on other GPUs, manual runs, and
one deadline per failed start."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpugate.config.file import LoadedConfig, parse_config
from gpugate.config.values import BUILTIN_SOURCE
from gpugate.core.discover import owned_gpus
from gpugate.core.outcome import RunSummary
from gpugate.core.run import RunScope
from gpugate.errors import ConfigError, ExitCode, GateError, NvmlUnavailable
from gpugate.front.cli import main
from gpugate.host.nvml import Gpu
from gpugate.host.systemd import unit_environment
from gpugate.integrations.records import read_leases
from gpugate.integrations.unit import manual_run_guard
from gpugate.phase import Phase
from gpugate.report.journal import PRIORITY_WARNING, Reporter
from tests.fakes import (
    UNIT,
    UNIT_CGROUP,
    FakeHost,
    RecordingJournal,
    RecordingNotifier,
    alive,
    raises_error,
    run_unit_phase,
)

A, B = "a.service", "b.service"


def env(show: str):  # type: ignore[no-untyped-def]
    return lambda unit: unit_environment(unit, show=lambda _: show)


def run(  # type: ignore[no-untyped-def]
    host: FakeHost,
    phase: str,
    unit: str = UNIT,
    loaded: LoadedConfig | None = None,
    journal: RecordingJournal | None = None,
    **kwargs,
) -> RunSummary:
    reporter = Reporter(
        unit, phase, journal=journal or host.journal, notifier=host.notifier, echo=False
    )
    return run_unit_phase(
        RunScope(
            Phase(phase), unit, lambda: UNIT_CGROUP if unit == UNIT else f"/system.slice/{unit}"
        ),
        loaded or host.config(),
        reporter,
        roots=host.roots,
        driver_factory=lambda: host.memory,
        **({"environ": {}} | kwargs),
    )


def with_gpus(host: FakeHost, gpus: list[int], **fields: object) -> LoadedConfig:
    return host.config(gpus=gpus, **fields)


# --- leases ---------------------------------------------------------------------------


def test_a_leased_refusal_names_every_lease_holder_in_its_fields(host: FakeHost) -> None:
    """GPUGATE_LEASE_UNIT of a `leased` refusal: each unit whose lease refuses the start
    (comma-separated, sorted), not the leases elsewhere; nothing killed."""
    c, d = "c.service", "d.service"
    running = {A: "active", c: "active", d: "active"}
    for unit, gpus in ((c, [2, 3]), (A, [0, 1]), (d, [6])):
        assert run(host, "pre", unit, with_gpus(host, gpus), unit_state=running.get).exit_code is (
            ExitCode.OK
        )
    refused = run(host, "pre", B, with_gpus(host, [1, 2, 4]), unit_state=running.get)
    assert refused.exit_code is ExitCode.HELD_BY_OTHERS
    (event,) = host.journal.events("refused")
    assert (event["GPUGATE_REASON"], event["GPUGATE_GPU"]) == ("leased", "1,2")
    assert event["GPUGATE_LEASE_UNIT"] == "a.service,c.service"
    assert sorted(lease.unit for lease in read_leases(host.root / "locks").leases) == [A, c, d]


@pytest.mark.root("not root, a run warns of the open files it cannot read")
def test_overlapping_unit_is_refused_until_the_lease_holder_stops(host: FakeHost) -> None:
    (orphan,) = host.pool.holder(host.gpu_files(4))
    host.memory.claim(orphan, {4}, 3000)
    running = {A: "activating"}
    state = running.get

    first = run(host, "pre", A, with_gpus(host, [0, 1, 2, 3]), unit_state=state)
    assert first.exit_code is ExitCode.OK
    (lease,) = read_leases(host.root / "locks").leases
    assert (lease.unit, lease.gpus) == (A, (0, 1, 2, 3))

    second = run(host, "pre", B, with_gpus(host, [2, 3, 4, 5]), unit_state=state)
    assert second.exit_code is ExitCode.HELD_BY_OTHERS
    assert alive(orphan), "a refused pre kills nothing"
    (refused,) = host.journal.events("refused")
    assert (refused["GPUGATE_REASON"], refused["GPUGATE_GPU"]) == ("leased", "2,3")
    assert refused["GPUGATE_LEASE_UNIT"] == A

    running[A] = "failed"  # a's server died and its post never ran: the lease is stale
    third = run(host, "pre", B, with_gpus(host, [2, 3, 4, 5]), unit_state=state)
    assert third.exit_code is ExitCode.OK and not alive(orphan)
    stale = [e for e in host.journal.events("warning") if e["GPUGATE_REASON"] == "lease-stale"]
    assert [(e["GPUGATE_LEASE_UNIT"], e["GPUGATE_LEASE_UNIT_STATE"]) for e in stale] == [
        ("a.service", "failed")
    ]
    assert [lease.unit for lease in read_leases(host.root / "locks").leases] == [B]
    run(host, "pre", B, with_gpus(host, [2, 3, 4, 5]), unit_state=state)
    assert len(host.journal.events("warning")) == 1, "said once: the stale lease is gone"

    assert run(host, "post", B, with_gpus(host, [2, 3, 4, 5])).exit_code is ExitCode.OK
    assert read_leases(host.root / "locks").leases == []


def test_dry_run_reports_the_lease_and_writes_nothing(host: FakeHost) -> None:
    run(host, "pre", A, with_gpus(host, [0]), unit_state=lambda _: "active")
    summary = run(host, "pre", B, with_gpus(host, [0]), unit_state=lambda _: "active", dry_run=True)
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS
    assert [lease.unit for lease in read_leases(host.root / "locks").leases] == [A]


@pytest.mark.parametrize("share", [(True, True), (True, False), (False, True)])
def test_sharing_needs_both_units_to_agree(host: FakeHost, share: tuple[bool, bool]) -> None:
    active = lambda _: "active"  # noqa: E731
    run(host, "pre", A, with_gpus(host, [1], share_gpus=share[0]), unit_state=active)
    second = run(host, "pre", B, with_gpus(host, [1], share_gpus=share[1]), unit_state=active)
    expected = ExitCode.OK if all(share) else ExitCode.HELD_BY_OTHERS
    assert second.exit_code is expected


@pytest.mark.parametrize("trial", range(5))
def test_units_started_at_the_same_moment_one_wins(host: FakeHost, trial: int) -> None:
    # Both units are activating (systemd runs both pres at once); the locks give them turns.
    results: dict[str, ExitCode] = {}
    barrier = threading.Barrier(2)

    def start(unit: str, gpus: list[int]) -> None:
        barrier.wait()
        journal = RecordingJournal()
        results[unit] = run(
            host, "pre", unit, with_gpus(host, gpus), journal, unit_state=lambda _: "activating"
        ).exit_code

    threads = [
        threading.Thread(target=start, args=(A, [0, 1, 2, 3])),
        threading.Thread(target=start, args=(B, [2, 3, 4, 5])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results.values()) == [ExitCode.OK, ExitCode.HELD_BY_OTHERS], trial
    (lease,) = read_leases(host.root / "locks").leases
    assert results[lease.unit] is ExitCode.OK


# --- gpus = "auto" --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("show", "mine", "theirs"),
    [
        ("Environment=CUDA_VISIBLE_DEVICES=4,5\n", 4, 1),
        ("Environment=NVIDIA_VISIBLE_DEVICES=2\n", 2, 3),
        ("Environment=NVIDIA_VISIBLE_DEVICES=7 CUDA_VISIBLE_DEVICES=0\n", 0, 7),
        (f"Environment=CUDA_VISIBLE_DEVICES=GPU-fa4e5a11-0000-0000-0000-{6:012x}\n", 6, 5),
    ],
)
def test_auto_takes_the_units_own_visible_devices(
    host: FakeHost, show: str, mine: int, theirs: int
) -> None:
    (on_mine,) = host.pool.holder(host.gpu_files(mine))
    (on_theirs,) = host.pool.holder(host.gpu_files(theirs))
    host.memory.claim(on_mine, {mine}, 5000)
    host.memory.claim(on_theirs, {theirs}, 5000)

    summary = run(host, "pre", unit_env=env(show))

    assert summary.exit_code is ExitCode.OK
    assert not alive(on_mine) and alive(on_theirs)
    (started,) = host.journal.events("run_started")
    assert started["GPUGATE_GPU_SOURCE"].endswith("(Environment=)")
    (lease,) = read_leases(host.root / "locks").leases
    assert mine in lease.gpus and theirs not in lease.gpus


def test_all_gpus_without_config_or_environment_is_a_warning(host: FakeHost) -> None:
    builtin = LoadedConfig(host.config().config, BUILTIN_SOURCE)
    run(host, "pre", loaded=builtin, unit_env=env("Environment=\n"))
    (started,) = host.journal.events("run_started")
    assert started["PRIORITY"] == str(PRIORITY_WARNING)
    assert read_leases(host.root / "locks").leases == [], "no lease on GPUs nothing named"
    run(host, "pre", unit_env=env("Environment=\n"))  # a config file exists: no warning
    assert host.journal.events("run_started")[1]["PRIORITY"] != str(PRIORITY_WARNING)


def test_config_check_shows_the_resolved_gpus(
    host: FakeHost, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "gpugate.integrations.unit.unit_environment",
        env("Environment=CUDA_VISIBLE_DEVICES=4,5\n"),
    )
    config = host.root / "c.toml"
    config.write_text("")
    assert main(["config", "check", str(config), "--unit", UNIT]) == 0
    out = capsys.readouterr().out
    # the effective config printed is the unit's: its GPUs as the unit's environment names them
    printed = "\n".join(line for line in out.splitlines() if not line.startswith("#"))
    assert parse_config(printed, "-").gpus == (4, 5)


# --- NVML faults kept to the unit's GPUs ----------------------------------------------


@pytest.mark.parametrize("lost", [{6}, {4, 7}, {5}])
def test_a_lost_gpu_the_unit_does_not_own_is_a_warning(host: FakeHost, lost: set[int]) -> None:
    (worker,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(worker, {1}, 8000)
    host.memory.lost = lost

    summary = run(host, "pre", loaded=with_gpus(host, [0, 1, 2, 3]))

    assert summary.exit_code is ExitCode.OK and not alive(worker)
    warnings = [e for e in host.journal.events("warning") if e["GPUGATE_REASON"] == "gpu-fault"]
    assert sorted(int(e["GPUGATE_GPU"]) for e in warnings) == sorted(lost)
    assert all(e["PRIORITY"] == str(PRIORITY_WARNING) for e in warnings)


@pytest.mark.root("not root, a run warns of the open files it cannot read")
def test_a_failing_query_on_another_gpu_is_a_warning(host: FakeHost) -> None:
    host.memory.failing_usage = {5}
    assert run(host, "post", loaded=with_gpus(host, [0])).exit_code is ExitCode.OK
    assert [e["GPUGATE_GPU"] for e in host.journal.events("warning")] == ["5"]


@pytest.mark.parametrize(
    ("gpus", "lost"),
    [([6], {6}), ([0, 6], {6}), ("all", {3}), (["GPU-fa4e5a11-0000-0000-0000-000000000002"], {2})],
)
def test_a_fault_on_the_units_own_gpu_fails_it(
    host: FakeHost, gpus: object, lost: set[int]
) -> None:
    host.memory.lost = lost
    with pytest.raises(NvmlUnavailable) as raised:
        run(host, "pre", loaded=host.config(gpus=gpus))
    assert raised.value.exit_code is ExitCode.NVML_UNAVAILABLE
    assert not (host.root / "locks" / "leases").is_dir() or not any(
        (host.root / "locks" / "leases").iterdir()
    ), "no lease for a run that failed"


# --- manual runs ----------------------------------------------------------------------


def cli(host: FakeHost, *args: str, state: str | None = "active") -> int:
    config = host.root / "c.toml"
    config.write_text(
        f'gpus = [0]\nlock_dir = "{host.root / "locks"}"\n[pre]\nsigterm_grace_s = 1\n'
        "[post]\nsigterm_grace_s = 1\n"
    )
    return main(
        [*args, "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
        reporter_factory=lambda unit, phase: Reporter(
            unit, phase, journal=host.journal, notifier=RecordingNotifier(), echo=False
        ),
        unit_state=lambda _: state,
    )


@pytest.mark.parametrize("phase", ["pre", "post"])
@pytest.mark.parametrize("state", ["active", "activating", "reloading"])
def test_a_hand_typed_run_on_a_running_unit_kills_nothing(
    host: FakeHost, capsys: pytest.CaptureFixture[str], phase: str, state: str
) -> None:
    server, *workers = host.pool.holder(host.gpu_files(0), children=2)
    host.put_in_unit(server, *workers)

    assert cli(host, phase, UNIT, state=state) == ExitCode.MANUAL_RUN_REFUSED

    assert all(alive(pid) for pid in [server, *workers])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert not host.journal.events("signal_sent")


def test_dry_run_and_force_are_allowed_and_a_stopped_unit_is_not_guarded(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    (server,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(server)
    assert cli(host, "pre", UNIT, "--dry-run") == 0 and alive(server)
    assert cli(host, "pre", UNIT, "--force") == 0 and not alive(server)
    (again,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(again)
    assert cli(host, "post", UNIT, state="inactive") == 0 and not alive(again)
    (third,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(third)
    assert cli(host, "post", UNIT, state=None) == 0 and not alive(third)  # no systemd


def test_the_units_own_hook_is_told_apart(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/system.slice/vllm.service\n")
    hook = {"INVOCATION_ID": "0123"}

    def refused(unit: str, environ: dict[str, str]) -> bool:
        return manual_run_guard(Phase.PRE, unit, lambda _: "active", environ, proc) is not None

    assert not refused(UNIT, hook)
    assert refused(UNIT, {}), "no INVOCATION_ID: not a hook"
    assert refused("other.service", hook), "another unit's hook"
    (proc / "self" / "cgroup").write_text("0::/user.slice/user-0.slice/session-3.scope\n")
    assert refused(UNIT, hook), "a shell that copied INVOCATION_ID"
    (proc / "self" / "cgroup").write_text("0::/system.slice/vllm.service\n")
    asked: list[str] = []
    assert manual_run_guard(Phase.PRE, UNIT, asked.append, hook, proc) is None  # type: ignore[arg-type]
    assert asked == [], "the unit's own hook does not ask systemd"


# --- one deadline per failed start ----------------------------------------------------


def test_post_after_a_failed_pre_kills_but_does_not_wait_again(host: FakeHost) -> None:
    host.memory.leaked_mib[2] = 50000  # a driver that never frees it
    hook = {"INVOCATION_ID": "f00d", "SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited"}
    loaded = host.config(gpus=[2], pre={"wait_timeout_s": 1.0})
    pre = run(host, "pre", loaded=loaded, environ=hook)
    assert pre.exit_code is ExitCode.MEMORY_TIMEOUT
    assert read_leases(host.root / "locks").leases == []
    (member,) = host.pool.holder(host.gpu_files(2))
    host.put_in_unit(member)  # what ExecStartPre= left behind, if anything

    post = run(host, "post", loaded=loaded, environ=hook)

    assert not alive(member), "post still kills the cgroup"
    assert post.seconds_wait == 0.0, "and does not wait on the memory pre already waited for"

    def said(event: str) -> list[dict[str, str]]:
        return [e for e in host.journal.events(event) if e.get("GPUGATE_REASON") == "failed-start"]

    (skipped,) = said("timeout")
    assert skipped["GPUGATE_GPU"] == "2"
    (failed,) = said("error")
    assert failed["GPUGATE_FAILED_START"].startswith("GPU 2 (")
    last = host.journal.entries[-1][0]  # last, for `systemctl status`
    assert failed["GPUGATE_FAILED_START"] in last and host.notifier.states[-1].endswith(
        last
    )  # STATUS=, shown by systemctl status


def test_post_of_another_start_waits_as_before(host: FakeHost) -> None:
    host.memory.leaked_mib[2] = 50000
    loaded = host.config(gpus=[2], pre={"wait_timeout_s": 1.0}, post={"wait_timeout_s": 1.0})
    run(host, "pre", loaded=loaded, environ={"INVOCATION_ID": "one"})
    post = run(host, "post", loaded=loaded, environ={"INVOCATION_ID": "two"})
    assert post.exit_code is ExitCode.MEMORY_TIMEOUT and post.seconds_wait > 0
    # a pre that succeeds clears what an earlier failure left
    host.memory.leaked_mib.clear()
    run(host, "pre", loaded=loaded, environ={"INVOCATION_ID": "three"})
    post = run(
        host, "post", loaded=loaded, environ={"INVOCATION_ID": "three", "SERVICE_RESULT": "signal"}
    )
    assert not [e for e in host.journal.events("error") if e["GPUGATE_REASON"] == "failed-start"]


def test_a_pre_that_succeeds_on_unnamed_gpus_leaves_no_failure(host: FakeHost) -> None:
    """All GPUs only because nothing named the unit's: no lease, and no failure record either
    (a post of the same start must not say that it failed)."""
    hook = {"INVOCATION_ID": "cafe", "SERVICE_RESULT": "signal"}
    pre = run(host, "pre", environ=hook, unit_env=env("Environment=\n"))
    assert pre.exit_code is ExitCode.OK
    assert not (host.root / "locks" / "failed").exists() or not any(
        (host.root / "locks" / "failed").iterdir()
    )
    run(host, "post", environ=hook, unit_env=env("Environment=\n"))
    assert not [e for e in host.journal.events("error") if e["GPUGATE_REASON"] == "failed-start"]


def test_a_pre_that_raised_is_recorded_too(host: FakeHost) -> None:
    host.memory.lost = {3}
    hook = {"INVOCATION_ID": "beef", "SERVICE_RESULT": "exit-code"}
    with pytest.raises(GateError):
        run(host, "pre", loaded=host.config(gpus=[3]), environ=hook)
    host.memory.lost = set()
    run(host, "post", loaded=host.config(gpus=[3]), environ=hook)
    (failed,) = [
        e for e in host.journal.events("error") if e.get("GPUGATE_REASON") == "failed-start"
    ]
    assert failed["GPUGATE_FAILED_START"]  # the pre's error, recorded though it raised


def test_a_uuid_prefix_names_the_one_gpu_it_starts(host: FakeHost) -> None:
    gpus = [Gpu(0, "GPU-aaaa1111-0", 0, "x", 1), Gpu(1, "GPU-aaaa2222-1", 1, "x", 1)]
    assert owned_gpus(("GPU-aaaa2222",), gpus, "s") == [gpus[1]]
    assert owned_gpus(("gpu-AAAA1111-0",), gpus, "s") == [gpus[0]]
    with raises_error(ConfigError, field="gpus"):
        owned_gpus(("GPU-aaaa",), gpus, "s")
    with raises_error(ConfigError, field="gpus"):
        owned_gpus(("GPU-bbbbbbbb",), gpus, "s")
    # through the unit's environment: an ambiguous prefix is a config error, nothing killed
    (orphan,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(orphan, {1}, 100)
    with raises_error(ConfigError, field="gpus"):
        run(host, "pre", unit_env=env("Environment=CUDA_VISIBLE_DEVICES=GPU-fa4e5a11-0000\n"))
    assert alive(orphan)


# --- hand runs (gpugate run) -------------------------------------------------------------


@pytest.mark.root("not root, a run warns of the open files it cannot read")
def test_a_hand_runs_lease_says_who_started_it_and_force_runs_onto_it(host: FakeHost) -> None:
    hand = "gpugate-run-vllm-ab12cd.service"
    by = {"GPUGATE_STARTED_BY": "alice (uid 1000, /dev/pts/3)"}
    assert run(host, "pre", hand, with_gpus(host, [0, 1]), environ=by).exit_code is ExitCode.OK
    (lease,) = read_leases(host.root / "locks").leases
    assert lease.started_by == "alice (uid 1000, /dev/pts/3)"

    refused = run(host, "pre", B, with_gpus(host, [1, 2]), unit_state=lambda _: "active")
    assert refused.exit_code is ExitCode.HELD_BY_OTHERS
    (event,) = host.journal.events("refused")
    assert (event["GPUGATE_REASON"], event["GPUGATE_GPU"]) == ("leased", "1")

    forced = run(
        host,
        "pre",
        B,
        with_gpus(host, [1, 2]),
        unit_state=lambda _: "active",
        ignore_leases=True,
    )
    assert forced.exit_code is ExitCode.OK
    warned = host.journal.events("warning")
    assert [(e["GPUGATE_REASON"], e["GPUGATE_LEASE_UNIT"]) for e in warned] == [
        ("lease-forced", hand)
    ]
    # The environment (a unit's EnvironmentFile=) forces nothing: only pre --ignore-leases.
    for value in ("1", "yes"):
        again = run(
            host,
            "pre",
            A,
            with_gpus(host, [0]),
            unit_state=lambda _: "active",
            environ={"GPUGATE_RUN_FORCE": value},
        )
        assert again.exit_code is ExitCode.HELD_BY_OTHERS
