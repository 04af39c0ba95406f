"""Two tasks of one elastic array across nodes never share a GPU, on the devcluster (docs/elastic.md,
"Tasks never share a GPU"): two nodes of one GPU with two opportunistic slots each, the real Prolog,
sidecars and coordinator. Slurm counts only slots, so it may start both tasks of
``--array=0-1 --gres=gpu:1 --antman-elastic=1:2`` on one node; that node's sidecar places the first and
refuses the second (no GPU free of its sibling), its Prolog requeues it, and the coordinator keeps it
off that node and lifts the requeue's BeginTime wait, so it starts on the other node at once. Asserted:
both tasks end up RUNNING on different nodes, and at no moment of either sidecar's log did one GPU
hold both. The tasks only sleep: no training is needed to see where they are placed."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime

import pytest

from slurm_antman.lab.devcluster.jobs import JobsError, wait_for
from conftest import TEST_PORT_BASE, ClusterHandle, managed_cluster

pytestmark = [pytest.mark.cluster]

PORT_BASE = TEST_PORT_BASE + 2300
NODES = ("node1", "node2")


@pytest.fixture(scope="module")
def apart_cluster(tmp_path_factory):
    # The default two opportunistic slots per GPU: what let Slurm start both tasks on one node's one GPU.
    with managed_cluster(tmp_path_factory.mktemp("apart-cluster"), tmp_path_factory.mktemp("apart-jobs"),
                         nodes=2, gpus=1, cpus=4, port_base=PORT_BASE, accounting=False, coordinator=True) as c:
        yield c


def _tasks(c: ClusterHandle, array: int) -> dict[str, dict[str, str]]:
    """The array's records by task index ("0", "1"; a pending rest by its range)."""
    r = c.run(["scontrol", "show", "job", "-o", str(array)])
    out = {}
    for line in r.stdout.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        out[fields.get("ArrayTaskId", "?")] = fields
    return out


_REGISTERED = re.compile(r"job (\d+) \(opportunistic, uid \d+\) registered on GPU\(s\) \[([\d, ]*)\]")
_RETIRED = re.compile(r"job (\d+) retired")
_NO_ROOM = re.compile(r"job (\d+): no room for \d+ GPU\(s\); the Prolog requeues it: (.*)")


def _at(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _gpu_history(log: str, node: str) -> tuple[list[set[str]], dict[str, tuple[float, str]], dict[str, float]]:
    """Every GPU's jobs after each registration in a sidecar's log (a job's registration replaces its
    earlier one), the jobs it refused for want of room (when, why), and when each job was registered."""
    held: dict[str, set[int]] = {}
    seen: list[set[str]] = []
    refused: dict[str, tuple[float, str]] = {}
    registered: dict[str, float] = {}
    for line in log.splitlines():
        if m := _REGISTERED.search(line):
            held[m.group(1)] = {int(g) for g in m.group(2).replace(" ", "").split(",") if g}
            registered[m.group(1)] = _at(line)
        elif m := _RETIRED.search(line):
            held.pop(m.group(1), None)
        elif m := _NO_ROOM.search(line):
            refused[m.group(1)] = (_at(line), m.group(2))
        for gpu in {g for gs in held.values() for g in gs}:
            seen.append({f"{node}:{gpu}:{j}" for j, gs in held.items() if gpu in gs})
    return seen, refused, registered


def test_two_tasks_of_an_elastic_array_end_up_on_two_nodes(apart_cluster: ClusterHandle):
    c = apart_cluster
    logs = {n: c.c.dir / "log" / f"sidecar-{n}.log" for n in NODES}
    audit = c.c.dir / "log" / "coordinator-audit.jsonl"
    t0 = time.monotonic()
    array = c.sbatch("--antman=opportunistic", "--antman-elastic=1:2", "--array=0-1", "--gres=gpu:1",
                     wrap="sleep 120")

    def diagnose() -> str:
        tasks = _tasks(c, array)
        side = "\n".join(f"--- {n}:\n{p.read_text(errors='replace')[-2000:]}" for n, p in logs.items() if p.exists())
        states = {t: (f.get("JobState"), f.get("NodeList"), f.get("Restarts"), f.get("Reason"), f.get("ExcNodeList"))
                  for t, f in tasks.items()}
        return f"tasks: {states}\n{side}"

    def both_running_placed():
        # RUNNING with Reason=Prolog is a task whose Prolog may still refuse it: wait for both placed.
        tasks = _tasks(c, array)
        if not {"0", "1"} <= set(tasks) or any(tasks[t].get("JobState") != "RUNNING"
                                                or tasks[t].get("Reason") != "None" for t in ("0", "1")):
            return None
        placed = "".join(p.read_text(errors="replace") for p in logs.values() if p.exists())
        ids = {m.group(1) for m in _REGISTERED.finditer(placed)}
        return tasks if all(tasks[t]["JobId"] in ids for t in ("0", "1")) else None

    try:
        tasks = wait_for(both_running_placed, 90, "both tasks RUNNING and placed", step=0.25)
    except JobsError as e:
        raise AssertionError(f"{e}\n{diagnose()}") from None
    apart_s = time.monotonic() - t0
    nodes = {t: tasks[t]["NodeList"] for t in ("0", "1")}
    ids = {tasks[t]["JobId"] for t in ("0", "1")}
    assert nodes["0"] != nodes["1"], diagnose()

    # No GPU ever held both tasks, on either node; and where Slurm started both on one node, the
    # task refused there was refused for its sibling, requeued, and kept off that node.
    refused_by: dict[str, tuple[str, float, str]] = {}
    placed_at: dict[str, float] = {}
    for n, path in logs.items():
        seen, refused, registered = _gpu_history(path.read_text(errors="replace"), n)
        assert not [s for s in seen if len({x.rsplit(":", 1)[1] for x in s} & ids) > 1], (n, seen, diagnose())
        refused_by.update({j: (n, at, why) for j, (at, why) in refused.items() if j in ids})
        placed_at.update({j: at for j, at in registered.items() if j in ids})
    requeued = {t: f for t, f in tasks.items() if t in ("0", "1") and f.get("Restarts") != "0"}
    assert len(refused_by) == len(requeued) <= 1, (refused_by, requeued, diagnose())
    waited = ""
    if refused_by:
        (job_id, (first_node, refused_at, why)), = refused_by.items()
        assert "another task of the job's elastic array runs there" in why, why
        again = next(f for f in requeued.values())
        assert again["JobId"] == job_id and again["NodeList"] != first_node, diagnose()
        kept = [json.loads(line) for line in audit.read_text().splitlines() if '"keep_off"' in line]
        kept = [d for d in kept if d.get("kind") == "keep_off" and d.get("job_id") == job_id
                and first_node in d.get("params", {}).get("nodes", [])]
        assert kept and f"elastic array {array}" in kept[0].get("reason", ""), (kept, diagnose())
        # Kept off and made eligible: well within the ~121 s BeginTime wait Slurm gives a requeued job.
        wait_s = placed_at[job_id] - refused_at
        assert 0 < wait_s < 60, (wait_s, diagnose())
        waited = f"; task {job_id} refused on {first_node}, placed on {again['NodeList']} {wait_s:.1f} s later"
    print(f"\nelastic array {array}: tasks on {nodes} {apart_s:.1f} s after submission{waited}")
    c.run(["scancel", str(array)], check=True)
