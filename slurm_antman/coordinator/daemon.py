"""The coordinator daemon: every ``coordinator.cycle_s`` it builds a snapshot from Slurm and the
sidecars' reports, runs the policy core, carries the decisions out, and writes each to the audit log.

Restart safety: the policy's CoordinatorState is written to the audit log after every cycle that
changed it, and a restarted daemon starts from the last one written, replaying the decisions logged
after it. The executor re-checks Slurm before every action (a Requeue only while the job's restart
count is the one seen at the decision), so a cycle cut short by SIGKILL and run again does nothing
twice. A failed decision is audited with its error and retried on the next cycle.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman.policy.cluster import (
    HOLDING_STATES, CoordinatorState, PolicyParams, Preemption, Requeued, decide,
)
from slurm_antman.slurm import CliBackend, SlurmError
from slurm_antman.slurm.pyslurm_backend import long_lived_backend
from .tenants import TenantQuotas

from ..service import serve_until_stopped
from . import audit, snapshot_builder
from .executor import Executor

log = logging.getLogger("antman.coordinator")


def params_from_config(cfg: cfgmod.AntmanConfig) -> PolicyParams:
    return PolicyParams.from_config(cfg)


# Job owners remembered beyond the current snapshot (for explain); the audit log names the rest.
MAX_OWNERS = 50_000

# Audit records of what the sidecars reported having done (not the coordinator's decisions).
SIDECAR_RECORDS = frozenset({"placed", "paused", "resumed"})


def restore_state(path: str, grace_s: float) -> tuple[CoordinatorState, int]:
    """The state a killed coordinator had: its last ``state`` record plus the preemption decisions
    carried out after it. Returns (state, number of records replayed).

    The log's files are read newest first and no further back than the newest state record: the
    coordinator's own rotation begins each file with one, so PATH alone is read; rotated files are
    read only when PATH has none (renamed by logrotate before the coordinator wrote its first state
    into the new file, or a log with no state change yet), which keeps restore right either way."""
    state = CoordinatorState.empty()
    after: list[dict] = []
    for f in audit.files(path):
        found: Optional[CoordinatorState] = None
        file_after: list[dict] = []
        for rec in audit.read_file(f):
            if rec["kind"] == "state":
                try:
                    found = CoordinatorState.from_json(rec["state"])
                    file_after = []
                except (ValueError, KeyError) as e:
                    log.warning("audit log %s: unreadable state record at %s: %s", f, rec.get("ts"), e)
            elif rec.get("outcome") == "ok" and rec["kind"] not in SIDECAR_RECORDS:
                file_after.append(rec)
        after = file_after + after
        if found is not None:
            state = found
            break
    pre = dict(state.preempting)
    req = dict(state.requeued)
    for rec in after:
        job_id = str(rec.get("job_id", ""))
        params = rec.get("params") or {}
        inputs = rec.get("inputs") or {}
        ts = float(rec.get("ts", 0.0))
        if rec["kind"] == "preempt_notice" and job_id not in pre:
            pre[job_id] = Preemption(job_id, str(params.get("node", "")), ts,
                                     ts + float(params.get("grace_s", grace_s)), int(rec.get("restarts") or 0),
                                     str(rec.get("reason", "")), int(inputs.get("gpu", -1)),
                                     str(inputs.get("for_job_id", "")))
        elif rec["kind"] == "requeue" and job_id in pre:
            was = pre.pop(job_id)
            req[job_id] = Requeued(job_id, was.node, was.gpu, was.for_job_id, ts, was.restarts_at_decision)
        elif rec["kind"] == "make_eligible" and job_id in req:
            was = req[job_id]
            start = params.get("start_unix")
            req[job_id] = replace(was, made_eligible=True, eligible_sent=was.eligible_sent + 1,
                                  eligible_unix=float(start) if start is not None else ts)
    state = replace(state, preempting=MappingProxyType(pre), requeued=MappingProxyType(req))
    return state, len(after)


def quota_use(snap: Any) -> dict[str, int]:
    """GPUs each account holds or is about to hold as guaranteed (running, or pending and not held)."""
    used: dict[str, int] = {}
    for j in snap.jobs:
        if j.job_class != "guaranteed":
            continue
        if j.state in HOLDING_STATES or (j.state == "PENDING" and not j.held_for_quota):
            used[j.account] = used.get(j.account, 0) + j.gpus
    return used


def quota_lua(snap: Any, as_of: float) -> str:
    """antman_quota.lua. ``as_of``: the Unix time taken before Slurm was read for ``snap``; job_submit.lua
    counts its own guaranteed admissions from then on as not yet in ``used``."""
    used = quota_use(snap)
    rows = "".join(f'    ["{a}"] = {{ quota = {int(q)}, used = {used.get(a, 0)} }},\n'
                   for a, q in sorted(snap.quotas.items()))
    return "-- written by the slurm-antman coordinator every cycle; read by job_submit.lua\n" \
           f"return {{ as_of = {float(as_of):.3f}, accounts = {{\n{rows}}} }}\n"


_PLACEMENT_WHY = {
    "requested": "the GPUs Slurm bound to the job",
    "fit": "the GPUs that met the opportunistic rules with the most predicted progress",
}


class Coordinator:
    def __init__(self, cfg: cfgmod.AntmanConfig, backend: Optional[CliBackend] = None, hub: Any = None,
                 clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.backend = backend or long_lived_backend(gres_name=cfg.slurm.gpu_gres, choice=cfg.slurm.backend)
        log.info("reading Slurm through %s", "pyslurm" if type(self.backend).__name__ == "PyslurmBackend" else "the CLI")
        self.hub = hub
        self.clock = clock
        self.params = params_from_config(cfg)
        self.audit = audit.AuditLog(cfg.coordinator.audit_log, max_bytes=cfg.coordinator.audit_max_bytes,
                                    keep=cfg.coordinator.audit_keep)
        self.executor = Executor(self.backend, cfg, hub, clock)
        self.tenants = TenantQuotas(cfg, self.backend, clock, background=True)
        self.state = CoordinatorState.empty()
        self.reports: dict[str, Any] = {}
        self._class_sent: dict[tuple[str, str], float] = {}
        self._placed: dict[str, tuple] = {}  # job -> the placement last written to the audit log
        self._paused: dict[str, str] = {}  # job -> the node of the pause last written to the audit log
        # job -> its Slurm user: the jobs of the latest snapshot, and the most recent ones before them, so
        # that explain can tell a finished job's owner and the audit log names it.
        self._owners: dict[str, str] = {}
        self.query: Any = None  # query.QueryServer while the query endpoint is served
        self._published = 0.0  # monotonic time of the last view handed to it
        self._persisted: Optional[dict] = None
        self._stop = threading.Event()
        self.cycles = 0
        self.metrics: Any = None  # slurm_antman.metrics.CoordinatorMetrics when metrics are served
        self.config_path: Optional[str] = None  # what SIGHUP re-reads
        self._reload_requested = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.state, replayed = restore_state(self.cfg.coordinator.audit_log, self.params.grace_s)
        self._persisted = self.state.to_json()
        if self.hub is not None:
            self.hub.start()
        self._start_query()
        self.audit.append({"ts": round(self.clock(), 3), "kind": "coordinator", "event": "start",
                           "preempting": sorted(self.state.preempting), "requeued": sorted(self.state.requeued),
                           "replayed": replayed, "uplink": self.hub is not None})
        log.info("coordinator started: %d preemption(s) in progress, %d requeued job(s) remembered; audit log %s",
                 len(self.state.preempting), len(self.state.requeued), self.cfg.coordinator.audit_log)

    def _start_query(self) -> None:
        """Serve the query endpoint. A failure is logged, not fatal: deciding for the cluster matters more
        than showing it to its users."""
        from . import query

        address = self.cfg.coordinator.query_address()
        if address is None:
            log.info("coordinator.query_endpoint is off: users see live numbers only as root on a node")
            return
        audit_path = self.cfg.coordinator.audit_log
        owner_lookup = query.slurm_owner(self.backend) if hasattr(self.backend, "job_user") else None
        server = query.QueryServer(address, lambda view: query.QueryHandler(view, audit_path,
                                                                            owner_lookup=owner_lookup))
        try:
            server.start()
        except query.QueryServerError as e:
            log.error("%s: users' antman squeue/nodes/explain get no answer from this coordinator", e)
            return
        self.query = server
        self._publish()

    def _publish(self, at_most_every_s: float = 0.0) -> None:
        if self.query is None or time.monotonic() - self._published < at_most_every_s:
            return
        self._published = time.monotonic()
        from .query import QueryView

        c = self.cfg.coordinator
        self.query.publish(QueryView(reports=MappingProxyType(dict(self.reports)),
                                     owners=MappingProxyType(self._owners), admin_users=frozenset(c.admin_users),
                                     stale_report_s=c.stale_report_s))

    def _remember_owners(self, jobs: list) -> None:
        """A new dict each time: the published view keeps the one it was given, unchanged."""
        current = {str(j.job_id): j.user for j in jobs if j.user}
        owners = {k: v for k, v in self._owners.items() if k not in current}
        owners.update(current)
        excess = len(owners) - MAX_OWNERS
        if excess > 0:
            owners = dict(list(owners.items())[excess:])  # the oldest first: insertion order
        self._owners = owners

    def _audit_job(self, rec: dict) -> dict:
        """A job's record names its user, so explain can tell its owner long after Slurm forgot the job."""
        user = self._owners.get(str(rec.get("job_id", "")))
        if user:
            rec["user"] = user
        return rec

    def stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        """Safe from a signal handler; the loop re-reads the config between cycles."""
        self._reload_requested.set()

    # Bound at start: the hub's socket and keys, the audit log file, the metrics endpoint.
    _RESTART_ONLY = ("endpoint", "key_dir", "audit_log", "metrics_port", "metrics_bind", "query_endpoint")

    def reload(self) -> bool:
        """Re-read ``config_path``; the policy state, reports and audit log are kept. False: rejected."""
        self._reload_requested.clear()
        # SIGHUP also reopens the audit log, for sites whose logrotate renames it (never copytruncate:
        # a copy can miss lines that were fsync'd and acknowledged). The state goes first into the
        # new file so that it alone restores the coordinator, as after a rotation of its own.
        self.audit.reopen()
        self._persist(force=True)
        if self.config_path is None:
            return False
        log.info("SIGHUP: re-reading %s", self.config_path)
        try:
            new = cfgmod.load(self.config_path)
        except cfgmod.ConfigError as e:
            log.error("reload REJECTED, keeping the running configuration: %s", str(e).replace("\n", ";"))
            return False
        for key in self._RESTART_ONLY:
            if getattr(new.coordinator, key) != getattr(self.cfg.coordinator, key):
                log.warning("reload: coordinator.%s changed; it takes effect at the next restart", key)
        self.cfg = new
        self.audit.max_bytes, self.audit.keep = new.coordinator.audit_max_bytes, new.coordinator.audit_keep
        self.params = params_from_config(new)
        self.executor.cfg = new
        self.tenants = TenantQuotas(new, self.backend, self.clock, background=True)  # quota_source may have changed
        self._publish()  # admin_users may have changed
        log.info("configuration reloaded; kept %d preemption(s) in progress and %d requeued job(s)",
                 len(self.state.preempting), len(self.state.requeued))
        return True

    def close(self) -> None:
        if self.query is not None:
            self.query.stop()
            self.query = None
        if self.hub is not None:
            self.hub.close()
        self.audit.append({"ts": round(self.clock(), 3), "kind": "coordinator", "event": "stop"})
        self.audit.close()

    def serve_forever(self) -> None:
        next_cycle = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._reload_requested.is_set():
                    self.reload()
                wait = max(0.0, next_cycle - time.monotonic())
                if self.hub is not None:
                    self._take(self.hub.poll(min(wait, 0.2)))
                else:
                    self._stop.wait(min(wait, 0.2))
                if time.monotonic() >= next_cycle:
                    next_cycle = time.monotonic() + self.cfg.coordinator.cycle_s
                    self.run_cycle()
        finally:
            self.close()

    def _take(self, reports: list) -> None:
        for r in reports:
            self.reports[r.node] = r
            # Each report, not only a cycle's last one: a resume and the next pause can both come within
            # one cycle (the sidecar reports each at once), and explain must show both.
            self._record_pauses(r)
        if reports:
            # Copying every report on every arrival costs more than users gain on a large cluster: a
            # view at most half a second behind (and each cycle's) is as fresh as a 2 s report is.
            self._publish(at_most_every_s=0.5)

    # -- one cycle ---------------------------------------------------------------------------
    def run_cycle(self) -> list[tuple[Any, Any]]:
        """One decision cycle; returns (decision, outcome) pairs. Never raises for Slurm trouble."""
        self.cycles += 1
        started = time.monotonic()
        try:
            return self._cycle()
        finally:
            if self.metrics is not None:
                self.metrics.cycle_seconds.observe(time.monotonic() - started)

    def _cycle(self) -> list[tuple[Any, Any]]:
        # Before Slurm is read: the quota file's as_of must not be later than what squeue saw.
        now = self.clock()
        try:
            jobs = self.backend.jobs()
            nodes = self.backend.nodes()
        except SlurmError as e:
            log.warning("cycle skipped: cannot read Slurm: %s", e)
            return []
        self._remember_owners(jobs)
        self._publish()
        snap = snapshot_builder.build(self.cfg, jobs, nodes, self.reports, now, self.tenants.current())
        # Before this cycle's decisions, which act on the jobs placed.
        self._record_placements({str(j.job_id): j.restarts for j in jobs if j.state == "RUNNING"})
        try:
            decisions, new_state = decide(snap, self.state, self.params)
        except Exception:  # noqa: BLE001 - a policy bug must not end the daemon; the state is kept
            log.exception("policy core failed on this cycle's snapshot")
            return []
        done = []
        for d in decisions:
            outcome = self.executor.execute(d, new_state)
            rec = self._audit_job(audit.decision_record(d, outcome.outcome, self.clock(), outcome.error,
                                                        outcome.detail))
            if outcome.restarts is not None:
                rec["restarts"] = outcome.restarts
            self.audit.append(rec)
            level = logging.WARNING if outcome.failed else logging.INFO
            log.log(level, "%s %s: %s [%s%s]", d.kind, getattr(d, "job_id", getattr(d, "node", "")), d.reason,
                    outcome.outcome, f": {outcome.error}" if outcome.error else "")
            if outcome.failed or outcome.retry:
                new_state = new_state.forget(d)
            if self.metrics is not None:
                self.metrics.count(d.kind, outcome.outcome)
            done.append((d, outcome))
        self.state = new_state
        self._persist()
        self._write_quota(snap, now)
        self._sync_classes(jobs)
        if self.metrics is not None:
            self.metrics.publish(snap.jobs, dict(snap.quotas), quota_use(snap), self.tenants.source,
                                 self.tenants.error is not None)
        return done

    def _write_quota(self, snap: Any, as_of: float) -> None:
        """Every cycle, changed use or not: a newer as_of lets job_submit.lua forget the admissions
        this snapshot already counts."""
        path = self.cfg.coordinator.quota_file
        if not path:
            return
        try:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(quota_lua(snap, as_of))
            os.replace(tmp, path)  # job_submit.lua reads it at any moment: whole or not at all
        except OSError as e:
            log.warning("cannot write the quota file %s: %s", path, e)

    def _record_placements(self, restarts: Mapping[str, int]) -> None:
        """Each placement a sidecar reports that the audit log does not have yet, as a ``placed``
        record: where the job runs and why there, for ``antman explain`` (not a decision: the
        sidecar chose). Kept only for jobs still reported, so the memory follows the cluster.
        ``restarts`` (Slurm's count per running job) tells a placement after a requeue from the same
        one written again by a restarted coordinator, which explain shows once; a job Slurm does not
        show running is left out (a report from before its requeue's Epilog)."""
        seen: dict[str, tuple] = {}
        for node, rep in self.reports.items():
            for rj in rep.jobs:
                n = restarts.get(rj.job_id)
                if rj.placement is None or n is None:
                    continue
                key = (node, tuple(rj.gpus), rj.placement, rj.placement_note or "", n)
                seen[rj.job_id] = key
                if self._placed.get(rj.job_id) == key:
                    continue
                self.audit.append(self._audit_job({
                    "ts": round(self.clock(), 3), "kind": "placed", "job_id": rj.job_id, "node": node,
                    "params": {"gpus": list(rj.gpus), "placement": rj.placement, "job_class": rj.job_class,
                               "restarts": n},
                    "reason": rj.placement_note or _PLACEMENT_WHY.get(rj.placement, ""), "outcome": "ok"}))
        self._placed = seen

    def _record_pauses(self, rep: Any) -> None:
        """Each pause in place a sidecar reports, once, and its end: for ``antman explain``."""
        for rj in rep.jobs:
            was = self._paused.get(rj.job_id)
            if getattr(rj, "paused", False):
                if was is None:
                    self.audit.append(self._audit_job({
                        "ts": round(self.clock(), 3), "kind": "paused", "job_id": rj.job_id, "node": rep.node,
                        "params": {}, "reason": rj.pause_reason, "outcome": "ok"}))
                self._paused[rj.job_id] = rep.node
            elif was is not None:
                self.audit.append(self._audit_job({
                    "ts": round(self.clock(), 3), "kind": "resumed", "job_id": rj.job_id, "node": rep.node,
                    "params": {}, "reason": "its GPU had room for it again", "outcome": "ok"}))
                del self._paused[rj.job_id]
        # A paused job this node no longer reports ended (or was requeued) paused: no resume to record.
        gone = {rj.job_id for rj in rep.jobs}
        for job_id in [k for k, node in self._paused.items() if node == rep.node and k not in gone]:
            del self._paused[job_id]

    def _persist(self, force: bool = False) -> None:
        data = self.state.to_json()
        # A state record is also what lets the audit log rotate (it rotates just before one), so one is
        # written when rotation is due even if the state has not changed.
        if force or data != self._persisted or self.audit.rotation_due:
            self.audit.append({"ts": round(self.clock(), 3), "kind": "state", "state": data})
            self._persisted = data

    def _sync_classes(self, jobs: list) -> None:
        """A running job Slurm calls guaranteed that its sidecar still treats as opportunistic (an
        upgrade whose message was lost, or a sidecar restart) gets its job_class_update again."""
        if self.hub is None:
            return
        running = {str(j.job_id): j.antman_class for j in jobs if j.state == "RUNNING"}
        for node, rep in self.reports.items():
            for rj in rep.jobs:
                want = running.get(rj.job_id)
                if want != "guaranteed" or rj.job_class == want:
                    continue
                key = (node, rj.job_id)
                if self._class_sent.get(key) == rep.received_unix:
                    continue  # once per report: the next report shows whether it took
                self._class_sent[key] = rep.received_unix
                if self.hub.send(node, p.JobClassUpdate(job_id=rj.job_id, job_class=want)):
                    log.info("job %s: re-sent job_class_update %s to %s", rj.job_id, want, node)


def make_hub(cfg: cfgmod.AntmanConfig) -> Any:
    if cfg.coordinator.key_dir is None:
        log.warning("coordinator.key_dir is not set: no sidecar uplink; quotas and classes only "
                    "(no placement from measurements, no preemption)")
        return None
    from .hub import SidecarHub

    return SidecarHub(cfg)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="antman coordinator", description="the cluster coordinator daemon")
    ap.add_argument("--config", default=None, help="antman.yaml (default: $ANTMAN_CONFIG or /etc/slurm-antman/antman.yaml)")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="least severity logged (to stderr: the journal under systemd)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    import os

    a = _parser().parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = a.config or os.environ.get("ANTMAN_CONFIG", "/etc/slurm-antman/antman.yaml")
    try:
        cfg = cfgmod.load(path)
    except cfgmod.ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    try:
        hub = make_hub(cfg)
        coord = Coordinator(cfg, hub=hub)
        coord.start()
    except Exception as e:  # noqa: BLE001 - one clear line for the admin
        print(f"antman coordinator: cannot start: {e}", file=sys.stderr)
        return 1
    coord.config_path = path
    server = None
    if cfg.coordinator.metrics_port:
        from prometheus_client import CollectorRegistry

        from slurm_antman import metrics

        registry = CollectorRegistry()
        coord.metrics = metrics.CoordinatorMetrics(registry)
        try:
            server = metrics.serve(registry, cfg.coordinator.metrics_bind, cfg.coordinator.metrics_port,
                                   cfg.coordinator.metrics_tls)
        except OSError as e:
            log.error("metrics endpoint %s:%d not served: %s", cfg.coordinator.metrics_bind,
                      cfg.coordinator.metrics_port, e)
    serve_until_stopped(coord, server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
