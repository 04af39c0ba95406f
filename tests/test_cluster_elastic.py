"""Elastic width on the devcluster (docs/elastic.md), end to end: a real Slurm, the
real sidecar, the SPANK plugin and job_submit.lua, and a torchrun (CPU, gloo) job under
``torch_patch.elastic_launch``. A guaranteed job claims one of the elastic job's two GPUs: the job
sheds it and goes on at width 1, from the checkpoint its agent saved at the change, without a requeue;
when the guaranteed job has gone it grows back to 2 after the hold. Nothing is lost: every step is
trained, none skipped, and the sample stream continues exactly.

Measured, not asserted beyond the target's bound (docs/benchmarks.md records the numbers): how long
the shed GPU took to be given back (target: within the grace time + 5 s) and the training gap, from
the last step at the old width to the first at the new, against a requeue's 6.04 s."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from slurm_antman.lab.bench.elastic import (
    GLOBAL_BATCH, GPU_MEMORY_MB, GUARANTEED, SidecarLog, elastic_job_script, events, lost_steps, steps,
)
from conftest import TEST_PORT_BASE, ClusterHandle, managed_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PORT_BASE = TEST_PORT_BASE + 1700
GRACE_S = 10           # the devcluster's grace_time_s
HOLD_S = 5.0           # sidecar.elastic_hold_s here (300 s by default)


@pytest.fixture(scope="module")
def elastic_cluster(tmp_path_factory):
    # One node of two 4 GiB GPUs: demo_guaranteed's "burst" (3,400 MiB) leaves under the 1 GiB an
    # opportunistic job needs. No coordinator: a width change is the node's own business.
    with managed_cluster(tmp_path_factory.mktemp("elastic-cluster"), tmp_path_factory.mktemp("elastic-jobs"),
                         nodes=1, gpus=2, cpus=4, port_base=PORT_BASE, accounting=False, coordinator=False,
                         overrides={"nodes": {"gpu_memory_mb": GPU_MEMORY_MB},
                                    "sidecar": {"elastic_hold_s": HOLD_S}}) as c:
        yield c


def _wait(pred, timeout: float, what: str, why=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{why()}")


def _gap(events: list[dict], start_index: int) -> float:
    """Seconds from the last step before the start at ``start_index`` to the first step after it."""
    before = [e for e in events[:start_index] if e.get("event") == "step"]
    after = [e for e in events[start_index:] if e.get("event") == "step"]
    return after[0]["time"] - before[-1]["time"]


def test_an_elastic_job_sheds_a_claimed_gpu_trains_on_and_grows_back(elastic_cluster: ClusterHandle, tmp_path):
    c = elastic_cluster
    log, ckpt, phase = tmp_path / "train.jsonl", tmp_path / "train.ckpt", tmp_path / "phase"
    phase.write_text("burst")
    side = SidecarLog(c.c.dir / "log" / "sidecar-node1.log")
    sidecar_says = side.text

    def diagnose() -> str:
        return f"sidecar:\n{sidecar_says()[-3000:]}\njob output:\n{c.output(ej)[-3000:]}\nlog: {events(log)[-5:]}"

    ej = c.sbatch("--antman=opportunistic", "--antman-elastic=1:2", "--gres=gpu:2", "-w", "node1",
                  script=elastic_job_script(ckpt, log))
    _wait(lambda: len(steps(events(log), 2)) >= 10, 120, "10 steps at width 2", diagnose)
    gj = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1", script=f"#!/bin/bash\nexec {sys.executable} "
                  f"{GUARANTEED} {phase}\n")
    shed = _wait(lambda: re.search(r"job %d: WIDTH 2 -> 1, GPU\(s\) \[.*\] -> \[(\d)\]" % ej, sidecar_says()), 90,
                 "the sidecar's shrink", diagnose)
    back = _wait(lambda: re.search(r"job %d: GPU (\d) given back ([0-9.]+) s after the width change" % ej,
                                   sidecar_says()), GRACE_S + 30, "the shed GPU given back", diagnose)
    returned_s = float(back.group(2))
    n_before = len(events(log))
    _wait(lambda: len(steps(events(log), 1)) >= 5, 90, "5 steps at width 1", diagnose)
    assert c.show(ej)["JobState"] == "RUNNING" and c.show(ej).get("Restarts") == "0", diagnose()
    assert "PREEMPT" not in sidecar_says() and "PAUSE" not in sidecar_says(), diagnose()

    c.run(["scancel", str(gj)], check=True)
    _wait(lambda: re.search(r"job %d: WIDTH 1 -> 2" % ej, sidecar_says()), 60 + HOLD_S, "the grow", diagnose)
    _wait(lambda: len(steps(events(log)[n_before:], 2)) >= 5, 90, "5 steps at width 2 again", diagnose)
    c.run(["scancel", str(ej)], check=True)

    evs = events(log)
    starts = [i for i, e in enumerate(evs) if e.get("event") == "start"]
    assert [evs[i]["world_size"] for i in starts] == [2, 1, 2], evs
    # Nothing lost: every step from 1 to the last trained, on exactly its samples (GLOBAL_BATCH each),
    # whatever the width; a restart resumes at the step the width change's checkpoint holds.
    assert lost_steps(evs) == [], lost_steps(evs)
    assert len(steps(evs)) >= 25 and steps(evs)[-1]["last"] == steps(evs)[-1]["step"] * GLOBAL_BATCH - 1
    shrink_gap, grow_gap = _gap(evs, starts[1]), _gap(evs, starts[2])
    launcher = [json.loads(m) for m in re.findall(r"antman-elastic-launch: width change (\{.*\})", c.output(ej))]
    assert back.group(1) != shed.group(1)  # the GPU given back is not the one it kept
    print(f"\nelastic width on the devcluster: shed GPU {back.group(1)} given back {returned_s:.1f} s after the "
          f"change (target <= grace {GRACE_S} s + 5 s); training gap {shrink_gap:.2f} s at the shrink, "
          f"{grow_gap:.2f} s at the grow (a requeue: 6.04 s to training again, docs/benchmarks.md); "
          f"launcher: {launcher}")
    assert returned_s <= GRACE_S + 5, diagnose()
