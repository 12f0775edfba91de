"""The unit's gpugate configuration as a run reads it: the built-in defaults
(`config.values.DefaultConfig`, no pydantic) where no file sets anything, else pydantic's model
of the file (`config.schema.GateConfig`, built on first use); and the loaded result.

Where the file is found and how it is read is `config.file`. Only what an operator sets
lives here; where gpugate looks (/dev, /proc, the cgroup tree) is `host.HostRoots`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from gpugate.config.values import DefaultConfig, DefaultPolicy

if TYPE_CHECKING:
    from gpugate.config.schema import GateConfig, PhasePolicy

Config = Union["GateConfig", DefaultConfig]
Policy = Union["PhasePolicy", DefaultPolicy]

# pydantic v2 reads it each time it builds a model's validator: "__all__" loads no plugin and
# skips the scan of every installed distribution's entry points (importlib.metadata).
NO_PLUGINS = "PYDANTIC_DISABLE_PLUGINS"


def pydantic_config() -> type[GateConfig]:
    """pydantic's model of a config file, built at the first call with pydantic's plugin scan
    off: gpugate loads no pydantic plugin. The variable is put back at once, so that nothing
    gpugate starts (`gpugate run`'s workload) inherits it."""
    saved = os.environ.get(NO_PLUGINS)
    os.environ[NO_PLUGINS] = "__all__"
    try:
        from gpugate.config.schema import GateConfig  # noqa: PLC0415 - pydantic on demand
    finally:
        if saved is None:
            del os.environ[NO_PLUGINS]
        else:
            os.environ[NO_PLUGINS] = saved
    return GateConfig


def validated(config: Config) -> GateConfig:
    """The config as pydantic's model (to change a field as a file would, or dump it)."""
    if isinstance(config, DefaultConfig):
        return pydantic_config().model_validate(dataclasses.asdict(config))
    return config


def replaced(config: Config, **changes: Any) -> Config:
    """A copy with these fields changed, as the code chose them (not validated: no file said
    them): the defaults stay the defaults' type, a file's config pydantic's."""
    if isinstance(config, DefaultConfig):
        return dataclasses.replace(config, **changes)
    return config.model_copy(update=changes)


def replaced_policy(policy: Policy, **changes: Any) -> Policy:
    """A phase's policy with these fields changed, as `replaced`."""
    if isinstance(policy, DefaultPolicy):
        return dataclasses.replace(policy, **changes)
    return policy.model_copy(update=changes)


def fields_set(config: Config) -> frozenset[str]:
    """The fields the file set (none: the built-in defaults)."""
    if isinstance(config, DefaultConfig):
        return frozenset()
    return frozenset(config.model_fields_set)


@dataclass(frozen=True)
class LoadedConfig:
    config: Config
    source: str  # the file it came from, or BUILTIN_SOURCE
