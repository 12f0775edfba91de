#!/usr/bin/env python3
"""A stand-in for a vLLM server that looks like vLLM to every tool, without a GPU.

    python3 fake_vllm.py --gpus 0,1 --port 8000 [--host 127.0.0.1] [--mib 95000]
        [--state-dir /run/fake-nvml] [--dev-root /dev] [--ignore-sigterm-workers]
        [--ignore-sigterm-worker RANK]
        [--title-prefix VLLM] [--ready-file PATH] [--shm TAG]

Process tree, as vLLM builds it (multiprocessing with the spawn context):

    python3 fake_vllm.py ...            the API server: keeps its python command line, serves
                                        GET /health on HOST:PORT
    ├─ <python> -c from multiprocessing.resource_tracker import main;main(N)
    └─ VLLM::EngineCore
       ├─ VLLM::Worker_TP0              one per GPU: opens DEV_ROOT/nvidiactl, nvidia-uvm and
       └─ VLLM::Worker_TP1              nvidiaN, writes STATE_DIR/claims/PID, sleeps forever

Each worker's claim file holds one line "MIB STARTTIME N" (STARTTIME is field 22 of
/proc/PID/stat), which the stand-in libnvidia-ml.so.1 turns into a GPU process using MIB MiB.
Nobody sets a parent-death signal and the API server does not handle SIGTERM, so killing it
(SIGTERM or SIGKILL) leaves the engine core and the workers running: the incident gpugate is for.

With --shm TAG the application also holds POSIX shared memory in /dev/shm, as vLLM's does:
worker 0 a multiprocessing SharedMemory segment `psm_TAG` (open and mapped), the engine core an
NCCL-like segment `nccl-TAG` (mapped, its fd closed), and the API server a multiprocessing
semaphore `sem.mp-...` (sem_open: mapped only). None stays registered with the resource
tracker, as NCCL's and torch's segments never are, so only gpugate can remove them once the
application is killed.

Once every worker has written its claim and the port is bound, the API server prints READY
and, with --ready-file, writes there (atomically) a JSON object of the pids:
{"api_server": PID, "engine_core": PID, "workers": [PID, ...]}, and with --shm the files'
paths: "shm": [PATH, ...].
A port already in use, or a worker that cannot open its device files, exits non-zero at once.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import re
import signal
import sys
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

PR_SET_NAME = 15


def set_comm(title: str) -> None:
    """The kernel's comm only (15 bytes), through prctl(PR_SET_NAME): what a bare root without
    setproctitle can do (tests/simhost/roots.py's Debian 11 and 13)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NAME, title.encode()[:15], 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME)")


set_title: Callable[[str], None]
try:
    from setproctitle import setproctitle as set_title
except ImportError:
    set_title = set_comm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--gpus",
        required=True,
        help="device numbers N of DEV_ROOT/nvidiaN, e.g. 0,1; N/GI/CI: a MIG slice of GPU N",
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--mib", type=int, default=95000, help="MiB each worker uses on its GPU")
    p.add_argument("--state-dir", default="/run/fake-nvml")
    p.add_argument("--dev-root", default="/dev")
    p.add_argument("--ignore-sigterm-workers", action="store_true")
    p.add_argument(
        "--ignore-sigterm-worker",
        type=int,
        action="append",
        default=[],
        metavar="RANK",
        help="only this worker ignores SIGTERM (repeatable)",
    )
    p.add_argument("--title-prefix", default=os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM"))
    p.add_argument("--ready-file", default=None)
    p.add_argument("--shm", default=None, metavar="TAG", help="hold /dev/shm files named by TAG")
    args = p.parse_args(argv)
    args.gpu_list = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if not all(re.fullmatch(r"[0-9]+(/[0-9]+/[0-9]+)?", g) for g in args.gpu_list):
        p.error("--gpus takes N or N/GI/CI, comma-separated")
    if not args.gpu_list:
        p.error("--gpus names no GPU")
    return args


def proc_starttime(pid: int) -> int:
    """Field 22 of /proc/PID/stat (the comm in field 2 may hold spaces and parentheses)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


# Device files a worker keeps open for its whole life, like a CUDA context does.
_held_files: list[int] = []
_held_shm: list[Any] = []  # shared memory kept for the process's life
SHM_BYTES = 1024 * 1024


def untracked(name: str, kind: str) -> None:
    """Take a resource off the resource tracker's list: NCCL's and torch's never are on it."""
    from multiprocessing import resource_tracker

    resource_tracker.unregister(name, kind)


def hold_segment_open(tag: str) -> None:
    from multiprocessing import shared_memory

    segment = shared_memory.SharedMemory(f"psm_{tag}", create=True, size=SHM_BYTES)
    segment.buf[:] = b"w" * SHM_BYTES  # touched: it takes space in /dev/shm
    untracked(segment._name, "shared_memory")  # type: ignore[attr-defined]
    _held_shm.append(segment)


def hold_segment_mapped(tag: str) -> None:
    """A segment mapped with its fd closed, as NCCL leaves its own (a libc mmap: Python's mmap
    keeps a duplicate of the fd)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    fd = os.open(f"/dev/shm/nccl-{tag}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"n" * SHM_BYTES)
    address = libc.mmap(None, SHM_BYTES, 3, 1, fd, 0)  # PROT_READ|PROT_WRITE, MAP_SHARED
    os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    _held_shm.append(address)


def worker_main(rank: int, gpu: str, args: argparse.Namespace, ready: Connection) -> None:
    """gpu: N, or N/GI/CI for a MIG slice of GPU N (CUDA opens /dev/nvidiaN for either)."""
    set_title(f"{args.title_prefix}::Worker_TP{rank}")
    if args.ignore_sigterm_workers or rank in args.ignore_sigterm_worker:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dev = Path(args.dev_root)
    for name in ("nvidiactl", "nvidia-uvm", f"nvidia{gpu.split('/', maxsplit=1)[0]}"):
        _held_files.append(os.open(dev / name, os.O_RDONLY))
    if args.shm and rank == 0:
        hold_segment_open(args.shm)
    claims = Path(args.state_dir) / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    write_atomically(claims / str(pid), f"{args.mib} {proc_starttime(pid)} {gpu}\n")
    ready.send(pid)
    ready.close()
    while True:
        signal.pause()


def engine_core_main(args: argparse.Namespace, ready: Connection) -> None:
    set_title(f"{args.title_prefix}::EngineCore")
    if args.shm:
        hold_segment_mapped(args.shm)
    ctx = multiprocessing.get_context("spawn")
    workers = []
    pipes = []
    for rank, gpu in enumerate(args.gpu_list):
        r, w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker_main, args=(rank, gpu, args, w), name=f"Worker_TP{rank}")
        proc.start()
        w.close()
        workers.append(proc)
        pipes.append(r)
    try:
        pids = [r.recv() for r in pipes]
    except EOFError:
        # A worker died before writing its claim: take the others down and fail.
        for proc in workers:
            proc.kill()
        sys.exit(1)
    ready.send(pids)
    ready.close()
    while True:
        signal.pause()


class HealthHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # bind first: a port in use fails fast, before any process is started
        server = ThreadingHTTPServer((args.host, args.port), HealthHandler)
    except OSError as err:
        print(f"fake_vllm: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 1

    ctx = multiprocessing.get_context("spawn")  # also starts the resource tracker
    shm_paths: list[str] = []
    if args.shm:
        semaphore = ctx.Semaphore()  # sem_open: /dev/shm/sem.mp-..., mapped, fd closed
        name = semaphore._semlock.name  # type: ignore[attr-defined]
        untracked(name, "semaphore")
        _held_shm.append(semaphore)
        shm_paths = [
            f"/dev/shm/psm_{args.shm}",
            f"/dev/shm/nccl-{args.shm}",
            f"/dev/shm/sem.{name[1:]}",
        ]
    ready_r, ready_w = ctx.Pipe(duplex=False)
    engine = ctx.Process(target=engine_core_main, args=(args, ready_w), name="EngineCore")
    engine.start()
    ready_w.close()
    try:
        worker_pids = ready_r.recv()
    except EOFError:
        print("fake_vllm: engine core failed to start its workers", file=sys.stderr)
        return 1

    if args.ready_file:
        pids = {"api_server": os.getpid(), "engine_core": engine.pid, "workers": worker_pids}
        if shm_paths:
            pids["shm"] = shm_paths
        write_atomically(Path(args.ready_file), json.dumps(pids) + "\n")
    print("READY", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
