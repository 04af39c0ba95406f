"""``antman bench simulate``: replay a trace window on a simulated cluster under one or more policies
with the production policy code (see slurm_antman/lab/evaluation/simulator/), print a table or JSON,
and write results.json, per-job CSVs and plots with ``--out``."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from typing import Optional

from slurm_antman.coordinator.tenants import quotas_from_associations
from slurm_antman.errors import AntmanError
from slurm_antman.slurm import CliBackend

from slurm_antman.lab.evaluation import perturb, report, sacct_trace, traces, utilisation
from slurm_antman.lab.evaluation.simulator import NO_ROOM, POLICIES, SimConfig
from slurm_antman.lab.evaluation.simulator.config import BACKFILLS, PLACEMENTS
from slurm_antman.lab.evaluation.simulator.parallel import default_workers, simulate_many
from slurm_antman.lab.evaluation.simulator.slot_fill import COMPUTE_MODES, SlotFillParams
from slurm_antman.lab.evaluation.workloads import GiB


def add_trace_args(p: argparse.ArgumentParser, nodes: int, gpus: int, speedup: float, trace_required: bool = True) -> None:
    """The flags ``antman bench simulate`` and ``antman bench trace`` share (their defaults differ:
    a simulated cluster is large, the devcluster small)."""
    p.add_argument("--trace", required=trace_required,
                   help="Philly (philly_pollux.csv) or openb pod list CSV, or a site's own history: the output "
                        f"of sacct -X --json, or of sacct -X -P --format={sacct_trace.P_FORMAT}")
    p.add_argument("--window", help="START:END in seconds from the trace start, or ISO START/END")
    p.add_argument("--tenants", help="comma-separated tenants (Philly virtual clusters) to keep")
    p.add_argument("--nodes", type=int, default=nodes, help="nodes of the cluster the trace is replayed on")
    p.add_argument("--gpus", type=int, default=gpus, help="GPUs per node")
    p.add_argument("--gpu-mem-gib", type=float, default=32.0, help="memory of each GPU in GiB")
    p.add_argument("--speedup", type=float, default=speedup, help="divide every trace time by this")
    p.add_argument("--policy", default="antman",
                   help=f"one of {', '.join(POLICIES)}, a comma-separated list, or 'all'")
    p.add_argument("--quota-scale", type=float, default=1.0,
                   help="tenant quotas: this times the cluster size times the tenant's GPU-time share")
    p.add_argument("--seed", type=int, default=0, help="workload profile assignment seed")
    p.add_argument("--utilisation", default=SimConfig.utilisation, choices=utilisation.MODES,
                   help="how busy jobs keep their GPUs: production (drawn from published cluster figures, "
                        "docs/workload_model.md) or saturated (as busy as a benchmark: the pessimistic case)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="antman bench simulate", description=__doc__)
    add_trace_args(p, nodes=4, gpus=8, speedup=1.0, trace_required=False)
    site = p.add_argument_group("a site's own history (docs/admin.md, \"What would antman buy my cluster?\")")
    site.add_argument("--from-sacct", action="store_true",
                      help="replay this cluster's own jobs: sacct -X --json from Slurm accounting (slurmdbd) "
                           "between --since and --until, instead of --trace")
    site.add_argument("--since", default="now-30days", help="with --from-sacct: sacct's -S (default now-30days)")
    site.add_argument("--until", default="now", help="with --from-sacct: sacct's -E (default now)")
    site.add_argument("--save-sacct", metavar="FILE",
                      help="with --from-sacct: keep what sacct printed, to replay it again with --trace FILE")
    site.add_argument("--shape-from-slurm", action="store_true",
                      help="--nodes and --gpus from this cluster (scontrol show nodes: the nodes with GPUs, "
                           "and the GPU count most of them have)")
    site.add_argument("--quotas-from-slurm", action="store_true",
                      help="each account's guaranteed GPUs from Slurm accounting (GrpTRES=gres/gpu=N), in place "
                           "of its share of the history's GPU-time times --quota-scale")
    p.add_argument("--cycle-s", type=float, default=SimConfig.cycle_s,
                   help="least simulated seconds between coordinator cycles (and quota-file rewrites)")
    p.add_argument("--perturb", type=int, default=1, metavar="N",
                   help="run each policy N times, the coordinator cycle shifted by whole seconds around --cycle-s "
                        "(5: -2 to +2 s), and report each metric's mean and range: one run moves by a few percent "
                        "with the cycle's phase (lab/evaluation/perturb.py). The tables and CSVs stay the nominal run's")
    p.add_argument("--slow-preempt-s", type=_seconds_or_none, default=SimConfig.slow_preempt_s,
                   help="the sidecar's slow_preempt_s: seconds over the slowdown target at the minimum share "
                        "before an opportunistic neighbour is preempted; 'none': throttle only")
    p.add_argument("--pause-max-s", type=_seconds_or_none, default=SimConfig.pause_max_s,
                   help="antman: sidecar.pause_max_s, pause an opportunistic job in place (its state to host memory) "
                        "for at most this long before it is requeued; 'none' (default here): requeue at once")
    p.add_argument("--resume-hold-s", type=float, default=SimConfig.resume_hold_s,
                   help="antman: sidecar.resume_hold_s, how long its GPU must fit a paused job again before it resumes")
    p.add_argument("--util-scale", type=float, default=SimConfig.util_scale,
                   help="production: multiply every job's drawn utilisation by this (capped at its benchmark's)")
    p.add_argument("--slots-per-gpu", type=int, default=SimConfig.slots_per_gpu,
                   help="antman and shared: opportunistic.slots_per_gpu, the opportunistic jobs one GPU may host "
                        "(default %(default)s, as antman.yaml's)")
    p.add_argument("--oom-retry-s", type=float, default=SimConfig.oom_retry_s,
                   help="shared: seconds from a job's first CUDA out-of-memory failure to its user's resubmission "
                        "(Slurm ends it FAILED and does not requeue it; default %(default)s)")
    p.add_argument("--oom-retry-max-s", type=float, default=SimConfig.oom_retry_max_s,
                   help="shared: each further failure of the same job doubles the wait before its resubmission, up to "
                        "this (default %(default)s: an hour; equal to --oom-retry-s: every time alike)")
    p.add_argument("--util-threshold", type=float, default=SimConfig.util_threshold,
                   help="antman: opportunistic.utilization_threshold, the GPU utilisation over which a GPU takes no "
                        "new opportunistic job (default %(default)s, as antman.yaml's)")
    p.add_argument("--min-progress", type=float, default=SimConfig.min_progress,
                   help="antman: opportunistic.min_progress (a GPU takes an opportunistic job only where it is "
                        "predicted to make this fraction of its solo rate; under it a running job crawls)")
    p.add_argument("--move-after-s", type=_seconds_or_none, default=SimConfig.move_after_s,
                   help="antman: opportunistic.move_after_s (seconds a job may crawl before it is moved); 'none'")
    p.add_argument("--no-room", choices=NO_ROOM, default=SimConfig.no_room,
                   help="antman: an opportunistic job on a node where too few GPUs meet the opportunistic rules "
                        "waits for room (wait, the default, as antman.yaml's opportunistic.no_room) or starts on the "
                        "least-loaded ones (fallback)")
    p.add_argument("--no-room-wait-max-s", type=float, default=None,
                   help="antman, what-if not built on the real path: under --no-room wait, an opportunistic job "
                        "waits for room at most this long after its submission, then starts as under fallback")
    p.add_argument("--upgrade-running", action="store_true",
                   help="antman: make running opportunistic jobs guaranteed when their tenant has quota again "
                        "(antman.yaml opportunistic.upgrade_running; off by default)")
    p.add_argument("--move-gain", type=float, default=SimConfig.move_gain,
                   help="antman: opportunistic.move_gain (a move needs a GPU promising this many times the progress)")
    p.add_argument("--placement", choices=PLACEMENTS, default=SimConfig.placement,
                   help="nodes: a job on one node if it fits one, else on as few nodes as hold it (-N, as Slurm and "
                        "the replay); spread: free GPUs wherever they are (the model until 2026-11-26)")
    p.add_argument("--backfill", choices=BACKFILLS, default=SimConfig.backfill,
                   help="easy: submission order with a reservation for the first job that cannot start (Slurm's "
                        "sched/backfill, see simulator/scheduler.py); first_fit: any job that fits starts (the model until "
                        "2026-11-26)")
    p.add_argument("--no-locality", dest="locality", action="store_false",
                   help="a multi-node job runs as fast as a packed one (default: Pollux's measured per-GPU efficiency)")
    p.add_argument("--nodes-per-switch", type=int, default=SimConfig.nodes_per_switch,
                   help="topology/tree: nodes under each leaf switch (0: one switch)")
    p.add_argument("--switch-wait-s", type=_seconds_or_none, default=SimConfig.switch_wait_s,
                   help="antman: an opportunistic multi-node job waits this long for one switch "
                        "(opportunistic.switch_wait_s); 'none'")
    p.add_argument("--compute", choices=COMPUTE_MODES, default=SimConfig.compute,
                   help="antman: opportunistic jobs beside a guaranteed job run under the duty throttle's share "
                        "(duty) or fill its idle slots (slots: simulator/slot_fill.py; parameters measured once on an "
                        "H100, GPU proof run 4)")
    p.add_argument("--fill-efficiency", type=float, default=SlotFillParams.fill_efficiency,
                   help="--compute slots: fraction of the guaranteed job's idle device time filled (default %(default)s, "
                        "an H100's; the contending emulated GPU's: 0.69)")
    p.add_argument("--slot-leak", type=float, default=SlotFillParams.leak,
                   help="--compute slots: the guaranteed job's slowdown beside slot-filling jobs (default %(default)s, "
                        "an H100's; the contending emulated GPU's: 0.004)")
    p.add_argument("--elastic-share", type=float, default=SimConfig.elastic_share,
                   help="antman: the share of multi-GPU jobs that are elastic (1 to their GPUs; 0 to 1)")
    p.add_argument("--elastic-change-s", type=float, default=SimConfig.elastic_change_s,
                   help="antman: seconds a width change stops an elastic job (default: the devcluster's measured "
                        "median training gap, tests/test_cluster_elastic.py; Amoeba's ~95%% saving gives 0.3)")
    p.add_argument("--elastic-hold-s", type=float, default=SimConfig.elastic_hold_s,
                   help="antman: least seconds between two width changes of one job (hysteresis)")
    p.add_argument("--elastic-narrow-start", action="store_true",
                   help="antman, what-if not built on the real path: an elastic job with no room for all of it "
                        "starts on the node with the most room, narrower")
    p.add_argument("--elastic-grow-shared", action="store_true",
                   help="antman, what-if not built on the real path: an elastic job grows onto any GPU where the "
                        "node policy would place an opportunistic job (default: an idle GPU it shed)")
    p.add_argument("--elastic-arrays", action="store_true",
                   help="antman: elastic jobs wider than a node run as the real path runs them, a job array of "
                        "one-node tasks whose width changes by whole tasks (simulator/elastic_array.py)")
    p.add_argument("--elastic-array-shrink-s", type=float, default=SimConfig.elastic_array_shrink_s,
                   help="--elastic-arrays: seconds a task's loss stops the training across nodes, besides redoing "
                        "the work since the checkpoint the staying tasks took for it (default %(default)s: the "
                        "devcluster's measured gap, docs/benchmarks.md)")
    p.add_argument("--elastic-array-grow-s", type=float, default=SimConfig.elastic_array_grow_s,
                   help="--elastic-arrays: seconds a task's start stops the training across nodes, besides redoing "
                        "the work since the checkpoint the running tasks took for it (default %(default)s: the "
                        "devcluster's measured gap, docs/benchmarks.md)")
    p.add_argument("--elastic-array-host-first", action="store_true",
                   help="with --elastic-arrays: an array's other tasks are held while its rendezvous host (task 0) "
                        "is pending, so none holds GPUs waiting for it (a what-if of a coordinator rule)")
    p.add_argument("--elastic-array-min-tasks", type=int, default=SimConfig.elastic_array_min_tasks,
                   help="--elastic-arrays: the fewest tasks the training runs on (MIN = this x G; default %(default)s)")
    p.add_argument("--wait-study-s", type=float, default=None,
                   help="antman, a study: while a one-GPU opportunistic job waits for room, at most once per this "
                        "many simulated seconds, count which rule keeps each GPU from it (metrics: wait_study)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run the policies (and the cycles of --perturb) in up to N processes at once; the results "
                        f"are those of --jobs 1, in the same order (default 1; this machine: {default_workers() + 1} "
                        "cores)")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument("--out", help="directory for results.json, jobs-POLICY.csv and PNG plots")
    return p


def _from_slurm(a: argparse.Namespace) -> dict:
    """What ``--from-sacct``, ``--shape-from-slurm`` and ``--quotas-from-slurm`` read from the running
    cluster, through the Slurm adapter; sets ``a.trace``, ``a.nodes`` and ``a.gpus`` as they say.
    Returns what the report records of it."""
    if a.from_sacct == bool(a.trace):
        raise ValueError("give --trace FILE or --from-sacct (this cluster's own history), one of the two")
    if not (a.from_sacct or a.shape_from_slurm or a.quotas_from_slurm):
        return {}
    backend = CliBackend(timeout=600)  # months of accounting can take sacct minutes
    out: dict = {}
    if a.from_sacct:
        text = backend.accounting_history(a.since, a.until)
        if a.save_sacct:
            path = a.save_sacct
        else:
            fd, path = tempfile.mkstemp(prefix="antman-sacct-", suffix=".json")
            os.close(fd)
            atexit.register(os.unlink, path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        a.trace = path
        out["sacct"] = {"since": a.since, "until": a.until, "saved": a.save_sacct}
    if a.shape_from_slurm:
        counts = Counter(n.gres.get("gpu", 0) for n in backend.nodes() if n.gres.get("gpu", 0) > 0)
        if not counts:
            raise ValueError("--shape-from-slurm: no node of this cluster has a gpu GRES")
        a.gpus = counts.most_common(1)[0][0]
        a.nodes = sum(counts.values())
        out["shape_from_slurm"] = {"nodes": a.nodes, "gpus_per_node": a.gpus,
                                   "gpus_by_node_count": {str(k): v for k, v in sorted(counts.items())}}
    if a.quotas_from_slurm:
        cluster = backend.config().get("ClusterName", "")
        reading = quotas_from_associations(backend.associations(), cluster)
        for problem in reading.problems:
            print(f"antman bench simulate: {problem}", file=sys.stderr)
        if not reading.quotas:
            raise ValueError(f"--quotas-from-slurm: no account of cluster {cluster!r} has GrpTRES=gres/gpu=N")
        out["quotas_from_slurm"] = dict(sorted(reading.quotas.items()))
        out["quotas_tuple"] = tuple(sorted(reading.quotas.items()))
    return out


def _seconds_or_none(text: str) -> Optional[float]:
    if text.strip().lower() in ("none", "null", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds, or 'none'") from None


def _policies(text: str) -> list[str]:
    names = list(POLICIES) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(f"--policy {text!r}: allowed: {', '.join(POLICIES)}, a comma-separated list, or all")
    return names


def main(argv: Optional[list[str]] = None) -> int:
    a = _parser().parse_args(argv)
    site: dict = {}
    try:
        policies = _policies(a.policy)
        tenants = [t.strip() for t in a.tenants.split(",") if t.strip()] if a.tenants else None
        t0 = time.perf_counter()
        site = _from_slurm(a)
        skips = sacct_trace.SacctSkips()
        jobs = sorted(traces.load(a.trace, a.window, tenants, skips), key=lambda j: (j.submit_s, j.job_id))
        if traces.detect_format(a.trace) == traces.SACCT:
            site["sacct_skipped"] = skips.to_json()
            # What accounting does not hold is said, not hidden: each job's GPU use comes from the model.
            print(f"antman bench simulate: {len(jobs)} jobs from {a.trace}; left out: {skips.no_gpu} without GPUs, "
                  f"{skips.never_ran} that never started, {skips.still_running} still running. Accounting holds "
                  f"no GPU utilisation or memory: each job's comes from the workload model "
                  f"(--utilisation {a.utilisation}, --util-scale {a.util_scale:g}; docs/workload_model.md)",
                  file=sys.stderr)
        if not jobs:
            print(f"antman bench simulate: no jobs in {a.trace} for window {a.window!r} and tenants {tenants}",
                  file=sys.stderr)
            return 2
        cfgs = [SimConfig(policy=p, nodes=a.nodes, gpus_per_node=a.gpus, gpu_mem_bytes=int(a.gpu_mem_gib * GiB),
                          speedup=a.speedup, quota_scale=a.quota_scale, seed=a.seed,
                          cycle_s=a.cycle_s, slow_preempt_s=a.slow_preempt_s, utilisation=a.utilisation,
                          util_scale=a.util_scale, min_progress=a.min_progress, move_after_s=a.move_after_s,
                          slots_per_gpu=a.slots_per_gpu, util_threshold=a.util_threshold, move_gain=a.move_gain,
                          oom_retry_s=a.oom_retry_s, oom_retry_max_s=a.oom_retry_max_s,
                          no_room=a.no_room, upgrade_running=a.upgrade_running, pause_max_s=a.pause_max_s,
                          resume_hold_s=a.resume_hold_s, placement=a.placement, backfill=a.backfill,
                          locality=a.locality, nodes_per_switch=a.nodes_per_switch, switch_wait_s=a.switch_wait_s,
                          elastic_share=a.elastic_share, elastic_change_s=a.elastic_change_s,
                          compute=a.compute, slot_fill=SlotFillParams(a.fill_efficiency, a.slot_leak),
                          elastic_hold_s=a.elastic_hold_s, elastic_narrow_start=a.elastic_narrow_start,
                          elastic_grow_shared=a.elastic_grow_shared, elastic_arrays=a.elastic_arrays,
                          elastic_array_shrink_s=a.elastic_array_shrink_s, elastic_array_grow_s=a.elastic_array_grow_s,
                          elastic_array_min_tasks=a.elastic_array_min_tasks,
                          elastic_array_host_first=a.elastic_array_host_first,
                          wait_study_s=a.wait_study_s, no_room_wait_max_s=a.no_room_wait_max_s,
                          quotas=site.get("quotas_tuple"))
                for p in policies]
        perturb_cycles = perturb.cycles(a.cycle_s, a.perturb)
        if a.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {a.jobs}")
    except (traces.TraceError, ValueError, AntmanError) as e:
        print(f"antman bench simulate: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    # Every run at once: each policy's nominal run, then its shifted cycles (--perturb), in this order.
    shifted = [perturb.variants(cfg, a.perturb) for cfg in cfgs]
    written: set[str] = set()

    def done(k: int, r) -> None:
        # A policy's per-job rows are written as its run ends, beside the runs still going (antman's
        # takes the longest), so that little is left to write after the last.
        if a.out and k < len(cfgs):
            report.write_jobs(a.out, r)
            written.add(r.policy)

    runs = simulate_many(jobs, cfgs + [c for v in shifted for c in v], a.jobs, done)
    results, rest = runs[:len(cfgs)], iter(runs[len(cfgs):])
    others = [[next(rest).metrics for _ in v] for v in shifted]
    meta = {"trace": a.trace, "window": a.window, "tenants": tenants, "jobs": len(jobs), "nodes": a.nodes,
            "gpus_per_node": a.gpus, "gpu_mem_gib": a.gpu_mem_gib, "speedup": a.speedup,
            "quota_scale": a.quota_scale, "seed": a.seed, "cycle_s": a.cycle_s, "slow_preempt_s": a.slow_preempt_s,
            "utilisation": a.utilisation, "util_scale": a.util_scale, "min_progress": a.min_progress, "move_after_s": a.move_after_s,
            "slots_per_gpu": a.slots_per_gpu, "util_threshold": a.util_threshold,
            "oom_retry_s": a.oom_retry_s, "oom_retry_max_s": a.oom_retry_max_s,
            "move_gain": a.move_gain, "no_room": a.no_room, "upgrade_running": a.upgrade_running,
            "pause_max_s": a.pause_max_s, "resume_hold_s": a.resume_hold_s, "placement": a.placement,
            "backfill": a.backfill, "locality": a.locality, "nodes_per_switch": a.nodes_per_switch,
            "switch_wait_s": a.switch_wait_s, "elastic_share": a.elastic_share,
            "compute": a.compute, "fill_efficiency": a.fill_efficiency, "slot_leak": a.slot_leak,
            "elastic_change_s": a.elastic_change_s, "elastic_hold_s": a.elastic_hold_s,
            "elastic_narrow_start": a.elastic_narrow_start, "elastic_grow_shared": a.elastic_grow_shared,
            "elastic_arrays": a.elastic_arrays, "elastic_array_shrink_s": a.elastic_array_shrink_s,
            "elastic_array_grow_s": a.elastic_array_grow_s,
            "elastic_array_min_tasks": a.elastic_array_min_tasks,
            "elastic_array_host_first": a.elastic_array_host_first, "load_s": round(load_s, 3), "jobs_at_once": a.jobs,
            "command": shlex.join(["antman", "bench", "simulate", *(sys.argv[1:] if argv is None else argv)]),
            **{k: v for k, v in site.items() if k != "quotas_tuple"}}
    if a.perturb > 1:
        meta["perturbed"] = {cfg.policy: perturb.collect(cfg, a.perturb, r.metrics, o)
                             for cfg, r, o in zip(cfgs, results, others)}
        meta["perturb_cycles_s"] = perturb_cycles
    notes = report.write(a.out, results, meta, written) if a.out else []
    if a.json:
        print(json.dumps(report.document(results, meta), indent=2, sort_keys=True))
    else:
        keys = ("jobs_done", "sm_util", "useful_util_queued", "mem_util", "jct_mean_s", "jct_guaranteed_mean_s",
                "queue_delay_mean_s", "preemptions", "moves", "preemption_lost_gpu_s", "oom_failures", "wall_s")
        print("policy      " + " ".join(f"{k:>22}" for k in keys))
        for r in results:
            vals = [r.metrics.get(k) for k in keys]
            print(f"{r.policy:<11} " + " ".join(f"{v:>22.4g}" if isinstance(v, float) else f"{str(v):>22}"
                                               for v in vals))
        if a.perturb > 1:
            print(f"over {a.perturb} runs, cycle {perturb_cycles[0]:g}-{perturb_cycles[-1]:g} s: mean [min, max]")
            for name, summary in meta["perturbed"].items():
                print(perturb.line(name, summary))
    for n in notes:
        print(n, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
