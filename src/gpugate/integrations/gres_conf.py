"""A Slurm node's configuration: gres.conf's GPUs in slurmd's order, as NVML's GPUs, and a
job's private /dev/shm; root's files, read capped; GresUnresolved where not certain
(docs/slurm.md has slurmd's rules)."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from gpugate.errors import GresUnresolved, Refused
from gpugate.host.nvml import Gpu, slice_capabilities
from gpugate.host.safe_files import kind_of, read_trusted
from gpugate.untrusted import for_error

GRES_NAME = "gres.conf"
DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"
MAX_GRES_BYTES = 256 * 1024  # a gres.conf is a few lines; thousands of nodes fit in this
MAX_FILES = 1024  # device files one hostlist may name (a node has at most a few dozen GPUs)
GPU = "gpu"
SHARD = "shard"
MULTIPLE = ","  # a MultipleFiles record's files, joined as slurmd keeps them
# Slurm's config parser: KEY=VALUE, the value bare or in double quotes; keys in any case.
PAIR = re.compile(r'([A-Za-z]+)=("[^"]*"|[^\s"]+)')
RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
KNOWN_AUTODETECT = {"nvml", "off"}
BINDINGS = {"cores", "cpus", "links", "link"}  # what AutoDetect checks against NVML's
NVIDIA_MAJOR = 195  # the driver's character devices /dev/nvidia0..N (nvidiactl is 195:255)
GPU_NODE = re.compile(r"nvidia([0-9]{1,4})")
CAP_NODE = re.compile(r"nvidia-cap([0-9]{1,6})")  # a MIG capability device

StatFn = Callable[[str], os.stat_result]
Known = dict[tuple[bool, int], int]  # (is a character device, st_rdev) -> M of /dev/nvidiaM
TMPFS = "job_container/tmpfs"
JOB_CONTAINER_CONF = "job_container.conf"
DEFAULT_DIRS = "/tmp,/dev/shm"  # read_jcconf.h SLURM_TMPFS_DEF_DIRS
MAX_CONF_BYTES = 1 << 20
SHM = "/dev/shm"


class GpuLayout(NamedTuple):
    """This node's gres/gpu as slurmd numbers it."""

    path: str  # the gres.conf read
    files: tuple[str, ...]  # the GPUs' device files, in slurmd's order (AutoDetect: the filter)
    nvml_order: bool  # AutoDetect=nvml: slurmd orders the GPUs as NVML enumerates them
    shards: Shards | None = None  # gres/shard: which GPUs carry shards (None: none do)
    types: tuple[str, ...] = ()  # each file's line's Type= (lowercased, "" for none)
    # AutoDetect=nvml: slurm.conf's Gres= for the node, (type or "", count) each; None: unread
    given: tuple[tuple[str, int], ...] | None = None


class Shards(NamedTuple):
    """gres.conf's gres/shard for this node, as gres_c_s.c spreads it over the GPU files."""

    line: int  # the first Name=shard line
    files: tuple[str, ...]  # the GPU files given shards (File= with Count >= its files)
    every_gpu: bool  # a Name=shard line without File=: Count spread over every GPU
    fileless_count: int  # that line's Count


def gres_conf_path(slurm_conf: str | None) -> Path:
    """gres.conf beside slurm.conf, as slurmd finds it (get_extra_conf_path): slurmd puts
    SLURM_CONF in the prolog's and epilog's environment; without it, /etc/slurm."""
    conf = slurm_conf or DEFAULT_SLURM_CONF
    if not os.path.isabs(conf) or "\n" in conf or len(conf) > 4096:
        raise GresUnresolved(f"SLURM_CONF {for_error(conf)}: not an absolute path")
    return Path(os.path.dirname(conf)) / GRES_NAME


def read_root_file(path: Path, limit: int = MAX_GRES_BYTES) -> str:
    """A file of Slurm's, root's (safe_files.read_trusted), else GresUnresolved."""
    try:
        return read_trusted(path, limit)
    except Refused as exc:
        raise GresUnresolved(f"{path}: {exc}") from None


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) per line, a trailing backslash joining the next; no comments."""
    found: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate([*text.splitlines(), ""], 1):  # "": the last one ends
        body = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = number
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        joined = (pending + body).strip()
        pending = ""
        if joined:
            found.append((start, joined))
    return found


def pairs(number: int, text: str, path: str) -> list[tuple[str, str]]:
    """KEY=VALUE pairs of one line, keys lowercased; anything else is not read for certain."""
    rest = PAIR.sub("", text).strip()
    if rest:
        raise _uncertain(path, number, rest)
    return [(key.lower(), value.strip('"')) for key, value in PAIR.findall(text)]


def _uncertain(path: str, number: int, text: str) -> GresUnresolved:
    return GresUnresolved(f"{path} line {number}: {for_error(text)} not read for certain")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist, in the order written: `a[0-3,6]b,c`; ValueError where it is a form
    this reader does not know (two bracket groups, a descending range)."""
    names: list[str] = []
    items = re.split(r",(?![^\[]*\])", text)  # commas outside brackets
    if not all(items):
        raise ValueError(text)
    for item in items:
        if "[" not in item and "]" not in item:
            names.append(item)
            continue
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
        if match is None:
            raise ValueError(item)
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            bounds = RANGE.fullmatch(part.strip())
            if bounds is None:
                raise ValueError(part)
            low_text, high_text = bounds.group(1), bounds.group(2) or bounds.group(1)
            low, high = int(low_text), int(high_text)
            if high < low or high - low >= MAX_FILES:
                raise ValueError(part)
            width = len(low_text) if low_text.startswith("0") and len(low_text) > 1 else 0
            names.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(low, high + 1))
        if len(names) > MAX_FILES:
            raise ValueError(item)
    return names


Lines = list[tuple[int, dict[str, str]]]  # (line number, its keys)


def _node_lines(text: str, path: str, node: str | None) -> tuple[Lines, str]:
    """The Name= lines for this node (the general ones first), and its AutoDetect."""
    general: Lines = []
    for_node: Lines = []
    every = local = ""  # AutoDetect= alone on a line, and on the node's
    for number, line_text in logical_lines(text):
        items = pairs(number, line_text, path)
        first, keys = (items[0][0], dict(items)) if items else ("", {})
        if first == "autodetect" and len(items) == 1:
            every = keys["autodetect"].lower()
        elif first == "nodename":
            try:
                nodes = expand_hostlist(items[0][1])
            except ValueError:
                raise _uncertain(path, number, f"NodeName={items[0][1]}") from None
            if node is None:
                raise GresUnresolved(
                    f"{path} line {number}: NodeName= lines, and slurmd named no node "
                    "(SLURMD_NODENAME)"
                )
            if node in nodes:
                local = keys.get("autodetect", local).lower()
                if "name" in keys:
                    for_node.append((number, keys))
        elif first == "name":
            general.append((number, keys))
        elif first:
            raise _uncertain(path, number, "Include" if first == "include" else first)
    return general + for_node, local or every or "off"


def parse_gres_conf(text: str, path: str, node: str | None) -> GpuLayout:
    """This node's gres/gpu in slurmd's order. node: slurmd's name for it (SLURMD_NODENAME)."""
    lines, autodetect = _node_lines(text, path, node)
    if autodetect not in KNOWN_AUTODETECT:
        raise GresUnresolved(
            f"{path}: AutoDetect={for_error(autodetect)}: slurmd's GPU order is not knowable here"
        )
    files, types, fileless = _gpu_files(path, lines)
    shards = _shard_files(path, lines)
    nvml = autodetect == "nvml"
    # AutoDetect matches a line without File= to detected GPUs by Type and Count, in an
    # order of its own: which GPUs it took is not knowable from here.
    if nvml and fileless:
        raise GresUnresolved(
            f"{path}: AutoDetect=nvml with a Name=gpu line without File=: which GPUs slurmd "
            "matched to it is not knowable here"
        )
    bound = next((n for n, keys in lines if keys.get("name") == GPU and BINDINGS & set(keys)), 0)
    if nvml and bound:  # _merge_system_gres_conf: "mismatching Cores or Links ... Ignoring it"
        raise GresUnresolved(
            f"{path} line {bound}: AutoDetect=nvml with Cores=/Links= on a GPU line: slurmd "
            "drops a GPU whose detected cores or links differ, which gpugate cannot compare"
        )
    if not nvml and not files:
        named = for_error(node) if node else "(unnamed)"
        raise GresUnresolved(f"{path}: no Name=gpu File= line for node {named}")
    return GpuLayout(path, tuple(files), nvml_order=nvml, shards=shards, types=tuple(types))


COUNT = re.compile(r"([0-9]{1,12})(?:([KMGTP])(IB|B)?)?", re.IGNORECASE)


def _count(path: str, number: int, text: str) -> int:
    """A Count=, with slurmd's suffixes (suffix_mult: K or KiB 1024, KB 1000, ... to P)."""
    match = COUNT.fullmatch(text)
    if match is None:
        raise _uncertain(path, number, f"Count={text}")
    digits, unit, kind = match.groups()
    if unit is None:
        return int(digits)
    base = 1000 if (kind or "").upper() == "B" else 1024
    return int(digits) * int(base ** ("KMGTP".index(unit.upper()) + 1))


def _shard_files(path: str, lines: Lines) -> Shards | None:
    """Which GPU files carry shards (gres_c_s.c, 22.05: a shard record without File= spreads
    its Count over every gres/gpu file; with File=, Count / its files each, 0 where fewer)."""
    files: list[str] = []
    first = every = 0
    for number, keys in lines:
        if keys.get("name") != SHARD:
            continue
        count = _count(path, number, keys.get("count", "1"))
        if count <= 0:
            continue
        first = first or number
        if "file" not in keys:
            every = count
            continue
        try:
            named = expand_hostlist(keys["file"])
        except ValueError:
            raise _uncertain(path, number, f"File={keys['file']}") from None
        if count >= len(named):
            files.extend(named)
    return Shards(first, tuple(files), bool(every), every) if every or files else None


def _gpu_files(path: str, lines: Lines) -> tuple[list[str], list[str], bool]:
    """The Name=gpu lines' files in gres.conf's order, each one's line's Type (lowercased;
    "" for none), and whether a line without File= names a Type= or Count= (what AutoDetect
    matches by). `Files=` is slurmd's other spelling of `File=`."""
    files: list[str] = []
    types: list[str] = []
    fileless = False
    for number, keys in lines:
        if keys.get("name") != GPU:
            continue
        written = keys.get("file", keys.get("files"))
        several = keys.get("multiplefiles")
        if written is None and several is None:
            fileless = fileless or "count" in keys or "type" in keys
            continue
        try:
            named = expand_hostlist(written or several or "")
        except ValueError:
            raise _uncertain(path, number, f"File={written or several}") from None
        if written is not None and several is not None:  # slurmd: fatal
            raise _uncertain(path, number, "File and MultipleFiles")
        if several is not None:  # one GPU (a MIG slice) of several files: one number
            named = [MULTIPLE.join(named)]
        files += named
        types += [keys.get("type", "").lower()] * len(named)
    names = [name for name in files if MULTIPLE not in name]
    if len(set(names)) != len(names):  # slurmd refuses to start ("duplicate device file name")
        twice = next(name for name in names if names.count(name) > 1)
        raise GresUnresolved(f"{path}: File {for_error(twice)} listed twice")
    return files, types, fileless


class DeviceNodes(NamedTuple):
    """This host's /dev/nvidiaM nodes (dev: the device root; stat: a test's stand-in)."""

    dev: Path = Path("/dev")
    stat: StatFn = os.stat
    proc: Path = Path("/proc")  # its driver/nvidia/capabilities name each slice's devices

    def by_number(self, caps: bool = False) -> Known:
        """(is a character device, st_rdev) -> M, for each /dev/nvidiaM that is a node (caps:
        -> K, for each /dev/nvidia-caps/nvidia-capK)."""
        folder = self.dev / "nvidia-caps" if caps else self.dev
        names, major = (CAP_NODE, None) if caps else (GPU_NODE, NVIDIA_MAJOR)
        found: Known = {}
        try:
            listed = os.listdir(folder)
        except OSError:
            return found
        for name in listed:
            match = names.fullmatch(name)
            if match is None:
                continue
            try:
                info = self.stat(str(folder / name))
            except OSError:
                continue
            minor, is_char = int(match.group(1)), stat.S_ISCHR(info.st_mode)
            driver_made = major is None or os.major(info.st_rdev) == major
            if is_char and driver_made:
                if os.minor(info.st_rdev) == minor:  # else not the node the driver made
                    found[(True, info.st_rdev)] = minor
            elif is_char or stat.S_ISBLK(info.st_mode):  # a stand-in of another number
                found[(is_char, info.st_rdev)] = minor
        return found

    def file_path(self, file: str) -> str:
        """A gres.conf File under this device root (the real /dev: as written)."""
        if self.dev == Path("/dev") or not file.startswith("/dev/"):
            return file
        return str(self.dev / file[len("/dev/") :])


def minor_of(file: str, nodes: DeviceNodes, known: Known, path: str) -> int:
    """M of the /dev/nvidiaM that File is (followed as slurmd's stat follows it)."""
    try:
        info = nodes.stat(nodes.file_path(file))
    except OSError as exc:
        why = f"({exc.strerror or exc})"
    else:
        is_char = stat.S_ISCHR(info.st_mode)
        minor = known.get((is_char, info.st_rdev))
        if not (is_char or stat.S_ISBLK(info.st_mode)):
            why = f"(a {kind_of(info.st_mode)} file)"
        elif minor is None:
            why = f"(device {os.major(info.st_rdev)}:{os.minor(info.st_rdev)} is no /dev/nvidiaN)"
        else:
            return minor
    raise GresUnresolved(f"{path}: File {for_error(file)} is no GPU device node {why}")


def gpu_order(
    layout: GpuLayout, gpus: Sequence[Gpu], nodes: DeviceNodes, count: int, unreadable: int = 0
) -> list[Gpu]:
    """The node's GPUs in slurmd's order, the first `count` of them at least (each device
    file before them must be a GPU: slurmd skips one it cannot stat, and numbers the rest
    one lower). unreadable: GPUs NVML counts but cannot read (NVML's order has gaps)."""
    known = nodes.by_number()
    whole = [gpu for gpu in gpus if gpu.mig is None]  # a slice shares its GPU's minor
    by_minor = {gpu.minor: gpu for gpu in whole}
    if layout.nvml_order:
        if unreadable:
            raise GresUnresolved(
                f"{layout.path}: AutoDetect=nvml, and NVML cannot read {unreadable} GPU(s): "
                "slurmd's order has gaps gpugate cannot place"
            )
        ordered = sorted(whole, key=lambda gpu: gpu.index)
        if layout.files:
            minors = {minor_of(file, nodes, known, layout.path) for file in layout.files}
            ordered = [gpu for gpu in ordered if gpu.minor in minors]
        ordered = _given_by_slurm_conf(layout, ordered, nodes, known)
        in_mig = next((gpu for gpu in ordered if gpu.mig_mode), None)
        if in_mig is not None:
            raise GresUnresolved(
                f"{layout.path}: AutoDetect=nvml, and GPU {in_mig.index} is in MIG mode: "
                "slurmd numbers its MIG slices, not the GPU, in an order that rests on its "
                "version and on qsort's order of equal keys (gres_gpu.c "
                "_sort_gpu_by_links_order); a job's slices are taken from the MIG UUIDs "
                "slurmd writes into its CUDA_VISIBLE_DEVICES"
            )
        return ordered
    found: list[Gpu] = []
    for file in layout.files[:count]:
        if MULTIPLE in file:
            found.append(_slice_of_files(file, gpus, nodes, known, layout.path))
            continue
        minor = minor_of(file, nodes, known, layout.path)
        gpu = by_minor.get(minor)
        if gpu is None:
            raise GresUnresolved(
                f"{layout.path}: File {for_error(file)} is /dev/nvidia{minor}, and NVML lists no "
                f"GPU with minor number {minor}"
            )
        if gpu.mig_mode:
            raise GresUnresolved(
                f"{layout.path}: File {for_error(file)} is GPU {gpu.index}, which is in MIG mode: "
                "a whole-GPU number would take every slice's processes, other jobs' too"
            )
        found.append(gpu)
    return found


def _given_by_slurm_conf(
    layout: GpuLayout, ordered: list[Gpu], nodes: DeviceNodes, known: Known
) -> list[Gpu]:
    """The detected GPUs slurm.conf's count gives the node (`_merge_system_gres_conf`: each
    of its Count records takes the first unmatched GPU by file name; gres.conf's File= cut at
    the count), in NVML's order. Typed: each GPU's NVML name must hold exactly one of the
    types (slurmd matches by that) and each type's count cover its GPUs."""
    if layout.given is None:
        return ordered
    given = dict(layout.given)
    if "" in given:
        count = given[""]
        if count >= len(ordered):
            return ordered
        if layout.files:
            kept = {minor_of(file, nodes, known, layout.path) for file in layout.files[:count]}
        else:
            kept = {gpu.minor for gpu in sorted(ordered, key=lambda gpu: gpu.minor)[:count]}
        return [gpu for gpu in ordered if gpu.minor in kept]
    per_type: dict[str, int] = {}
    for gpu in ordered:
        name = gpu.name.lower().replace(" ", "_")
        kinds = [kind for kind in given if kind in name]
        if len(kinds) != 1 or (layout.files and set(layout.types) - {kinds[0]}):
            raise GresUnresolved(
                f"{layout.path}: AutoDetect=nvml, and GPU {gpu.index} ({for_error(gpu.name)}) is "
                f"not of exactly one Gres= type ({', '.join(map(for_error, given))}) for certain"
            )
        per_type[kinds[0]] = per_type.get(kinds[0], 0) + 1
    short = [kind for kind, found in per_type.items() if found > given[kind]]
    if short:
        raise GresUnresolved(
            f"{layout.path}: AutoDetect=nvml finds more {for_error(short[0])} GPUs than Gres= "
            "gives the node: which slurmd takes is not knowable here"
        )
    return ordered


def _slice_of_files(
    record: str, gpus: Sequence[Gpu], nodes: DeviceNodes, known: Known, path: str
) -> Gpu:
    """The slice a MultipleFiles record is: its GPU's /dev/nvidiaM and the capability devices
    of one slice of it (the driver's capabilities files name each slice's, by minor)."""
    caps_known = nodes.by_number(caps=True)
    minors: set[int] = set()
    caps: set[int] = set()
    for file in record.split(MULTIPLE):
        try:
            minors.add(minor_of(file, nodes, known, path))
        except GresUnresolved:
            caps.add(_cap_of(file, nodes, caps_known, path))
    # CUDA needs both: the compute instance's device names the slice, its GPU instance's
    # may come with it; any other capability is another slice's
    owned = slice_capabilities(nodes.proc, gpus)
    chosen = [gpu for gpu in gpus if gpu.index in owned and owned[gpu.index][1] in caps]
    if (
        len(minors) != 1
        or len(chosen) != 1
        or chosen[0].minor not in minors
        or not caps <= set(owned[chosen[0].index])
    ):
        raise GresUnresolved(
            f"{path}: MultipleFiles {for_error(record)} is not one GPU's device and the "
            "capability devices of one MIG slice of it"
        )
    return chosen[0]


def _cap_of(file: str, nodes: DeviceNodes, known: Known, path: str) -> int:
    try:
        info = nodes.stat(nodes.file_path(file))
    except OSError as exc:
        raise GresUnresolved(f"{path}: File {for_error(file)}: {exc.strerror or exc}") from None
    cap = known.get((stat.S_ISCHR(info.st_mode), info.st_rdev))
    if cap is None:
        raise GresUnresolved(
            f"{path}: File {for_error(file)} is neither a GPU nor a MIG capability"
        )
    return cap


def job_gpus(
    numbers: Sequence[int],
    layout: GpuLayout,
    gpus: Sequence[Gpu],
    nodes: DeviceNodes,
    unreadable: int = 0,
) -> tuple[Gpu, ...]:
    """The GPUs slurmd's numbers name (numbers: SLURM_JOB_GPUS's)."""
    if not numbers:
        return ()
    ordered = gpu_order(layout, gpus, nodes, max(numbers) + 1, unreadable)
    past = [n for n in numbers if n >= len(ordered)]
    if past:
        raise GresUnresolved(
            f"{layout.path}: GPU number {past[0]} past the {len(ordered)} GPU(s) it lists "
            "for this node"
        )
    return tuple(ordered[n] for n in numbers)


MIG_LEGACY = re.compile(r"MIG-(GPU-[0-9A-Fa-f-]{1,64})/([0-9]{1,3})/([0-9]{1,3})")
MIG_UUID = re.compile(r"MIG-[0-9A-Fa-f-]{1,64}")


def slices_by_unique_id(
    numbers: Sequence[int], visible: Sequence[str], gpus: Sequence[Gpu], variable: str
) -> tuple[Gpu, ...] | None:
    """The MIG slices slurmd names by unique ID beside its numbers (gres_common.c
    gres_common_epilog_set_env / _prep_set_env: CUDA_VISIBLE_DEVICES takes a device's
    unique_id, set only for an AutoDetect=nvml MIG slice, else its number); None where it
    names no slice. A whole GPU beside slices, or lists that do not pair: GresUnresolved."""
    if not any(entry.startswith("MIG-") for entry in visible):
        return None
    if len(visible) != len(numbers):
        raise GresUnresolved(
            f"CUDA_VISIBLE_DEVICES names {len(visible)} device(s), {variable} {len(numbers)}"
        )
    found: list[Gpu] = []
    for number, entry in zip(numbers, visible):
        if not entry.startswith("MIG-"):
            raise GresUnresolved(
                f"{variable} number {number} is a whole GPU beside MIG slices: its place in "
                "slurmd's order is not knowable here"
            )
        found.append(_slice_named(entry, gpus))
    return tuple(found)


def _slice_named(entry: str, gpus: Sequence[Gpu]) -> Gpu:
    legacy = MIG_LEGACY.fullmatch(entry)
    named = (legacy[1], int(legacy[2]), int(legacy[3])) if legacy else None
    uuid = entry if legacy is None and MIG_UUID.fullmatch(entry) else None
    for gpu in gpus:
        mig = gpu.mig
        if mig is not None and (
            (mig.parent_uuid, mig.gpu_instance, mig.compute_instance) == named or gpu.uuid == uuid
        ):
            return gpu
    raise GresUnresolved(f"CUDA_VISIBLE_DEVICES {for_error(entry)}: NVML lists no such MIG slice")


def shard_minors(
    layout: GpuLayout, gpus: Sequence[Gpu], nodes: DeviceNodes, slurm_conf: Path, node: str | None
) -> frozenset[int]:
    """The minor numbers of the GPUs that carry gres/shard on this node. slurm.conf, where
    gpugate reads it for certain, may take them away (no `shard` in GresTypes: no plugin; the
    node's Gres= without shard: a count of 0, `_merge_config`) or cut a Count; where it does
    not, gres.conf alone says (more GPUs shared, never fewer)."""
    shards = layout.shards
    if shards is None:
        return frozenset()
    count = shards.fileless_count
    try:
        text = read_root_file(slurm_conf, MAX_CONF_BYTES)
        types = last_value(text, "GresTypes")
        if types and SHARD not in [name.strip().lower() for name in types.split(",")]:
            return frozenset()
        given = sum(_gres_counts(_node_gres(text, node, "shards"), SHARD).values())
        if not given:
            return frozenset()
        count = min(count, given)
    except GresUnresolved:
        pass
    known = nodes.by_number()
    if not shards.every_gpu:
        return frozenset(minor_of(file, nodes, known, layout.path) for file in shards.files)
    minors = [_gpu_minor(file, nodes, known, layout.path) for file in layout.files]
    if not layout.files:  # AutoDetect=nvml: every GPU, in NVML's order
        minors = [gpu.minor for gpu in sorted(gpus, key=lambda g: g.index) if gpu.mig is None]
    return frozenset(m for m, share in zip(minors, spread(count, len(minors))) if share)


def _gpu_minor(record: str, nodes: DeviceNodes, known: Known, path: str) -> int:
    """M of the GPU a File (or a MultipleFiles record, by its /dev/nvidiaM) is."""
    *first, last = record.split(MULTIPLE)
    for file in first:
        with contextlib.suppress(GresUnresolved):
            return minor_of(file, nodes, known, path)
    return minor_of(last, nodes, known, path)


def spread(count: int, gpus: int) -> list[int]:
    """A fileless shard Count over the GPU files, as `_distribute_count` does: each in turn
    gets what is left over the GPUs left (so the first get 0 where Count < GPUs)."""
    shares = []
    for left in range(gpus, 0, -1):
        shares.append(count // left)
        count -= shares[-1]
    return shares


def in_slurm_conf_order(layout: GpuLayout, slurm_conf: Path, node: str | None) -> GpuLayout:
    """gres.conf's files as slurmd merges them with slurm.conf (gres.c `_merge_config`,
    `_merge_gres2`, 22.05; interfaces/gres.c 23.02-24.11): where the node's Gres= names GPU
    types, each type in the order Gres= first names it, that type's files in gres.conf's
    order, cut at its count; a file of no type Gres= names is dropped. Untyped Gres=gpu:N:
    gres.conf's order."""
    if layout.nvml_order:
        why = f"{layout.path}: AutoDetect=nvml takes the GPUs {slurm_conf}'s Gres= gives the node"
    elif len(set(layout.types)) > 1:
        why = f"{layout.path} names several GPU Types, which slurmd numbers in {slurm_conf}'s order"
    else:
        return layout
    try:
        text = read_root_file(slurm_conf, MAX_CONF_BYTES)
    except GresUnresolved as exc:
        raise GresUnresolved(f"{why} ({exc})") from None
    counts = _gres_counts(_node_gres(text, node, why), GPU)  # in the order written
    if "" in counts and len(counts) > 1:
        raise GresUnresolved(f"{why} (typed and untyped GPUs in one Gres=)")
    if layout.nvml_order:
        return layout._replace(given=tuple(counts.items()))
    counts.pop("", None)
    if not counts:
        return layout
    ordered: list[tuple[str, str]] = []
    for kind, count in counts.items():
        ordered += [(f, t) for f, t in zip(layout.files, layout.types) if t == kind][:count]
    return layout._replace(files=tuple(f for f, _ in ordered), types=tuple(t for _, t in ordered))


def _node_gres(text: str, node: str | None, why: str) -> str:
    """The node's Gres= as slurm.conf's NodeName= lines give it (a NodeName=DEFAULT line's
    Gres= for those after it)."""
    default: str = ""
    found: str | None = None
    for number, line in logical_lines(text):
        head = line.split(None, 1)[0].lower()
        if head.startswith("include"):
            raise GresUnresolved(f"{why} (line {number}: {for_error(line[:40])} not followed)")
        if not head.startswith("nodename="):
            continue
        keys: dict[str, str] = {k.lower(): v.strip('"') for k, v in PAIR.findall(line)}
        names = keys.get("nodename", "")
        if names.upper() == "DEFAULT":
            default = keys.get("gres", default)
            continue
        try:
            listed = expand_hostlist(names)
        except ValueError:
            raise GresUnresolved(f"{why} (line {number}: NodeName={for_error(names)})") from None
        if node is not None and node in listed:
            if found is not None:
                raise GresUnresolved(f"{why} (node {for_error(node)} on two lines)")
            found = keys.get("gres", default)
    if found is None:
        raise GresUnresolved(f"{why} (no NodeName= line for {for_error(node or '(unnamed)')})")
    return found


def _gres_counts(gres: str, name: str) -> dict[str, int]:
    """NAME's counts in a Gres= by type ("" untyped), in the order written (gres.c
    `_get_gres_cnt`: `name[:type...][:count]`, a `(S:...)` binding ignored)."""
    counts: dict[str, int] = {}
    for token in gres.split(","):
        parts = token.split("(", 1)[0].strip().split(":")
        if parts[0] != name:
            continue
        count = 1
        if len(parts) > 1 and parts[-1][:1].isdigit():
            count = _count("slurm.conf", 0, parts.pop())
        for kind in parts[1:] or [""]:
            counts[kind.lower()] = counts.get(kind.lower(), 0) + count
    return counts


def last_value(text: str, key: str) -> str:
    """The last `KEY=VALUE` of a Slurm config file (keys in any case, comments dropped)."""
    found = ""
    pattern = re.compile(rf"(?:^|\s){key}=(\"[^\"]*\"|\S+)", re.IGNORECASE)
    for raw in text.splitlines():
        for match in pattern.finditer(raw.split("#", 1)[0]):
            found = match.group(1).strip('"')
    return found


def shm_privacy(slurm_conf: Path) -> tuple[str, str, bool]:
    """slurm.conf's JobContainerType ("" where unset), job_container.conf's Dirs (or the
    default), and whether /dev/shm is among them: private to each job."""
    plugin = last_value(read_root_file(slurm_conf, MAX_CONF_BYTES), "JobContainerType")
    if plugin != TMPFS:
        return plugin, "", False
    path = slurm_conf.parent / JOB_CONTAINER_CONF
    dirs = last_value(read_root_file(path, MAX_CONF_BYTES), "Dirs") if path.exists() else ""
    dirs = dirs or DEFAULT_DIRS
    return plugin, dirs, SHM in [d.strip().rstrip("/") for d in dirs.split(",")]
