"""``make gpu-site-proof``: the whole product on one GPU under Slurm, measured, as a user runs it.

A one-node Slurm site (slurmctld, slurmd, the SPANK plugin, job_submit.lua and cli_filter.lua, the node's
sidecar and the coordinator, as the devcluster starts them) on the machine's one GPU: gres.conf names
``/dev/nvidia0``, the sidecar measures it with NVML, and the AntMan loop of ``antman demo`` runs through
sbatch, as an unprivileged user, with real models of the zoo (``lab/jobs/site_guaranteed.py`` and
``site_train.py``) and the agent loaded from the site's agent bundle. Without a GPU the same sequence runs
on the devcluster's emulated one with the demo's jobs (CI runs it so, tests/test_site_proof.py).

Left out, and said so in the report: accounting (no slurmdbd or MariaDB on the GPU machine; the tenants'
quotas come from antman.yaml), and device confinement where the machine's cgroups do not allow it (it is
tried first; the report says which held).

Writes ``OUT/site.json`` (everything, rewritten as the run goes) and ``OUT/site.md`` (for a reader).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from slurm_antman.lab import demo as loop
from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.lab.devcluster.processes import DevclusterError, unified_cgroup_host

from slurm_antman.lab.devcluster import carried_slurm
from .report import write_report

# Real models of the zoo, each at a batch that keeps its step well past launch overhead on an H100/H200
# (the GPU proof's interference part found ResNet-50 at 32 launch-bound on an H200, its solo time drifting
# 10 %; docs/gpu_proof.md). The opportunistic job is the zoo's LSTM language model: a different kernel mix.
GUARANTEED_MODEL, GUARANTEED_BATCH = "resnet50", 128
OPPORTUNISTIC_MODEL, OPPORTUNISTIC_BATCH = "lstm_lm", 64
DEFAULT_DIR = Path("/tmp/antman-site")
# The node's CPUs as slurm.conf gives them: two jobs of one CPU each and room for a step, whatever the
# machine has (the devcluster's slurmd takes slurm.conf's word: SlurmdParameters=config_overrides). A
# single-CPU machine (the cgroup v2 guest) would otherwise hold the opportunistic job pending for good.
CPUS = 4


def _commit() -> str:
    r = subprocess.run(["git", "-C", str(dc.REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else os.environ.get("ANTMAN_COMMIT", "unknown")


def gpu_facts() -> Optional[dict]:
    """The machine's GPU 0 by NVML, or None where there is none (or no NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: an emulated run
        return None
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        return {"name": name.decode() if isinstance(name, bytes) else name,
                "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                "driver": str(pynvml.nvmlSystemGetDriverVersion())}
    finally:
        pynvml.nvmlShutdown()


def machine_facts() -> dict:
    return {"kernel": platform.release(), "python": platform.python_version(),
            "cgroup": "v2 (unified)" if unified_cgroup_host() else "v1 or hybrid",
            "systemd": Path("/run/systemd/system").is_dir(), "cpus": os.cpu_count()}


class NvmlSampler(threading.Thread):
    """NVML's per-process GPU memory, summed per Slurm job (a process's job from its SLURM_JOB_ID, read
    as root from /proc), every half second, beside the sidecar's limit for that job at the same moment."""

    def __init__(self, limits) -> None:
        super().__init__(daemon=True)
        self.samples: list[dict] = []
        self._limits = limits  # () -> {job_id: limit bytes or None}
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()
        self.join(5)

    def run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            t0 = time.monotonic()
            while not self._stop.wait(0.5):
                per_job: dict[str, int] = {}
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    job = _job_of(proc.pid)
                    if job and proc.usedGpuMemory is not None:
                        per_job[job] = per_job.get(job, 0) + int(proc.usedGpuMemory)
                self.samples.append({"t": round(time.monotonic() - t0, 2), "used": per_job, "limit": self._limits()})
        finally:
            pynvml.nvmlShutdown()


def _job_of(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"SLURM_JOB_ID="):
                    return kv.split(b"=", 1)[1].decode()
    except OSError:
        return None
    return None


def cuda_jobs(work: Path) -> loop.LoopJobs:
    """The loop's jobs on a real GPU: the scripts copied into the jobs' directory (the checkout may lie
    where the jobs' user cannot read), run by this interpreter (the machine's torch with CUDA)."""
    for name in ("site_guaranteed.py", "site_train.py"):
        shutil.copy2(loop.jobs.script(name), work / name)
    return loop.LoopJobs(
        guaranteed_script=f"{work / 'site_guaranteed.py'} {GUARANTEED_MODEL} {GUARANTEED_BATCH}",
        opportunistic_script=f"{work / 'site_train.py'} {work / 'lstm.ckpt'} {OPPORTUNISTIC_MODEL} {OPPORTUNISTIC_BATCH}",
        env={}, guaranteed=f"{GUARANTEED_MODEL}-guaranteed", opportunistic=f"{OPPORTUNISTIC_MODEL}-opportunistic",
        grow="it holds a quarter of the GPU's memory more",
        burst="the guaranteed job bursts to all but 1 GiB of the GPU: less than the opportunistic job's 1 GiB "
              "minimum is left",
        patience=2.0)


def _order(what: str) -> list[bool]:
    return {"try": [True, False], "on": [True], "off": [False]}[what]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_antman.lab.siteproof.proof", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-site-proof"), help="where site.json and site.md go")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the cluster's directory")
    ap.add_argument("--bundle", type=Path, help="a carried Slurm (carried_slurm build): run it instead of the installed one")
    ap.add_argument("--device", choices=("auto", "cuda", "emulated"), default="auto",
                    help="auto: the real GPU where NVML finds one, else the emulated one")
    ap.add_argument("--confine", choices=("try", "on", "off"), default="try",
                    help="device confinement (task/cgroup, ConstrainDevices=yes): try it, then without")
    ap.add_argument("--port-base", type=int, default=17917, help="the first of the cluster's loopback ports")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    gpu = gpu_facts() if a.device != "emulated" else None
    if a.device == "cuda" and gpu is None:
        print("site proof: --device cuda, but NVML finds no GPU here", file=sys.stderr)
        return 2
    device = "cuda" if gpu else "emulated"
    rec: dict = {"started_unix": time.time(), "commit": _commit(), "device": device, "gpu": gpu,
                 "machine": machine_facts(), "left_out": ["accounting (slurmdbd, MariaDB): quotas from antman.yaml"],
                 "attempts": [], "loop": {}, "checks": {}}

    def save() -> None:
        write_report(a.out, rec)

    save()
    prefix = None
    if a.bundle:
        prefix = carried_slurm.unpack(a.bundle, a.dir.parent / f"{a.dir.name}-slurm")
        rec["slurm_carried"] = json.loads((prefix.path / "carried.json").read_text())
    overrides = dict(loop.OVERRIDES)
    if gpu:
        overrides = {**overrides, "nodes": {"gpu_memory_mb": gpu["memory_bytes"] >> 20, "gpu_files": "/dev/nvidia0"},
                     "sidecar": {**overrides["sidecar"], "telemetry": "nvml"}}
    cluster = None
    for confine in _order(a.confine):
        try:
            cluster = dc.up(a.dir, nodes=1, gpus=1, cpus=CPUS, port_base=a.port_base,
                            overrides=overrides, accounting=False, cgroups=confine, slurm_prefix=prefix.path if prefix else None)
            rec["attempts"].append({"confine_devices": confine, "ok": True})
            rec["confine_devices"] = confine
            break
        except DevclusterError as e:
            rec["attempts"].append({"confine_devices": confine, "ok": False, "error": str(e)[-2000:],
                                    "slurmd_log": _tail(a.dir / "log" / "slurmd-node1.log")})
            save()
    if cluster is None:
        rec["result"] = "no cluster"
        save()
        print(f"site proof: the cluster did not start; see {a.out}/site.md", file=sys.stderr)
        return 1
    if not rec["confine_devices"]:
        rec["left_out"].append("device confinement: slurmd did not start with task/cgroup here (attempts)")
    rec["slurm_version"] = cluster.run(["sinfo", "--version"]).stdout.strip()
    save()
    work = loop.fresh_work_dir(a.dir)
    os.chown(work, *dc.ensure_user())
    sampler = None
    if gpu:
        demo_view = loop.Demo(cluster, work)

        def limits() -> dict:
            st = demo_view._node_state()
            return {j.job_id: j.mem_limit_bytes for j in st.jobs} if st is not None else {}

        sampler = NvmlSampler(limits)
        sampler.start()
    ok = False
    try:
        jobs = cuda_jobs(work) if gpu else loop.emulated_jobs(work)
        jobs.as_user = dc.ensure_user()  # submitted by an ordinary user, as at a site
        loop.run_loop(cluster, work, jobs, rec["loop"])
        ok = True
    except RuntimeError as e:
        rec["error"] = str(e)
        loop.console.print(f"[red]site proof: {e}[/]; the cluster's logs are in {a.dir}/log, the jobs' output in {work}")
    finally:
        if sampler is not None:
            sampler.stop()
            rec["nvml_samples"] = sampler.samples
        rec["outputs"] = {p.name: _tail(p, 400) for p in sorted(work.glob("*.out"))}
        loop.stop(cluster, a.dir, keep=False)
    rec["checks"] = checks(rec)
    rec["result"] = "passed" if ok and all(c["ok"] is not False for c in rec["checks"].values()) else "failed"
    rec["ended_unix"] = time.time()
    save()
    loop.console.rule(f"site proof {rec['result']}: {a.out}/site.md")
    return 0 if rec["result"] == "passed" else 1


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# The node loop's own target (NodePolicyParams.target_slowdown); the run's noise is added on top.
TARGET_SLOWDOWN = 0.02


def checks(rec: dict) -> dict:
    """Each target of the proof, with what was measured and whether it held."""
    lp = rec.get("loop", {})
    out: dict = {}
    if lp.get("alone_ms") and lp.get("beside_ms"):
        slow = lp["beside_ms"] / lp["alone_ms"] - 1
        noise = _alone_noise(rec)
        held = slow <= TARGET_SLOWDOWN + noise
        # On the emulated GPU of a loaded 2-core CI machine ten seconds of steps are a figure, not a target
        # (antman demo prints it and asserts nothing): recorded, and held only on a real GPU.
        out["guaranteed_beside"] = {"slowdown": slow, "noise": noise, "ok": held if rec.get("device") == "cuda" else None,
                                    "target": f"<= {TARGET_SLOWDOWN:.0%} + the guaranteed job's own step noise alone"
                                    + ("" if rec.get("device") == "cuda" else f" (on a GPU; here {'within' if held else 'over'})")}
    if "opportunistic_step_lines_per_s" in lp:
        out["opportunistic_progress"] = {"step_lines_per_s": lp["opportunistic_step_lines_per_s"],
                                         "ok": lp["opportunistic_step_lines_per_s"] > 0}
    if "limit_after_bytes" in lp:
        out["shrink"] = {"limit_before": lp["limit_before_bytes"], "limit_after": lp["limit_after_bytes"],
                         "ok": lp["limit_after_bytes"] < lp["limit_before_bytes"]}
    if rec.get("nvml_samples"):
        out["nvml_under_limit"] = _nvml_under_limit(rec["nvml_samples"], str(lp.get("opportunistic_job")))
    if "burst_end_to_training_s" in lp:
        out["pause_resume"] = {"burst_to_paused_s": lp["burst_to_paused_s"],
                               "burst_end_to_training_s": lp["burst_end_to_training_s"],
                               "restarts": lp["restarts_after_pause"], "ok": lp["restarts_after_pause"] == 0}
    if "resumed_line" in lp:
        starts = lp.get("opportunistic_starts", [])
        resumed_at = _int_after(lp["resumed_line"], "step=")
        out["requeue_resume"] = {"resumed": lp["resumed_line"], "ok": resumed_at is not None and resumed_at > 0}
        # No job lost or run twice: the guaranteed job never restarted; the opportunistic job started
        # exactly twice, once per run, each from where the last left off.
        out["no_job_lost_or_twice"] = {"guaranteed_restarts": lp.get("guaranteed_restarts"), "opportunistic_starts": starts,
                                       "ok": lp.get("guaranteed_restarts") == 0 and len(starts) == 2
                                       and "restarts=0" in starts[0] and "restarts=1" in starts[1]}
    if "explain" in lp:
        out["explain"] = {"ok": "requeue" in lp["explain"].lower() and "pause" in lp["explain"].lower()}
    return out


def _alone_noise(rec: dict) -> float:
    """The guaranteed job's own step time spread alone: the coefficient of variation of the 20-step means it
    printed before its neighbour came (``step_ms=``), 0 where it printed none (the emulated demo job)."""
    import statistics

    text = rec.get("outputs", {}).get(f"{GUARANTEED_MODEL}-guaranteed.out", "")
    ms = [float(line.rsplit("step_ms=", 1)[1]) for line in text.splitlines() if "step_ms=" in line and "phase=base" in line]
    ms = ms[1:]  # the first covers one step: warm-up
    return statistics.pstdev(ms) / statistics.fmean(ms) if len(ms) >= 3 else 0.0


def _nvml_under_limit(samples: list[dict], job: str, slack: int = 1 << 30) -> dict:
    """NVML's memory of the opportunistic job against its limit, over the samples where a limit stood for the
    two seconds before (a limit just lowered takes a step to apply). ``slack``: what a process holds beyond
    torch's allocator (its CUDA context, cuDNN's workspace), about 0.5-1 GiB on an H100/H200."""
    over, seen, worst = 0, 0, None
    for i, s in enumerate(samples):
        lim = s["limit"].get(job)
        used = s["used"].get(job)
        if lim is None or used is None or i < 4 or any(p["limit"].get(job) != lim for p in samples[i - 4:i]):
            continue
        seen += 1
        excess = used - lim
        worst = excess if worst is None else max(worst, excess)
        over += excess > slack
    return {"samples": seen, "over": over, "worst_excess_bytes": worst, "slack_bytes": slack, "ok": seen > 0 and over == 0}


def _int_after(text: str, key: str) -> Optional[int]:
    try:
        return int(text.split(key, 1)[1].split()[0])
    except (IndexError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
