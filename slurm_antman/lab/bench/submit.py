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

from slurm_antman.lab.devcluster import cluster as dc


_EMPTY_LUA = """function slurm_job_submit(job_desc, part_list, submit_uid) return slurm.SUCCESS end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
return slurm.SUCCESS
"""


def _submit_one(cluster: dc.Cluster, args: list[str]) -> float:
    """Seconds for one held sbatch, as a user's script would run it."""
    t0 = time.perf_counter()
    r = cluster.run(["sbatch", "--hold", "--parsable", "-o", "/dev/null", *args, "--wrap", "true"])
    took = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"sbatch {' '.join(args)} failed: {r.stderr.strip()}")
    return took


def _clear(cluster: dc.Cluster) -> None:
    cluster.run(["scancel", "--user", "root"])


def run(jobs_per_round: int, rounds: int, base_dir: Path, port_base: int) -> dict:
    plain_dir, antman_dir, lua_dir = base_dir / "plain", base_dir / "antman", base_dir / "plain-lua"
    plain = dc.up(plain_dir, nodes=2, gpus=4, port_base=port_base, plain=True)
    # Plain Slurm with Slurm's job_submit/lua running a script that does nothing: what any Lua
    # policy costs a site before slurm-antman's own logic, so the report can tell the two apart.
    lua = dc.up(lua_dir, nodes=2, gpus=4, port_base=port_base + 100, plain=True,
                extra_slurm_conf="JobSubmitPlugins=lua\n", extra_etc_files={"job_submit.lua": _EMPTY_LUA})
    try:
        antman = dc.up(antman_dir, nodes=2, gpus=4, port_base=port_base + 50)
        try:
            variants = {
                "plain": (plain, ["--gres=gpu:1"]),
                "plain_empty_lua": (lua, ["--gres=gpu:1"]),
                "antman_opportunistic": (antman, ["--antman=opportunistic", "--gres=gpu:1"]),
                "antman_guaranteed": (antman, ["--antman=guaranteed", "--gres=gpu:1"]),
                "antman_noflag": (antman, ["--gres=gpu:1"]),
            }
            for cluster, args in variants.values():  # warm caches (munge, page cache) before timing
                for _ in range(3):
                    _submit_one(cluster, args)
                _clear(cluster)
            # Submissions interleave one by one, the order rotating, so a slow spell of this shared
            # machine hits every variant alike; medians then drop the spells' outliers.
            lat: dict[str, list[float]] = {k: [] for k in variants}
            names = list(variants)
            for i in range(jobs_per_round * rounds):
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    cluster, args = variants[name]
                    lat[name].append(_submit_one(cluster, args))
                if (i + 1) % jobs_per_round == 0:  # keep the queues short, as between a user's batches
                    for cluster, _ in variants.values():
                        _clear(cluster)
        finally:
            dc.down(antman_dir)
    finally:
        dc.down(lua_dir)
        dc.down(plain_dir)
    med = {k: statistics.median(v) for k, v in lat.items()}
    result = {
        "jobs": jobs_per_round * rounds,
        "median_latency_ms": {k: round(v * 1000, 2) for k, v in med.items()},
        "jobs_per_s": {k: round(1 / v, 2) for k, v in med.items()},
        # throughput ratio: > 1 would mean faster than plain Slurm
        "ratio": {k: round(med["plain"] / med[k], 3) for k in med if k != "plain"},
    }
    antman = {k: v for k, v in result["ratio"].items() if k.startswith("antman")}
    result["slowdown_pct_worst"] = round(100 * (1 - min(antman.values())), 1)
    # The part slurm-antman adds on top of Slurm's own Lua plugin.
    result["ratio_vs_empty_lua"] = {k: round(med["plain_empty_lua"] / med[k], 3) for k in antman}
    result["target_met"] = result["slowdown_pct_worst"] <= 5.0
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="antman bench submit", description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50, help="jobs per variant between queue clean-ups")
    ap.add_argument("--rounds", type=int, default=6,
                    help="rounds of --jobs submissions per variant; the medians are over all of them")
    ap.add_argument("--port-base", type=int, default=18617,
                    help="slurmctld port of the plain cluster; the slurm-antman one uses +50, the empty-Lua one +100")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    if a.jobs < 1 or a.rounds < 1:
        ap.error("--jobs and --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="antman-bench-submit-") as tmp:
        res = run(a.jobs, a.rounds, Path(tmp), a.port_base)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"sbatch throughput from the median latency of {res['jobs']} interleaved held submissions per variant:")
        for k, v in res["jobs_per_s"].items():
            ratio = res["ratio"].get(k)
            print(f"  {k:<22} {v:8.2f} jobs/s" + (f"   {ratio:.3f} x plain" if ratio else ""))
        for k, v in res["ratio_vs_empty_lua"].items():
            print(f"  {k:<22} {v:.3f} x plain Slurm running an empty job_submit.lua")
        print(f"worst slowdown {res['slowdown_pct_worst']:.1f}% (target <= 5%): "
              f"{'met' if res['target_met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
