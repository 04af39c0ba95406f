"""Elastic width across nodes on the devcluster (docs/elastic.md, "Across nodes: a job
array"), end to end: three nodes that are hosts of their own (network namespaces), the real sidecars
and coordinator, job_submit.lua, and one torchrun training (CPU, gloo) run as a two-task job array
under ``torch_patch.elastic_launch``, its c10d rendezvous crossing the nodes' interfaces.

- A guaranteed job claims the GPU of task 1: the coordinator requeues that task alone, task 0's
  training goes on at world size 1 from the checkpoint, and the task may start again only after the
  hold (StartTime set to the requeue + ``elastic_hold_s``); then the job grows back to 2.
- A guaranteed job claims the GPU of task 0, which hosts the rendezvous: every task of the array is
  requeued, both start again at once, and the training resumes from its checkpoint.

Nothing is lost in either: every step is trained on exactly its samples, none skipped. The training
gaps are printed (docs/benchmarks.md records them); only generous bounds are asserted."""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime

import pytest

from slurm_antman.lab.bench.elastic import (
    CKPT_EVERY, GLOBAL_BATCH, GPU_MEMORY_MB, GUARANTEED, TRAIN, events, lost_steps, steps,
)
from conftest import TEST_PORT_BASE, ClusterHandle, managed_cluster
from slurm_antman.lab.devcluster.jobs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PORT_BASE = TEST_PORT_BASE + 2100
HOLD_S = 12.0          # sidecar.elastic_hold_s here (300 s by default): the shed task's wait
GRACE_S = 10.0         # grace_time_s of the devcluster (slurm_antman.lab.devcluster.files)


@pytest.fixture(scope="module")
def array_cluster(tmp_path_factory):
    # Three nodes of one 4 GiB GPU: demo_guaranteed's burst (3,400 MiB) leaves no room for an
    # opportunistic job beside it, so its claim is a preemption; the third node is where a shed task
    # may come back while the guaranteed job still holds its old one. Two opportunistic slots per GPU
    # (the default): Slurm may start both tasks on one node; the sidecar keeps them apart.
    with managed_cluster(tmp_path_factory.mktemp("array-cluster"), tmp_path_factory.mktemp("array-jobs"),
                         nodes=3, gpus=1, cpus=4, port_base=PORT_BASE, hosts=True, accounting=False,
                         overrides={"nodes": {"gpu_memory_mb": GPU_MEMORY_MB},
                                    "sidecar": {"elastic_hold_s": HOLD_S}}) as c:
        yield c


def _wait(pred, timeout: float, what: str, why):
    return wait_for(pred, timeout, what, step=0.5, why=why)


def _tasks(c: ClusterHandle, array: int) -> dict[str, dict[str, str]]:
    """The array's records by task index ("0", "1"; a pending rest by its range)."""
    r = c.run(["scontrol", "show", "job", "-o", str(array)])
    out = {}
    for line in r.stdout.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        out[fields.get("ArrayTaskId", "?")] = fields
    return out


def _widths(evs: list[dict]) -> list[int]:
    """World sizes of the training's starts, a repeat of the same size folded (a shrink may take two
    restarts: the survivors' workers fail once before they meet without the lost node)."""
    out: list[int] = []
    for e in evs:
        if e.get("event") == "start" and (not out or out[-1] != e["world_size"]):
            out.append(e["world_size"])
    return out


def _gaps(evs: list[dict]) -> list[tuple[int, float]]:
    """(world size, seconds from the last step before a start to the first step after it) at every
    start after the first: each width change's or requeue's training gap."""
    out = []
    for i, e in enumerate(evs):
        if e.get("event") != "start":
            continue
        before = [x["time"] for x in evs[:i] if x.get("event") == "step"]
        after = [x["time"] for x in evs[i:] if x.get("event") == "step"]
        if before and after:
            out.append((e["world_size"], round(after[0] - before[-1], 2)))
    return out


def _redone(evs: list[dict]) -> list[tuple[int, int, float]]:
    """(world size, steps trained again, seconds they had taken) at every start after the first: the
    last step logged before the start less the step it resumed from."""
    out = []
    for i, e in enumerate(evs):
        before = [x for x in evs[:i] if x.get("event") == "step"]
        if e.get("event") == "start" and before:
            again = [x for x in before if x["step"] > e["step"]]
            span = again[-1]["time"] - again[0]["time"] if len(again) > 1 else 0.0
            out.append((e["world_size"], before[-1]["step"] - e["step"], round(span, 2)))
    return out


def test_an_elastic_array_sheds_a_task_trains_on_grows_back_and_survives_its_hosts_loss(
        array_cluster: ClusterHandle, tmp_path):
    c = array_cluster
    log, ckpt, phase = tmp_path / "train.jsonl", tmp_path / "train.ckpt", tmp_path / "phase"
    phase.write_text("burst")
    phase.chmod(0o644)
    # The nodes share one UTS name (hosts.py), which resolves to loopback: gloo must be told the
    # interface that carries the node's address, as at a site whose hostnames do not resolve to it.
    script = (f"#!/bin/bash\nexport GLOO_SOCKET_IFNAME=eth0\nexec {sys.executable} -m torch_patch.elastic_launch --rdzv-dir {tmp_path} {TRAIN} "
              f"--ckpt {ckpt} --log-file {log} --steps 1000000 --step-s 0.1 --global-batch {GLOBAL_BATCH} "
              f"--ckpt-every {CKPT_EVERY}\n")
    array = c.sbatch("--antman=opportunistic", "--antman-elastic=1:2", "--array=0-1", "--gres=gpu:1",
                     script=script)
    coordinator_log = c.c.dir / "log" / "coordinator.log"
    audit = c.c.dir / "log" / "coordinator-audit.jsonl"

    def diagnose() -> str:
        tasks = _tasks(c, array)
        outs = "\n".join(f"--- task {t} ({f.get('JobId')}):\n{c.output(int(f['JobId']))[-2500:]}"
                         for t, f in tasks.items() if f.get("JobId", "").isdigit())
        coord = coordinator_log.read_text(errors="replace")[-3000:] if coordinator_log.exists() else ""
        return (f"tasks: { {t: (f.get('JobState'), f.get('NodeList'), f.get('Reason')) for t, f in tasks.items()} }\n"
                f"log: {events(log)[-6:]}\ncoordinator:\n{coord}\n{outs}")

    _wait(lambda: len(steps(events(log), 2)) >= 10, 180, "10 steps at world size 2", diagnose)
    tasks = _tasks(c, array)
    node0, node1 = tasks["0"]["NodeList"], tasks["1"]["NodeList"]
    assert node0 != node1, diagnose()

    def task(i: str) -> dict[str, str]:
        # By index: the first task's raw id is the array's own, under which scontrol lists every task.
        return _tasks(c, array).get(i, {})

    def restarts(i: str) -> int:
        return int(task(i).get("Restarts", "0"))

    # A task the sidecar kept apart from its sibling at the start was requeued once already.
    before = {i: restarts(i) for i in ("0", "1")}

    # 1. A guaranteed job claims task 1's GPU: the array sheds that task, the training goes on.
    g1 = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", node1,
                  script=f"#!/bin/bash\nexec {sys.executable} {GUARANTEED} {phase}\n")
    held = _wait(lambda: (lambda t: t if t.get("JobState") == "PENDING" and int(t.get("Restarts", 0)) > before["1"]
                          else None)(task("1")), 120, "task 1 requeued", diagnose)
    assert restarts("0") == before["0"], diagnose()  # the host trains on
    shed_at = time.time()
    _wait(lambda: len(steps(events(log), 1, shed_at - 5)) >= 5, 120, "5 steps at world size 1", diagnose)
    assert task("0")["JobState"] == "RUNNING", diagnose()
    # The hold: the shed task may not start again at once (Slurm's own wait would be ~121 s; the
    # coordinator set StartTime to the requeue + HOLD_S).
    def start_time() -> float:
        t = task("1")
        try:
            return datetime.strptime(t.get("StartTime", ""), "%Y-%m-%dT%H:%M:%S").timestamp()
        except ValueError:
            return float("inf")

    # The coordinator's StartTime replaces Slurm's (the requeue + ~121 s) within a cycle or two.
    start_unix = _wait(lambda: (lambda s: s if s < shed_at + 60 else None)(start_time()), 20,
                       "the hold's StartTime on task 1", diagnose)
    assert shed_at - 15 < start_unix - HOLD_S < shed_at + 5, (held, start_unix, shed_at, diagnose())
    _wait(lambda: task("1").get("JobState") == "RUNNING", HOLD_S + 90, "task 1 started again", diagnose)
    regrown_at = time.time()
    assert regrown_at - shed_at >= HOLD_S - 3, diagnose()  # it waited its hold
    _wait(lambda: len(steps(events(log), 2, regrown_at)) >= 5, 120, "5 steps at world size 2 again", diagnose)

    # 2. A guaranteed job claims task 0's GPU: it hosts the rendezvous, so the whole array goes.
    c.run(["scancel", str(g1)], check=True)
    node0 = task("0")["NodeList"]
    g0 = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", node0,
                  script=f"#!/bin/bash\nexec {sys.executable} {GUARANTEED} {phase}\n")
    _wait(lambda: restarts("0") == before["0"] + 1, 120, "task 0 requeued", diagnose)
    host_lost_at = time.time()
    _wait(lambda: restarts("1") == before["1"] + 2, 60, "task 1 requeued with its host", diagnose)
    # The training starts again, from its checkpoint, once the tasks run again.
    _wait(lambda: [e for e in events(log) if e.get("event") == "start" and e["time"] > host_lost_at - 5], 240,
          "the training's start after the host's loss", diagnose)
    restarted = max(e["time"] for e in events(log) if e.get("event") == "start")
    _wait(lambda: len(steps(events(log), None, restarted)) >= 10, 120, "10 steps after the host's loss",
          diagnose)
    c.run(["scancel", str(array), str(g0)], check=True)

    evs = events(log)
    starts = [e["time"] for e in evs if e.get("event") == "start"]
    # The training may first start at world size 1 (task 0 alone, MIN is 1) while Slurm still places task
    # 1; from width 2 it went to 1 at the shed and back to 2 at the grow.
    widths = _widths(evs)
    assert widths[widths.index(2):][:3] == [2, 1, 2], widths
    # Nothing lost: every step from 1 to the last trained, on its own samples; a restart repeats at
    # most the steps since the periodic checkpoint (no hook checkpoints a node's loss).
    assert lost_steps(evs, requeued_at=starts) == [], lost_steps(evs, requeued_at=starts)
    assert steps(evs)[-1]["last"] == steps(evs)[-1]["step"] * GLOBAL_BATCH - 1
    decided = audit.read_text(errors="replace")
    assert re.search(r"hosts elastic array %d's rendezvous" % array, decided), decided[-3000:]
    assert re.search(r"a task of elastic array %d: the other tasks train on" % array, decided), decided[-3000:]
    # The shed and the host's loss asked every task to checkpoint at the requeue (policy/cluster/
    # array_checkpoint.py), and rank 0's agent, on whichever task it was, did so in the last part of the
    # grace time, not at the notice: each restart resumed from that checkpoint (or a periodic one after
    # it), not from one before the notice.
    assert re.search(r'"kind":"checkpoint_notice".*"cause":"leave:.*"outcome":"ok"', decided), decided[-3000:]
    # When each notice went out, from the audit (the test sees a requeue only at its next poll, seconds
    # after Slurm did it, so its own clock cannot tell the grace time's halves apart).
    notices = sorted(r["ts"] for r in map(json.loads, decided.splitlines())
                     if r.get("kind") == "checkpoint_notice" and r.get("outcome") == "ok"
                     and str(r.get("params", {}).get("cause", "")).startswith("leave:"))
    for gone_at, width in ((shed_at, 1), (host_lost_at, None)):
        restart = next(e for e in evs if e.get("event") == "start" and e["time"] > gone_at - 5
                       and width in (None, e["world_size"]))
        asked = [e for e in evs if e.get("event") == "checkpoint" and e["why"] == "checkpoint"
                 and gone_at - GRACE_S - 5 < e["time"] < restart["time"]]
        assert asked, (gone_at, [e for e in evs if e.get("event") == "checkpoint"])
        noticed = [ts for ts in notices if ts < gone_at]
        assert noticed, (gone_at, notices)
        assert asked[-1]["time"] > noticed[-1] + GRACE_S / 2, (asked, noticed[-1], gone_at)
        assert restart["step"] >= asked[-1]["step"], (restart, asked)
    print(f"\nelastic array across nodes: (world size, training gap s) at each start: {_gaps(evs)}")
    print(f"trained again after a restart (steps, s): {_redone(evs)}")


def test_an_elastic_array_runs_its_launchers_as_srun_steps(array_cluster: ClusterHandle, tmp_path):
    """The launcher as a site's scripts often start it, in an `srun` step of each task: the step finds
    the task's environment (the Prolog's env file, through the SPANK plugin), and the tasks' launchers
    still meet in one rendezvous across the nodes and train at world size 2."""
    c = array_cluster
    log, ckpt = tmp_path / "train.jsonl", tmp_path / "train.ckpt"
    script = (f"#!/bin/bash\nexport GLOO_SOCKET_IFNAME=eth0\nexec srun -n1 {sys.executable} -m torch_patch.elastic_launch "
              f"--rdzv-dir {tmp_path} {TRAIN} --ckpt {ckpt} --log-file {log} --steps 1000000 --step-s 0.1 "
              f"--global-batch {GLOBAL_BATCH} --ckpt-every {CKPT_EVERY}\n")
    array = c.sbatch("--antman=opportunistic", "--antman-elastic=1:2", "--array=0-1", "--gres=gpu:1",
                     script=script)

    def diagnose() -> str:
        tasks = _tasks(c, array)
        outs = "\n".join(f"--- task {t} ({f.get('JobId')}):\n{c.output(int(f['JobId']))[-2500:]}"
                         for t, f in tasks.items() if f.get("JobId", "").isdigit())
        return f"tasks: { {t: (f.get('JobState'), f.get('NodeList')) for t, f in tasks.items()} }\n{outs}"

    try:
        _wait(lambda: len(steps(events(log), 2)) >= 10, 180, "10 steps at world size 2 under srun", diagnose)
        tasks = _tasks(c, array)
        assert tasks["0"]["NodeList"] != tasks["1"]["NodeList"], diagnose()
        evs = events(log)
        assert lost_steps(evs, requeued_at=[e["time"] for e in evs if e.get("event") == "start"]) == []
    finally:
        c.run(["scancel", str(array)])
