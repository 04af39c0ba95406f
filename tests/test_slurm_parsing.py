"""Parsers of Slurm output, on text captured from the devcluster (slurm-wlm 22.05.8, and 24.11.5 below)."""

from __future__ import annotations

import json

import pytest

from slurm_antman.slurm.errors import SlurmOutputError
from slurm_antman.slurm.parsing import (gres_counts, gres_indices, job_from_scontrol, job_from_squeue_json,
                                        jobs_from_squeue_json, node_from_sinfo_json, normalise_state,
                                        parse_admin_comment, parse_scontrol_line, filter_jobs, gres_prefix,
                                        tres_body)

# `sbatch -J 'nasty name' --comment 'a b WorkDir=/x Command=y' --gres=gpu:2 --wrap 'sleep 120'`
NASTY = (
    "JobId=1 JobName=nasty name UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
    "Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-11-20T23:41:51 EligibleTime=2026-11-20T23:41:51 AccrueTime=2026-11-20T23:41:51 "
    "StartTime=2026-11-20T23:41:52 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-11-20T23:41:52 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:15656 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=node1 BatchHost=node1 NumNodes=1 NumCPUs=1 NumTasks=1 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
    "CoreSpec=* JOB_GRES=gpu:2   Nodes=node1 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1) MinCPUsNode=1 "
    "MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 "
    "Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp Comment=a b WorkDir=/x Command=y  "
    "StdErr=/tmp/slurm-1.out StdIn=/dev/null StdOut=/tmp/slurm-1.out Power= TresPerNode=gres:gpu:2 "
)

# `sbatch -J multi -N2 --gres=gpu:1 --wrap 'sleep 120'`: one Nodes=/GRES= block per node.
MULTI = (
    "JobId=2 JobName=multi UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 "
    "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
    "Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-11-20T23:41:51 EligibleTime=2026-11-20T23:41:51 AccrueTime=2026-11-20T23:41:51 "
    "StartTime=2026-11-20T23:41:52 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-11-20T23:41:52 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:15656 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
    "CoreSpec=* JOB_GRES=gpu:2   Nodes=node1 CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:2)   Nodes=node2 CPU_IDs=0 Mem=0 "
    "GRES=gpu:1(IDX:0) MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp "
    "StdErr=/tmp/slurm-2.out StdIn=/dev/null StdOut=/tmp/slurm-2.out Power= TresPerNode=gres:gpu:1 "
)

# A held job after the Prolog tagged it (`scontrol update JobId=3 AdminComment=...`), requeued once.
TAGGED_PENDING = (
    "JobId=3 JobName=held UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=0 Nice=0 Account=(null) "
    "QOS=(null) JobState=PENDING Reason=JobHeldUser Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 "
    "Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-11-20T23:41:51 EligibleTime=Unknown AccrueTime=Unknown StartTime=Unknown EndTime=Unknown "
    "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-20T23:41:51 Scheduler=Main "
    "Partition=gpu AllocNode:Sid=localhost:15656 ReqNodeList=(null) ExcNodeList=(null) NodeList= NumNodes=1 "
    "NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=4000M,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) "
    "DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) "
    "WorkDir=/tmp AdminComment=antman:class=opportunistic;gpus=node1:0+1  StdErr=/tmp/slurm-3.out "
    "StdIn=/dev/null StdOut=/tmp/slurm-3.out Power= "
)

SQUEUE_JOB_MULTI = json.loads(
    '{"account": "", "admin_comment": "", "comment": "", "gres_detail": ["gpu:1(IDX:2)", "gpu:1(IDX:0)"], '
    '"job_id": 2, "job_resources": {"nodes": "node[1-2]", "allocated_cores": 2, "allocated_hosts": 2, '
    '"allocated_nodes": [{"sockets": {"1": {"cores": {"0": "allocated"}}}, "nodename": "node1", "cpus_used": 0, '
    '"memory_used": 0, "memory_allocated": 0}, {"sockets": {"0": {"cores": {"0": "allocated"}}}, '
    '"nodename": "node2", "cpus_used": 0, "memory_used": 0, "memory_allocated": 0}]}, "job_state": "RUNNING", '
    '"name": "multi", "nodes": "node[1-2]", "partition": "gpu", "restart_cnt": 0, "start_time": 1795218112, '
    '"state_reason": "None", "submit_time": 1795218111, "tres_per_node": "gres:gpu:1", "user_id": 0, '
    '"user_name": "root"}')
SQUEUE_JOB_OPP = json.loads(
    '{"job_id": 3, "name": "held", "user_name": "root", "user_id": 0, "account": "", "partition": "gpu", '
    '"job_state": "RUNNING", "state_reason": "None", "nodes": "node1", "restart_cnt": 0, '
    '"admin_comment": "antman:class=opportunistic;gpus=node1:0+1", "comment": "", "gres_detail": [], '
    '"job_resources": {"nodes": "node1", "allocated_cores": 1, "allocated_hosts": 1, "allocated_nodes": '
    '[{"sockets": {"0": {"cores": {"0": "allocated"}}}, "nodename": "node1", "cpus_used": 0, "memory_used": 0, '
    '"memory_allocated": 0}]}, "tres_per_node": "", "submit_time": 1795218111, "start_time": 1795218146}')
SINFO_NODE = json.loads(
    '{"name": "node1", "state": "mixed", "state_flags": [], "gres": "gpu:4,antman_opp:8", '
    '"gres_used": "gpu:3,antman_opp:0", "partitions": ["gpu", "opportunistic"], "cpus": 4, "alloc_cpus": 2, '
    '"real_memory": 4000, "reason": ""}')


def test_free_text_values_keep_spaces_and_lookalike_keys():
    fields = dict(parse_scontrol_line(NASTY))
    assert fields["JobName"] == "nasty name"
    assert fields["Comment"] == "a b WorkDir=/x Command=y"
    assert fields["WorkDir"] == "/tmp"
    assert fields["Command"] == "(null)"
    assert fields["StdErr"] == "/tmp/slurm-1.out"
    assert fields["Power"] == ""
    assert fields["TresPerNode"] == "gres:gpu:2"


@pytest.mark.parametrize("comment", [
    "x StdErr=/evil StdIn=/e StdOut=/e Power= TresPerNode=gres:gpu:9",  # forges every later key
    "UserId=evil(7) JobState=COMPLETED",                                  # keys that come earlier
    "NewKey=1 Partition=debug",
    "",
])
def test_comment_cannot_forge_fields(comment):
    line = NASTY.replace("Comment=a b WorkDir=/x Command=y ", f"Comment={comment} ")
    job = job_from_scontrol(line)
    assert job.comment == comment
    assert (job.user, job.state, job.partition, job.tres_per_node) == ("root", "RUNNING", "gpu", "gres:gpu:2")
    assert job.raw["StdErr"] == "/tmp/slurm-1.out"


def test_job_name_and_workdir_with_spaces():
    line = NASTY.replace("JobName=nasty name", "JobName=a UserId=evil(5) b").replace(
        "WorkDir=/tmp Comment", "WorkDir=/home/my dir/x y Comment")
    job = job_from_scontrol(line)
    assert job.name == "a UserId=evil(5) b"
    assert job.user == "root"
    assert job.raw["WorkDir"] == "/home/my dir/x y"


def test_unknown_keys_of_a_newer_slurm_are_kept():
    line = NASTY.replace("Power= ", "Power= Container=(null) ContainerID= ")
    pairs = dict(parse_scontrol_line(line))
    assert pairs["Container"] == "(null)" and pairs["ContainerID"] == ""
    assert pairs["TresPerNode"] == "gres:gpu:2"


def test_scontrol_job_with_gpus():
    job = job_from_scontrol(NASTY)
    assert (job.job_id, job.state, job.antman_class, job.restarts) == (1, "RUNNING", "none", 0)
    assert job.gpus_by_node == {"node1": [0, 1]} and job.gpus == [0, 1]
    assert job.account == "" and job.nodes == ["node1"]
    assert job.start_time is not None and job.start_time.year == 2026


def test_scontrol_multi_node_gres_blocks():
    job = job_from_scontrol(MULTI)
    assert job.nodes == ["node1", "node2"]
    assert job.gpus_by_node == {"node1": [2], "node2": [0]}
    assert job.gpus == [2, 0]


def test_scontrol_tagged_opportunistic_pending():
    job = job_from_scontrol(TAGGED_PENDING)
    assert job.antman_class == "opportunistic"
    assert job.admin_comment == "antman:class=opportunistic;gpus=node1:0+1"
    assert (job.state, job.reason, job.restarts, job.nodes, job.start_time) == ("PENDING", "JobHeldUser", 1, [], None)


def test_scontrol_garbage_is_a_clear_error():
    with pytest.raises(SlurmOutputError, match="not a key=value line"):
        parse_scontrol_line("slurm_load_jobs error: Invalid job id specified")
    with pytest.raises(SlurmOutputError, match="JobId"):
        job_from_scontrol("JobId=abc JobName=x")


def test_squeue_json_multi_node_and_opportunistic():
    multi = job_from_squeue_json(SQUEUE_JOB_MULTI)
    assert multi.gpus_by_node == {"node1": [2], "node2": [0]}
    assert (multi.user, multi.reason, multi.antman_class) == ("root", "", "none")
    opp = job_from_squeue_json(SQUEUE_JOB_OPP)
    assert opp.antman_class == "opportunistic" and opp.gpus_by_node == {"node1": [0, 1]}
    jobs = jobs_from_squeue_json({"jobs": [SQUEUE_JOB_MULTI, SQUEUE_JOB_OPP]})
    assert [j.job_id for j in filter_jobs(jobs, states=["running"], users=["root"])] == [2, 3]
    assert filter_jobs(jobs, states=["PENDING"]) == []
    with pytest.raises(SlurmOutputError, match="'jobs'"):
        jobs_from_squeue_json({"meta": {}})


def test_sinfo_json_node():
    node = node_from_sinfo_json(SINFO_NODE)
    assert (node.name, node.state, node.cpus, node.alloc_cpus) == ("node1", "MIXED", 4, 2)
    assert node.gres == {"gpu": 4, "antman_opp": 8} and node.gres_used == {"gpu": 3, "antman_opp": 0}


@pytest.mark.parametrize("spec,want", [
    ("gpu:2(IDX:0-1)", [0, 1]), ("gpu:1(IDX:2)", [2]), ("gpu:3(IDX:0,2-3)", [0, 2, 3]),
    ("gpu:a100:2(IDX:4-5)", [4, 5]), ("antman_opp:1", []), ("gpu:1(IDX:1),antman_opp:1", [1]),
    ("(null)", []), ("", []),
])
def test_gres_indices(spec, want):
    assert gres_indices(spec) == want


def test_gres_counts_typed_and_indexed():
    assert gres_counts("gpu:a100:2(S:0-1),gpu:v100:1,antman_opp:8") == {"gpu": 3, "antman_opp": 8}
    assert gres_counts("gpu:3(IDX:0-2)") == {"gpu": 3}


@pytest.mark.parametrize("text,cls,gpus,problem", [
    ("antman:class=guaranteed", "guaranteed", {}, None),
    ("antman:class=opportunistic;gpus=node1:0+1,node2:3", "opportunistic", {"node1": [0, 1], "node2": [3]}, None),
    ("", "none", {}, None), ("(null)", "none", {}, None), ("site note", "none", {}, None),
    ("antman:class=root", "none", {}, "class must be one of"),
    ("antman:class=opportunistic;gpus=node1:x", "opportunistic", {}, "bad GPU index"),
    ("antman:class=guaranteed;req=never", "guaranteed", {}, "req must be one of"),
    ("antman:junk", "none", {}, "is not KEY=VALUE"),
])
def test_admin_comment_tag(text, cls, gpus, problem):
    tag = parse_admin_comment(text)
    assert (tag.job_class, tag.gpus_by_node) == (cls, gpus)
    assert (tag.problem is None) if problem is None else (problem in tag.problem)


@pytest.mark.parametrize("raw,want", [
    ("RUNNING", "RUNNING"), (["PENDING", "REQUEUED"], "PENDING"), ("CANCELLED by 0", "CANCELLED"),
    ("completed", "COMPLETED"), ("", "UNKNOWN"), (None, "UNKNOWN"),
])
def test_normalise_state(raw, want):
    assert normalise_state(raw) == want


# ---- Slurm 24.11 (Debian trixie's 24.11.5, captured in `make test-slurm24`'s chroot) --------------
# `sbatch -J 'my job' --comment 'hi there' --gres=gpu:1 --wrap 'sleep 30'`: ReqTRES=/AllocTRES= where
# 22.05 prints TRES=, and TresPerNode in the gres/ form.
SLURM24_JOB = (
    "JobId=1 JobName=my job UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 Account=(null) "
    "QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 "
    "ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-11-25T06:02:27 EligibleTime=2026-11-25T06:02:27 AccrueTime=2026-11-25T06:02:27 "
    "StartTime=2026-11-25T06:02:30 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-11-25T06:02:30 Scheduler=Main Partition=gpu AllocNode:Sid=0.0.0.0:0 ReqNodeList=(null) "
    "ExcNodeList=(null) NodeList=node1 BatchHost=node1 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 "
    "ReqB:S:C:T=0:0:*:* ReqTRES=cpu=1,mem=4000M,node=1,billing=1 AllocTRES=cpu=1,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=gpu:1   Nodes=node1 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0) "
    "MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK "
    "Contiguous=0 Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp/wt-s24 Comment=hi there  "
    "StdErr=/tmp/wt-s24/slurm-1.out StdIn=/dev/null StdOut=/tmp/wt-s24/slurm-1.out TresPerNode=gres/gpu:1 "
)
SLURM24_SQUEUE_JOB = json.loads(
    '{"job_id": 2, "name": "wrap", "user_name": "root", "user_id": 0, "account": "", "partition": "gpu", '
    '"job_state": ["RUNNING"], "state_reason": "None", "nodes": "node2", "restart_cnt": 0, '
    '"admin_comment": "antman:class=guaranteed;gpus=node2:0+1", "comment": "", "tres_per_node": "gres/gpu:2", '
    '"submit_time": {"set": true, "infinite": false, "number": 1795586547}, '
    '"start_time": {"set": true, "infinite": false, "number": 1795586550}, "excluded_nodes": "", '
    '"gres_detail": ["gpu:2(IDX:0-1)"], "job_resources": {"nodes": {"count": 1, "list": "node2", '
    '"allocation": [{"index": 0, "name": "node2", "cpus": {"count": 1, "used": 0}}]}}}')
# One entry of `scontrol show nodes --json` (24.11's `sinfo --json` groups nodes instead).
SLURM24_NODE = json.loads(
    '{"name": "node1", "state": ["MIXED"], "gres": "gpu:2,antman_opp:4", "gres_used": "gpu:1,antman_opp:0", '
    '"partitions": ["gpu", "opportunistic"], "cpus": 4, "alloc_cpus": 1, "real_memory": 4000, "reason": ""}')


def test_slurm24_scontrol_job_line():
    job = job_from_scontrol(SLURM24_JOB)
    assert (job.job_id, job.name, job.comment, job.state) == (1, "my job", "hi there", "RUNNING")
    assert job.tres_per_node == "gres/gpu:1" and job.gpus_by_node == {"node1": [0]}
    assert job.raw["AllocTRES"] == "cpu=1,node=1,billing=1" and job.raw["WorkDir"] == "/tmp/wt-s24"


def test_slurm24_squeue_json_job():
    job = job_from_squeue_json(SLURM24_SQUEUE_JOB)
    assert (job.job_id, job.state, job.antman_class, job.gpus_by_node) == (2, "RUNNING", "guaranteed", {"node2": [0, 1]})
    assert job.submit_time is not None and job.submit_time.timestamp() == 1795586547


def test_slurm24_squeue_json_gres_follows_allocation_order():
    # The allocation's order (node2 first), not the sorted node list, says which GRES is whose.
    j = dict(SLURM24_SQUEUE_JOB, nodes="node[1-2]", admin_comment="", gres_detail=["gpu:1(IDX:3)", "gpu:2(IDX:0-1)"],
             job_resources={"nodes": {"allocation": [{"name": "node2"}, {"name": "node1"}]}})
    assert job_from_squeue_json(j).gpus_by_node == {"node2": [3], "node1": [0, 1]}


def test_slurm24_scontrol_nodes_json_node():
    n = node_from_sinfo_json(SLURM24_NODE)
    assert (n.name, n.state, n.gres, n.gres_used) == ("node1", "MIXED", {"gpu": 2, "antman_opp": 4},
                                                      {"gpu": 1, "antman_opp": 0})
    assert (n.cpus, n.alloc_cpus, n.partitions) == (4, 1, ["gpu", "opportunistic"])


@pytest.mark.parametrize("tres,body,prefix", [
    ("gres:gpu:2,gres:nic:1", "gpu:2,nic:1", "gres:"),
    ("gres/gpu:2,gres/nic:1", "gpu:2,nic:1", "gres/"),
    ("gpu:2", "gpu:2", "gres:"),
    ("", "", "gres:"),
])
def test_tres_forms_of_both_versions(tres, body, prefix):
    assert tres_body(tres) == body and gres_prefix(tres) == prefix


def test_executor_reads_and_writes_tres_in_either_form():
    from slurm_antman.coordinator.executor import retarget_tres
    from slurm_antman.slurm.parsing import gres_count

    assert gres_count("gres/gpu:a100:2,gres/nic:1", ("gpu",)) == gres_count("gres:gpu:a100:2", ("gpu",)) == 2
    assert retarget_tres("gres/gpu:2,gres/nic:1", ("gpu",), "antman_opp") == "gres/nic:1,gres/antman_opp:2"
    assert retarget_tres("gres:gpu:2", ("gpu",), "antman_opp") == "gres:antman_opp:2"


def test_scontrol_config_of_both_versions():
    from slurm_antman.slurm.parsing import parse_scontrol_config

    v22 = "Configuration data as of 2026-11-25T06:02:27\nProlog                  = /etc/antman-prolog\nPrologFlags             = Alloc\n"
    v24 = ("Configuration data as of 2026-11-25T06:02:27\nProlog[1]               = /etc/second\n"
           "Prolog[0]               = /etc/antman-prolog\nPrologFlags             = Alloc\nEpilog[0]               = /e\n"
           "ResvProlog              = (null)\n")
    assert parse_scontrol_config(v22)["Prolog"] == "/etc/antman-prolog"
    conf = parse_scontrol_config(v24)
    assert conf["Prolog"] == "/etc/antman-prolog,/etc/second" and conf["Epilog"] == "/e"
    assert conf["PrologFlags"] == "Alloc" and conf["ResvProlog"] == "(null)"


# --- typed GPUs (antman.yaml nodes[].gpu_type) -------------------------------------------------

def test_typed_gres_through_the_parsers():
    assert gres_counts("gpu:h100:4(S:0-1),antman_opp:h100:8") == {"gpu": 4, "antman_opp": 8}
    assert gres_indices("gres/gpu:h100:2(IDX:1,3),gres/antman_opp:h100:1", "gpu") == [1, 3]
    assert gres_indices("gpu:h100:1(IDX:2)", "antman_opp") == []


def test_executor_keeps_one_gpu_type_when_it_moves_a_job_between_gres():
    from slurm_antman.coordinator.executor import retarget_tres
    from slurm_antman.slurm.parsing import gres_count, gres_types

    assert retarget_tres("gres:antman_opp:h100:2", ("gpu", "antman_opp"), "gpu") == "gres:gpu:h100:2"
    assert retarget_tres("gres/gpu:h100:1,gres/nic:1", ("gpu",), "antman_opp") == "gres/nic:1,gres/antman_opp:h100:1"
    # Two types cannot be one node's slots: untyped, as before types existed.
    assert retarget_tres("gres:gpu:h100:1,gres:gpu:a100:1", ("gpu",), "antman_opp") == "gres:antman_opp:2"
    assert gres_types("gres:gpu:2,gres:gpu:h100,gres:nic:a:1", ("gpu",)) == {"h100"}
    assert gres_count("gres:antman_opp:h100:3", ("gpu", "antman_opp")) == 3


def test_setting_a_typed_nodes_slots_keeps_the_type():
    from slurm_antman import config
    from slurm_antman.coordinator.executor import Executor
    from slurm_antman.policy.cluster import SetOppSlots
    from slurm_antman.slurm.models import Node

    class Backend:
        def __init__(self, gres: str):
            self.node = Node("n1", "MIXED", [], gres_counts(gres), {}, ["gpu"], 8, 0, 1000, "", {"gres": gres})
            self.calls: list[list[str]] = []

        def nodes(self):
            return [self.node]

        def update_node(self, node, **fields):
            self.calls.append((node, fields))

    cfg = config.parse({"nodes": [{"name": "n1", "gpus": 4, "gpu_type": "h100"}]})
    for raw, want in (("gpu:h100:4(S:0,1),antman_opp:h100:8", "gpu:h100:4,antman_opp:h100:3"),
                      ("gpu:4(S:0-1),antman_opp:8", "gpu:4,antman_opp:3")):
        b = Backend(raw)
        out = Executor(b, cfg).execute(SetOppSlots("n1", 3), None)
        assert out.outcome == "ok", out
        assert b.calls == [("n1", {"Gres": want})]


def test_slots_are_not_set_on_a_node_that_shows_no_gres_yet():
    """scontrol's Gres= replaces the whole list: on a node that has not registered (no GRES shown), setting
    the slots alone would drop its GPUs. The executor waits for the node instead."""
    from slurm_antman import config
    from slurm_antman.coordinator.executor import Executor
    from slurm_antman.policy.cluster import SetOppSlots
    from slurm_antman.slurm.models import Node

    class Backend:
        calls: list = []

        def nodes(self):
            return [Node("n1", "UNKNOWN*", [], gres_counts(""), {}, [], 8, 0, 1000, "", {"gres": ""})]

        def update_node(self, node, **fields):
            self.calls.append((node, fields))

    cfg = config.parse({"nodes": [{"name": "n1", "gpus": 4}]})
    b = Backend()
    out = Executor(b, cfg).execute(SetOppSlots("n1", 8), None)
    assert out.outcome == "skipped" and "not registered" in out.detail, out
    assert b.calls == []


def test_a_missing_slurm_conf_is_named_at_once_not_retried_for_a_minute(tmp_path):
    """scontrol retries a missing slurm.conf once a second for 60 s; the backend says so without
    running it (the message is the backend's own, not scontrol's)."""
    from slurm_antman.slurm import SlurmUnavailable
    from slurm_antman.slurm.cli_backend import CliBackend

    missing = tmp_path / "no-such-slurm.conf"
    b = CliBackend(env={"SLURM_CONF": str(missing), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}, timeout=90)
    with pytest.raises(SlurmUnavailable, match=f"SLURM_CONF names {missing}, which does not exist"):
        b.job("7")
