"""`gpugate slurm prolog|epilog` (slurm.conf's Prolog=/Epilog=, run by slurmd as root): the
job's GPUs are slurmd's numbers (integrations.gres_conf), its cgroup stands for the unit's, and
a non-zero exit drains the node with a reason naming what holds which GPU (docs/slurm.md);
`gpugate slurm check`: whether each job gets a private /dev/shm and gres.conf resolves every GPU
to an NVML GPU (exit 78 where not)."""

from __future__ import annotations

import contextlib
import functools
import re
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple, TextIO

from gpugate.config.file import DEFAULT_CONFIG_DIR, LoadedConfig, replaced
from gpugate.config.values import GpuRef, parse_gpu_text
from gpugate.core.discover import Discovery
from gpugate.core.outcome import UNKILLABLE, Blocker, PlainWorkload, RunSummary
from gpugate.core.run import RunScope
from gpugate.errors import BadInput, ExitCode, GateError, GresUnresolved, InvalidValue
from gpugate.front.hook import (
    Hook,
    HostAccess,
    parse_uid,
    run_hook,
    set_drain_reason,
    stopped_by_signals,
)
from gpugate.host.nvml import GpuDriver
from gpugate.host.systemd import HostRoots
from gpugate.integrations.config_files import CACHE_NAME, load_config
from gpugate.integrations.gres_conf import (
    DEFAULT_SLURM_CONF,
    DeviceNodes,
    gpu_order,
    gres_conf_path,
    in_slurm_conf_order,
    job_gpus,
    parse_gres_conf,
    read_root_file,
    shard_minors,
    shm_privacy,
    slices_by_unique_id,
)
from gpugate.phase import Phase
from gpugate.report import lines
from gpugate.report.journal import Event
from gpugate.untrusted import CGROUP, REASON, Kind, for_error, printable

JOB_SCOPE = "slurmstepd.scope"  # where Slurm's cgroup/v2 plugin puts every job
METRICS_UNIT = "slurm"  # one label for all jobs: a job ID label would grow without bound
CONFIG_NAME = "slurm.toml"
JOB_ID = re.compile(r"[1-9][0-9]{0,9}")
MAX_JOB_ID = 2**32 - 1
# The prolog/epilog see SLURM_JOB_GPUS, an srun task SLURM_STEP_GPUS. Not CUDA_VISIBLE_DEVICES:
# in a task it is the task's own numbering, and alone it is not slurmd's.
GPU_VARIABLES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
NO_DEVICE_FILES = "NoDevFiles"  # Slurm before 15.08, for a gres without device files
MAX_VISIBLE_CHARS = 8192  # 64 slices' unique IDs with room to spare


class SlurmJob(NamedTuple):
    job_id: int
    uid: int | None
    gpus: tuple[int, ...]  # slurmd's numbers (gres.conf's order); () where it has no GPU here
    gpus_from: str  # the variable they came from
    node_name: str | None  # SLURMD_NODENAME: Slurm's name for this node
    no_gpus: str = ""  # the value that said "no GPU" (NoDevFiles, an empty list): said once
    visible: tuple[str, ...] = ()  # the hooks' CUDA_VISIBLE_DEVICES: a MIG slice's unique ID

    @property
    def label(self) -> str:
        """Stands for the unit in reports: GPUGATE_UNIT, stderr lines, decision reasons."""
        return f"slurm-job-{self.job_id}"


def job_from_env(environ: Mapping[str, str]) -> SlurmJob:
    raw_id = environ.get("SLURM_JOB_ID", "")
    if not JOB_ID.fullmatch(raw_id) or int(raw_id) > MAX_JOB_ID:
        raise BadInput(
            f"SLURM_JOB_ID {(for_error(raw_id) if raw_id else 'not set')}: not a Slurm job ID (a "
            "positive integer)"
        )
    raw_uid = environ.get("SLURM_JOB_UID")
    uid = None if raw_uid is None else parse_uid(raw_uid)
    if raw_uid is not None and uid is None:
        raise BadInput(f"SLURM_JOB_UID {raw_uid!r}: not a user ID")
    gpus: tuple[int, ...] = ()
    source = next((name for name in GPU_VARIABLES if environ.get(name, "").strip()), "")
    said = "" if source else next((f"{n}=" for n in GPU_VARIABLES if n in environ), "")
    if source and environ[source].strip() == NO_DEVICE_FILES:
        said = f"{source}={NO_DEVICE_FILES}"
    elif source:
        gpus = gpu_numbers(source, environ[source])
    # slurmd writes it beside SLURM_JOB_GPUS: one entry per number, the number or a unique ID
    visible = environ.get("CUDA_VISIBLE_DEVICES", "") if source == GPU_VARIABLES[0] else ""
    if len(visible) > MAX_VISIBLE_CHARS:
        visible = ""
    return SlurmJob(
        job_id=int(raw_id),
        uid=uid,
        gpus=gpus,
        gpus_from=source,
        node_name=environ.get("SLURMD_NODENAME") or None,
        no_gpus=said,
        visible=tuple(v.strip() for v in visible.split(",")) if visible else (),
    )


def gpu_numbers(variable: str, value: str) -> tuple[int, ...]:
    """slurmd's numbers: `0,1,5`, each once (a UUID or a range is none of slurmd's)."""
    try:
        refs = parse_gpu_text(value)
    except InvalidValue as exc:
        raise BadInput(f"{variable} {for_error(value)}: {exc}") from None
    for ref in refs:
        if isinstance(ref, str):
            raise BadInput(
                f"{variable} {for_error(value)}: {for_error(ref)} is not a GPU number slurmd "
                "writes (0, 1, ... as gres.conf lists them)"
            )
    return tuple(ref for ref in refs if isinstance(ref, int))


def job_cgroup(job_id: int, cgroup_root: Path, node_name: str | None = None) -> str:
    """The job's cgroup (cgroup v2). slurmd creates it after the prolog and removes it before
    the epilog; then the path it would have stands for it, and matches no process. Under
    `slurmstepd.scope`, or `NODE_slurmstepd.scope` (Debian builds Slurm with multiple-slurmd
    support, and the scope carries the node's name)."""
    name = f"job_{job_id}"
    scopes = [
        scope
        for parent in [cgroup_root, *sorted(cgroup_root.glob("*.slice"))]
        for scope in sorted(parent.glob(f"*{JOB_SCOPE}"))
        if scope.name == JOB_SCOPE or scope.name.endswith("_" + JOB_SCOPE)
    ]
    there = [scope for scope in scopes if (scope / name).is_dir()]
    wanted = [f"{node_name}_{JOB_SCOPE}", JOB_SCOPE] if node_name else [JOB_SCOPE]
    preferred = [scope for want in wanted for scope in scopes if scope.name == want]
    for scope in (there or preferred or scopes)[:1]:
        return "/" + str((scope / name).relative_to(cgroup_root))
    return f"/system.slice/{JOB_SCOPE}/{name}"


def load_slurm_config(
    explicit: Path | None, config_dir: Path = DEFAULT_CONFIG_DIR, *, cache: Path | None = None
) -> LoadedConfig:
    """--config PATH, else /etc/gpugate/slurm.toml, else default.toml, else built-in."""
    if explicit is None and (config_dir / CONFIG_NAME).exists():
        explicit = config_dir / CONFIG_NAME
    return load_config(None, explicit, config_dir, cache=cache)


def with_job_gpus(loaded: LoadedConfig, gpus: tuple[GpuRef, ...], note: str) -> LoadedConfig:
    """The config with the job's GPUs: their UUIDs, or () (the job's cgroup only)."""
    return LoadedConfig(replaced(loaded.config, gpus=gpus), f"{loaded.source} ({note})")


class JobWorkload(PlainWorkload):
    """A Slurm job as the workload of its prolog or epilog. Slurm gives out the GPUs and
    drains a failed node itself, so no lease is checked or taken. A GPU that carries
    gres/shard is shared by every job on it (docs/slurm.md)."""

    __slots__ = ("shard_minors",)

    def __init__(self, loaded: LoadedConfig, shard_minors: frozenset[int]) -> None:
        """loaded: the config with the job's GPUs (job_config's); shard_minors: the device
        numbers of those that carry gres/shard."""
        super().__init__(loaded, f"gpus in {loaded.source}")
        self.shard_minors = shard_minors

    def shared_gpus(self, discovery: Discovery) -> frozenset[int]:
        return frozenset(gpu.index for gpu in discovery.owned if gpu.minor in self.shard_minors)


MAX_REASON_HOLDERS = 3  # processes a drain reason names
SLURM_JOB_CGROUP = re.compile(r"slurmstepd\.scope/job_([0-9]{1,10})(?:/|$)")
HELD_RULES = {
    "protected": "protected (protected_executables/protected_units)",
    "orphan": "an orphan gpugate may not kill here",
    "other-account": "another account's",
    "watcher": "a watcher",
}


def slurm(
    front: HostAccess, phase: Phase, config_path: Path | None, *, dry_run: bool = False
) -> int:
    with stopped_by_signals():
        roots = front.host_roots()
        job: SlurmJob | None = None
        result: RunSummary | GateError
        try:
            job = job_from_env(front.environ)
            fields = {"GPUGATE_SLURM_JOB": str(job.job_id), "OBJECT_SYSTEMD_UNIT": JOB_SCOPE}
            if job.uid is not None:
                fields["GPUGATE_SLURM_JOB_UID"] = str(job.uid)
            reporter = front.reporter_factory(job.label, phase.value, fields=fields)
            if not job.gpus:
                if job.no_gpus:  # Slurm's own words for "no GPU here"
                    said = f"no GPUs to gate ({job.no_gpus})"
                    reporter.event(Event.RUN_FINISHED, said, result="success")
                return int(ExitCode.OK)  # a CPU job, or a node without GPUs: not gpugate's
            config = load_slurm_config(config_path, cache=roots.run / CACHE_NAME)
            loaded, driver_factory, shards = job_config(config, job, front, roots)
        except GateError as exc:
            print(lines.error(exc.message), file=sys.stderr)
            result = exc
        else:
            locate = functools.partial(job_cgroup, job.job_id, roots.cgroup, job.node_name)
            scope = RunScope(phase, job.label, locate, None, dry_run, roots, driver_factory)
            hook = Hook(scope, lambda _, got, _r: JobWorkload(got, shards), reporter, METRICS_UNIT)
            result = run_hook(hook, loaded)
        code = result.exit_code
        if dry_run or code in (ExitCode.OK, ExitCode.INTERRUPTED):  # slurmd stopped it: drains
            return int(code)
        detail = result.message if isinstance(result, GateError) else failure_detail(result)
        reason = drain_reason(phase.value, job.job_id if job else None, detail, int(code))
        if isinstance(result, RunSummary):  # an error said it already
            print(lines.error(f"drain: {reason}"), file=sys.stderr, flush=True)
        node = front.environ.get("SLURMD_NODENAME")
        if node:
            set_drain_reason(node, reason, sys.stderr)
        return int(code)


def job_config(
    config: LoadedConfig, job: SlurmJob, front: HostAccess, roots: HostRoots
) -> tuple[LoadedConfig, Callable[[], GpuDriver], frozenset[int]]:
    """The config with the job's GPUs as NVML's UUIDs, the driver opened, and the minors of
    the GPUs that carry shards; numbers not resolved for certain: no GPU, the job's cgroup
    alone."""
    driver: GpuDriver | None = None
    given = f"{job.gpus_from}={','.join(map(str, job.gpus))}"
    slurm_conf = front.environ.get("SLURM_CONF")
    where = Path(slurm_conf or DEFAULT_SLURM_CONF)
    nodes = DeviceNodes(roots.dev, front.device_stat, roots.proc)
    try:
        path = gres_conf_path(slurm_conf)
        driver = front.driver_factory()
        every = driver.gpus()
        # slurmd named each slice by its MIG UUID: that is certain without gres.conf
        slices = slices_by_unique_id(job.gpus, job.visible, every, job.gpus_from)
        try:
            layout = parse_gres_conf(read_root_file(path), str(path), job.node_name)
            layout = in_slurm_conf_order(layout, where, job.node_name)
        except GresUnresolved:
            if slices is None:
                raise
            layout = None
        gpus = slices or ()
        shards: frozenset[int] = frozenset()
        if layout is not None:
            if slices is None:
                gpus = job_gpus(job.gpus, layout, every, nodes, len(driver.faults()))
            shards = shard_minors(layout, every, nodes, where, job.node_name)
    except (GresUnresolved, GateError) as exc:
        if driver is not None:
            driver.close()
        print(
            lines.warning(
                f"{given}: slurmd's GPU numbers not resolved ({exc}); "
                "only the job's own cgroup is cleaned, nothing outside it is killed"
            ),
            file=sys.stderr,
        )
        unresolved = f"{given} not resolved: the job's cgroup only"
        return with_job_gpus(config, (), unresolved), front.driver_factory, frozenset()
    opened = driver
    uuids = tuple(gpu.uuid for gpu in gpus)
    through = str(path) if slices is None else "CUDA_VISIBLE_DEVICES's MIG unique IDs"
    loaded = with_job_gpus(config, uuids, f"gpus from {given} through {through}")
    return loaded, lambda: opened, shards


def failure_detail(summary: RunSummary) -> str:
    """A drain reason's detail: each process that kept a GPU, each GPU still used."""
    parts = []
    for item in summary.held[:MAX_REASON_HOLDERS]:
        gpus = f" on GPU {','.join(map(str, item.gpus))}" if item.gpus else ""
        parts.append(f"PID {item.pid} ({item.user or '?'}){gpus}: {held_rule(item)}")
    if len(summary.held) > MAX_REASON_HOLDERS:
        parts.append(f"{len(summary.held) - MAX_REASON_HOLDERS} more PID(s)")
    for busy in summary.busy:
        pids = ", ".join(map(str, busy.pids[:MAX_REASON_HOLDERS]))
        listed = f", NVML lists PID {pids}" if pids else ""
        parts.append(
            f"GPU {busy.gpu.shown} ({busy.gpu.uuid}) still {busy.used_mib} MiB used: "
            f"memory not freed{listed}"
        )
    if parts:
        return "; ".join(parts)
    gpus = ",".join(str(gpu.index) for gpu in summary.owned) or "none"
    return f"GPU {gpus}: {summary.exit_code.name.lower()}"


def held_rule(item: Blocker) -> str:
    """The rule in an admin's words: why gpugate left the process alive."""
    rule = item.rule
    if rule == UNKILLABLE:
        return "unkillable (survived SIGKILL)"
    if rule == "straddles":
        return f"straddles GPU {','.join(map(str, item.foreign))}, not this job's"
    if rule in ("other-unit", "other-container"):
        job = SLURM_JOB_CGROUP.search(item.cgroup or "")
        if job:
            return f"in another job ({job.group(1)})"
        return f"in another unit ({printable(item.other or item.cgroup, CGROUP)})"
    return HELD_RULES.get(rule, rule)


def drain_reason(phase: str, job_id: int | None, detail: str, code: int) -> str:
    """A failed prolog's or epilog's reason for `scontrol update State=DRAIN`: escaped, no
    double quote (scontrol strips one at either end), at most REASON.chars; the exit code
    stays whole where the detail is cut."""
    who = f" job {job_id}" if job_id is not None else ""
    head, tail = f"gpugate {phase}{who}: ", f" (exit {code})"
    room = REASON.chars - len(head) - len(tail)
    return head + printable(detail.replace('"', "'"), Kind(room, room)) + tail


def slurm_check(
    environ: Mapping[str, str],
    node: str | None,
    driver_factory: Callable[[], GpuDriver],
    nodes: DeviceNodes,
    stream: TextIO | None = None,
) -> int:
    out = stream or sys.stdout
    node = node or environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    slurm_conf = environ.get("SLURM_CONF") or DEFAULT_SLURM_CONF
    try:
        gres_conf_path(slurm_conf)  # SLURM_CONF an absolute path, or GresUnresolved
        print(shm_line(*shm_privacy(Path(slurm_conf))), file=out)
    except GresUnresolved as exc:
        print(f"/dev/shm: not known ({exc})", file=out)
    try:
        path = gres_conf_path(slurm_conf)
        layout = parse_gres_conf(read_root_file(path), str(path), node)
        layout = in_slurm_conf_order(layout, Path(slurm_conf), node)
        with contextlib.closing(driver_factory()) as driver:
            gpus, faults = list(driver.gpus()), list(driver.faults())
        ordered = gpu_order(layout, gpus, nodes, len(layout.files), len(faults))
        shards = shard_minors(layout, gpus, nodes, Path(slurm_conf), node)
    except GresUnresolved as exc:
        print(
            f"GPUs of node {node}: slurmd's numbers not resolved ({exc}); the hooks clean only "
            "a job's own cgroup",
            file=out,
        )
        return int(ExitCode.CONFIG)
    except GateError as exc:
        print(lines.error(exc.message), file=sys.stderr)
        return int(exc.exit_code)
    order = "AutoDetect=nvml: NVML's order" if layout.nvml_order else "File= order"
    print(f"GPUs of node {node}, as slurmd numbers them ({layout.path}, {order}):", file=out)
    shared = ""
    if layout.shards is not None:
        shared = f", shared: carries gres/shard ({layout.path} line {layout.shards.line})"
    for number, gpu in enumerate(ordered):
        where = "" if layout.nvml_order else f" {layout.files[number]} ="
        print(f"  {number} ={where} {gpu.label}{shared if gpu.minor in shards else ''}", file=out)
    return int(ExitCode.OK)


def shm_line(plugin: str, dirs: str, private: bool) -> str:
    if private:
        return f"/dev/shm: private to each job (JobContainerType={plugin}, Dirs={dirs})"
    setting = f"JobContainerType={plugin}, Dirs={dirs or '-'}" if plugin else "no JobContainerType"
    advice = "" if plugin else ": JobContainerType=job_container/tmpfs gives each job its own"
    return (
        f"/dev/shm: shared by the node's jobs ({setting}); gpugate removes only the segments "
        f"of processes it killed{advice}"
    )
