"""gpugate's textfile scraped by the real node_exporter 1.5 and queried from the real
Prometheus 2.42 (Debian's packages, inside one simulated host of this module's own), which
evaluates docs/metrics.md's alert rules itself: they fire after the first failure of a hook that never
ran before, and the release histogram arrives as a histogram."""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from incident import REPO
from realparts import hold_gpus_cmd, install_debs, wait_for
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

TEXTFILE_DIR = "/var/lib/gpugate-textfile"
PROMETHEUS = "http://127.0.0.1:9090"
METRICS_DOC = REPO / "docs" / "metrics.md"
CONFIG = (
    f'metrics_textfile = "{TEXTFILE_DIR}/gpugate.prom"\n'
    "[pre]\nsigterm_grace_s = 0.5\nsigkill_wait_s = 0.5\nwait_timeout_s = 2\n"
    "[post]\nsigterm_grace_s = 0.5\nsigkill_wait_s = 0.5\nwait_timeout_s = 2\n"
)
PROMETHEUS_YML = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - /etc/prometheus/gpugate.rules.yml
scrape_configs:
  - job_name: node
    static_configs:
      - targets: ["127.0.0.1:9100"]
"""


def readme_rules() -> str:
    """The alert rules block of docs/metrics.md, exactly as written there."""
    section = METRICS_DOC.read_text()
    match = re.search(r"```yaml\n(groups:.*?)```", section, re.S)
    assert match, "docs/metrics.md has no ```yaml groups: block"
    return match.group(1)


def unit_text(gpu: int) -> str:
    hold = hold_gpus_cmd([gpu], 4000).replace("$", "$$")  # systemd expands $ in ExecStart=
    return (
        "[Service]\nType=simple\n"
        "ExecStartPre=/usr/bin/gpugate pre %n\nExecStopPost=/usr/bin/gpugate post %n\n"
        f"ExecStart=/bin/sh -c '{hold}'\nTimeoutStartSec=60\nTimeoutStopSec=60\n"
    )


class Prom:
    def __init__(self, sim: SimHost) -> None:
        self.sim = sim

    def get(self, path: str, **params: str) -> Any:
        url = f"{PROMETHEUS}{path}?{urllib.parse.urlencode(params)}"
        out = self.sim.run(["curl", "-fsS", "--max-time", "5", url], check=False)
        if out.returncode != 0:
            return None
        return json.loads(out.stdout)

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self.get("/api/v1/query", query=expr)
        if not answer or answer.get("status") != "success":
            return []
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def firing(self, alert: str, **labels: str) -> list[dict[str, Any]]:
        answer = self.get("/api/v1/alerts")
        alerts = answer["data"]["alerts"] if answer else []
        return [
            a
            for a in alerts
            if a["labels"].get("alertname") == alert
            and a["state"] == "firing"
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]


@pytest.fixture(scope="module")
def prom(fake_nvml_lib: Path | None) -> Iterator[Prom]:
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    sim = SimHost.boot(nvml_lib=fake_nvml_lib, gpus=8)
    try:
        sim.install_gpugate(REPO)
        sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
        install_debs(sim, "prometheus", ["prometheus-node-exporter", "prometheus"])
        sim.run(f"mkdir -p {TEXTFILE_DIR}")
        sim.write_file(
            "/etc/default/prometheus-node-exporter",
            'ARGS="--web.listen-address=127.0.0.1:9100 '
            f'--collector.textfile.directory={TEXTFILE_DIR}"\n',
        )
        sim.write_file("/etc/default/prometheus", 'ARGS="--web.listen-address=127.0.0.1:9090"\n')
        sim.write_file("/etc/prometheus/prometheus.yml", PROMETHEUS_YML)
        sim.write_file("/etc/prometheus/gpugate.rules.yml", readme_rules())
        # Prometheus's own checker first: a rule it cannot parse fails here, by its words.
        sim.run(["promtool", "check", "rules", "/etc/prometheus/gpugate.rules.yml"])
        sim.systemctl("start", "prometheus-node-exporter.service", "prometheus.service")
        p = Prom(sim)
        wait_for("Prometheus ready", lambda: p.query("up") and p.query('up{job="node"} == 1'))
        yield p
    finally:
        sim.poweroff()


def used_mib(sim: SimHost, gpu: int) -> int:
    data = json.loads(sim.run(["gpugate", "status", "--json"]).stdout)
    used: int = data["gpus"][gpu]["used_mib"]
    return used


def start(sim: SimHost, unit: str) -> int:
    return sim.systemctl("start", unit, check=False).returncode


def test_alerts_fire_on_the_first_failure_ever(prom: Prom) -> None:
    sim = prom.sim
    # "fresh": its first run ever fails (memory that no process holds on its GPU).
    sim.install_unit("fresh.service", unit_text(3))
    sim.write_file("/etc/gpugate/fresh.service.toml", "gpus = [3]\n" + CONFIG)
    sim.write_file("/run/fake-nvml/leak/3", "7000\n")
    # "steady": runs cleanly first (its pre kills an orphan on its GPU), then fails once.
    sim.install_unit("steady.service", unit_text(5))
    sim.write_file("/etc/gpugate/steady.service.toml", "gpus = [5]\n" + CONFIG)
    sim.spawn_scope(["/bin/sh", "-c", hold_gpus_cmd([5], 3000)], unit="orphan-5.scope")
    wait_for("the orphan's 3000 MiB on GPU 5", lambda: used_mib(sim, 5) == 3000)

    assert start(sim, "steady.service") == 0
    sim.systemctl("stop", "steady.service")
    # Prometheus must have seen the zeros before the failure, as on any node between runs.
    wait_for(
        "steady's runs in Prometheus",
        lambda: (
            prom.query(
                'gpugate_runs_total{unit="steady.service",phase="pre",result="memory_timeout"} == 0'
            )
            and prom.query('gpugate_last_run_failed{unit="steady.service",phase="post"} == 0')
        ),
    )
    assert not prom.firing("GpugateRunFailed", unit="steady.service")
    assert not prom.firing("GpugateFailuresLastHour", unit="steady.service")
    assert start(sim, "fresh.service") != 0
    sim.write_file("/run/fake-nvml/leak/5", "7000\n")
    assert start(sim, "steady.service") != 0

    fired = wait_for(
        "GpugateRunFailed for fresh.service",
        lambda: prom.firing("GpugateRunFailed", unit="fresh.service", phase="pre"),
    )
    assert fired[0]["annotations"]["summary"].startswith("gpugate pre of fresh.service failed")
    wait_for(
        "GpugateFailuresLastHour for steady.service",
        lambda: prom.firing("GpugateFailuresLastHour", unit="steady.service", phase="pre"),
    )
    wait_for(
        "GpugateRunFailed for steady.service",
        lambda: prom.firing("GpugateRunFailed", unit="steady.service", phase="pre"),
    )
    # steady's first pre killed the orphan: one kill-to-free time, as a histogram
    (count,) = prom.query('gpugate_memory_release_seconds_count{unit="steady.service"}')
    assert count["metric"]["phase"] == "pre" and float(count["value"][1]) == 1
    (median,) = prom.query(
        'histogram_quantile(0.5, gpugate_memory_release_seconds_bucket{unit="steady.service"})'
    )
    assert 0 < float(median["value"][1]) <= 10
    meta = prom.get("/api/v1/metadata", metric="gpugate_memory_release_seconds")
    assert meta["data"]["gpugate_memory_release_seconds"][0]["type"] == "histogram"
    (parsed,) = prom.query("node_textfile_scrape_error")
    assert parsed["value"][1] == "0"

    # A success clears the gauge, and with it the alert.
    sim.run("rm -f /run/fake-nvml/leak/3")
    sim.systemctl("reset-failed", "fresh.service", check=False)
    assert start(sim, "fresh.service") == 0
    wait_for(
        "fresh.service's gauge back at 0",
        lambda: prom.query('gpugate_last_run_failed{unit="fresh.service",phase="pre"} == 0'),
    )
    wait_for(
        "GpugateRunFailed for fresh.service's pre resolved",
        lambda: not prom.firing("GpugateRunFailed", unit="fresh.service", phase="pre"),
        timeout=30,
    )
    sim.systemctl("stop", "fresh.service")
    wait_for(
        "every GpugateRunFailed for fresh.service resolved",
        lambda: (
            prom.query('gpugate_last_run_failed{unit="fresh.service",phase="post"} == 0')
            and not prom.firing("GpugateRunFailed", unit="fresh.service")
        ),
        timeout=30,
    )


def test_sweep_alerts_fire_after_their_for_time(prom: Prom) -> None:
    """docs/metrics.md's sweep rules, with the 10 minutes of `for:` and the 5 minutes without a
    sweep shortened to seconds: memory held by nobody fires once it stayed `for:` that long,
    and a sweep that stopped running fires once its timestamp is that old."""
    sim = prom.sim
    rules = readme_rules()
    assert "for: 10m" in rules and "gpugate_sweep_timestamp_seconds) > 300" in rules
    shortened = rules.replace("for: 10m", "for: 4s").replace(
        "gpugate_sweep_timestamp_seconds) > 300", "gpugate_sweep_timestamp_seconds) > 8"
    )
    sim.write_file("/etc/prometheus/gpugate.rules.yml", shortened)
    sim.run(["promtool", "check", "rules", "/etc/prometheus/gpugate.rules.yml"])
    sim.systemctl("kill", "--kill-who=main", "--signal=HUP", "prometheus.service")
    wait_for(
        "the shortened rules loaded",
        lambda: any(
            rule.get("name") == "GpugateMemoryHeldByNobody" and rule.get("duration") == 4
            for group in (prom.get("/api/v1/rules") or {}).get("data", {}).get("groups", [])
            for rule in group["rules"]
        ),
    )
    sim.write_file("/etc/gpugate/sweep.toml", CONFIG)
    sim.spawn_scope(["/bin/sh", "-c", hold_gpus_cmd([6], 2500)], unit="nobody-6.scope")
    wait_for("the holder's 2500 MiB on GPU 6", lambda: used_mib(sim, 6) == 2500)
    try:
        sim.run(["gpugate", "sweep", "--config", "/etc/gpugate/sweep.toml"], timeout=120)
        wait_for(
            "GPU 6's memory held by nobody in Prometheus",
            lambda: prom.query('gpugate_gpu_memory_mib{gpu="6",owner="nobody"} == 2500'),
        )
        fired = wait_for(
            "GpugateMemoryHeldByNobody for GPU 6",
            lambda: prom.firing("GpugateMemoryHeldByNobody", gpu="6"),
        )
        assert "2500 MiB" in fired[0]["annotations"]["summary"]  # type: ignore[index]
        assert not prom.firing("GpugateMemoryHeldByNobody", gpu="5")
        wait_for("GpugateSweepStopped", lambda: prom.firing("GpugateSweepStopped"))
    finally:
        sim.systemctl("stop", "nobody-6.scope", check=False)
