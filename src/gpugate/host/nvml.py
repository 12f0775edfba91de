"""The only module that talks to NVIDIA's driver (pynvml), and the MIG capability devices
under /proc/driver/nvidia. Everything else sees `Gpu` and `GpuUsage` through `GpuDriver`."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast

from gpugate.errors import (
    CallTimedOut,
    GateError,
    GpuError,
    NvmlNotAnswering,
    NvmlUnavailable,
    PermissionDenied,
)
from gpugate.host.safe_files import find_program, read_capped, run_program, untrusted

MIB = 1024 * 1024
# A MIG slice is keyed, where GPUs are keyed by index, by MIG_KEY_BASE + MIG_PER_GPU * (its GPU's
# index) + its MIG index: above any index a config may name (config.values.MAX_GPU_INDEX).
MIG_KEY_BASE = 1024
MIG_PER_GPU = 16
NOT_AVAILABLE = 0xFFFFFFFF  # NVML's gpuInstanceId of a process on no MIG slice


def mig_key(parent: int, mig_index: int) -> int:
    return MIG_KEY_BASE + MIG_PER_GPU * parent + mig_index


def mig_parent(key: int) -> int | None:
    """The GPU index of a slice's key; None for a GPU's index."""
    return (key - MIG_KEY_BASE) // MIG_PER_GPU if key >= MIG_KEY_BASE else None


class MigSlice(NamedTuple):
    parent: int
    parent_uuid: str
    mig_index: int  # for nvmlDeviceGetMigDeviceHandleByIndex
    gpu_instance: int
    compute_instance: int
    profile: str  # from its name ("1g.10gb"), "" where the name has none


class Gpu(NamedTuple):
    index: int  # type: ignore[assignment]  # NVML's index; a MIG slice's mig_key
    uuid: str  # GPU-... ; MIG-... for a slice
    minor: int  # N of /dev/nvidiaN: not always equal to the index (a slice: its GPU's)
    name: str
    total_mib: int
    mig: MigSlice | None = None  # set on a MIG slice
    mig_mode: bool = False  # a whole GPU in MIG mode (its slices follow it in gpus())

    @property
    def shown(self) -> str:
        """The GPU as operators name it: its index, or a slice's GPU/GI/CI."""
        if self.mig is None:
            return str(self.index)
        return f"{self.mig.parent}/{self.mig.gpu_instance}/{self.mig.compute_instance}"

    @property
    def label(self) -> str:
        if self.mig is None:
            return f"GPU {self.index} ({self.uuid})"
        return f"MIG {self.shown} ({self.uuid})"  # GPU/GI/CI, as the legacy MIG-GPU-... form

    def covers(self, other: Gpu) -> bool:
        """Owning this one owns the other: itself, or (a whole GPU) each of its slices."""
        return other == self or (
            self.mig is None and other.mig is not None and other.mig.parent == self.index
        )


class GpuProcess(NamedTuple):
    pid: int
    used_mib: int | None  # None where the driver does not say
    on_slice: bool = False  # listed with a MIG GPU instance (its slice lists it too)
    mps_client: bool = False  # on NVML's MPS client list (docs/mps.md)


class GpuUsage(NamedTuple):
    gpu: Gpu
    used_mib: int
    processes: tuple[GpuProcess, ...]
    processes_listed: bool = True  # False: the driver cannot list this GPU's processes


class GpuFault(NamedTuple):
    index: int  # type: ignore[assignment]  # tuple.index, shadowed
    error: GateError
    uuid: str | None = None  # where NVML still gave it
    minor: int | None = None


class GpuDriver(Protocol):
    """What the run and `status` ask of the GPU driver. faults: the GPUs it counts but cannot
    read (lost, an unsupported query); usage may raise GpuError (that GPU) or NvmlUnavailable;
    answer_by: each later query is waited for until this time.monotonic() deadline (the run's);
    not_answering: why the driver stopped answering, where it did (it is asked nothing more)."""

    def gpus(self) -> Sequence[Gpu]: ...
    def faults(self) -> Sequence[GpuFault]: ...
    def usage(self, gpu: Gpu) -> GpuUsage: ...
    def answer_by(self, deadline: float) -> None: ...
    def not_answering(self) -> NvmlNotAnswering | None: ...
    def close(self) -> None: ...


# NVML is loaded by the driver's own path, never by bare name: dlopen("libnvidia-ml.so.1")
# would search the unit's LD_LIBRARY_PATH first, and root's hook would load whatever is there.
NVML_LIBRARY = "libnvidia-ml.so.1"
NVML_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/powerpc64le-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib",
)
LDCONFIG_DIRS = ("/sbin", "/usr/sbin")
LDCONFIG_TIMEOUT_S = 5.0


def find_nvml_library(dirs: Sequence[str] = NVML_DIRS) -> str | None:
    """libnvidia-ml.so.1 in the driver's folders, else in the dynamic loader's cache (ldconfig
    -p); only a file that no account but root (and gpugate's own) may change."""
    in_dirs = (os.path.join(folder, NVML_LIBRARY) for folder in dirs)
    for path in itertools.chain(in_dirs, _ldconfig_paths()):
        if os.path.isfile(path) and untrusted(path) is None:
            return path
    return None


def _ldconfig_paths() -> Iterator[str]:
    """The absolute paths `ldconfig -p` lists for libnvidia-ml.so.1, run when first asked."""
    ldconfig = find_program("ldconfig", LDCONFIG_DIRS)
    try:
        listed = run_program([ldconfig, "-p"], LDCONFIG_TIMEOUT_S) if ldconfig else None
    except GateError:
        return
    for line in listed.stdout.splitlines() if listed else ():
        name, _, path = line.partition(" => ")
        if name.strip().split(" ", 1)[0] == NVML_LIBRARY and os.path.isabs(path.strip()):
            yield path.strip()


def load_nvml_library(nv: Any, library: str | None) -> None:
    """The library, loaded by its absolute path, as pynvml's handle (under pynvml's lock)
    before nvmlInit, which then loads nothing by name."""
    with nv.libLoadLock:
        if nv.nvmlLib is not None:
            return
        path = library or find_nvml_library()
        if path is None:
            raise _not_found(f" in {', '.join(NVML_DIRS)} or the dynamic loader's cache")
        try:
            nv.nvmlLib = ctypes.CDLL(path)
        except OSError as exc:
            raise _not_found(f": {path} cannot be loaded ({exc})") from None


def _not_found(where: str) -> NvmlUnavailable:
    return NvmlUnavailable(
        f"NVML: {NVML_LIBRARY} not found{where}: is the NVIDIA driver installed?"
    )


ANSWER_WITHIN_S = 5.0  # a call's time limit where no run deadline is given (`status`)
# Each call may take this long even past the deadline (the run's last looks): a healthy call
# answers in milliseconds; a hung one costs the run this much more, once.
MIN_ANSWER_S = 1.0


def import_pynvml() -> None:
    """pynvml's import (with ctypes.util, subprocess, tempfile: about 15 ms) paid now, by a
    long-lived process that forks its runs (`gpugate nri`), so that each run does not."""
    import pynvml  # noqa: F401, PLC0415


class NvmlDriver:
    """GpuDriver backed by libnvidia-ml.so.1. Each query runs on one worker thread (CallThread)
    and is waited for until the run's deadline (answer_by), else ANSWER_WITHIN_S: a driver
    that stops answering (as a hanging nvidia-smi) ends the run with NvmlNotAnswering, naming
    the call and GPU, and is asked nothing more, not even nvmlShutdown. NVML is initialised at
    the first query, once the deadline is known. library: tests' stand-in (--nvml-library)."""

    def __init__(self, *, library: str | None = None) -> None:
        import pynvml  # noqa: PLC0415 - only runs that need the driver pay its import

        self._nv: Any = pynvml
        self._library = os.path.abspath(library) if library else None
        self._thread = CallThread("nvml")
        self._until: float | None = None  # the run's deadline (time.monotonic)
        self._stuck: NvmlNotAnswering | None = None
        self._calling: tuple[str, int | None] = ("", None)  # the NVML call under way, its GPU
        self._initialized = False
        self._memory_v2 = True
        self._handles: dict[int, Any] = {}
        self._gpus: list[Gpu] | None = None
        self._faults: list[GpuFault] = []

    def answer_by(self, deadline: float) -> None:
        self._until = deadline

    def not_answering(self) -> NvmlNotAnswering | None:
        return self._stuck

    def _bounded(self, job: Any, *args: Any) -> Any:
        """job(*args) on the NVML thread, by the deadline; its exceptions as raised."""
        if self._stuck is not None:
            raise self._stuck
        now, deadline = time.monotonic(), self._until
        until = now + ANSWER_WITHIN_S if deadline is None else max(deadline, now + MIN_ANSWER_S)
        try:
            return self._thread.call(until, job, *args)
        except CallTimedOut as exc:
            name, index = self._calling
            where = "" if index is None else f" on GPU {index}"
            self._stuck = NvmlNotAnswering(
                f"NVML is not answering: {name}{where} did not return within "
                f"{exc.waited_s:.1f} s (a hung driver, as when nvidia-smi hangs; see dmesg for "
                "Xid errors: the GPU may need a reset or the host a reboot)"
            )
            raise self._stuck from None

    def _raw(self, index: int | None, function: Any, *args: Any, **kwargs: Any) -> Any:
        """On the NVML thread: one call, noted first so that a hang can be named."""
        self._calling = (_name(function), index)
        return function(*args, **kwargs)

    def close(self) -> None:
        if not self._initialized or self._stuck is not None or self._thread.busy:
            return  # nvmlShutdown would wait behind the call that has not returned
        with contextlib.suppress(self._nv.NVMLError, NvmlNotAnswering):
            self._bounded(self._raw, None, self._nv.nvmlShutdown)

    def gpus(self) -> Sequence[Gpu]:
        if self._gpus is None:
            self._gpus = self._bounded(self._read_gpus)
        return self._gpus

    def _read_gpus(self) -> list[Gpu]:
        nv = self._nv
        if not self._initialized:
            self._calling = ("dlopen", None)
            load_nvml_library(nv, self._library)
            try:
                self._raw(None, nv.nvmlInit)
            except nv.NVMLError_LibraryNotFound:
                raise _not_found("") from None
            except nv.NVMLError_DriverNotLoaded:
                raise NvmlUnavailable("NVML: the NVIDIA kernel driver is not loaded") from None
            except nv.NVMLError_NoPermission:
                why = "NVML: permission denied opening the NVIDIA driver"
                raise PermissionDenied(why) from None
            except nv.NVMLError as exc:
                raise NvmlUnavailable(f"NVML: initialisation failed: {exc}") from None
            self._initialized = True
        found: list[Gpu] = []
        try:
            count = self._raw(None, nv.nvmlDeviceGetCount)
        except nv.NVMLError as exc:
            raise NvmlUnavailable(f"NVML: cannot count GPUs: {exc}") from None
        for index in range(count):
            try:
                gpu = self._read_gpu(index)
                found += [gpu, *(self._read_slices(gpu) if gpu.mig_mode else [])]
            except GpuError as exc:
                self._faults.append(GpuFault(index, exc))
        return found

    def _read_slices(self, gpu: Gpu) -> list[Gpu]:
        """The MIG devices of a GPU in MIG mode, as NVML numbers them (a free index: none)."""
        nv, index = self._nv, gpu.index
        parent = self._handles[index]
        most = int(self._call(index, nv.nvmlDeviceGetMaxMigDeviceCount, parent))
        slices: list[Gpu] = []
        call = functools.partial(self._call, index)
        for mig_index in range(min(most, MIG_PER_GPU)):
            get = nv.nvmlDeviceGetMigDeviceHandleByIndex
            try:
                handle = call(get, parent, mig_index, keep=nv.NVMLError_NotFound)
            except nv.NVMLError_NotFound:
                continue
            key = mig_key(index, mig_index)
            self._handles[key] = handle
            name = _text(call(nv.nvmlDeviceGetName, handle))
            memory = call(nv.nvmlDeviceGetMemoryInfo, handle)
            gpu_instance = int(call(nv.nvmlDeviceGetGpuInstanceId, handle))
            compute_instance = int(call(nv.nvmlDeviceGetComputeInstanceId, handle))
            profile = name.rsplit(" MIG ", 1)[1] if " MIG " in name else ""
            mig = MigSlice(index, gpu.uuid, mig_index, gpu_instance, compute_instance, profile)
            uuid = _text(call(nv.nvmlDeviceGetUUID, handle))
            slices.append(Gpu(key, uuid, gpu.minor, name, int(memory.total) // MIB, mig=mig))
        return slices

    def faults(self) -> Sequence[GpuFault]:
        self.gpus()
        return list(self._faults)

    def _read_gpu(self, index: int) -> Gpu:
        nv = self._nv
        handle = self._handles[index] = self._call(index, nv.nvmlDeviceGetHandleByIndex, index)
        memory = self._call(index, nv.nvmlDeviceGetMemoryInfo, handle)
        uuid = _text(self._call(index, nv.nvmlDeviceGetUUID, handle))
        minor = int(self._call(index, nv.nvmlDeviceGetMinorNumber, handle))
        name = _text(self._call(index, nv.nvmlDeviceGetName, handle))
        try:
            current = self._raw(index, nv.nvmlDeviceGetMigMode, handle)[0]
        except nv.NVMLError:
            current = 0  # a GPU whose MIG mode NVML cannot say is read whole
        return Gpu(index, uuid, minor, name, int(memory.total) // MIB, mig_mode=int(current) == 1)

    def usage(self, gpu: Gpu) -> GpuUsage:
        return cast(GpuUsage, self._bounded(self._usage, gpu))

    def _usage(self, gpu: Gpu) -> GpuUsage:
        """A GPU's or a MIG slice's (its own handle); errors on a slice are its GPU's."""
        nv = self._nv
        handle = self._handles[gpu.index]
        index = gpu.index if gpu.mig is None else gpu.mig.parent
        used = self._used_bytes(index, handle, whole=gpu.mig is None)
        lists: list[tuple[Sequence[Any], bool]] = []
        unsupported = nv.NVMLError_NotSupported  # the memory figure stands; device files decide
        for query in (
            nv.nvmlDeviceGetComputeRunningProcesses,
            nv.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            with contextlib.suppress(unsupported):
                lists.append((self._call(index, query, handle, keep=unsupported), False))
        listed = len(lists) == 2
        lists.append((self._mps_clients(index, handle), True))
        return GpuUsage(gpu, used // MIB, _merged(lists), processes_listed=listed)

    def _mps_clients(self, index: int, handle: Any) -> list[Any]:
        """NVML's list of MPS clients (the server itself is on the compute list). A driver
        without the call, or a GPU that does not support it, serves no MPS client."""
        nv = self._nv
        keep = (nv.NVMLError_FunctionNotFound, nv.NVMLError_NotSupported)
        for query in filter(None, (getattr(nv, name, None) for name in MPS_QUERIES)):
            try:
                return list(self._call(index, query, handle, keep=keep))
            except nv.NVMLError_FunctionNotFound:
                continue  # a driver older than this version of the call: the one before
            except nv.NVMLError_NotSupported:
                return []
        return []

    def _used_bytes(self, index: int, handle: Any, *, whole: bool = True) -> int:
        """A slice (not whole) whose handle refuses v2 falls back to v1 for that call alone."""
        nv = self._nv
        if self._memory_v2:
            # v2 reports reserved memory apart; v1's "used" includes it and is never 0.
            try:
                memory = self._raw(
                    index, nv.nvmlDeviceGetMemoryInfo, handle, version=nv.nvmlMemory_v2
                )
                return int(memory.used)
            except (
                nv.NVMLError_FunctionNotFound,
                nv.NVMLError_ArgumentVersionMismatch,
                nv.NVMLError_NotSupported,
            ):
                self._memory_v2 = not whole
            except nv.NVMLError:
                pass  # the v1 call below reports it, in the words every other call uses
        return int(self._call(index, nv.nvmlDeviceGetMemoryInfo, handle).used)

    def _call(self, index: int, function: Any, *args: Any, keep: Any = ()) -> Any:
        """One call on the NVML thread, its NVMLError as gpugate's (but those of keep)."""
        nv = self._nv
        try:
            return self._raw(index, function, *args)
        except keep:
            raise
        except nv.NVMLError_GpuIsLost:
            why = f"NVML: GPU {index} is lost (fell off the bus); it needs a reset or reboot"
            raise GpuError(index, why, code="nvml-gpu-lost") from None
        except nv.NVMLError_NotSupported:
            raise GpuError(index, f"NVML: GPU {index} does not support {_name(function)}") from None
        except nv.NVMLError_NoPermission:
            raise PermissionDenied(f"NVML: permission denied for {_name(function)}") from None
        except (nv.NVMLError_Uninitialized, nv.NVMLError_DriverNotLoaded) as exc:
            raise NvmlUnavailable(f"NVML: {_name(function)}: {exc}") from None
        except nv.NVMLError as exc:
            raise GpuError(index, f"NVML: {_name(function)} on GPU {index}: {exc}") from None


# The MPS client list, newest version first (pynvml's unversioned name is v3 and says a
# missing symbol in words of its own); a client NVML lists as compute too is one process.
MPS_QUERIES = (
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v2",
)


def _merged(lists: Sequence[tuple[Sequence[Any], bool]]) -> tuple[GpuProcess, ...]:
    """NVML's process lists of one GPU (each with whether it is the MPS list) merged by PID: a
    process on the compute and the graphics list uses the sum; an MPS client on the compute
    list too (nvidia-smi's "M+C") is one context listed twice: the larger figure."""
    used: dict[int, int | None] = {}
    on_slice: set[int] = set()
    mps: set[int] = set()
    for procs, is_mps in lists:
        for proc in procs:
            pid = int(proc.pid)
            mib = None if proc.usedGpuMemory is None else int(proc.usedGpuMemory) // MIB
            previous = used.get(pid)
            if previous is None:
                used[pid] = mib
            elif mib is not None:
                used[pid] = max(previous, mib) if is_mps else previous + mib
            instance = getattr(proc, "gpuInstanceId", None)
            if isinstance(instance, int) and instance != NOT_AVAILABLE:
                on_slice.add(pid)
            if is_mps:
                mps.add(pid)
    return tuple(
        GpuProcess(pid, mib, on_slice=pid in on_slice, mps_client=pid in mps)
        for pid, mib in sorted(used.items())
    )


def _name(function: Any) -> str:
    return str(getattr(function, "__name__", function))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NoGpus(NamedTuple):
    """Stands in for NVML when it failed and the policy says go on: cgroup cleanup only. Given
    the error of a driver that hung before it named its GPUs (`status`), each /dev/nvidiaN
    minor is a fault saying why, so its holders are still shown."""

    error: NvmlNotAnswering | None = None
    minors: Sequence[int] = ()

    def gpus(self) -> Sequence[Gpu]:
        return []

    def faults(self) -> Sequence[GpuFault]:
        error = self.error
        return [GpuFault(minor, error, minor=minor) for minor in self.minors] if error else []

    def usage(self, gpu: Gpu) -> GpuUsage:
        raise self.error or AssertionError(gpu)  # no error: a bug, a GPU it was not given

    def answer_by(self, deadline: float) -> None:
        pass  # it is asked nothing

    def not_answering(self) -> NvmlNotAnswering | None:
        return self.error

    def close(self) -> None:
        pass


class CallThread:
    """One daemon thread that makes, in order, calls into a library that may never return (a
    hung GPU driver), each waited for until a deadline. ctypes releases the GIL for the call,
    so the caller waits on an Event with a timeout (a wait a signal handler's exception
    interrupts). A hung call cannot be cancelled: the daemon thread lets the process exit, and
    the caller must make no further call (it would queue behind the hung one)."""

    def __init__(self, name: str) -> None:
        self.name = name
        # Each call: the job, set once it has returned, and (its value, its exception) then.
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, list[Any]]]
        self._requests = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: threading.Event | None = None

    @property
    def busy(self) -> bool:
        """A call has not returned (it hung, or its caller was interrupted waiting for it)."""
        return self._last is not None and not self._last.is_set()

    def call(self, until: float, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """function(*args, **kwargs)'s value or exception, or CallTimedOut once `until` passes."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self._last = done = threading.Event()
        answer: list[Any] = []
        started = time.monotonic()
        self._requests.put((functools.partial(function, *args, **kwargs), done, answer))
        if not done.wait(max(until - started, 0.0)):
            raise CallTimedOut(time.monotonic() - started)
        value, error = answer
        if error is not None:
            raise error
        return value

    def _serve(self) -> None:
        while True:
            job, done, answer = self._requests.get()
            try:
                answer[:] = [job(), None]
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, as it is
                answer[:] = [None, exc]
            done.set()


# MIG capability devices. The driver grants access to a GPU instance and to a compute instance
# by device files: /proc/driver/nvidia/capabilities/gpuN/mig/giG/access (N: the GPU's minor) and
# .../giG/ciC/access say, as "DeviceFileMinor: K", which /dev/nvidia-caps/nvidia-capK stands for
# it. A process on a slice holds them open from its start to its exit, also while NVML does not
# list it. The compute instance's names one slice; the GPU instance's names one where its GPU
# instance holds that slice alone. Hosts with nv_cap_enable_devfs=0 have none, and a process
# with CAP_SYS_ADMIN may use every capability without holding one.
CAPABILITIES = Path("driver/nvidia/capabilities")  # under the proc root
CAP_DEVICE = re.compile(r"nvidia-caps/nvidia-cap([0-9]+)$")
MINOR_LINE = re.compile(rb"^DeviceFileMinor:\s*([0-9]+)\s*$", re.MULTILINE)
MAX_ACCESS_BYTES = 4096


def _slice_minors(
    proc_root: Path, gpus: Sequence[Gpu]
) -> Iterator[tuple[Gpu, MigSlice, list[int | None]]]:
    """Each slice, its MigSlice and the minors (None where the driver names none) of its GPU
    instance's and compute instance's capability devices."""
    for gpu in gpus:
        mig = gpu.mig
        if mig is None:
            continue
        folder = proc_root / CAPABILITIES / f"gpu{gpu.minor}" / "mig" / f"gi{mig.gpu_instance}"
        minors: list[int | None] = []
        for access in (folder / "access", folder / f"ci{mig.compute_instance}" / "access"):
            try:
                match = MINOR_LINE.search(read_capped(access, MAX_ACCESS_BYTES))
            except OSError:
                match = None
            minors.append(int(match.group(1)) if match else None)
        yield gpu, mig, minors


def slice_of_cap_minor(proc_root: Path, gpus: Sequence[Gpu]) -> dict[int, int]:
    """The minor K of each capability device that ties a process to one slice -> its key."""
    per_instance = Counter((gpu.mig.parent, gpu.mig.gpu_instance) for gpu in gpus if gpu.mig)
    found: dict[int, int] = {}
    for gpu, mig, (gi_minor, ci_minor) in _slice_minors(proc_root, gpus):
        if ci_minor is not None:
            found[ci_minor] = gpu.index
        if gi_minor is not None and per_instance[(mig.parent, mig.gpu_instance)] == 1:
            found[gi_minor] = gpu.index
    return found


def slice_capabilities(proc_root: Path, gpus: Sequence[Gpu]) -> dict[int, tuple[int, int]]:
    """Each slice's key -> the minors of its GPU instance's and compute instance's capability
    devices, where the driver names both."""
    return {
        gpu.index: (gi_minor, ci_minor)
        for gpu, _, (gi_minor, ci_minor) in _slice_minors(proc_root, gpus)
        if gi_minor is not None and ci_minor is not None
    }


def cap_minor(path: str) -> int | None:
    """K of a held /dev/nvidia-caps/nvidia-capK, else None."""
    match = CAP_DEVICE.search(path)
    return int(match.group(1)) if match else None
