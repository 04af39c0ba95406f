"""Prometheus endpoints: a real sidecar (emulated telemetry) and a real coordinator cycle, served on
loopback, scraped over HTTP and parsed with prometheus-client's own parser."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import urllib.request
from typing import Optional

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from slurm_antman import config as cfgmod
from slurm_antman import metrics
from slurm_antman import protocol as p
from slurm_antman.coordinator.daemon import Coordinator
from slurm_antman.clients import sidecar_control as client
from slurm_antman.lab.fake_agent import FakeAgent
from slurm_antman.sidecar.cli import build

MiB = 1 << 20
GPU_MB = 8192


def scrape(port: int, host: str = "127.0.0.1") -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> Optional[float]:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="amm-", dir="/tmp")  # short: Unix socket paths are limited to 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait_for(fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_sidecar_metrics_match_telemetry_and_reports(sockdir):
    conf = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 2, "gpu_memory_mb": GPU_MB}],
                         "sidecar": {"heartbeat_s": 0.2, "telemetry": "emulated"}})
    sc = build(conf, "n1", sockdir, tick_s=0.1, uplink=False)
    registry = CollectorRegistry()
    sc.metrics = metrics.SidecarCollector()
    registry.register(sc.metrics)
    server = metrics.serve(registry, "127.0.0.1", 0)
    sc.start()
    thread = threading.Thread(target=sc.serve_forever, daemon=True)
    thread.start()
    agent = None
    try:
        reg = client.register_job(sockdir, "4711", uid=0, user="root", job_class="opportunistic", gpus=1,
                                   account="vision")
        agent = FakeAgent(reg.endpoint, "4711", hostname="n1", agent_version="test")
        agent.register()
        agent.send(p.Report(iteration=1, iterations=1, iteration_ms=250.0, busy_ms=200.0,
                            mem_allocated_bytes=300 * MiB, mem_reserved_bytes=512 * MiB, mem_peak_bytes=512 * MiB,
                            spilled_bytes=64 * MiB, limits_seq=0))
        lab = {"node": "n1", "job_id": "4711", "account": "vision", "class": "opportunistic"}
        s = wait_for(lambda: (lambda m: m if value(m, "antman_job_minibatch_seconds", **lab) is not None else None)(
            scrape(server.port)))
        state = client.node_state(sockdir)
        for g in state.gpus:
            gl = {"node": "n1", "gpu": str(g.index)}
            assert value(s, "antman_gpu_memory_total_bytes", **gl) == GPU_MB * MiB
            assert value(s, "antman_gpu_memory_used_bytes", **gl) is not None
            assert 0.0 <= value(s, "antman_gpu_utilization_ratio", **gl) <= 1.0
        assert value(s, "antman_job_minibatch_seconds", **lab) == pytest.approx(0.25)
        assert value(s, "antman_job_spill_bytes", **lab) == 64 * MiB
        js = next(j for j in state.jobs if j.job_id == "4711")
        assert value(s, "antman_job_compute_share_ratio", **lab) == pytest.approx(js.compute_share)
        if js.mem_limit_bytes is None:
            assert value(s, "antman_job_memory_limit_bytes", **lab) is None
        else:
            assert value(s, "antman_job_memory_limit_bytes", **lab) == js.mem_limit_bytes
        # The agent does not report a throttle delay: absent, not a made-up zero.
        assert value(s, "antman_job_throttle_delay_seconds", **lab) is None

        client.retire_job(sockdir, "4711")
        wait_for(lambda: value(scrape(server.port), "antman_job_compute_share_ratio", **lab) is None)
    finally:
        if agent is not None:
            agent.close()
        sc.stop()
        thread.join(5)
        server.close()


def test_coordinator_counts_decisions_and_exposes_quota(tmp_path):
    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 2}],
                        "tenants": [{"account": "vision", "guaranteed_gpus": 4},
                                    {"account": "nlp-team", "guaranteed_gpus": 2}],
                        "coordinator": {"audit_log": str(tmp_path / "audit.jsonl")}})
    registry = CollectorRegistry()
    m = metrics.CoordinatorMetrics(registry)
    server = metrics.serve(registry, "127.0.0.1", 0)
    try:
        from slurm_antman.policy.cluster.model import JobView

        jobs = [JobView("101", "vision", "ann", "RUNNING", "guaranteed", "guaranteed", 2, "n1", 0.0, 1.0, 0, None,
                        False),
                JobView("102", "vision", "ann", "RUNNING", "opportunistic", "opportunistic", 1, "n1", 0.0, 1.0, 0,
                        None, False),
                JobView("103", "nlp-team", "bob", "PENDING", "guaranteed", "guaranteed", 1, None, 0.0, None, 0,
                        None, False)]
        m.publish(jobs, {t.account: t.guaranteed_gpus for t in cfg.tenants}, {"vision": 2, "nlp-team": 1})
        for kind, outcome in [("preempt_notice", "ok"), ("preempt_notice", "ok"), ("requeue", "ok"),
                              ("upgrade", "ok"), ("upgrade", "error"), ("set_opp_slots", "skipped")]:
            m.count(kind, outcome)
        m.cycle_seconds.observe(0.03)
        m.cycle_seconds.observe(0.7)
        s = scrape(server.port)
        assert value(s, "antman_tenant_quota_used_gpus", account="vision") == 2
        assert value(s, "antman_tenant_quota_used_gpus", account="nlp-team") == 1
        assert value(s, "antman_tenant_quota_gpus", account="nlp-team") == 2
        assert value(s, "antman_jobs", **{"class": "guaranteed", "state": "RUNNING"}) == 1
        assert value(s, "antman_jobs", **{"class": "guaranteed", "state": "PENDING"}) == 1
        assert value(s, "antman_jobs", **{"class": "opportunistic", "state": "RUNNING"}) == 1
        assert value(s, "antman_coordinator_preemptions_total") == 2
        assert value(s, "antman_coordinator_requeues_total") == 1
        assert value(s, "antman_coordinator_upgrades_total") == 1  # the failed one does not count
        assert value(s, "antman_coordinator_decisions_total", kind="upgrade", outcome="error") == 1
        assert value(s, "antman_coordinator_cycle_seconds_count") == 2
        assert value(s, "antman_coordinator_cycle_seconds_bucket", le="0.05") == 1
        assert value(s, "antman_coordinator_cycle_seconds_sum") == pytest.approx(0.73)
    finally:
        server.close()


def test_coordinator_cycle_observes_latency_without_slurm(tmp_path):
    """A real Coordinator whose Slurm commands are missing (empty PATH) still times its skipped cycle."""
    from slurm_antman.slurm import CliBackend

    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 2}],
                        "coordinator": {"audit_log": str(tmp_path / "audit.jsonl")}})
    coord = Coordinator(cfg, backend=CliBackend(env={"PATH": str(tmp_path)}, timeout=5))
    registry = CollectorRegistry()
    coord.metrics = metrics.CoordinatorMetrics(registry)
    coord.start()
    try:
        assert coord.run_cycle() == []
    finally:
        coord.close()
    assert registry.get_sample_value("antman_coordinator_cycle_seconds_count") == 1


def test_metrics_bind_must_be_an_address():
    with pytest.raises(cfgmod.ConfigError, match=r"sidecar\.metrics_bind: 'anywhere' is not an IP address"):
        cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "sidecar": {"metrics_bind": "anywhere"}})
    with pytest.raises(cfgmod.ConfigError, match=r"coordinator\.metrics_port"):
        cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "coordinator": {"metrics_port": 70000}})


def test_grafana_dashboard_queries_only_exported_metrics():
    """Every metric the dashboard queries is one the daemons export (names drift otherwise)."""
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parent.parent / "etc" / "grafana" / "slurm-antman.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    used = {m for e in exprs for m in re.findall(r"\bantman_[a-z_]+", e)}
    registry = CollectorRegistry()
    m = metrics.CoordinatorMetrics(registry)
    m.count("upgrade", "ok")
    m.cycle_seconds.observe(0.1)
    from slurm_antman.policy.cluster.model import JobView

    m.publish([JobView("1", "a", "u", "RUNNING", "auto", "guaranteed", 1, "n1", 0.0, 1.0, 0, None, False)],
              {"a": 2}, {"a": 1})
    col = metrics.SidecarCollector()
    col.publish(metrics.SidecarView("n1", (metrics.GpuPoint(0, 1, 2, 0.5),), (metrics.JobPoint(
        "1", "a", "opportunistic", 10, 5, 0.5, 100.0, 3.0, 7),)))
    registry.register(col)
    exported = {s.name for fam in registry.collect() for s in fam.samples}
    missing = {u for u in used if u not in exported}
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(missing)}"
    assert {"antman_job_spill_bytes", "antman_coordinator_cycle_seconds_bucket"} <= used


def test_sidecar_daemon_serves_metrics_on_configured_port(sockdir):
    """``antman sidecar`` as a process: sidecar.metrics_port turns the endpoint on, on loopback."""
    import os
    import socket
    import subprocess
    import sys

    import yaml

    with socket.socket() as s:  # a free loopback port; released before the daemon binds it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join(sockdir, "antman.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"nodes": [{"name": "n1", "gpus": 3, "gpu_memory_mb": GPU_MB}],
                        "sidecar": {"telemetry": "emulated", "heartbeat_s": 0.2, "metrics_port": port}}, f)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "slurm_antman.sidecar.cli", "--config", path, "--node", "n1",
                             "--socket-dir", os.path.join(sockdir, "s")], cwd=repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def ready():
            try:
                return scrape(port)
            except OSError:
                assert proc.poll() is None, "sidecar exited"
                return None
        s = wait_for(ready)
        assert [value(s, "antman_gpu_memory_total_bytes", node="n1", gpu=str(i)) for i in range(3)] == [GPU_MB * MiB] * 3
    finally:
        proc.terminate()
        proc.wait(10)
