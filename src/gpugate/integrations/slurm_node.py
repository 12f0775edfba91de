"""What a Slurm node's own configuration gives a job (`gpugate slurm check`): a private
/dev/shm from job_container/tmpfs, and gres.conf's GPUs as NVML's.

job_container/tmpfs (slurm.conf `JobContainerType=job_container/tmpfs`) mounts a private
/tmp and /dev/shm for each job in 22.05; from 23.02 the dirs are job_container.conf's `Dirs=`
(default `/tmp,/dev/shm`). Both files are root's, read as gres.conf is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpugate.integrations.gres_conf import read_root_file

TMPFS = "job_container/tmpfs"
JOB_CONTAINER_CONF = "job_container.conf"
DEFAULT_DIRS = "/tmp,/dev/shm"  # read_jcconf.h SLURM_TMPFS_DEF_DIRS
MAX_CONF_BYTES = 1 << 20
SHM = "/dev/shm"


@dataclass(frozen=True)
class ShmPrivacy:
    plugin: str  # slurm.conf's JobContainerType, "" where unset
    dirs: str  # job_container.conf's Dirs (or the default)

    @property
    def private(self) -> bool:
        return self.plugin == TMPFS and SHM in [d.strip().rstrip("/") for d in self.dirs.split(",")]


def last_value(text: str, key: str) -> str:
    """The last `KEY=VALUE` of a Slurm config file (keys in any case, comments dropped)."""
    found = ""
    pattern = re.compile(rf"(?:^|\s){key}=(\"[^\"]*\"|\S+)", re.IGNORECASE)
    for raw in text.splitlines():
        for match in pattern.finditer(raw.split("#", 1)[0]):
            found = match.group(1).strip('"')
    return found


def shm_privacy(slurm_conf: Path) -> ShmPrivacy:
    plugin = last_value(read_root_file(slurm_conf, MAX_CONF_BYTES), "JobContainerType")
    if plugin != TMPFS:
        return ShmPrivacy(plugin, "")
    path = slurm_conf.parent / JOB_CONTAINER_CONF
    dirs = last_value(read_root_file(path, MAX_CONF_BYTES), "Dirs") if path.exists() else ""
    return ShmPrivacy(plugin, dirs or DEFAULT_DIRS)
