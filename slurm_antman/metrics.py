"""Prometheus metrics of the sidecar and the coordinator: the names, labels and how they are filled.

Both daemons are single-threaded loops while prometheus-client serves scrapes from its own thread.
So the loop publishes an immutable *view* (plain tuples) once per tick, and a collector turns the
latest view into metric families at scrape time: no lock, no half-updated job, and a job that is
gone from the view is gone from the scrape (no stale label sets left behind in a Gauge).

Labels: ``job_id`` and ``account`` as Slurm spells them (``squeue -o %i``, ``%a``), ``class`` as
AdminComment holds it, ``node`` as the Slurm node name, ``gpu`` as the physical index on the node.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("antman.metrics")

PREFIX = "antman"


# --- sidecar ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuPoint:
    index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float


@dataclass(frozen=True)
class JobPoint:
    job_id: str
    account: str
    job_class: str
    mem_limit_bytes: Optional[int]
    mem_used_bytes: int
    compute_share: float
    iteration_ms: Optional[float]
    throttle_delay_ms: Optional[float]
    spilled_bytes: Optional[int]


@dataclass(frozen=True)
class SidecarView:
    node: str
    gpus: tuple[GpuPoint, ...] = ()
    jobs: tuple[JobPoint, ...] = ()
    placement_waits: int = 0
    noncompliant: int = 0
    state_write_errors: int = 0
    pauses: int = 0
    pause_seconds: float = 0.0
    pause_bytes_moved: int = 0
    width_shrinks: int = 0
    width_grows: int = 0
    width_unreturned: int = 0


class SidecarCollector(Collector):
    def __init__(self) -> None:
        self.view: Optional[SidecarView] = None

    def publish(self, view: SidecarView) -> None:
        self.view = view  # one reference swap: a scrape sees the old view or the new, never a mix

    def collect(self) -> Iterator[GaugeMetricFamily]:
        v = self.view
        if v is None:
            return
        gl = ["node", "gpu"]

        def gpu_family(name: str, doc: str, unit: str = "") -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_gpu_{name}", doc, labels=gl, unit=unit)

        used = gpu_family("memory_used", "GPU memory in use (NVML, or emulated).", "bytes")
        total = gpu_family("memory_total", "GPU memory.", "bytes")
        util = gpu_family("utilization_ratio", "GPU utilisation, 0-1, last sample.")
        for g in v.gpus:
            lv = [v.node, str(g.index)]
            used.add_metric(lv, g.memory_used_bytes)
            total.add_metric(lv, g.memory_total_bytes)
            util.add_metric(lv, g.utilization)
        yield from (used, total, util)

        jl = ["node", "job_id", "account", "class"]

        def job_family(name: str, doc: str, unit: str = "") -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_job_{name}", doc, labels=jl, unit=unit)

        limit = job_family("memory_limit", "GPU memory limit sent to the job's agents; absent when unlimited.", "bytes")
        mem = job_family("memory_used", "GPU memory the job's processes use.", "bytes")
        share = job_family("compute_share_ratio", "Compute share sent to the job's agents, 0-1.")
        mb = job_family("minibatch", "Mini-batch time last reported (slowest agent).", "seconds")
        thr = job_family("throttle_delay", "Throttle delay per mini-batch, when the agent reports it.", "seconds")
        spill = job_family("spill", "Bytes spilled to host memory, when the agents report it.", "bytes")
        for j in v.jobs:
            lv = [v.node, j.job_id, j.account, j.job_class]
            if j.mem_limit_bytes is not None:
                limit.add_metric(lv, j.mem_limit_bytes)
            mem.add_metric(lv, j.mem_used_bytes)
            share.add_metric(lv, j.compute_share)
            if j.iteration_ms is not None:
                mb.add_metric(lv, j.iteration_ms / 1000.0)
            if j.throttle_delay_ms is not None:
                thr.add_metric(lv, j.throttle_delay_ms / 1000.0)
            if j.spilled_bytes is not None:
                spill.add_metric(lv, j.spilled_bytes)
        yield from (limit, mem, share, mb, thr, spill)
        waits = CounterMetricFamily(f"{PREFIX}_placement_waits", "Opportunistic jobs refused for want of a GPU "
                                    "that meets the rules (opportunistic.no_room: wait); each was requeued.",
                                    labels=["node"])
        waits.add_metric([v.node], v.placement_waits)
        yield waits
        nc = CounterMetricFamily(f"{PREFIX}_noncompliant", "Opportunistic jobs found not keeping to their limits beside "
                                 "a guaranteed job (no agent, limits not acknowledged, memory over the limit) and "
                                 "asked to be requeued (slurm_antman.policy.node.compliance).", labels=["node"])
        nc.add_metric([v.node], v.noncompliant)
        yield nc
        sw = CounterMetricFamily(f"{PREFIX}_state_write_errors", "Job records the sidecar could not write to its "
                                 "state directory (full, read-only); the jobs are served, but a restarted sidecar "
                                 "would not find them.", labels=["node"])
        sw.add_metric([v.node], v.state_write_errors)
        yield sw
        for name, text, value in (
                ("pauses", "Opportunistic jobs paused in place (their GPU state moved to host memory) for a "
                           "guaranteed job's burst, instead of requeued.", v.pauses),
                ("pause_seconds", "Seconds opportunistic jobs spent paused in place, summed over ended pauses.",
                 v.pause_seconds),
                ("pause_bytes_moved", "Bytes of GPU state paused jobs moved to host memory.", v.pause_bytes_moved),
                ("width_shrinks", "GPUs elastic opportunistic jobs gave up (a width change) instead of a pause or "
                                  "requeue.", v.width_shrinks),
                ("width_grows", "GPUs elastic opportunistic jobs grew onto.", v.width_grows),
                ("width_unreturned", "GPUs an elastic job was told to give up and still used after the grace time: "
                                     "it was asked to be requeued.", v.width_unreturned)):
            c = CounterMetricFamily(f"{PREFIX}_{name}", text, labels=["node"])
            c.add_metric([v.node], value)
            yield c


# --- coordinator -----------------------------------------------------------------------------

@dataclass(frozen=True)
class CoordinatorView:
    quota_used: tuple[tuple[str, int], ...] = ()   # (account, guaranteed GPUs held)
    quota: tuple[tuple[str, int], ...] = ()        # (account, guaranteed GPUs allowed)
    jobs_by_class: tuple[tuple[str, str, int], ...] = ()  # (class, Slurm state, count)
    quota_source: str = ""                         # "accounting" or "antman.yaml"
    quota_error: bool = False                      # the last read of the quota source failed


class CoordinatorMetrics(Collector):
    """Counters and the latency histogram live in ``registry``; the gauges come from the latest view."""

    def __init__(self, registry: CollectorRegistry):
        self.view = CoordinatorView()
        self.decisions = Counter(f"{PREFIX}_coordinator_decisions", "Decisions carried out, by kind and outcome.",
                                 ["kind", "outcome"], registry=registry)
        self.preemptions = Counter(f"{PREFIX}_coordinator_preemptions", "Opportunistic jobs sent a preemption "
                                   "notice.", registry=registry)
        self.requeues = Counter(f"{PREFIX}_coordinator_requeues", "Opportunistic jobs requeued through Slurm.",
                                registry=registry)
        self.upgrades = Counter(f"{PREFIX}_coordinator_upgrades", "Opportunistic jobs upgraded to guaranteed.",
                                registry=registry)
        self.cycle_seconds = Histogram(f"{PREFIX}_coordinator_cycle_seconds", "Decision-cycle latency: snapshot, "
                                       "decide, execute.", registry=registry,
                                       buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
        registry.register(self)

    def count(self, kind: str, outcome: str) -> None:
        self.decisions.labels(kind=kind, outcome=outcome).inc()
        if outcome != "ok":
            return
        if kind == "preempt_notice":
            self.preemptions.inc()
        elif kind == "requeue":
            self.requeues.inc()
        elif kind == "upgrade":
            self.upgrades.inc()

    def publish(self, jobs: Iterable[Any], quotas: dict[str, int], used: dict[str, int], quota_source: str = "",
                quota_error: bool = False) -> None:
        by: dict[tuple[str, str], int] = {}
        for j in jobs:
            key = (j.job_class, j.state)
            by[key] = by.get(key, 0) + 1
        self.view = CoordinatorView(tuple(sorted(used.items())), tuple(sorted(quotas.items())),
                                    tuple((c, s, n) for (c, s), n in sorted(by.items())), quota_source, quota_error)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        v = self.view
        used = GaugeMetricFamily(f"{PREFIX}_tenant_quota_used_gpus", "Guaranteed GPUs a tenant holds or is about "
                                 "to hold (running, or pending and not held for quota).", labels=["account"])
        accounts = dict(v.quota)
        for a, n in v.quota_used:
            used.add_metric([a], n)
        for a in accounts:
            if a not in dict(v.quota_used):
                used.add_metric([a], 0)
        quota = GaugeMetricFamily(f"{PREFIX}_tenant_quota_gpus", "Guaranteed GPUs a tenant may hold (from the "
                                  "quota source in force: Slurm accounting's GrpTRES, or antman.yaml).",
                                  labels=["account"])
        for a, n in v.quota:
            quota.add_metric([a], n)
        jobs = GaugeMetricFamily(f"{PREFIX}_jobs", "Jobs Slurm knows, by slurm-antman class and Slurm state.",
                                 labels=["class", "state"])
        for c, s, n in v.jobs_by_class:
            jobs.add_metric([c, s], n)
        source = GaugeMetricFamily(f"{PREFIX}_tenant_quota_source", "1 for the source of the tenant quotas in force; "
                                   "error is 1 when its last read failed (the quotas read before are kept).",
                                   labels=["source", "error"])
        if v.quota_source:
            source.add_metric([v.quota_source, "1" if v.quota_error else "0"], 1)
        yield from (used, quota, jobs, source)


# --- serving ---------------------------------------------------------------------------------

@dataclass
class MetricsServer:
    registry: CollectorRegistry
    port: int = 0
    server: Any = field(default=None, repr=False)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def serve(registry: CollectorRegistry, bind: str, port: int, tls: Any = None) -> MetricsServer:
    """Serve ``registry`` on http://BIND:PORT/metrics in a daemon thread; PORT 0 picks a free one (tests).
    ``tls`` (config.MetricsTls): HTTPS, and only clients with a certificate of ``client_ca_file``."""
    if tls is None:
        server, _thread = start_http_server(port, addr=bind, registry=registry)
    else:
        for what, path in (("cert_file", tls.cert_file), ("key_file", tls.key_file),
                           ("client_ca_file", tls.client_ca_file)):
            if not os.path.isfile(path):
                raise OSError(f"metrics_tls.{what}: {path} is not a readable file")
        server, _thread = start_http_server(port, addr=bind, registry=registry, certfile=tls.cert_file,
                                            keyfile=tls.key_file, client_cafile=tls.client_ca_file,
                                            client_auth_required=True)
    actual = server.server_address[1]
    log.info("metrics on %s://%s:%d/metrics%s", "https" if tls else "http", bind if ":" not in bind else f"[{bind}]",
             actual, " (client certificates required)" if tls else "")
    return MetricsServer(registry, actual, server)
