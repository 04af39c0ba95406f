"""A trace window replayed through the devcluster: real sbatch, real Slurm scheduling, real sidecars
and coordinator, and emulated training jobs (``emulated_job``) that speak the real agent protocol.

The three policies run the same jobs on the same devcluster configuration:

- ``exclusive``: plain Slurm, one job per GPU. Every job is submitted ``--antman=guaranteed`` with no
  tenant quotas, so nothing shares a GPU; the sidecars only measure. The class a job *would* have been
  admitted as (for the guaranteed-JCT metric) is worked out here with job_submit.lua's rule, as the
  simulator does.
- ``shared``: ``--antman=auto`` with tenant quotas, so over-quota jobs go opportunistic and share GPUs,
  but the sidecars run observe-only (``sidecar.enforce: false``): nobody limits or throttles them.
  The emulated jobs get the GPU's memory size (``--gpu-mem-bytes``): when the footprints on a GPU
  exceed it, the job that arrived last fails with CUDA out of memory (Slurm: FAILED), as in the
  simulator, and the driver resubmits it as the simulator's user does (``trace_run.oom_resubmit_delay``:
  ``oom_retry_s`` later, backing off on each further failure; ``oom_failures`` counts the failures).
- ``antman``: the full system.

Times are in the simulator's units: trace seconds divided by ``speedup``, from the trace start, so a
replay and ``simulate`` on the same window can be compared number by number (``agreement``).
Utilisation comes from the sidecars' telemetry (emulated GPUs whose memory and busy time are what the
agents report), sampled every ``poll_s`` and averaged over [first submission, last submission], the
simulator's measuring window.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Optional, Sequence

from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.errors import AntmanError
from slurm_antman.policy.cluster.quota import fits_quota
from .metrics import summarize
from .simulator import SimResult, tenant_quotas
from .trace_run import TraceRunConfig, oom_resubmit_delay
from .traces import TraceJob
from .workloads import Profile, assign

POLICIES = ("exclusive", "shared", "antman")
_TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
# A trace job whose Slurm job failed with CUDA out of memory, waiting to be resubmitted: not terminal.
# (Slurm's own OUT_OF_MEMORY above is the host memory cgroup's kill, a failure like any other.)
OOM_RETRY = "OOM_RETRY"


class ReplayError(AntmanError):
    pass


@dataclass(frozen=True)
class ReplayConfig(TraceRunConfig):
    """A devcluster replay: the fields every run of a trace has (``TraceRunConfig``), then the replay's own."""

    # The devcluster is a few emulated GPUs that run in real time: a small cluster and a fast trace.
    nodes: int = 2
    gpus_per_node: int = 4
    speedup: float = 60.0
    grace_s: int = 30             # the devcluster's antman.yaml takes whole seconds (grace_time_s)
    iter_scale: float = 1.0       # emulated mini-batch time = profile.iter_ms * iter_scale
    # The emulated jobs run on contending emulated GPUs (emulated_job --contend: interference emerges
    # from the jobs' timing); False: they take it from the workload formula, the simulator's own model,
    # so the replay could only repeat it.
    contend: bool = True
    poll_s: float = 1.0
    max_wall_s: float = 1800.0    # jobs not done by then are reported as not done
    port_base: int = 18900

    _error: ClassVar[type[Exception]] = ReplayError

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ReplayError(f"--policy {self.policy!r}: allowed: {', '.join(POLICIES)}")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ReplayError("--nodes and --gpus must be at least 1")
        if self.speedup <= 0 or self.iter_scale <= 0:
            raise ReplayError("--speedup and --iter-scale must be positive")
        self._check_gpu_memory()
        self._check_oom_retry()


@dataclass
class _Run:
    """One trace job's life on the devcluster."""

    job: TraceJob
    profile: Profile
    submit_s: float                     # replay time it is due
    work_s: float
    slurm_id: Optional[int] = None      # the current Slurm job
    attempts: list = field(default_factory=list)  # every Slurm job id it had, in order (OOM resubmissions)
    submitted_at: Optional[float] = None  # replay time the first sbatch returned
    submitted_as: Optional[str] = None
    ran_as: Optional[str] = None
    state: str = "UNSUBMITTED"
    ooms: int = 0                       # Slurm jobs of it that failed with CUDA out of memory
    retry_at: Optional[float] = None    # replay time of the resubmission, while state is OOM_RETRY
    records: list = field(default_factory=list)


def observe(r: _Run, slurm_id: int, state: str, oom_failed: bool, now: float, retry_s: float,
            retry_max_s: Optional[float] = None) -> None:
    """Takes in what Slurm says of one of ``r``'s Slurm jobs. A FAILED job whose run record says it ran
    out of GPU memory makes ``r`` wait for its resubmission (``OOM_RETRY``), counted once: ``retry_s``,
    or with ``retry_max_s`` the simulator's back-off (``trace_run.oom_resubmit_delay``); any other
    state, FAILED without that record included, is ``r``'s state as it is."""
    if slurm_id != r.slurm_id or r.state == OOM_RETRY:
        return  # an earlier attempt (squeue lists ended jobs for minutes), or a failure already counted
    if state == "FAILED" and oom_failed:
        r.ooms += 1
        wait = retry_s if retry_max_s is None else oom_resubmit_delay(retry_s, retry_max_s, r.ooms)
        r.state, r.retry_at = OOM_RETRY, now + wait
    else:
        r.state = state


def due_for_retry(r: _Run, now: float) -> bool:
    return r.state == OOM_RETRY and r.retry_at is not None and r.retry_at <= now


def oom_failed(records: Sequence[dict]) -> bool:
    """Whether one Slurm job's run records say it failed with CUDA out of memory (any rank: a DDP
    job dies with its first rank)."""
    return any(x.get("oom") is True for x in records)


def fits(jobs: Sequence[TraceJob], gpus_per_node: int) -> tuple[list[TraceJob], list[TraceJob]]:
    """Jobs one node can hold, and the rest: an emulated job runs its ranks on one node."""
    ok = [j for j in jobs if j.gpus <= gpus_per_node]
    return ok, [j for j in jobs if j.gpus > gpus_per_node]


def _overrides(cfg: ReplayConfig, quotas: dict[str, int]) -> dict:
    return {
        "grace_time_s": cfg.grace_s,
        "nodes": {"gpu_memory_mb": cfg.gpu_mem_bytes >> 20, "memory_mb": 64000},
        "opportunistic": {"slots_per_gpu": cfg.slots_per_gpu},
        "sidecar": {"enforce": cfg.policy != "shared"},
        "tenants": [] if cfg.policy == "exclusive" else
        [{"account": t, "guaranteed_gpus": q} for t, q in sorted(quotas.items())],
    }


def _account(tenant: str) -> str:
    # Philly virtual cluster ids are hex strings; a Slurm account name must not start with a digit
    # in some tools, so every tenant gets a prefix.
    return f"vc{tenant}"


class Replay:
    def __init__(self, jobs: Sequence[TraceJob], cfg: ReplayConfig, workdir: Path,
                 log: Callable[[str], None] = lambda s: None):
        self.cfg = cfg
        self.dir = Path(workdir)
        self.log = log
        self.quotas = {_account(t): q for t, q in
                       tenant_quotas(jobs, cfg.nodes * cfg.gpus_per_node, cfg.quota_scale).items()}
        starts = [j.submit_s / cfg.speedup for j in jobs]
        self.t0 = min(starts) if starts else 0.0
        self.t_end_measure = max(starts) if starts else 0.0
        self.runs = [_Run(j, assign(j.job_id, cfg.seed), j.submit_s / cfg.speedup,
                          max(j.duration_s / cfg.speedup, 1.0)) for j in jobs]
        self.series: list[tuple[float, float, float]] = []
        self.by_slurm: dict[int, _Run] = {}
        self.state_dir = self.dir / "state"
        self.board_dir = self.dir / "board"
        self.scripts = self.dir / "scripts"

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> SimResult:
        from slurm_antman.slurm import default_backend

        for d in (self.state_dir, self.board_dir, self.scripts):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        cluster_dir = self.dir / "cluster"
        cluster = dc.up(cluster_dir, nodes=self.cfg.nodes, gpus=self.cfg.gpus_per_node,
                        cpus=self.cfg.gpus_per_node * (1 + self.cfg.slots_per_gpu) + 2,
                        port_base=self.cfg.port_base, overrides=_overrides(self.cfg, self.quotas))
        try:
            self.cluster = cluster
            self.backend = default_backend(env=cluster.env)
            from slurm_antman.config import load as load_config

            self.antman_cfg = load_config(cluster.config_path)
            self._loop()
        finally:
            dc.down(cluster_dir)
        return self._result()

    def _now(self) -> float:
        return time.monotonic() - self._wall0 + self.t0

    def _loop(self) -> None:
        self._wall0 = time.monotonic()
        queue = sorted(self.runs, key=lambda r: (r.submit_s, r.job.job_id))
        nxt = 0
        last_poll = -1e9
        while True:
            now = self._now()
            while nxt < len(queue) and queue[nxt].submit_s <= now:
                self._submit(queue[nxt])
                nxt += 1
            for r in self.runs:
                if due_for_retry(r, now):
                    self._submit(r)
            if time.monotonic() - last_poll >= self.cfg.poll_s:
                last_poll = time.monotonic()
                self._poll()
                done = sum(1 for r in self.runs if r.state in _TERMINAL)
                if nxt == len(queue) and done == len(self.runs):
                    return
                if time.monotonic() - self._wall0 > self.cfg.max_wall_s:
                    self.log(f"replay: {len(self.runs) - done} job(s) not done after {self.cfg.max_wall_s:.0f} s")
                    return
            retries = [r.retry_at for r in self.runs if r.state == OOM_RETRY and r.retry_at is not None]
            wake = min(queue[nxt].submit_s if nxt < len(queue) else now + self.cfg.poll_s,
                       now + self.cfg.poll_s, *retries)
            time.sleep(max(0.0, min(self.cfg.poll_s, wake - self._now())))

    # -- submission --------------------------------------------------------------------------------

    def _admitted_exclusive(self, r: _Run) -> str:
        """job_submit.lua's rule (guaranteed while the tenant's guaranteed GPUs plus this job's fit its
        quota), applied by the driver: under exclusive it only labels the job for the metrics."""
        acct = _account(r.job.tenant)
        q = self.quotas.get(acct)
        held = sum(x.job.gpus for x in self.runs if x.submitted_as == "guaranteed" and x.slurm_id is not None
                   and x.job.tenant == r.job.tenant and x.state not in _TERMINAL)
        return "guaranteed" if fits_quota(q, held, r.job.gpus) else "opportunistic"

    def _submit(self, r: _Run) -> None:
        """sbatch for ``r``: its first submission, or its resubmission after an OOM (same profile, same
        work: the failed job made no progress worth keeping, and a new job id starts no checkpoint)."""
        n = r.job.gpus
        cmd = [sys.executable, "-m", "slurm_antman.lab.evaluation.emulated_job", "--profile", r.profile.name,
               "--work-s", f"{r.work_s:.3f}", "--state-dir", str(self.state_dir),
               "--board-dir", str(self.board_dir), "--iter-scale", str(self.cfg.iter_scale)]
        if self.cfg.contend:
            cmd.append("--contend")
        if self.cfg.policy == "shared":
            # Only here can footprints overflow a GPU: antman's memory limits make a job spill
            # instead, and exclusive shares nothing.
            cmd += ["--gpu-mem-bytes", str(self.cfg.gpu_mem_bytes)]
        line = " ".join(cmd)
        script = self.scripts / f"{r.job.job_id}.sh"
        # One rank per GPU, as a DDP job runs: each rank's agent registers for its own GPU, and a rank
        # that fails (OOM) takes the others down with it, as a collective would.
        script.write_text("#!/bin/bash\n" + (f"exec {line}\n" if n == 1 else
                                             f"exec srun --ntasks={n} --kill-on-bad-exit=1 {line}\n"))
        if self.cfg.policy == "exclusive":
            flag = "--antman=guaranteed"
            if r.submitted_as is None:
                r.submitted_as = self._admitted_exclusive(r)
        elif r.slurm_id is not None and r.submitted_as is not None:
            # A resubmission keeps the class it was admitted as: the simulator's failed job goes back
            # to its queue with its class, it is not submitted anew.
            flag = f"--antman={r.submitted_as}"
        else:
            flag = "--antman=auto"
        argv = ["sbatch", "--parsable", "-J", f"t{r.job.job_id}", "-A", _account(r.job.tenant), flag,
                f"--gres=gpu:{n}", f"--ntasks={n}", "-c", "1", "-N", "1", "-D", str(self.dir),
                "-o", str(self.state_dir / f"{r.job.job_id}.out"), "--open-mode=append", str(script)]
        res = self.cluster.run(argv, timeout=60)
        if res.returncode != 0:
            # Nothing silently dropped: a refused submission is a failed replay job, reported as such.
            r.state = "FAILED"
            self.log(f"replay: sbatch for trace job {r.job.job_id} failed: {res.stderr.strip()}")
            return
        r.slurm_id = int(res.stdout.strip().split(";")[0])
        r.attempts.append(r.slurm_id)
        if r.submitted_at is None:  # JCT counts from the first submission, as in the simulator
            r.submitted_at = self._now()
        r.state, r.retry_at = "PENDING", None
        self.by_slurm[r.slurm_id] = r

    # -- watching ----------------------------------------------------------------------------------

    def _poll(self) -> None:
        from slurm_antman.views.live import sidecar_states

        now = self._now()
        try:
            jobs = self.backend.jobs()
        except Exception as e:  # noqa: BLE001 - a slow controller: try again next poll
            self.log(f"replay: squeue failed ({e}); retrying")
            jobs = []
        for j in jobs:
            r = self.by_slurm.get(j.job_id)
            if r is None or j.job_id != r.slurm_id:
                continue  # not ours, or an earlier attempt that failed with OOM
            if j.antman_class in ("guaranteed", "opportunistic"):
                if r.submitted_as is None:
                    r.submitted_as = j.antman_class
                if j.state == "RUNNING" and self.cfg.policy != "exclusive":
                    # (under exclusive every job runs guaranteed; its label is the admitted class)
                    r.ran_as = j.antman_class
            failed_oom = j.state == "FAILED" and r.state != OOM_RETRY and oom_failed(self._records(j.job_id))
            ooms = r.ooms
            observe(r, j.job_id, j.state, failed_oom, now, self.cfg.oom_retry_s, self.cfg.oom_retry_max_s)
            if r.ooms > ooms:
                self.log(f"replay: trace job {r.job.job_id} (Slurm job {j.job_id}) failed with CUDA out of "
                         f"memory; resubmitting at {r.retry_at:.0f} s")
        states = sidecar_states(self.antman_cfg, self.cluster.nodes)
        n = self.cfg.nodes * self.cfg.gpus_per_node
        util = mem = 0.0
        for st in states.values():
            for g in st.gpus:
                util += min(1.0, g.utilization)
                mem += min(g.memory_used_bytes, self.cfg.gpu_mem_bytes)
        if states:
            self.series.append((now, util / n, mem / (n * self.cfg.gpu_mem_bytes)))

    # -- results ------------------------------------------------------------------------------------

    def _records(self, slurm_id: int) -> list[dict]:
        """The run records of one Slurm job (one line per run and rank)."""
        out = []
        for path in sorted(self.state_dir.glob(f"{slurm_id}.*runs.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out

    def _to_replay_time(self, unix: float) -> float:
        return unix - self._unix0 + self.t0

    def _result(self) -> SimResult:
        # replay time <-> unix time: the loop's start
        self._unix0 = time.time() - (time.monotonic() - self._wall0)
        rows = [job_row(r, [self._records(i) for i in r.attempts], self._to_replay_time) for r in self.runs]
        n = self.cfg.nodes * self.cfg.gpus_per_node
        inside = [(t, u, m) for t, u, m in self.series if self.t0 <= t <= self.t_end_measure]
        ends = [r["end_s"] for r in rows if r["end_s"] is not None]
        makespan = [(t, u, m) for t, u, m in self.series if self.t0 <= t <= max(ends, default=self.t0)]
        metrics = summarize(rows)
        metrics.update(
            policy=self.cfg.policy, gpus=n, start_overhead_s=start_overhead(rows),
            sm_util=_mean([u for _, u, _ in inside]), mem_util=_mean([m for _, _, m in inside]),
            sm_util_makespan=_mean([u for _, u, _ in makespan]), mem_util_makespan=_mean([m for _, _, m in makespan]),
            measure_window_s=[self.t0, self.t_end_measure], telemetry_samples=len(inside),
            quotas=dict(self.quotas), wall_s=round(time.monotonic() - self._wall0, 1),
            oom_failures=sum(r.ooms for r in self.runs),  # failed attempts, as SimResult counts them
        )
        return SimResult(self.cfg.policy, metrics, rows, list(self.series))


def job_row(r: _Run, attempts: Sequence[Sequence[dict]], to_replay_time: Callable[[float], float]) -> dict:
    """One trace job's row, with the simulator's keys, from the run records of each of its Slurm jobs
    (``attempts``, in submission order: OOM failures, then the last one). Its start is the first
    attempt's, its end the last one's; ``restarts`` counts requeues and OOM failures, as the
    simulator's does, ``preemptions`` the requeues only. An OOM failure loses no GPU time (the
    simulator's job fails while allocating): only requeues within one Slurm job count."""
    recs = [x for a in attempts for x in a]
    done = [x for x in (attempts[-1] if attempts else []) if x.get("completed")]
    starts = [x["start_unix"] for x in recs if x.get("start_unix")]
    requeues = sum(max((int(x.get("restart_count", 0)) for x in a), default=0) for a in attempts)
    end = max(x["end_unix"] for x in done) if done and r.state == "COMPLETED" else None
    return {
        "job_id": r.job.job_id, "tenant": r.job.tenant, "gpus": r.job.gpus, "profile": r.profile.name,
        "class": r.ran_as or r.submitted_as or "none", "submitted_as": r.submitted_as,
        "submit_s": r.submit_s if r.submitted_at is None else r.submitted_at,
        "first_start_s": to_replay_time(min(starts)) if starts else None,
        "end_s": to_replay_time(end) if end is not None else None,
        "duration_s": r.work_s, "restarts": requeues + r.ooms, "preemptions": requeues, "ooms": r.ooms,
        "lost_gpu_s": round(sum(lost_gpu_s(a, r.job.gpus) for a in attempts), 3),
        "slurm_job_id": r.slurm_id, "attempts": len(r.attempts), "slurm_state": r.state,
        "runs": len({(i, x.get("restart_count"), x.get("rank", 0)) for i, a in enumerate(attempts) for x in a}),
        "mean_slowdown": max((float(x.get("mean_slowdown", 1.0)) for x in done), default=None),
    }


def lost_gpu_s(records: Sequence[dict], gpus: int) -> float:
    """GPU time a requeue threw away: per interrupted run, the work it had done beyond what the next
    run resumed from (rank 0's records), times the job's GPUs."""
    runs = sorted((x for x in records if int(x.get("rank", 0)) == 0), key=lambda x: int(x.get("restart_count", 0)))
    lost = sum(max(0.0, float(a.get("work_done_s", 0.0)) - float(b.get("resumed_from_s", 0.0)))
               for a, b in zip(runs, runs[1:]))
    return round(lost * gpus, 3)


def start_overhead(rows: Sequence[dict]) -> Optional[float]:
    """Median seconds a job's run took beyond its work: process start to first iteration and the
    exit, measured on jobs admitted guaranteed that ran once, to completion, never opportunistic (an
    upgraded job was throttled before: its extra time is not start-up); their work is slowed only by
    ``mean_slowdown``. The simulator takes it as ``start_overhead_s``."""
    extra = sorted(r["end_s"] - r["first_start_s"] - r["duration_s"] * (r["mean_slowdown"] or 1.0)
                   for r in rows if r["end_s"] is not None and r["first_start_s"] is not None
                   and r["restarts"] == 0 and r["class"] == r["submitted_as"] == "guaranteed")
    return round(max(0.0, extra[len(extra) // 2]), 3) if extra else None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def replay(jobs: Sequence[TraceJob], cfg: ReplayConfig, workdir: Path, log: Callable[[str], None] = lambda s: None) -> SimResult:
    return Replay(jobs, cfg, workdir, log).run()


AGREEMENT_KEYS = ("sm_util", "mem_util", "sm_util_makespan", "mem_util_makespan", "jct_mean_s",
                  "jct_guaranteed_mean_s", "queue_delay_mean_s")
# simulated / replayed, per metric, that the replay test accepts: measured in docs/evaluation.md
TOLERANCE = {"sm_util_makespan": (0.75, 1.33), "mem_util_makespan": (0.75, 1.33), "jct_mean_s": (0.75, 1.33)}


def agreement(replayed: dict, simulated: dict) -> dict:
    """Per metric: the simulator's value over the replay's (1.0 is perfect agreement)."""
    out = {}
    for k in AGREEMENT_KEYS:
        a, b = replayed.get(k), simulated.get(k)
        out[k] = None if a in (None, 0) or b is None else round(b / a, 4)
    out["jobs_done"] = [replayed.get("jobs_done"), simulated.get("jobs_done")]
    out["oom_failures"] = [replayed.get("oom_failures"), simulated.get("oom_failures")]
    return out
