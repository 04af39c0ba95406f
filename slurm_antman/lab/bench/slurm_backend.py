"""``antman bench slurm-backend``: the Slurm adapter's reads through the CLI against pyslurm, on one cluster.

The reads the product repeats: the coordinator's snapshot of every job each cycle (``jobs()``) and a Prolog's
read of its own job (``job(id)``). One devcluster (plain Slurm: the reads do not depend on the stack) with
``--nodes`` slurmd and ``--jobs`` jobs of the ordinary user, half running on GPUs and half held pending, is
read by both backends in alternating rounds (the order inside a round alternates too, so the machine's
noise lands on both alike). Before any timing, both must return the same records: a backend that is
faster but answers differently is not a candidate. Needs the pyslurm built for the installed Slurm
(``slurm_antman.slurm.pyslurm_backend.available``); without it the benchmark says why and stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.slurm.cli_backend import CliBackend


def _record(x) -> dict:
    d = dataclasses.asdict(x)
    d.pop("raw", None)
    d.pop("tag_reading", None)
    return d


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def differences(cli: CliBackend, other: CliBackend, job_ids: list[int]) -> list[str]:
    """Every field where ``other`` reads a job differently from the CLI ("" list: the same records)."""
    out = []
    a = {j.job_id: _record(j) for j in cli.jobs()}
    b = {j.job_id: _record(j) for j in other.jobs()}
    if set(a) != set(b):
        out.append(f"jobs(): job ids differ: cli only {sorted(set(a) - set(b))[:5]}, other only {sorted(set(b) - set(a))[:5]}")
    for k in set(a) & set(b):
        out += [f"jobs() job {k} {f}: {a[k][f]!r} != {b[k][f]!r}" for f in a[k] if a[k][f] != b[k][f]]
    for k in job_ids:
        x, y = _record(cli.job(k)), _record(other.job(k))
        out += [f"job({k}) {f}: {x[f]!r} != {y[f]!r}" for f in x if x[f] != y[f]]
    return out


def measure(backends: dict[str, CliBackend], job_ids: list[int], rounds: int) -> dict:
    times: dict[str, dict[str, list[float]]] = {name: {"jobs": [], "job": []} for name in backends}
    names = list(backends)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            b = backends[name]
            times[name]["jobs"].append(_timed(b.jobs))
            jid = job_ids[r % len(job_ids)]
            times[name]["job"].append(_timed(lambda: b.job(jid)))
    out = {}
    for name, per in times.items():
        out[name] = {op: {"median_ms": round(statistics.median(v) * 1e3, 2),
                          "p90_ms": round(sorted(v)[int(0.9 * (len(v) - 1))] * 1e3, 2), "n": len(v)}
                     for op, v in per.items()}
    return out


def run(nodes: int, jobs: int, rounds: int, base_dir: Path, port_base: int) -> dict:
    from slurm_antman.slurm import version as slurm_version
    from slurm_antman.slurm.pyslurm_backend import PyslurmBackend, available

    cluster = dc.up(base_dir / "cluster", nodes=nodes, gpus=4, port_base=port_base, plain=True, accounting=False)
    try:
        env = cluster.env
        # pyslurm reads slurm.conf once, when it is first imported, from this process's environment.
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
        cli = CliBackend(env=env)
        version = cli.version()
        why_not = available(version)
        if why_not:
            return {"slurm": slurm_version.fmt(version), "pyslurm": why_not}
        running = min(jobs // 2, nodes * 4)
        for i in range(jobs):
            held = ["--hold"] if i >= running else []
            r = cluster.run(["runuser", "-u", dc.DEV_USER, "--", "sbatch", "--parsable", "-D", "/tmp", "-o", "/dev/null",
                             "--gres=gpu:1", f"--comment=bench job {i} Partition=fake", *held, "--wrap", "sleep 600"])
            if r.returncode:
                raise RuntimeError(f"sbatch failed: {r.stderr.strip()}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sum(j.state == "RUNNING" for j in cli.jobs()) < running:
            time.sleep(1)
        job_ids = sorted(j.job_id for j in cli.jobs())
        backends = {"cli": cli, "pyslurm": PyslurmBackend(env=env)}
        diff = differences(cli, backends["pyslurm"], job_ids[:20] + job_ids[-20:])
        result = {"slurm": slurm_version.fmt(version), "nodes": nodes, "jobs": len(job_ids),
                  "running": sum(j.state == "RUNNING" for j in cli.jobs()), "rounds": rounds,
                  "same_records": not diff, "differences": diff[:20]}
        if not diff:
            measure(backends, job_ids, 3)  # warm: page cache, munge, the library's first load
            result["timings"] = measure(backends, job_ids, rounds)
        return result
    finally:
        cluster.run(["scancel", "--user", dc.DEV_USER])
        dc.down(base_dir / "cluster")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="antman bench slurm-backend", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16, help="slurmd nodes (default 16)")
    ap.add_argument("--jobs", type=int, default=120, help="jobs of the ordinary user, half running (default 120)")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds, each backend once per round (default 40)")
    ap.add_argument("--port-base", type=int, default=19117, help="the cluster's slurmctld port (default 19117)")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here too")
    a = ap.parse_args(argv)
    if a.nodes < 1 or a.jobs < 1 or a.rounds < 1:
        ap.error("--nodes, --jobs and --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="antman-bench-backend-") as d:
        result = run(a.nodes, a.jobs, a.rounds, Path(d), a.port_base)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    if "pyslurm" in result and isinstance(result["pyslurm"], str):
        print(f"antman bench slurm-backend: {result['pyslurm']}", file=sys.stderr)
        return 2
    return 0 if result.get("same_records") else 1


if __name__ == "__main__":
    sys.exit(main())
