"""The command line that runs this very gpugate, isolated (docs/hardening.md, rules 5 and 6):
what `gpugate install` writes on a unit's hook lines and `gpugate run` on its unit's.

Python isolated (`-I`) reads no PYTHON* variable, adds neither the current folder nor the
script's to its path, and skips the user's site folder, so a unit's Environment=PYTHONPATH=
(often the server's venv) imports nothing into root's hook. A pip or pipx console script's
shebang has no -I: the hooks run its interpreter as `PYTHON -I -m gpugate` (the venv's
interpreter finds the venv's packages by its pyvenv.cfg, not by the environment). The
packages' /usr/bin/gpugate already says `#!/usr/bin/python3 -I`: it is used as it is.
Whatever PATH says: the paths are the ones this process was started from."""

from __future__ import annotations

import os
import sys

FALLBACK = ("/usr/bin/gpugate",)
SHEBANG_BYTES = 256


def gpugate_command(argv0: str | None = None, executable: str | None = None) -> tuple[str, ...]:
    """This gpugate: the launcher that was run where its shebang already isolates Python,
    else this interpreter with -I -m gpugate."""
    script = os.path.abspath(argv0 if argv0 is not None else sys.argv[0])
    if shebang(script) is not None and isolates(script):
        return (script,)
    python = executable if executable is not None else sys.executable
    if not python or not os.path.isabs(python):
        return FALLBACK
    return (python, "-I", "-m", "gpugate")


def command_for(path: str) -> tuple[str, ...]:
    """An operator's --gpugate-path: as it is where it isolates Python itself (or is not a
    Python script); a console script whose shebang lacks -I is run by its interpreter, -I."""
    line = shebang(path)
    if line is None or isolates(path):
        return (path,)
    interpreter = line[0]
    if os.path.basename(interpreter).startswith("python") and os.path.isabs(interpreter):
        return (interpreter, "-I", path)
    return (path,)


def shebang(path: str) -> list[str] | None:
    """The words of path's `#!` line; None where it has none or cannot be read."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(SHEBANG_BYTES)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").split()
    return words or None


def isolates(path: str) -> bool:
    """The shebang runs Python with -I (alone or among other one-letter flags: -sI, -IS)."""
    words = shebang(path) or []
    return any(w.startswith("-") and not w.startswith("--") and "I" in w for w in words[1:])
