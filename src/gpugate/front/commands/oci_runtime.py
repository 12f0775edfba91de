"""`gpugate-oci-runtime`: an OCI runtime for docker and containerd, which run only the hooks in
a container's spec. On `create` of a GPU container it adds gpugate's createRuntime and poststop
hooks to config.json, then execs the runtime it wraps (runc, or NVIDIA's where install recorded
it) with its arguments unchanged."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gpugate.errors import BadInput, ConfigError, ExitCode
from gpugate.host.oci import hook_entry, json_object, not_host_root, read_config, spec_gpu_request
from gpugate.host.safe_files import write_in
from gpugate.host.wrapped_runtime import CHAIN, PATHS, RUNC, choose, read_record

# runc's global options that take a value (`runc --help`): the command is the first word
# that is neither an option nor such an option's value.
VALUE_OPTIONS = frozenset({"--root", "--log", "--log-format", "--criu", "--rootless"})
HOOK_STAGES = ("createRuntime", "poststop")
GPUGATE_PATHS = ("/usr/bin/gpugate", "/usr/local/bin/gpugate")


def command_of(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    words = iter(argv)
    for word in words:
        if word in VALUE_OPTIONS:
            next(words, None)  # its value
        elif not word.startswith("-"):
            return word, list(words)
    return None, []


def bundle_of(args: Sequence[str]) -> str:
    """`create`'s --bundle / -b (default: the working folder, as runc has it)."""
    for position, word in enumerate(args):
        if word in ("--bundle", "-b") and position + 1 < len(args):
            return args[position + 1]
        if word.startswith(("--bundle=", "-b=")):
            return word.partition("=")[2]
    return os.getcwd()


def with_hooks(
    spec: dict[str, object], gpugate: str | Sequence[str], *, always: bool = False
) -> bool:
    """False where it has them already; always: even without GPUs (NVIDIA's may add some)."""
    if not always and not spec_gpu_request(spec):
        return False
    hooks = spec.setdefault("hooks", {})
    if not isinstance(hooks, dict):
        raise BadInput("config.json: hooks: not a JSON object")
    changed = False
    for stage in HOOK_STAGES:
        entries = hooks.setdefault(stage, [])
        if not isinstance(entries, list):
            raise BadInput(f"config.json: hooks.{stage}: not a list")
        entry = hook_entry(gpugate, stage)
        if not any(isinstance(e, dict) and e.get("args") == entry["args"] for e in entries):
            entries.append(entry)
            changed = True
    return changed


def add_hooks(bundle: str, gpugate: Sequence[str], *, always: bool = False) -> bool:
    """config.json rewritten in place (safe_files.write_in, same mode)."""
    spec = json_object(read_config(bundle), f"{bundle}/config.json")
    if not with_hooks(spec, gpugate, always=always):
        return False
    fd = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        mode = os.stat("config.json", dir_fd=fd).st_mode & 0o777
        write_in(fd, "config.json", json.dumps(spec).encode(), mode)
    finally:
        os.close(fd)
    return True


def main(argv: Sequence[str]) -> int:
    """Returns only where the wrapped runtime cannot be run."""
    command, args = command_of(argv)
    creating = command in ("create", "run")
    try:
        recorded = read_record()
    except ConfigError as exc:
        if creating:  # a GPU container must not start without the runtime the host chose
            print(f"gpugate-oci-runtime: {exc.message}", file=sys.stderr)
            return int(exc.exit_code)
        recorded = RUNC  # state, kill, delete: NVIDIA's runtime passes them to runc unchanged
    wrapped = choose(recorded, os.environ)
    if wrapped.path is None:
        print(f"gpugate-oci-runtime: no runc in {', '.join(PATHS[RUNC])}", file=sys.stderr)
        return int(ExitCode.NVML_UNAVAILABLE)
    # A rootless runtime's hooks would gate nothing, and its bundle is its user's to write.
    if creating and not_host_root() is None:
        beside = str(Path(sys.argv[0]).absolute().parent / "gpugate")  # a venv's bin/, /usr/bin
        found = (p for p in (beside, *GPUGATE_PATHS) if os.access(p, os.X_OK))
        gpugate = next(found, GPUGATE_PATHS[0])
        try:
            add_hooks(bundle_of(args), (gpugate,), always=wrapped.name != RUNC)
        except (BadInput, OSError) as exc:
            # A GPU container without its gate must not start unnoticed: the create fails.
            print(f"gpugate-oci-runtime: {exc}", file=sys.stderr)
            return int(getattr(exc, "exit_code", ExitCode.STATE_UNWRITABLE))
    chain = {CHAIN: wrapped.name} if wrapped.name != RUNC else {}  # NVIDIA's may run us again
    os.execve(wrapped.path, [wrapped.path, *argv], {**os.environ, **chain})  # noqa: S606
    return int(ExitCode.INTERNAL)  # not reached: execve replaced this process
