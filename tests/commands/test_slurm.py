"""`gpugate slurm prolog|epilog` the way slurmd runs them: the job in the environment, its
cgroup in a stand-in tree shaped like Slurm's cgroup/v2 plugin makes it, real processes."""

from __future__ import annotations

import os
import pwd
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpugate.errors import BadInput, ExitCode
from gpugate.front.commands.slurm import job_cgroup, job_from_env
from gpugate.front.commands.slurm import slurm as slurm_hook
from gpugate.front.hook import HostAccess
from gpugate.host.nvml import mig_key
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from tests.fakes import FakeHost, alive, mig_uuid

JOB_CGROUP = "/system.slice/slurmstepd.scope/job_42"
TASK_CGROUP = f"{JOB_CGROUP}/step_0/user/task_0"
UUID_3 = "GPU-fa4e5a11-0000-0000-0000-000000000003"
GPU_0 = "GPU-fa4e5a11-0000-0000-0000-000000000000"


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


@pytest.mark.parametrize(
    ("environ", "gpus", "source", "no_gpus"),
    [
        # the hooks: SLURM_JOB_GPUS, slurmd's numbers (gres.conf's order)
        (
            {"SLURM_JOB_GPUS": "0,1", "SLURM_STEP_GPUS": "5", "CUDA_VISIBLE_DEVICES": "6"},
            (0, 1),
            "SLURM_JOB_GPUS",
            "",
        ),
        ({"SLURM_JOB_GPUS": "7,0,3"}, (7, 0, 3), "SLURM_JOB_GPUS", ""),
        # an srun task: SLURM_JOB_GPUS empty, SLURM_STEP_GPUS set (the same numbers)
        (
            {"SLURM_JOB_GPUS": "", "SLURM_STEP_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"},
            (0, 1),
            "SLURM_STEP_GPUS",
            "",
        ),
        # CUDA_VISIBLE_DEVICES alone is not slurmd's: no GPU named
        ({"CUDA_VISIBLE_DEVICES": "3,2"}, (), "", ""),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, (), "", ""),
        # Slurm's words for no GPU: said once, exit 0
        ({"SLURM_JOB_GPUS": "NoDevFiles"}, (), "SLURM_JOB_GPUS", "SLURM_JOB_GPUS=NoDevFiles"),
        ({"SLURM_STEP_GPUS": "NoDevFiles"}, (), "SLURM_STEP_GPUS", "SLURM_STEP_GPUS=NoDevFiles"),
        ({"SLURM_JOB_GPUS": ""}, (), "", "SLURM_JOB_GPUS="),
        ({"SLURM_JOB_GPUS": " ", "SLURM_STEP_GPUS": ""}, (), "", "SLURM_JOB_GPUS="),
        ({}, (), "", ""),
    ],
)
def test_job_gpus_as_slurmd_writes_them(
    environ: dict[str, str], gpus: tuple[int, ...], source: str, no_gpus: str
) -> None:
    job = job_from_env({"SLURM_JOB_ID": "9", **environ})
    assert (job.gpus, job.gpus_from, job.no_gpus) == (gpus, source, no_gpus)


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({}, "SLURM_JOB_ID"),
        ({"SLURM_JOB_ID": "0"}, "SLURM_JOB_ID '0'"),
        ({"SLURM_JOB_ID": "-4"}, "SLURM_JOB_ID '-4'"),
        ({"SLURM_JOB_ID": "42x"}, "SLURM_JOB_ID '42x'"),
        ({"SLURM_JOB_ID": "99999999999"}, "SLURM_JOB_ID '99999999999'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "root"}, "SLURM_JOB_UID 'root'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "01000"}, "SLURM_JOB_UID '01000'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "4294967295"}, "SLURM_JOB_UID '4294967295'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "2,,3"}, "SLURM_JOB_GPUS '2,,3'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "2-3"}, "SLURM_JOB_GPUS '2-3'"),
        ({"SLURM_JOB_ID": "42", "SLURM_STEP_GPUS": "x"}, "SLURM_STEP_GPUS 'x'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "-1"}, "SLURM_JOB_GPUS '-1'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "4294967296"}, "SLURM_JOB_GPUS '4294967296'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "nodevfiles"}, "SLURM_JOB_GPUS 'nodevfiles'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0\n1"}, "SLURM_JOB_GPUS '0\\n1'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "2,2"}, "SLURM_JOB_GPUS '2,2'"),
        ({"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": f"{UUID_3},4"}, f"SLURM_JOB_GPUS '{UUID_3},4'"),
    ],
)
def test_bad_environment_is_refused(environ: Mapping[str, str], named: str) -> None:
    """Exit 64, the one line naming the variable and its value as slurmd set it."""
    with pytest.raises(BadInput) as caught:
        job_from_env(environ)
    assert caught.value.message.startswith(named), caught.value.message
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
    from gpugate.host import safe_files

    found = tmp_path / "sbin" / "scontrol"
    found.parent.mkdir()
    found.write_text("#!/bin/sh\n")
    found.chmod(0o755)
    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(tmp_path / "bin"), str(found.parent)))
    monkeypatch.setenv("PATH", "")
    assert safe_files.find_program("scontrol") == str(found)
    found.chmod(0o644)
    assert safe_files.find_program("scontrol") is None


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
    for name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES", "SLURMD_NODENAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_JOB_UID", raising=False)
    etc = tmp_path / "etc-slurm"
    etc.mkdir()
    (etc / "gres.conf").write_text("Name=gpu File=/dev/nvidia[0-7]\n")
    (etc / "slurm.conf").write_text("GresTypes=gpu\nNodeName=gpu07 Gres=gpu:8\n")
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_UID": "1000",
        "SLURM_JOB_GPUS": "2,3",
        "SLURMD_NODENAME": "gpu07",
        "SLURM_CONF": str(etc / "slurm.conf"),
    }
    from gpugate.host import safe_files

    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(bin_dir),))
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


def device_stat(dev: Path) -> Callable[[str], os.stat_result]:
    """os.stat, where the stand-in /dev/nvidiaN (plain files) read as the driver's character
    devices 195:N, as on a real node (a link to one is followed, as stat follows it)."""

    def stat_(path: str) -> os.stat_result:
        real = Path(os.path.realpath(path))
        match = re.fullmatch(r"nvidia([0-9]+)", real.name)
        cap = re.fullmatch(r"nvidia-cap([0-9]+)", real.name)
        fields = (stat.S_IFCHR | 0o444, 0, 0, 1, 0, 0, 0, 0, 0, 0)
        if real.parent == dev and match and real.is_file():
            return os.stat_result(fields, {"st_rdev": os.makedev(195, int(match.group(1)))})
        if real.parent == dev / "nvidia-caps" and cap and real.is_file():  # major: dynamic
            return os.stat_result(fields, {"st_rdev": os.makedev(508, int(cap.group(1)))})
        return os.stat(path)

    return stat_


def slurm(host: FakeHost, phase: str, config: Path, driver: object = None) -> int:
    """`gpugate slurm PHASE --config CONFIG` with slurmd's environment (os.environ)."""

    def reporter(unit: str, phase: str, *, fields: dict[str, str] | None = None) -> Reporter:
        return Reporter(
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False, fields=fields
        )

    factory = (lambda: host.memory) if driver is None else driver
    front = HostAccess(driver_factory=factory, reporter_factory=reporter, roots=host.roots)  # type: ignore[arg-type]
    front.device_stat = device_stat(host.dev)
    return slurm_hook(front, Phase(phase), config)


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


@pytest.mark.message
def test_epilog_fails_on_a_leak_naming_gpu_and_mib(
    host: FakeHost, slurm_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    host.memory.leaked_mib[3] = 50000
    host.memory.leaked_mib[5] = 7000  # not the job's GPU: no concern of this epilog

    code = slurm(host, "epilog", slurm_config(host, epilog_wait_s=0.3))

    assert code == ExitCode.MEMORY_TIMEOUT
    reason = (
        f"gpugate epilog job 42: GPU 3 ({UUID_3}) still 50000 MiB used: memory not freed (exit 21)"
    )
    assert capsys.readouterr().err == f"gpugate: drain: {reason}\n"
    assert scontrol_args(host) == ["update", "NodeName=gpu07", "State=DRAIN", f"Reason={reason}"]


@pytest.mark.message
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


def gres(env: dict[str, str], text: str) -> None:
    (Path(env["SLURM_CONF"]).parent / "gres.conf").write_text(text)


def run_started(host: FakeHost) -> dict[str, str]:
    return host.journal.events("run_started")[0]  # type: ignore[no-any-return]


def signalled(host: FakeHost) -> set[int]:
    return {int(e["GPUGATE_PID"]) for e in host.journal.events("signal_sent")}


@pytest.mark.parametrize(
    ("gres_text", "job_gpus", "files", "nvml"),
    [
        # slurmd's number N is the N-th File, whose minor is NVML's minor number, not its index
        ("Name=gpu File=/dev/nvidia[0-7]\n", "0,1", (0, 1), {7, 6}),
        # File= out of order: the order written
        ("Name=gpu File=/dev/nvidia3,/dev/nvidia1,/dev/nvidia[0,2]\n", "0,3", (3, 2), {4, 5}),
        ("Name=gpu File=/dev/nvidia[6,4,2,0]\n", "1", (4,), {3}),
        # several lines: every Name= line first, then this node's NodeName= lines
        (
            "NodeName=gpu07 Name=gpu Type=h100 File=/dev/nvidia[4-5]\n"
            "Name=gpu Type=a100 File=/dev/nvidia[0-1]\n"
            "NodeName=gpu08 Name=gpu File=/dev/nvidia[2-3]\n",
            "2",
            (4,),
            {3},
        ),
        ("Name=gpu File=/dev/nvidia[0-3,6]\nName=gpu File=/dev/nvidia7\n", "4,5", (6, 7), {1, 0}),
        # AutoDetect=nvml: NVML's enumeration, whatever the files' order
        ("AutoDetect=nvml\nName=gpu File=/dev/nvidia[0-7]\n", "0,1", (7, 6), {0, 1}),
        ("NodeName=gpu[01-08] AutoDetect=nvml\n", "2", (5,), {2}),
        # several Types: slurm.conf's Gres= order of types (a100 first), each cut at its count
        (
            "Name=gpu Type=H100 File=/dev/nvidia[4-7]\nName=gpu Type=a100 File=/dev/nvidia[0-1]\n",
            "0,2",
            (0, 4),
            {7, 3},
        ),
        (
            "Name=gpu Type=a100 File=/dev/nvidia[0-3]\nName=gpu Type=h100 File=/dev/nvidia[4-5]\n",
            "2,3",
            (4, 5),
            {3, 2},
        ),
        (
            "Name=gpu Type=a100 File=/dev/nvidia0\nName=gpu Type=l4 File=/dev/nvidia7\n"
            "Name=gpu Type=h100 Files=/dev/nvidia[4-5]\n",
            "1",
            (4,),
            {3},
        ),
    ],
)
def test_epilog_finds_the_jobs_gpus_as_slurmd_numbers_them(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    gres_text: str,
    job_gpus: str,
    files: tuple[int, ...],
    nvml: set[int],
) -> None:
    """Device minors in another order than NVML's indices (nvidia7 is NVML's GPU 0): the
    job's own leftovers on its device files die, a server on any other survives."""
    slurm_conf = "GresTypes=gpu\nNodeName=gpu07 Gres=gpu:8\n"
    if "Type=" in gres_text:
        slurm_conf = "GresTypes=gpu\nNodeName=DEFAULT Gres=gpu:a100:2,gpu:h100:2\nNodeName=gpu07\n"
    host.memory.minors = [7, 6, 5, 4, 3, 2, 1, 0]
    gres(slurm_env, gres_text)
    Path(slurm_env["SLURM_CONF"]).write_text(slurm_conf)
    monkeypatch.setenv("SLURM_JOB_GPUS", job_gpus)
    own = {}
    for minor in files:
        (pid,) = host.pool.holder(host.gpu_files(minor))
        host.memory.claim(pid, {7 - minor}, 1000)
        own[pid] = minor
    others = []
    for minor in set(range(8)) - set(files):
        (pid,) = host.pool.holder(host.gpu_files(minor))
        host.memory.claim(pid, {7 - minor}, 1000)
        others.append(pid)

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert not any(alive(pid) for pid in own)
    assert all(alive(pid) for pid in others)
    assert signalled(host) == set(own)
    assert set(run_started(host)["GPUGATE_GPU"].split(",")) == {str(i) for i in nvml}


# gres.conf and job numbers gpugate cannot resolve for certain, each with why (the case's id;
# tests/unit/test_slurm_gres.py pins the words)
UNRESOLVED = [
    (None, "0", "no such file"),
    ("Name=gpu File=/dev/nvidia[0-7]\n", "8", "GPU number 8 past the 8 GPU(s)"),
    ("Name=gpu File=/dev/nvidia[0-1]\n", "0,2", "GPU number 2 past the 2 GPU(s)"),
    ("AutoDetect=rsmi\nName=gpu File=/dev/nvidia[0-7]\n", "0", "AutoDetect='rsmi'"),
    ("AutoDetect=nvml\nName=gpu Type=h100 Count=8\n", "0", "without File="),
    ("Name=gpu Type=h100 Count=8\n", "0", "no Name=gpu File= line"),
    ("NodeName=gpu08 Name=gpu File=/dev/nvidia[0-7]\n", "0", "no Name=gpu File= line"),
    ("Name=gpu File=/dev/null,/dev/nvidia1\n", "1", "'/dev/null' is no GPU device node"),
    ("Name=gpu File=/dev/nvidia9\n", "0", "is no GPU device node"),
    ("Name=gpu File=/dev/nvidia[0-3]\nInclude /etc/slurm/more.conf\n", "0", "not read"),
    ("Name=gpu File=/dev/nvidia[0-3]x[1-2]\n", "0", "not read for certain"),
    ("Name=gpu File=/dev/nvidia[3-1]\n", "0", "not read for certain"),
    ("Name=gpu File=/dev/nvidia[0-1],/dev/nvidia1\n", "0", "listed twice"),
    ("Name=gpu MultipleFiles=/dev/nvidia[0-1]\n", "0", "MultipleFiles"),
]


@pytest.mark.message
@pytest.mark.parametrize(
    ("gres_text", "job_gpus"),
    [case[:-1] for case in UNRESOLVED],
    ids=[case[-1] for case in UNRESOLVED],
)
def test_numbers_not_resolved_for_certain_touch_nothing_outside_the_job(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    gres_text: str | None,
    job_gpus: str,
) -> None:
    if gres_text is None:
        (Path(slurm_env["SLURM_CONF"]).parent / "gres.conf").unlink()
    else:
        gres(slurm_env, gres_text)
    monkeypatch.setenv("SLURM_JOB_GPUS", job_gpus)
    member, worker = host.pool.holder(host.gpu_files(0), children=1)
    host.put_in_unit(member, worker, cgroup=TASK_CGROUP)
    bystanders = []
    for gpu in range(8):
        (pid,) = host.pool.holder(host.gpu_files(gpu))
        host.memory.claim(pid, {gpu}, 1000)
        bystanders.append(pid)

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert not alive(member) and not alive(worker)
    assert all(alive(pid) for pid in bystanders)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpugate: warning: SLURM_JOB_GPUS="), err
    assert "GPUGATE_GPU" not in run_started(host)
    assert scontrol_args(host) is None


@pytest.mark.message
@pytest.mark.parametrize("phase", ["prolog", "epilog"])
@pytest.mark.parametrize(
    ("variables", "said"),
    [
        ({"SLURM_JOB_GPUS": "NoDevFiles"}, "no GPUs to gate (SLURM_JOB_GPUS=NoDevFiles)"),
        ({"SLURM_JOB_GPUS": ""}, "no GPUs to gate (SLURM_JOB_GPUS=)"),
        ({"SLURM_STEP_GPUS": "NoDevFiles"}, "no GPUs to gate (SLURM_STEP_GPUS=NoDevFiles)"),
    ],
)
def test_slurms_own_no_gpu_words_gate_nothing_and_drain_nothing(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    phase: str,
    variables: dict[str, str],
    said: str,
) -> None:
    monkeypatch.delenv("SLURM_JOB_GPUS")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    (orphan,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(orphan, {2}, 1000)

    def no_driver() -> object:
        raise AssertionError("no GPU to gate: NVML is not opened")

    assert slurm(host, phase, slurm_config(host), driver=no_driver) == 0

    assert alive(orphan)
    assert capsys.readouterr().err == ""
    assert scontrol_args(host) is None
    (entry,) = host.journal.events("run_finished")
    assert len(host.journal.entries) == 1
    assert entry["MESSAGE"] == said
    assert entry["GPUGATE_EVENT"] == "run_finished" and entry["GPUGATE_RESULT"] == "success"
    assert entry["GPUGATE_SLURM_JOB"] == "42" and entry["GPUGATE_PHASE"] == phase


@pytest.mark.message
def test_straddling_leftover_drains_naming_only_the_held_gpu_pid_and_rule(
    host: FakeHost, slurm_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Job 42 has GPUs 2 and 3; a leftover holds 3 and another job's 5: spared, and the
    reason names GPU 3 (not the freed GPU 2), its PID and account, and the rule."""
    (freed,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(freed, {2}, 1000)
    (straddler,) = host.pool.holder(host.gpu_files(3, 5))
    host.memory.claim(straddler, {3, 5}, 2000)

    code = slurm(host, "epilog", slurm_config(host))

    assert code == ExitCode.HELD_BY_OTHERS
    assert not alive(freed) and alive(straddler)
    account = pwd.getpwuid(os.getuid()).pw_name
    reason = (
        f"gpugate epilog job 42: PID {straddler} ({account}) on GPU 3: straddles GPU 5, "
        "not this job's (exit 22)"
    )
    assert capsys.readouterr().err == f"gpugate: drain: {reason}\n"
    assert scontrol_args(host) == ["update", "NodeName=gpu07", "State=DRAIN", f"Reason={reason}"]


@pytest.mark.message
def test_drain_reason_bounded_and_names_a_few_pids(
    host: FakeHost, slurm_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    straddlers = []
    for _ in range(6):
        (pid,) = host.pool.holder(host.gpu_files(3, 5))
        host.memory.claim(pid, {3, 5}, 100)
        straddlers.append(pid)

    assert slurm(host, "epilog", slurm_config(host)) == ExitCode.HELD_BY_OTHERS

    assert all(alive(pid) for pid in straddlers)
    reason = scontrol_args(host)[3].removeprefix("Reason=")  # type: ignore[index]
    assert len(reason) <= 250 and reason.endswith("(exit 22)") and '"' not in reason
    named = [pid for pid in straddlers if f"PID {pid} " in reason]
    assert len(named) == 3
    assert "3 more PID(s)" in reason or reason.count("PID") == 3


def test_autodetect_with_a_gpu_nvml_cannot_read_is_not_resolved(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """NVML's order has a gap where it cannot read a GPU: slurmd's N-th GPU is not placed."""
    gres(slurm_env, "AutoDetect=nvml\n")
    host.memory.lost = {0}
    monkeypatch.setenv("SLURM_JOB_GPUS", "1")
    (bystander,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(bystander, {1}, 1000)

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert alive(bystander)
    assert capsys.readouterr().err.count("\n") == 1  # one warning  # not resolved: said so


@pytest.mark.message
@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("Name=gpu File=/dev/\x1b[2Jnvidia[0-7]\n", "\\x1b[2Jnvidia"),
        ("Name=gpu File=/dev/nvidia[0-7]\x07\n", "nvidia0\\x07"),
        ("Name=gpu File=/dev/nvidia[0-7] \u202eType=a100\n", "\\u202e' not read"),
    ],
)
def test_hostile_gres_text_is_one_escaped_line_and_kills_nothing(
    host: FakeHost,
    slurm_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    text: str,
    shown: str,
) -> None:
    gres(slurm_env, text)
    (orphan,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(orphan, {2}, 1000)

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert alive(orphan)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and shown in err, err
    assert "\x1b" not in err and "\x07" not in err and "\u202e" not in err


# ---------------------------------------------------------------- MIG slices


MIG_SLICES = [(1, 0, 20000), (2, 0, 20000), (5, 0, 40000)]  # GPU 0's slices 0, 1, 2


def mig_node(host: FakeHost) -> dict[int, int]:
    """GPU 0 in MIG mode with three slices: on each an orphan (in no job's cgroup) holding
    /dev/nvidia0, as every process on any slice does; NVML lists each on its slice."""
    host.memory.mig = {0: list(MIG_SLICES)}
    on_slice = {}
    for k in range(3):
        (pid,) = host.pool.holder(host.gpu_files(0))
        host.memory.claim(pid, {mig_key(0, k)}, 1000)
        on_slice[k] = pid
    return on_slice


@pytest.mark.parametrize(
    "gres_text",
    [
        "AutoDetect=nvml\n",
        "NodeName=gpu07 AutoDetect=nvml\n",
        "AutoDetect=nvml\nName=gpu Type=a100_1g.10gb Count=3\n",
        "AutoDetect=nvml\nNodeName=gpu07 Name=gpu File=/dev/nvidia0\n",
        "AutoDetect=nvml\nName=gpu Type=a100_1g.10gb Count=2 Cores=0-3\n"
        "Name=gpu Type=a100_3g.40gb Count=1\n",
        "AutoDetect=nvml\nName=gpu MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21\n",
        None,  # no gres.conf at all: CUDA_VISIBLE_DEVICES's IDs are slurmd's alone
    ],
)
@pytest.mark.parametrize("form", ["uuid", "legacy"])
@pytest.mark.parametrize(("number", "mine"), [(0, 1), (1, 0), (2, 2), (5, 1)])
def test_epilog_on_a_slice_slurmd_named_kills_only_that_slices_process(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    gres_text: str | None,
    form: str,
    number: int,
    mine: int,
) -> None:
    """slurmd (AutoDetect=nvml) writes each MIG slice's unique ID beside its number: that,
    not gres.conf nor a guess at slurmd's order, names the job's slice."""
    if gres_text is None:
        (Path(slurm_env["SLURM_CONF"]).parent / "gres.conf").unlink(missing_ok=True)
    else:
        gres(slurm_env, gres_text)
    on_slice = mig_node(host)
    gi, ci, _ = MIG_SLICES[mine]
    unique = mig_uuid(0, gi, ci) if form == "uuid" else f"MIG-{GPU_0}/{gi}/{ci}"
    monkeypatch.setenv("SLURM_JOB_GPUS", str(number))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", unique)

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert signalled(host) == {on_slice[mine]}
    assert not alive(on_slice[mine])
    assert all(alive(pid) for k, pid in on_slice.items() if k != mine)
    assert run_started(host)["GPUGATE_GPU"] == str(mig_key(0, mine))
    assert capsys.readouterr().err == ""


# slices gpugate cannot know for certain, each with why (the case's id; tests/unit/test_slurm_gres.py
# pins the words)
SLICES_UNKNOWN = [
    # slurmd numbers the slices, not the GPU, in an order gpugate cannot know for certain
    ("AutoDetect=nvml\n", "0", None, "GPU 0 is in MIG mode"),
    ("AutoDetect=nvml\n", "1", "1", "GPU 0 is in MIG mode"),
    ("NodeName=gpu07 AutoDetect=nvml\n", "0,1", "0,1", "GPU 0 is in MIG mode"),
    ("AutoDetect=nvml\nName=gpu File=/dev/nvidia[0-1]\n", "0", None, "in MIG mode"),
    # a whole-GPU File= on a GPU in MIG mode: every slice, other jobs' too
    ("Name=gpu File=/dev/nvidia[0-7]\n", "0", None, "GPU 0, which is in MIG mode"),
    ("AutoDetect=off\nName=gpu File=/dev/nvidia0\n", "0", None, "in MIG mode"),
    ("Name=gpu Type=a100 File=/dev/nvidia[0-1] Cores=0-7\n", "0", None, "in MIG mode"),
    # the manual MIG form whose files are not one slice's for certain
    (
        "Name=gpu MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21\n",
        "0",
        None,
        "nvidia-cap21",
    ),
    ("Name=gpu MultipleFiles=/dev/nvidia[0-1]\n", "0", None, "MultipleFiles"),
    # other vendors' detection: not NVML's order
    ("AutoDetect=rsmi\n", "0", None, "AutoDetect='rsmi'"),
    ("AutoDetect=oneapi\n", "0", None, "AutoDetect='oneapi'"),
    ("AutoDetect=nrt\n", "0", None, "AutoDetect='nrt'"),
    # slurmd's IDs that do not pair with its numbers, or a slice NVML does not list
    ("AutoDetect=nvml\n", "0,1", f"{mig_uuid(0, 1, 0)}", "names 1 device(s)"),
    ("AutoDetect=nvml\n", "0,1", f"{mig_uuid(0, 1, 0)},1", "whole GPU beside MIG"),
    ("AutoDetect=nvml\n", "0", mig_uuid(0, 9, 0), "no such MIG slice"),
    ("AutoDetect=nvml\n", "0", "MIG-GPU-fa4e5a11-0000-0000-0000-000000000000/9/0", "no such"),
    ("AutoDetect=nvml\n", "0", "MIG-not-a-uuid!", "no such MIG slice"),
]


@pytest.mark.parametrize(
    ("gres_text", "job_gpus", "visible"),
    [case[:-1] for case in SLICES_UNKNOWN],
    ids=[case[-1] for case in SLICES_UNKNOWN],
)
def test_slices_not_known_for_certain_kill_nothing_outside_the_job(
    host: FakeHost,
    slurm_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    gres_text: str,
    job_gpus: str,
    visible: str | None,
) -> None:
    """Never a process on a slice that is not the job's: the job's cgroup only, one warning."""
    gres(slurm_env, gres_text)
    on_slice = mig_node(host)
    member, worker = host.pool.holder(host.gpu_files(0), children=1)
    host.put_in_unit(member, worker, cgroup=TASK_CGROUP)
    monkeypatch.setenv("SLURM_JOB_GPUS", job_gpus)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert not alive(member) and not alive(worker)  # the job's own cgroup is still cleaned
    assert all(alive(pid) for pid in on_slice.values())
    assert signalled(host) <= {member, worker}
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one warning: the numbers not resolved
    assert "GPUGATE_GPU" not in run_started(host)
    assert scontrol_args(host) is None


def test_a_tasks_cuda_visible_devices_is_not_slurmds(
    host: FakeHost, slurm_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLURM_STEP_GPUS (an srun task's): its CUDA_VISIBLE_DEVICES is the task's own, never
    taken as slurmd's unique IDs."""
    job = job_from_env(
        {"SLURM_JOB_ID": "4", "SLURM_STEP_GPUS": "0", "CUDA_VISIBLE_DEVICES": mig_uuid(0, 1, 0)}
    )
    assert job.visible == ()
    job = job_from_env(
        {"SLURM_JOB_ID": "4", "SLURM_JOB_GPUS": "0,3", "CUDA_VISIBLE_DEVICES": "MIG-a, 3"}
    )
    assert job.visible == ("MIG-a", "3")


# ---------------------------------------------------------------- gres/shard

SHARDED = "GresTypes=gpu,shard\nNodeName=gpu07 Gres=gpu:8,shard:64\n"


OTHER_JOB = "/system.slice/slurmstepd.scope/job_43/step_0/user/task_0"


@pytest.fixture
def kernel_cgroups(monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    """The cgroup the kernel reports for a PID (/proc/PID/cgroup), for processes a test puts
    in another job: its stand-in for moving them into slurmstepd.scope/job_43."""
    from gpugate.host import scan

    moved: dict[int, str] = {}
    real = scan.ProcFs._read

    def read(self: scan.ProcFs, pid: int, name: str) -> str | None:
        if name == "cgroup" and pid in moved:
            return f"0::{moved[pid]}\n"
        return real(self, pid, name)

    monkeypatch.setattr(scan.ProcFs, "_read", read)
    return moved


def shard_node(
    host: FakeHost,
    env: dict[str, str],
    moved: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    gres_text: str,
    slurm_conf: str,
) -> dict[str, int]:
    """Job 42 on GPU 2, beside job 43's process there and its process on GPU 3, and an
    escaped leftover of job 42 on GPU 2 (in no job's cgroup)."""
    gres(env, gres_text)
    Path(env["SLURM_CONF"]).write_text(slurm_conf)
    monkeypatch.setenv("SLURM_JOB_GPUS", "2")
    (sharer,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(sharer, {2}, 30000)
    (elsewhere,) = host.pool.holder(host.gpu_files(3))
    host.memory.claim(elsewhere, {3}, 30000)
    moved.update({sharer: OTHER_JOB, elsewhere: OTHER_JOB})
    (leftover,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(leftover, {2}, 5000)
    return {"sharer": sharer, "elsewhere": elsewhere, "leftover": leftover}


@pytest.mark.parametrize("phase", ["prolog", "epilog"])
@pytest.mark.parametrize(
    "gres_text",
    [
        "Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=64\n",
        "Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=64 File=/dev/nvidia[0-7]\n",
        "Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=8 File=/dev/nvidia2\n",
        "Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=1K File=/dev/nvidia[2-3]\n",
        "NodeName=gpu07 Name=gpu File=/dev/nvidia[0-7]\nNodeName=gpu[01-08] Name=shard Count=64\n",
        "AutoDetect=nvml\nName=shard Count=64\n",
        "AutoDetect=nvml\nName=shard Count=16 File=/dev/nvidia[2,5]\n",
    ],
)
def test_shard_jobs_share_a_gpu_without_a_drain_and_leftovers_still_die(
    host: FakeHost,
    slurm_env: dict[str, str],
    kernel_cgroups: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    phase: str,
    gres_text: str,
) -> None:
    """GPU 2 carries gres/shard: job 43's process there is a sharer (never killed, never a
    refusal, its memory not waited for); job 42's escaped leftover is still killed."""
    pids = shard_node(host, slurm_env, kernel_cgroups, monkeypatch, gres_text, SHARDED)

    assert slurm(host, phase, slurm_config(host, epilog_wait_s=5)) == 0

    assert alive(pids["sharer"]) and alive(pids["elsewhere"])
    assert not alive(pids["leftover"])
    assert signalled(host) == {pids["leftover"]}
    assert scontrol_args(host) is None
    assert capsys.readouterr().err == ""
    reasons = {e["GPUGATE_PID"]: e["GPUGATE_REASON"] for e in host.journal.events("holder_found")}
    assert reasons.get(str(pids["sharer"])) in (None, "sharer")


@pytest.mark.parametrize(
    ("gres_text", "slurm_conf"),
    [
        ("Name=gpu File=/dev/nvidia[0-7]\n", SHARDED),
        # shards on other GPUs only, or too few to give each file one (Count / files = 0)
        ("Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=8 File=/dev/nvidia3\n", SHARDED),
        ("Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=4 File=/dev/nvidia[0-7]\n", SHARDED),
        ("Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=0\n", SHARDED),
        # another node's shards; slurmd without the shard plugin (GresTypes)
        (
            "Name=gpu File=/dev/nvidia[0-7]\nNodeName=gpu08 Name=shard Count=64\n",
            SHARDED,
        ),
        ("Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=64\n", "GresTypes=gpu\n"),
    ],
)
def test_a_gpu_without_shards_keeps_the_whole_gpu_guarantee(
    host: FakeHost,
    slurm_env: dict[str, str],
    kernel_cgroups: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    gres_text: str,
    slurm_conf: str,
) -> None:
    """gpu:1 on a GPU that carries no shard: another job's process there refuses (exit 22,
    the node drains) and nothing is killed, as before shards."""
    pids = shard_node(host, slurm_env, kernel_cgroups, monkeypatch, gres_text, slurm_conf)

    assert slurm(host, "epilog", slurm_config(host)) == ExitCode.HELD_BY_OTHERS

    assert all(alive(pid) for pid in pids.values())
    refused = {(e["GPUGATE_PID"], e["GPUGATE_REASON"]) for e in host.journal.events("refused")}
    assert refused == {(str(pids["sharer"]), "other-unit")}  # job 43's, not 42's to kill
    args = scontrol_args(host)
    assert args is not None and args[2] == "State=DRAIN"


# GPU 0's slices' capability devices, as /proc/driver/nvidia/capabilities names them
CAPS = {"gpu0/mig/gi1": 21, "gpu0/mig/gi1/ci0": 22, "gpu0/mig/gi2": 30, "gpu0/mig/gi2/ci0": 31}
CAPS.update({"gpu0/mig/gi5": 57, "gpu0/mig/gi5/ci0": 58})


@pytest.fixture
def capability_devices(host: FakeHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpugate.host import nvml

    root = tmp_path / "capabilities"
    for relative, minor in CAPS.items():
        access = root / relative / "access"
        access.parent.mkdir(parents=True, exist_ok=True)
        access.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\n")
    monkeypatch.setattr(nvml, "CAPABILITIES", root)
    (host.dev / "nvidia-caps").mkdir()
    for minor in CAPS.values():
        (host.dev / "nvidia-caps" / f"nvidia-cap{minor}").write_bytes(b"")


def multiple(gi_cap: int, ci_cap: int, gpu: str = "/dev/nvidia0") -> str:
    return f"{gpu},/dev/nvidia-caps/nvidia-cap{gi_cap},/dev/nvidia-caps/nvidia-cap{ci_cap}"


@pytest.mark.parametrize(
    ("gres_text", "number", "mine"),
    [
        # slurmd's number N: the N-th record (one per MultipleFiles line), in gres.conf's order
        (
            f"Name=gpu MultipleFiles={multiple(30, 31)}\nName=gpu MultipleFiles={multiple(21, 22)}\n"
            f"Name=gpu MultipleFiles={multiple(57, 58)}\n",
            1,
            0,
        ),
        (
            f"Name=gpu MultipleFiles={multiple(57, 58)}\nName=gpu MultipleFiles={multiple(30, 31)}\n",
            0,
            2,
        ),
        # a record of the GPU and its compute instance's device alone; whole GPUs before it
        (
            "Name=gpu File=/dev/nvidia[1-2]\n"
            "Name=gpu MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap31\n",
            2,
            1,
        ),
        # NodeName= lines after Name= lines; Type= in slurm.conf's order of types
        (
            f"NodeName=gpu07 Name=gpu Type=2g MultipleFiles={multiple(21, 22)}\n"
            f"Name=gpu Type=3g MultipleFiles={multiple(57, 58)}\n"
            f"NodeName=gpu[06-07] Name=gpu Type=2g MultipleFiles={multiple(30, 31)}\n",
            1,
            1,
        ),
    ],
)
def test_multiple_files_records_are_slices_by_capability_device(
    host: FakeHost,
    slurm_env: dict[str, str],
    capability_devices: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    gres_text: str,
    number: int,
    mine: int,
) -> None:
    """The manual MIG form: each MultipleFiles line one number, the slice whose capability
    devices it lists; the epilog kills only that slice's processes."""
    gres(slurm_env, gres_text)
    Path(slurm_env["SLURM_CONF"]).write_text("NodeName=gpu07 Gres=gpu:2g:2,gpu:3g:1\n")
    on_slice = mig_node(host)
    monkeypatch.setenv("SLURM_JOB_GPUS", str(number))

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert signalled(host) == {on_slice[mine]}
    assert all(alive(pid) for k, pid in on_slice.items() if k != mine)
    assert run_started(host)["GPUGATE_GPU"] == str(mig_key(0, mine))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "record",
    [
        multiple(21, 31),  # two slices' devices
        "/dev/nvidia1,/dev/nvidia-caps/nvidia-cap22",  # GPU 1 with a slice of GPU 0
        "/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21",  # the GPU instance alone: no slice
        "/dev/nvidia0,/dev/nvidia1",  # two GPUs
        "/dev/nvidia0,/dev/null",
        "/dev/nvidia0,/dev/nvidia-caps/nvidia-cap99",  # no such capability device
    ],
)
def test_multiple_files_not_one_slice_touch_nothing_outside_the_job(
    host: FakeHost,
    slurm_env: dict[str, str],
    capability_devices: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    record: str,
) -> None:
    gres(slurm_env, f"Name=gpu MultipleFiles={record}\n")
    on_slice = mig_node(host)
    monkeypatch.setenv("SLURM_JOB_GPUS", "0")

    assert slurm(host, "epilog", slurm_config(host)) == 0

    assert all(alive(pid) for pid in on_slice.values())
    assert signalled(host) == set()
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one warning: the numbers not resolved
