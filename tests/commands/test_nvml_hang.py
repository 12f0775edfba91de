"""A driver that stops answering (issue 18, item 2), through real pynvml and the stand-in
libnvidia-ml.so.1 whose `hang` settings make NVML calls block until they are cleared: a hook
ends at its deadline with exit 26 and one line naming the call, the GPU and how long; `status`
ends within its own few seconds with what it could read; the post of that start does not ask
NVML again. Each gpugate runs as a command, as systemd runs it: the process must still exit
while a call hangs. The subprocess time limits are generous bounds that prove "no hang"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpugate.errors import ExitCode
from tests.fake_nvml.build import BuildError, build_fake_nvml

UNIT = "vllm.service"
NO_HANG_S = 60  # far above every deadline below: reaching it means gpugate hung


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_fake_nvml(tmp_path_factory.mktemp("nvml")).parent
    except BuildError as exc:
        pytest.skip(f"cannot build the stand-in NVML: {exc}")


@dataclass
class Driver:
    """The stand-in driver's settings and state, and gpugate run against it."""

    root: Path
    lib: Path

    @property
    def settings(self) -> Path:
        return self.root / "nvml.conf"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    def set(self, extra: str = "") -> None:
        text = f"dev_root = {self.dev}\nstate_dir = {self.state}\n{extra}\n"
        tmp = self.settings.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.settings)  # the library re-reads it at every call: never half

    def hung_calls(self) -> list[str]:
        log = self.state / "hung.log"
        return log.read_text().splitlines() if log.exists() else []

    def config(self, phase: str = "pre", wait_s: float = 2) -> Path:
        path = self.root / "c.toml"
        path.write_text(
            f'lock_dir = "{self.root}/locks"\ngpus = [0, 1]\n[{phase}]\n'
            f"wait_timeout_s = {wait_s}\nsigterm_grace_s = 0.5\nsigkill_wait_s = 0.5\n"
        )
        return path

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "FAKE_NVML_CONFIG": str(self.settings),
            **extra,
        }

    def roots_args(self) -> list[str]:
        """The stand-in roots, by the hidden option (never the environment: hardening.md)."""
        return [
            "--host-roots",
            f"dev={self.dev},cgroup={self.root / 'cgroup'},run={self.root}",
            "--nvml-library",
            str(self.lib / "libnvidia-ml.so.1"),
        ]

    def gpugate(self, *args: str, **env: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "gpugate", *self.roots_args(), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(**env),
        )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=NO_HANG_S)
    return proc.returncode, out, err


@pytest.fixture
def driver(fake_lib: Path, tmp_path: Path) -> Iterator[Driver]:
    found = Driver(tmp_path, fake_lib)
    found.dev.mkdir()
    for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl"]:
        (found.dev / name).write_bytes(b"")
    (found.state / "leak").mkdir(parents=True)
    (found.root / "cgroup" / "system.slice" / UNIT).mkdir(parents=True)
    (found.root / "cgroup" / "system.slice" / UNIT / "cgroup.procs").write_text("")
    found.set()
    yield found
    found.set()  # a hung call of a process still around returns, and it exits


def test_hang_at_init_ends_pre_at_its_deadline_then_a_start_succeeds(driver: Driver) -> None:
    driver.set("hang = 1")
    code, _, err = finish(driver.gpugate("pre", UNIT, "--config", str(driver.config(wait_s=2))))
    assert code == ExitCode.NVML_NOT_ANSWERING, err
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("gpugate: ") and len(err.strip().splitlines()) == 1  # no traceback
    assert [c.split()[1] for c in driver.hung_calls()] == ["nvmlInit"]
    record = driver.root / "locks" / "failed" / f"{UNIT}.json"
    assert json.loads(record.read_text())["exit_code"] == ExitCode.NVML_NOT_ANSWERING

    driver.set()  # the driver answers again
    code, _, err = finish(driver.gpugate("pre", UNIT, "--config", str(driver.config())))
    assert code == ExitCode.OK, err


@pytest.mark.message
def test_hang_mid_run_names_the_call_and_the_gpu(driver: Driver) -> None:
    (driver.state / "leak" / "1").write_text("50000")  # pre waits for this memory
    proc = driver.gpugate("pre", UNIT, "--config", str(driver.config(wait_s=4)))
    assert proc.stderr is not None
    for line in proc.stderr:  # handshake: the memory wait has begun
        if "waiting for the driver to free memory" in line:
            break
    else:
        raise AssertionError("pre never waited for memory")
    driver.set("hang_gpus = 1")
    code, _, err = finish(proc)
    assert code == ExitCode.NVML_NOT_ANSWERING, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gpugate: NVML is not answering: ") and " on GPU 1 " in last
    assert any(call.endswith(" 1") for call in driver.hung_calls())


def test_post_of_that_start_does_not_ask_nvml_again(driver: Driver) -> None:
    driver.set("hang = 1")
    start = {"INVOCATION_ID": "7f3c0ffee", "SERVICE_RESULT": "exit-code"}
    pre = driver.gpugate("pre", UNIT, "--config", str(driver.config(wait_s=2)), **start)
    assert finish(pre)[0] == ExitCode.NVML_NOT_ANSWERING
    calls = len(driver.hung_calls())
    # post's own deadline is long: asking NVML would hang it for all of it
    post = driver.gpugate("post", UNIT, "--config", str(driver.config("post", 45)), **start)
    code, _, err = finish(post)
    assert code == ExitCode.OK, err
    assert len(driver.hung_calls()) == calls, "post made no NVML call"


@pytest.mark.parametrize("fault", ["hang = 1", "hang_gpus = 5"])
@pytest.mark.root("not root, status first warns that holders may be missing")
def test_status_ends_with_what_it_could_read(driver: Driver, fault: str) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; f = open(sys.argv[1]); print(1, flush=True); time.sleep(600)",
            str(driver.dev / "nvidia3"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
        driver.set(fault)
        code, out, err = finish(driver.gpugate("status"))
    finally:
        holder.kill()
        holder.wait()
    assert code == ExitCode.NVML_NOT_ANSWERING, err
    assert len(err.strip().splitlines()) == 1
    rows = {row.split()[0]: row for row in out.splitlines() if row.strip()}
    assert "3!" in rows  # the GPU NVML did not answer for is marked, its row kept
    holder_row = next(r for r in out.splitlines() if r.lstrip().startswith(str(holder.pid)))
    assert holder_row.split()[5] == "3", "its GPU, from /dev/nvidia3 alone"


def test_sigterm_while_nvml_hangs_stops_at_once(driver: Driver) -> None:
    # The run waits on a hung nvmlInit (its deadline is far away); systemctl stop's SIGTERM
    # ends it at once, the hung call notwithstanding.
    driver.set("hang = 1")
    proc = driver.gpugate("pre", UNIT, "--config", str(driver.config(wait_s=3 * NO_HANG_S)))
    while not driver.hung_calls():  # handshake: the stand-in driver says the call blocks
        assert proc.poll() is None, "pre ended before NVML hung"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == ExitCode.INTERRUPTED, err
