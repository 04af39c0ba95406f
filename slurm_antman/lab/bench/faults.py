"""``antman bench faults``: faults and attacks on a job's limits, run on a real devcluster, counted.

One node, one emulated 2 GiB GPU, tenant ``research`` with one guaranteed GPU: every job shares
GPU 0, so every fault happens beside a guaranteed job. Each scenario starts a guaranteed and an
opportunistic PyTorch job that train and checkpoint (``slurm_antman/lab/jobs/demo_train.py``), does the
damage, waits for the node to recover, and counts what Slurm and the jobs' own output say:

- ``jobs_lost``: a job that ended other than by finishing (FAILED, CANCELLED, NODE_FAIL, ...) or
  that Slurm no longer knows;
- ``jobs_doubled``: a job that ran as two copies at once (two ``START`` lines in one Slurm life)
  or finished twice;
- ``guaranteed_restarts``: requeues of the guaranteed jobs (``Restarts``), which must stay 0;
- ``recover_s``: from the end of the fault (daemon restarted, disk freed, agent dead) to the node
  serving the job again (the agent's reports back, or the job running managed).

``problems`` lists what a scenario expected and did not see (an opportunistic job requeued twice,
a daemon that did not come back); the target is 0 / 0 / 0 and no problem on every row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from slurm_antman.lab import jobs
from pathlib import Path
from typing import Callable, Optional, Sequence

from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.coordinator import audit
from slurm_antman.lab.devcluster.jobs import ClusterJobs, JobsError, wait_for

GRACE_S = 5
COMPLIANCE_GRACE_S = 10
SLURMCTLD_DOWN_S = 30.0
TRAIN = jobs.script("demo_train.py")
# States a job may be in and still be alive or done as it should; anything else ended it badly.
ALIVE = {"RUNNING", "PENDING", "COMPLETING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "COMPLETED"}
STATE_MOUNT_BYTES = 4 << 20

# The guaranteed job: demo_train.py with its agent told that the (emulated) GPU is busy
# GUARANTEED_DUTY of the job's compute time (on CPU it would count every iteration as GPU-busy). The
# policy places an opportunistic job only where its predicted progress reaches min_progress (0.25),
# which beside a guaranteed job held to a 2 % slowdown means one that keeps its GPU busy under ~8 %
# (waiting on its input pipeline, a notebook): every fault then happens on a shared GPU.
GUARANTEED_DUTY = 0.05
GUARANTEED_TRAIN = ("import runpy, sys, torch_patch; torch_patch.install().emulate_device(256 << 20, "
                    f"{GUARANTEED_DUTY}); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name=\"__main__\")")

# An agent killed mid-message: it registers as its job's agent, reports once, starts a message of
# 1,000,000 bytes (under the protocol's limit, so libzmq reads it) and is SIGKILLed while the bytes
# are still in flight; the job script then goes on to train with a fresh agent.
TORN_AGENT = r"""
import os, signal, sys, zmq
from slurm_antman import protocol as p
if os.path.exists(sys.argv[1]):
    sys.exit(0)  # once per job, whichever run of it gets here first
open(sys.argv[1], "w").close()
s = zmq.Context().socket(zmq.DEALER)
s.connect(os.environ[p.ENDPOINT_ENV])
s.send_multipart(p.encode(p.Message(body=p.Register(job_id=os.environ["SLURM_JOB_ID"], pid=os.getpid(), rank=0,
    local_rank=0, world_size=1, hostname="x", agent_version="torn", torch_version="none", device="cuda",
    job_class="opportunistic"))))
assert s.poll(10000), "no answer to register"
s.recv_multipart()
s.send_multipart(p.encode(p.Message(body=p.Report(iteration=1, iterations=1, iteration_ms=100.0, busy_ms=50.0,
    mem_allocated_bytes=1 << 20, mem_reserved_bytes=1 << 20, mem_peak_bytes=1 << 20, spilled_bytes=0, limits_seq=0))))
s.send_multipart([p.MARKER, b"{" + b" " * 1_000_000])
print("TORN: killing the agent mid-message", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

# The audit's first attack: two connections to the job's own endpoint, each registered, each
# reporting memory at the protocol's bound, so the node's sum is past any number it can encode.
# Only in the job's first life: after the requeue it trains like any job.
HUGE_REPORTS = r"""
import os, sys, time, zmq
from slurm_antman import protocol as p
if os.path.exists(sys.argv[1]):
    print("AFTER REQUEUE", flush=True); time.sleep(600); sys.exit(0)
open(sys.argv[1], "w").close()
ctx = zmq.Context()
socks = []
for rank in (0, 1):
    s = ctx.socket(zmq.DEALER)
    s.connect(os.environ[p.ENDPOINT_ENV])
    s.send_multipart(p.encode(p.Message(body=p.Register(job_id=os.environ["SLURM_JOB_ID"], pid=os.getpid(), rank=rank,
        local_rank=0, world_size=2, hostname="x", agent_version="rogue", torch_version="none", device="cuda",
        job_class="opportunistic"))))
    socks.append(s)
print("ATTACKING", flush=True)
for i in range(1, 600):
    for s in socks:
        s.send_multipart(p.encode(p.Message(body=p.Report(iteration=i, iterations=1, iteration_ms=100.0, busy_ms=90.0,
            mem_allocated_bytes=p.MAX_NUMBER, mem_reserved_bytes=p.MAX_NUMBER, mem_peak_bytes=p.MAX_NUMBER,
            spilled_bytes=0, limits_seq=0))))
        while s.poll(0):
            s.recv_multipart()
    time.sleep(0.2)
"""


@dataclass
class FaultResult:
    fault: str
    jobs_lost: int = 0
    jobs_doubled: int = 0
    guaranteed_restarts: int = 0
    recover_s: Optional[float] = None
    problems: list[str] = field(default_factory=list)
    skipped: str = ""

    @property
    def ok(self) -> bool:
        return not self.skipped and not self.problems and not (
            self.jobs_lost or self.jobs_doubled or self.guaranteed_restarts)


class Scenarios:
    """The scenarios, on one running devcluster. Each leaves the cluster with no job."""

    def __init__(self, jobs: ClusterJobs, state_mounts: list[Path]):
        self.j = jobs
        self.c = jobs.c
        self.state_mounts = state_mounts
        self.node = self.c.nodes[0]
        self.ckpt_dir = jobs.workdir / "ckpt"
        self.ckpt_dir.mkdir(exist_ok=True)
        os.chown(self.ckpt_dir, jobs.uid, jobs.gid)  # the jobs' user writes the checkpoints
        # Requeues before the fault (a Prolog refusing a job for want of room, the normal wait path)
        # are not the fault's doing: each scenario counts from here.
        self.restarts_before: dict[int, int] = {}

    # --- helpers ----------------------------------------------------------------------------

    def _train(self, name: str, steps: int = 100_000, prelude: str = "") -> str:
        ckpt = self.ckpt_dir / f"{name}-{time.monotonic_ns()}.pt"
        return f"#!/bin/bash\n{prelude}exec {sys.executable} {TRAIN} {ckpt} {steps} 0.05\n"

    def _guaranteed(self) -> int:
        """A guaranteed job training at GUARANTEED_DUTY: room beside it that an opportunistic job may use."""
        ckpt = self.ckpt_dir / f"g-{time.monotonic_ns()}.pt"
        g = self.j.sbatch("--antman=guaranteed", "--gres=gpu:1", "-A", "research", "-J", "guaranteed",
                          script=f"#!/bin/bash\nexec {sys.executable} -c '{GUARANTEED_TRAIN}' {TRAIN} {ckpt} 100000 0.05\n")
        self.j.wait_output(g, r"^step 5 ", timeout=90)
        # An opportunistic job may join only once the sidecar has measured the guaranteed one.
        wait_for(self._gpu_measured, 60, "the guaranteed job's utilisation measured")
        return g

    def _gpu_measured(self) -> bool:
        from slurm_antman.clients import sidecar_control as client

        try:
            return all(g.util_measured for g in client.node_state(self._socket_dir(), timeout_s=2.0).gpus)
        except (client.SidecarUnreachable, client.SidecarError):
            return False

    def _baseline(self, *jobs: int) -> None:
        for j in jobs:
            self.restarts_before[j] = int(self.j.show(j).get("Restarts", "0") or 0)

    def _script_file(self, text: str) -> Path:
        path = self.j.workdir / f"attack-{time.monotonic_ns()}.py"
        path.write_text(text)
        return path

    def _squeue(self) -> dict[int, dict]:
        r = self.j.run([sys.executable, "-m", "slurm_antman.cli", "squeue", "--json"])
        if r.returncode != 0:
            return {}
        try:
            return {row["job_id"]: row for row in json.loads(r.stdout)}
        except (ValueError, KeyError, TypeError):
            return {}

    def _agent_back(self, job_id: int) -> bool:
        row = self._squeue().get(job_id, {})
        return row.get("iteration_ms") is not None and isinstance(row.get("mem_limit_bytes"), int)

    def _steps(self, job_id: int) -> int:
        return len(re.findall(r"^step ", self.j.output(job_id), re.M))

    def _proc(self, name: str) -> dc.Proc:
        return next(pr for pr in self.c.procs if pr.name == name)

    def _kill(self, name: str, sig: int) -> None:
        pr = self._proc(name)
        if pr.alive():
            os.kill(pr.pid, sig)
        wait_for(lambda: not pr.alive(), 30, f"{name} to exit")

    def _sidecar_answers(self) -> bool:
        from slurm_antman.clients import sidecar_control as client

        try:
            client.ping(self._socket_dir(), timeout_s=2.0)
            return True
        except (client.SidecarUnreachable, client.SidecarError):
            return False

    def _socket_dir(self) -> str:
        from slurm_antman import config as config_mod

        return config_mod.load(self.c.config_path).node_socket_dir(self.node)

    def _pair(self) -> tuple[int, int]:
        """A guaranteed and an opportunistic job training side by side on GPU 0, the agent of the
        opportunistic one reporting with a limit set."""
        g = self._guaranteed()
        o = self.j.sbatch("--antman=opportunistic", "--gres=gpu:1", "-A", "research", "-J", "opportunistic",
                          script=self._train("o"))
        self.j.wait_output(o, r"^step 10 ", timeout=180)
        wait_for(lambda: self._agent_back(o), 60, "the opportunistic job's agent reporting")
        self._baseline(g, o)
        return g, o

    def _still_training(self, jobs: Sequence[int], for_s: float = 6.0) -> list[str]:
        before = {j: self._steps(j) for j in jobs}
        time.sleep(for_s)
        return [f"job {j} made no progress in {for_s:g} s after recovery" for j in jobs if self._steps(j) <= before[j]]

    def _tally(self, res: FaultResult, classes: dict[int, str], max_requeues: Optional[dict[int, int]] = None) -> None:
        for job_id, cls in classes.items():
            try:
                info = self.j.show(job_id)
            except JobsError:
                res.jobs_lost += 1
                res.problems.append(f"job {job_id} ({cls}) is no longer known to Slurm")
                continue
            state = info.get("JobState", "?")
            restarts = int(info.get("Restarts", "0") or 0)
            out = self.j.output(job_id)
            if state not in ALIVE:
                res.jobs_lost += 1
                res.problems.append(f"job {job_id} ({cls}) ended {state} ({info.get('Reason')})")
            starts = len(re.findall(r"^START ", out, re.M)) + len(re.findall(r"^(?:TORN|ATTACKING|AFTER REQUEUE)",
                                                                           out, re.M))
            if out.count("DONE step=") > 1 or starts > 2 * (restarts + 1):
                res.jobs_doubled += 1
                res.problems.append(f"job {job_id} ({cls}) started {starts} times in {restarts + 1} Slurm run(s)")
            requeues = restarts - self.restarts_before.get(job_id, 0)
            if cls == "guaranteed":
                res.guaranteed_restarts += requeues
            elif requeues > (max_requeues or {}).get(job_id, 0):
                res.problems.append(f"job {job_id} ({cls}) requeued {requeues} time(s) by the fault")

    def _reset(self) -> None:
        self.j.cancel_all()
        if not self.j.wait_empty(60):
            raise JobsError("jobs still running 60 s after scancel")

    # --- the scenarios ----------------------------------------------------------------------

    def sidecar_killed(self) -> FaultResult:
        res = FaultResult("sidecar SIGKILLed and restarted")
        g, o = self._pair()
        self._kill(f"sidecar:{self.node}", signal.SIGKILL)
        t0 = time.monotonic()
        dc.replace_proc(self.c, dc.start_sidecar(self.c, self.node))
        wait_for(lambda: self._agent_back(o), 90, "the agent to re-register with the restarted sidecar")
        res.recover_s = time.monotonic() - t0
        time.sleep(COMPLIANCE_GRACE_S + 2)  # past the compliance grace time: nothing may be requeued
        res.problems += self._still_training([g, o])
        self._tally(res, {g: "guaranteed", o: "opportunistic"})
        return res

    def coordinator_torn_audit(self) -> FaultResult:
        res = FaultResult("coordinator SIGKILLed, torn last audit line, restarted")
        g, o = self._pair()
        audit_log = self.c.dir / "log" / "coordinator-audit.jsonl"
        self._kill("coordinator", signal.SIGKILL)
        with open(audit_log, "ab") as f:
            f.write(b'{"ts": 1, "kind": "requeue", "job_id": "' + str(o).encode() + b'", "outc')
        killed = time.time()
        t0 = time.monotonic()
        dc.replace_proc(self.c, dc.start_coordinator(self.c))

        def started_again() -> bool:
            return any(r.get("kind") == "coordinator" and r.get("event") == "start" and r.get("ts", 0) >= killed
                       for r in audit.read(audit_log))

        wait_for(started_again, 60, "the restarted coordinator's start record")
        res.recover_s = time.monotonic() - t0
        time.sleep(5)  # a few of its cycles
        if not self._proc("coordinator").alive():
            res.problems.append("the restarted coordinator exited")
        res.problems += self._still_training([g, o])
        self._tally(res, {g: "guaranteed", o: "opportunistic"})
        return res

    def slurmctld_stopped(self) -> FaultResult:
        res = FaultResult(f"slurmctld stopped for {SLURMCTLD_DOWN_S:g} s and restarted")
        g, o = self._pair()
        self._kill("slurmctld", signal.SIGTERM)
        time.sleep(SLURMCTLD_DOWN_S)
        t0 = time.monotonic()
        dc.replace_proc(self.c, dc.start_slurmctld(self.c))

        def both_running() -> bool:
            r = self.j.run(["squeue", "-h", "-o", "%i %T"])
            rows = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
            return r.returncode == 0 and rows.get(str(g)) == "RUNNING" and rows.get(str(o)) == "RUNNING"

        wait_for(both_running, 90, "slurmctld back with both jobs running")
        res.recover_s = time.monotonic() - t0
        time.sleep(5)
        for name in ("coordinator", f"sidecar:{self.node}"):
            if not self._proc(name).alive():
                res.problems.append(f"{name} exited while slurmctld was down")
        res.problems += self._still_training([g, o])
        self._tally(res, {g: "guaranteed", o: "opportunistic"})
        return res

    def agent_killed_mid_message(self) -> FaultResult:
        res = FaultResult("agent SIGKILLed mid-message")
        g = self._guaranteed()
        sidecar_pid = self._proc(f"sidecar:{self.node}").pid
        torn = self._script_file(TORN_AGENT)
        o = self.j.sbatch("--antman=opportunistic", "--gres=gpu:1", "-A", "research", "-J", "torn",
                          script=self._train("o", prelude=f"{sys.executable} {torn} {torn}.done\n"))
        self.j.wait_output(o, r"^TORN:", timeout=180)
        self._baseline(g, o)
        t0 = time.monotonic()
        self.j.wait_output(o, r"^step 10 ", timeout=90)
        wait_for(lambda: self._agent_back(o), 60, "the job's new agent reporting")
        res.recover_s = time.monotonic() - t0
        side = self._proc(f"sidecar:{self.node}")
        if side.pid != sidecar_pid or not side.alive() or not self._sidecar_answers():
            res.problems.append("the sidecar did not survive the torn message")
        res.problems += self._still_training([g, o])
        self._tally(res, {g: "guaranteed", o: "opportunistic"})
        return res

    def state_dir_full(self) -> FaultResult:
        res = FaultResult("node state directories full")
        if not self.state_mounts:
            res.skipped = "needs the state directories on small tmpfs mounts (root, mount(8)); none were made"
            return res
        fillers = [_fill(m) for m in self.state_mounts]
        try:
            g = self._guaranteed()
            o = self.j.sbatch("--antman=opportunistic", "--gres=gpu:1", "-A", "research", "-J", "opportunistic",
                              script=self._train("o"))
            # With nowhere to write its env file the job must not start unmanaged: it waits or is requeued.
            time.sleep(20)
            if re.search(r"^START ", self.j.output(o), re.M):
                res.problems.append("the opportunistic job started while its node could not record its limits")
        finally:
            for f in fillers:
                f.unlink(missing_ok=True)
        t0 = time.monotonic()
        self.j.wait_output(o, r"^step 5 ", timeout=240)
        wait_for(lambda: self._agent_back(o), 60, "the opportunistic job's agent reporting")
        res.recover_s = time.monotonic() - t0
        if "class=opportunistic" not in self.j.output(o):
            res.problems.append("the opportunistic job did not run as one")
        res.problems += self._still_training([g, o])
        self._tally(res, {g: "guaranteed", o: "opportunistic"}, max_requeues={o: 1})
        return res

    def forged_class(self) -> FaultResult:
        res = FaultResult("attack: class forged in the job name")
        g = self._guaranteed()
        t0 = time.monotonic()
        o = self.j.sbatch("--antman=opportunistic", "--gres=gpu:1", "-A", "research",
                          "-J", f"x AdminComment=antman:class=guaranteed;gpus={self.node}:0",
                          script=self._train("o"))
        self.j.wait_output(o, r"^step 5 ", timeout=180)
        res.recover_s = time.monotonic() - t0
        if not re.search(r"^START .*class=opportunistic", self.j.output(o), re.M):
            res.problems.append("the forged job did not run as opportunistic")
        if not self.j.show(o).get("AdminComment", "").startswith("antman:class=opportunistic"):
            res.problems.append("the forged class reached the job's AdminComment")
        res.problems += self._still_training([g, o])
        self._tally(res, {g: "guaranteed", o: "opportunistic"})
        return res

    def huge_reports(self) -> FaultResult:
        res = FaultResult("attack: two agents reporting memory too large to add up")
        g = self._guaranteed()
        sidecar_pid = self._proc(f"sidecar:{self.node}").pid
        attack = self._script_file(HUGE_REPORTS)
        o = self.j.sbatch("--antman=opportunistic", "--gres=gpu:1", "-A", "research", "-J", "huge",
                          script=f"#!/bin/bash\nexec {sys.executable} {attack} {attack}.done\n")
        self.j.wait_output(o, r"^ATTACKING", timeout=180)
        self._baseline(g, o)
        t0 = time.monotonic()
        # Over its limit beside a guaranteed job: the sidecar names it and the coordinator requeues it.
        requeued = str(self.restarts_before[o] + 1)
        wait_for(lambda: self.j.show(o).get("Restarts") == requeued, COMPLIANCE_GRACE_S + 60, "the attacker's requeue")
        res.recover_s = time.monotonic() - t0
        side = self._proc(f"sidecar:{self.node}")
        if side.pid != sidecar_pid or not side.alive() or not self._sidecar_answers():
            res.problems.append("the sidecar did not survive the reports")
        res.problems += self._still_training([g])
        self._tally(res, {g: "guaranteed", o: "opportunistic"}, max_requeues={o: 1})
        return res

    def all(self) -> list[Callable[[], FaultResult]]:
        return [self.sidecar_killed, self.coordinator_torn_audit, self.slurmctld_stopped,
                self.agent_killed_mid_message, self.state_dir_full, self.forged_class, self.huge_reports]


def _fill(mount: Path) -> Path:
    """Write one file until the filesystem at ``mount`` has no byte left; the file, to free it."""
    path = mount / ".antman-bench-filler"
    chunk = b"\0" * (64 << 10)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        for size in (4096, 512, 1):  # the last partial blocks
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                continue
    return path


def _mount_state_dirs(d: Path, port_base: int) -> list[Path]:
    """Small tmpfs mounts where the node keeps state (antman-state, the sidecar's socket directory),
    made before the cluster starts so its daemons use them; [] where this process cannot mount."""
    targets = [d / "antman-state", dc.sidecar_socket_dir(port_base)]
    done: list[Path] = []
    for t in targets:
        t.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STATE_MOUNT_BYTES},mode=0755", "tmpfs", str(t)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            _unmount(done)
            return []
        done.append(t)
    return done


def _unmount(mounts: Sequence[Path]) -> None:
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def run(d: Path, port_base: int, only: Optional[set[str]] = None,
        progress: Callable[[str], None] = lambda s: None) -> list[FaultResult]:
    """Start the devcluster in ``d``, run the scenarios (``only``: a subset by method name), stop it."""
    d.mkdir(parents=True, exist_ok=True)
    for sub in ("run", "antman-state"):
        shutil.rmtree(d / sub, ignore_errors=True)
    mounts = _mount_state_dirs(d, port_base)
    results: list[FaultResult] = []
    try:
        cluster = dc.up(d, nodes=1, gpus=1, cpus=4, port_base=port_base, overrides={
            "grace_time_s": GRACE_S, "nodes": {"gpu_memory_mb": 2048},
            "sidecar": {"compliance_grace_s": COMPLIANCE_GRACE_S},
            "tenants": [{"account": "research", "guaranteed_gpus": 1}]})
        try:
            work = d / "jobs"
            work.mkdir(exist_ok=True)
            sc = Scenarios(ClusterJobs(cluster, work), mounts)
            for scenario in sc.all():
                if only and scenario.__name__ not in only:
                    continue
                progress(f"{scenario.__name__} ...")
                try:
                    res = scenario()
                except JobsError as e:
                    res = FaultResult(scenario.__name__, problems=[str(e)])
                results.append(res)
                progress(f"{scenario.__name__}: {'ok' if res.ok else 'FAILED' if not res.skipped else 'skipped'}")
                sc._reset()
        finally:
            dc.down(d)  # cancels every job first, whoever submitted it
    finally:
        _unmount(mounts)
        shutil.rmtree(dc.run_dir(port_base), ignore_errors=True)
    return results


SCENARIO_NAMES = ("sidecar_killed", "coordinator_torn_audit", "slurmctld_stopped", "agent_killed_mid_message",
                  "state_dir_full", "forged_class", "huge_reports")


def _table(results: Sequence[FaultResult]) -> str:
    rows = [("fault", "jobs lost", "jobs doubled", "guaranteed restarts", "recover (s)", "problems")]
    for r in results:
        rows.append((r.fault, str(r.jobs_lost), str(r.jobs_doubled), str(r.guaranteed_restarts),
                     "-" if r.recover_s is None else f"{r.recover_s:.1f}",
                     f"skipped: {r.skipped}" if r.skipped else "; ".join(r.problems) or "none"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="antman bench faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help='print {"faults": [{"fault", "jobs_lost", ...}, ...]}')
    ap.add_argument("--only", help=f"comma-separated scenarios: {', '.join(SCENARIO_NAMES)}")
    ap.add_argument("--dir", help="work directory (devcluster, job output); default: a new temporary one")
    ap.add_argument("--port-base", type=int, default=19100, help="the devcluster's first TCP port (loopback)")
    a = ap.parse_args(argv)
    only = None
    if a.only:
        only = {s.strip() for s in a.only.split(",") if s.strip()}
        unknown = sorted(only - set(SCENARIO_NAMES))
        if unknown:
            print(f"antman bench faults: --only {', '.join(unknown)}: allowed: {', '.join(SCENARIO_NAMES)}",
                  file=sys.stderr)
            return 2
    if os.geteuid() != 0:
        print("antman bench faults: runs slurmctld, slurmd and mounts: run it as root", file=sys.stderr)
        return 2
    d = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="antman-faults-"))

    def on_term(signum, frame):
        raise SystemExit(128 + signum)  # through the finally blocks: the cluster down, the mounts gone

    signal.signal(signal.SIGTERM, on_term)
    try:
        results = run(d, a.port_base, only, progress=lambda s: print(f"antman bench faults: {s}", file=sys.stderr))
    except dc.DevclusterError as e:
        print(f"antman bench faults: the devcluster did not come up: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"faults": [{k: v for k, v in asdict(r).items()} for r in results]}, indent=2))
    else:
        print(_table(results))
    return 0 if results and all(r.ok or r.skipped for r in results) else 1
