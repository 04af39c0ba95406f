"""``antman bench trace``: replay a trace window through the local devcluster (real sbatch, Slurm,
sidecars, coordinator; emulated jobs speaking the real agent protocol) under one or more policies, and
with ``--with-simulator`` run ``antman bench simulate``'s simulator on the same jobs to measure how
far the two agree. Prints a table or JSON; ``--out`` writes results.json, per-job CSVs and plots."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from .simulate import _policies, add_trace_args
from slurm_antman.lab.devcluster.processes import DevclusterError
from slurm_antman.lab.evaluation import replay as rp
from slurm_antman.lab.evaluation import report, traces
from slurm_antman.lab.evaluation.simulator import SimConfig, simulate
from slurm_antman.lab.evaluation.workloads import GiB

KEYS = ("jobs_done", "sm_util", "mem_util", "jct_mean_s", "jct_guaranteed_mean_s", "queue_delay_mean_s",
        "preemptions", "oom_failures", "wall_s")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="antman bench trace", description=__doc__.split("\n\n")[0])
    add_trace_args(p, nodes=2, gpus=4, speedup=60.0)
    # The emulated jobs run their model's benchmark duty: production idle time is not emulated yet,
    # so the replay and its simulator run saturated (a clear error below for anything else).
    p.set_defaults(utilisation="saturated")
    p.add_argument("--iter-scale", type=float, default=1.0, help="emulated mini-batch time = profile's x this")
    p.add_argument("--contend", action=argparse.BooleanOptionalAction, default=True,
                   help="the emulated jobs run on contending emulated GPUs (emulated_job --contend): "
                        "interference emerges from their timing (the default); --no-contend: it is "
                        "read from the workload formula, which the replay then cannot disagree with")
    p.add_argument("--max-wall-s", type=float, default=1800.0, help="give up on jobs not done after this long")
    p.add_argument("--oom-retry-s", type=float, default=rp.ReplayConfig.oom_retry_s,
                   help="shared: seconds from a job's first CUDA out-of-memory failure to its resubmission, doubled "
                        "for each further failure of the same job up to the simulator's oom_retry_max_s "
                        "(trace_run.oom_resubmit_delay; default %(default)s)")
    p.add_argument("--dir", help="work directory (devcluster, job state); default: a new temporary one")
    p.add_argument("--port-base", type=int, default=18900, help="the devcluster's first TCP port (loopback)")
    p.add_argument("--with-simulator", action="store_true",
                   help="also simulate the same jobs and report the agreement per metric")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument("--out", help="directory for results.json, jobs-POLICY.csv and PNG plots")
    return p


def run(a: argparse.Namespace, log=lambda s: print(s, file=sys.stderr)) -> dict:
    # The devcluster replays what it can run for real: quota and scavenger are simulator baselines.
    policies = list(rp.POLICIES) if a.policy == "all" else _policies(a.policy)
    if a.utilisation != "saturated":
        raise rp.ReplayError(f"--utilisation {a.utilisation}: the devcluster replay's emulated jobs run as busy as "
                             "their benchmark; only --utilisation saturated is supported here")
    tenants = [t.strip() for t in a.tenants.split(",") if t.strip()] if a.tenants else None
    jobs = traces.load_sorted(a.trace, a.window, tenants)
    jobs, too_wide = rp.fits(jobs, a.gpus)
    if not jobs:
        raise rp.ReplayError(f"no jobs in {a.trace} for window {a.window!r} and tenants {tenants} "
                             f"that fit a node of {a.gpus} GPUs")
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="antman-trace-"))
    results, sims = [], []
    for policy in policies:
        cfg = rp.ReplayConfig(policy=policy, nodes=a.nodes, gpus_per_node=a.gpus,
                              gpu_mem_bytes=int(a.gpu_mem_gib * GiB), speedup=a.speedup,
                              quota_scale=a.quota_scale, seed=a.seed, iter_scale=a.iter_scale, contend=a.contend,
                              max_wall_s=a.max_wall_s, port_base=a.port_base, oom_retry_s=a.oom_retry_s)
        log(f"antman bench trace: {policy}: {len(jobs)} jobs on {a.nodes} x {a.gpus} emulated GPUs ...")
        t = time.perf_counter()
        results.append(rp.replay(jobs, cfg, work / policy, log))
        log(f"antman bench trace: {policy}: done in {time.perf_counter() - t:.0f} s")
        if a.with_simulator:
            # The devcluster's coordinator cycles every second; so does the simulated one here. Its
            # jobs take seconds to start (Python, torch, registering): the simulator is told how long.
            sims.append(simulate(jobs, SimConfig(**{**cfg.common(), "grace_s": float(cfg.grace_s)}, cycle_s=1.0,
                                                 utilisation="saturated",
                                                 start_overhead_s=results[-1].metrics["start_overhead_s"] or 0.0)))
    meta = {"trace": a.trace, "window": a.window, "tenants": tenants, "jobs": len(jobs),
            "jobs_left_out_too_wide": len(too_wide), "nodes": a.nodes, "gpus_per_node": a.gpus,
            "gpu_mem_gib": a.gpu_mem_gib, "speedup": a.speedup, "quota_scale": a.quota_scale, "seed": a.seed,
            "iter_scale": a.iter_scale, "contend": a.contend, "oom_retry_s": a.oom_retry_s,
            "source": "devcluster replay"}
    doc = report.document(results, meta)
    if sims:
        doc["simulator"] = report.document(sims, {**meta, "source": "simulator", "cycle_s": 1.0})
        doc["agreement"] = {r.policy: rp.agreement(r.metrics, s.metrics) for r, s in zip(results, sims)}
    if a.out:
        for note in report.write(a.out, results, meta):
            log(note)
        if sims:
            for note in report.write(Path(a.out) / "simulator", sims, {**meta, "source": "simulator"}):
                log(note)
        (Path(a.out) / "results.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return doc


def main(argv: Optional[list[str]] = None) -> int:
    a = _parser().parse_args(argv)
    try:
        doc = run(a)
    except (traces.TraceError, rp.ReplayError, ValueError) as e:
        print(f"antman bench trace: {e}", file=sys.stderr)
        return 2
    except DevclusterError as e:
        print(f"antman bench trace: the devcluster did not come up: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    print("policy      " + " ".join(f"{k:>22}" for k in KEYS))
    for name, m in doc["policies"].items():
        print(f"{name:<11} " + " ".join(f"{m.get(k):>22.4g}" if isinstance(m.get(k), float)
                                        else f"{str(m.get(k)):>22}" for k in KEYS))
    for name, agr in doc.get("agreement", {}).items():
        print(f"agreement {name}: " + ", ".join(f"{k} {v}" for k, v in agr.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
