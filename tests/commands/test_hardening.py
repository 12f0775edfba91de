"""Races, faults, bad input and concurrency (issue 6). Each test fails without its protection."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpugate.config.file import parse_config
from gpugate.errors import ConfigError, ExitCode, LockTimeout, NvmlUnavailable
from gpugate.front.cli import main
from gpugate.host.locks import gpu_locks
from gpugate.host.nvml import Gpu, GpuUsage
from gpugate.host.systemd import HostRoots
from tests.fake_nvml.build import BuildError, build_fake_nvml
from tests.fakes import FakeGpuMemory, FakeHost, RecordingJournal, alive, as_nobody

REPO = Path(__file__).resolve().parents[2]


def test_holder_that_forks_while_dying_is_found_in_a_later_round(host: FakeHost) -> None:
    # On SIGTERM the holder forks a child that keeps its device handle, then exits.
    script = textwrap.dedent(
        f"""
        import os, signal, time
        handle = open({str(host.dev / "nvidia0")!r}, "rb")
        def on_term(signum, frame):
            # The child takes SIGTERM blocked: one sent before it has reset the parent's
            # handler stays pending, so it dies of it rather than forking again.
            signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                with open({str(host.root / "child.pid")!r}, "w") as f:
                    f.write(str(os.getpid()))
                # it keeps the parent's context, and its memory, through the inherited fd
                with open({str(host.root / "claims")!r} + f"/{{os.getpid()}}", "w") as f:
                    f.write("0 5000")
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM}})
                time.sleep(3600)
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        open({str(host.root / "armed")!r}, "w").close()
        time.sleep(3600)
        """
    )
    (host.root / "claims").mkdir()
    host.memory.claim_dir = host.root / "claims"
    # The context's memory outlives the parent while the child holds the fd (and a little).
    host.memory.release_lag_s = 1.0
    parent = host.pool.command([sys.executable, "-c", script])
    deadline = time.monotonic() + 15
    while not (host.root / "armed").exists():  # its SIGTERM handler is in place
        assert time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.02)
    host.memory.claim(parent.pid, {0}, 5000)
    summary = host.run_phase(
        "pre", host.config(), host.reporter(), driver_factory=lambda: host.memory
    )
    child = int((host.root / "child.pid").read_text())
    host.pool.started.append((child, 0))
    assert summary.exit_code is ExitCode.OK
    assert summary.rounds == 2
    assert not alive(parent.pid) and not alive(child)


def _hold_lock_in_child(lock_dir: Path, gpus: list[Gpu]) -> subprocess.Popen[str]:
    code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from gpugate.host.locks import gpu_locks
        from gpugate.host.nvml import Gpu
        gpus = [Gpu(i, u, i, "g", 1) for i, u in {[(g.index, g.uuid) for g in gpus]!r}]
        with gpu_locks(Path({str(lock_dir)!r}), gpus, time.monotonic() + 5):
            print("locked", flush=True)
            time.sleep(3600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_overlapping_runs_serialise_disjoint_do_not_and_crashed_holder_frees(
    tmp_path: Path,
) -> None:
    gpus = FakeGpuMemory().gpus()
    holder = _hold_lock_in_child(tmp_path, [gpus[0], gpus[1]])
    waited: list[int] = []
    try:
        with (
            pytest.raises(LockTimeout),
            gpu_locks(
                tmp_path,
                [gpus[1], gpus[2]],
                time.monotonic() + 0.3,
                on_wait=lambda gpu: waited.append(gpu.index),
            ),
        ):
            pass
        assert waited == [1]  # it waited on the held GPU, then gave up at its deadline
        with gpu_locks(
            tmp_path,
            [gpus[2], gpus[3]],
            time.monotonic() + 5,
            on_wait=lambda gpu: waited.append(gpu.index),
        ):
            assert waited == [1]  # disjoint GPUs: taken without waiting on anyone
    finally:
        holder.kill()  # a crashed gpugate: its flock dies with it
        holder.wait()
    with gpu_locks(tmp_path, [gpus[0], gpus[1]], time.monotonic() + 2):
        pass


class FailsMidRun(FakeGpuMemory):
    """Works for discovery, then loses GPU 2 while gpugate waits."""

    def usage(self, gpu: Gpu) -> GpuUsage:
        if self.queries >= 8:
            raise NvmlUnavailable(
                "NVML: GPU 2 is lost (fell off the bus); it needs a reset or reboot"
            )
        return super().usage(gpu)


def test_nvml_lost_mid_run_fails_or_goes_on_per_policy(host: FakeHost) -> None:
    (member,) = host.pool.holder([])
    host.put_in_unit(member)
    memory = FailsMidRun(leaked_mib={0: 5000})
    with pytest.raises(NvmlUnavailable):
        host.run_phase("post", host.config(), host.reporter("post"), driver_factory=lambda: memory)
    memory = FailsMidRun(leaked_mib={0: 5000})
    summary = host.run_phase(
        "post",
        host.config(post={"on_nvml_error": "warn"}),
        host.reporter("post"),
        driver_factory=lambda: memory,
    )
    assert summary.exit_code is ExitCode.OK
    assert any(e["GPUGATE_REASON"] == "nvml-degraded" for e in host.journal.events("warning"))


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_fake_nvml(tmp_path_factory.mktemp("nvml")).parent
    except BuildError as exc:
        pytest.skip(f"cannot build the stand-in NVML: {exc}")


@pytest.mark.message
@pytest.mark.parametrize(
    ("settings_text", "message"),
    [
        ("init_error = 9", "gpugate: NVML: the NVIDIA kernel driver is not loaded"),
        ("lost_gpus = 3", "gpugate: NVML: GPU 3 is lost (fell off the bus)"),
        ("memory_not_supported = 1", "gpugate: NVML: GPU 0 does not support"),
        ("init_error = 4", "gpugate: NVML: permission denied"),
    ],
)
def test_driver_faults_through_real_pynvml(
    fake_lib: Path, tmp_path: Path, settings_text: str, message: str
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    settings_file = tmp_path / "nvml.conf"
    settings_file.write_text(
        f"dev_root = {dev}\nstate_dir = {tmp_path / 'state'}\n{settings_text}\n"
    )
    config = tmp_path / "c.toml"
    config.write_text(
        f'lock_dir = "{tmp_path}/locks"\n[pre]\nwait_timeout_s = 2\n'
        "sigterm_grace_s = 0.5\nsigkill_wait_s = 0.5\n"
    )
    env = {
        **os.environ,
        "FAKE_NVML_CONFIG": str(settings_file),
    }
    roots = [
        "--host-roots",
        f"dev={dev},cgroup={tmp_path},run={tmp_path}",
        "--nvml-library",
        str(fake_lib / "libnvidia-ml.so.1"),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "gpugate", *roots, "pre", "vllm.service", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    expected = ExitCode.PERMISSION if "permission" in message else ExitCode.NVML_UNAVAILABLE
    assert result.returncode == expected, result.stderr
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    config.write_text(config.read_text() + 'on_nvml_error = "warn"\n')
    if expected is ExitCode.NVML_UNAVAILABLE:
        warned = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpugate",
                *roots,
                "pre",
                "vllm.service",
                "--config",
                str(config),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert warned.returncode == 0, warned.stderr  # on_nvml_error = "warn": it went on


@pytest.mark.message
@pytest.mark.root("as root it sees every process and drops to another account")
def test_not_root_says_what_it_cannot_see(host: FakeHost) -> None:
    host.pool.holder(host.gpu_files(0))

    def dry_run_as_nobody() -> dict[str, Any]:
        journal = RecordingJournal()
        reporter = host.reporter()
        reporter.journal = journal
        summary = host.run_phase(
            "pre", host.config(), reporter, dry_run=True, driver_factory=lambda: host.memory
        )
        return {"code": int(summary.exit_code), "messages": [m for m, _ in journal.entries]}

    data = as_nobody(dry_run_as_nobody)
    (warning,) = [m for m in data["messages"] if "not permitted to read the open files of" in m]
    assert "run gpugate as root" in warning
    assert not warning.split("(PID ")[1].startswith("1, 2,"), (
        "kernel threads are not hidden holders"
    )


@pytest.mark.root("as root it sees every process and drops to another account")
def test_gpu_listed_by_nvml_but_invisible_in_proc_is_reported(host: FakeHost) -> None:
    host.memory.listed_without_memory[1] = [4194303]  # a PID no process here has
    summary = host.run_phase(
        "pre",
        host.config(pre={"wait_timeout_s": 0.3}),
        host.reporter(),
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.MEMORY_TIMEOUT
    invisible = [e for e in host.journal.events("warning")]
    assert [(e["GPUGATE_REASON"], e["GPUGATE_PID"]) for e in invisible] == [
        ("other-pid-namespace", "4194303")
    ]


toml_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.text(max_size=20).map(json.dumps),
    st.lists(st.integers(-3, 12), max_size=4).map(lambda v: "[" + ", ".join(map(str, v)) + "]"),
)
keys = st.sampled_from(
    ["gpus", "free_mib", "kill_other_units", "protected_units", "pre", "nope", "lock_dir", "post"]
)
sub_keys = st.sampled_from(
    ["kill_orphans", "sigterm_grace_s", "wait_timeout_s", "on_timeout", "lock_dir", "bogus"]
)


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    lines = [f"{draw(keys)} = {draw(toml_scalars)}" for _ in range(draw(st.integers(0, 4)))]
    for table in draw(
        st.lists(st.sampled_from(["pre", "post", "epilog", "x"]), max_size=2, unique=True)
    ):
        lines.append(f"[{table}]")
        lines += [
            f"{draw(sub_keys)} = {draw(toml_scalars)}" for _ in range(draw(st.integers(0, 3)))
        ]
    if draw(st.booleans()):
        lines.append(draw(st.text(max_size=30)))
    return "\n".join(lines)


@settings(max_examples=400, deadline=None)
@given(text=config_texts())
def test_any_config_text_is_valid_or_one_line_error_naming_file(text: str) -> None:
    try:
        parse_config(text, "/etc/gpugate/x.toml")
    except ConfigError as exc:
        assert str(exc).startswith("/etc/gpugate/x.toml: ")
        assert "\n" not in str(exc)


argv_items = st.one_of(
    st.sampled_from(
        [
            "pre",
            "post",
            "status",
            "config",
            "check",
            "--json",
            "--dry-run",
            "--config",
            "vllm.service",
            "vllm@.service",
            r"vllm@a\x2db.service",
            "x",
            "",
            "-h",
            "install",
            "uninstall",
            "--force",
            "--gpus",
            "0,1",
            "vllm",
            "vllm.service\n",
            "slurm",
            "prolog",
            "--watch",
        ]
    ),
    st.text(max_size=12),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(argv=st.lists(argv_items, max_size=5))
def test_any_command_line_gives_an_exit_code_never_a_traceback(
    argv: list[str], tmp_path: Path
) -> None:
    # Nothing here can kill: every run is a dry run against an empty stand-in host.
    def driver() -> FakeGpuMemory:
        return FakeGpuMemory(count=2)

    config = tmp_path / "c.toml"
    config.write_text(f'lock_dir = "{tmp_path}"\n')
    args = [a for a in argv if a not in ("pre", "post", "install", "uninstall", "--watch")]
    if argv and argv[0] in ("pre", "post"):
        args = [argv[0], "--dry-run", "--config", str(config), *args]
    if argv and argv[0] in ("install", "uninstall"):  # into tmp_path, never /etc
        dirs = ["--systemd-dir", str(tmp_path / "systemd"), "--config-dir", str(tmp_path / "gg")]
        args = [argv[0], *args, "--dry-run", "--no-reload", *dirs]
    out = open(os.devnull, "w")  # noqa: SIM115
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(
                args,
                driver_factory=driver,
                roots=HostRoots(dev=tmp_path, cgroup=tmp_path, run=tmp_path),
            )
        except SystemExit as exit_:  # argparse: --help and usage errors
            code = int(exit_.code or 0)
    out.close()
    assert code in {int(c) for c in ExitCode}
    assert code != ExitCode.INTERNAL, argv  # every input gpugate can be given has its own code


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.root("create a freezer cgroup")
@pytest.mark.skipif(
    not (FREEZER / "cgroup.procs").exists(),
    reason="no cgroup v1 freezer mounted at /sys/fs/cgroup/freezer",
)
def test_really_unkillable_holder_named_with_wchan_and_exit_unkillable(host: FakeHost) -> None:
    # A task frozen by the cgroup v1 freezer sits in D state and does not die on SIGKILL until
    # thawed: the closest thing to a holder stuck in the driver that a machine without a GPU has.
    (stuck,) = host.pool.holder(host.gpu_files(1))
    host.put_in_unit(stuck)
    host.memory.claim(stuck, {1}, 3000)
    group = FREEZER / f"gpugate-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(stuck))
        (group / "freezer.state").write_text("FROZEN")
        deadline = time.monotonic() + 5
        while (group / "freezer.state").read_text().strip() != "FROZEN":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        summary = host.run_phase(
            "post",
            host.config(
                post={"wait_timeout_s": 2.0, "sigkill_wait_s": 0.5, "sigterm_grace_s": 0.3}
            ),
            host.reporter("post"),
            driver_factory=lambda: host.memory,
        )
        assert summary.exit_code is ExitCode.UNKILLABLE
        named = [e for e in host.journal.events("survivor") if e["GPUGATE_PID"] == str(stuck)]
        assert named and named[0]["GPUGATE_STATE"] == "D"
        assert named[0]["GPUGATE_WCHAN"] not in ("", "?")
        assert alive(stuck)
    finally:
        (group / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + 10
        while alive(stuck) and time.monotonic() < deadline:
            time.sleep(0.05)  # the pending SIGKILL lands once thawed
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                os.kill(int(pid), 9)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_nvml_lost_mid_wait_degrades_the_same_run(host: FakeHost) -> None:
    """NVML failing while gpugate waits (after it killed): the run goes on for the cgroup
    with the first run's deadline and summary, not a second run with a fresh deadline."""
    (member,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(member)
    memory = FailsMidRun(leaked_mib={0: 5000})
    memory.claim(member, {0}, 1000)
    ticks = iter(range(10_000))
    summary = host.run_phase(
        "post",
        host.config(post={"on_nvml_error": "warn", "wait_timeout_s": 30}),
        host.reporter("post"),
        driver_factory=lambda: memory,
        clock=lambda: next(ticks) * 0.001,  # a clock the test reads: 1 ms a look
    )
    assert summary.exit_code is ExitCode.OK
    assert summary.degraded
    assert [ident.pid for ident in summary.killed] == [member]  # the first pass's kill kept
    assert len(host.journal.events("run_started")) == 1
    assert len(host.journal.events("run_finished")) == 1
    # Every timeout extension asked of systemd ends at the first deadline (30 s + 10 s).
    extensions = [
        int(state.split("=")[1]) / 1e6
        for state in host.notifier.states
        if state.startswith("EXTEND_TIMEOUT_USEC=")
    ]
    assert extensions and max(extensions) <= 40
