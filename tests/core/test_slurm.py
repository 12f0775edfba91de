"""`gpugate slurm prolog|epilog` the way slurmd runs them: the job in the environment, its
cgroup in a stand-in tree shaped like Slurm's cgroup/v2 plugin makes it, real processes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpugate.errors import ExitCode
from gpugate.front.cli import main
from gpugate.integrations.slurm import SlurmEnvError, job_cgroup, job_from_env
from gpugate.report.journal import Reporter
from tests.fakes import FakeHost, alive

JOB_CGROUP = "/system.slice/slurmstepd.scope/job_42"
TASK_CGROUP = f"{JOB_CGROUP}/step_0/user/task_0"
UUID_3 = "GPU-fa4e5a11-0000-0000-0000-000000000003"


# ---------------------------------------------------------------- the environment


def test_job_gpus_from_slurm_job_gpus_first() -> None:
    environ = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_UID": "1000",
        "SLURM_JOB_GPUS": " 2, 3 ",
        "CUDA_VISIBLE_DEVICES": "0",
        "SLURMD_NODENAME": "gpu07",
    }
    job = job_from_env(environ)
    assert (job.job_id, job.uid, job.gpus, job.gpus_from) == (42, 1000, (2, 3), "SLURM_JOB_GPUS")
    assert job.node_name == "gpu07"
    assert job.label == "slurm-job-42"


def test_job_gpus_fall_back_to_cuda_visible_devices_indices_or_uuids() -> None:
    job = job_from_env({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": f"1,{UUID_3}"})
    assert (job.gpus, job.gpus_from, job.uid, job.node_name) == (
        (1, UUID_3),
        "CUDA_VISIBLE_DEVICES",
        None,
        None,
    )
    assert job_from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": ""}).gpus == ()


@pytest.mark.parametrize(
    ("environ", "gpus", "source"),
    [
        # a batch job and the hooks: SLURM_JOB_GPUS, indices or (some sites) UUIDs
        (
            {"SLURM_JOB_GPUS": "0,1", "SLURM_STEP_GPUS": "5", "CUDA_VISIBLE_DEVICES": "6"},
            (0, 1),
            "SLURM_JOB_GPUS",
        ),
        ({"SLURM_JOB_GPUS": f"{UUID_3},4"}, (UUID_3, 4), "SLURM_JOB_GPUS"),
        # an srun task: SLURM_JOB_GPUS empty, SLURM_STEP_GPUS set
        (
            {"SLURM_JOB_GPUS": "", "SLURM_STEP_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"},
            (0, 1),
            "SLURM_STEP_GPUS",
        ),
        ({"SLURM_JOB_GPUS": " ", "SLURM_STEP_GPUS": UUID_3}, (UUID_3,), "SLURM_STEP_GPUS"),
        ({"SLURM_STEP_GPUS": "", "CUDA_VISIBLE_DEVICES": "3,2"}, (3, 2), "CUDA_VISIBLE_DEVICES"),
        ({"SLURM_JOB_GPUS": "", "SLURM_STEP_GPUS": "", "CUDA_VISIBLE_DEVICES": ""}, (), ""),
    ],
)
def test_job_gpus_first_non_empty_variable_wins(
    environ: dict[str, str], gpus: tuple[int | str, ...], source: str
) -> None:
    job = job_from_env({"SLURM_JOB_ID": "9", **environ})
    assert (job.gpus, job.gpus_from) == (gpus, source)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "SLURM_JOB_ID not set: not a Slurm job ID"),
        ({"SLURM_JOB_ID": "0"}, "SLURM_JOB_ID '0': not a Slurm job ID"),
        ({"SLURM_JOB_ID": "-4"}, "SLURM_JOB_ID '-4': not a Slurm job ID"),
        ({"SLURM_JOB_ID": "42x"}, "SLURM_JOB_ID '42x': not a Slurm job ID"),
        ({"SLURM_JOB_ID": "99999999999"}, "SLURM_JOB_ID '99999999999': not a Slurm job ID"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "root"}, "SLURM_JOB_UID 'root': not a user ID"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "2,,3"}, "SLURM_JOB_GPUS '2,,3': '' is not"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "2-3"}, "SLURM_JOB_GPUS '2-3': '2-3' is not"),
        ({"SLURM_JOB_ID": "42", "SLURM_STEP_GPUS": "x"}, "SLURM_STEP_GPUS 'x': 'x' is not a GPU"),
        (
            {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "2,2"},
            "SLURM_JOB_GPUS '2,2': lists GPU 2 twice",
        ),
        (
            {"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "NoDevFiles"},
            "CUDA_VISIBLE_DEVICES 'NoDevFiles': 'NoDevFiles' is not a GPU index (0, 1, ...) or UUID",
        ),
    ],
)
def test_bad_environment_is_refused(environ: Mapping[str, str], message: str) -> None:
    with pytest.raises(SlurmEnvError) as caught:
        job_from_env(environ)
    assert caught.value.message.startswith(message)
    assert caught.value.exit_code is ExitCode.USAGE


def test_job_cgroup_found_under_slurmstepd_scope(tmp_path: Path) -> None:
    assert job_cgroup(42, tmp_path) == JOB_CGROUP  # gone already: the default path
    (tmp_path / TASK_CGROUP.lstrip("/")).mkdir(parents=True)
    assert job_cgroup(42, tmp_path) == JOB_CGROUP
    other = tmp_path / "system.slice" / "gpu07_slurmstepd.scope" / "job_43" / "step_extern"
    other.mkdir(parents=True)
    assert job_cgroup(43, tmp_path) == "/system.slice/gpu07_slurmstepd.scope/job_43"
    assert job_cgroup(4, tmp_path) == "/system.slice/slurmstepd.scope/job_4"


@pytest.mark.parametrize(
    "task",
    [
        "job_42/step_0/user/task_0",  # srun
        "job_42/step_batch/user/task_0",  # sbatch
        "job_42/step_extern/user/task_special",  # ConstrainDevices=no
        "job_42/step_0/slurm",  # slurmstepd itself
    ],
)
@pytest.mark.parametrize(
    "scope", ["gpu07_slurmstepd.scope", "slurmstepd.scope", "a-b_slurmstepd.scope"]
)
def test_job_cgroup_as_slurmd_creates_it(tmp_path: Path, scope: str, task: str) -> None:
    (tmp_path / "system.slice" / scope / task).mkdir(parents=True)
    assert job_cgroup(42, tmp_path, "gpu07") == f"/system.slice/{scope}/job_42"


def test_job_cgroup_missing_at_hook_time_names_the_nodes_scope(tmp_path: Path) -> None:
    """At Prolog= the job's cgroup is not there yet, at Epilog= it is gone: the path stands
    under this node's scope, and holds no process."""
    for scope in ("gpu06_slurmstepd.scope", "gpu07_slurmstepd.scope"):
        (tmp_path / "system.slice" / scope / "job_41" / "step_0").mkdir(parents=True)
    assert job_cgroup(42, tmp_path, "gpu07") == "/system.slice/gpu07_slurmstepd.scope/job_42"
    assert job_cgroup(42, tmp_path, None) == "/system.slice/gpu06_slurmstepd.scope/job_42"
    # a scope that only ends like slurmd's is not one
    (tmp_path / "system.slice" / "notslurmstepd.scope" / "job_42").mkdir(parents=True)
    assert job_cgroup(42, tmp_path, "gpu07") == "/system.slice/gpu07_slurmstepd.scope/job_42"


def test_scontrol_found_without_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slurmd gives the hooks no PATH: scontrol is looked for where Slurm installs it."""
    from gpugate.host import programs

    found = tmp_path / "sbin" / "scontrol"
    found.parent.mkdir()
    found.write_text("#!/bin/sh\n")
    found.chmod(0o755)
    monkeypatch.setattr(programs, "SYSTEM_DIRS", (str(tmp_path / "bin"), str(found.parent)))
    monkeypatch.setenv("PATH", "")
    assert programs.find_program("scontrol") == str(found)
    found.chmod(0o644)
    assert programs.find_program("scontrol") is None


# ---------------------------------------------------------------- the runs


@pytest.fixture
def slurm_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """slurmd's environment for job 42 on GPUs 2 and 3, and a stand-in scontrol in the system
    folders gpugate searches that records its arguments (slurmd itself gives no PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/scontrol.args\n')
    scontrol.chmod(0o755)
    for name in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "SLURMD_NODENAME", "SLURM_JOB_UID"):
        monkeypatch.delenv(name, raising=False)
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_UID": "1000",
        "SLURM_JOB_GPUS": "2,3",
        "SLURMD_NODENAME": "gpu07",
    }
    from gpugate.host import programs

    monkeypatch.setattr(programs, "SYSTEM_DIRS", (str(bin_dir),))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def scontrol_args(host: FakeHost) -> list[str] | None:
    path = host.root / "scontrol.args"
    return path.read_text().splitlines() if path.exists() else None


def slurm_config(host: FakeHost, *, epilog_wait_s: float = 10) -> Path:
    path = host.root / "slurm.toml"
    path.write_text(
        f'metrics_textfile = "{host.root}/textfile/gpugate.prom"\n'
        f'lock_dir = "{host.root}/locks"\n'
        "[prolog]\nsigterm_grace_s = 1\nwait_timeout_s = 10\n"
        f"[epilog]\nsigterm_grace_s = {min(1, epilog_wait_s / 4)}\nwait_timeout_s = {epilog_wait_s}\n"
        f"sigkill_wait_s = {min(1, epilog_wait_s / 4)}\n"
    )
    return path


def slurm(host: FakeHost, phase: str, config: Path, driver: object = None) -> int:
    def reporter(unit: str, phase: str, *, fields: dict[str, str] | None = None) -> Reporter:
        return Reporter(
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False, fields=fields
        )

    return main(
        ["slurm", phase, "--config", str(config)],
        driver_factory=(lambda: host.memory) if driver is None else driver,  # type: ignore[arg-type,return-value]
        reporter_factory=reporter,
        roots=host.roots,
    )


def test_epilog_reaps_the_jobs_leftovers_and_passes(
    host: FakeHost, slurm_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Left in the job's cgroup (a worker that outlived the step), and an orphan outside it
    # on the job's GPU (started from an ssh login); a bystander on another GPU.
    leftover, worker = host.pool.holder(host.gpu_files(2), children=1)
    host.put_in_unit(leftover, worker, cgroup=TASK_CGROUP)
    host.memory.claim(worker, {2}, 40000)
    (orphan,) = host.pool.holder(host.gpu_files(3))
    host.memory.claim(orphan, {3}, 20000)
    (bystander,) = host.pool.holder(host.gpu_files(5))
    host.memory.claim(bystander, {5}, 30000)

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert not any(alive(pid) for pid in (leftover, worker, orphan))
    assert alive(bystander)
    assert capsys.readouterr().err == ""
    assert scontrol_args(host) is None
    started = host.journal.events("run_started")[0]
    assert started["GPUGATE_GPU"] == "2,3"
    assert started["GPUGATE_UNIT"] == "slurm-job-42"
    assert started["GPUGATE_PHASE"] == "epilog"
    assert started["GPUGATE_SLURM_JOB"] == "42"
    assert started["GPUGATE_SLURM_JOB_UID"] == "1000"
    assert started["OBJECT_SYSTEMD_UNIT"] == "slurmstepd.scope"
    reasons = {e["GPUGATE_PID"]: e["GPUGATE_REASON"] for e in host.journal.events("holder_found")}
    assert (reasons[str(worker)], reasons[str(orphan)]) == ("cgroup", "orphan")
    text = (host.root / "textfile" / "gpugate.prom").read_text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    runs = ("gpugate_runs_total", (("phase", "epilog"), ("result", "success"), ("unit", "slurm")))
    assert samples[runs] == 1
    reclaimed = ("gpugate_reclaimed_mib_total", (("gpu", "3"), ("unit", "slurm"), ("uuid", UUID_3)))
    assert samples[reclaimed] == 20000


def test_epilog_fails_on_a_leak_naming_gpu_and_mib(
    host: FakeHost, slurm_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    host.memory.leaked_mib[3] = 50000
    host.memory.leaked_mib[5] = 7000  # not the job's GPU: no concern of this epilog

    code = slurm(host, "epilog", slurm_config(host, epilog_wait_s=0.3))

    assert code == ExitCode.MEMORY_TIMEOUT
    reason = f"gpugate epilog job 42: GPU 3 ({UUID_3}) still 50000 MiB used (exit 21)"
    assert capsys.readouterr().err == f"gpugate: drain: {reason}\n"
    assert scontrol_args(host) == ["update", "NodeName=gpu07", "State=DRAIN", f"Reason={reason}"]


def test_bad_environment_exits_2_and_kills_nothing(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (orphan,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(orphan, {2}, 1000)
    monkeypatch.setenv("SLURM_JOB_GPUS", "2;3")

    def no_driver() -> object:
        raise AssertionError("NVML must not be opened for a bad environment")

    assert slurm(host, "epilog", slurm_config(host), driver=no_driver) == ExitCode.USAGE

    assert alive(orphan)
    err = capsys.readouterr().err
    assert err.startswith("gpugate: SLURM_JOB_GPUS '2;3': ") and err.count("\n") == 1
    args = scontrol_args(host)
    assert args[:3] == ["update", "NodeName=gpu07", "State=DRAIN"]  # the node drained
    assert args[3].startswith("Reason=gpugate epilog: ") and args[3].endswith(" (exit 64)")


def test_job_without_gpus_is_left_alone(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("SLURM_JOB_GPUS")
    (member,) = host.pool.holder([])
    host.put_in_unit(member, cgroup=TASK_CGROUP)

    def no_driver() -> object:
        raise AssertionError("a CPU node may have no NVML at all")

    assert slurm(host, "epilog", slurm_config(host), driver=no_driver) == 0
    assert alive(member)
    assert capsys.readouterr().err == ""
    assert not host.journal.entries


def test_prolog_frees_the_jobs_gpus_and_spares_the_rest(
    host: FakeHost, slurm_env: dict[str, str]
) -> None:
    (stale,) = host.pool.holder(host.gpu_files(2))  # a server someone left on GPU 2
    host.memory.claim(stale, {2}, 60000)
    (bystander,) = host.pool.holder(host.gpu_files(6))
    host.memory.claim(bystander, {6}, 60000)

    assert slurm(host, "prolog", slurm_config(host)) == 0

    assert not alive(stale)
    assert alive(bystander)
    assert {e["GPUGATE_PHASE"] for e in host.journal.events("signal_sent")} == {"prolog"}


def test_unknown_gpu_in_the_job_exits_3_naming_the_variable(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SLURM_JOB_GPUS", "9")
    assert slurm(host, "prolog", slurm_config(host)) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert err.startswith("gpugate: ")
    assert "SLURM_JOB_GPUS" in err  # the variable the GPUs came from
    assert err.count("\n") == 1
