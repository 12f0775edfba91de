"""The config's one model: each setting declared once, as a class attribute whose annotation is
its type and whose `setting(...)` holds its default, bounds, check and description. Strict (TOML
has real types: "yes" is no bool, "2048" no number), frozen, no unknown key. A file's values are
validated by pydantic's engine, `pydantic_core.SchemaValidator`, over a core schema made from
these declarations at the first file that sets something (CONTRIBUTING: why not BaseModel); the
built-in defaults need neither."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional, TypeVar, cast, get_args

from gpugate.config import values
from gpugate.errors import GateError, InvalidValue
from gpugate.host.systemd import validate_unit_name
from gpugate.phase import Phase
from gpugate.untrusted import for_error

if TYPE_CHECKING:
    from pydantic_core import SchemaValidator

OnFailure = Literal["fail", "warn"]
ModelT = TypeVar("ModelT", bound="Model")


class Setting:
    """A field's declaration, `name: type = setting(default, "what it does", ge=1)`: its name
    and type (from the annotation), default, bounds (gt, ge, le), check (it sees the typed value
    and returns it or raises InvalidValue) and words."""

    def __init__(
        self,
        default: Any,
        description: str,
        *,
        check: Callable[[Any], Any] | None = None,
        **bounds: float,
    ) -> None:
        self.name = self.annotation = ""
        self.default, self.description = default, description
        self.check, self.bounds = check, bounds


setting: Any = Setting  # typed Any: `free_mib: int = setting(...)` declares an int


class Model:
    """A frozen table of settings; `model_fields` lists its `Setting`s in declaration order."""

    model_fields: ClassVar[dict[str, Setting]] = {}
    model_fields_set: frozenset[str]

    def __init_subclass__(cls) -> None:
        fields = {}
        # The class's own annotations, as written (strings: `from __future__ import annotations`).
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():  # noqa: RUF063
            declared = cls.__dict__.get(name)
            if isinstance(declared, Setting):
                declared.name, declared.annotation = name, annotation
                fields[name] = declared
        cls.model_fields = fields
        _MODELS[cls.__name__] = cls

    def __init__(self, **changes: Any) -> None:
        """The defaults (no pydantic), or with these fields validated as a file's are."""
        made = type(self).model_validate(changes) if changes else type(self).built_in()
        self.__dict__.update(made.__dict__)

    @classmethod
    def built_in(cls: type[ModelT]) -> ModelT:
        return cls._made({name: field.default for name, field in cls.model_fields.items()}, ())

    @classmethod
    def _made(cls: type[ModelT], fields: dict[str, Any], given: Any) -> ModelT:
        made = object.__new__(cls)
        made.__dict__.update(fields)
        made.__dict__["model_fields_set"] = frozenset(given)
        return made

    @classmethod
    def model_validate(cls: type[ModelT], data: object) -> ModelT:
        """data validated by pydantic's engine over the model's core schema, built once (0.35 ms
        here); pydantic_core.ValidationError names the first field refused."""
        if cls not in _VALIDATORS:
            from pydantic_core import SchemaValidator  # noqa: PLC0415 - only where a file sets

            _VALIDATORS[cls] = SchemaValidator(_table_schema(cls, cls.built_in()), {"strict": True})
        return cast(ModelT, _VALIDATORS[cls].validate_python(data))

    def checked(self: ModelT) -> ModelT:
        """Once every field passed: a rule across fields, raising InvalidValue."""
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise ValueError(f"{type(self).__name__} is frozen: {name} cannot be set")

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return ((name, self.__dict__[name]) for name in self.model_fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Model) and type(other) is type(self) and dict(self) == dict(other)

    def __hash__(self) -> int:
        return hash(tuple(dict(self).values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self)})"

    def model_dump(self, *, exclude_defaults: bool = False) -> dict[str, Any]:
        """The fields as JSON holds them (lists for tuples, text for paths), tables as dicts."""
        dumped: dict[str, Any] = {}
        for name, value in self:
            if exclude_defaults and value == self.model_fields[name].default:
                continue
            dumped[name] = value
            if isinstance(value, Model):
                dumped[name] = value.model_dump(exclude_defaults=exclude_defaults)
            elif isinstance(value, (tuple, PurePath)):
                dumped[name] = list(value) if isinstance(value, tuple) else str(value)
        return dumped


_MODELS: dict[str, type[Model]] = {}


def to_plain(value: Any) -> Any:
    """A validated value as marshal keeps it: a table as ("table", its model, its fields, the
    keys its file set), a path as ("path", text), a tuple as ("tuple", items); None, bool, int,
    float and str as they are. TypeError for anything else."""
    if isinstance(value, Model):
        fields = tuple((name, to_plain(item)) for name, item in value)
        return ("table", type(value).__name__, fields, tuple(sorted(value.model_fields_set)))
    if isinstance(value, PurePath):
        return ("path", str(value))
    if isinstance(value, tuple):
        return ("tuple", tuple(to_plain(item) for item in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{type(value).__name__} has no plain form")


def from_plain(plain: Any) -> Any:
    """to_plain's value back, without validating it again; ValueError or LookupError for
    anything to_plain does not make (a table whose model's fields have changed among them)."""
    if not isinstance(plain, tuple):
        return plain
    kind, *rest = plain
    if kind == "path":
        return Path(*rest)
    if kind == "tuple":
        return tuple(from_plain(item) for item in rest[0])
    if kind != "table":
        raise ValueError(f"{kind!r} is no plain form")
    name, fields, given = rest
    model = _MODELS[name]
    made = {field: from_plain(item) for field, item in fields}
    if list(made) != list(model.model_fields):
        raise ValueError(f"{name}'s fields are not {list(made)}")
    return model._made(made, given)


_VALIDATORS: dict[type[Model], SchemaValidator] = {}


def _table_schema(model: type[Model], defaults: Model) -> Any:
    """A table: its keys, each defaulting to `defaults`' value (a phase keeps its own), none
    other; an instance of the model (changed(), tests) passes as its fields."""
    from pydantic_core import core_schema as cs  # noqa: PLC0415

    fields = {}
    for name, field in model.model_fields.items():
        default, optional = getattr(defaults, name), field.annotation.startswith("Optional[")
        inner = field.annotation[len("Optional[") : -1] if optional else field.annotation
        if inner in _MODELS:
            schema = _table_schema(_MODELS[inner], default)
        elif inner in _SCHEMAS:
            schema = _SCHEMAS[inner](cs, field.bounds)
        else:
            raise TypeError(f"{name}: {field.annotation}: no core schema for it in _SCHEMAS")
        if field.check is not None:
            schema = cs.no_info_after_validator_function(field.check, schema)
        schema = cs.nullable_schema(schema) if optional else schema
        fields[name] = cs.typed_dict_field(
            cs.with_default_schema(schema, default=default), required=False
        )
    table = cs.typed_dict_schema(fields, strict=True, extra_behavior="forbid")

    def made_from(value: Any, handler: Any) -> Model:
        if isinstance(value, Model):
            value = dict(value)
        given = frozenset(value) if isinstance(value, dict) else ()
        return model._made(handler(value), given).checked()

    return cs.no_info_wrap_validator_function(made_from, table)


# Each annotation a field may have, as pydantic's core schema (strict unless said).
_SCHEMAS: dict[str, Callable[[Any, dict[str, float]], Any]] = {
    "bool": lambda cs, bounds: cs.bool_schema(strict=True),
    "int": lambda cs, bounds: cs.int_schema(strict=True, **bounds),
    "float": lambda cs, bounds: cs.float_schema(strict=True, **bounds),  # an int is a float
    "str": lambda cs, bounds: cs.str_schema(strict=True),
    "OnFailure": lambda cs, bounds: cs.literal_schema(list(get_args(OnFailure))),
    # A TOML string; a Path where the code passes one.
    "Path": lambda cs, bounds: cs.no_info_before_validator_function(
        lambda value: str(value) if isinstance(value, PurePath) else value,
        cs.no_info_after_validator_function(Path, cs.str_schema(strict=True)),
    ),
    # A TOML array (a tuple where the code passes one), each item strict.
    "tuple[str, ...]": lambda cs, bounds: cs.no_info_after_validator_function(
        tuple, cs.list_schema(cs.str_schema(strict=True), strict=False)
    ),
    "tuple[int, ...]": lambda cs, bounds: cs.no_info_after_validator_function(
        tuple, cs.list_schema(cs.int_schema(strict=True, **bounds), strict=False)
    ),
    # "auto", "all" or a list of GPUs, in values.gpu_refs' words.
    "values.GpusSetting": lambda cs, bounds: cs.no_info_plain_validator_function(_gpus),
}


def _gpus(value: object) -> values.GpusSetting:
    if value in ("all", "auto"):
        return cast(values.GpusSetting, value)
    if not isinstance(value, (list, tuple)):
        raise InvalidValue('must be "all", "auto" or a list of GPU indices or UUIDs, e.g. [0, 1]')
    return values.gpu_refs(value)


def _not_below_interval(value: float) -> float:
    if value < values.SWEEP_INTERVAL_S:
        raise InvalidValue(
            f"{value} s is below the sweep timer's interval ({values.SWEEP_INTERVAL_S} s): "
            "a holder could not be seen unowned that long by two sweeps"
        )
    return value


def _tmpfs_size(value: str) -> str:
    # It goes into the drop-in's TemporaryFileSystem= line: nothing but a size passes.
    if value != values.PRIVATE_SHM_OFF and not values.PRIVATE_SHM_SIZE.fullmatch(value):
        raise InvalidValue(
            f'{for_error(value)}: "off", a percentage of RAM ("50%") or a size in k, m or g ("64g")'
        )
    return value


def _absolute_executables(value: tuple[str, ...]) -> tuple[str, ...]:
    for path in value:
        if not path.startswith("/"):
            raise InvalidValue(
                f"{for_error(path)} is not an absolute path" if path else "must be an absolute path"
            )
    return value


def _unit_names(value: tuple[str, ...]) -> tuple[str, ...]:
    for name in value:
        try:
            validate_unit_name(name)
        except GateError:
            raise InvalidValue(
                f"{for_error(name)} is not a service or scope unit name with its suffix (e.g. "
                "nvidia-persistenced.service)"
            ) from None
    return value


def _container_names(value: tuple[str, ...]) -> tuple[str, ...]:
    for item in value:
        if not values.CONTAINER_NAME.fullmatch(item):
            raise InvalidValue(f"{for_error(item)} is not a container name or id")
    if len(set(value)) != len(value):
        raise InvalidValue("lists a container twice")
    return value


def _absolute_path(value: Path) -> Path:
    if not value.is_absolute():
        raise InvalidValue("must be an absolute path")
    return value


class PhasePolicy(Model):
    """What one phase (pre, post, prolog, epilog) may kill and how long it waits."""

    kill_orphans: bool = setting(
        True, "Kill holders outside any unit (a server started by hand from ssh)?"
    )
    kill_app_tree: bool = setting(
        True, "Also kill the rest of such a holder's application (never a login shell)."
    )
    sigterm_grace_s: float = setting(10.0, "Seconds between SIGTERM and SIGKILL.", gt=0, le=3600)
    sigkill_wait_s: float = setting(
        5.0, "Seconds after SIGKILL before a survivor is reported.", gt=0, le=3600
    )
    wait_timeout_s: float = setting(
        120.0, "Deadline for the whole run (kill and memory wait), in seconds.", gt=0, le=86400
    )
    on_timeout: OnFailure = setting(
        "fail", 'Memory not freed by the deadline: "fail" (the run fails) or "warn".'
    )
    on_nvml_error: OnFailure = setting(
        "fail", 'NVML unusable: "fail" (the run fails) or "warn" (clean the cgroup only).'
    )
    remove_shm: bool = setting(
        True,
        "Remove the /dev/shm files the killed processes held open or mapped, once they are "
        "gone, where no other process holds them (docs/shared-memory.md).",
    )

    @classmethod
    def of(cls, phase: Phase) -> PhasePolicy:
        """A phase's built-in policy: post alone spares holders outside any unit."""
        kills = phase.traits.kills_orphans
        fields = {**dict(cls.built_in()), "kill_orphans": kills, "kill_app_tree": kills}
        return cls._made(fields, ())

    def checked(self) -> PhasePolicy:
        kill_s = self.sigterm_grace_s + self.sigkill_wait_s
        if kill_s >= self.wait_timeout_s:
            raise InvalidValue(
                f"sigterm_grace_s + sigkill_wait_s ({kill_s:g} s) must be below wait_timeout_s "
                f"({self.wait_timeout_s:g} s), which also holds the memory wait"
            )
        return self


class SweepPolicy(Model):
    """`gpugate sweep` (the gpugate-sweep.timer): what it may do to GPU memory nobody owns."""

    reap_after_s: Optional[float] = setting(
        None,
        "Kill a holder unowned this many seconds, with pre's rules, on GPUs nothing holds a "
        "lease on (not set: report only).",
        check=_not_below_interval,
        le=values.MAX_SWEEP_AGE_S,
    )
    drain_after_s: Optional[float] = setting(
        None,
        "Where slurmd runs: drain the node once a GPU holds memory unowned this many seconds "
        "(not set: never).",
        check=_not_below_interval,
        le=values.MAX_SWEEP_AGE_S,
    )
    reap_sessions: bool = setting(
        False,
        "Reap (reap_after_s) a holder in a logind session its user is still logged in to, as "
        "one nobody owns (not set: shown as owner `session`, never reaped).",
    )


class GateConfig(Model):
    """A unit's, a job's or a container's config: the file's tables are its fields."""

    gpus: values.GpusSetting = setting(
        "auto",
        'The unit\'s GPUs: "auto" (its own CUDA_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES, '
        'else all), "all", or indices, UUIDs and MIG slices, e.g. [0, 1] or ["MIG-..."].',
    )
    free_mib: int = setting(
        1024,
        "Per GPU, MiB used at or below which the GPU counts as free (drivers keep some).",
        ge=1,
    )
    kill_other_units: bool = setting(
        False,
        "May processes of another active unit holding these GPUs be killed? "
        "(Never a way to share a GPU: that is share_gpus.)",
    )
    share_gpus: bool = setting(
        False,
        "Share these GPUs on purpose with other units, runs and containers that share them: "
        "their processes are never killed or waited for; orphans still are.",
    )
    protected_executables: tuple[str, ...] = setting(
        (
            "/usr/bin/nvidia-persistenced",
            # CUDA MPS (docs/mps.md): the control daemon and the server it starts for a client
            *values.MPS_EXECUTABLES,
            "/usr/bin/nv-hostengine",
            "/usr/bin/dcgm-exporter",
            "/usr/bin/nvidia-smi",
            "/usr/bin/Xorg",
            "/usr/lib/xorg/Xorg",
        ),
        "Never killed, by exact /proc/PID/exe path.",
        check=_absolute_executables,
    )
    protected_units: tuple[str, ...] = setting(
        (
            "nvidia-persistenced.service",
            "nvidia-dcgm.service",
            "dcgm-exporter.service",
            "nvidia-fabricmanager.service",
            "display-manager.service",
        ),
        "Never killed, by the unit their cgroup belongs to.",
        check=_unit_names,
    )
    ports: tuple[int, ...] = setting(
        (),
        "The unit's TCP ports: before it starts (pre), a process listening on one is a holder "
        "like a GPU holder, and pre returns once they are free.",
        ge=1,
        le=65535,
    )
    pre: PhasePolicy = setting(PhasePolicy.of(Phase.PRE), "ExecStartPre=: before the unit starts.")
    post: PhasePolicy = setting(
        PhasePolicy.of(Phase.POST), "ExecStopPost=: after the unit stopped."
    )
    prolog: PhasePolicy = setting(PhasePolicy.of(Phase.PROLOG), "Slurm's Prolog=.")
    epilog: PhasePolicy = setting(PhasePolicy.of(Phase.EPILOG), "Slurm's Epilog=.")
    sweep: SweepPolicy = setting(SweepPolicy.built_in(), "gpugate sweep, the timer's.")
    lock_dir: Path = setting(
        values.DEFAULT_LOCK_DIR,
        "Folder of gpugate's per-GPU locks (best on a tmpfs such as /run).",
        check=_absolute_path,
    )
    metrics_textfile: Optional[Path] = setting(
        None,
        "node_exporter textfile rewritten after each run (not set: no metrics).",
        check=_absolute_path,
    )
    containers: tuple[str, ...] = setting(
        (),
        "Containers (names or ids) that are the unit's own (`docker run --name`).",
        check=_container_names,
    )
    shm_min_free_mib: Optional[int] = setting(
        None,
        "pre (and prolog) fail with exit 29 when /dev/shm has less free after their cleanup "
        "(not set: no check).",
        ge=1,
    )
    private_shm: str = setting(
        values.DEFAULT_PRIVATE_SHM,
        "The unit's own /dev/shm, which the kernel frees when its last process ends: its size "
        '("50%" of RAM, "64g", "16384m"; what `gpugate install` and `gpugate run` write as '
        'TemporaryFileSystem=/dev/shm), or "off": the unit shares the host\'s.',
        check=_tmpfs_size,
    )

    def selection(self) -> values.GpuSelection:
        """The GPUs once "auto" is resolved (left unresolved: every GPU)."""
        return "all" if self.gpus == "auto" else self.gpus

    def changed(self, **changes: object) -> GateConfig:
        """A copy with these fields changed, validated as a file's are (file.replaced is not)."""
        return GateConfig.model_validate({**dict(self), **changes})

    def policy(self, phase: Phase) -> PhasePolicy:
        return cast(PhasePolicy, getattr(self, phase.value))  # a field per phase, named after it


DEFAULTS = GateConfig.built_in()
