"""Pairs of profiles on one contending emulated GPU (``contended_gpu``): measured slowdown against the
workload formula (``Profile.slowdown``, docs/workload_model.md).

    python -m slurm_antman.lab.evaluation.contended_bench [--profiles a,b,...] [--duties 1.0,0.5]
        [--window-s 4] [--iter-scale 1.0] [--switch-ms 0.1] [--json] [--out FILE]

Every profile runs alone, then every unordered pair of them (each with itself too) side by side, in
worker processes of their own (this module with ``--worker``) on one device started for the run, each
worker doing the emulated job's mini-batch (``contended_gpu.minibatch``: a host phase, then its GPU
phase in kernels of at most ``emulated_job.KERNEL_MAX_S``, launched without waiting, then a
synchronize). A pair's measured slowdown is each side's mean mini-batch time beside the other over its
own alone with the same drawn idle (``pair_entry``), measured in the same run.

The default profiles are one per interference kind of ``workloads.INTERFERENCE``, the zoo's exact
match where Gavel measured the same model: resnet50 (R50_32), transformer_nmt (T64), lstm_lm (LM80),
rl_ppo_atari (A3C), cyclegan (CG): all 15 pairs of the kinds with measured numbers.

At duty 1 (the default) the formula is Gavel's measured pair ``d``. The host phase is fixed, as the
emulated job's is, so two jobs of one period can lock into the best interleaving the device allows;
``--host-jitter`` draws each host phase from ``[0, 2 x]`` its length instead (random phases, which is
what the formula's "busy periods overlap at random" assumes). ``--duties 1.0,0.5`` also runs
every profile and pair at lower duty, the way a production job with a data-loader stall runs: before
each mini-batch the worker sleeps a stall drawn from ``[0, 2 m]``, ``m = (1/b - 1)`` x its mini-batch
time (random, so two equal jobs do not lock into a phase; as ``antman bench models`` does on a GPU).
There the table also gives the formula calibrated with the device's own full-duty pair
(``workloads.slowdown_beside`` with ``d_device``), which checks the formula's overlap term on its own.

The device models time-slicing only: no two kernels share the SMs, no memory-bandwidth or cache
contention. So it cannot reproduce a pair Gavel measured above 2 (contention beyond an even slice) nor
one below what the two jobs' GPU phases force (kernels that overlap better than a time slice):
docs/workload_model.md has the table and where it disagrees.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from .contended_gpu import (DEFAULT_INFLIGHT, DEFAULT_SWITCH_S, ContendedDevice, Sleeper, minibatch, split_minibatch,
                            stop_devices)
from .workloads import BY_NAME, slowdown_beside
from ..worker_pool import run_released

DEFAULT_PROFILES = ("resnet50", "transformer_nmt", "lstm_lm", "rl_ppo_atari", "cyclegan")
NODE = "bench"
READY_TIMEOUT_S = 60.0


class BenchError(RuntimeError):
    pass


def _kernel_max_s() -> float:
    from .emulated_job import KERNEL_MAX_S

    return KERNEL_MAX_S


def parse_duties(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            d = float(part)
        except ValueError:
            d = math.nan
        if not 0.0 < d <= 1.0:
            raise BenchError(f"--duties {part.strip()!r}: each duty must be a number in (0, 1]")
        out.append(d)
    return sorted(set(out) | {1.0}, reverse=True)


def parse_profiles(text: Optional[str]) -> list[str]:
    if not text:
        return list(DEFAULT_PROFILES)
    if text.strip() == "all":
        return list(BY_NAME)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BY_NAME]
    if bad or not names:
        raise BenchError(f"--profiles {', '.join(bad) or text!r}: unknown; allowed: {', '.join(BY_NAME)} or 'all'")
    return names


def formula(victim: str, neighbour: str, duty_victim: float, duty_neighbour: float) -> float:
    """The workload model's slowdown of ``victim`` beside an uncontrolled ``neighbour``."""
    return BY_NAME[victim].slowdown([(BY_NAME[neighbour].kind, duty_neighbour)], duty=duty_victim)


# --- the worker ---------------------------------------------------------------------------------------


def worker(a: argparse.Namespace) -> dict:
    """One job: connect, say ready, run mini-batches from ``go`` for the window and the linger after
    it (so the neighbour's window is contended to its end); the mini-batches after the first that end
    inside the window are the measurement."""
    p = BY_NAME[a.worker]
    iter_s = p.iter_ms / 1000.0 * a.iter_scale
    gpu_s, host_s = split_minibatch(iter_s, p.sm_util)
    stall_mean = (1.0 / a.duty - 1.0) * iter_s
    rng = random.Random(a.seed)
    kmax = _kernel_max_s()
    sleep = Sleeper()
    with ContendedDevice(a.root, NODE, [0], a.name, switch_s=a.switch_ms / 1e3, inflight=a.inflight,
                         idle_s=a.device_idle_s) as dev:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise BenchError("the parent did not say go")
        t0 = time.monotonic()
        end_window, end_all = t0 + a.window_s, t0 + a.window_s + a.linger_s
        n = 0
        first = last = None
        stalled = 0.0
        now = t0
        while now < end_all:
            stall = rng.uniform(0.0, 2.0 * stall_mean) if stall_mean > 0 else 0.0
            host = rng.uniform(0.0, 2.0 * host_s) if a.host_jitter else host_s
            sleep(stall)
            minibatch(dev, gpu_s, host, kmax, sleep=sleep)
            now = time.monotonic()
            if first is None:
                first = now  # the first mini-batch is the warm-up: two jobs started together collide in it
            elif now <= end_window:
                n += 1
                last = now
                stalled += stall + host
        pid = dev.server_pids[0]
    if n == 0:
        raise BenchError(f"{a.worker}: fewer than two mini-batches completed in the {a.window_s} s window")
    return {"profile": a.worker, "duty": a.duty, "iterations": n, "iter_ms": (last - first) / n * 1e3,
            "nominal_ms": (iter_s + stall_mean) * 1e3, "idle_ms": stalled / n * 1e3, "device_pid": pid}


# --- the parent ---------------------------------------------------------------------------------------


def _worker_cmd(name: str, duty: float, seed: int, ident: str, a: argparse.Namespace, root: str,
                linger_s: float) -> list[str]:
    return [sys.executable, "-m", "slurm_antman.lab.evaluation.contended_bench", "--worker", name,
            "--name", ident, "--root", root, "--duty", repr(duty), "--seed", str(seed),
            "--window-s", repr(a.window_s), "--linger-s", repr(linger_s), "--iter-scale", repr(a.iter_scale),
            "--switch-ms", repr(a.switch_ms), "--inflight", str(a.inflight),
            "--device-idle-s", repr(a.device_idle_s)] + (["--host-jitter"] if a.host_jitter else [])


def run_together(jobs: Sequence[tuple[str, float]], a: argparse.Namespace, root: str, run_no: int) -> list[dict]:
    """Runs one worker per (profile, duty) at once on the run's device; their results in order."""
    from .contended_gpu import _package_root

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (_package_root(), env.get("PYTHONPATH")) if x)
    longest = max(BY_NAME[n].iter_ms / 1000.0 * a.iter_scale / d for n, d in jobs)
    linger = max(0.5, 2.5 * longest)
    cmds = [_worker_cmd(n, d, a.seed * 1000 + run_no * 10 + i, f"w{run_no}-{i}", a, root, linger)
            for i, (n, d) in enumerate(jobs)]
    return run_released(cmds, [n for n, _ in jobs], env, "go", a.window_s + linger + READY_TIMEOUT_S, BenchError)


def measure(a: argparse.Namespace, log=lambda s: print(s, file=sys.stderr)) -> dict:
    names = parse_profiles(a.profiles)
    duties = parse_duties(a.duties)
    root = tempfile.mkdtemp(prefix="antman-contend-")
    doc: dict[str, Any] = {
        "what": "pairs of profiles on one contending emulated GPU (slurm_antman.lab.evaluation.contended_bench)",
        "date_unix": time.time(), "switch_ms": a.switch_ms, "inflight": a.inflight, "window_s": a.window_s,
        "iter_scale": a.iter_scale, "kernel_max_s": _kernel_max_s(), "duties": duties, "seed": a.seed,
        "host_jitter": a.host_jitter, "profiles": {}, "pairs": []}
    runs = itertools.count()
    pids: set[int] = set()
    try:
        solo: dict[tuple[str, float], dict] = {}
        for n in names:
            p = BY_NAME[n]
            doc["profiles"][n] = {"kind": p.kind, "sm_util": p.sm_util, "iter_ms": p.iter_ms, "solo": {}}
            for d in duties:
                log(f"contended bench: {n} alone at duty {d:g} ...")
                r, = run_together([(n, d)], a, root, next(runs))
                pids.add(r["device_pid"])
                solo[(n, d)] = doc["profiles"][n]["solo"][f"{d:g}"] = r
        for i, n in enumerate(names):
            for m in names[i:]:
                full: Optional[dict] = None
                for da, db in [(x, y) for x in duties for y in duties if not (n == m and x < y)]:
                    log(f"contended bench: {n} at duty {da:g} beside {m} at duty {db:g} ...")
                    ra, rb = run_together([(n, da), (m, db)], a, root, next(runs))
                    pids.update((ra["device_pid"], rb["device_pid"]))
                    q = pair_entry(n, m, da, db, ra, rb, solo[(n, da)], solo[(m, db)], full)
                    doc["pairs"].append(q)
                    full = full or q
        doc["device_pids"] = sorted(pids)
        return doc
    finally:
        stop_devices(pids, root)  # the devices this run started


def pair_entry(a: str, b: str, da: float, db: float, ra: dict, rb: dict, sa: dict, sb: dict,
               full: Optional[dict]) -> dict:
    """One pair at one combination of duties. A side's slowdown is its mini-batch time beside the
    other over its time alone **with the same idle**: the alone run's time less its mean drawn idle
    (stall, and the host phase with ``--host-jitter``) plus the pair run's. The idle is drawn at
    random, and a dozen draws differ between two runs by several percent of a mini-batch; this takes
    that noise out, and changes nothing where the idle is fixed (duty 1, no jitter)."""
    q: dict[str, Any] = {"a": a, "b": b, "duty_a": da, "duty_b": db, "run_a": ra, "run_b": rb,
                         "solo_a": sa, "solo_b": sb}
    for who, r, solo in (("a", ra, sa), ("b", rb, sb)):
        q[f"slowdown_{who}"] = r["iter_ms"] / (solo["iter_ms"] - solo["idle_ms"] + r["idle_ms"])
    cal = full if full is not None else q
    for who, victim, other, bv, bn in (("a", a, b, da, db), ("b", b, a, db, da)):
        q[f"formula_{who}"] = formula(victim, other, bv, bn)
        q[f"device_formula_{who}"] = slowdown_beside(bv, bn, cal[f"slowdown_{who}"])
    return q


def table(doc: dict) -> str:
    """Markdown: the full-duty pairs (measured against Gavel's d), then the lower duties."""
    lines = ["| row job (kind, sm_util) | beside (kind) | measured | formula (Gavel) | measured - formula |",
             "| --- | --- | ---: | ---: | ---: |"]
    rows = []
    for q in doc["pairs"]:
        if q["duty_a"] == 1.0 and q["duty_b"] == 1.0:
            rows.append((q["a"], q["b"], q["slowdown_a"], q["formula_a"]))
            if q["a"] != q["b"]:
                rows.append((q["b"], q["a"], q["slowdown_b"], q["formula_b"]))
            else:  # both sides of a self pair measure the same thing: their mean
                rows[-1] = (q["a"], q["b"], (q["slowdown_a"] + q["slowdown_b"]) / 2, q["formula_a"])
    for v, n, meas, form in rows:
        pv, pn = BY_NAME[v], BY_NAME[n]
        lines.append(f"| {v} ({pv.kind}, {pv.sm_util:g}) | {n} ({pn.kind}) | {meas:.2f} | {form:.2f} | {meas - form:+.2f} |")
    low = [q for q in doc["pairs"] if not (q["duty_a"] == 1.0 and q["duty_b"] == 1.0)]
    if low:
        lines += ["", "| pair (duties) | measured a / b | formula, device's d | formula, Gavel's d |",
                  "| --- | ---: | ---: | ---: |"]
        for q in low:
            lines.append(f"| {q['a']}@{q['duty_a']:g} + {q['b']}@{q['duty_b']:g} | "
                         f"{q['slowdown_a']:.2f} / {q['slowdown_b']:.2f} | "
                         f"{q['device_formula_a']:.2f} / {q['device_formula_b']:.2f} | "
                         f"{q['formula_a']:.2f} / {q['formula_b']:.2f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slurm_antman.lab.evaluation.contended_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", help=f"comma list or 'all' (default: {','.join(DEFAULT_PROFILES)})")
    p.add_argument("--duties", default="1.0", help="comma list in (0, 1]; 1.0 always runs (default 1.0)")
    p.add_argument("--window-s", type=float, default=4.0, help="timed window per run (default 4)")
    p.add_argument("--iter-scale", type=float, default=1.0, help="mini-batch time multiplier (default 1)")
    p.add_argument("--switch-ms", type=float, default=DEFAULT_SWITCH_S * 1e3,
                   help="the device's context-switch cost (default %(default)s ms, assumed: contended_gpu)")
    p.add_argument("--inflight", type=int, default=DEFAULT_INFLIGHT, help="kernels in flight per job")
    p.add_argument("--seed", type=int, default=0, help="seed of the host phases' draws (--host-jitter; default 0)")
    p.add_argument("--host-jitter", action="store_true",
                   help="draw each host phase from [0, 2 x its length] instead of a fixed one (random "
                        "phases; the emulated job's host phase is fixed)")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument("--out", help="write the JSON document to this file")
    # Passed by the parent to each worker process.
    p.add_argument("--worker", metavar="PROFILE", help="internal: run one job of this profile")
    p.add_argument("--name", default="w", help="internal (with --worker)")
    p.add_argument("--root", help="internal (with --worker): the device's board directory")
    p.add_argument("--duty", type=float, default=1.0, help="internal (with --worker)")
    p.add_argument("--linger-s", type=float, default=1.0, help="internal (with --worker)")
    p.add_argument("--device-idle-s", type=float, default=10.0, help="internal: the device's idle exit")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    if not (a.window_s > 0 and a.iter_scale > 0 and a.inflight >= 1 and 0 <= a.switch_ms <= 1000):
        print("contended bench: --window-s and --iter-scale must be > 0, --inflight >= 1, "
              "--switch-ms in [0, 1000]", file=sys.stderr)
        return 2
    try:
        if a.worker:
            if a.worker not in BY_NAME or not a.root or not 0 < a.duty <= 1:
                raise BenchError("--worker needs a profile, --root and a --duty in (0, 1]")
            print(json.dumps(worker(a)), flush=True)
            return 0
        doc = measure(a)
    except BenchError as e:
        print(f"contended bench: {e}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text if a.json else table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
