"""The run's shm step, in the finishing stage: the shared memory of the killed (a dry run:
of those it would kill) once they are gone; then, before a start, the free space the next
start needs."""

from __future__ import annotations

import functools

from gpugate.core.outcome import exit_code_for
from gpugate.core.run_state import RunState
from gpugate.core.shm_cleanup import ShmHost, plan, remove, short_of_space
from gpugate.errors import ExitCode
from gpugate.host.nvml import MIB
from gpugate.host.shm import ShmKey
from gpugate.host.systemd import unit_of_cgroup


def clean_shm(state: RunState, would_kill: set[int] | None = None) -> None:
    deps = state.deps
    host = deps.shm_host(state.shm.areas, deps.roots.proc)
    freed = 0
    if state.policy.remove_shm:
        label = functools.partial(shm_label, state)
        if would_kill is not None:
            removals = plan(state.shm.ledger, would_kill, host, label)
            freed = sum(r.facts.bytes for r in removals if r.removed and r.facts)
        else:
            killed = {ident.pid for ident in state.signalled}
            removals = remove(state.shm.ledger, killed, host, label)
        state.narrator.shm_files(removals)
    check_shm_space(state, host, freed)


def check_shm_space(state: RunState, host: ShmHost, freed: int) -> None:
    needed_mib = state.config.shm_min_free_mib
    if (
        needed_mib is None
        or not state.scope.phase.traits.before_start
        or exit_code_for(state.facts) is not ExitCode.OK
    ):
        return
    short = short_of_space(host, needed_mib * MIB, freed)
    if short is None:
        return
    holders: dict[ShmKey, list[int]] = {}
    if short.largest:
        for key, pids in host.holders().by_key.items():
            holders[key] = sorted(pids)
    state.narrator.shm_short(short, holders, functools.partial(shm_label, state))
    state.facts.shm_short = True


def shm_label(state: RunState, pid: int) -> str:
    if pid in state.shm.labels:
        return state.shm.labels[pid]
    info = state.procfs.info(pid)
    if info is None:
        return f"PID {pid}"
    unit = unit_of_cgroup(info.cgroup or "/")
    return f"PID {pid} ({info.comm}, {unit})" if unit else f"PID {pid} ({info.comm})"
