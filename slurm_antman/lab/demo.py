"""``antman demo``: the AntMan loop on a local Slurm cluster, narrated.

One emulated GPU, two jobs on it: a guaranteed job and an opportunistic one. The guaranteed job's
memory grows and the opportunistic job's limit shrinks and its compute share drops, live; a burst
needs more than shrinking frees, so the opportunistic job is paused in place and resumed when the
burst passes; a burst that lasts past ``sidecar.pause_max_s`` ends the pause with the coordinator's
notice, grace and requeue, and the job resumes from its checkpoint. ``antman explain`` tells the story.
CPU only: GPU memory and utilisation are emulated by the jobs' agents; Slurm (with slurmdbd), the
SPANK plugin, job_submit.lua, the sidecar, the coordinator and the agents inside the jobs are real.
"""

from __future__ import annotations

import concurrent.futures
import json
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from slurm_antman.policy.node.core import NodePolicyParams

from . import jobs
from .devcluster import cluster as dc
from .jobs.demo_device import ENV_ROOT

# A log or CI capture is not a terminal; rich would fold the tables at 80 columns there.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _data(name: str) -> Path:
    return jobs.script(name)


class Demo:
    def __init__(self, cluster: dc.Cluster, work: Path, as_user: Optional[tuple[int, int]] = None):
        self.c = cluster
        self.as_user = as_user  # (uid, gid) that submits the jobs; None: root, as the demo always has
        self.work = work
        self._sockdir: str | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def submit(self, name: str, flags: list[str], script: str, env: Optional[dict[str, str]] = None) -> int:
        """``script``: a Python file and its arguments, run by this interpreter as the job's step, with
        ``env`` exported first."""
        path = self.work / f"{name}.sh"
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
        path.write_text(f"#!/bin/bash\n{exports}exec {sys.executable} {script}\n")
        r = self.c.run(["sbatch", "--parsable", "-J", name, "-D", str(self.work),
                        "-o", str(self.work / f"{name}.out"), "--open-mode=append", *flags, str(path)],
                       as_user=self.as_user)
        if r.returncode:
            raise RuntimeError(f"sbatch for {name} failed: {r.stderr.strip()}")
        jid = int(r.stdout.strip().split(";")[0])
        console.print(f"  submitted [bold]{name}[/] as job {jid}: sbatch {' '.join(flags)}")
        return jid

    def jobs(self) -> dict[int, dict]:
        r = self.c.run([sys.executable, "-m", "slurm_antman.cli", "squeue", "--json", "--all"])
        if r.returncode:
            raise RuntimeError(f"antman squeue failed: {r.stderr.strip()}")
        return {j["job_id"]: j for j in json.loads(r.stdout)}

    def show_queue(self, title: str) -> None:
        self.print_queue(self.take_queue(), title)

    def queue_text(self) -> str:
        return self.take_queue().result().stdout.rstrip()

    def print_text(self, text: str, title: str) -> None:
        console.print(Panel(text or "(antman squeue printed nothing)", title=f"antman squeue: {title}", expand=False))

    def take_queue(self) -> concurrent.futures.Future:
        """``antman squeue`` now, in the background: the demo goes on meanwhile (on a slow node, a guest, the
        command takes seconds that a burst's timing must not wait for)."""
        return self._pool.submit(self.c.run, [sys.executable, "-m", "slurm_antman.cli", "squeue"],
                                 env={**self.c.env, "COLUMNS": "154"})

    def print_queue(self, taken: concurrent.futures.Future, title: str) -> None:
        r = taken.result()
        console.print(Panel(r.stdout.rstrip() or r.stderr.strip(), title=f"antman squeue: {title}", expand=False))

    def output(self, name: str) -> str:
        path = self.work / f"{name}.out"
        return path.read_text() if path.exists() else ""

    def wait(self, what: str, pred, timeout: float = 120):
        """``pred``'s first true value, polled with back-off; RuntimeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        delay = 0.3
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            time.sleep(delay)
            delay = min(delay * 1.4, 2.0)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")

    def state(self, jid: int) -> str:
        return self.jobs().get(jid, {}).get("state", "GONE")

    def _node_state(self):
        """The node's sidecar's own view (None while it does not answer): a local socket, answered in
        milliseconds, where ``antman squeue`` takes a process start and a trip through the coordinator."""
        from slurm_antman.clients import sidecar_control as client

        if self._sockdir is None:  # read once: watch_cut samples every 50 ms
            from slurm_antman import config as cfgmod

            self._sockdir = cfgmod.load(self.c.config_path).node_socket_dir(self.c.nodes[0])
        try:
            return client.node_state(self._sockdir)
        except (client.SidecarUnreachable, client.SidecarError):
            return None

    def gpu_measured(self) -> bool:
        """The sidecar lets an opportunistic job beside a guaranteed one only once it has measured how
        busy the guaranteed job keeps the GPU."""
        st = self._node_state()
        return st is not None and all(g.util_measured for g in st.gpus)

    def sidecar_job(self, jid: int):
        st = self._node_state()
        return next((j for j in st.jobs if j.job_id == str(jid)), None) if st is not None else None

    def step_times(self, g: int, o: int, seconds: float) -> tuple[float, float, float]:
        """The guaranteed job's solo time per step (the sidecar's baseline), its mean over ``seconds``
        of reports beside the opportunistic job, and the opportunistic job's mean share meanwhile."""
        beside, shares, base = [], [], None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            st = self._node_state()
            jobs = {j.job_id: j for j in st.jobs} if st is not None else {}
            gj, oj = jobs.get(str(g)), jobs.get(str(o))
            if gj is not None and oj is not None and gj.iteration_ms and gj.baseline_ms:
                base = gj.baseline_ms
                beside.append(gj.iteration_ms)
                shares.append(oj.compute_share)
            time.sleep(0.25)
        if not beside:
            raise RuntimeError(f"the sidecar reported no step time of job {g} beside job {o} in {seconds:.0f} s")
        return base, statistics.fmean(beside), statistics.fmean(shares)

    def watch_cut(self, jid: int, before, timeout: float):
        """The opportunistic job's memory limit and compute share after a rise in guaranteed demand:
        ``(limit, lowest share)``. The share is halved in the same policy step that lowers the limit,
        then climbs back by one step per guaranteed report (20 a second here), so it is low for well
        under a second: sampled every 50 ms from the sidecar, not polled through ``antman squeue``."""
        deadline = time.monotonic() + timeout
        limit, low = None, None
        while time.monotonic() < deadline:
            j = self.sidecar_job(jid)
            if j is not None and j.mem_limit_bytes is not None and j.mem_limit_bytes < before.mem_limit_bytes:
                limit = j.mem_limit_bytes
                low = j.compute_share if low is None else min(low, j.compute_share)
                # At its floor already (the guaranteed job ran over its target on a loaded machine), the
                # share cannot drop further: the limit is what shows the rise.
                if low < before.compute_share or before.compute_share <= NodePolicyParams().min_share:
                    return limit, low
            time.sleep(0.05)
        if limit is None:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for the opportunistic job's limit to drop")
        raise RuntimeError(f"the opportunistic job's limit dropped but its share stayed at or above "
                           f"{before.compute_share:.2f} (lowest seen {low:.2f})")


def _last(text: str, prefix: str) -> str:
    lines = [l for l in text.splitlines() if l.startswith(prefix)]
    return lines[-1] if lines else ""


def _steps(text: str) -> int:
    return sum(1 for l in text.splitlines() if l.startswith("step "))


def _limit(j: dict) -> str:
    v = j.get("mem_limit_bytes")
    return "unlimited" if v is None else f"{v / 2**30:.1f} GiB"


# The demo's cluster: one node, one emulated 4 GiB GPU; a pause lasts at most 12 s before the requeue,
# and the coordinator's grace time is 5 s, so the whole loop fits in about two minutes.
PAUSE_MAX_S = 12
GRACE_S = 5
OVERRIDES = {
    "grace_time_s": GRACE_S, "nodes": {"gpu_memory_mb": 4096},
    "sidecar": {"pause_max_s": PAUSE_MAX_S, "resume_hold_s": 2.0},
    "tenants": [{"account": "research", "guaranteed_gpus": 1}],
}


@dataclass
class LoopJobs:
    """The two jobs of the loop. ``guaranteed_script`` takes the phase file as its last argument; the
    opportunistic job prints ``START step= restarts=``, ``step N`` and ``PREEMPTED`` lines (demo_train.py)."""
    guaranteed_script: str
    opportunistic_script: str
    env: dict[str, str]
    grow: str        # what the guaranteed job's heavier phase is, in words
    burst: str       # and its burst
    where: str = "GPU 0"  # the GPU they share, in words
    guaranteed: str = "resnet-guaranteed"
    opportunistic: str = "bert-opportunistic"
    patience: float = 1.0  # the waits' scale: a real model starts and checkpoints slower than the demo's
    as_user: Optional[tuple[int, int]] = None  # who submits: None, root (the demo); (uid, gid), an ordinary user


def emulated_jobs(work: Path) -> LoopJobs:
    """The demo's jobs on the contending emulated GPU: servers run as the jobs' user, in the jobs'
    directory, one job's kernels at a time, so the guaranteed job's steps really wait behind its
    neighbour's."""
    device = work / "device"
    device.mkdir()
    shutil.chown(device, work.stat().st_uid, work.stat().st_gid)
    device.chmod(work.stat().st_mode & 0o7777)
    return LoopJobs(guaranteed_script=str(_data("demo_guaranteed.py")),
                    opportunistic_script=f"{_data('demo_train.py')} {work / 'bert.ckpt'} 100000 0.05",
                    env={ENV_ROOT: str(device)},
                    grow="0.5 GiB -> 1.5 GiB of GPU memory",
                    burst="the guaranteed job bursts to 3.3 GiB: what is left is under the opportunistic job's "
                          "1 GiB minimum",
                    where="one contending emulated GPU, which runs one job's kernels at a time")


def run_loop(cluster: dc.Cluster, work: Path, jobs: LoopJobs, rec: dict) -> None:
    """The AntMan loop on the cluster's one GPU, narrated; what it measured goes into ``rec`` as it comes
    (a step that fails leaves the ones before it). RuntimeError when something waited for did not happen."""
    demo = Demo(cluster, work, jobs.as_user)
    phase = work / "guaranteed.phase"
    phase.write_text("base")
    wait = jobs.patience
    g_name, o_name = jobs.guaranteed, jobs.opportunistic
    console.rule("1. A guaranteed and an opportunistic job share GPU 0")
    g = demo.submit(g_name, ["--antman=guaranteed", "--gres=gpu:1", "-A", "research"],
                    script=f"{jobs.guaranteed_script} {phase}", env=jobs.env)
    rec["guaranteed_job"] = g
    demo.wait("the guaranteed job to train", lambda: "step " in demo.output(g_name), 120 * wait)
    demo.wait("the sidecar to measure the guaranteed job's GPU use", demo.gpu_measured, 90 * wait)
    o = demo.submit(o_name, ["--antman=opportunistic", "--gres=gpu:1", "-A", "research"],
                    script=jobs.opportunistic_script, env=jobs.env)
    rec["opportunistic_job"] = o
    # As long as the guaranteed job was given: it starts as cold (PyTorch's import), and then trains under
    # the throttle, held at the probe share while the guaranteed job measures its solo pace (node policy
    # core, "probe"). 90 s ran out once in the single-CPU cgroup v2 guest beside another cluster's tests
    # (2026-11-29), which passed alone.
    demo.wait("the opportunistic job to train", lambda: _steps(demo.output(o_name)) >= 2, 120 * wait)
    demo.wait("its limits", lambda: demo.jobs()[o].get("compute_share") is not None, 30 * wait)
    rec["squeue_sharing"] = demo.queue_text()
    demo.print_text(rec["squeue_sharing"], "two jobs on GPU 0")
    shown = demo.jobs()[o]
    console.print("The opportunistic job asked for --gres=gpu:1; job_submit.lua moved it to the count-only "
                  "antman_opp GRES and the opportunistic partition, and the sidecar put it beside the guaranteed "
                  f"job on GPU 0: memory limit {_limit(shown)}, compute share {shown['compute_share']:.2f} "
                  "(the guaranteed job is never limited; the share follows the guaranteed job's speed, report "
                  "by report).")
    steps_before = _steps(demo.output(o_name))
    t0 = time.monotonic()
    base, beside, share = demo.step_times(g, o, 10 * wait)
    rec.update(alone_ms=base, beside_ms=beside, beside_s=10 * wait, mean_share=share,
               opportunistic_step_lines_per_s=(_steps(demo.output(o_name)) - steps_before) / (time.monotonic() - t0))
    console.print(f"  Both run on {jobs.where}: {g_name} took {base:.1f} ms a step alone, {beside:.1f} ms beside {o_name} "
                  f"over {10 * wait:.0f} s ({beside / base - 1:+.1%}), while the sidecar held {o_name} at a mean "
                  f"compute share of {share:.2f}. The node loop's target is +2 %, as a mean over its episodes.")

    console.rule("2. The guaranteed job's memory grows: the opportunistic job shrinks, live")
    before = demo.sidecar_job(o)
    if before is None or before.mem_limit_bytes is None:
        raise RuntimeError("the sidecar shows no memory limit for the opportunistic job")
    phase.write_text("grow")
    console.print(f"  the guaranteed job enters a heavier phase: {jobs.grow}")
    limit, low = demo.watch_cut(o, before, 30 * wait)
    rec.update(limit_before_bytes=before.mem_limit_bytes, limit_after_bytes=limit,
               share_before=before.compute_share, share_lowest=low)
    demo.show_queue("the opportunistic job shrunk and throttled")
    console.print(f"  {o_name}: memory limit {before.mem_limit_bytes / 2**30:.1f} GiB -> "
                  f"{limit / 2**30:.1f} GiB, compute share "
                  f"{before.compute_share:.2f} -> {low:.2f} at the jump (a rise in guaranteed "
                  "demand halves the budget at once; it climbs back while the guaranteed job keeps its speed). "
                  "It keeps training: its agent spills what does not fit to host memory and spaces out its "
                  "kernel launches.")

    console.rule("3. A burst needs more than shrinking frees: pause in place")
    phase.write_text("burst")
    console.print(f"  {jobs.burst}")
    t0 = time.monotonic()
    demo.wait("the opportunistic job to pause", lambda: demo.state(o) == "PAUSED", 30 * wait)
    rec["burst_to_paused_s"] = time.monotonic() - t0
    paused_view = demo.take_queue()
    at = _steps(demo.output(o_name))
    time.sleep(3)
    if _steps(demo.output(o_name)) > at:
        raise RuntimeError("the paused job kept training")
    phase.write_text("grow")
    rec["squeue_paused"] = paused_view.result().stdout.rstrip()
    demo.print_text(rec["squeue_paused"], "paused in place: its GPU state on the host, its GPU memory freed")
    console.print("  the burst passes after a few seconds ...")
    t0 = time.monotonic()
    demo.wait("the opportunistic job to resume", lambda: demo.state(o) == "RUNNING"
              and _steps(demo.output(o_name)) > at, 30 * wait)
    rec["burst_end_to_training_s"] = time.monotonic() - t0
    rec["restarts_after_pause"] = demo.jobs()[o]["restarts"]
    console.print(f"  ... and {o_name} resumed in place: same process, no restart (restarts="
                  f"{rec['restarts_after_pause']}), training again: {_last(demo.output(o_name), 'step')}.")

    console.rule(f"4. A burst that lasts: pause runs out after {PAUSE_MAX_S} s, requeue, resume from checkpoint")
    phase.write_text("burst")
    demo.wait("the opportunistic job to pause again", lambda: demo.state(o) == "PAUSED", 30 * wait)
    console.print(f"  paused again; the burst goes on past sidecar.pause_max_s ({PAUSE_MAX_S} s): the sidecar asks "
                  f"the coordinator, which sends a notice, waits the grace time ({GRACE_S} s) and requeues the job")
    demo.wait("the requeue", lambda: demo.jobs()[o]["restarts"] >= 1, (PAUSE_MAX_S + GRACE_S + 60) * wait)
    demo.show_queue("requeued through Slurm")
    rec["preempted_line"] = _last(demo.output(o_name), "PREEMPTED")
    console.print(f"  {o_name}: {rec['preempted_line'] or 'requeued'}")
    phase.write_text("base")
    console.print("  the burst ends; the requeued job may run again (the coordinator clears Slurm's BeginTime "
                  "wait for the jobs it requeues)")
    demo.wait("the requeued job to resume from its checkpoint",
              lambda: "restarts=1" in demo.output(o_name), 120 * wait)
    resumed = _last(demo.output(o_name), "START step=")
    demo.wait("the requeued job to train again", lambda: _steps(demo.output(o_name).split(
        "restarts=1", 1)[1]) >= 1, 60 * wait)
    rec["resumed_line"] = resumed
    console.print(f"  {o_name}: {resumed}")
    rec["squeue_after"] = demo.queue_text()
    demo.print_text(rec["squeue_after"], "after the resume")

    console.rule("5. antman explain tells the story")
    r = cluster.run([sys.executable, "-m", "slurm_antman.cli", "explain", str(o)])
    rec["explain"] = r.stdout.rstrip() or r.stderr.strip()
    console.print(Panel(rec["explain"], title=f"antman explain {o}", expand=False))

    console.rule("Summary")
    states = demo.jobs()
    t = Table("job", "name", "class", "GPUs", "restarts", "state", "progress")
    for jid, name in ((g, g_name), (o, o_name)):
        j = states.get(jid, {})
        gpus = j.get("gpus")
        t.add_row(str(jid), name, j.get("class", "?"), ",".join(map(str, gpus)) if gpus else "-",
                  str(j.get("restarts", "?")), j.get("state", "?"), _last(demo.output(name), "step"))
    console.print(t)
    rec["guaranteed_restarts"] = states[g]["restarts"]
    rec["opportunistic_starts"] = [line for line in demo.output(o_name).splitlines() if line.startswith("START")]
    if states[g]["restarts"] != 0:
        raise RuntimeError("the guaranteed job was restarted")
    console.print("The guaranteed job ran throughout, never limited and never restarted. The opportunistic job "
                  "shrank, slowed, paused in place once (no restart) and was requeued once, resuming from its "
                  "checkpoint.")


def main(args) -> int:
    d = Path(args.dir)
    console.rule("[bold]slurm-antman demo: the AntMan loop on one GPU")
    console.print("Bringing up a local Slurm cluster: slurmctld, slurmdbd on MariaDB, one slurmd with one GPU, the "
                  "SPANK plugin, job_submit.lua, the node's sidecar and the coordinator.")
    console.print("[bold]CPU only: the GPU is emulated[/] (4 GiB; each job's agent reports the memory and "
                  "utilisation a GPU job would have). Slurm, the daemons and the agents inside the jobs are real.")
    cluster = dc.up(d, nodes=1, gpus=1, cpus=4, port_base=args.port_base, overrides=OVERRIDES)
    console.print(f"  cluster up in {d}  (eval: {' '.join(f'{k}={v}' for k, v in cluster.exports().items())})")
    work = fresh_work_dir(d)
    ok = False
    try:
        run_loop(cluster, work, emulated_jobs(work), {})
        ok = True
    except RuntimeError as e:  # what the demo waited for did not happen: say what, keep the logs
        console.print(f"[red]demo failed: {e}[/]; the cluster's logs are in {d}/log, the jobs' output in {work}")
    finally:
        stop(cluster, d, args.keep)
    console.rule("[green]demo finished" if ok else "[red]demo failed")
    return 0 if ok else 1


def fresh_work_dir(d: Path) -> Path:
    work = d / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def stop(cluster: dc.Cluster, d: Path, keep: bool) -> None:
    if keep:
        console.print(f"Cluster left running (--keep). Stop it with: antman devcluster down --dir {d}")
    else:
        cluster.run(["scancel", "--user", "root"])
        stopped = dc.down(d)
        console.print(f"Cluster torn down: stopped {len(stopped)} processes.")
