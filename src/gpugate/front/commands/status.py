"""`gpugate status [UNIT] [--json|--watch]`: the GPUs and the processes holding them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpugate.errors import ExitCode, NvmlNotAnswering
from gpugate.front.commands import Front
from gpugate.host.nvml import GpuDriver, NotAnswering
from gpugate.host.roots import HostRoots
from gpugate.host.systemd import unit_argument, validate_unit_name
from gpugate.report import lines

if TYPE_CHECKING:
    from gpugate.config.models import LoadedConfig
    from gpugate.core.discover import DeviceScanner


def status(
    front: Front,
    unit_given: str | None,
    config: Path | None,
    *,
    as_json: bool = False,
    watch: bool = False,
) -> int:
    """as_json: stable JSON (docs/status-json.md); watch: redraw every second, as watch(1)."""
    from gpugate.front.status import render_json, render_table  # noqa: PLC0415
    from gpugate.integrations.config_files import load_config  # noqa: PLC0415

    roots = front.host_roots()
    unit = validate_unit_name(unit_argument(unit_given)) if unit_given else None
    loaded = load_config(unit, config)
    driver = front.driver_factory()
    try:
        warned: list[str] = []
        look = Look(unit, loaded, driver, roots, warned)
        if watch:
            from gpugate.host.scan import WatchScan  # noqa: PLC0415

            look.scanner = WatchScan()
        while True:
            data = look()
            hung = driver.not_answering()
            if not watch:
                print(render_json(data) if as_json else render_table(data), flush=True)
                if hung is not None:
                    print(lines.error(hung.message), file=sys.stderr, flush=True)
                    return int(hung.exit_code)
                return int(ExitCode.GPU_UNREADABLE if data["unreadable_gpus"] else ExitCode.OK)
            if hung is not None:
                raise hung  # --watch: no next look can answer
            # Home and clear the screen, then the table, as watch(1) draws it.
            header = f"every 1 s: gpugate status{' ' + unit if unit else ''}    (Ctrl-C ends)"
            print(f"\x1b[H\x1b[J{header}\n\n{render_table(data)}", flush=True)
            time.sleep(1)
    except KeyboardInterrupt:
        return int(ExitCode.OK)  # how --watch ends
    except BrokenPipeError:
        # `gpugate status | head`: the reader has all it wanted. Point stdout at /dev/null so
        # that the interpreter's last flush does not fail once more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return int(ExitCode.OK)
    finally:
        driver.close()


class Look:
    """One look for `status`, again at each --watch tick; a warning about unreadable holders is
    said once (warned). Each look reads /proc with one ProcFs, in one oneshot(): discovery and
    the JSON's rules share what it read."""

    def __init__(
        self,
        unit: str | None,
        loaded: LoadedConfig,
        driver: GpuDriver,
        roots: HostRoots,
        warned: list[str],
    ) -> None:
        from gpugate.core.discover import full_scan  # noqa: PLC0415

        self.unit = unit
        self.loaded = loaded
        self.driver = driver
        self.roots = roots
        self.warned = warned
        self.scanner: DeviceScanner = full_scan

    def __call__(self) -> dict[str, Any]:
        from gpugate.front.status import (  # noqa: PLC0415
            as_dict,
            collect,
            device_minors,
            state_warnings,
            unreadable_warning,
        )
        from gpugate.host.procfs import ProcFs  # noqa: PLC0415

        unit, loaded, roots = self.unit, self.loaded, self.roots
        procfs = ProcFs(roots.proc)
        with procfs.oneshot():
            try:
                discovery = collect(
                    unit, loaded, self.driver, roots, procfs=procfs, scanner=self.scanner
                )
            except NvmlNotAnswering as exc:
                # Hung before it named a GPU: what /dev and /proc show, without NVML.
                driver = NotAnswering(exc, device_minors(roots))
                discovery = collect(unit, loaded, driver, roots, procfs=procfs)
            for warning in [unreadable_warning(discovery), *state_warnings(loaded)]:
                if warning and warning not in self.warned:  # once, also in --watch
                    print(warning, file=sys.stderr, flush=True)
                    self.warned.append(warning)
            return as_dict(discovery, loaded, roots, procfs)
