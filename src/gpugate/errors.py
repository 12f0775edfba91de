"""Exit codes and the errors that carry them.

Every failure gpugate knows about is a `GateError` with one exit code and a one-line message;
the CLI prints the message and exits with the code, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum, IntEnum

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (on `--help`'s path)
if TYPE_CHECKING:
    from typing import ClassVar


class ExitCode(IntEnum):
    """Where a BSD sysexits code means the same, gpugate uses it (systemd's journal line, also
    in `systemctl status`, names it: `status=78/CONFIG`); its own outcomes use codes systemd has
    no name for (20 and up: `status=21/n/a`), never a false LSB label such as `7/NOTRUNNING`.
    What each means: EXIT_MEANINGS (--help's epilog), and README's table in full (its code,
    name and systemd label checked against these by tests/test_docs.py)."""

    OK = 0
    USAGE = 64
    NVML_UNAVAILABLE = 69
    INTERNAL = 70
    STATE_UNWRITABLE = 73
    LOCK_TIMEOUT = 75
    PERMISSION = 77
    CONFIG = 78
    UNKILLABLE = 20
    MEMORY_TIMEOUT = 21
    HELD_BY_OTHERS = 22
    UNKNOWN_UNIT = 23
    INSTALL = 24
    RESPAWNING = 25
    NVML_NOT_ANSWERING = 26
    INTERRUPTED = 27
    HOST_UNSUPPORTED = 28
    SHM_SPACE = 29
    MANUAL_RUN_REFUSED = 80
    GPU_UNREADABLE = 81

    @property
    def systemd_label(self) -> str:
        """How systemd logs this code ("Control process exited, code=exited, status=78/CONFIG",
        also shown by `systemctl status`): `78/CONFIG`, `21/n/a`."""
        return f"{int(self)}/{SYSEXITS_NAMES.get(int(self), 'n/a')}"


# systemd's names for the codes gpugate shares with it (`systemd-analyze exit-status`). The
# same on systemd 247 to 257: what changed between them is systemd's own range (200 and up,
# grown to 245/KSM by 254), which gpugate never uses.
SYSEXITS_NAMES = {
    0: "SUCCESS",
    64: "USAGE",
    69: "UNAVAILABLE",
    70: "SOFTWARE",
    73: "CANTCREAT",
    75: "TEMPFAIL",
    77: "NOPERM",
    78: "CONFIG",
}

EXIT_MEANINGS = {
    ExitCode.OK: "ok",
    ExitCode.INTERNAL: "internal error",
    ExitCode.USAGE: "usage",
    ExitCode.CONFIG: "config",
    ExitCode.NVML_UNAVAILABLE: "NVML (or systemctl) unavailable",
    ExitCode.STATE_UNWRITABLE: "gpugate's state cannot be written",
    ExitCode.UNKILLABLE: "holders survived SIGKILL",
    ExitCode.MEMORY_TIMEOUT: "memory not freed in time",
    ExitCode.HELD_BY_OTHERS: "GPUs held by processes gpugate may not kill or leased",
    ExitCode.PERMISSION: "permission",
    ExitCode.UNKNOWN_UNIT: "unknown unit",
    ExitCode.LOCK_TIMEOUT: "GPU lock timeout",
    ExitCode.INSTALL: "install/uninstall refused",
    ExitCode.RESPAWNING: "holders respawned until the deadline",
    ExitCode.NVML_NOT_ANSWERING: "NVML did not answer (hung driver)",
    ExitCode.INTERRUPTED: "stopped by SIGTERM/SIGINT",
    ExitCode.HOST_UNSUPPORTED: "host unsupported (no cgroup v2 tree)",
    ExitCode.SHM_SPACE: "/dev/shm short of free space",
    ExitCode.MANUAL_RUN_REFUSED: "pre/post by hand on a running unit (no --force)",
    ExitCode.GPU_UNREADABLE: "status: a GPU NVML cannot read",
}


def exit_code_summary() -> str:
    """`0 ok, 20 holders survived SIGKILL, ...`: for --help, from the codes themselves."""
    return ", ".join(f"{int(code)} {EXIT_MEANINGS[code]}" for code in sorted(ExitCode))


class Problem(Enum):
    """What went wrong, as a code: an error carries one and its facts (paths, values, GPU
    indices), and `report.error_text` says it in words, as `core.decide.Rule` is a verdict's
    code and `report.reasons` its words. Tests assert on these."""

    # configuration (ConfigError: source and field name where)
    CONFIG_NOT_TOML = "config-not-toml"
    CONFIG_UNKNOWN_KEY = "config-unknown-key"
    CONFIG_WRONG_TYPE = "config-wrong-type"
    CONFIG_INVALID = "config-invalid"  # pydantic's own words for the value, as they are
    CONFIG_NO_FILE = "config-no-file"
    CONFIG_UNREADABLE = "config-unreadable"
    CONFIG_IS_FOLDER = "config-is-folder"
    CONFIG_NOT_UTF8 = "config-not-utf8"
    CONFIG_OS_ERROR = "config-os-error"
    CONFIG_UNTRUSTED = "config-untrusted"  # another account may change the file (found)
    CONFIG_STATE_UNTRUSTED = "config-state-untrusted"  # ... or lock_dir
    LOCK_DIR_NOT_FOLDER = "lock-dir-not-folder"
    LOCK_DIR_NOT_HOSTS = "lock-dir-not-hosts"  # a file of the lookup names another lock_dir
    GRACE_OVER_DEADLINE = "grace-over-deadline"
    SWEEP_BELOW_INTERVAL = "sweep-below-interval"  # [sweep] reap_after_s/drain_after_s
    GPUS_FORM = "gpus-form"
    NOT_ABSOLUTE = "not-absolute"
    NOT_UNIT_NAME = "not-unit-name"
    NOT_CONTAINER = "not-container"
    CONTAINER_TWICE = "container-twice"
    GPU_NOT_REF = "gpu-not-ref"
    GPU_INDEX_RANGE = "gpu-index-range"
    GPU_MIG = "gpu-mig"
    GPU_LIST_EMPTY = "gpu-list-empty"
    GPU_TWICE = "gpu-twice"
    GPU_NO_SUCH_INDEX = "gpu-no-such-index"
    GPU_NO_SUCH_UUID = "gpu-no-such-uuid"
    GPU_UUID_AMBIGUOUS = "gpu-uuid-ambiguous"
    GPU_NO_SUCH_MIG = "gpu-no-such-mig"  # a MIG UUID no slice has
    GPU_NOT_MIG_MODE = "gpu-not-mig-mode"  # MIG-GPU-<uuid>/<gi>/<ci> on a GPU not in MIG mode
    GPU_NO_SUCH_MIG_INSTANCE = "gpu-no-such-mig-instance"  # ... with no such GI/CI
    VARIABLE_VALUE = "variable-value"  # CUDA_VISIBLE_DEVICES & co.: the GPU list's problem
    ROOTS_FORM = "roots-form"
    ROOTS_NOT_ABSOLUTE = "roots-not-absolute"
    ROOTS_NO_FOLDER = "roots-no-folder"
    # NVML
    NVML_LIBRARY_MISSING = "nvml-library-missing"
    NVML_LIBRARY_NOT_FOUND = "nvml-library-not-found"
    NVML_LIBRARY_UNLOADABLE = "nvml-library-unloadable"
    NVML_DRIVER_NOT_LOADED = "nvml-driver-not-loaded"
    NVML_NO_PERMISSION = "nvml-no-permission"
    NVML_INIT_FAILED = "nvml-init-failed"
    NVML_COUNT_FAILED = "nvml-count-failed"
    NVML_GPU_LOST = "nvml-gpu-lost"
    NVML_NOT_SUPPORTED = "nvml-not-supported"
    NVML_CALL_DENIED = "nvml-call-denied"
    NVML_CALL_FAILED = "nvml-call-failed"
    NVML_GPU_CALL_FAILED = "nvml-gpu-call-failed"
    NVML_OWN_GPU_FAULT = "nvml-own-gpu-fault"
    NVML_OWN_GPU_UNREAD = "nvml-own-gpu-unread"
    # units, systemd, programs, the host
    UNIT_NOT_SERVICE_OR_SCOPE = "unit-not-service-or-scope"
    UNIT_NAME_INVALID = "unit-name-invalid"
    UNIT_TEMPLATE = "unit-template"
    UNIT_UNKNOWN = "unit-unknown"
    UNIT_ENV_FILE_UNREADABLE = "unit-env-file-unreadable"
    UNIT_NOT_GIVEN = "unit-not-given"
    PROGRAM_NOT_ANSWERING = "program-not-answering"
    PROGRAM_CANNOT_RUN = "program-cannot-run"
    CGROUP_MOUNTINFO_UNREADABLE = "cgroup-mountinfo-unreadable"
    CGROUP_V1_ONLY = "cgroup-v1-only"
    CGROUP_TREE_ELSEWHERE = "cgroup-tree-elsewhere"
    # state, locks, permissions, signals
    STATE_OS_ERROR = "state-os-error"
    STATE_FILE_IN_THE_WAY = "state-file-in-the-way"
    STATE_FOLDER_IN_THE_WAY = "state-folder-in-the-way"
    NO_PERMISSION_CREATING = "no-permission-creating"
    NO_PERMISSION_WRITING = "no-permission-writing"
    NO_PERMISSION = "no-permission"
    NO_PERMISSION_READING = "no-permission-reading"
    NO_PERMISSION_SIGNAL = "no-permission-signal"
    LOCK_TIMEOUT = "lock-timeout"
    INTERRUPTED = "interrupted"
    INTERRUPTED_DURING = "interrupted-during"  # with the run's Progress: what it was doing
    # a Slurm job's environment
    SLURM_JOB_ID = "slurm-job-id"
    SLURM_JOB_UID = "slurm-job-uid"
    SLURM_GPU_VARIABLE = "slurm-gpu-variable"
    SLURM_GPU_NUMBER = "slurm-gpu-number"  # not a number slurmd writes (a UUID, a range)
    # a node's gres.conf, where slurmd's GPU numbers cannot be resolved for certain
    GRES_SLURM_CONF = "gres-slurm-conf"
    GRES_UNTRUSTED = "gres-untrusted"
    GRES_MISSING = "gres-missing"
    GRES_UNREADABLE = "gres-unreadable"
    GRES_NOT_UTF8 = "gres-not-utf8"
    GRES_LINE = "gres-line"
    GRES_NODE_UNKNOWN = "gres-node-unknown"
    GRES_AUTODETECT = "gres-autodetect"
    GRES_AUTODETECT_MATCH = "gres-autodetect-match"
    GRES_FILE_TWICE = "gres-file-twice"
    GRES_NO_FILES = "gres-no-files"
    GRES_FILE_NOT_GPU = "gres-file-not-gpu"
    GRES_NO_NVML_GPU = "gres-no-nvml-gpu"
    GRES_INDEX_PAST = "gres-index-past"
    GRES_NVML_FAULTS = "gres-nvml-faults"
    # install / uninstall
    INSTALL_NOT_SERVICE = "install-not-service"
    INSTALL_NO_SYSTEMCTL = "install-no-systemctl"
    INSTALL_RELOAD_FAILED = "install-reload-failed"
    INSTALL_RELOAD_ERROR = "install-reload-error"
    INSTALL_TIMER_FAILED = "install-timer-failed"  # systemctl enable|disable gpugate-sweep.timer
    INSTALL_EDITED = "install-edited"
    INSTALL_EDITED_REMOVE = "install-edited-remove"
    INSTALL_UNIT_UNKNOWN = "install-unit-unknown"
    INSTALL_GPUGATE_PATH = "install-gpugate-path"
    INSTALL_GPUGATE_PATH_RELATIVE = "install-gpugate-path-relative"
    # gpugate run
    LAUNCH_NO_COMMAND = "launch-no-command"
    LAUNCH_CONFIG_PATH = "launch-config-path"
    LAUNCH_NO_SYSTEMD_RUN = "launch-no-systemd-run"
    LAUNCH_UNIT_EXISTS = "launch-unit-exists"
    LAUNCH_NVML = "launch-nvml"
    LAUNCH_NO_GPU = "launch-no-gpu"
    LAUNCH_LEASED = "launch-leased"
    LAUNCH_CONFIG_UNWRITABLE = "launch-config-unwritable"
    LAUNCH_NOT_EXECUTABLE = "launch-not-executable"
    LAUNCH_NOT_FOUND = "launch-not-found"
    LAUNCH_CANNOT_RUN = "launch-cannot-run"
    LAUNCH_NAME_NOT_SERVICE = "launch-name-not-service"
    LAUNCH_NAME_NOT_PLAIN = "launch-name-not-plain"
    LAUNCH_SUDO_VARIABLES = "launch-sudo-variables"
    LAUNCH_OTHER_ACCOUNT = "launch-other-account"
    LAUNCH_NAME_TEMPLATE = "launch-name-template"
    LAUNCH_FORCE_NOT_ROOT = "launch-force-not-root"
    # gpugate's own state read back (integrations/records.py: BadRecord, one phrase, no path)
    RECORD_UNREADABLE = "record-unreadable"
    RECORD_NOT_FILE = "record-not-file"
    RECORD_TOO_LARGE = "record-too-large"
    RECORD_NOT_UTF8 = "record-not-utf8"
    RECORD_CONSTANT = "record-constant"
    RECORD_DIGITS = "record-digits"
    RECORD_CHARS = "record-chars"
    RECORD_OUT_OF_RANGE = "record-out-of-range"
    RECORD_NESTED = "record-nested"
    RECORD_NOT_JSON = "record-not-json"
    RECORD_NOT_OBJECT = "record-not-object"
    RECORD_NOT_STRING = "record-not-string"
    RECORD_TOO_LONG = "record-too-long"
    RECORD_NOT_INTEGER = "record-not-integer"
    RECORD_NOT_NUMBER = "record-not-number"
    RECORD_NOT_FLAG = "record-not-flag"
    RECORD_NOT_LIST = "record-not-list"
    RECORD_TOO_MANY = "record-too-many"
    RECORD_WRONG_UNIT = "record-wrong-unit"
    # containers: the OCI hook's input (OciInputError), install --containers (InstallError)
    OCI_STATE_SLOW = "oci-state-slow"
    OCI_STATE_TOO_BIG = "oci-state-too-big"
    OCI_STATE_NO_ID = "oci-state-no-id"
    OCI_STATE_NO_BUNDLE = "oci-state-no-bundle"
    OCI_BUNDLE_UNOPENABLE = "oci-bundle-unopenable"
    OCI_CONFIG_UNOPENABLE = "oci-config-unopenable"
    OCI_NOT_REGULAR = "oci-not-regular"
    OCI_TOO_BIG = "oci-too-big"
    OCI_NOT_OWNERS = "oci-not-owners"
    OCI_WRITABLE = "oci-writable"
    OCI_ENV_TOO_LONG = "oci-env-too-long"
    OCI_NOT_JSON = "oci-not-json"
    OCI_NOT_OBJECT = "oci-not-object"
    OCI_NOT_LIST = "oci-not-list"
    OCI_DEVICE_NOT_GPU = "oci-device-not-gpu"
    OCI_DEVICE_LINK = "oci-device-link"
    OCI_MOUNT_FOLDER = "oci-mount-folder"
    OCI_CDI_NAME = "oci-cdi-name"
    OCI_GPU_MIG = "oci-gpu-mig"
    OCI_GPU_WORD = "oci-gpu-word"
    OCI_GPU_UNKNOWN = "oci-gpu-unknown"
    OCI_ANNOTATION_TOO_LONG = "oci-annotation-too-long"
    OCI_NO_OWN_CGROUP = "oci-no-own-cgroup"  # the container's cgroup is not its own
    PRIVATE_SHM_FORM = "private-shm-form"
    INSTALL_UNREADABLE = "install-unreadable"
    INSTALL_NOT_TOML = "install-not-toml"
    INSTALL_NOT_JSON = "install-not-json"
    INSTALL_NOT_OBJECT = "install-not-object"
    INSTALL_NOT_OUR_HOOK = "install-not-our-hook"
    INSTALL_DEFAULT_RUNTIME = "install-default-runtime"
    INSTALL_NO_WRAPPER = "install-no-wrapper"
    INSTALL_DOCKER_RELOAD = "install-docker-reload"
    INSTALL_UNTRUSTED = "install-untrusted"  # a file install edits that another account may change
    INSTALL_CONTAINERD_VERSION = "install-containerd-version"
    INSTALL_CONTAINERD_RUNTIME_THERE = "install-containerd-runtime-there"  # not gpugate's block
    INSTALL_CONTAINERD_EDIT = "install-containerd-edit"  # the edit would change other settings
    INSTALL_CONTAINERD_DEFAULT = "install-containerd-default"  # uninstall: still the default
    INSTALL_CONTAINERD_DEFAULT_CONFIG = "install-containerd-default-config"
    INSTALL_MARK_UNCLOSED = "install-mark-unclosed"
    RUNTIME_RECORD_VALUE = "runtime-record-value"  # the wrapped runtime's record names no choice
    # the surroundings' refusals
    MANUAL_RUN = "manual-run"
    WORDED = "worded"  # words made before this code existed (`text`): to be given a code


Facts = Mapping[str, object]


class GateError(Exception):
    """A failure with a documented exit code, a `Problem` code and its facts. Its words are
    `report.error_text`'s: `message` is what report/ says of it (report installs its wording
    when it is imported, as it always is where an error reaches an operator)."""

    exit_code: ExitCode = ExitCode.INTERNAL
    wording: ClassVar[Callable[[GateError], str] | None] = None  # set by report.error_text

    def __init__(self, problem: Problem | str, **facts: object) -> None:
        """problem: a str is words made before the codes ("worded"); new errors give a code."""
        if isinstance(problem, str):
            problem, facts = Problem.WORDED, {"text": problem, **facts}
        super().__init__(problem.value)
        self.problem = problem
        self.facts: dict[str, object] = dict(facts)

    @property
    def message(self) -> str:
        wording = GateError.wording
        if wording is None:  # report/ not loaded: the code and facts, still one line
            shown = ", ".join(f"{key}={value!r}" for key, value in self.facts.items())
            return f"{self.problem.value}: {shown}" if shown else self.problem.value
        return wording(self)

    def __str__(self) -> str:
        return self.message


class InvalidValue(ValueError):
    """A value a pydantic validator (or a GPU list's parser) refuses: its code and facts; the
    caller names where it was (file and field, or variable) in a ConfigError."""

    def __init__(self, problem: Problem, **facts: object) -> None:
        super().__init__(problem.value)
        self.problem = problem
        self.facts: dict[str, object] = dict(facts)


class ConfigError(GateError):
    exit_code = ExitCode.CONFIG

    def __init__(self, source: str, field: str, problem: Problem, **facts: object) -> None:
        super().__init__(problem, **facts)
        self.source = source
        self.field = field


class NvmlUnavailable(GateError):
    exit_code = ExitCode.NVML_UNAVAILABLE


class NvmlNotAnswering(GateError):
    """An NVML call did not return in time: the driver is hung (as `nvidia-smi` hangs). Not an
    NvmlUnavailable: its time is spent, so on_nvml_error = "warn" cannot go on without it."""

    exit_code = ExitCode.NVML_NOT_ANSWERING


class Interrupted(GateError):
    """The hook was sent SIGTERM (systemctl stop, a stop job's timeout) or SIGINT (Ctrl-C)."""

    exit_code = ExitCode.INTERRUPTED

    def __init__(
        self,
        problem: Problem | str,
        signal_name: str = "SIGTERM",
        stage: str = "",
        **facts: object,
    ) -> None:
        """stage: the run's stage when it was stopped (core.outcome.Stage's code), "" unknown."""
        super().__init__(problem, signal=signal_name, stage=stage, **facts)
        self.signal_name = signal_name
        self.stage = stage


class ProgramNotAnswering(GateError):
    """systemctl (or another program gpugate needs an answer from) outlived its deadline."""

    exit_code = ExitCode.NVML_UNAVAILABLE


class ProgramNotFound(GateError):
    """A program gpugate needs an answer from is not in the system folders, or cannot run."""

    exit_code = ExitCode.NVML_UNAVAILABLE


class StateUnwritable(GateError):
    """gpugate's own state (locks, leases, failed-start records, metrics) cannot be written:
    no space, a read-only file system, a file where a folder should be. what: the state that
    goes there; cause: the OS's words (strerror) where the problem is STATE_OS_ERROR."""

    exit_code = ExitCode.STATE_UNWRITABLE

    def __init__(
        self,
        path: object,
        what: str,
        problem: Problem = Problem.STATE_OS_ERROR,
        **facts: object,
    ) -> None:
        super().__init__(problem, path=path, what=what, **facts)
        self.path = path
        self.what = what


class PermissionDenied(GateError):
    exit_code = ExitCode.PERMISSION


class UnknownUnit(GateError):
    exit_code = ExitCode.UNKNOWN_UNIT


class LockTimeout(GateError):
    exit_code = ExitCode.LOCK_TIMEOUT


class InstallError(GateError):
    exit_code = ExitCode.INSTALL


class HostUnsupported(GateError):
    exit_code = ExitCode.HOST_UNSUPPORTED


class ManualRunRefused(GateError):
    exit_code = ExitCode.MANUAL_RUN_REFUSED


ECHO_MAX = 60  # characters of a value (or key) an error message repeats


def echo(value: object, *, quote: bool = True, limit: int = ECHO_MAX) -> str:
    """A value as an error message repeats it: repr'd, and cut short (a 10 MB value in a
    config file must not become a 10 MB stderr line)."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"  # the one mark of a cut
