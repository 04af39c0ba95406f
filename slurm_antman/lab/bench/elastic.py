"""``antman bench elastic``: a width change against a requeue (docs/elastic.md), side by side, on the
same job in one run.

On a devcluster (Slurm, the real sidecar, the SPANK plugin and job_submit.lua; one node of two
emulated 4 GiB GPUs, ``ConstrainDevices=yes``), an elastic job runs ``elastic_train.py`` (DDP on CPU,
gloo) under ``torch_patch.elastic_launch`` at width 2. Each round:

- **shrink**: a guaranteed job bursts on one of its GPUs (``demo_guaranteed.py``, 3,400 MiB: under
  the 1 GiB an opportunistic job needs is left); the sidecar sheds that GPU. Measured: from the
  sidecar's decision (its ``WIDTH`` log line) to the GPU given back (its own measure, logged), and
  to the job's first step at width 1;
- **grow**: the guaranteed job is cancelled; after ``sidecar.elastic_hold_s`` the sidecar grows the job
  back. Measured: from the decision to the first step at width 2.

Then the same job is **requeued** ``--rounds`` times the way the coordinator does it (``scontrol
requeue``, a second later ``StartTime=now+2``: Slurm 22.05 refuses a credential made in the second
its old one was revoked), measured from the requeue to its first step after the restart.

``gap_ratio`` is the median shrink's time to training again over the median requeue's. The
targets: the GPU given back within the grace time + 5 s, and a training gap well under a requeue's.
Every step of the job is checked to have been trained exactly once on its own samples (``lost``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Optional, Sequence

from slurm_antman.lab import jobs

TRAIN = jobs.script("elastic_train.py")
GUARANTEED = jobs.script("demo_guaranteed.py")
GLOBAL_BATCH = 32
CKPT_EVERY = 10       # elastic_train.py's --ckpt-every: what a requeue (no checkpoint hook) may repeat
GPU_MEMORY_MB = 4096  # demo_guaranteed's burst (3,400 MiB) leaves under the opportunistic minimum (1 GiB)
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def events(path: Path) -> list[dict]:
    """The JSON lines ``elastic_train.py`` wrote so far (a line being written is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def steps(evs: list[dict], width: Optional[int] = None, after: float = 0.0) -> list[dict]:
    return [e for e in evs if e.get("event") == "step" and (width is None or e.get("world_size") == width)
            and e.get("time", 0.0) > after]


def lost_steps(evs: list[dict], requeued_at: Sequence[float] = ()) -> list[str]:
    """What is wrong with the job's record: a step never trained, a step on other samples than its own,
    or a restart that resumed after the last step logged, or before it by more than its checkpoint
    allows: one step at a width change (the agent checkpoints at it), ``CKPT_EVERY`` after a requeue
    (times in ``requeued_at``: no hook runs, the periodic checkpoint is what there is). [] = nothing lost."""
    problems = []
    trained = steps(evs)
    if not trained:
        return ["no step trained"]
    missing = sorted(set(range(1, trained[-1]["step"] + 1)) - {e["step"] for e in trained})
    if missing:
        problems.append(f"steps never trained: {missing[:20]}")
    for e in trained:
        if (e["first"], e["last"]) != ((e["step"] - 1) * GLOBAL_BATCH, e["step"] * GLOBAL_BATCH - 1):
            problems.append(f"step {e['step']} trained samples {e['first']}-{e['last']}")
    prev_start = float("-inf")
    for i, e in enumerate(evs):
        if e.get("event") != "start":
            continue
        requeue = any(prev_start < t <= e["time"] for t in requeued_at)
        prev_start = e["time"]
        before = [x["step"] for x in evs[:i] if x.get("event") == "step"]
        allowed = CKPT_EVERY if requeue else 1
        if before and not 0 <= max(before) - e["step"] <= allowed:
            problems.append(f"a restart ({'requeue' if requeue else 'width change'}) resumed after step {e['step']} "
                            f"where step {max(before)} was the last logged (at most {allowed} may repeat)")
    return problems


def log_time(line: str) -> float:
    """The Unix time of a line of a daemon's log (Python logging's local-time stamp, milliseconds)."""
    m = _LOG_TIME.match(line)
    if m is None:
        raise ValueError(f"no time stamp in {line[:80]!r}")
    stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
    return stamp.timestamp() + int(m.group(2)) / 1000.0


class SidecarLog:
    """The node's sidecar log from the moment this is made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mark = path.stat().st_size if path.exists() else 0

    def text(self) -> str:
        return self.path.read_text(errors="replace")[self.mark:] if self.path.exists() else ""

    def find(self, pattern: str) -> Optional[re.Match]:
        return re.search(pattern, self.text(), re.M)


def elastic_job_script(ckpt: Path, log: Path, python: str = sys.executable) -> str:
    return (f"#!/bin/bash\nexec {python} -m torch_patch.elastic_launch {TRAIN} --ckpt {ckpt} --log-file {log} "
            f"--steps 1000000 --step-s 0.1 --global-batch {GLOBAL_BATCH}\n")


def measure(rounds: int, workdir: Path, port_base: int, hold_s: float = 3.0) -> dict:
    from slurm_antman import config as cfgmod
    from slurm_antman.lab.devcluster import cluster as dc
    from slurm_antman.lab.devcluster.hosts import let_users_through
    from slurm_antman.lab.devcluster.jobs import ClusterJobs, wait_for

    d = workdir / "devcluster"
    let_users_through(workdir)
    # With the coordinator and accounting, as `antman bench pause` measures its requeue: without a
    # coordinator a requeued job waited for Slurm's periodic scheduling pass (27-30 s here, 2026-11-26).
    cluster = dc.up(d, nodes=1, gpus=2, cpus=4, port_base=port_base,
                    overrides={"nodes": {"gpu_memory_mb": GPU_MEMORY_MB}, "sidecar": {"elastic_hold_s": hold_s}})
    try:
        cj = ClusterJobs(cluster, workdir)
        grace = float(cfgmod.load(cluster.config_path).grace_time_s)
        log, ckpt, phase = workdir / "train.jsonl", workdir / "train.ckpt", workdir / "phase"
        phase.write_text("burst")
        os.chmod(phase, 0o644)
        side = SidecarLog(d / "log" / "sidecar-node1.log")
        jid = cj.sbatch("--antman=opportunistic", "--antman-elastic=1:2", "--gres=gpu:2", "-w", "node1",
                        script=elastic_job_script(ckpt, log))
        wait_for(lambda: len(steps(events(log), 2)) >= 10, 180, "10 steps at width 2")
        shrinks, grows, returned = [], [], []
        for r in range(1, rounds + 1):
            gj = cj.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1",
                           script=f"#!/bin/bash\nexec {sys.executable} {GUARANTEED} {phase}\n")
            shed = wait_for(lambda: list(re.finditer(rf"^.*job {jid}: WIDTH 2 -> 1.*$", side.text(), re.M))[r - 1:],
                            120, f"shrink {r}", step=0.1)[0]
            t_shed = log_time(shed.group(0))
            back = wait_for(lambda: list(re.finditer(rf"job {jid}: GPU \d given back ([0-9.]+) s", side.text()))[r - 1:],
                            grace + 30, f"the GPU given back, round {r}", step=0.1)[0]
            returned.append(float(back.group(1)))
            first = wait_for(lambda: steps(events(log), 1, after=t_shed), 120, f"a step at width 1, round {r}", step=0.1)
            shrinks.append(first[0]["time"] - t_shed)
            cluster.run(["scancel", str(gj)], check=True)
            grow = wait_for(lambda: list(re.finditer(rf"^.*job {jid}: WIDTH 1 -> 2.*$", side.text(), re.M))[r - 1:],
                            120 + hold_s, f"grow {r}", step=0.1)[0]
            t_grow = log_time(grow.group(0))
            first = wait_for(lambda: steps(events(log), 2, after=t_grow), 120, f"a step at width 2, round {r}", step=0.1)
            grows.append(first[0]["time"] - t_grow)
            wait_for(lambda: len(steps(events(log), 2, after=t_grow)) >= 5, 60, "5 steps at width 2", step=0.2)
        requeues: list[float] = []
        requeued_at: list[float] = []
        for r in range(1, rounds + 1):
            t0 = time.time()
            requeued_at.append(t0)
            cluster.run(["scontrol", "requeue", str(jid)], check=True)
            time.sleep(1.0)
            cluster.run(["scontrol", "update", f"JobId={jid}", "StartTime=now+2"])
            # The first step of the run Slurm restarted (a step logged before the kill reached it is not).
            first = wait_for(lambda: [e for e in steps(events(log), after=_restarted(events(log), t0))],
                             180, f"training again after requeue {r}", step=0.1)
            requeues.append(first[0]["time"] - t0)
            wait_for(lambda: len(steps(events(log), after=t0)) >= 5, 60, "5 steps after the requeue", step=0.2)
        cluster.run(["scancel", str(jid)])
        lost = lost_steps(events(log), requeued_at)
        return {"rounds": rounds, "grace_s": grace, "hold_s": hold_s, "returned_s": returned,
                "shrink_to_training_s": shrinks, "grow_to_training_s": grows, "requeue_to_training_s": requeues,
                "returned_s_max": max(returned), "shrink_s_median": median(shrinks), "grow_s_median": median(grows),
                "requeue_s_median": median(requeues), "gap_ratio": median(shrinks) / median(requeues),
                "lost": lost}
    finally:
        ClusterJobs(cluster, workdir).cancel_all()
        dc.down(d)


def _restarted(evs: list[dict], since: float) -> float:
    """When the first start after ``since`` was logged; infinity before there is one."""
    return next((e["time"] for e in evs if e.get("event") == "start" and e.get("time", 0.0) > since), float("inf"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="antman bench elastic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="shrinks, grows and requeues measured (default %(default)s)")
    ap.add_argument("--hold-s", type=float, default=3.0, help="sidecar.elastic_hold_s on the bench's cluster")
    ap.add_argument("--port-base", type=int, default=19620, help="the devcluster's first TCP port (loopback)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        print("antman bench elastic: --rounds must be at least 1", file=sys.stderr)
        return 2
    if a.hold_s < 0:
        print("antman bench elastic: --hold-s must be >= 0", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("antman bench elastic: it runs a devcluster (slurmctld, slurmd): run as root", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="antman-bench-elastic-"))
    try:
        doc = measure(a.rounds, work, a.port_base, a.hold_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"shrink:  GPU given back after {', '.join(f'{x:.2f}' for x in doc['returned_s'])} s "
              f"(target <= grace {doc['grace_s']:g} s + 5 s); training again {doc['shrink_s_median']:.2f} s after "
              f"the decision (median of {doc['rounds']})")
        print(f"grow:    training again {doc['grow_s_median']:.2f} s after the decision")
        print(f"requeue: training again {doc['requeue_s_median']:.2f} s after the requeue")
        print(f"shrink / requeue: {doc['gap_ratio']:.2f}; lost: {doc['lost'] or 'nothing'}")
    return 0 if not doc["lost"] else 1
