"""``antman bench submit``: sbatch throughput with the slurm-antman stack against plain Slurm.

Two devclusters run side by side, identical but for the stack (SPANK plugin, job_submit.lua,
hooks). Rounds alternate between them, and the order within a round alternates too, so machine
noise (this is a shared 2-core box) lands on both sides alike. Jobs are submitted held: the
benchmark measures the submission path, not scheduling or the Prolog.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import devcluster as dc


def _submit_batch(cluster: dc.Cluster, args: list[str], n: int) -> float:
    """Seconds to submit ``n`` held jobs one after another, as a user's script would."""
    t0 = time.perf_counter()
    for _ in range(n):
        r = cluster.run(["sbatch", "--hold", "--parsable", "-o", "/dev/null", *args, "--wrap", "true"])
        if r.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {r.stderr.strip()}")
    return time.perf_counter() - t0


def _clear(cluster: dc.Cluster) -> None:
    cluster.run(["scancel", "--user", "root"])


def run(jobs_per_round: int, rounds: int, base_dir: Path, port_base: int) -> dict:
    plain_dir, antman_dir = base_dir / "plain", base_dir / "antman"
    plain = dc.up(plain_dir, nodes=2, gpus=4, port_base=port_base, plain=True)
    try:
        antman = dc.up(antman_dir, nodes=2, gpus=4, port_base=port_base + 50)
        try:
            variants = {
                "plain": (plain, ["--gres=gpu:1"]),
                "antman_opportunistic": (antman, ["--antman=opportunistic", "--gres=gpu:1"]),
                "antman_guaranteed": (antman, ["--antman=guaranteed", "--gres=gpu:1"]),
                "antman_noflag": (antman, ["--gres=gpu:1"]),
            }
            for cluster, args in variants.values():  # warm caches (munge, page cache) before timing
                _submit_batch(cluster, args, 3)
                _clear(cluster)
            rates: dict[str, list[float]] = {k: [] for k in variants}
            names = list(variants)
            for i in range(rounds):
                order = names if i % 2 == 0 else names[::-1]
                for name in order:
                    cluster, args = variants[name]
                    rates[name].append(jobs_per_round / _submit_batch(cluster, args, jobs_per_round))
                for cluster, _ in variants.values():
                    _clear(cluster)
        finally:
            dc.down(antman_dir)
    finally:
        dc.down(plain_dir)
    med = {k: statistics.median(v) for k, v in rates.items()}
    # Paired per round: both sides of a ratio ran seconds apart, so slow spells of the machine cancel.
    ratio = {k: statistics.median(a / b for a, b in zip(rates[k], rates["plain"])) for k in rates if k != "plain"}
    result = {
        "jobs_per_round": jobs_per_round, "rounds": rounds,
        "jobs_per_s": {k: round(v, 2) for k, v in med.items()},
        "ratio": {k: round(v, 3) for k, v in ratio.items()},
    }
    result["slowdown_pct_worst"] = round(100 * (1 - min(result["ratio"].values())), 1)
    result["target_met"] = result["slowdown_pct_worst"] <= 5.0
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="antman bench submit", description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=30, help="jobs per round and variant")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--port-base", type=int, default=18617)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.jobs < 1 or a.rounds < 1:
        ap.error("--jobs and --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="antman-bench-submit-") as tmp:
        res = run(a.jobs, a.rounds, Path(tmp), a.port_base)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"sbatch throughput, median of {a.rounds} rounds x {a.jobs} held jobs (ratio: median of per-round ratios):")
        for k, v in res["jobs_per_s"].items():
            ratio = res["ratio"].get(k)
            print(f"  {k:<22} {v:8.2f} jobs/s" + (f"   {ratio:.3f} x plain" if ratio else ""))
        print(f"worst slowdown {res['slowdown_pct_worst']:.1f}% (target <= 5%): "
              f"{'met' if res['target_met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
