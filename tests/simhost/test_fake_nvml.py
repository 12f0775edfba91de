"""Tests of the stand-in libnvidia-ml.so.1, driven through pynvml exactly as gpugate uses it.

The library is loaded in a subprocess (LD_LIBRARY_PATH, FAKE_NVML_CONFIG), since a process
can load only one libnvidia-ml.so.1 and pynvml caches it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
MIB = 1024 * 1024
TOTAL = 97887 * MIB
RESERVED = 512 * MIB


def _load_build() -> Any:
    spec = importlib.util.spec_from_file_location(
        "fake_nvml_build", HERE.parent / "fake_nvml" / "build.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()


@pytest.fixture(scope="module")
def lib_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is missing: cannot build the stand-in libnvidia-ml.so.1")
    out = tmp_path_factory.mktemp("fake-nvml-lib")
    lib = build.build_fake_nvml(out)
    assert lib == out / "libnvidia-ml.so.1"
    return out


class Sim:
    """A settings file, device files and a state directory under tmp_path."""

    def __init__(self, root: Path, lib_dir: Path) -> None:
        self.lib_dir = lib_dir
        self.dev = root / "dev"
        self.state = root / "state"
        self.conf = root / "fake-nvml.conf"
        self.dev.mkdir()
        for name in [f"nvidia{n}" for n in range(8)] + ["nvidiactl", "nvidia-uvm"]:
            (self.dev / name).touch()
        (self.state / "claims").mkdir(parents=True)
        self.configure()
        self.children: list[subprocess.Popen[bytes]] = []

    def configure(self, **settings: object) -> None:
        lines = [
            "# written by test_fake_nvml",
            f"dev_root = {self.dev}",
            f"state_dir = {self.state}",
        ]
        lines += [f"{key} = {value}  # a comment" for key, value in settings.items()]
        self.conf.write_text("\n".join(lines) + "\n")

    def env(self) -> dict[str, str]:
        return dict(os.environ, LD_LIBRARY_PATH=str(self.lib_dir), FAKE_NVML_CONFIG=str(self.conf))

    def run(self, code: str, timeout: float = 30, wrapper: tuple[str, ...] = ()) -> Any:
        """Runs `code` (pynvml imported as n) in a subprocess; returns what it prints, as JSON."""
        prelude = "import json, time, ctypes, pynvml as n\n"
        proc = subprocess.run(
            [*wrapper, sys.executable, "-c", prelude + textwrap.dedent(code)],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def snapshot(self, wrapper: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """Everything pynvml says about every GPU."""
        return self.run(SNAPSHOT, wrapper=wrapper)  # type: ignore[no-any-return]

    def hold(self, *names: str, then: str = "pass") -> subprocess.Popen[bytes]:
        """Starts a process that holds DEV_ROOT/NAME open for each name (and nothing else),
        then runs `then`."""
        opens = "; ".join(f"fds.append(os.open({str(self.dev / n)!r}, os.O_RDONLY))" for n in names)
        code = f"import os, time; fds = []; {opens}; {then}; print('held', flush=True); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        self.children.append(child)
        assert child.stdout is not None
        assert child.stdout.readline() == b"held\n"
        return child

    def claim(self, pid: int, mib: int, devices: str, starttime: int | None = None) -> Path:
        if starttime is None:
            starttime = starttime_of(pid)
        path = self.state / "claims" / str(pid)
        path.write_text(f"{mib} {starttime} {devices}\n")
        return path

    def freed_lines(self) -> list[list[str]]:
        log = self.state / "freed.log"
        return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def starttime_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


SNAPSHOT = """
def mem(h):
    try:
        v1 = n.nvmlDeviceGetMemoryInfo(h)
        v2 = n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2)
    except n.NVMLError as e:
        return type(e).__name__, None
    return [v1.total, v1.free, v1.used], [v2.version, v2.total, v2.reserved, v2.free, v2.used]
def procs(fn, h):
    return sorted([p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in fn(h))
n.nvmlInit()
out = []
for i in range(n.nvmlDeviceGetCount()):
    try:
        h = n.nvmlDeviceGetHandleByIndex(i)
    except n.NVMLError as e:
        out.append({"error": type(e).__name__})
        continue
    uuid = n.nvmlDeviceGetUUID(h)
    by_uuid = n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(uuid))
    v1, v2 = mem(h)
    out.append({
        "index": n.nvmlDeviceGetIndex(h), "minor": n.nvmlDeviceGetMinorNumber(h), "uuid": uuid,
        "by_uuid": by_uuid, "name": n.nvmlDeviceGetName(h), "v1": v1, "v2": v2,
        "compute": procs(n.nvmlDeviceGetComputeRunningProcesses, h),
        "compute_v2": procs(n.nvmlDeviceGetComputeRunningProcesses_v2, h),
        "graphics": procs(n.nvmlDeviceGetGraphicsRunningProcesses, h),
        "mps": procs(n.nvmlDeviceGetMPSComputeRunningProcesses, h),
    })
n.nvmlShutdown()
print(json.dumps(out))
"""

NA = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId without MIG


def idle_memory(used: int = 0) -> tuple[list[int], list[int]]:
    v1 = [TOTAL, TOTAL - RESERVED - used, used + RESERVED]
    v2 = [0x02000028, TOTAL, RESERVED, TOTAL - RESERVED - used, used]
    return v1, v2


@pytest.fixture
def sim(tmp_path: Path, lib_dir: Path) -> Iterator[Sim]:
    s = Sim(tmp_path, lib_dir)
    yield s
    for child in s.children:  # only the processes this test started
        if child.poll() is None:
            child.kill()
        child.wait()


def test_builds_without_warnings(lib_dir: Path, tmp_path: Path) -> None:
    src = HERE.parent / "fake_nvml" / "fake_nvml.c"
    out = tmp_path / "lib.so"
    proc = subprocess.run(
        ["gcc", *build.CFLAGS, "-Werror", "-o", str(out), str(src)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    # build_fake_nvml rebuilds only when the source is newer
    lib = lib_dir / "libnvidia-ml.so.1"
    before = lib.stat().st_mtime_ns
    assert build.build_fake_nvml(lib_dir) == lib
    assert lib.stat().st_mtime_ns == before


def test_build_script_cli(tmp_path: Path, lib_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE.parent / "fake_nvml" / "build.py"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == tmp_path / "out" / "libnvidia-ml.so.1"
    assert (tmp_path / "out" / "libnvidia-ml.so.1").is_file()


@pytest.mark.message
def test_build_without_gcc_raises_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.BuildError, match="gcc not found"):
        build.build_fake_nvml(tmp_path)


def test_idle_host_with_defaults(sim: Sim) -> None:
    gpus = sim.snapshot()
    assert len(gpus) == 8
    v1, v2 = idle_memory()
    for i, gpu in enumerate(gpus):
        assert gpu["index"] == i == gpu["by_uuid"]
        assert gpu["minor"] == i
        assert gpu["uuid"] == f"GPU-fa4e5a11-0000-0000-0000-{i:012x}"
        assert gpu["name"] == "NVIDIA H200 (simulated)"
        assert (gpu["v1"], gpu["v2"]) == (v1, v2)
        assert gpu["compute"] == gpu["graphics"] == gpu["mps"] == []
    versions = sim.run("""
        n.nvmlInit()
        print(json.dumps([n.nvmlSystemGetDriverVersion(), n.nvmlSystemGetNVMLVersion()]))
    """)
    assert versions[0] == "570.0.sim"
    assert versions[1].endswith("570.0.sim")


def test_missing_settings_file_means_defaults(sim: Sim) -> None:
    sim.conf.unlink()
    out = sim.run("""
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(7)
        print(json.dumps([n.nvmlDeviceGetCount(), n.nvmlDeviceGetUUID(h),
                          n.nvmlDeviceGetMinorNumber(h)]))
    """)
    assert out == [8, "GPU-fa4e5a11-0000-0000-0000-000000000007", 7]


def test_claimed_holder_is_listed_and_counted(sim: Sim) -> None:
    holder = sim.hold("nvidiactl", "nvidia-uvm", "nvidia2")
    sim.claim(holder.pid, 1000, "2")
    # nvidia-persistenced-like: holds every device file, has no claim
    daemon = sim.hold(*[f"nvidia{n}" for n in range(8)], "nvidiactl")
    # a claim on a GPU whose device file the process does not hold
    stranger = sim.hold("nvidia4")
    sim.claim(stranger.pid, 300, "5", starttime=starttime_of(stranger.pid))

    gpus = sim.snapshot()
    v1, v2 = idle_memory(1000 * MIB)
    assert gpus[2]["compute"] == [[holder.pid, 1000 * MIB, NA, NA]]
    assert gpus[2]["compute_v2"] == gpus[2]["compute"]
    assert (gpus[2]["v1"], gpus[2]["v2"]) == (v1, v2)
    assert gpus[2]["graphics"] == gpus[2]["mps"] == []
    for i in (0, 1, 3, 4, 6, 7):
        assert gpus[i]["compute"] == [], i
        assert (gpus[i]["v1"], gpus[i]["v2"]) == idle_memory(), i
    assert daemon.pid not in {p[0] for g in gpus for p in g["compute"]}
    # the stranger is not live: not listed; its memory lingers only for release_delay_ms (0)
    assert gpus[5]["compute"] == []
    assert gpus[5]["v2"] == idle_memory()[1]
    assert sim.freed_lines()[-1][1:] == [str(stranger.pid), "5"]


def test_multi_gpu_claim_and_many_holders(sim: Sim) -> None:
    a = sim.hold("nvidia0", "nvidia1")
    sim.claim(a.pid, 700, "0,1")
    b = sim.hold("nvidia1")
    sim.claim(b.pid, 50, "1")
    # claims two GPUs but holds only one device file: listed there, its memory used on both
    c = sim.hold("nvidia6")
    sim.claim(c.pid, 20, "6,7")
    gpus = sim.snapshot()
    assert gpus[0]["compute"] == [[a.pid, 700 * MIB, NA, NA]]
    assert gpus[1]["compute"] == sorted([[a.pid, 700 * MIB, NA, NA], [b.pid, 50 * MIB, NA, NA]])
    assert gpus[1]["v2"][4] == 750 * MIB
    assert gpus[1]["v1"][2] == 750 * MIB + RESERVED
    assert gpus[6]["compute"] == [[c.pid, 20 * MIB, NA, NA]]
    assert gpus[7]["compute"] == []
    assert gpus[6]["v2"][4] == gpus[7]["v2"][4] == 20 * MIB


def test_memory_of_killed_holder_lingers_for_release_delay(sim: Sim) -> None:
    delay_ms = 1500
    sim.configure(release_delay_ms=delay_ms)
    holder = sim.hold("nvidia3")
    claim = sim.claim(holder.pid, 4096, "3")
    assert sim.snapshot()[3]["compute"] == [[holder.pid, 4096 * MIB, NA, NA]]

    holder.send_signal(signal.SIGKILL)
    killed_ns = time.time_ns()
    os.waitid(os.P_PID, holder.pid, os.WEXITED | os.WNOWAIT)  # dead, and left unreaped
    # not reaped yet: a zombie holds no fds, so it is no longer listed, but its memory is used
    assert Path(f"/proc/{holder.pid}").exists()
    gpu = sim.snapshot()[3]
    assert gpu["compute"] == []
    assert gpu["v2"][4] == 4096 * MIB
    gone = claim.with_name(f"{holder.pid}.gone")
    assert gone.exists()
    noticed_ns = int(gone.read_text())
    assert killed_ns <= noticed_ns <= time.time_ns()
    holder.wait()

    # poll like gpugate does until the driver reports the memory freed
    out = sim.run("""
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(3)
        seen = []
        while n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2).used:
            seen.append(time.time_ns())
            time.sleep(0.02)
        print(json.dumps([seen[0] if seen else None, time.time_ns()]))
    """)
    freed_seen_ns = out[1]
    assert out[0] is not None  # it was still used when polling began
    assert freed_seen_ns - noticed_ns >= delay_ms * 1_000_000
    assert freed_seen_ns - noticed_ns < (delay_ms + 2000) * 1_000_000
    assert not claim.exists() and not gone.exists()
    [line] = sim.freed_lines()
    assert line[1:] == [str(holder.pid), "3"]
    assert noticed_ns + delay_ms * 1_000_000 <= int(line[0]) <= freed_seen_ns
    gpu = sim.snapshot()[3]
    assert (gpu["v1"], gpu["v2"]) == idle_memory()
    assert len(sim.freed_lines()) == 1  # reported once


def test_closing_the_device_file_releases(sim: Sim) -> None:
    sim.configure(release_delay_ms=60_000)
    code = f"""
import os, sys
fd = os.open({str(sim.dev / "nvidia1")!r}, os.O_RDONLY)
print("held", flush=True)
sys.stdin.readline()
os.close(fd)
print("closed", flush=True)
sys.stdin.readline()
"""
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    sim.children.append(child)  # type: ignore[arg-type]
    assert child.stdout and child.stdin
    assert child.stdout.readline() == "held\n"
    sim.claim(child.pid, 10, "1")
    assert sim.snapshot()[1]["compute"] == [[child.pid, 10 * MIB, NA, NA]]
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.stdout.readline() == "closed\n"
    gpu = sim.snapshot()[1]
    assert gpu["compute"] == []  # alive, but holds no device file: not live
    assert gpu["v2"][4] == 10 * MIB  # and the driver has not freed it yet (60 s delay)
    child.stdin.write("\n")
    child.stdin.flush()
    child.wait()


def test_recycled_pid_is_not_listed(sim: Sim) -> None:
    sim.configure(release_delay_ms=60_000)
    holder = sim.hold("nvidia6")
    claim = sim.claim(holder.pid, 2000, "6", starttime=starttime_of(holder.pid) - 1)
    gpu = sim.snapshot()[6]
    assert gpu["compute"] == []
    assert gpu["v2"][4] == 2000 * MIB  # lingers: it is the dead process's memory
    # with no delay it is released at the next query
    sim.configure(release_delay_ms=0)
    gpu = sim.snapshot()[6]
    assert gpu["v2"][4] == 0
    assert not claim.exists()
    assert sim.freed_lines()[0][1:] == [str(holder.pid), "6"]


def test_leaks_use_memory_without_processes(sim: Sim) -> None:
    (sim.state / "leak").mkdir()
    (sim.state / "leak" / "5").write_text("2048\n")
    gpus = sim.snapshot()
    assert (gpus[5]["v1"], gpus[5]["v2"]) == idle_memory(2048 * MIB)
    assert gpus[5]["compute"] == []
    assert gpus[4]["v2"] == idle_memory()[1]


def test_settings_are_reread_on_every_call(sim: Sim) -> None:
    out = sim.run(f"""
        import pathlib
        n.nvmlInit()
        conf = pathlib.Path({str(sim.conf)!r})
        before = n.nvmlDeviceGetCount()
        h = n.nvmlDeviceGetHandleByIndex(1)
        conf.write_text(conf.read_text() + "gpu_count = 4\\nlost_gpus = 1\\nreserved_mib = 0\\n")
        after = n.nvmlDeviceGetCount()
        try:
            n.nvmlDeviceGetUUID(h)
            lost = None
        except n.NVMLError as e:
            lost = type(e).__name__
        used = n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(0)).used
        print(json.dumps([before, after, lost, used]))
    """)
    assert out == [8, 4, "NVMLError_GpuIsLost", 0]


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (9, "NVMLError_DriverNotLoaded"),
        (18, "NVMLError_LibRmVersionMismatch"),
        (12, "NVMLError_LibraryNotFound"),
    ],
)
def test_init_error(sim: Sim, code: int, error: str) -> None:
    sim.configure(init_error=code)
    out = sim.run("""
        errors = []
        for init in (n.nvmlInit, lambda: n.nvmlInitWithFlags(0)):
            try:
                init()
                errors.append(None)
            except n.NVMLError as e:
                errors.append([type(e).__name__, e.value])
        try:
            n.nvmlDeviceGetCount()
        except n.NVMLError as e:
            errors.append(type(e).__name__)
        print(json.dumps(errors))
    """)
    assert out == [[error, code], [error, code], "NVMLError_Uninitialized"]


def test_lost_gpus(sim: Sim) -> None:
    sim.configure(lost_gpus="1 3")
    gpus = sim.snapshot()
    assert [g.get("error") for g in gpus] == [
        None,
        "NVMLError_GpuIsLost",
        None,
        "NVMLError_GpuIsLost",
        None,
        None,
        None,
        None,
    ]
    out = sim.run("""
        n.nvmlInit()
        try:
            n.nvmlDeviceGetHandleByUUID("GPU-fa4e5a11-0000-0000-0000-000000000003")
        except n.NVMLError as e:
            print(json.dumps(type(e).__name__))
    """)
    assert out == "NVMLError_GpuIsLost"


def test_memory_not_supported(sim: Sim) -> None:
    sim.configure(memory_not_supported=1)
    holder = sim.hold("nvidia0")
    sim.claim(holder.pid, 5, "0")
    gpu = sim.snapshot()[0]
    assert gpu["v1"] == "NVMLError_NotSupported"
    assert gpu["compute"] == [[holder.pid, 5 * MIB, NA, NA]]
    out = sim.run("""
        n.nvmlInit()
        try:
            n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(0), n.nvmlMemory_v2)
        except n.NVMLError as e:
            print(json.dumps(type(e).__name__))
    """)
    assert out == "NVMLError_NotSupported"


def test_non_default_minors_and_identity(sim: Sim) -> None:
    sim.configure(
        gpu_count=3,
        minors="4 6 2",
        uuid_prefix="GPU-00000000-1111-2222-3333-",
        name="NVIDIA B200 (simulated)",
        driver_version="999.1.2",
        total_mib=1000,
        reserved_mib=100,
    )
    holder = sim.hold("nvidia6")
    sim.claim(holder.pid, 300, "6")
    gpus = sim.snapshot()
    assert [g["minor"] for g in gpus] == [4, 6, 2]
    assert gpus[1]["uuid"] == "GPU-00000000-1111-2222-3333-000000000001"
    assert gpus[1]["name"] == "NVIDIA B200 (simulated)"
    assert gpus[1]["compute"] == [[holder.pid, 300 * MIB, NA, NA]]
    assert gpus[1]["v1"] == [1000 * MIB, 600 * MIB, 400 * MIB]
    assert gpus[1]["v2"] == [0x02000028, 1000 * MIB, 100 * MIB, 600 * MIB, 300 * MIB]
    assert gpus[0]["compute"] == gpus[2]["compute"] == []
    assert sim.run("n.nvmlInit(); print(json.dumps(n.nvmlSystemGetDriverVersion()))") == "999.1.2"


def test_raw_abi(sim: Sim) -> None:
    """What pynvml does not exercise: return codes for buffer sizes, versions, init state."""
    holder = sim.hold("nvidia0")
    sim.claim(holder.pid, 8, "0")
    out = sim.run("""
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        c = ctypes.c_uint(0)
        h = n.c_nvmlDevice_t()
        r = {}
        r["count_before_init"] = lib.nvmlDeviceGetCount_v2(ctypes.byref(c))
        r["shutdown_before_init"] = lib.nvmlShutdown()
        r["init"] = lib.nvmlInit_v2()
        r["handle"] = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
        r["bad_index"] = lib.nvmlDeviceGetHandleByIndex_v2(8, ctypes.byref(h))
        r["bad_uuid"] = lib.nvmlDeviceGetHandleByUUID(b"GPU-nope", ctypes.byref(n.c_nvmlDevice_t()))
        compute = lib.nvmlDeviceGetComputeRunningProcesses_v3
        c.value = 0
        r["null_array"] = [compute(h, ctypes.byref(c), None), c.value]
        arr = (n.c_nvmlProcessInfo_v3_t * 1)()
        c.value = 0
        r["too_small"] = [compute(h, ctypes.byref(c), arr), c.value]
        c.value = 1
        r["fits"] = [compute(h, ctypes.byref(c), arr), c.value, arr[0].pid, arr[0].usedGpuMemory]
        class V1(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
        v1 = (V1 * 2)()
        c.value = 2
        ret = lib.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(c), v1)
        r["unversioned"] = [ret, c.value, v1[0].pid, v1[0].usedGpuMemory, v1[1].pid]
        c.value = 0
        ret = lib.nvmlDeviceGetGraphicsRunningProcesses_v3(h, ctypes.byref(c), None)
        r["graphics_empty"] = [ret, c.value]
        m = n.c_nvmlMemory_v2_t()
        m.version = 0x01000028
        r["mem_bad_version"] = lib.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(m))
        buf = ctypes.create_string_buffer(8)
        r["small_name_buffer"] = lib.nvmlDeviceGetName(h, buf, 8)
        r["shutdown"] = lib.nvmlShutdown()
        r["count_after_shutdown"] = lib.nvmlDeviceGetCount_v2(ctypes.byref(c))
        lib.nvmlErrorString.restype = ctypes.c_char_p
        r["error_string"] = lib.nvmlErrorString(15).decode()
        print(json.dumps(r))
    """)
    assert out == {
        "count_before_init": 1,
        "shutdown_before_init": 1,
        "init": 0,
        "handle": 0,
        "bad_index": 2,
        "bad_uuid": 6,
        "null_array": [7, 1],
        "too_small": [7, 1],
        "fits": [0, 1, holder.pid, 8 * MIB],
        "unversioned": [0, 1, holder.pid, 8 * MIB, 0],
        "graphics_empty": [0, 0],
        "mem_bad_version": 25,
        "small_name_buffer": 7,
        "shutdown": 0,
        "count_after_shutdown": 1,
        "error_string": "GPU is lost",
    }


def test_reader_that_cannot_see_fds_trusts_the_claim(sim: Sim) -> None:
    """Like the driver, a reader that may not read another user's fds still lists its holders."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to start a holder as another user")
    holder = sim.hold("nvidia2", then="os.setresuid(65534, 65534, 65534)")
    sim.claim(holder.pid, 77, "2")
    no_ptrace = ("setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace")
    # the reader really cannot see the holder's fds
    proc = subprocess.run([*no_ptrace, "readlink", f"/proc/{holder.pid}/fd/3"], capture_output=True)
    assert proc.returncode != 0
    for wrapper in ((), no_ptrace):
        gpu = sim.snapshot(wrapper=wrapper)[2]
        assert gpu["compute"] == [[holder.pid, 77 * MIB, NA, NA]], wrapper
        assert gpu["v2"][4] == 77 * MIB
    holder.kill()
    os.waitid(os.P_PID, holder.pid, os.WEXITED | os.WNOWAIT)  # a zombie now, not reaped
    assert sim.snapshot(wrapper=no_ptrace)[2]["compute"] == []


MIG_SNAPSHOT = """
def procs(h):
    return sorted([p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
                  for p in n.nvmlDeviceGetComputeRunningProcesses(h))
n.nvmlInit()
out = []
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    gpu = {"mode": n.nvmlDeviceGetMigMode(h), "max": n.nvmlDeviceGetMaxMigDeviceCount(h),
           "is_mig": n.nvmlDeviceIsMigDeviceHandle(h).value, "compute": procs(h),
           "used": n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2).used, "slices": []}
    for k in range(gpu["max"]):
        try:
            m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        except n.NVMLError as e:
            gpu["slices"].append(type(e).__name__)
            continue
        uuid = n.nvmlDeviceGetUUID(m)
        parent = n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        again = n.nvmlDeviceGetHandleByUUID(uuid)
        v2 = n.nvmlDeviceGetMemoryInfo(m, n.nvmlMemory_v2)
        v1 = n.nvmlDeviceGetMemoryInfo(m)
        gpu["slices"].append({
            "uuid": uuid, "name": n.nvmlDeviceGetName(m),
            "is_mig": n.nvmlDeviceIsMigDeviceHandle(m).value,
            "gi": n.nvmlDeviceGetGpuInstanceId(m), "ci": n.nvmlDeviceGetComputeInstanceId(m),
            "parent": n.nvmlDeviceGetIndex(parent),
            "by_uuid": [n.nvmlDeviceGetGpuInstanceId(again), n.nvmlDeviceGetComputeInstanceId(again)],
            "v1": [v1.total, v1.free, v1.used], "v2": [v2.total, v2.reserved, v2.free, v2.used],
            "compute": procs(m),
        })
    out.append(gpu)
print(json.dumps(out))
"""

MIG_PREFIX = "MIG-fa4e5a11-0000-0000-0000-"


def mig_uuid(index: int, gi: int, ci: int) -> str:
    return f"{MIG_PREFIX}{index:04x}{gi:04x}{ci:04x}"


def test_mig_slices_through_pynvml(sim: Sim) -> None:
    sim.configure(gpu_count=2, mig="0 1/0/20000/2g.20gb 2/0/20000 5/0/40000/3g.40gb")
    on_one = sim.hold("nvidiactl", "nvidia0")
    sim.claim(on_one.pid, 1000, "0/1/0")
    on_two = sim.hold("nvidia0")
    sim.claim(on_two.pid, 300, "0/2/0")
    # holds the parent's device file, as every process on every slice does; on no slice
    watcher = sim.hold("nvidia0")
    (sim.state / "leak").mkdir()
    (sim.state / "leak" / "0-5-0").write_text("64\n")
    gpus = sim.run(MIG_SNAPSHOT)
    gpu0, gpu1 = gpus
    assert gpu0["mode"] == [1, 1] and gpu0["max"] == 7 and gpu0["is_mig"] == 0
    assert gpu1["mode"] == [0, 0] and gpu1["max"] == 0 and gpu1["slices"] == []
    assert gpu0["slices"][3:] == ["NVMLError_NotFound"] * 4
    one, two, three = gpu0["slices"][:3]
    assert [s["uuid"] for s in (one, two, three)] == [
        mig_uuid(0, 1, 0),
        mig_uuid(0, 2, 0),
        mig_uuid(0, 5, 0),
    ]
    assert one["name"] == "NVIDIA H200 (simulated) MIG 2g.20gb"
    assert two["name"] == "NVIDIA H200 (simulated) MIG 1g.20000mb"
    for s, (gi, ci) in zip((one, two, three), ((1, 0), (2, 0), (5, 0))):
        assert s["is_mig"] == 1 and s["parent"] == 0
        assert [s["gi"], s["ci"]] == s["by_uuid"] == [gi, ci]
    assert one["compute"] == [[on_one.pid, 1000 * MIB, 1, 0]]
    assert two["compute"] == [[on_two.pid, 300 * MIB, 2, 0]]
    assert three["compute"] == []
    assert one["v2"] == [20000 * MIB, 0, 19000 * MIB, 1000 * MIB]
    assert one["v1"] == [20000 * MIB, 19000 * MIB, 1000 * MIB]
    assert three["v2"][3] == 64 * MIB
    # the parent aggregates its slices (processes with their instance ids, memory)
    assert gpu0["compute"] == sorted(
        [[on_one.pid, 1000 * MIB, 1, 0], [on_two.pid, 300 * MIB, 2, 0]]
    )
    assert gpu0["used"] == 1364 * MIB
    assert watcher.pid not in {p[0] for g in gpus for p in g["compute"]}
    assert gpu1["compute"] == [] and gpu1["used"] == 0


def test_mig_claim_needs_the_parent_device_file(sim: Sim) -> None:
    sim.configure(release_delay_ms=60_000, mig="0 1/0/1000 2/0/1000")
    holder = sim.hold("nvidia1")  # not GPU 0's device file: not live on its slice
    sim.claim(holder.pid, 10, "0/1/0,1")
    gpus = sim.run(MIG_SNAPSHOT)
    assert gpus[0]["slices"][0]["compute"] == []
    assert gpus[0]["slices"][0]["v2"][3] == 10 * MIB  # counted: the process is alive
    assert gpus[0]["slices"][1]["v2"][3] == 0
    assert gpus[1]["compute"] == [[holder.pid, 10 * MIB, NA, NA]]


def test_mig_handle_errors(sim: Sim) -> None:
    sim.configure(mig="3 7/1/5000", gpu_count=4, max_mig_devices=2)
    out = sim.run(f"""
        n.nvmlInit()
        r = {{}}
        def err(f, *a):
            try:
                f(*a)
                return None
            except n.NVMLError as e:
                return type(e).__name__
        whole = n.nvmlDeviceGetHandleByIndex(0)
        mig = n.nvmlDeviceGetMigDeviceHandleByIndex(n.nvmlDeviceGetHandleByIndex(3), 0)
        r["gi_of_whole"] = err(n.nvmlDeviceGetGpuInstanceId, whole)
        r["parent_of_whole"] = err(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, whole)
        r["mig_of_non_mig"] = err(n.nvmlDeviceGetMigDeviceHandleByIndex, whole, 0)
        r["past_max"] = err(n.nvmlDeviceGetMigDeviceHandleByIndex,
                            n.nvmlDeviceGetHandleByIndex(3), 2)
        r["empty_slot"] = err(n.nvmlDeviceGetMigDeviceHandleByIndex,
                              n.nvmlDeviceGetHandleByIndex(3), 1)
        r["minor_of_mig"] = err(n.nvmlDeviceGetMinorNumber, mig)
        r["mode_of_mig"] = err(n.nvmlDeviceGetMigMode, mig)
        r["ids"] = [n.nvmlDeviceGetGpuInstanceId(mig), n.nvmlDeviceGetComputeInstanceId(mig)]
        r["unknown_mig_uuid"] = err(n.nvmlDeviceGetHandleByUUID, "{mig_uuid(3, 7, 2)}")
        r["legacy_form"] = err(n.nvmlDeviceGetHandleByUUID,
                               "MIG-GPU-fa4e5a11-0000-0000-0000-000000000003/7/1")
        print(json.dumps(r))
    """)
    assert out == {
        "gi_of_whole": "NVMLError_InvalidArgument",
        "parent_of_whole": "NVMLError_InvalidArgument",
        "mig_of_non_mig": "NVMLError_InvalidArgument",
        "past_max": "NVMLError_InvalidArgument",
        "empty_slot": "NVMLError_NotFound",
        "minor_of_mig": "NVMLError_InvalidArgument",
        "mode_of_mig": "NVMLError_InvalidArgument",
        "ids": [7, 1],
        "unknown_mig_uuid": "NVMLError_NotFound",
        "legacy_form": "NVMLError_NotFound",
    }


def test_gpugates_driver_reads_slices(sim: Sim) -> None:
    """host.nvml.NvmlDriver over the stand-in: slices follow their GPU, keyed apart, each
    with its own memory and processes; entries with a GPU instance are marked on_slice."""
    sim.configure(gpu_count=2, mig="1 3/0/10000/1g.10gb 4/1/20000")
    on_slice = sim.hold("nvidia1")
    sim.claim(on_slice.pid, 500, "1/4/1")
    whole = sim.hold("nvidia0")
    sim.claim(whole.pid, 50, "0")
    out = sim.run(f"""
        from gpugate.host.nvml import NvmlDriver
        d = NvmlDriver(library={str(sim.lib_dir / "libnvidia-ml.so.1")!r})
        rows = []
        for g in d.gpus():
            u = d.usage(g)
            rows.append([g.index, g.uuid, g.minor, g.total_mib, g.mig_mode, g.shown,
                         None if g.mig is None else g.mig.profile, u.used_mib,
                         [[p.pid, p.used_mib, p.on_slice] for p in u.processes]])
        d.close()
        print(json.dumps(rows))
    """)
    key = 1024 + 16
    assert out == [
        [
            0,
            "GPU-fa4e5a11-0000-0000-0000-000000000000",
            0,
            97887,
            False,
            "0",
            None,
            50,
            [[whole.pid, 50, False]],
        ],
        [
            1,
            "GPU-fa4e5a11-0000-0000-0000-000000000001",
            1,
            97887,
            True,
            "1",
            None,
            500,
            [[on_slice.pid, 500, True]],
        ],
        [key, mig_uuid(1, 3, 0), 1, 10000, False, "1/3/0", "1g.10gb", 0, []],
        [
            key + 1,
            mig_uuid(1, 4, 1),
            1,
            20000,
            False,
            "1/4/1",
            "1g.20000mb",
            500,
            [[on_slice.pid, 500, True]],
        ],
    ]


def test_mps_clients_are_on_the_mps_list_and_the_server_on_the_compute_list(sim: Sim) -> None:
    server = sim.hold("nvidiactl", "nvidia0", "nvidia1")
    sim.claim(server.pid, 300, "0,1")
    client = sim.hold("nvidiactl", "nvidia-uvm", "nvidia0")
    with_mps = sim.claim(client.pid, 4000, "0")
    with_mps.write_text(with_mps.read_text().rstrip() + " mps\n")
    both = sim.hold("nvidia0", "nvidia1")
    sim.claim(both.pid, 2000, "0,1")
    path = sim.state / "claims" / str(both.pid)
    path.write_text(path.read_text().rstrip() + " mps\n")
    stranger = sim.hold("nvidia2")
    bad = sim.claim(stranger.pid, 100, "2")
    bad.write_text(bad.read_text().rstrip() + " mpx\n")  # not a kind the stand-in knows

    gpus = sim.snapshot()
    assert gpus[0]["compute"] == [[server.pid, 300 * MIB, NA, NA]]
    assert gpus[0]["mps"] == sorted(
        [[client.pid, 4000 * MIB, NA, NA], [both.pid, 2000 * MIB, NA, NA]]
    )
    assert gpus[0]["v2"][4] == (300 + 4000 + 2000) * MIB  # every context's memory is used
    assert gpus[1]["compute"] == [[server.pid, 300 * MIB, NA, NA]]
    assert gpus[1]["mps"] == [[both.pid, 2000 * MIB, NA, NA]]
    assert gpus[2]["compute"] == gpus[2]["mps"] == [] and gpus[2]["v2"][4] == 0
    v2 = sim.run("""
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        print(json.dumps(sorted(p.pid for p in n.nvmlDeviceGetMPSComputeRunningProcesses_v2(h))))
    """)
    assert v2 == sorted([client.pid, both.pid])

    sim.configure(mps_clients_compute=1)  # nvidia-smi's M+C: on both lists
    gpus = sim.snapshot()
    assert {p[0] for p in gpus[0]["compute"]} == {server.pid, client.pid, both.pid}
    assert {p[0] for p in gpus[0]["mps"]} == {client.pid, both.pid}


@pytest.mark.parametrize(("code", "error"), [(13, "FunctionNotFound"), (3, "NotSupported")])
def test_a_driver_that_cannot_list_mps_clients(sim: Sim, code: int, error: str) -> None:
    client = sim.hold("nvidia0")
    path = sim.claim(client.pid, 4000, "0")
    path.write_text(path.read_text().rstrip() + " mps\n")
    sim.configure(mps_error=code)
    out = sim.run("""
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        try:
            n.nvmlDeviceGetMPSComputeRunningProcesses_v3(h)
            print(json.dumps(None))
        except n.NVMLError as e:
            print(json.dumps(type(e).__name__))
    """)
    assert out == f"NVMLError_{error}"


GPUGATE_USAGE = """
from gpugate.host.nvml import NvmlDriver
d = NvmlDriver(library={lib!r})
rows = []
for g in d.gpus():
    u = d.usage(g)
    rows.append([g.index, u.used_mib, u.processes_listed,
                 [[p.pid, p.used_mib, p.on_slice, p.mps_client] for p in u.processes]])
d.close()
print(json.dumps(rows))
"""


def test_gpugates_driver_reads_mps_clients_with_their_memory(sim: Sim) -> None:
    """host.nvml.NvmlDriver: the server from the compute list, each client from the MPS list
    with its MiB and marked, on a GPU and on a MIG slice; a client on both lists counted once;
    a driver without the MPS call lists the rest, as readable as before."""
    sim.configure(gpu_count=2, mig="1 3/0/10000")
    server = sim.hold("nvidia0", "nvidia1")
    sim.claim(server.pid, 300, "0,1/3/0")
    client = sim.hold("nvidia0")
    path = sim.claim(client.pid, 4000, "0")
    path.write_text(path.read_text().rstrip() + " mps\n")
    on_slice = sim.hold("nvidia1")
    path = sim.claim(on_slice.pid, 700, "1/3/0")
    path.write_text(path.read_text().rstrip() + " mps\n")
    code = GPUGATE_USAGE.format(lib=str(sim.lib_dir / "libnvidia-ml.so.1"))
    key = 1024 + 16

    rows = sim.run(code)
    assert rows[0] == [
        0,
        4300,
        True,
        sorted([[server.pid, 300, False, False], [client.pid, 4000, False, True]]),
    ]
    assert rows[2] == [
        key,
        1000,
        True,
        sorted([[server.pid, 300, True, False], [on_slice.pid, 700, True, True]]),
    ]

    sim.configure(gpu_count=2, mig="1 3/0/10000", mps_clients_compute=1)
    assert sim.run(code)[0] == rows[0]  # the larger figure, not the sum

    for missing in (13, 3):
        sim.configure(gpu_count=2, mig="1 3/0/10000", mps_error=missing)
        rows = sim.run(code)
        assert rows[0] == [0, 4300, True, [[server.pid, 300, False, False]]]
