"""A node's gres.conf as slurmd reads it (integrations.gres_conf), slurmd's GPU numbers as
NVML's GPUs by device number (integrations.gres_conf), and the drain reason's words."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from gpugate.core.outcome import UNKILLABLE, Blocker, BusyGpu
from gpugate.errors import ExitCode, GresUnresolved
from gpugate.front.commands.slurm import drain_reason, failure_detail, slurm_check
from gpugate.host.nvml import Gpu, mig_key
from gpugate.integrations.gres_conf import (
    DeviceNodes,
    GpuLayout,
    expand_hostlist,
    gres_conf_path,
    in_slurm_conf_order,
    job_gpus,
    parse_gres_conf,
    read_root_file,
    slices_by_unique_id,
    spread,
)
from tests.fakes import FakeGpuMemory, mig_uuid, run_summary

PATH = "/etc/slurm/gres.conf"


def layout(text: str, node: str | None = "gpu07") -> GpuLayout:
    return parse_gres_conf(text, PATH, node)


def unresolved(text: str, node: str | None = "gpu07") -> GresUnresolved:
    with pytest.raises(GresUnresolved) as caught:
        parse_gres_conf(text, PATH, node)
    return caught.value


# ---------------------------------------------------------------- hostlists


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("/dev/nvidia0", ["/dev/nvidia0"]),
        ("/dev/nvidia[0-3]", [f"/dev/nvidia{i}" for i in range(4)]),
        (
            "/dev/nvidia[0-3,6]",
            ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3", "/dev/nvidia6"],
        ),
        ("/dev/nvidia[6,4,2]", ["/dev/nvidia6", "/dev/nvidia4", "/dev/nvidia2"]),
        (
            "/dev/nvidia3,/dev/nvidia[1-2],/dev/nvidia0",
            ["/dev/nvidia3", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia0"],
        ),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("/dev/nvidia[7]", ["/dev/nvidia7"]),
    ],
)
def test_hostlists_expand_in_the_order_written(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(
    "text",
    [
        "/dev/nvidia[3-1]",
        "/dev/nvidia[0-1]x[0-1]",
        "/dev/nvidia[",
        "/dev/nvidia[a-b]",
        "a,,b",
        ",",
        "/dev/nvidia[0-99999]",
        "/dev/nvidia[0-1",
    ],
)
def test_hostlists_this_reader_does_not_know_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


# ---------------------------------------------------------------- gres.conf


@pytest.mark.parametrize(
    ("text", "files"),
    [
        ("Name=gpu File=/dev/nvidia[0-7]\n", [f"/dev/nvidia{i}" for i in range(8)]),
        ("name=gpu file=/dev/nvidia[1,0]  # comment\n", ["/dev/nvidia1", "/dev/nvidia0"]),
        ('Name=gpu File="/dev/nvidia2"\n', ["/dev/nvidia2"]),
        # Name= lines first, then this node's NodeName= lines, each in the file's order
        (
            "NodeName=gpu07 Name=gpu Type=h100 File=/dev/nvidia[4-5]\n"
            "Name=gpu Type=a100 File=/dev/nvidia[0-1]\n"
            "NodeName=gpu[01-06] Name=gpu File=/dev/nvidia[2-3]\n"
            "NodeName=gpu[07-08] Name=gpu Type=l4 File=/dev/nvidia6\n",
            ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia4", "/dev/nvidia5", "/dev/nvidia6"],
        ),
        # other gres are not GPUs; a line continued with a backslash is one line
        (
            "Name=shard Count=8\nName=mps Count=100 File=/dev/nvidia0\n"
            "Name=gpu \\\n  File=/dev/nvidia[2-3]\n",
            ["/dev/nvidia2", "/dev/nvidia3"],
        ),
        ("AutoDetect=off\nName=gpu File=/dev/nvidia0\n", ["/dev/nvidia0"]),
        (
            "AutoDetect=nvml\nNodeName=gpu07 AutoDetect=off\nName=gpu File=/dev/nvidia1\n",
            ["/dev/nvidia1"],
        ),
    ],
)
def test_gres_conf_lists_gpus_in_slurmds_order(text: str, files: list[str]) -> None:
    found = layout(text)
    assert (list(found.files), found.nvml_order) == (files, False)


@pytest.mark.parametrize(
    ("text", "files"),
    [
        ("AutoDetect=nvml\n", []),
        ("AutoDetect=NVML\nName=gpu File=/dev/nvidia[2-3]\n", ["/dev/nvidia2", "/dev/nvidia3"]),
        ("NodeName=gpu07 AutoDetect=nvml\n", []),
        (
            "AutoDetect=off\nNodeName=gpu07 AutoDetect=nvml Name=gpu File=/dev/nvidia0\n",
            ["/dev/nvidia0"],
        ),
    ],
)
def test_autodetect_nvml_orders_by_nvml(text: str, files: list[str]) -> None:
    found = layout(text)
    assert (list(found.files), found.nvml_order) == (files, True)


@pytest.mark.message
@pytest.mark.parametrize(
    ("text", "node", "problem"),
    [
        ("AutoDetect=rsmi\n", "gpu07", "GRES_AUTODETECT"),
        ("AutoDetect=oneapi\nName=gpu File=/dev/nvidia0\n", "gpu07", "GRES_AUTODETECT"),
        ("NodeName=gpu07 AutoDetect=nvidia\n", "gpu07", "GRES_AUTODETECT"),
        ("AutoDetect=nvml\nName=gpu Type=a100 Count=4\n", "gpu07", "GRES_AUTODETECT_MATCH"),
        ("AutoDetect=nvml\nName=gpu File=/dev/nvidia[0-1] Cores=0-3\n", "gpu07", "GRES_BOUND"),
        ("AutoDetect=nvml\nName=gpu File=/dev/nvidia0 Links=-1,0\n", "gpu07", "GRES_BOUND"),
        (
            "NodeName=gpu07 AutoDetect=nvml Name=gpu File=/dev/nvidia0 CPUs=0\n",
            "gpu07",
            "GRES_BOUND",
        ),
        ("Name=gpu Count=8\n", "gpu07", "GRES_NO_FILES"),
        ("", "gpu07", "GRES_NO_FILES"),
        ("NodeName=gpu08 Name=gpu File=/dev/nvidia0\n", "gpu07", "GRES_NO_FILES"),
        ("NodeName=gpu07 Name=gpu File=/dev/nvidia0\n", None, "GRES_NODE_UNKNOWN"),
        ("Include /etc/slurm/gres.d/*.conf\n", "gpu07", "GRES_LINE"),
        ("include=/etc/slurm/x.conf\n", "gpu07", "GRES_LINE"),
        ("Name=gpu File=/dev/nvidia[0-1] garbage\n", "gpu07", "GRES_LINE"),
        ("Name=gpu File=/dev/nvidia0 MultipleFiles=/dev/nvidia[0-1]\n", "gpu07", "GRES_LINE"),
        ("Name=gpu MultipleFiles=/dev/nvidia[1-0]\n", "gpu07", "GRES_LINE"),
        ("Name=gpu File=/dev/nvidia[1-0]\n", "gpu07", "GRES_LINE"),
        ("NodeName=gpu[07 Name=gpu File=/dev/nvidia0\n", "gpu07", "GRES_LINE"),
        ("Type=a100 File=/dev/nvidia0\n", "gpu07", "GRES_LINE"),
        (
            "Name=gpu File=/dev/nvidia0\nName=gpu File=/dev/nvidia[0-1]\n",
            "gpu07",
            "GRES_FILE_TWICE",
        ),
    ],
)
def test_gres_conf_not_read_for_certain(text: str, node: str | None, problem: str) -> None:
    assert str(unresolved(text, node)).count("\n") == 0  # one line; the class is the code


def test_gres_conf_path_follows_slurm_conf(tmp_path: Path) -> None:
    assert gres_conf_path(None) == Path("/etc/slurm/gres.conf")
    assert gres_conf_path("/run/slurm/conf/slurm.conf") == Path("/run/slurm/conf/gres.conf")
    for bad in ("slurm.conf", "../x/slurm.conf", "/etc/slurm/slurm.conf\n", "/" + "a" * 5000):
        with pytest.raises(GresUnresolved):
            gres_conf_path(bad)


def test_gres_conf_read_only_as_roots_file(tmp_path: Path) -> None:
    folder = tmp_path / "slurm"
    folder.mkdir()
    path = folder / "gres.conf"
    with pytest.raises(GresUnresolved):
        read_root_file(path)
    path.write_text("Name=gpu File=/dev/nvidia0\n")
    assert read_root_file(path) == "Name=gpu File=/dev/nvidia0\n"
    path.chmod(0o666)
    with pytest.raises(GresUnresolved):
        read_root_file(path)
    path.chmod(0o644)
    path.write_bytes(b"#" * (300 * 1024))
    with pytest.raises(GresUnresolved):
        read_root_file(path)
    path.unlink()
    os.mkfifo(path, 0o600)
    with pytest.raises(GresUnresolved):
        read_root_file(path)  # never blocks on a FIFO


# ---------------------------------------------------------------- numbers to GPUs

MINORS = [7, 6, 5, 4, 3, 2, 1, 0]  # NVML index i has minor MINORS[i]


def gpus(minors: list[int] = MINORS) -> list[Gpu]:
    return [Gpu(i, f"GPU-{i}", m, "Fake", 1000) for i, m in enumerate(minors)]


def nodes(tmp_path: Path, extra: dict[str, tuple[int, int, int]] | None = None) -> DeviceNodes:
    """A device root with /dev/nvidia0-7 as 195:N character devices (a stat stand-in: no
    mknod without root), and extra names with (type bits, major, minor)."""
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    table = {f"nvidia{i}": (stat.S_IFCHR, 195, i) for i in range(8)}
    table["nvidiactl"] = (stat.S_IFCHR, 195, 255)
    table.update(extra or {})
    for name in table:
        (dev / name).write_bytes(b"")
    (dev / "plain").write_bytes(b"")

    def stat_(path: str) -> os.stat_result:
        real = Path(os.path.realpath(path))
        if real.parent == dev and real.name in table:
            kind, major, minor = table[real.name]
            fields = (kind | 0o666, 0, 0, 1, 0, 0, 0, 0, 0, 0)
            return os.stat_result(fields, {"st_rdev": os.makedev(major, minor)})
        return os.stat(path)

    return DeviceNodes(dev, stat_)


@pytest.mark.parametrize(
    ("text", "numbers", "indices"),
    [
        ("Name=gpu File=/dev/nvidia[0-7]\n", (0, 1), (7, 6)),
        ("Name=gpu File=/dev/nvidia[0-7]\n", (7,), (0,)),
        ("Name=gpu File=/dev/nvidia[3,1,0,2]\n", (0, 3), (4, 5)),
        ("Name=gpu File=/dev/nvidia[0-3,6]\n", (4,), (1,)),
        ("Name=gpu File=/dev/nvidia6\nName=gpu File=/dev/nvidia0\n", (1, 0), (7, 1)),
        # a File that is a link to the node: the node it is (stat follows it)
        ("Name=gpu File=/dev/gpu-a,/dev/nvidia5\n", (0, 1), (0, 2)),
        ("AutoDetect=nvml\n", (0, 1, 7), (0, 1, 7)),
        # AutoDetect with File=: those GPUs, in NVML's order
        ("AutoDetect=nvml\nName=gpu File=/dev/nvidia[0,7,2]\n", (0, 1, 2), (0, 5, 7)),
    ],
)
def test_numbers_name_gpus_by_device_number(
    tmp_path: Path, text: str, numbers: tuple[int, ...], indices: tuple[int, ...]
) -> None:
    found_nodes = nodes(tmp_path)
    (found_nodes.dev / "gpu-a").symlink_to(found_nodes.dev / "nvidia7")
    found = job_gpus(numbers, layout(text), gpus(), found_nodes)
    assert tuple(gpu.index for gpu in found) == indices


def test_a_file_named_like_a_gpu_is_the_gpu_its_device_number_says(tmp_path: Path) -> None:
    """/dev/nvidia-a100-0 (a site's own name) and a renamed node: the number decides."""
    found_nodes = nodes(tmp_path, {"nvidia-a100-0": (stat.S_IFCHR, 195, 3)})
    found = job_gpus((0,), layout("Name=gpu File=/dev/nvidia-a100-0\n"), gpus(), found_nodes)
    assert [gpu.index for gpu in found] == [4]


@pytest.mark.message
@pytest.mark.parametrize(
    ("text", "numbers", "extra", "problem"),
    [
        ("Name=gpu File=/dev/nvidia[0-1]\n", (2,), {}, "GRES_INDEX_PAST"),
        ("Name=gpu File=/dev/nvidia[0-1]\n", (0, 5), {}, "GRES_INDEX_PAST"),
        ("Name=gpu File=/dev/plain\n", (0,), {}, "GRES_FILE_NOT_GPU"),
        ("Name=gpu File=/dev/missing,/dev/nvidia1\n", (1,), {}, "GRES_FILE_NOT_GPU"),
        (
            "Name=gpu File=/dev/null0\n",
            (0,),
            {"null0": (stat.S_IFCHR, 1, 3)},
            "GRES_FILE_NOT_GPU",
        ),
        (
            "Name=gpu File=/dev/blk\n",
            (0,),
            {"blk": (stat.S_IFBLK, 195, 1)},
            "GRES_FILE_NOT_GPU",
        ),
        # 195:9 is a GPU device number, but no /dev/nvidia9 is that device
        (
            "Name=gpu File=/dev/odd\n",
            (0,),
            {"odd": (stat.S_IFCHR, 195, 9)},
            "GRES_FILE_NOT_GPU",
        ),
        ("Name=gpu File=/dev/nvidiactl\n", (0,), {}, "GRES_FILE_NOT_GPU"),
        ("AutoDetect=nvml\n", (8,), {}, "GRES_INDEX_PAST"),
        (
            "AutoDetect=nvml\nName=gpu File=/dev/nvidia0,/dev/plain\n",
            (0,),
            {},
            "GRES_FILE_NOT_GPU",
        ),
    ],
)
def test_numbers_not_resolved_for_certain(
    tmp_path: Path,
    text: str,
    numbers: tuple[int, ...],
    extra: dict[str, tuple[int, int, int]],
    problem: str,
) -> None:
    with pytest.raises(GresUnresolved):
        job_gpus(numbers, layout(text), gpus(), nodes(tmp_path, extra))


def test_a_node_named_for_one_gpu_is_the_gpu_its_number_says(tmp_path: Path) -> None:
    """/dev/nvidia9 made as 195:2 is GPU minor 2's device (and no GPU 9's)."""
    found_nodes = nodes(tmp_path, {"nvidia9": (stat.S_IFCHR, 195, 2)})
    found = job_gpus((0,), layout("Name=gpu File=/dev/nvidia9\n"), gpus(), found_nodes)
    assert [gpu.minor for gpu in found] == [2]


def test_a_gpu_nvml_does_not_list(tmp_path: Path) -> None:
    with pytest.raises(GresUnresolved):
        job_gpus((0,), layout("Name=gpu File=/dev/nvidia7\n"), gpus([0, 1]), nodes(tmp_path))


def test_a_broken_file_after_the_jobs_numbers_does_not_matter(tmp_path: Path) -> None:
    """slurmd skips a File it cannot stat and numbers the later ones one lower: only the
    files up to the job's highest number must be GPUs."""
    text = "Name=gpu File=/dev/nvidia0,/dev/nvidia1,/dev/plain\n"
    found = job_gpus((1,), layout(text), gpus(), nodes(tmp_path))
    assert [gpu.index for gpu in found] == [6]


# ---------------------------------------------------------------- the drain reason

GPU3 = Gpu(3, "GPU-3", 3, "Fake", 1000)


@pytest.mark.parametrize(
    ("item", "words"),
    [
        (
            Blocker(11, "bob", (3,), "straddles", foreign=(5,)),
            "PID 11 (bob) on GPU 3: straddles GPU 5, not this job's",
        ),
        (
            Blocker(
                12,
                "eve",
                (3,),
                "other-unit",
                other="gpu07_slurmstepd.scope",
                cgroup="/system.slice/gpu07_slurmstepd.scope/job_43/step_0/user/task_0",
            ),
            "PID 12 (eve) on GPU 3: in another job (43)",
        ),
        (
            Blocker(
                13,
                "root",
                (3,),
                "other-unit",
                other="vllm.service",
                cgroup="/system.slice/vllm.service",
            ),
            "PID 13 (root) on GPU 3: in another unit (vllm.service)",
        ),
        (
            Blocker(
                14,
                "root",
                (3, 4),
                "other-container",
                other="docker-ab.scope",
                cgroup="/system.slice/docker-ab.scope",
            ),
            "PID 14 (root) on GPU 3,4: in another unit (docker-ab.scope)",
        ),
        (
            Blocker(15, "amy", (3,), UNKILLABLE),
            "PID 15 (amy) on GPU 3: unkillable (survived SIGKILL)",
        ),
        (
            Blocker(16, None, (), "protected"),
            "PID 16 (?): protected (protected_executables/protected_units)",
        ),
    ],
)
def test_drain_detail_names_pid_account_gpu_and_rule(item: Blocker, words: str) -> None:
    summary = run_summary(exit_code=ExitCode.HELD_BY_OTHERS, owned=[GPU3], held=[item])
    assert failure_detail(summary) == words


@pytest.mark.message
def test_drain_detail_names_memory_not_freed_and_only_those_gpus() -> None:
    summary = run_summary(
        exit_code=ExitCode.MEMORY_TIMEOUT,
        owned=[GPU3, Gpu(4, "GPU-4", 4, "Fake", 1000)],
        busy=[BusyGpu(GPU3, 700, (88, 89))],
    )
    assert failure_detail(summary) == (
        "GPU 3 (GPU-3) still 700 MiB used: memory not freed, NVML lists PID 88, 89"
    )


@pytest.mark.message
def test_drain_reason_bounded_escaped_and_keeps_its_exit_code() -> None:
    hostile = Blocker(
        12, "eve", (3,), "other-unit", other='x"\n' + "y" * 400, cgroup="/system.slice/x.service"
    )
    many = [Blocker(100 + i, "bob", (3,), "straddles", foreign=(5,)) for i in range(6)]
    for held in ([hostile], many, [hostile, *many]):
        summary = run_summary(exit_code=ExitCode.HELD_BY_OTHERS, owned=[GPU3], held=held)
        reason = drain_reason("epilog", 4294967295, failure_detail(summary), 22)
        assert len(reason) <= 250
        assert reason.startswith("gpugate epilog job 4294967295: PID 1")
        assert reason.endswith(" (exit 22)")
        assert '"' not in reason and "\n" not in reason and reason.isprintable()
    summary = run_summary(exit_code=ExitCode.HELD_BY_OTHERS, owned=[GPU3], held=many)
    assert failure_detail(summary).endswith("; 3 more PID(s)")
    assert failure_detail(summary).count("PID 10") == 3


# ---------------------------------------------------------------- gpugate slurm check


NODE_GPUS = "NodeName=gpu07 Gres=gpu:8\n"


class Driver:
    def __init__(self, found: list[Gpu], faults: int = 0) -> None:
        self.found, self.fault_count = found, faults

    def gpus(self) -> list[Gpu]:
        return self.found

    def faults(self) -> list[object]:
        return [object()] * self.fault_count

    def close(self) -> None:
        pass


def check(
    tmp_path: Path,
    slurm_conf: str,
    gres_text: str | None,
    job_container: str | None = None,
    faults: int = 0,
    found: list[Gpu] | None = None,
) -> tuple[int, str]:
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "slurm.conf").write_text(slurm_conf)
    if gres_text is not None:
        (etc / "gres.conf").write_text(gres_text)
    if job_container is not None:
        (etc / "job_container.conf").write_text(job_container)
    out = io.StringIO()
    code = slurm_check(
        {"SLURM_CONF": str(etc / "slurm.conf")},
        "gpu07",
        lambda: Driver(gpus() if found is None else found, faults),  # type: ignore[arg-type,return-value]
        nodes(tmp_path),
        out,
    )
    return code, out.getvalue()


@pytest.mark.parametrize(
    ("slurm_conf", "job_container", "private"),
    [
        ("JobContainerType=job_container/tmpfs\n", None, True),
        ("jobcontainertype=job_container/tmpfs # private tmp\n", "BasePath=/var/jc\n", True),
        ("JobContainerType=job_container/tmpfs\n", "BasePath=/var/jc\nDirs=/tmp,/dev/shm/\n", True),
        ("JobContainerType=job_container/tmpfs\n", "BasePath=/var/jc\nDirs=/tmp\n", False),
        ("JobContainerType=job_container/none\n", None, False),
        ("# JobContainerType=job_container/tmpfs\n", None, False),
        ("ClusterName=x\n", None, False),
    ],
)
def test_check_says_whether_jobs_get_their_own_dev_shm(
    tmp_path: Path, slurm_conf: str, job_container: str | None, private: bool
) -> None:
    code, said = check(tmp_path, slurm_conf, "Name=gpu File=/dev/nvidia[0-7]\n", job_container)
    assert code == ExitCode.OK
    first = said.splitlines()[0]
    assert first.startswith("/dev/shm: private to each job" if private else "/dev/shm: shared")


def test_check_lists_each_number_as_a_gpu(tmp_path: Path) -> None:
    code, said = check(tmp_path, "", "Name=gpu File=/dev/nvidia[1,0]\n")
    assert code == ExitCode.OK
    assert said.splitlines()[2:] == [
        "  0 = /dev/nvidia1 = GPU 6 (GPU-6)",
        "  1 = /dev/nvidia0 = GPU 7 (GPU-7)",
    ]
    code, said = check(tmp_path, NODE_GPUS, "AutoDetect=nvml\n")
    assert code == ExitCode.OK and said.splitlines()[2] == "  0 = GPU 0 (GPU-0)"


@pytest.mark.message
@pytest.mark.parametrize(
    ("gres_text", "faults", "words"),
    [
        (None, 0, "gres.conf: no such file"),
        ("AutoDetect=rsmi\n", 0, "AutoDetect='rsmi'"),
        ("Name=gpu File=/dev/plain\n", 0, "is no GPU device node"),
        ("AutoDetect=nvml\n", 1, "NVML cannot read 1 GPU(s)"),
    ],
)
def test_check_exits_78_where_a_number_is_not_resolved(
    tmp_path: Path, gres_text: str | None, faults: int, words: str
) -> None:
    code, said = check(tmp_path, NODE_GPUS, gres_text, faults=faults)
    assert code == ExitCode.CONFIG
    assert len(said.splitlines()) > 1  # the node's numbers: not resolved, and why
    assert words in said


# ---------------------------------------------------------------- MIG slices


def mig_gpus() -> list[Gpu]:
    """GPU 0 in MIG mode with slices 0/1/0, 0/2/0, 0/5/0; GPU 1 whole (the stand-in's)."""
    return list(FakeGpuMemory(count=2, mig={0: [(1, 0, 1), (2, 0, 1), (5, 0, 1)]}).gpus())


@pytest.mark.message
@pytest.mark.parametrize(
    "gres_text",
    [
        "AutoDetect=nvml\n",
        "NodeName=gpu07 AutoDetect=nvml\n",
        "AutoDetect=nvml\nName=gpu File=/dev/nvidia[0-1]\n",
        "AutoDetect=nvml\nName=gpu File=/dev/nvidia0\n",
        "Name=gpu File=/dev/nvidia[0-1]\n",
        "AutoDetect=off\nName=gpu Type=a100 File=/dev/nvidia0 Cores=0-3\n",
        "NodeName=gpu07 Name=gpu File=/dev/nvidia0\n",
    ],
)
def test_check_never_prints_a_gpu_in_mig_mode_as_one_number(tmp_path: Path, gres_text: str) -> None:
    """slurmd numbers a MIG-mode GPU's slices (AutoDetect=nvml), or gives the whole GPU to
    one job (File=): gpugate prints no guess, exits 78 and says why."""
    code, said = check(tmp_path, NODE_GPUS, gres_text, found=mig_gpus())
    assert code == ExitCode.CONFIG
    assert "MIG mode" in said.splitlines()[1]
    assert " = MIG " not in said and " = GPU 0 " not in said


@pytest.mark.message
def test_check_lists_gpus_beside_a_mig_gpu_slurmd_does_not_number(tmp_path: Path) -> None:
    """File= naming only whole GPUs not in MIG mode: numbered as ever (no slice among them)."""
    code, said = check(tmp_path, "", "Name=gpu File=/dev/nvidia1\n", found=mig_gpus())
    assert code == ExitCode.OK
    assert (
        said.splitlines()[2]
        == "  0 = /dev/nvidia1 = GPU 1 (GPU-fa4e5a11-0000-0000-0000-000000000001)"
    )


SLICE_GPUS = mig_gpus()


@pytest.mark.parametrize(
    ("numbers", "visible", "keys"),
    [
        ((0,), (mig_uuid(0, 1, 0),), (mig_key(0, 0),)),
        ((0, 1, 2), (mig_uuid(0, 5, 0), mig_uuid(0, 1, 0), mig_uuid(0, 2, 0)), (1026, 1024, 1025)),
        ((4,), ("MIG-GPU-fa4e5a11-0000-0000-0000-000000000000/2/0",), (mig_key(0, 1),)),
    ],
)
def test_slices_named_by_the_unique_ids_slurmd_writes(
    numbers: tuple[int, ...], visible: tuple[str, ...], keys: tuple[int, ...]
) -> None:
    found = slices_by_unique_id(numbers, visible, SLICE_GPUS, "SLURM_JOB_GPUS")
    assert found is not None and tuple(gpu.index for gpu in found) == keys


def test_numbers_alone_name_no_slice() -> None:
    assert slices_by_unique_id((0, 1), ("0", "1"), SLICE_GPUS, "SLURM_JOB_GPUS") is None
    assert slices_by_unique_id((0,), (), SLICE_GPUS, "SLURM_JOB_GPUS") is None


@pytest.mark.parametrize(
    ("numbers", "visible"),
    [
        ((0, 1), (mig_uuid(0, 1, 0),)),  # not one ID per number
        ((0, 1), (mig_uuid(0, 1, 0), "1")),  # a whole GPU beside slices
        ((0,), (mig_uuid(0, 3, 0),)),  # no such slice
        ((0,), (mig_uuid(0, 1, 0)[:-2],)),  # a prefix is not slurmd's (it writes whole IDs)
        ((0,), ("MIG-GPU-fa4e5a11-0000-0000-0000-000000000001/1/0",)),  # GPU 1 has no slices
        ((0,), ("MIG-\x1b[2J",)),
    ],
)
def test_unique_ids_that_do_not_name_a_slice_for_certain(
    numbers: tuple[int, ...], visible: tuple[str, ...]
) -> None:
    with pytest.raises(GresUnresolved) as caught:
        slices_by_unique_id(numbers, visible, SLICE_GPUS, "SLURM_JOB_GPUS")
    assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value)


# ---------------------------------------------------------------- gres/shard


@pytest.mark.parametrize(
    ("text", "files", "every"),
    [
        ("Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=64\n", (), True),
        ("NodeName=gpu07 Name=shard Count=8\nName=gpu File=/dev/nvidia0\n", (), True),
        (
            "Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=16 File=/dev/nvidia[0-1]\n",
            ("/dev/nvidia0", "/dev/nvidia1"),
            False,
        ),
        # Count / files each (gres_c_s.c _build_shared_list): 0 each where fewer
        ("Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=1 File=/dev/nvidia[0-1]\n", None, False),
        ("Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=0\n", None, False),
        (
            "Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=2k File=/dev/nvidia3\n",
            ("/dev/nvidia3",),
            False,
        ),
        ("Name=gpu File=/dev/nvidia[0-3]\nNodeName=gpu08 Name=shard Count=8\n", None, False),
        ("Name=gpu File=/dev/nvidia[0-3]\nName=mps Count=100\n", None, False),
        ("AutoDetect=nvml\nName=shard Count=64\n", (), True),
    ],
)
def test_gres_conf_says_which_gpus_carry_shards(
    text: str, files: tuple[str, ...] | None, every: bool
) -> None:
    shards = layout(text).shards
    if files is None:
        assert shards is None
    else:
        assert shards is not None and (shards.files, shards.every_gpu) == (files, every)


@pytest.mark.parametrize(
    "text",
    [
        "Name=gpu File=/dev/nvidia0\nName=shard Count=lots\n",
        "Name=gpu File=/dev/nvidia0\nName=shard Count=8 File=/dev/nvidia[1-0]\n",
    ],
)
def test_shard_lines_not_read_for_certain(text: str) -> None:
    assert "\n" not in str(unresolved(text))


@pytest.mark.message
@pytest.mark.parametrize(
    ("slurm_conf", "gres_text", "shared"),
    [
        ("GresTypes=gpu,shard\n", "Name=gpu File=/dev/nvidia[0-1]\nName=shard Count=16\n", [0, 1]),
        (
            "GresTypes=gpu,shard\n",
            "Name=gpu File=/dev/nvidia[0-1]\nName=shard Count=8 File=/dev/nvidia1\n",
            [1],
        ),
        ("GresTypes=gpu\n", "Name=gpu File=/dev/nvidia[0-1]\nName=shard Count=16\n", []),
        ("GresTypes=gpu,shard\n", "Name=gpu File=/dev/nvidia[0-1]\n", []),
    ],
)
def test_check_says_which_gpus_are_shared_and_why(
    tmp_path: Path, slurm_conf: str, gres_text: str, shared: list[int]
) -> None:
    code, said = check(tmp_path, slurm_conf, gres_text)
    assert code == ExitCode.OK
    rows = said.splitlines()[2:]
    assert [n for n, row in enumerate(rows) if "shared: carries gres/shard" in row] == shared
    for n in shared:
        assert rows[n].endswith("gres.conf line 2)")


# ---------------------------------------------------------------- slurm.conf's order of types

MIXED = "Name=gpu Type=h100 File=/dev/nvidia[4-5]\nName=gpu Type=a100 File=/dev/nvidia[0-1]\n"


def merged(tmp_path: Path, slurm_conf: str, gres_text: str = MIXED) -> list[str]:
    path = tmp_path / "slurm.conf"
    path.write_text(slurm_conf)
    return list(in_slurm_conf_order(layout(gres_text), path, "gpu07").files)


@pytest.mark.parametrize(
    ("slurm_conf", "files"),
    [
        ("NodeName=gpu07 Gres=gpu:a100:2,gpu:h100:2\n", [0, 1, 4, 5]),
        ("NodeName=gpu07 Gres=gpu:h100:2,gpu:a100:2 CPUs=8\n", [4, 5, 0, 1]),
        ("NodeName=gpu[01-08] Gres=gpu:A100:1,gpu:h100:2(S:0-1)\n", [0, 4, 5]),
        ("NodeName=DEFAULT Gres=gpu:a100:2,gpu:h100:1\nNodeName=gpu07 CPUs=8\n", [0, 1, 4]),
        ("NodeName=gpu07 Gres=gpu:4\n", [4, 5, 0, 1]),  # untyped: gres.conf's order
        ("NodeName=gpu07 Gres=gpu:a100:2,shard:64\n", [0, 1]),  # h100 not on this node
        ('NodeName=gpu07 Gres="gpu:a100:2,gpu:h100:2"\n', [0, 1, 4, 5]),
        ("NodeSet=ns Nodes=gpu07\nnodename=gpu07 \\\n  Gres=gpu:h100:1,gpu:a100:1\n", [4, 0]),
    ],
)
def test_several_types_numbered_in_slurm_confs_order(
    tmp_path: Path, slurm_conf: str, files: list[int]
) -> None:
    assert merged(tmp_path, "GresTypes=gpu\n" + slurm_conf) == [f"/dev/nvidia{n}" for n in files]


def test_one_type_needs_no_slurm_conf(tmp_path: Path) -> None:
    one = "Name=gpu Type=a100 File=/dev/nvidia[4-5]\nName=gpu Type=A100 File=/dev/nvidia0\n"
    missing = tmp_path / "none" / "slurm.conf"
    found = in_slurm_conf_order(layout(one), missing, "gpu07")
    assert list(found.files) == ["/dev/nvidia4", "/dev/nvidia5", "/dev/nvidia0"]


@pytest.mark.message
@pytest.mark.parametrize(
    "slurm_conf",
    [
        "Include /etc/slurm/nodes.conf\n",
        "include nodes.conf\nNodeName=gpu07 Gres=gpu:a100:2,gpu:h100:2\n",
        "NodeName=gpu08 Gres=gpu:a100:2,gpu:h100:2\n",
        "NodeName=gpu07 Gres=gpu:a100:2\nNodeName=gpu[06-07] Gres=gpu:h100:2\n",
        "NodeName=gpu07 Gres=gpu:2,gpu:a100:2\n",
        "NodeName=gpu[07 Gres=gpu:a100:2\n",
    ],
)
def test_several_types_without_slurm_confs_order_are_not_resolved(
    tmp_path: Path, slurm_conf: str
) -> None:
    with pytest.raises(GresUnresolved) as caught:
        merged(tmp_path, slurm_conf)
    assert "\n" not in str(caught.value) and "several GPU Types" in str(caught.value)
    with pytest.raises(GresUnresolved):
        in_slurm_conf_order(layout(MIXED), tmp_path / "missing.conf", "gpu07")


def test_a_shard_count_spreads_as_slurmd_spreads_it() -> None:
    """_distribute_count: each GPU in turn gets what is left over the GPUs left."""
    assert spread(64, 8) == [8] * 8
    assert spread(3, 4) == [0, 1, 1, 1]
    assert spread(10, 4) == [2, 2, 3, 3]
    assert spread(0, 2) == [0, 0]
    assert sum(spread(1000, 7)) == 1000


@pytest.mark.message
@pytest.mark.parametrize(
    ("slurm_conf", "gres_text", "shared"),
    [
        # Count below the GPUs: the first GPUs get none
        (
            "GresTypes=gpu,shard\nNodeName=gpu07 Gres=gpu:4,shard:3\n",
            "Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=3\n",
            [1, 2, 3],
        ),
        # slurm.conf's count cuts gres.conf's
        (
            "GresTypes=gpu,shard\nNodeName=gpu07 Gres=gpu:4,shard:2\n",
            "Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=64\n",
            [2, 3],
        ),
        # the node's Gres= without shard: none, whatever gres.conf says
        (
            "GresTypes=gpu,shard\nNodeName=gpu07 Gres=gpu:4\n",
            "Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=64\n",
            [],
        ),
        (
            "GresTypes=gpu,shard\nNodeName=DEFAULT Gres=gpu:4,shard:8\nNodeName=gpu[06-07]\n",
            "Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=8\n",
            [0, 1, 2, 3],
        ),
        # slurm.conf not read for certain (an Include): gres.conf alone says (more shared)
        (
            "GresTypes=gpu,shard\nInclude nodes.conf\n",
            "Name=gpu File=/dev/nvidia[0-3]\nName=shard Count=64\n",
            [0, 1, 2, 3],
        ),
    ],
)
def test_slurm_conf_gives_or_takes_a_nodes_shards(
    tmp_path: Path, slurm_conf: str, gres_text: str, shared: list[int]
) -> None:
    code, said = check(tmp_path, slurm_conf, gres_text)
    assert code == ExitCode.OK
    rows = said.splitlines()[2:]
    assert [n for n, row in enumerate(rows) if "shared: carries gres/shard" in row] == shared


def test_check_prints_the_slice_of_each_multiple_files_line(tmp_path: Path) -> None:
    """The manual MIG form: each line one number, the slice its capability devices name."""
    proc = tmp_path / "proc"
    dev = tmp_path / "dev"
    minors = {"gi1": 21, "gi1/ci0": 22, "gi2": 30, "gi2/ci0": 31, "gi5": 57, "gi5/ci0": 58}
    for relative, minor in minors.items():
        access = proc / "driver/nvidia/capabilities/gpu0/mig" / relative / "access"
        access.parent.mkdir(parents=True)
        access.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\n")
    (dev / "nvidia-caps").mkdir(parents=True)
    table = {f"nvidia{i}": (195, i) for i in range(2)}
    table.update({f"nvidia-cap{m}": (508, m) for m in minors.values()})
    for name in table:
        (dev / ("nvidia-caps" if "cap" in name else "") / name).write_bytes(b"")

    def stat_(path: str) -> os.stat_result:
        name = Path(path).name
        if name in table:
            fields = (stat.S_IFCHR | 0o444, 0, 0, 1, 0, 0, 0, 0, 0, 0)
            return os.stat_result(fields, {"st_rdev": os.makedev(*table[name])})
        return os.stat(path)

    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text("GresTypes=gpu\n")
    caps = "/dev/nvidia-caps/nvidia-cap"
    (etc / "gres.conf").write_text(
        f"Name=gpu MultipleFiles=/dev/nvidia0,{caps}57,{caps}58\n"
        f"Name=gpu MultipleFiles=/dev/nvidia0,{caps}[21-22]\n"
        "Name=gpu File=/dev/nvidia1\n"
    )
    out = io.StringIO()
    code = slurm_check(
        {"SLURM_CONF": str(etc / "slurm.conf")},
        "gpu07",
        lambda: Driver(mig_gpus()),  # type: ignore[arg-type,return-value]
        DeviceNodes(dev, stat_, proc),
        out,
    )
    assert code == ExitCode.OK, out.getvalue()
    rows = out.getvalue().splitlines()[2:]
    assert [row.split(" = ")[-1].split(" (")[0] for row in rows] == [
        "MIG 0/5/0",
        "MIG 0/1/0",
        "GPU 1",
    ]
    assert rows[0].startswith(f"  0 = /dev/nvidia0,{caps}57,{caps}58 = ")


@pytest.mark.parametrize(
    ("slurm_conf", "indices"),
    [
        ("NodeName=gpu07 Gres=gpu:8\n", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("NodeName=gpu07 Gres=gpu:16\n", [0, 1, 2, 3, 4, 5, 6, 7]),
        # fewer than detected: slurmd takes the first by file name (/dev/nvidia0..), in
        # NVML's order (MINORS: NVML's GPU i is /dev/nvidia(7-i))
        ("NodeName=gpu07 Gres=gpu:2\n", [6, 7]),
        ("NodeName=gpu07 Gres=gpu:fake:8\n", [0, 1, 2, 3, 4, 5, 6, 7]),  # "Fake GPU" names
    ],
)
def test_autodetect_takes_the_gpus_slurm_conf_gives(
    tmp_path: Path, slurm_conf: str, indices: list[int]
) -> None:
    code, said = check(tmp_path, slurm_conf, "AutoDetect=nvml\n")
    assert code == ExitCode.OK, said
    rows = said.splitlines()[2:]
    assert [int(row.split("GPU ")[1].split(" ")[0]) for row in rows] == indices


@pytest.mark.message
@pytest.mark.parametrize(
    ("slurm_conf", "words"),
    [
        ("", "no NodeName= line for "),
        ("Include nodes.conf\n", "not followed"),
        ("NodeName=gpu07 Gres=gpu:a100:8\n", "not of exactly one Gres= type"),
        ("NodeName=gpu07 Gres=gpu:fake:4\n", "more 'fake' GPUs than Gres="),
        ("NodeName=gpu07 Gres=gpu:fa:8,gpu:ke:8\n", "not of exactly one Gres= type"),
    ],
)
def test_autodetect_without_slurm_confs_count_for_certain_is_not_resolved(
    tmp_path: Path, slurm_conf: str, words: str
) -> None:
    code, said = check(tmp_path, slurm_conf, "AutoDetect=nvml\n")
    assert code == ExitCode.CONFIG
    assert words in said, said
