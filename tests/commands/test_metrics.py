"""The node_exporter textfile: parsed with prometheus-client's own parser, its values checked
against what each run reported in the journal, accumulated across runs and processes."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpugate.config.file import parse_config
from gpugate.errors import ConfigError, ExitCode, NvmlUnavailable
from gpugate.front.cli import main
from gpugate.host.nvml import Gpu
from gpugate.host.scan import ProcessId
from gpugate.integrations.metrics import record_run, render, run_record
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from tests.commands.test_oci_hook_run import A_ID, A_SCOPE, hook
from tests.fakes import UNIT, UNIT_CGROUP, FakeHost, alive, run_summary

Key = tuple[str, tuple[tuple[str, str], ...]]
GPU0 = Gpu(0, "GPU-0", 0, "NVIDIA H100", 81559)


def parse(text: str) -> dict[Key, float]:
    values: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in values, f"sample {key} twice"
            values[key] = sample.value
    return values


def key(name: str, **labels: str) -> Key:
    return (name, tuple(sorted(labels.items())))


def gpu_labels(host: FakeHost, index: int, unit: str = UNIT) -> dict[str, str]:
    return {"unit": unit, "gpu": str(index), "uuid": host.memory.gpus()[index].uuid}


def write_config(host: FakeHost, metrics: Path, *, pre_wait_s: float = 10) -> Path:
    path = host.root / f"gpugate-{pre_wait_s}.toml"
    path.write_text(
        f'metrics_textfile = "{metrics}"\n'
        f'lock_dir = "{host.root}/locks"\n'
        f"[pre]\nsigterm_grace_s = {min(1, pre_wait_s / 4)}\nsigkill_wait_s = {min(1, pre_wait_s / 4)}\n"
        f"wait_timeout_s = {pre_wait_s}\n"
        "[post]\nsigterm_grace_s = 1\nwait_timeout_s = 10\n"
    )
    return path


def gpugate(host: FakeHost, *argv: str, driver: object = None) -> int:
    return main(
        list(argv),
        driver_factory=(lambda: host.memory) if driver is None else driver,  # type: ignore[arg-type,return-value]
        reporter_factory=lambda unit, phase, **_: host.reporter(phase),
        roots=host.roots,
    )


@pytest.fixture
def metrics(host: FakeHost) -> Path:
    return host.root / "textfile" / "gpugate.prom"


def test_values_match_what_the_run_reported(host: FakeHost, metrics: Path) -> None:
    host.memory.release_lag_s = 2.0  # the driver frees late: the run waits for it
    first, second = host.pool.holder(host.gpu_files(2)), host.pool.holder(host.gpu_files(5))
    host.put_in_unit(*first, *second)
    host.memory.claim(first[0], {2}, 3000)
    host.memory.claim(second[0], {5}, 1000)
    config = write_config(host, metrics)

    before = time.time()
    assert gpugate(host, "post", UNIT, "--config", str(config)) == 0
    after = time.time()

    assert not alive(first[0]) and not alive(second[0])
    (finished,) = host.journal.events("run_finished")
    values = parse(metrics.read_text())
    run = {"phase": "post", "unit": UNIT}
    assert values[key("gpugate_runs_total", **run, result="success")] == 1
    assert values[key("gpugate_processes_killed_total", **run)] == int(finished["GPUGATE_KILLED"])
    assert values[key("gpugate_processes_killed_total", **run)] == 2
    waited = values[key("gpugate_wait_seconds_total", **run)]
    assert waited == pytest.approx(float(finished["GPUGATE_SECONDS_WAIT"]), abs=0.001)
    assert waited > 0
    reclaimed = {
        index: values[key("gpugate_reclaimed_mib_total", **gpu_labels(host, index))]
        for index in range(8)
    }
    assert reclaimed == {0: 0, 1: 0, 2: 3000, 3: 0, 4: 0, 5: 1000, 6: 0, 7: 0}
    assert sum(reclaimed.values()) == int(finished["GPUGATE_FREED_MIB"])
    for index in range(8):
        stamp = values[key("gpugate_last_success_timestamp_seconds", **gpu_labels(host, index))]
        assert before <= stamp <= after
    assert values[key("gpugate_last_run_failed", **run)] == 0
    # kill to free: at least the driver's late release, at most the whole run
    released = values[key("gpugate_memory_release_seconds_sum", **run)]
    assert 2.0 <= released <= after - before
    assert values[key("gpugate_memory_release_seconds_count", **run)] == 1
    buckets = {
        float(dict(labels)["le"]): value
        for (name, labels), value in values.items()
        if name == "gpugate_memory_release_seconds_bucket"
    }
    assert buckets[float("inf")] == 1
    assert all(v == (bound >= released) for bound, v in buckets.items())


@pytest.mark.parametrize(
    ("phase", "phases", "unit"),
    [
        ("pre", ("pre", "post"), UNIT),
        ("post", ("pre", "post"), "x@1.service"),
        ("prolog", ("prolog", "epilog"), "slurm"),
        ("epilog", ("prolog", "epilog"), "slurm"),
    ],
)
@pytest.mark.parametrize("result", ["success", "memory_timeout", "held_by_others", "config"])
def test_first_write_puts_every_result_of_the_units_phases_at_zero(
    tmp_path: Path, phase: str, phases: tuple[str, ...], unit: str, result: str
) -> None:
    """increase() sees no rise in a series born at 1: every series a later failure of this
    unit can land in exists at 0 from the first write on, and the gauge says 1 at once."""
    textfile = tmp_path / "gpugate.prom"
    record_run(
        textfile, run_record(phase, unit, ExitCode[result.upper().replace("SUCCESS", "OK")], None)
    )
    values = parse(textfile.read_text())
    results = ["success", *(code.name.lower() for code in ExitCode if code is not ExitCode.OK)]
    for each_phase in phases:
        for each in results:
            count = values[key("gpugate_runs_total", phase=each_phase, unit=unit, result=each)]
            assert count == (1 if (each_phase, each) == (phase, result) else 0)
    assert values[key("gpugate_last_run_failed", phase=phase, unit=unit)] == (result != "success")
    # a second run keeps the counts and flips the gauge
    record_run(textfile, run_record(phase, unit, ExitCode.OK, None))
    values = parse(textfile.read_text())
    assert values[key("gpugate_runs_total", phase=phase, unit=unit, result="success")] == (
        2 if result == "success" else 1
    )
    assert values[key("gpugate_last_run_failed", phase=phase, unit=unit)] == 0
    assert not any(name.startswith("gpugate_memory_release") for name, _ in values)


def test_release_histogram_accumulates_by_bucket(tmp_path: Path) -> None:
    textfile = tmp_path / "gpugate.prom"
    observed = [0.05, 0.3, 0.3, 4.0, 400.0]
    for seconds in observed:
        killed = run_summary(killed=[ProcessId(10, 1)], seconds_kill=seconds, owned=[GPU0])
        record_run(textfile, run_record("post", UNIT, ExitCode.OK, killed))
    families = {f.name: f for f in text_string_to_metric_families(textfile.read_text())}
    histogram = families["gpugate_memory_release_seconds"]
    assert histogram.type == "histogram"
    buckets = {
        float(s.labels["le"]): s.value for s in histogram.samples if s.name.endswith("_bucket")
    }
    for bound, value in buckets.items():
        assert value == sum(1 for seconds in observed if seconds <= bound)
    sums = [s.value for s in histogram.samples if s.name.endswith("_sum")]
    assert sums == [pytest.approx(sum(observed))]


def test_counters_accumulate_and_failures_keep_last_success(host: FakeHost, metrics: Path) -> None:
    config = write_config(host, metrics)
    (member,) = host.pool.holder(host.gpu_files(2))
    host.put_in_unit(member)
    host.memory.claim(member, {2}, 3000)
    assert gpugate(host, "post", UNIT, "--config", str(config)) == 0
    first = parse(metrics.read_text())
    # The stand-in cgroup.procs is a plain file: drop the member, as the kernel would.
    (host.cgroup_root / UNIT_CGROUP.lstrip("/") / "cgroup.procs").write_text("")

    (orphan,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(orphan, {2}, 2000)
    assert gpugate(host, "pre", UNIT, "--config", str(config)) == 0

    host.memory.leaked_mib[4] = 2048
    short = write_config(host, metrics, pre_wait_s=0.3)
    assert gpugate(host, "pre", UNIT, "--config", str(short)) == ExitCode.MEMORY_TIMEOUT

    values = parse(metrics.read_text())
    assert values[key("gpugate_runs_total", phase="post", unit=UNIT, result="success")] == 1
    assert values[key("gpugate_runs_total", phase="pre", unit=UNIT, result="success")] == 1
    assert values[key("gpugate_runs_total", phase="pre", unit=UNIT, result="memory_timeout")] == 1
    assert values[key("gpugate_processes_killed_total", phase="post", unit=UNIT)] == 1
    assert values[key("gpugate_processes_killed_total", phase="pre", unit=UNIT)] == 1
    assert values[key("gpugate_reclaimed_mib_total", **gpu_labels(host, 2))] == 5000
    last = "gpugate_last_success_timestamp_seconds"
    # The failed run left GPU 4 busy: its last success is still the second run's.
    success_2 = values[key(last, **gpu_labels(host, 2))]
    assert values[key(last, **gpu_labels(host, 4))] == success_2
    assert success_2 > first[key(last, **gpu_labels(host, 2))]


def test_textfile_is_replaced_atomically(host: FakeHost, metrics: Path) -> None:
    config = write_config(host, metrics)
    assert gpugate(host, "post", UNIT, "--config", str(config)) == 0
    with metrics.open() as old:
        old_inode = os.fstat(old.fileno()).st_ino
        assert gpugate(host, "post", UNIT, "--config", str(config)) == 0
        # A reader that opened the file before the rewrite still reads the whole old file.
        old_values = parse(old.read())
    new_values = parse(metrics.read_text())
    runs = key("gpugate_runs_total", phase="post", unit=UNIT, result="success")
    assert (old_values[runs], new_values[runs]) == (1, 2)
    assert metrics.stat().st_ino != old_inode
    assert sorted(p.name for p in metrics.parent.iterdir()) == [
        "gpugate.prom",
        "gpugate.prom.lock",
        "gpugate.prom.state",
    ]


def _record_many(path: str, count: int) -> None:
    for _ in range(count):
        killed = run_summary(killed=[ProcessId(10, 1)])
        record_run(Path(path), run_record("post", UNIT, ExitCode.OK, killed))


def test_concurrent_runs_lose_no_count(metrics: Path) -> None:
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_record_many, args=(str(metrics), 10)) for _ in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    values = parse(metrics.read_text())
    assert values[key("gpugate_runs_total", phase="post", unit=UNIT, result="success")] == 60
    assert values[key("gpugate_processes_killed_total", phase="post", unit=UNIT)] == 60


def test_errors_are_counted_and_dry_runs_are_not(host: FakeHost, metrics: Path) -> None:
    config = write_config(host, metrics)

    def broken() -> object:
        raise NvmlUnavailable("NVML: the NVIDIA kernel driver is not loaded")

    assert (
        gpugate(host, "pre", UNIT, "--config", str(config), driver=broken)
        == ExitCode.NVML_UNAVAILABLE
    )
    assert gpugate(host, "pre", UNIT, "--config", str(config), "--dry-run") == 0
    values = parse(metrics.read_text())
    runs = {k: v for k, v in values.items() if k[0] == "gpugate_runs_total" and v}
    assert runs == {key("gpugate_runs_total", phase="pre", unit=UNIT, result="nvml_unavailable"): 1}
    assert values[key("gpugate_last_run_failed", phase="pre", unit=UNIT)] == 1
    assert key("gpugate_last_run_failed", phase="post", unit=UNIT) not in values


@pytest.mark.parametrize("phase", ["pre", "post"])
@pytest.mark.parametrize("layout", ["file-as-folder", "folder-as-file", "below-a-file"])
def test_an_unwritable_textfile_is_a_warning_never_the_runs_failure(
    host: FakeHost, capsys: pytest.CaptureFixture[str], layout: str, phase: str
) -> None:
    """Metrics are never a run's failure (docs/metrics.md): a textfile that cannot be written
    is a warning in the journal (GPUGATE_REASON=metrics-unwritable) and on stderr, the run
    kills and frees as without metrics, and its exit is what it would be without them."""
    blocker = host.root / "not-a-folder"
    if layout == "file-as-folder":
        blocker.write_text("")
        textfile = blocker / "gpugate.prom"
    elif layout == "below-a-file":
        blocker.write_text("")
        textfile = blocker / "deeper" / "gpugate.prom"
    else:
        (blocker / "gpugate.prom").mkdir(parents=True)
        textfile = blocker / "gpugate.prom"
    config = write_config(host, textfile)
    (member,) = host.pool.holder(host.gpu_files(1))
    host.put_in_unit(member)
    host.reporter = lambda phase="pre": Reporter(  # type: ignore[method-assign]
        UNIT, phase, journal=host.journal, notifier=host.notifier, echo=True
    )
    assert gpugate(host, phase, UNIT, "--config", str(config)) == ExitCode.OK
    assert not alive(member)
    (warned,) = [
        e for e in host.journal.events("warning") if e["GPUGATE_REASON"] == "metrics-unwritable"
    ]
    assert str(textfile) in warned["MESSAGE"]
    err = capsys.readouterr().err
    assert str(textfile) in err  # echoed on stderr too
    assert host.journal.events("error") == []


def test_label_values_are_escaped() -> None:
    odd = 'vllm\\x2dold"\n.service'
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    from gpugate.integrations.metrics import apply

    summary = run_summary(
        killed=[ProcessId(pid, 1) for pid in (10, 11, 12)],
        seconds_wait=0.25,
        owned=[GPU0],
        freed_mib_by_gpu={0: 7},
    )
    apply(samples, "post", odd, ExitCode.OK, summary, 1700000000.5)
    values = parse(render(samples))
    assert values[key("gpugate_processes_killed_total", phase="post", unit=odd)] == 3
    assert values[key("gpugate_wait_seconds_total", phase="post", unit=odd)] == 0.25
    assert values[key("gpugate_reclaimed_mib_total", unit=odd, gpu="0", uuid="GPU-0")] == 7
    stamp = key("gpugate_last_success_timestamp_seconds", unit=odd, gpu="0", uuid="GPU-0")
    assert values[stamp] == 1700000000.5


def test_config_check_shows_the_textfile_and_the_slurm_phases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpugate.compat import tomllib

    unset = tmp_path / "unset.toml"
    unset.write_text("[epilog]\nwait_timeout_s = 30\n")
    assert main(["config", "check", str(unset)]) == 0
    effective = tomllib.loads(capsys.readouterr().out)
    assert "metrics_textfile" not in effective
    assert effective["epilog"] == {**effective["prolog"], "wait_timeout_s": 30.0}
    assert effective["epilog"]["kill_orphans"] is True
    assert effective["post"]["kill_orphans"] is False

    textfile = tmp_path / "set.toml"
    textfile.write_text('metrics_textfile = "/var/lib/node_exporter/textfile_collector/g.prom"\n')
    assert main(["config", "check", str(textfile)]) == 0
    assert tomllib.loads(capsys.readouterr().out)["metrics_textfile"] == (
        "/var/lib/node_exporter/textfile_collector/g.prom"
    )

    relative = tmp_path / "relative.toml"
    relative.write_text('metrics_textfile = "gpugate.prom"\n')
    assert main(["config", "check", str(relative)]) == ExitCode.CONFIG
    assert capsys.readouterr().err.count("\n") == 1  # one line, no traceback
    with pytest.raises(ConfigError) as refused:  # the field it names
        parse_config(relative.read_text(), str(relative))
    assert (refused.value.source, refused.value.field) == (str(relative), "metrics_textfile")


@pytest.mark.parametrize("blocked", ["textfile", "locks/leases"])
def test_a_containers_hooks_go_on_without_metrics_and_poststop_without_its_lease_folder(
    host: FakeHost, blocked: str
) -> None:
    """A container's start (the hook's pre) kills the stale holder and starts with an
    unwritable metrics textfile (a warning); its poststop ends 0 also where its lease cannot
    be removed (a warning, GPUGATE_REASON=state-not-recorded)."""
    (stale,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(stale, {1}, 4000)
    (host.root / "textfile").write_text("")
    real = host.config
    host.config = lambda **o: real(  # type: ignore[method-assign]
        **{"metrics_textfile": host.root / "textfile" / "gpugate.prom", **o}
    )
    running = {A_SCOPE: "active"}
    assert hook(host, Phase.PRE, A_ID, [], running, devices=[1]) == ExitCode.OK
    assert not alive(stale)
    if blocked == "locks/leases":
        for lease in (host.root / "locks" / "leases").iterdir():
            lease.unlink()
        (host.root / "locks" / "leases").rmdir()
        (host.root / "locks" / "leases").write_text("")
    running[A_SCOPE] = "deactivating"
    assert hook(host, Phase.POST, A_ID, [], running, devices=[1]) == ExitCode.OK
    reasons = [e["GPUGATE_REASON"] for e in host.journal.events("warning")]
    assert reasons.count("metrics-unwritable") == 2, reasons
    assert ("state-not-recorded" in reasons) is (blocked == "locks/leases"), reasons
    assert host.journal.events("error") == []
