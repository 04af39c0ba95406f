"""``antman demo``: the whole submission path on a local cluster, narrated.

Guaranteed and opportunistic PyTorch jobs share node1's GPUs; then a guaranteed job needs the CPUs
an opportunistic job holds, Slurm preempts it by requeue, and it resumes from its checkpoint.
Everything here is real Slurm; the demo only submits, watches and explains.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from . import devcluster as dc
from .slurm.models import REQUEUED_START_TIME

# A log or CI capture is not a terminal; rich would fold the tables at 80 columns there.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


class Demo:
    def __init__(self, cluster: dc.Cluster, work: Path):
        self.c = cluster
        self.work = work
        self.train = work / "demo_train.py"
        shutil.copy(resources.files("slurm_antman") / "data" / "demo_train.py", self.train)

    def submit(self, name: str, flags: list[str], steps: int) -> int:
        script = self.work / f"{name}.sh"
        script.write_text(
            "#!/bin/bash\n"
            f"exec {sys.executable} {self.train} {self.work / (name + '.ckpt')} {steps}\n"
        )
        r = self.c.run(["sbatch", "--parsable", "-J", name, "-D", str(self.work),
                        "-o", str(self.work / f"{name}.out"), "--open-mode=append", *flags, str(script)])
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
        r = self.c.run([sys.executable, "-m", "slurm_antman.cli", "squeue"], env={**self.c.env, "COLUMNS": "154"})
        console.print(Panel(r.stdout.rstrip() or r.stderr.strip(), title=f"antman squeue: {title}", expand=False))

    def output(self, name: str) -> str:
        path = self.work / f"{name}.out"
        return path.read_text() if path.exists() else ""

    def wait(self, what: str, pred, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.3
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(delay)
            delay = min(delay * 1.4, 2.0)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")

    def state(self, jid: int) -> str:
        return self.jobs().get(jid, {}).get("state", "GONE")


def _last(text: str, prefix: str) -> str:
    lines = [l for l in text.splitlines() if l.startswith(prefix)]
    return lines[-1] if lines else ""


def main(args) -> int:
    d = Path(args.dir)
    console.rule("[bold]slurm-antman demo")
    console.print("Bringing up a local Slurm cluster: slurmctld, 2 x slurmd, 4 fake GPUs and 4 CPUs per node,"
                  " the SPANK plugin, job_submit.lua, and a sidecar per node.")
    cluster = dc.up(d, nodes=2, gpus=4, cpus=4, port_base=args.port_base)
    console.print(f"  cluster up in {d}  (eval: {' '.join(f'{k}={v}' for k, v in cluster.exports().items())})")
    work = d / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    demo = Demo(cluster, work)
    ok = False
    try:
        console.rule("1. A guaranteed job and two opportunistic jobs share node1")
        g1 = demo.submit("resnet-guaranteed", ["--antman=guaranteed", "--gres=gpu:1", "-c", "1", "-w", "node1"], 240)
        o1 = demo.submit("bert-opportunistic", ["--antman=opportunistic", "--gres=gpu:1", "-c", "1", "-w", "node1"], 400)
        o2 = demo.submit("gpt-opportunistic", ["--antman=opportunistic", "--gres=gpu:1", "-c", "1", "-w", "node1"], 400)
        names = {g1: "resnet-guaranteed", o1: "bert-opportunistic", o2: "gpt-opportunistic"}
        demo.wait("all three jobs to train", lambda: all("step 5 " in demo.output(n) for n in names.values()))
        demo.show_queue("three jobs training on node1")
        for jid, name in names.items():
            console.print(f"  {name:<20} {_last(demo.output(name), 'START')}  ->  {_last(demo.output(name), 'step')}")
        console.print("The opportunistic jobs asked for --gres=gpu:1; job_submit.lua moved them to the count-only "
                      "antman_opp GRES and the opportunistic partition, and the node's sidecar picked the physical "
                      "GPU each one sees in CUDA_VISIBLE_DEVICES.")

        console.rule("2. A guaranteed job needs CPUs an opportunistic job holds")
        g2 = demo.submit("llama-guaranteed", ["--antman=guaranteed", "--gres=gpu:1", "-c", "2", "-w", "node1"], 40)
        names[g2] = "llama-guaranteed"
        demo.wait("the guaranteed job to start", lambda: demo.state(g2) == "RUNNING")
        jobs = demo.jobs()
        victims = [j for j in (o1, o2) if jobs[j]["restarts"] >= 1]
        if not victims:
            raise RuntimeError("Slurm started the guaranteed job without preempting an opportunistic one")
        victim = victims[0]
        demo.wait("the victim's checkpoint on SIGTERM", lambda: "PREEMPTED" in demo.output(names[victim]), 30)
        demo.show_queue("Slurm preempted an opportunistic job by requeue")
        console.print(f"  {names[victim]}: {_last(demo.output(names[victim]), 'PREEMPTED')}")
        console.print("Slurm keeps a requeued job out for ~2 minutes (BeginTime). The coordinator clears that wait "
                      "for the jobs it requeues itself (GPU memory or compute); this one Slurm preempted on its own "
                      f"for CPUs, so the demo clears it: scontrol update StartTime={REQUEUED_START_TIME}.")
        cluster.run(["scontrol", "update", f"JobId={victim}", f"StartTime={REQUEUED_START_TIME}"])

        console.rule("3. The requeued job resumes from its checkpoint when room returns")
        demo.wait("the requeued job to resume", lambda: "restarts=1" in demo.output(names[victim]), 180)
        console.print(f"  {names[victim]}: {_last(demo.output(names[victim]), 'START')}")
        demo.wait("the requeued job to train again", lambda: demo.output(names[victim]).count("step ") >
                  demo.output(names[victim]).split("restarts=1")[0].count("step ") + 1, 60)
        demo.show_queue("after the resume")

        console.rule("Summary")
        jobs = demo.jobs()
        t = Table("job", "name", "class", "GPUs", "restarts", "state", "progress")
        for jid, name in names.items():
            j = jobs.get(jid, {})
            gpus = j.get("gpus")
            t.add_row(str(jid), name, j.get("class", "?"), ",".join(map(str, gpus)) if gpus else "-",
                      str(j.get("restarts", "?")), j.get("state", "?"),
                      _last(demo.output(name), "DONE") or _last(demo.output(name), "step"))
        console.print(t)
        resumed = _last(demo.output(names[victim]), "START step=")
        console.print(f"Guaranteed jobs ran without interruption; {names[victim]} was preempted by requeue and "
                      f"came back with SLURM_RESTART_COUNT=1 ({resumed}).")
        ok = True
    finally:
        if args.keep:
            console.print(f"Cluster left running (--keep). Stop it with: antman devcluster down --dir {d}")
        else:
            cluster.run(["scancel", "--user", "root"])
            stopped = dc.down(d)
            console.print(f"Cluster torn down: stopped {len(stopped)} processes.")
    console.rule("[green]demo finished" if ok else "[red]demo failed")
    return 0 if ok else 1
