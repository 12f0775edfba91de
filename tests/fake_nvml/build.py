"""Build the stand-in NVIDIA driver library (libnvidia-ml.so.1) from fake_nvml.c.

Use from Python: ``build_fake_nvml(out_dir)`` returns ``out_dir/libnvidia-ml.so.1``;
or from a shell: ``python3 tests/fake_nvml/build.py OUTDIR``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("fake_nvml.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
CFLAGS = ["-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-fvisibility=hidden"]


class BuildError(RuntimeError):
    """The library could not be built (no compiler, or the compiler failed)."""


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile fake_nvml.c into out_dir/libnvidia-ml.so.1, unless it is already newer."""
    out_dir = Path(out_dir)
    target = out_dir / LIBRARY_NAME
    if target.exists() and target.stat().st_mtime >= SOURCE.stat().st_mtime:
        return target
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError(f"gcc not found on PATH: cannot build {LIBRARY_NAME} from {SOURCE}")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile next to the target and rename, so a concurrent loader never sees half a file.
    fd, tmp_name = tempfile.mkstemp(prefix=".libnvidia-ml.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        result = subprocess.run(
            [gcc, *CFLAGS, "-o", str(tmp), str(SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise BuildError(
                f"gcc failed ({result.returncode}) building {SOURCE}:\n{result.stderr}"
            )
        tmp.chmod(0o755)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUTDIR", file=sys.stderr)
        return 2
    try:
        print(build_fake_nvml(Path(argv[1])))
    except BuildError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
