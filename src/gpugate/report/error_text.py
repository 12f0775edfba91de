"""Every error in words: a `GateError` carries a `Problem` code and its facts; this module says
it, one line, as `gpugate: ...` on stderr, the journal's error entry and STATUS= show it. The
raise sites name what went wrong and what they saw; the words are here, in one place.

Importing this module installs `error_text` as `GateError.wording`, so `error.message` (and
`str(error)`) is these words wherever report/ is loaded, as it is wherever an error reaches an
operator."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from gpugate.errors import ConfigError, GateError, InvalidValue, Problem, echo

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (on `--help`'s path)
if TYPE_CHECKING:
    from typing import Any

# This module is loaded with the package (gpugate/__init__.py), so on `--help`'s path too: the
# words that need more (trust_text's file facts, untrusted's dataclasses) import it when used.

# What goes in a state folder, by the code a raise site gives (`what`); words given as they
# are pass through.
STATE_WORDS = {
    "gpu-locks": "GPU locks",
    "gpu-lock": "a GPU lock",
    "gpu-lease": "the GPU lease",
    "run-config": "gpugate run's config (--port)",
}
MAX_LISTED = 5  # processes a manual-run refusal lists before "and N more"
MAX_LISTED_TEXT = 120  # characters of each


class Facts:
    """An error's facts as attributes (`f.path`), a nested error in words."""

    def __init__(self, facts: dict[str, object]) -> None:
        self._facts = facts

    def __getattr__(self, name: str) -> Any:
        value = self._facts.get(name, "")
        if isinstance(value, GateError):
            return error_text(value)
        if isinstance(value, InvalidValue):
            return problem_text(value.problem, value.facts)
        if name == "what":
            return STATE_WORDS.get(str(value), value)
        return value

    def get(self, name: str, default: object = None) -> Any:
        return self._facts.get(name, default)


def _indices(values: Iterable[object]) -> str:
    return ", ".join(str(value) for value in values)


def _index_list(indices: list[int]) -> str:
    if not indices:
        return "no GPUs"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"GPUs {indices[0]}-{indices[-1]}"
    return "GPUs " + ", ".join(map(str, indices))


def _doing(f: Facts) -> str:
    if not f.get("progress"):
        return "running"
    # Here, not at the top: every gpugate import loads this module (its errors' words), and
    # the stage machine's types are for the runs that get that far.
    from gpugate.report.stage_text import doing  # noqa: PLC0415

    return doing(f.progress)


def _reasons() -> Any:
    # Here, not at the top, as for _doing: reasons reads the decision step's types.
    from gpugate.report import reasons  # noqa: PLC0415

    return reasons


def _oci_text() -> Any:
    # Here, not at the top, as for _doing: containers' words are for the commands about them.
    from gpugate.report import oci_text  # noqa: PLC0415

    return oci_text


def _trust_text() -> Any:
    from gpugate.report import trust_text  # noqa: PLC0415

    return trust_text


def _manual_run(f: Facts) -> str:
    from gpugate.report.untrusted import cut  # noqa: PLC0415

    # Each already shown (escaped) by describe(); one line, each short.
    would_kill = [cut(re.sub(r"\s+", " ", str(text)), MAX_LISTED_TEXT) for text in f.would_kill]
    listed = "; ".join(would_kill[:MAX_LISTED]) + (
        f"; and {len(would_kill) - MAX_LISTED} more" if len(would_kill) > MAX_LISTED else ""
    )
    what = (
        f"it would kill {len(would_kill)} process(es): {listed}"
        if would_kill
        else "it would kill nothing now"
    )
    return (
        f"{f.unit} is {f.state} and this `gpugate {f.phase}` is not its {f.phase} hook "
        f"(not in the unit's cgroup with INVOCATION_ID set); {what}; nothing killed. To do it "
        f"on purpose: gpugate {f.phase} {f.unit} --force"
    )


def _wrong_type(f: Facts) -> str:
    return f"{f.detail}, not {f.input_type} {echo(f.shown, quote=False)}"


def _unknown_key(f: Facts) -> str:
    return "unknown key" + (f"; did you mean {f.suggestion!r}?" if f.suggestion else "")


def _not_gpu_why(f: Facts) -> str:
    if f.get("cause"):
        return f"({f.cause})"
    if f.get("kind"):
        return f"(a {f.kind} file)"
    return f"(device {f.major}:{f.minor} is no /dev/nvidiaN)"


WORDS: dict[Problem, Callable[[Facts], str]] = {
    Problem.CONFIG_NOT_TOML: lambda f: f"not valid TOML: {f.detail}",
    Problem.CONFIG_UNKNOWN_KEY: _unknown_key,
    Problem.CONFIG_WRONG_TYPE: _wrong_type,
    Problem.CONFIG_INVALID: lambda f: f"{f.detail}",
    Problem.CONFIG_NO_FILE: lambda f: "no such file",
    Problem.CONFIG_UNREADABLE: lambda f: "permission denied reading it",
    Problem.CONFIG_IS_FOLDER: lambda f: "is a directory, not a TOML file",
    Problem.CONFIG_NOT_UTF8: lambda f: "is not UTF-8 text",
    Problem.CONFIG_OS_ERROR: lambda f: f"{f.cause}",
    Problem.CONFIG_UNTRUSTED: lambda f: (
        _trust_text().untrusted_text(f.found) if f.get("found") else "another account may change it"
    ),
    Problem.CONFIG_STATE_UNTRUSTED: lambda f: (
        _trust_text().untrusted_text(f.found, state=True)
        if f.get("found")
        else "another account may change it"
    ),
    Problem.LOCK_DIR_NOT_FOLDER: lambda f: f"{f.lock_dir}: {f.existing} is not a folder",
    Problem.LOCK_DIR_NOT_HOSTS: lambda f: (
        f"{f.lock_dir} is not the host's lock_dir {f.host} ({f.where}): every unit, gpugate "
        "run, container and Slurm job keeps its leases in one; set lock_dir in default.toml "
        "alone (docs/hardening.md: one lock_dir for every lease)"
    ),
    Problem.GRACE_OVER_DEADLINE: lambda f: (
        f"sigterm_grace_s + sigkill_wait_s ({f.kill_s:g} s) must be below wait_timeout_s "
        f"({f.wait_timeout_s:g} s), which also holds the memory wait"
    ),
    Problem.SWEEP_BELOW_INTERVAL: lambda f: (
        f"{f.value} s is below the sweep timer's interval ({f.interval_s} s): a holder "
        "could not be seen unowned that long by two sweeps"
    ),
    Problem.GPUS_FORM: lambda f: (
        'must be "all", "auto" or a list of GPU indices or UUIDs, e.g. [0, 1]'
    ),
    Problem.NOT_ABSOLUTE: lambda f: (
        f"{echo(f.value)} is not an absolute path" if f.get("value") else "must be an absolute path"
    ),
    Problem.NOT_UNIT_NAME: lambda f: (
        f"{echo(f.value)} is not a service or scope unit name with its suffix "
        "(e.g. nvidia-persistenced.service)"
    ),
    Problem.NOT_CONTAINER: lambda f: (
        f"{echo(f.value)} is not a container name or id"
        + (" (letters, digits, _.-)" if f.get("hint") else "")
    ),
    Problem.CONTAINER_TWICE: lambda f: "lists a container twice",
    Problem.GPU_NOT_REF: lambda f: (
        f"{echo(f.value)} is not a GPU index (0, 1, ...) or UUID (GPU-xxxxxxxx-...)"
        if f.get("text")
        else f"{echo(f.value)} is not a GPU index or UUID"
    ),
    Problem.GPU_INDEX_RANGE: lambda f: f"GPU index {f.value} is out of range (0-{f.most})",
    Problem.GPU_MIG: lambda f: (
        f"{echo(f.value)} is not a MIG device UUID (MIG-xxxxxxxx-...) or MIG-GPU-<uuid>/<gi>/<ci>"
    ),
    Problem.GPU_LIST_EMPTY: lambda f: "must name at least one GPU",
    Problem.GPU_TWICE: lambda f: f"lists GPU {echo(f.value, quote=False)} twice",
    Problem.GPU_NO_SUCH_INDEX: lambda f: (
        f"GPU index {f.value} does not exist; NVML lists {_index_list(f.listed)}"
    ),
    Problem.GPU_NO_SUCH_UUID: lambda f: f"no GPU has UUID {echo(f.value, quote=False)}",
    Problem.GPU_UUID_AMBIGUOUS: lambda f: (
        f"{echo(f.value, quote=False)} is the start of more than one GPU's UUID"
    ),
    Problem.GPU_NO_SUCH_MIG: lambda f: (
        f"no MIG device has UUID {echo(f.value, quote=False)}"
        + ("" if f.mig_gpus else " (no GPU is in MIG mode)")
    ),
    Problem.GPU_NOT_MIG_MODE: lambda f: (
        f"{echo(f.value, quote=False)}: GPU {f.gpu} is not in MIG mode"
    ),
    Problem.GPU_NO_SUCH_MIG_INSTANCE: lambda f: (
        f"{echo(f.value, quote=False)}: GPU {f.gpu} has no MIG device with GPU instance "
        f"{f.gi} and compute instance {f.ci} (it has {f.listed or 'none'})"
    ),
    Problem.VARIABLE_VALUE: lambda f: f"{echo(f.value)}: {f.cause}",
    Problem.ROOTS_FORM: lambda f: f"{echo(f.value)}: not dev=DIR, proc=DIR or cgroup=DIR",
    Problem.ROOTS_NOT_ABSOLUTE: lambda f: f"{echo(f.value)} is not an absolute path",
    Problem.ROOTS_NO_FOLDER: lambda f: f"{echo(f.value, quote=False)}: no such folder",
    Problem.NVML_LIBRARY_MISSING: lambda f: (
        "NVML: libnvidia-ml.so.1 not found: is the NVIDIA driver installed?"
    ),
    Problem.NVML_LIBRARY_NOT_FOUND: lambda f: (
        f"NVML: {f.library} not found in {', '.join(f.dirs or [])} or the dynamic loader's "
        "cache: is the NVIDIA driver installed?"
    ),
    Problem.NVML_LIBRARY_UNLOADABLE: lambda f: (
        f"NVML: {f.library} not found: {f.path} cannot be loaded ({f.detail}): is the NVIDIA "
        "driver installed?"
    ),
    Problem.NVML_DRIVER_NOT_LOADED: lambda f: "NVML: the NVIDIA kernel driver is not loaded",
    Problem.NVML_NO_PERMISSION: lambda f: "NVML: permission denied opening the NVIDIA driver",
    Problem.NVML_INIT_FAILED: lambda f: f"NVML: initialisation failed: {f.detail}",
    Problem.NVML_COUNT_FAILED: lambda f: f"NVML: cannot count GPUs: {f.detail}",
    Problem.NVML_GPU_LOST: lambda f: (
        f"NVML: GPU {f.gpu} is lost (fell off the bus); it needs a reset or reboot"
    ),
    Problem.NVML_NOT_SUPPORTED: lambda f: f"NVML: GPU {f.gpu} does not support {f.call}",
    Problem.NVML_CALL_DENIED: lambda f: f"NVML: permission denied for {f.call}",
    Problem.NVML_CALL_FAILED: lambda f: f"NVML: {f.call}: {f.detail}",
    Problem.NVML_GPU_CALL_FAILED: lambda f: f"NVML: {f.call} on GPU {f.gpu}: {f.detail}",
    Problem.NVML_OWN_GPU_FAULT: lambda f: (
        f"{f.fault} (a GPU of {f.who}" + (": gpus = all)" if f.get("all_gpus") else ")")
    ),
    Problem.NVML_OWN_GPU_UNREAD: lambda f: (
        f"{f.fault}; {f.who}'s GPU {echo(f.value, quote=False)} is not among those NVML can read"
    ),
    Problem.UNIT_NOT_SERVICE_OR_SCOPE: lambda f: (
        f"unit {f.unit!r}: not a valid service or scope unit name (pass %n from the unit file)"
    ),
    Problem.UNIT_NAME_INVALID: lambda f: f"unit {f.unit!r}: not a valid unit name",
    Problem.UNIT_TEMPLATE: lambda f: (
        f"unit {f.unit!r}: a template; name an instance, e.g. {f.prefix}@0.service"
    ),
    Problem.UNIT_UNKNOWN: lambda f: f"unit {f.unit}: systemd knows no such unit",
    Problem.UNIT_ENV_FILE_UNREADABLE: lambda f: (
        f"unit {f.unit}: EnvironmentFile={f.path}: cannot read it ({f.detail}); "
        "systemd would not start the unit either"
    ),
    Problem.UNIT_NOT_GIVEN: lambda f: (
        "no UNIT given and gpugate is not running inside a service's cgroup; "
        "pass the unit (%n in a unit file)"
    ),
    Problem.PROGRAM_NOT_ANSWERING: lambda f: (
        f"{f.program} {f.first_argument} did not answer within {f.timeout_s:g} s (killed)"
    ),
    Problem.PROGRAM_CANNOT_RUN: lambda f: f"{f.path}: cannot run it: {f.cause}",
    Problem.CGROUP_MOUNTINFO_UNREADABLE: lambda f: (
        f"cannot read {f.path} ({f.cause}): gpugate cannot tell which cgroup tree this host "
        "tracks its units in; nothing was killed"
    ),
    Problem.CGROUP_V1_ONLY: lambda f: (
        f"this host's cgroups are v1 only (no cgroup2 at {f.system} or {f.hybrid}): gpugate "
        "finds a unit's processes in the unified hierarchy (cgroup v2), which this host lacks; "
        "nothing was killed. Boot with systemd.unified_cgroup_hierarchy=1 on the kernel command "
        'line (RHEL 8: grubby --update-kernel=ALL --args="systemd.unified_cgroup_hierarchy=1"), '
        "then reboot"
    ),
    Problem.CGROUP_TREE_ELSEWHERE: lambda f: (
        f"this host's cgroup2 tree {f.mount} is not at {f.expected}: gpugate cannot find its "
        "units' processes; nothing was killed"
    ),
    Problem.STATE_OS_ERROR: lambda f: f"{f.path}: cannot write {f.what} there: {f.cause}",
    Problem.STATE_FILE_IN_THE_WAY: lambda f: (
        f"{f.path}: cannot write {f.what} there: a file is in the way (not a folder)"
    ),
    Problem.STATE_FOLDER_IN_THE_WAY: lambda f: (
        f"{f.path}: cannot write {f.what} there: a folder is in the way (not a file)"
    ),
    Problem.NO_PERMISSION_CREATING: lambda f: (
        f"{f.path}: permission denied creating it (for {f.what})"
    ),
    Problem.NO_PERMISSION_WRITING: lambda f: f"{f.path}: permission denied writing {f.what} there",
    Problem.NO_PERMISSION: lambda f: f"{f.path}: permission denied",
    Problem.NO_PERMISSION_READING: lambda f: (
        f"{f.path}: permission denied (run as root)"
        if f.get("writing")
        else f"{f.path}: permission denied reading it (run as root)"
    ),
    Problem.NO_PERMISSION_SIGNAL: lambda f: (
        f"not permitted to signal PID {f.pid} (run gpugate as root)"
    ),
    Problem.LOCK_TIMEOUT: lambda f: f"{f.path}: another gpugate run held {f.gpu} past the deadline",
    Problem.INTERRUPTED: lambda f: f"stopped by {f.signal}",
    Problem.INTERRUPTED_DURING: lambda f: (
        f"stopped by {f.signal} while {_doing(f)}; it left no GPU lock or lease"
    ),
    Problem.SLURM_JOB_ID: lambda f: (
        f"SLURM_JOB_ID {echo(f.value) if f.value else 'not set'}: not a Slurm job ID "
        "(a positive integer)"
    ),
    Problem.SLURM_JOB_UID: lambda f: f"SLURM_JOB_UID {f.value!r}: not a user ID",
    Problem.SLURM_GPU_VARIABLE: lambda f: f"{f.variable} {echo(f.value)}: {f.cause}",
    Problem.SLURM_GPU_NUMBER: lambda f: (
        f"{echo(f.value)} is not a GPU number slurmd writes (0, 1, ... as gres.conf lists them)"
    ),
    Problem.GRES_SLURM_CONF: lambda f: f"SLURM_CONF {echo(f.value)}: not an absolute path",
    Problem.GRES_UNTRUSTED: lambda f: (
        f"{f.path}: not read, {f.component} may be changed by an account other than root"
    ),
    Problem.GRES_MISSING: lambda f: f"{f.path}: no such file",
    Problem.GRES_UNREADABLE: lambda f: f"{f.path}: cannot read it: {f.cause}",
    Problem.GRES_NOT_UTF8: lambda f: f"{f.path}: cannot read it: not UTF-8",
    Problem.GRES_LINE: lambda f: f"{f.path} line {f.line}: {echo(f.value)} not read for certain",
    Problem.GRES_NODE_UNKNOWN: lambda f: (
        f"{f.path} line {f.line}: NodeName= lines, and slurmd named no node (SLURMD_NODENAME)"
    ),
    Problem.GRES_AUTODETECT: lambda f: (
        f"{f.path}: AutoDetect={echo(f.value)}: slurmd's GPU order is not knowable here"
    ),
    Problem.GRES_AUTODETECT_MATCH: lambda f: (
        f"{f.path}: AutoDetect=nvml with a Name=gpu line without File=: which GPUs slurmd "
        "matched to it is not knowable here"
    ),
    Problem.GRES_FILE_TWICE: lambda f: f"{f.path}: File {echo(f.file)} listed twice",
    Problem.GRES_NO_FILES: lambda f: (
        f"{f.path}: no Name=gpu File= line for node {echo(f.node) if f.node else '(unnamed)'}"
    ),
    Problem.GRES_FILE_NOT_GPU: lambda f: (
        f"{f.path}: File {echo(f.file)} is no GPU device node " + _not_gpu_why(f)
    ),
    Problem.GRES_NO_NVML_GPU: lambda f: (
        f"{f.path}: File {echo(f.file)} is /dev/nvidia{f.minor}, and NVML lists no GPU with "
        f"minor number {f.minor}"
    ),
    Problem.GRES_NVML_FAULTS: lambda f: (
        f"{f.path}: AutoDetect=nvml, and NVML cannot read {f.count} GPU(s): slurmd's order "
        "has gaps gpugate cannot place"
    ),
    Problem.GRES_INDEX_PAST: lambda f: (
        f"{f.path}: GPU number {f.value} past the {f.count} GPU(s) it lists for this node"
    ),
    Problem.INSTALL_NOT_SERVICE: lambda f: (
        f"unit {f.unit!r}: gpugate installs on .service units (ExecStartPre=)"
    ),
    Problem.INSTALL_NO_SYSTEMCTL: lambda f: (
        f"files written, but no systemctl in {f.path}: run `systemctl daemon-reload`"
    ),
    Problem.INSTALL_RELOAD_FAILED: lambda f: (
        f"files written, but `systemctl daemon-reload` failed: {f.said}; run it yourself"
    ),
    Problem.INSTALL_RELOAD_ERROR: lambda f: f"files written, but {f.cause}; run it yourself",
    Problem.INSTALL_TIMER_FAILED: lambda f: (
        f"`systemctl {f.action} gpugate-sweep.timer` failed: {echo(f.detail, quote=False)}"
    ),
    Problem.INSTALL_EDITED: lambda f: (
        f"{_indices(f.paths)}: edited by you (or not written by gpugate install); "
        "nothing changed; --force replaces it"
    ),
    Problem.INSTALL_EDITED_REMOVE: lambda f: (
        f"{f.path}: edited by you (or not written by gpugate install); nothing changed; "
        "--force removes it"
    ),
    Problem.INSTALL_UNIT_UNKNOWN: lambda f: (
        f"unit {f.unit}: systemd knows no such unit (systemctl list-unit-files); nothing "
        "changed; --force installs anyway"
    ),
    Problem.INSTALL_GPUGATE_PATH: lambda f: (
        f"--gpugate-path {f.value!r}: an absolute path of letters, digits and _.+/- only "
        "(it goes into ExecStartPre= unquoted)"
    ),
    Problem.INSTALL_GPUGATE_PATH_RELATIVE: lambda f: (
        f"--gpugate-path {f.value!r}: not an absolute path"
    ),
    Problem.LAUNCH_NO_COMMAND: lambda f: (
        "no COMMAND given: gpugate run [OPTIONS] -- COMMAND [ARGS...]"
    ),
    Problem.LAUNCH_CONFIG_PATH: lambda f: (
        f"--config {str(f.value)[:80]!r}: use a path of letters, digits and _.+@:,-/"
    ),
    Problem.LAUNCH_NO_SYSTEMD_RUN: lambda f: (
        "systemd-run not found in the system folders: gpugate run needs systemd"
    ),
    Problem.LAUNCH_UNIT_EXISTS: lambda f: (
        f"systemd already has {f.unit} ({f.load_state}, {f.active_state})"
        + ("; choose another --name" if f.get("explicit") else "; run it again")
    ),
    Problem.LAUNCH_NVML: lambda f: f"gpugate run: {f.cause}",
    Problem.LAUNCH_NO_GPU: lambda f: f"{f.source}: names no GPU; gpugate run is for GPU programs",
    Problem.LAUNCH_LEASED: lambda f: f"not starting {f.unit}: {f.refusal}; --force runs it anyway",
    Problem.LAUNCH_FORCE_NOT_ROOT: lambda f: (
        f"not starting {f.unit}: {f.refusal}; --force over a lease is root's alone"
    ),
    Problem.LAUNCH_CONFIG_UNWRITABLE: lambda f: (
        f"{f.path}: permission denied writing the run's config (--port): run gpugate run "
        "as root (sudo)"
    ),
    Problem.LAUNCH_NOT_EXECUTABLE: lambda f: f"{f.program}: not an executable file",
    Problem.LAUNCH_NOT_FOUND: lambda f: f"{f.program}: command not found on PATH",
    Problem.LAUNCH_CANNOT_RUN: lambda f: f"{f.program}: cannot run it: {f.cause}",
    Problem.LAUNCH_NAME_NOT_SERVICE: lambda f: (
        f"--name {str(f.value)[:80]!r}: gpugate run makes a service; name it NAME.service"
    ),
    Problem.LAUNCH_NAME_NOT_PLAIN: lambda f: (
        f"--name {str(f.value)[:80]!r}: not a plain unit name (letters, digits and :_.- only, "
        "not first a - or ., no \\ escapes; at most 255 characters with .service)"
    ),
    Problem.LAUNCH_NAME_TEMPLATE: lambda f: (
        f"--name {str(f.value)[:80]!r}: a transient unit cannot be a template instance"
    ),
    Problem.RECORD_UNREADABLE: lambda f: f"cannot be read ({f.cause})",
    Problem.RECORD_NOT_FILE: lambda f: "not a regular file",
    Problem.RECORD_TOO_LARGE: lambda f: f"larger than {f.kib} KiB",
    Problem.RECORD_NOT_UTF8: lambda f: "not UTF-8",
    Problem.RECORD_CONSTANT: lambda f: f"{f.value} is not a number gpugate writes",
    Problem.RECORD_DIGITS: lambda f: f"a number of {f.count} digits",
    Problem.RECORD_CHARS: lambda f: f"a number of {f.count} characters",
    Problem.RECORD_OUT_OF_RANGE: lambda f: f"{f.key} is out of range",
    Problem.RECORD_NESTED: lambda f: "nested too deeply",
    Problem.RECORD_NOT_JSON: lambda f: f"not JSON ({str(f.detail)[:80]})",
    Problem.RECORD_NOT_OBJECT: lambda f: f"a JSON {f.kind}, not an object",
    Problem.RECORD_NOT_STRING: lambda f: f"{f.key} is not a string",
    Problem.RECORD_TOO_LONG: lambda f: f"{f.key} is longer than {f.limit} characters",
    Problem.RECORD_NOT_INTEGER: lambda f: f"{f.key} is not an integer from {f.low} to {f.high}",
    Problem.RECORD_NOT_NUMBER: lambda f: f"{f.key} is not a number",
    Problem.RECORD_NOT_FLAG: lambda f: f"{f.key} is not true or false",
    Problem.RECORD_NOT_LIST: lambda f: f"{f.key} is not a list",
    Problem.RECORD_TOO_MANY: lambda f: f"{f.key} has more than {f.most} items",
    Problem.RECORD_WRONG_UNIT: lambda f: f"its unit is not {f.unit}",
    Problem.LAUNCH_SUDO_VARIABLES: lambda f: _reasons().sudo_variables_text(f.environ or {}),
    Problem.LAUNCH_OTHER_ACCOUNT: lambda f: (
        _reasons().other_account_refusal(f.unit, f.choices)
        if f.get("choices")
        else f"not starting {f.unit}: another account's process holds its GPUs"
    ),
    Problem.MANUAL_RUN: _manual_run,
    Problem.OCI_STATE_SLOW: lambda f: (
        f"the container state on stdin did not end within {f.timeout_s:g} s"
    ),
    Problem.OCI_STATE_TOO_BIG: lambda f: f"the container state on stdin is over {f.limit} bytes",
    Problem.OCI_STATE_NO_ID: lambda f: (
        "the container state on stdin: id: missing or not a container id"
    ),
    Problem.OCI_STATE_NO_BUNDLE: lambda f: (
        "the container state on stdin: bundle: missing or not absolute"
    ),
    Problem.OCI_BUNDLE_UNOPENABLE: lambda f: f"{f.path}: the bundle cannot be opened: {f.cause}",
    Problem.OCI_CONFIG_UNOPENABLE: lambda f: f"{f.path}: cannot be opened: {f.cause}",
    Problem.OCI_NOT_REGULAR: lambda f: f"{f.path}: not a regular file",
    Problem.OCI_TOO_BIG: lambda f: f"{f.path}: over {f.limit} bytes",
    Problem.OCI_NOT_OWNERS: lambda f: f"{f.path}: owned by uid {f.uid}, not by this runtime's user",
    Problem.OCI_WRITABLE: lambda f: f"{f.path}: writable by others than its owner",
    Problem.OCI_ENV_TOO_LONG: lambda f: (
        f"config.json: process.env: {f.variable} is over {f.limit} characters"
    ),
    Problem.OCI_NOT_JSON: lambda f: (
        f"{f.source}: not JSON ({f.detail})" if f.get("detail") else f"{f.source}: not JSON"
    ),
    Problem.OCI_NOT_OBJECT: lambda f: f"{f.source}: not a JSON object",
    Problem.OCI_NOT_LIST: lambda f: f"{f.source}: not a list",
    Problem.OCI_DEVICE_NOT_GPU: lambda f: (
        f"{f.source}: the device {f.major}:{f.minor} it reaches is no GPU NVML knows"
    ),
    Problem.OCI_DEVICE_LINK: lambda f: (
        f"config.json: linux.devices: {echo(f.path)} has no major and minor, and on the host"
        " it is a symbolic link: which device it is cannot be told"
    ),
    Problem.OCI_MOUNT_FOLDER: lambda f: (
        f"config.json: mounts: {echo(f.path)} holds over {f.limit} entries: which GPUs"
        " a bind mount of it reaches cannot be told"
    ),
    Problem.OCI_CDI_NAME: lambda f: (
        f"config.json: {echo(f.source)}: {echo(f.value)} is not a CDI device name"
        " (vendor/class=device)"
    ),
    Problem.OCI_GPU_MIG: lambda f: (
        f"config.json: {echo(f.source)}: {echo(f.value)} is a MIG device: name whole GPUs"
    ),
    Problem.OCI_GPU_WORD: lambda f: (
        f"config.json: {echo(f.source)}: {echo(f.value)} is not a GPU index, a GPU UUID or all"
    ),
    Problem.OCI_ANNOTATION_TOO_LONG: lambda f: (
        f"config.json: annotations: {echo(f.key)} is over {f.limit} characters"
    ),
    Problem.OCI_GPU_UNKNOWN: lambda f: (
        f"config.json: {echo(f.source)}: {echo(f.value)} is no GPU NVML knows"
    ),
    Problem.OCI_NO_OWN_CGROUP: lambda f: _oci_text().no_own_cgroup(f.cgroup, f.id),
    Problem.PRIVATE_SHM_FORM: lambda f: (
        f'{echo(f.value)}: "off", a percentage of RAM ("50%") or a size in k, m or g ("64g")'
    ),
    Problem.INSTALL_UNREADABLE: lambda f: (
        f"{f.path}: cannot read it ({f.cause})"
        + ("; nothing changed" if f.get("nothing_changed") else "")
    ),
    Problem.INSTALL_NOT_TOML: lambda f: (
        f"{f.path}: cannot be read as TOML ({f.cause}); nothing changed"
    ),
    Problem.INSTALL_NOT_JSON: lambda f: f"{f.path}: not valid JSON ({f.where}); nothing changed",
    Problem.INSTALL_NOT_OBJECT: lambda f: (
        f"{f.path}: {f.key + ': ' if f.get('key') else ''}not a JSON object; nothing changed"
    ),
    Problem.INSTALL_NOT_OUR_HOOK: lambda f: (
        f"{f.path}: not gpugate's hook file; nothing changed; --force replaces it"
    ),
    Problem.INSTALL_DEFAULT_RUNTIME: lambda f: (
        f'{f.path}: "default-runtime" is {f.runtime}: set another first; nothing changed'
    ),
    Problem.INSTALL_NO_WRAPPER: lambda f: (
        f"no {f.wrapper} beside {f.gpugate}: install gpugate's package whole"
    ),
    Problem.INSTALL_DOCKER_RELOAD: lambda f: _oci_text().docker_reload_failed(
        f.cause if f.get("cause") else f"`systemctl reload docker` failed: {f.said}"
    ),
    Problem.INSTALL_UNTRUSTED: lambda f: (
        f"{f.path}: "
        + (_trust_text().untrusted_text(f.found) if f.get("found") else "refused: untrusted")
    ),
    Problem.INSTALL_CONTAINERD_VERSION: lambda f: (
        f"{f.path}: config version {echo(f.version)}: gpugate edits versions 2 (containerd 1.6, "
        "1.7) and 3 (2.x); `containerd config migrate` converts it; nothing changed"
    ),
    Problem.INSTALL_CONTAINERD_RUNTIME_THERE: lambda f: (
        f"{f.path}: a runtime {f.runtime} that gpugate install did not write is there; take it "
        "out first; nothing changed"
    ),
    Problem.INSTALL_CONTAINERD_EDIT: lambda f: (
        f"{f.path}: adding {f.table} as a table would change other settings (inline or dotted "
        "tables there); add it by hand (docs/containers.md); nothing changed"
    ),
    Problem.INSTALL_CONTAINERD_DEFAULT: lambda f: (
        f"{f.path}: default_runtime_name is {f.runtime}, not set by gpugate install: set another "
        "first (containerd would not start its pods); nothing changed"
    ),
    Problem.INSTALL_CONTAINERD_DEFAULT_CONFIG: lambda f: (
        f"{f.path} is missing and `containerd config default` failed: "
        + ("no containerd in the system folders" if f.get("missing") else "")
        + (f"{f.cause}" if f.get("cause") else f"{f.get('said', '')}")
        + "; nothing changed"
    ),
    Problem.INSTALL_MARK_UNCLOSED: lambda f: (
        f"{f.path}: line {f.line}: gpugate's block is opened and never closed (`{f.end}`); "
        "mend it by hand; nothing changed"
    ),
    Problem.RUNTIME_RECORD_VALUE: lambda f: (
        f"{echo(f.value)}: not one of {', '.join(f.choices)} (gpugate install --containers "
        "writes it)"
    ),
    Problem.WORDED: lambda f: f"{f.text}",
}


def problem_text(problem: Problem, facts: dict[str, object]) -> str:
    """A problem code (an InvalidValue's, say) and its facts in words, without a where."""
    return WORDS[problem](Facts(facts))


def error_text(error: GateError) -> str:
    """The one line an operator reads for this error (after `gpugate: `)."""
    words = WORDS[error.problem](Facts(error.facts))
    if isinstance(error, ConfigError):
        where = f"{error.source}: {error.field}" if error.field else error.source
        more = error.facts.get("more", 0)
        return f"{where}: {words}" + (f" (and {more} more)" if more else "")
    return words


GateError.wording = error_text
