"""gpugate as the real slurmd's Prolog= and Epilog= (Slurm 22.05, munge; Debian's packages,
inside one simulated host of this module's own): one node, cgroup/v2, proctrack/cgroup,
task/cgroup, ConstrainDevices=yes, gres gpu:8 on device-node stand-ins (loop block devices). Jobs by srun
and sbatch; the evidence is Slurm's own (`sinfo`, `sinfo -R`, the jobs' output).

slurmd (only it) runs with an LD_PRELOAD shim that shows it just the `0::` line of
/proc/*/cgroup: the machine's kernel also mounts cgroup v1 hierarchies, which slurmd refuses
("Hybrid mode is not supported"); a real cgroup v2 node has nothing else. Jobs, prolog and
epilog run without it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from incident import REPO
from realparts import gpu_device_nodes, install_debs, slurm_gres_conf, wait_for
from sandbox import SimHost

from gpugate.errors import ExitCode

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

NODE = "simhost"
SHIM_SOURCE = Path(__file__).resolve().parent / "slurm_shim" / "cgroup_v2_only.c"
SHIM_OUT = REPO / ".simhost" / "slurm-shim" / "cgroup_v2_only.so"
SHIM_INSIDE = "/usr/local/lib/cgroup_v2_only.so"
MIB = 5000
SLURM_CONF = f"""\
ClusterName=sim
SlurmctldHost={NODE}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
Prolog=/etc/slurm/gpugate-prolog
Epilog=/etc/slurm/gpugate-epilog
PrologEpilogTimeout=60
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MpiDefault=none
ReturnToService=2
NodeName={NODE} NodeAddr=127.0.0.1 Gres=gpu:8 CPUs=1 State=UNKNOWN
PartitionName=gpu Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
CGROUP_CONF = "CgroupPlugin=cgroup/v2\nConstrainDevices=yes\n"
GPUGATE_SLURM = (
    "[prolog]\nsigterm_grace_s = 1\nwait_timeout_s = 10\n"
    "[epilog]\nsigterm_grace_s = 1\nsigkill_wait_s = 1\nwait_timeout_s = 3\n"
)
# Holds /dev/nvidiaN for each N of LIST open, as CUDA does, and claims MIB on each with the
# stand-in NVML (the driver would know), then sleeps SECONDS.
HOLD = """\
#!/bin/sh
list=$1 mib=$2 n=3
for g in $(echo "$list" | tr , ' '); do eval "exec $n</dev/nvidia$g"; n=$((n + 1)); done
st=$(sed 's/.*) //' /proc/$$/stat | cut -d' ' -f20)
mkdir -p /run/fake-nvml/claims
echo "$mib $st $list" > /run/fake-nvml/claims/$$.tmp && mv /run/fake-nvml/claims/$$.tmp /run/fake-nvml/claims/$$
exec sleep "${3:-3600}"
"""


def build_shim() -> Path:
    if SHIM_OUT.exists() and SHIM_OUT.stat().st_mtime >= SHIM_SOURCE.stat().st_mtime:
        return SHIM_OUT
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot build slurmd's cgroup shim")
    SHIM_OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = SHIM_OUT.with_suffix(".tmp")
    subprocess.run(
        [gcc, "-O2", "-Wall", "-shared", "-fPIC", "-o", str(tmp), str(SHIM_SOURCE), "-ldl"],
        check=True,
        capture_output=True,
    )
    tmp.replace(SHIM_OUT)
    return SHIM_OUT


class Node:
    def __init__(self, sim: SimHost) -> None:
        self.sim = sim

    def sh(self, cmd: str, check: bool = True, timeout: float = 120) -> str:
        return self.sim.run(cmd, check=check, timeout=timeout).stdout

    def state(self) -> str:
        return self.sh(f"sinfo -h -n {NODE} -o %T", check=False).strip()

    def reason(self) -> str:
        return self.sh(f"sinfo -R -h -n {NODE} -o %E", check=False).strip()

    def settle(self, timeout: float = 60) -> str:
        """Wait until no job is left and the node has finished its epilogs."""
        wait_for("no job left", lambda: not self.sh("squeue -h", check=False).strip(), timeout)
        return str(
            wait_for(
                "node done completing",
                lambda: (s := self.state()) and "comp" not in s and s.rstrip("*"),
                timeout,
            )
        )

    def resume(self) -> None:
        self.sh(f"scontrol update NodeName={NODE} State=RESUME", check=False)
        wait_for("node idle", lambda: self.state() == "idle")

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.sh("gpugate status --json"))
        return data

    def used(self) -> dict[int, int]:
        return {gpu["index"]: gpu["used_mib"] for gpu in self.status()["gpus"]}

    def journal(self, job: int) -> list[dict[str, Any]]:
        out = self.sh(f"journalctl --no-pager -o json GPUGATE_SLURM_JOB={job}", check=False)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def exists_file(self, path: str) -> bool:
        return self.sim.exists(path)

    def alive(self, pid: int) -> bool:
        state = self.sh(f"sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -c1", check=False)
        return state.strip() not in ("", "Z", "X")

    def sbatch(self, script: str, gpus: int = 2) -> int:
        path = f"/root/job-{abs(hash(script))}.sh"
        self.sim.write_file(path, "#!/bin/sh\n" + script, mode=0o755)
        out = self.sh(f"cd /root && sbatch --parsable --gres=gpu:{gpus} -o /root/%j.out {path}")
        return int(out.strip().split(";")[0])


@pytest.fixture(scope="module")
def node(fake_nvml_lib: Path | None) -> Iterator[Node]:
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    shim = build_shim()
    sim = SimHost.boot(nvml_lib=fake_nvml_lib, gpus=8)
    try:
        sim.install_gpugate(REPO)
        sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
        install_debs(sim, "slurm", ["slurmctld", "slurmd", "slurm-client", "munge"])
        sim.write_file(SHIM_INSIDE, shim.read_bytes(), mode=0o755)
        gpu_device_nodes(sim)
        sim.run(
            f"hostname {NODE}; echo '127.0.0.1 {NODE}' >> /etc/hosts;"
            " ip addr add 127.0.0.2/8 dev lo;"
            " mkdir -p /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm"
        )
        sim.write_file("/etc/slurm/slurm.conf", SLURM_CONF)
        sim.write_file("/etc/slurm/cgroup.conf", CGROUP_CONF)
        slurm_gres_conf(sim)
        for phase in ("prolog", "epilog"):
            sim.write_file(
                f"/etc/slurm/gpugate-{phase}",
                f"#!/bin/sh\nexec /usr/bin/gpugate slurm {phase}\n",
                mode=0o755,
            )
        sim.write_file("/etc/gpugate/slurm.toml", GPUGATE_SLURM)
        sim.write_file("/usr/local/bin/hold-gpus", HOLD, mode=0o755)
        sim.write_file(
            "/etc/systemd/system/slurmd.service.d/cgroup-v2-only.conf",
            f"[Service]\nEnvironment=LD_PRELOAD={SHIM_INSIDE}\n",
        )
        sim.run(
            "test -s /etc/munge/munge.key || (dd if=/dev/urandom bs=1 count=1024 "
            "> /etc/munge/munge.key 2>/dev/null && chown munge:munge /etc/munge/munge.key "
            "&& chmod 400 /etc/munge/munge.key)"
        )
        sim.daemon_reload()
        sim.systemctl("start", "munge.service", "slurmctld.service")
        started = sim.systemctl("start", "slurmd.service", check=False)
        n = Node(sim)
        if started.returncode:
            raise AssertionError(
                "slurmd did not start:\n" + n.sh("tail -20 /var/log/slurm/slurmd.log", False)
            )
        try:
            wait_for("node idle", lambda: n.state() == "idle", timeout=60)
        except AssertionError as err:
            logs = n.sh("tail -15 /var/log/slurm/slurmd.log /var/log/slurm/slurmctld.log", False)
            raise AssertionError(f"{err}\n{logs}") from None
        yield n
    finally:
        sim.poweroff()


@pytest.fixture
def clean(node: Node) -> Iterator[Node]:
    yield node
    node.sh("scancel --user=root 2>/dev/null; rm -f /run/fake-nvml/leak/*", check=False)
    node.settle()
    if node.state() != "idle":
        node.resume()


def test_clean_srun_job_runs_with_its_gpus_and_leaves_the_node_idle(clean: Node) -> None:
    out = clean.sh(
        "cd /root && srun --gres=gpu:2 /bin/sh -c 'echo job=$SLURM_JOB_ID "
        "job_gpus=$SLURM_JOB_GPUS step_gpus=$SLURM_STEP_GPUS cuda=$CUDA_VISIBLE_DEVICES; "
        "cat /proc/self/cgroup | tail -1; hold-gpus $SLURM_STEP_GPUS 1000 1'",
        timeout=120,
    )
    first, cgroup = out.strip().splitlines()[:2]
    fields = dict(item.split("=", 1) for item in first.split())
    # What slurmd really gives an srun task: SLURM_JOB_GPUS empty, SLURM_STEP_GPUS set.
    assert fields["job_gpus"] == "" and fields["step_gpus"] == "0,1" == fields["cuda"]
    job = int(fields["job"])
    # ... in a scope named after the node (Debian's multiple-slurmd build)
    assert cgroup == f"0::/system.slice/{NODE}_slurmstepd.scope/job_{job}/step_0/user/task_0"
    assert clean.settle() == "idle" and clean.reason() == ""
    entries = clean.journal(job)
    finished = [e for e in entries if e.get("GPUGATE_EVENT") == "run_finished"]
    assert {e["GPUGATE_PHASE"] for e in finished} == {"prolog", "epilog"}
    assert all(e["GPUGATE_RESULT"] == "success" for e in finished)
    started = [e for e in entries if e.get("GPUGATE_EVENT") == "run_started"]
    assert all("2 GPU(s) [0, 1]" in e["MESSAGE"] for e in started)


def test_orphan_outside_the_job_cgroup_is_killed_other_jobs_untouched(clean: Node) -> None:
    other = clean.sbatch("exec hold-gpus $SLURM_JOB_GPUS 2000")
    wait_for("the other job on its GPUs", lambda: clean.used().get(0) == 2000)
    # A root job whose child moves itself out of the job's cgroup and outlives the job.
    job = clean.sbatch(
        "mkdir -p /sys/fs/cgroup/stray; "
        "sh -c 'echo $$ > /sys/fs/cgroup/stray/cgroup.procs; echo $$ > /root/orphan.pid; "
        "exec hold-gpus $SLURM_JOB_GPUS 3000' & sleep 2; exit 0"
    )
    wait_for("job done", lambda: not clean.sh(f"squeue -h -j {job}", check=False).strip())
    wait_for("node done completing", lambda: "comp" not in clean.state())
    said = clean.sh(f"cat /root/{job}.out", check=False)
    assert clean.exists_file("/root/orphan.pid"), said
    orphan = int(clean.sh("cat /root/orphan.pid").strip())
    assert not clean.alive(orphan)
    assert clean.state() in ("mixed", "allocated", "idle") and clean.reason() == ""
    used = clean.used()
    assert used[2] == 0 and used[3] == 0 and used[0] == 2000 and used[1] == 2000
    signalled = [e for e in clean.journal(job) if e.get("GPUGATE_EVENT") == "signal_sent"]
    assert {e["GPUGATE_PID"] for e in signalled} == {str(orphan)}
    assert {e["GPUGATE_PHASE"] for e in signalled} == {"epilog"}
    assert all(e["GPUGATE_ROLE"] == "orphan" for e in signalled)
    assert clean.sh(f"squeue -h -j {other} -o %T").strip() == "RUNNING"


@pytest.mark.message
def test_leaked_memory_fails_the_epilog_and_drains_with_gpugates_reason(clean: Node) -> None:
    # The driver keeps 7000 MiB of the job's GPUs used with no process left.
    job = clean.sbatch(
        "mkdir -p /run/fake-nvml/leak; "
        "for g in $(echo $SLURM_JOB_GPUS | tr , ' '); do echo 7000 > /run/fake-nvml/leak/$g; done"
    )
    try:
        wait_for("node drained", lambda: "drain" in clean.state(), timeout=60)
    except AssertionError as err:
        said = clean.sh(f"cat /root/{job}.out; scontrol show job {job} | head -5", check=False)
        raise AssertionError(f"{err}\n{said}") from None
    reason = clean.reason()
    assert reason.startswith(f"gpugate epilog job {job}: GPU 0 (")
    assert "still 7000 MiB used" in reason and reason.endswith(
        f"(exit {int(ExitCode.MEMORY_TIMEOUT)})"
    )


def test_prolog_kills_a_stale_holder_on_the_jobs_gpus(clean: Node) -> None:
    clean.sim.spawn_scope(["/usr/local/bin/hold-gpus", "0,1", "4000"], unit="stale.scope")
    wait_for("the stale holder's memory", lambda: clean.used()[0] == 4000)
    stale = int(clean.sh("cat /sys/fs/cgroup/user.slice/stale.scope/cgroup.procs").split()[0])
    job = clean.sbatch("echo ran on $SLURM_JOB_GPUS")
    assert clean.settle() == "idle" and clean.reason() == ""
    assert clean.sh(f"cat /root/{job}.out").strip() == "ran on 0,1"
    assert not clean.alive(stale)
    killed = [
        e
        for e in clean.journal(job)
        if e.get("GPUGATE_EVENT") == "signal_sent" and e.get("GPUGATE_PHASE") == "prolog"
    ]
    assert {e["GPUGATE_PID"] for e in killed} == {str(stale)}


# ---------------------------------------------------------------- slurmd's GPU numbers

REVERSED = "gpu_count = 8\nrelease_delay_ms = 0\nminors = 7 6 5 4 3 2 1 0\n"
PLAIN = "gpu_count = 8\nrelease_delay_ms = 0\n"
# The job's device files: slurmd's number N is the N-th of FILES (gres.conf's File= order).
DEVICES = """\
set -- {files}; devs=""
for n in $(echo $SLURM_JOB_GPUS | tr , ' ' | cut -d' ' -f{fields}); do
  eval "d=\\${{$((n + 1))}}"; devs="$devs,$d"
done
devs="${{devs#,}}{extra}"
"""
# A root job whose child leaves the job's cgroup holding those files, then waits for go-TAG.
ESCAPE = """\
mkdir -p /sys/fs/cgroup/stray
sh -c 'echo $$ > /sys/fs/cgroup/stray/cgroup.procs; echo $$ > /root/orphan-{tag}.pid;
exec hold-gpus '"$devs"' 3000' &
while [ ! -e /root/go-{tag} ]; do sleep 0.2; done
"""


def nvml_index(minor: int) -> int:
    return 7 - minor  # REVERSED: NVML's GPU i has minor 7 - i


@pytest.fixture
def reversed_minors(clean: Node) -> Iterator[Node]:
    """NVML's indices in another order than the device minors: /dev/nvidia7 is NVML's GPU 0."""
    clean.sim.write_file("/etc/fake-nvml.conf", REVERSED)
    try:
        yield clean
    finally:
        clean.sh("scancel --user=root; touch /root/go-a /root/go-s", check=False)
        clean.settle()
        clean.sh("rm -f /root/go-* /root/orphan-*", check=False)
        clean.sim.write_file("/etc/fake-nvml.conf", PLAIN)


def gres_order(node: Node, files: list[int]) -> None:
    """gres.conf's File= list, and slurmd restarted to read it."""
    listed = ",".join(map(str, files))
    node.sim.write_file("/etc/slurm/gres.conf", f"Name=gpu File=/dev/nvidia[{listed}]\n")
    node.sim.systemctl("restart", "slurmd.service")
    wait_for("node idle", lambda: node.state() == "idle", timeout=60)


def numbers(node: Node, job: int) -> list[int]:
    """slurmd's numbers for the job (`GRES=gpu:2(IDX:0-1)`, `(IDX:2,5)`)."""
    out = node.sh(f"scontrol show job -d {job}", check=False)
    idx = out.split("IDX:", 1)[1].split(")", 1)[0]
    found: list[int] = []
    for part in idx.split(","):
        low, _, high = part.partition("-")
        found.extend(range(int(low), int(high or low) + 1))
    return found


def devices(files: list[int], fields: str = "1-", extra: str = "") -> str:
    return DEVICES.format(files=" ".join(map(str, files)), fields=fields, extra=extra)


def escaping_job(node: Node, tag: str, script: str) -> tuple[int, int]:
    job = node.sbatch(script + ESCAPE.format(tag=tag))
    wait_for("the orphan", lambda: node.exists_file(f"/root/orphan-{tag}.pid"), timeout=60)
    return job, int(node.sh(f"cat /root/orphan-{tag}.pid").strip())


def running(node: Node, job: int) -> bool:
    return node.sh(f"squeue -h -j {job} -o %T", check=False).strip() == "RUNNING"


def finish(node: Node, job: int, tag: str) -> None:
    node.sh(f"touch /root/go-{tag}")
    wait_for("job done", lambda: not node.sh(f"squeue -h -j {job}", check=False).strip())
    wait_for("node done completing", lambda: "comp" not in node.state())


@pytest.mark.parametrize("files", [list(range(8)), [3, 2, 1, 0, 7, 6, 5, 4]])
def test_epilog_kills_its_own_leftovers_by_slurmds_numbers_not_nvmls(
    reversed_minors: Node, files: list[int]
) -> None:
    node = reversed_minors
    if files != list(range(8)):
        gres_order(node, files)
    server = None
    try:
        job, orphan = escaping_job(node, "a", devices(files))
        own = [files[n] for n in numbers(node, job)]
        other = node.sbatch(devices(files) + 'exec hold-gpus "$devs" 2000')
        wait_for("the other job running", lambda: running(node, other))
        theirs = [files[n] for n in numbers(node, other)]
        wait_for("the other job's memory", lambda: node.used()[nvml_index(theirs[0])] == 2000)
        # A server outside every job, on the device that is NVML's GPU with the index of one
        # of this job's numbers: what taking the numbers as NVML's indices would kill.
        spare = next(
            m for m in range(8) if m not in own + theirs and nvml_index(m) in numbers(node, job)
        )
        node.sim.spawn_scope(["/usr/local/bin/hold-gpus", str(spare), "4000"], unit="server.scope")
        server = int(node.sh("cat /sys/fs/cgroup/user.slice/server.scope/cgroup.procs").split()[0])
        wait_for("the server's memory", lambda: node.used()[nvml_index(spare)] == 4000)

        finish(node, job, "a")

        assert not node.alive(orphan)
        assert node.alive(server)
        assert node.reason() == ""
        used = node.used()
        assert [used[nvml_index(m)] for m in own] == [0, 0]
        assert used[nvml_index(spare)] == 4000
        assert [used[nvml_index(m)] for m in theirs] == [2000, 2000]
        signalled = [e for e in node.journal(job) if e.get("GPUGATE_EVENT") == "signal_sent"]
        assert {e["GPUGATE_PID"] for e in signalled} == {str(orphan)}
        assert running(node, other)
    finally:
        if server is not None:
            node.sh(f"kill {server}", check=False)
        if files != list(range(8)):
            node.sh("scancel --user=root; touch /root/go-a", check=False)
            node.settle()
            gres_order(node, list(range(8)))


@pytest.mark.message
def test_straddling_leftover_drains_naming_the_held_gpu_pid_and_rule(
    reversed_minors: Node,
) -> None:
    node = reversed_minors
    other = node.sbatch("exec hold-gpus $SLURM_JOB_GPUS 2000")
    wait_for("the other job running", lambda: running(node, other))
    theirs = numbers(node, other)
    # the orphan holds this job's first GPU (not its second) and one of the other job's
    job, orphan = escaping_job(node, "s", devices(list(range(8)), "1", f",{theirs[0]}"))
    mine = numbers(node, job)
    try:
        finish(node, job, "s")
        wait_for("node drained", lambda: "drain" in node.state(), timeout=60)
        assert node.alive(orphan)
        assert node.reason() == (
            f"gpugate epilog job {job}: PID {orphan} (root) on GPU {nvml_index(mine[0])}: "
            f"straddles GPU {nvml_index(theirs[0])}, not this job's "
            f"(exit {int(ExitCode.HELD_BY_OTHERS)})"
        )
    finally:
        node.sh(f"kill {orphan}", check=False)


@pytest.mark.parametrize("phase", ["prolog", "epilog"])
def test_no_dev_files_gates_nothing_and_drains_nothing(clean: Node, phase: str) -> None:
    """slurmd's environment for a job whose gres has no device files, as a hook gets it."""
    clean.sim.spawn_scope(["/usr/local/bin/hold-gpus", "4", "1500"], unit="bystander.scope")
    cgroup = "/sys/fs/cgroup/user.slice/bystander.scope/cgroup.procs"
    bystander = int(clean.sh(f"cat {cgroup}").split()[0])
    job = {"prolog": 7771, "epilog": 7772}[phase]
    try:
        ran = clean.sim.run(
            f"env -i SLURM_JOB_ID={job} SLURM_JOB_UID=0 SLURM_JOB_GPUS=NoDevFiles "
            f"SLURMD_NODENAME={NODE} SLURM_CONF=/etc/slurm/slurm.conf "
            f"/usr/bin/gpugate slurm {phase}",
            check=False,
        )
        assert ran.returncode == 0, ran.stderr
        assert clean.alive(bystander)
        assert clean.state() == "idle" and clean.reason() == ""
        said = [e["MESSAGE"] for e in clean.journal(job)]
        assert said == ["no GPUs to gate (SLURM_JOB_GPUS=NoDevFiles)"]
    finally:
        clean.sh(f"kill {bystander}", check=False)


# ---------------------------------------------------------------- gres/shard

SHARD_CONF = SLURM_CONF.replace("GresTypes=gpu\n", "GresTypes=gpu,shard\n").replace(
    "Gres=gpu:8 ", "Gres=gpu:8,shard:64 "
)
SHARD_GRES = "Name=gpu File=/dev/nvidia[0-7]\nName=shard Count=64\n"  # 8 per GPU
# A shard job: a process of its own on its GPU (in the job's cgroup), and one more that waits
# to be moved out of the job's cgroup (the escaped leftover), then waits for go-TAG.
SHARD_JOB = """\
hold-gpus $SLURM_JOB_GPUS {own} &
hold-gpus $SLURM_JOB_GPUS {left} &
echo $! > {dir}/leftover-{tag}.pid
while [ ! -e {dir}/go-{tag} ]; do sleep 0.2; done
"""


def restart_slurm(node: Node, slurm_conf: str, gres_conf: str) -> None:
    node.sim.write_file("/etc/slurm/slurm.conf", slurm_conf)
    slurm_gres_conf(node.sim, gres_conf)
    node.sim.systemctl("restart", "slurmctld.service", "slurmd.service")
    wait_for("node idle", lambda: node.state() == "idle", timeout=60)


@pytest.fixture
def sharded(clean: Node) -> Iterator[Node]:
    """The node's GPUs in shards (Slurm's documented layout), and alice to submit jobs."""
    clean.sh("id alice >/dev/null 2>&1 || useradd -m alice")
    clean.sh(
        "mkdir -p /run/fake-nvml/claims /sys/fs/cgroup/stray && chmod 1777 /run/fake-nvml/claims"
    )
    restart_slurm(clean, SHARD_CONF, SHARD_GRES)
    try:
        yield clean
    finally:
        clean.sh("scancel --user=root; scancel --user=alice; touch /tmp/go-r /tmp/go-a", False)
        clean.settle()
        clean.sh("rm -f /tmp/go-* /tmp/leftover-*", check=False)
        restart_slurm(clean, SLURM_CONF, "Name=gpu File=/dev/nvidia[0-7]\n")


def shard_job(node: Node, user: str, tag: str, own: int, left: int) -> tuple[int, int]:
    """A `--gres=shard:2` job of USER; its leftover moved out of its cgroup by root (only root
    may move a process between cgroups; a root job does it itself in the tests above)."""
    script = f"/tmp/shard-{tag}.sh"
    node.sim.write_file(
        script, "#!/bin/sh\n" + SHARD_JOB.format(own=own, left=left, dir="/tmp", tag=tag), 0o755
    )
    out = node.sh(
        f"cd /tmp && runuser -u {user} -- sbatch --parsable --gres=shard:2 -o /tmp/%j.out {script}"
    )
    job = int(out.strip().split(";")[0])
    wait_for(f"job {job} running", lambda: running(node, job), timeout=60)
    wait_for(f"job {job}'s leftover", lambda: node.exists_file(f"/tmp/leftover-{tag}.pid"))
    return job, int(node.sh(f"cat /tmp/leftover-{tag}.pid").strip())


def end(node: Node, job: int, tag: str) -> None:
    node.sh(f"touch /tmp/go-{tag}")
    wait_for("job done", lambda: not node.sh(f"squeue -h -j {job}", check=False).strip())
    wait_for("node done completing", lambda: "comp" not in node.state())


def escape(node: Node, pid: int) -> None:
    node.sh(f"echo {pid} > /sys/fs/cgroup/stray/cgroup.procs")


def gpus_of(node: Node, job: int) -> str:
    """The job's GPU in its hooks' environment, as the prolog's journal entry names it."""
    started = [e for e in node.journal(job) if e.get("GPUGATE_EVENT") == "run_started"]
    return str(started[0].get("GPUGATE_GPU", ""))


def test_two_users_shard_jobs_share_a_gpu_no_drain_each_leftover_killed(sharded: Node) -> None:
    node = sharded
    check = node.sim.run("gpugate slurm check", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("shared: carries gres/shard (/etc/slurm/gres.conf line 2)") == 8
    root_job, root_left = shard_job(node, "root", "r", 1000, 3000)
    alice_job, alice_left = shard_job(node, "alice", "a", 2000, 4000)
    # both on one GPU, and both hooks saw a gpu:1 job's environment
    assert gpus_of(node, root_job) == gpus_of(node, alice_job) == "0"
    assert node.state() in ("mixed", "allocated") and node.reason() == ""
    wait_for("both jobs' memory", lambda: node.used()[0] == 10000)

    escape(node, root_left)
    end(node, root_job, "r")
    # the root job's epilog: its leftover killed, alice's job (a sharer) untouched, no drain
    assert not node.alive(root_left)
    assert node.alive(alice_left) and running(node, alice_job)
    assert node.reason() == ""
    wait_for("alice's memory alone", lambda: node.used()[0] == 6000)
    signalled = [e for e in node.journal(root_job) if e.get("GPUGATE_EVENT") == "signal_sent"]
    assert {e["GPUGATE_PID"] for e in signalled} == {str(root_left)}

    escape(node, alice_left)
    end(node, alice_job, "a")
    assert not node.alive(alice_left)
    assert node.settle() == "idle" and node.reason() == ""
    assert node.used()[0] == 0
    signalled = [e for e in node.journal(alice_job) if e.get("GPUGATE_EVENT") == "signal_sent"]
    assert {e["GPUGATE_PID"] for e in signalled} == {str(alice_left)}
    for job in (root_job, alice_job):
        finished = [e for e in node.journal(job) if e.get("GPUGATE_EVENT") == "run_finished"]
        assert {e["GPUGATE_PHASE"] for e in finished} == {"prolog", "epilog"}
        assert all(e["GPUGATE_RESULT"] == "success" for e in finished)
