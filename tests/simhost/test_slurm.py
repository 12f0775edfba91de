"""`gpugate slurm prolog|epilog` on the simulated GPU host, run the way slurmd runs them.

No slurmd here: a stand-in slurmstepd (a bash script in the scope Slurm's cgroup/v2 plugin
uses, /system.slice/slurmstepd.scope) starts each job's vLLM-like server in the job's task
cgroup (job_ID/step_0/user/task_0) and parks itself in the scope's `system` cgroup, as
slurmstepd does. gpugate then runs from a system service (slurmd's place) with the environment
slurmd gives an Epilog= or Prolog= program: SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_GPUS,
SLURMD_NODENAME. A stand-in scontrol records the drain it is asked for.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
from incident import PYTHON, Host, prepare
from prometheus_client.parser import text_string_to_metric_families
from realparts import gpu_device_nodes, gpu_plain_files, slurm_gres_conf
from sandbox import SimHost

from gpugate.errors import ExitCode

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

STEPD_CGROUP = "/sys/fs/cgroup/system.slice/slurmstepd.scope"
TEXTFILE = "/run/gpugate-textfile/gpugate.prom"
SLURM_CONFIG = (
    f'metrics_textfile = "{TEXTFILE}"\n'
    "[prolog]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n"
    "[epilog]\nsigterm_grace_s = 2\nsigkill_wait_s = 0.5\nwait_timeout_s = 3\n"
)
SCONTROL = "#!/bin/sh\nprintf '%s\\n' \"$@\" > /run/scontrol.args\n"
JOB_MIB = 5000


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    """A Slurm GPU node's GPUs, as slurmd numbers them: gres.conf (`File=/dev/nvidia[0-7]`)
    beside slurm.conf and device nodes for the files it lists (the session host's plain-file
    stand-ins come back afterwards). nvidia-persistenced reopens the new nodes."""
    h = prepare(simhost)
    gpu_device_nodes(simhost)
    slurm_gres_conf(simhost)
    simhost.systemctl("restart", "nvidia-persistenced.service")
    simhost.write_file("/etc/gpugate/slurm.toml", SLURM_CONFIG)
    simhost.write_file("/usr/local/bin/scontrol", SCONTROL, mode=0o755)
    try:
        yield h
    finally:
        simhost.run(
            "rm -f /etc/gpugate/slurm.toml /usr/local/bin/scontrol /etc/slurm/gres.conf; "
            "rmdir /etc/slurm 2>/dev/null",
            check=False,
        )
        h.reset()
        gpu_plain_files(simhost)
        simhost.systemctl("restart", "nvidia-persistenced.service")


@pytest.fixture
def slurm(host: Host) -> Iterator[Host]:
    """Each test starts with no job, no leak, no metrics; whatever it started is stopped."""
    host.reset()
    host.sh(f"rm -rf /run/scontrol.args {TEXTFILE.rsplit('/', 1)[0]}")
    yield host
    host.sh(
        "systemctl stop slurmstepd.scope 2>/dev/null; systemctl reset-failed slurmstepd.scope "
        "2>/dev/null; rm -f /run/scontrol.args /run/fake-nvml/leak/*",
        check=False,
    )
    host.reset()


def server(job: int, gpus: str, port: int) -> list[str]:
    return [
        PYTHON,
        "/opt/fakevllm/fake_vllm.py",
        "--gpus",
        gpus,
        "--port",
        str(port),
        "--mib",
        str(JOB_MIB),
        "--ready-file",
        f"/run/ready-job{job}.json",
    ]


def start_jobs(host: Host, jobs: dict[int, list[str]]) -> dict[int, dict[str, Any]]:
    """The stand-in slurmstepd: each job's task in job_ID/step_0/user/task_0, itself in
    system/ (cgroup v2 keeps processes in leaves). It reaps its tasks, as slurmstepd does."""
    lines = [f"cg={STEPD_CGROUP}"]
    for job, argv in jobs.items():
        host.sh(f"rm -f /run/ready-job{job}.json")
        task = f"$cg/job_{job}/step_0/user/task_0"
        lines.append(f'mkdir -p "{task}"')
        lines.append(
            f'(echo $BASHPID > "{task}/cgroup.procs" && exec {shlex.join(argv)} '
            "</dev/null >/dev/null 2>&1) &"
        )
    lines += ['mkdir -p "$cg/system"', 'echo $$ > "$cg/system/cgroup.procs"']
    lines.append("while :; do wait; sleep 1; done")
    host.sim.spawn_scope(
        ["/bin/bash", "-c", "\n".join(lines)], unit="slurmstepd.scope", slice="system.slice"
    )
    return {job: host.wait_ready(f"/run/ready-job{job}.json") for job in jobs}


def job_pids(host: Host, job: int) -> list[int]:
    out = host.sh(f"cat $(find {STEPD_CGROUP}/job_{job} -name cgroup.procs) 2>/dev/null", False)
    return [int(pid) for pid in out.split()]


def run_slurmd_hook(
    host: Host, phase: str, job: int, gpus: str, **more: str
) -> tuple[int, str]:  # (exit status, stderr)
    """As slurmd runs Prolog=/Epilog=: as root, from a system service, with the job's
    environment (and MORE of slurmd's variables) and no terminal."""
    env = {
        "SLURM_JOB_ID": str(job),
        "SLURM_JOB_UID": "0",
        "SLURM_JOB_USER": "root",
        "SLURM_JOB_GPUS": gpus,
        "SLURMD_NODENAME": "simnode",
        **more,
    }
    argv = [
        "systemd-run",
        "--quiet",
        "--pipe",
        "--wait",
        "--collect",
        f"--unit=slurmd-{phase}-{job}",
        *(f"--setenv={name}={value}" for name, value in env.items()),
        "/usr/bin/gpugate",
        "slurm",
        phase,
    ]
    result = host.sim.run(argv, check=False, timeout=180)
    return result.returncode, result.stderr


def metrics(host: Host) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = host.sim.read_file(TEXTFILE)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_epilog_reaps_leftovers_frees_memory_and_passes(slurm: Host) -> None:
    host = slurm
    pids = start_jobs(host, {42: server(42, "2,3", 8142), 43: server(43, "5", 8143)})
    leftover_tasks = job_pids(host, 42)
    assert len(leftover_tasks) >= 4  # api server, tracker, engine core, two workers
    # Started by the job's user from an ssh login, outside the job's cgroup, on its GPU 3.
    orphan, shell = host.hand_start((3,), 8144, "hand-job42")
    used = host.used()
    assert (used[2], used[3], used[5]) == (JOB_MIB, JOB_MIB + 90000, JOB_MIB)

    code, stderr = run_slurmd_hook(host, "epilog", 42, "2,3")

    assert code == 0, stderr
    used = host.used()
    assert (used[2], used[3], used[5]) == (0, 0, JOB_MIB)
    for pid in [*leftover_tasks, orphan["api_server"], orphan["engine_core"], *orphan["workers"]]:
        assert not host.alive(pid), f"{pid} survived the epilog"
    assert job_pids(host, 42) == []
    assert host.alive(shell), "the login shell is never taken"
    for pid in [pids[43]["api_server"], *pids[43]["workers"]]:
        assert host.alive(pid), "another job's process was killed"
    for unit in ("nvidia-persistenced.service", "python-bystander.scope"):
        assert host.sim.systemctl("is-active", unit, check=False).stdout.strip() == "active"
    assert not host.sim.exists("/run/scontrol.args"), "drained although the epilog passed"
    signalled = host.journal_json("GPUGATE_SLURM_JOB=42", "GPUGATE_EVENT=signal_sent")
    assert {int(e["GPUGATE_PID"]) for e in signalled} >= set(pids[42]["workers"])
    assert {e["GPUGATE_UNIT"] for e in signalled} == {"slurm-job-42"}
    values = metrics(host)
    runs = ("gpugate_runs_total", (("phase", "epilog"), ("result", "success"), ("unit", "slurm")))
    assert values[runs] == 1
    reclaimed = {
        labels: value
        for (name, labels), value in values.items()
        if name == "gpugate_reclaimed_mib_total"
    }
    assert sorted(reclaimed.values()) == [JOB_MIB, JOB_MIB + 90000]


@pytest.mark.message
def test_epilog_with_leaked_memory_drains_naming_gpu_and_mib(slurm: Host) -> None:
    host = slurm
    host.sh("mkdir -p /run/fake-nvml/leak && echo 50000 > /run/fake-nvml/leak/3")

    code, stderr = run_slurmd_hook(host, "epilog", 42, "2,3")

    assert code == ExitCode.MEMORY_TIMEOUT, stderr
    (line,) = [text for text in stderr.splitlines() if text.startswith("gpugate: drain: ")]
    reason = line.removeprefix("gpugate: drain: ")
    assert reason.startswith("gpugate epilog job 42: GPU 3 (GPU-")
    assert reason.endswith(") still 50000 MiB used: memory not freed (exit 21)")
    assert host.sim.read_file("/run/scontrol.args").splitlines() == [
        "update",
        "NodeName=simnode",
        "State=DRAIN",
        f"Reason={reason}",
    ]
    labels = (("phase", "epilog"), ("result", "memory_timeout"), ("unit", "slurm"))
    assert metrics(host)[("gpugate_runs_total", labels)] == 1


def test_prolog_kills_stale_servers_but_never_another_job(slurm: Host) -> None:
    host = slurm
    pids = start_jobs(host, {43: server(43, "5", 8143)})
    stale, shell = host.hand_start((4,), 8145, "hand-stale")

    # Job 46 was given GPUs 4 and 5, but job 43 still runs on 5: refuse, kill nothing, drain.
    code, stderr = run_slurmd_hook(host, "prolog", 46, "4,5")
    assert code == ExitCode.HELD_BY_OTHERS, stderr
    (line,) = [text for text in stderr.splitlines() if text.startswith("gpugate: drain: ")]
    held = re.fullmatch(
        r"gpugate: drain: gpugate prolog job 46: PID (\d+) \(root\) on GPU 5: "
        r"in another job \(43\) \(exit 22\)",
        line,
    )
    assert held is not None, line
    assert int(held.group(1)) in job_pids(host, 43)
    assert all(host.alive(pid) for pid in [*pids[43]["workers"], *stale["workers"]])

    # Job 47 was given GPU 4 alone: the stale server there goes, its login shell stays.
    host.sh("rm -f /run/scontrol.args")
    code, stderr = run_slurmd_hook(host, "prolog", 47, "4")
    assert code == 0, stderr
    assert not any(host.alive(pid) for pid in [stale["api_server"], *stale["workers"]])
    assert host.alive(shell)
    assert all(host.alive(pid) for pid in pids[43]["workers"])
    assert host.used()[4] == 0
    assert not host.sim.exists("/run/scontrol.args")


# ---------------------------------------------------------------- MIG slices

NVML_CONF = "/etc/fake-nvml.conf"
MIG_CONF = "mig = 0 1/0/20000/2g.20gb 2/0/20000/2g.20gb 5/0/40000/3g.40gb\n"
GPU0 = "GPU-fa4e5a11-0000-0000-0000-000000000000"
MIG_SLURM = "/etc/slurm-mig"  # a copy's folder: SLURM_CONF=/etc/slurm-mig/slurm.conf
SLICE_SERVER = ("--mib", "3000")


def slice_uuid(gi: int) -> str:
    """The stand-in's UUID of GPU 0's slice with GPU instance GI (compute instance 0)."""
    return f"MIG-fa4e5a11-0000-0000-0000-0000{gi:04x}0000"


@pytest.fixture
def mig(slurm: Host) -> Iterator[Host]:
    """GPU 0 in MIG mode (slices 0/1/0, 0/2/0, 0/5/0), as on a one-A100 node."""
    slurm.sh(f"printf '%s' '{MIG_CONF}' >> {NVML_CONF}; mkdir -p {MIG_SLURM}")
    slurm.sim.write_file(f"{MIG_SLURM}/slurm.conf", "GresTypes=gpu\nNodeName=simnode Gres=gpu:3\n")
    yield slurm
    slurm.sh(
        "systemctl stop slurmstepd.scope 'hand-*.scope' 2>/dev/null; "
        f"sed -i '/^mig/d' {NVML_CONF}; rm -rf {MIG_SLURM}",
        check=False,
    )


# gres.conf forms slurmd accepts on such a node, each with what slurmd writes in the hooks'
# environment for a job on slice 0/1/0 (its MIG index 0); None: the slice is not known for
# certain (the job's cgroup only)
MIG_FORMS = [
    ("AutoDetect=nvml\n", {"CUDA_VISIBLE_DEVICES": slice_uuid(1)}, True),
    ("AutoDetect=nvml\n", {"CUDA_VISIBLE_DEVICES": f"MIG-{GPU0}/1/0"}, True),
    ("NodeName=simnode AutoDetect=nvml\n", {"CUDA_VISIBLE_DEVICES": slice_uuid(1)}, True),
    (
        "AutoDetect=nvml\nName=gpu Type=a100_2g.20gb Count=2\nName=gpu Type=a100_3g.40gb Count=1\n",
        {"CUDA_VISIBLE_DEVICES": slice_uuid(1)},
        True,
    ),
    ("AutoDetect=nvml\n", {}, False),  # numbers alone: slurmd's order is not knowable
    ("AutoDetect=nvml\n", {"CUDA_VISIBLE_DEVICES": "0"}, False),
    ("NodeName=simnode AutoDetect=nvml Name=gpu File=/dev/nvidia0\n", {}, False),
    ("Name=gpu File=/dev/nvidia[0-7]\n", {}, False),  # the whole GPU: every slice
    ("AutoDetect=off\nName=gpu Type=a100 File=/dev/nvidia0 Cores=0\n", {}, False),
    (
        "Name=gpu Type=2g.20gb MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21\n",
        {},
        False,
    ),
    ("AutoDetect=rsmi\n", {}, False),
    ("AutoDetect=oneapi\n", {}, False),
    ("AutoDetect=nrt\n", {}, False),
]


def test_mig_epilog_never_signals_a_process_on_another_slice(mig: Host) -> None:
    """Job 51 on slice 0/1/0 (its leftover outside its cgroup there), job 52 on slice 0/2/0,
    another user's notebook on slice 0/5/0; each holds /dev/nvidia0. For every gres.conf
    form, job 51's epilog signals only job 51's own: its slice where slurmd named it, else
    its cgroup alone."""
    host = mig
    jobs = start_jobs(host, {52: server(52, "0/2/0", 8152)})
    notebook, _ = host.hand_start((0,), 8155, "hand-notebook", "--gpus", "0/5/0", *SLICE_SERVER)
    leftover, _ = host.hand_start((0,), 8151, "hand-left51", "--gpus", "0/1/0", *SLICE_SERVER)
    others = [*jobs[52]["workers"], jobs[52]["api_server"], *notebook["workers"]]
    mine = [leftover["api_server"], *leftover["workers"]]
    for gres_text, env, resolved in MIG_FORMS:
        host.sim.write_file(f"{MIG_SLURM}/gres.conf", gres_text)
        check = host.sim.run(
            [
                "env",
                f"SLURM_CONF={MIG_SLURM}/slurm.conf",
                "gpugate",
                "slurm",
                "check",
                "--node",
                "simnode",
            ],
            check=False,
        )
        assert check.returncode == ExitCode.CONFIG, (gres_text, check.stdout)
        if resolved:
            continue  # killed once, below
        cursor = host.cursor()
        code, stderr = run_slurmd_hook(
            host, "epilog", 51, "0", SLURM_CONF=f"{MIG_SLURM}/slurm.conf", **env
        )
        assert code == 0, (gres_text, stderr)
        assert "slurmd's GPU numbers not resolved" in stderr, (gres_text, stderr)
        assert not host.events_after(cursor, GPUGATE_EVENT="signal_sent"), gres_text
        assert all(host.alive(pid) for pid in [*mine, *others]), gres_text
    round_ = 0
    for gres_text, env, resolved in MIG_FORMS:
        if not resolved:
            continue
        host.sim.write_file(f"{MIG_SLURM}/gres.conf", gres_text)
        cursor = host.cursor()
        code, stderr = run_slurmd_hook(
            host, "epilog", 51, "0", SLURM_CONF=f"{MIG_SLURM}/slurm.conf", **env
        )
        assert code == 0, (gres_text, stderr)
        assert all(host.alive(pid) for pid in others), gres_text
        signalled = {
            int(e["GPUGATE_PID"]) for e in host.events_after(cursor, GPUGATE_EVENT="signal_sent")
        }
        assert not signalled & set(others), gres_text
        assert not any(host.alive(pid) for pid in mine), gres_text
        assert host.used().get(1024, 0) == 0  # slice 0/1/0's memory (host.nvml.mig_key(0, 0))
        round_ += 1
        leftover, _ = host.hand_start(
            (0,), 8160 + round_, f"hand-left51-{round_}", "--gpus", "0/1/0", *SLICE_SERVER
        )
        mine = [leftover["api_server"], *leftover["workers"]]
    assert not host.sim.exists("/run/scontrol.args"), "drained"
