"""CUDA MPS between starts (docs/mps.md): `status` and `gpugate sweep` name each client with
its MiB and owner; an orphaned client is `nobody`'s with its memory (the documented alert
fires), is reaped, and the protected server is neither counted as nobody's nor signalled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpugate.errors import ExitCode
from gpugate.front.cli import main
from gpugate.front.commands.sweep import sweep
from tests.commands.test_sweep import at, front, metric
from tests.fakes import FakeHost, alive
from tests.unit.test_mps import start_server


def config(host: FakeHost, exe: Path, reap: str = "") -> Path:
    path = host.root / "mps.toml"
    path.write_text(
        f'lock_dir = "{host.root / "locks"}"\n'
        f'metrics_textfile = "{host.root / "metrics" / "gpugate.prom"}"\n'
        f'protected_executables = ["{exe}"]\n'
        "[pre]\nsigterm_grace_s = 1.0\nsigkill_wait_s = 1.0\nwait_timeout_s = 20.0\n"
        f"[sweep]\n{reap}\n"
    )
    return path


def test_status_and_the_sweep_name_an_orphaned_client_with_its_mib(
    host: FakeHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(host, tmp_path, (0, 1))
    host.memory.claim(server, {0, 1}, 300)
    (client,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(client, {0}, 9000)
    host.memory.mps_clients.add(client)
    path = config(host, tmp_path / "bin" / "nvidia-cuda-mps-server")

    code = main(
        ["status", "--json", "--config", str(path)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )
    assert code == ExitCode.OK
    holders = {h["pid"]: h for h in json.loads(capsys.readouterr().out)["holders"]}
    assert holders[client]["used_mib"] == {"0": 9000} and holders[client]["mps_client"] == [0]
    assert (holders[client]["owner"], holders[client]["mps_server"]) == ("nobody", False)
    assert (holders[server]["owner"], holders[server]["mps_server"]) == ("protected", True)
    assert holders[server]["mps_client"] == []

    assert sweep(path, front(host), **at(1000.0)) == ExitCode.OK
    assert metric(host, "gpugate_gpu_memory_mib", gpu="0", owner="nobody") == 9000
    assert metric(host, "gpugate_gpu_memory_mib", gpu="0", owner="protected") == 300
    assert metric(host, "gpugate_gpu_memory_mib", gpu="0", owner="unlisted") == 0
    (seen,) = host.journal.events("unowned_seen")
    assert (seen["GPUGATE_PID"], seen["GPUGATE_USED_MIB"]) == (str(client), "9000")

    path = config(host, tmp_path / "bin" / "nvidia-cuda-mps-server", "reap_after_s = 60")
    assert sweep(path, front(host), **at(1061.0)) == ExitCode.OK
    assert not alive(client) and alive(server)
    assert {e["GPUGATE_PID"] for e in host.journal.events("signal_sent")} == {str(client)}


def test_the_table_marks_mps_server_and_client(
    host: FakeHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(host, tmp_path, (0,))
    host.memory.claim(server, {0}, 300)
    (client,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(client, {0}, 9000)
    host.memory.mps_clients.add(client)
    path = config(host, tmp_path / "bin" / "nvidia-cuda-mps-server")
    code = main(
        ["status", "--config", str(path)], driver_factory=lambda: host.memory, roots=host.roots
    )
    assert code == ExitCode.OK
    rows = {
        line.split()[0]: line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.split()
    }
    assert rows[str(client)][5:8] == ["0", "mps", "9000"]
    assert rows[str(server)][2] == "protected" and rows[str(server)][5:8] == ["0", "mps", "300"]
