"""A multi-node opportunistic job holds opportunistic GRES on every node it runs on: the coordinator's
snapshot must charge each node its share. Charged all to its first node, that node would look fuller than
it is and every other node emptier, and the room the core finds (which nodes pending opportunistic jobs are
kept off) would be wrong on both."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from slurm_antman import config
from slurm_antman.coordinator.snapshot_builder import job_view
from slurm_antman.lab.snapshots import NOW, PARAMS, gpu, job, node
from slurm_antman.policy.cluster import placement
from slurm_antman.slurm.models import Job

CFG = config.parse({"nodes": [{"name": "n[1-2]", "gpus": 4}]})
START = datetime.fromtimestamp(NOW - 100, timezone.utc)


def _slurm_job(nodes: list[str], per_node: int) -> Job:
    return Job(5, "wide", "alice", "research", "opportunistic", "RUNNING", "None", ",".join(nodes), nodes, 0,
               "antman:class=opportunistic", "", "opportunistic", {}, f"gres:antman_opp:{per_node}", START, START)


def test_a_job_on_two_nodes_holds_its_per_node_slots_on_each():
    v = job_view(_slurm_job(["n1", "n2"], 2), CFG, {})
    assert v.gpus == 4 and v.node == "n1"
    assert v.allocation() == (("n1", 2), ("n2", 2))
    assert placement.opp_in_use_by_node([v]) == {"n1": 2, "n2": 2}


def test_a_job_on_one_node_keeps_the_plain_reading():
    v = job_view(_slurm_job(["n1"], 3), CFG, {})
    assert v.gpus_by_node == () and v.allocation() == (("n1", 3),)
    assert placement.opp_in_use_by_node([v]) == {"n1": 3}
    assert job("9", state="PENDING").allocation() == ()


def test_each_node_s_room_includes_what_slurm_gave_the_job_there():
    """One slot per GPU. n2: the wide job's 2 slots on GPUs 0 and 1, GPU 2 free (one slot of room), GPU 3
    busy: its room is 3 (its 2 allocated plus 1), so it is not without room; n1: exactly the job's 2
    slots, not the 4 of the whole job, and no free one: without room. Slurm's counts are left alone."""
    params = replace(PARAMS, slots_per_gpu=1)
    wide = job_view(_slurm_job(["n1", "n2"], 2), CFG, {})
    n1 = node("n1", (gpu(0, o=("5",)), gpu(1, o=("5",))), in_slurm=8)
    n2 = node("n2", (gpu(0, o=("5",)), gpu(1, o=("5",)), gpu(2), gpu(3, util=0.95)), in_slurm=8)
    assert placement.node_slots(n1, params, 2, ())[0] == 2 and placement.node_slots(n2, params, 2, ())[0] == 3
    changes, no_room = placement.step([n1, n2], [wide], params, {})
    assert changes == [] and no_room == ["n1"]


def test_a_job_on_two_nodes_is_upgraded_only_when_no_gpu_on_either_shares_a_guaranteed_job():
    """The upgrade rule (a running opportunistic job becomes guaranteed when its tenant has quota again and
    no guaranteed job shares its GPUs) must look at every node the job holds, not only its first."""
    from slurm_antman.policy.cluster import Upgrade, quota

    params = replace(PARAMS, upgrade_running=True)
    wide = replace(job_view(_slurm_job(["n1", "n2"], 1), CFG, {}), requested="guaranteed")
    n1 = node("n1", (gpu(0, o=("5",)), gpu(1)))
    shared = node("n2", (gpu(0, g=("7",), o=("5",)), gpu(1)))
    free = node("n2", (gpu(0, o=("5",)), gpu(1)))
    assert quota.step(NOW, [wide], {"research": 8}, params, (), {"n1": n1, "n2": shared}) == []
    assert quota.step(NOW, [wide], {"research": 8}, params, (), {"n1": n1}) == []  # n2 silent: cannot tell
    got = quota.step(NOW, [wide], {"research": 8}, params, (), {"n1": n1, "n2": free})
    assert [type(d) for d in got] == [Upgrade] and got[0].inputs["gpu_nodes"] == ["n1", "n2"]
