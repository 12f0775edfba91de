"""Inside the simulated host: run a command and say when it exited.

    python3 timed.py CMD...

Prints "EXIT UNIX_NS WALL_S RC MAXRSS_KIB CPU_S" on stdout once CMD has exited and been
reaped; CMD's own output passes through.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    proc = subprocess.Popen(argv[1:])
    _, status, usage = os.wait4(proc.pid, 0)
    exited_ns = time.time_ns()
    wall = time.perf_counter() - started
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    print(f"EXIT {exited_ns} {wall:.6f} {code} {usage.ru_maxrss} {cpu:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
