"""``antman bench pause``: pause in place against requeue, measured side by side.

Pause, on this machine: the real sidecar (emulated telemetry, one 16 GiB GPU) and a real training
process with the real agent (``slurm_antman/lab/jobs/demo_train.py``, its GPU footprint emulated at
``--footprint-gib``). A guaranteed job's agent (this process, speaking the protocol) bursts to leave
the opportunistic job less than its minimum memory; the sidecar pauses it; the burst ends and, after
``resume_hold_s``, the sidecar resumes it. Measured at the sidecar: from its decision to the agent's
``paused`` (the GPU memory free), and from its resume decision to the agent's ``resumed`` (training
again). On CPU the bytes do not cross a bus: the copy itself is ``antman bench gpu``'s part 7.

Requeue, on the devcluster: the same training job, opportunistic, is requeued the way the coordinator
does it (``scontrol requeue``, a second later ``StartTime=now+2``: Slurm 22.05 refuses a credential
made in the second its old one was revoked); measured from the requeue to its first step after the
restart (Slurm's kill and restart, Python and torch starting, the checkpoint loaded).

``speedup_vs_requeue`` is the requeue's time from the decision to training again over the pause's
(decision to ack, plus resume decision to training again); the target: >= 20.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median
from typing import Optional, Sequence

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman.lab import jobs
from slurm_antman.lab.fake_agent import FakeAgent

TRAIN = jobs.script("demo_train.py")
GiB = 1 << 30
OPP_TRAIN = ("import runpy, sys, torch_patch; torch_patch.install().emulate_device(int(sys.argv[1]), 0.5); "
             "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def _wait(pred, timeout: float, what: str, tick=None, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


def measure_pause(rounds: int, footprint_gib: float, workdir: Path) -> dict:
    from slurm_antman.clients import sidecar_control as client
    from slurm_antman.sidecar.cli import build

    conf = cfgmod.parse({"nodes": [{"name": "bench", "gpus": 1, "gpu_memory_mb": 16384}],
                         "sidecar": {"heartbeat_s": 0.2, "telemetry": "emulated", "resume_hold_s": 0.5,
                                     "pause_max_s": 600}})
    sockdir = tempfile.mkdtemp(prefix="am-pause-", dir="/tmp")
    sc = build(conf, "bench", sockdir, tick_s=0.05, uplink=False)
    sc.start()
    loop = threading.Thread(target=sc.serve_forever, daemon=True)
    loop.start()
    proc = None
    g = None
    try:
        reg = client.register_job(sockdir, "1", uid=os.getuid(), user="bench", job_class="guaranteed", gpus=1,
                                  physical_gpus=[0])
        # The guaranteed job's agent is spoken from here: its reported memory is the burst.
        g = FakeAgent(reg.endpoint, "1", job_class="guaranteed", hostname="bench", agent_version="bench")
        g.register(wait_s=0)
        g.report_memory(1 * GiB)
        o = client.register_job(sockdir, "2", uid=os.getuid(), user="bench", job_class="opportunistic", gpus=1)
        env = {**os.environ, p.ENV_JOB_ID: "2", p.ENV_CLASS: "opportunistic",
               p.ENDPOINT_ENV: o.endpoint, "SLURM_JOB_ID": "2"}
        ckpt = workdir / "pause-ckpt.pt"
        out = open(workdir / "pause-job.out", "w")
        proc = subprocess.Popen([sys.executable, "-c", OPP_TRAIN, str(int(footprint_gib * GiB)), str(TRAIN), str(ckpt),
                                 "1000000", "0.01"], env=env, stdout=out, stderr=subprocess.STDOUT)
        job = lambda: sc.jobs.get("2")  # noqa: E731 - read from the loop thread's objects, ints only
        _wait(lambda: job() and any(a.report for a in job().agents.values()), 120, "the job's agent reporting",
              tick=lambda: g.report_memory(1 * GiB))
        acks, resumes = [], []
        for _ in range(rounds):
            n_ack, n_res = len(sc.pause_ack_ms), len(sc.resume_ack_ms)
            # The burst: 15 GiB of 16 leaves less than the 1 GiB minimum beside 512 MiB of headroom.
            _wait(lambda: len(sc.pause_ack_ms) > n_ack, 30, "the pause ack", tick=lambda: g.report_memory(15 * GiB))
            acks.append(sc.pause_ack_ms[-1])
            _wait(lambda: len(sc.resume_ack_ms) > n_res, 30, "the resume ack", tick=lambda: g.report_memory(1 * GiB))
            resumes.append(sc.resume_ack_ms[-1])
            _wait(lambda: not job().paused, 10, "the job running again")
        return {"rounds": rounds, "footprint_bytes": int(footprint_gib * GiB), "pause_ack_ms": acks,
                "resume_ms": resumes, "pause_ack_ms_median": median(acks), "resume_ms_median": median(resumes)}
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        if g is not None:
            g.close()
        sc.stop()
        loop.join(10)
        shutil.rmtree(sockdir, ignore_errors=True)


def measure_requeue(rounds: int, workdir: Path, port_base: int) -> dict:
    from slurm_antman.lab.devcluster import cluster as dc
    from slurm_antman.lab.devcluster.jobs import ClusterJobs, wait_for

    d = workdir / "devcluster"
    cluster = dc.up(d, nodes=1, gpus=1, cpus=4, port_base=port_base)
    try:
        jobs = ClusterJobs(cluster, workdir)
        ckpt = workdir / "requeue-ckpt.pt"
        jid = jobs.sbatch("--antman=opportunistic", "--gres=gpu:1",
                          script=f"#!/bin/bash\nexec {sys.executable} {TRAIN} {ckpt} 1000000 0.01\n")
        jobs.wait_output(jid, r"^step 20 ", timeout=120)
        back = []
        for r in range(1, rounds + 1):
            t0 = time.monotonic()
            cluster.run(["scontrol", "requeue", str(jid)], check=True)
            time.sleep(1.0)
            cluster.run(["scontrol", "update", f"JobId={jid}", "StartTime=now+2"])
            pattern = re.compile(rf"^START .*restarts={r} ", re.M)
            wait_for(lambda: pattern.search(jobs.output(jid)), 120, "the restart", step=0.05)
            start_at = len(jobs.output(jid))
            wait_for(lambda: re.search(r"^step ", jobs.output(jid)[start_at:], re.M), 60, "its first step", step=0.05)
            back.append(time.monotonic() - t0)
        return {"rounds": rounds, "back_s": back, "back_s_median": median(back)}
    finally:
        cluster.run(["scancel", "--user", "root"])
        dc.down(d)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="antman bench pause", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="pauses (and requeues) measured (default %(default)s)")
    ap.add_argument("--footprint-gib", type=float, default=4.0, help="the job's emulated GPU footprint")
    ap.add_argument("--no-requeue", action="store_true", help="measure only the pause (no devcluster)")
    ap.add_argument("--port-base", type=int, default=19400, help="the devcluster's first TCP port (loopback)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        print("antman bench pause: --rounds must be at least 1", file=sys.stderr)
        return 2
    if not 0 < a.footprint_gib <= 14:
        print("antman bench pause: --footprint-gib must be in (0, 14] (the GPU is 16 GiB)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="antman-bench-pause-"))
    try:
        doc: dict = {"pause": measure_pause(a.rounds, a.footprint_gib, work)}
        if not a.no_requeue:
            if os.geteuid() != 0:
                print("antman bench pause: the requeue side runs a devcluster: run as root, or --no-requeue",
                      file=sys.stderr)
                return 2
            doc["requeue"] = measure_requeue(a.rounds, work, a.port_base)
            pause_s = (doc["pause"]["pause_ack_ms_median"] + doc["pause"]["resume_ms_median"]) / 1000.0
            requeue_s = doc["requeue"]["back_s_median"]  # from the requeue to training again
            doc["speedup_vs_requeue"] = requeue_s / pause_s
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        pz = doc["pause"]
        print(f"pause:   ack {pz['pause_ack_ms_median']:.1f} ms, resume {pz['resume_ms_median']:.1f} ms "
              f"(median of {pz['rounds']}; {pz['footprint_bytes'] / GiB:.1f} GiB emulated)")
        if "requeue" in doc:
            rq = doc["requeue"]
            print(f"requeue: training again {rq['back_s_median']:.2f} s after the requeue (median of {rq['rounds']})")
            print(f"speedup vs requeue: {doc['speedup_vs_requeue']:.0f}x")
    return 0
