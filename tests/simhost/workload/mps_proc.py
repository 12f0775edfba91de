"""A stand-in CUDA MPS process for the simulated host: the server (run by a copy of Python at
/usr/bin/nvidia-cuda-mps-server, so its /proc/PID/exe is the server's path) or a client
(--mps). It opens /dev/nvidiaN for each GPU, writes its claim for the stand-in NVML
("MIB STARTTIME N[,N...] [mps]"), then its ready file ({"pid": PID}), and sleeps. With
--log-signals FILE it notes each SIGTERM, SIGINT or SIGHUP it gets there and goes on."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", required=True)
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--ready", required=True)
    p.add_argument("--mps", action="store_true", help="an MPS client (else the server)")
    p.add_argument("--log-signals", default=None)
    p.add_argument("--state-dir", default="/run/fake-nvml")
    args = p.parse_args()
    if args.log_signals:
        log = args.log_signals

        def note(signum: int, _frame: object) -> None:
            with open(log, "a") as out:
                out.write(f"{os.getpid()} {signal.Signals(signum).name}\n")

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, note)
    gpus = args.gpus.split(",")
    handles = [os.open(f"/dev/nvidia{gpu}", os.O_RDONLY) for gpu in gpus]
    start = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
    claims = Path(args.state_dir) / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    kind = " mps" if args.mps else ""
    write_atomically(claims / str(os.getpid()), f"{args.mib} {start} {','.join(gpus)}{kind}\n")
    write_atomically(Path(args.ready), json.dumps({"pid": os.getpid()}))
    while handles:
        time.sleep(3600)


if __name__ == "__main__":
    main()
