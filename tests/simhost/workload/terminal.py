#!/usr/bin/env python3
"""A login's terminal: an interactive bash with job control on a new pty (what sshd or a
terminal emulator gives), fed from a FIFO, its output drained to a log.

    python3 terminal.py NAME

Creates /run/term-NAME.in (write lines there to type them), logs to /run/term-NAME.log and,
once the shell runs, writes {"terminal": PID, "shell": PID} to /run/term-NAME.json.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys


def main(name: str) -> int:
    fifo = f"/run/term-{name}.in"
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    master, slave = os.openpty()
    shell = subprocess.Popen(
        ["setsid", "--ctty", "bash", "--norc", "--noprofile", "-i"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "PS1": "$ ", "TERM": "dumb"},
    )
    os.close(slave)
    typed = os.open(fifo, os.O_RDWR)  # read-write: no EOF when a writer closes
    with open(f"/run/term-{name}.json.tmp", "w") as out:
        json.dump({"terminal": os.getpid(), "shell": shell.pid}, out)
    os.replace(f"/run/term-{name}.json.tmp", f"/run/term-{name}.json")
    with open(f"/run/term-{name}.log", "ab", buffering=0) as log:
        selector = selectors.DefaultSelector()
        selector.register(master, selectors.EVENT_READ)
        selector.register(typed, selectors.EVENT_READ)
        while shell.poll() is None:
            for key, _ in selector.select(timeout=1):
                try:
                    data = os.read(key.fd, 65536)
                except OSError:
                    return 0  # the shell is gone
                if key.fd == master:
                    log.write(data)
                else:
                    os.write(master, data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
