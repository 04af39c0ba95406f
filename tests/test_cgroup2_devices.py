"""Device programs on a real cgroup v2 node: what the SPANK plugin attaches for a job, and what happens when it
cannot (spank/README.md, "Devices under cgroup v2" and "When it fails").

Under cgroup v2 Slurm (src/plugins/cgroup/v2/cgroup_v2.c, ebpf.c) confines a job's devices with eBPF programs:
one attached with BPF_F_ALLOW_OVERRIDE to the job's cgroup and to ``step_N/user``, one with flags 0 to
``task_N`` of an srun step; a batch step gets the job's program only. For an opportunistic job the plugin
attaches to the task's own cgroup a copy of the program in effect there behind a prefix that allows its placed
GPU. These tests read what is attached with bpftool while jobs run on the devcluster, and make the node's
device setup one the plugin must refuse (a BPF_F_ALLOW_MULTI program above the jobs, as systemd attaches its
DevicePolicy= programs) to follow a failed grant from the plugin's log line to the coordinator keeping
opportunistic jobs off the node. Which GPUs each job can open is tests/test_site_cluster.py's.

Every job is submitted as the devcluster's ordinary user. Needs a node that boots the unified cgroup v2
hierarchy, bpftool and gcc: the User-Mode Linux guest of ``make test-cgroup2`` (.ci/uml) has them.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from slurm_antman import config as config_mod
from slurm_antman import device_failure
from slurm_antman.jobtag import parse_tag
from slurm_antman.lab.devcluster.processes import unified_cgroup_host
from slurm_antman.slurm import CliBackend

REPO = Path(__file__).resolve().parent.parent
CGROUP2 = Path("/sys/fs/cgroup")
NVIDIA_MAJOR = 195
# The plugin's prefix: a type check (3 instructions), then per placed device a major and a minor check and
# "return 1" (6): spank/cgroup_bpf.c, PREFIX_LEN.
PREFIX_ONE_DEVICE = 3 + 6

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not unified_cgroup_host(), reason="needs a node that boots the unified cgroup v2 hierarchy: "
                       "run make test-cgroup2 (a User-Mode Linux guest)"),
]


@pytest.fixture(scope="module", autouse=True)
def _tools() -> None:
    missing = [t for t in ("bpftool", "gcc") if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: the cgroup v2 device tests read programs with bpftool and "
                    "build tests/c/bpf_grant_driver.c with gcc (the .ci/uml guest has both)")


def bpftool(*args: str):
    """bpftool's JSON answer (its complaints about a kernel without BTF go to stderr)."""
    r = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return json.loads(r.stdout) if r.stdout.strip() else []


def own(cg: Path) -> list[dict]:
    """The device programs attached to cgroup ``cg`` itself: id, name, attach_flags ("" for flags 0)."""
    return [p for p in bpftool("cgroup", "show", str(cg)) if p["attach_type"] == "cgroup_device"]


def effective(cg: Path) -> list[int]:
    """The ids of the device programs the kernel runs for a process in ``cg``."""
    return [p["id"] for p in bpftool("cgroup", "show", str(cg), "effective") if p["attach_type"] == "cgroup_device"]


def xlated(prog_id: int) -> list[str]:
    """The program's translated instructions, as text (jumps are relative: equal code, equal text)."""
    return [i["disasm"] for i in bpftool("prog", "dump", "xlated", "id", str(prog_id))]


def ancestors(cg: Path) -> list[Path]:
    """``cg``'s parents up to and including the cgroup2 root."""
    return [p for p in cg.parents if p == CGROUP2 or CGROUP2 in p.parents]


def one(progs: list[dict], where: Path) -> dict:
    assert len(progs) == 1, (str(where), progs)
    return progs[0]


def task_cgroups(c, jid: int, want: int, timeout: float = 60) -> dict[str, Path]:
    """The task cgroups the job printed ("CGROUP WHO /path" lines, from /proc/self/cgroup), by WHO."""
    deadline = time.monotonic() + timeout
    found: dict[str, Path] = {}
    text = ""
    while time.monotonic() < deadline and len(found) < want:
        time.sleep(0.5)
        text = c.output(jid)
        found = {l.split()[1]: CGROUP2 / l.split()[2].lstrip("/") for l in text.splitlines()
                 if l.startswith("CGROUP ") and len(l.split()) == 3}
    assert len(found) == want, (c.show(jid).get("JobState"), text)
    return found


def submitted_by_the_user(c, jid: int) -> None:
    user = c.show(jid)["UserId"]
    assert user.startswith(f"{c.c.user}("), user  # the devcluster's ordinary user, not root


# The batch step's task and an srun step's task print their cgroup v2 path, and stay.
OPPORTUNISTIC_JOB = """#!/bin/bash
sed -n 's/^0::/CGROUP batch /p' /proc/self/cgroup
srun -n1 --overlap bash -c 'sed -n "s/^0::/CGROUP step /p" /proc/self/cgroup; sleep 120' &
sleep 120
"""
BATCH_ONLY_JOB = """#!/bin/bash
sed -n 's/^0::/CGROUP batch /p' /proc/self/cgroup
sleep 120
"""


def test_an_opportunistic_jobs_tasks_run_the_plugins_program_a_copy_of_slurms_behind_the_grant(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-n2", "-w", "node1", script=OPPORTUNISTIC_JOB)
    cgs = task_cgroups(c, jid, 2)
    submitted_by_the_user(c, jid)
    batch, step = cgs["batch"], cgs["step"]
    job_cg = batch.parents[2]
    assert batch.relative_to(job_cg).parts == ("step_batch", "user", "task_0"), batch
    assert step.parent.name == "user" and step.parents[1].name.startswith("step_") and step.parents[2] == job_cg, step
    # The job's cgroup: Slurm's program, attached with BPF_F_ALLOW_OVERRIDE, the only one at that level.
    slurm_job = one(own(job_cg), job_cg)
    assert (slurm_job["name"], slurm_job["attach_flags"]) == ("Slurm_Cgroup_v2", "override"), slurm_job
    # Nothing above the job: no MULTI program that would run beside the task's (the plugin refuses one).
    assert all(own(a) == [] for a in ancestors(job_cg)), {str(a): own(a) for a in ancestors(job_cg)}
    # The batch task: Slurm attaches nothing there; the plugin's program is attached with flags 0 and is the
    # one program the kernel runs for it.
    assert own(batch.parent) == [] and own(batch.parents[1]) == []
    mine = one(own(batch), batch)
    assert (mine["name"], mine["attach_flags"]) == ("antman_devices", ""), mine
    assert effective(batch) == [mine["id"]]
    # An srun step's task: Slurm's flags-0 program there was replaced by the plugin's (one program, ours),
    # Slurm's step_N/user program stays, and only ours runs for the task.
    slurm_user = one(own(step.parent), step.parent)
    assert (slurm_user["name"], slurm_user["attach_flags"]) == ("Slurm_Cgroup_v2", "override"), slurm_user
    assert own(step.parents[1]) == []
    mine_step = one(own(step), step)
    assert (mine_step["name"], mine_step["attach_flags"]) == ("antman_devices", ""), mine_step
    assert effective(step) == [mine_step["id"]]
    ours_step, slurm_step = xlated(mine_step["id"]), xlated(slurm_user["id"])
    assert ours_step[PREFIX_ONE_DEVICE:] == slurm_step, (ours_step, slurm_step)
    # What the plugin's program is: its prefix, then Slurm's program for the job unchanged (the step's
    # slurmstepd attached the job's program again, replacing it, but with the same instructions).
    slurm_job = one(own(job_cg), job_cg)
    ours, slurms = xlated(mine["id"]), xlated(slurm_job["id"])
    assert len(ours) == len(slurms) + PREFIX_ONE_DEVICE and ours[PREFIX_ONE_DEVICE:] == slurms, (ours, slurms)
    # The prefix names the placed GPU: its major and its minor.
    placed = parse_tag(CliBackend(env=c.env).job(jid).admin_comment).gpus["node1"]
    prefix = "\n".join(ours[:PREFIX_ONE_DEVICE])
    assert len(placed) == 1, placed
    assert f"!= 0x{NVIDIA_MAJOR:x} goto" in prefix and f"!= 0x{placed[0]:x} goto" in prefix, prefix
    c.run(["scancel", str(jid)])


def test_guaranteed_and_plain_jobs_run_slurms_program_alone(clean_cluster):
    c = clean_cluster
    jobs = {"guaranteed": c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1", script=BATCH_ONLY_JOB),
            "plain": c.sbatch("-w", "node1", script=BATCH_ONLY_JOB)}
    for kind, jid in jobs.items():
        batch = task_cgroups(c, jid, 1)["batch"]
        submitted_by_the_user(c, jid)
        job_cg = batch.parents[2]
        slurm_job = one(own(job_cg), job_cg)
        assert (slurm_job["name"], slurm_job["attach_flags"]) == ("Slurm_Cgroup_v2", "override"), \
            (kind, slurm_job)
        # Nothing of the plugin's on the task or anywhere on its path: Slurm's job-level program decides alone.
        assert own(batch) == [] and own(batch.parent) == [] and own(batch.parents[1]) == [], kind
        assert all(own(a) == [] for a in ancestors(job_cg)), kind
        assert effective(batch) == [slurm_job["id"]], kind
    c.run(["scancel", *map(str, jobs.values())])


# ---- the failure path, for real ----

FAILING_JOB = """#!/bin/bash
echo SCRIPT-RAN
sleep 120
"""


HEALTHY_AGAIN = "node node1 takes opportunistic jobs again"  # node1's sidecar, once its record is gone


def _count(path: Path, needle: str) -> int:
    return path.read_text(errors="replace").count(needle) if path.exists() else 0


@pytest.fixture(scope="module")
def failed_grant(cluster, tmp_path_factory) -> Iterator[dict]:
    """An opportunistic job on node1 while a BPF_F_ALLOW_MULTI device program (accepting every device) is
    attached to node1's slurmstepd scope, above every job cgroup of node1: the kernel runs it beside Slurm's,
    and the plugin, which cannot replace it, must refuse to grant. The user excludes node2, so the job can
    run on node1 only. Handed out once the job was requeued and the coordinator kept it off node1; on the way
    out the job is cancelled, the program detached, the node's device-failure record removed and the node's
    sidecar seen taking opportunistic jobs again, so later tests find the cluster as it was."""
    c = cluster
    c.cancel_all()
    assert c.wait_empty(30)
    exe = tmp_path_factory.mktemp("bpf-driver") / "bpf_grant_driver"
    r = subprocess.run(["gcc", "-std=gnu11", "-O1", "-Wall", "-Werror", f"-I{REPO / 'spank'}", "-o", str(exe),
                        str(REPO / "tests" / "c" / "bpf_grant_driver.c"), str(REPO / "spank" / "cgroup_bpf.c")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    scope = CGROUP2 / "system.slice" / "node1_slurmstepd.scope"
    if not scope.is_dir():  # slurmd asks systemd for it when it starts its first step
        c.run_as_user(["srun", "-w", "node1", "true"], timeout=60, cwd=c.workdir)
    assert scope.is_dir(), f"{scope}: no slurmstepd scope for node1 (is slurmd's cgroup plugin cgroup/v2?)"
    assert own(scope) == [], own(scope)
    cfg = config_mod.load(c.c.config_path)
    record = device_failure.path(Path(cfg.state_dir) / "node1")
    sidecar_log = c.c.dir / "log" / "sidecar-node1.log"
    healthy_again = _count(sidecar_log, HEALTHY_AGAIN)
    jid = None
    try:
        # tests/c/bpf_grant_driver.c's allow-all program (named slurm_like), attached with BPF_F_ALLOW_MULTI.
        r = subprocess.run([str(exe), "attach", str(scope), "multi", "allow-all"], capture_output=True, text=True,
                           timeout=30)
        assert r.stdout.strip() == "attached", (r.stdout, r.stderr)
        prog = one(own(scope), scope)
        assert prog["attach_flags"] == "multi", prog
        jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-x", "node2", script=FAILING_JOB)
        explain_out = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = c.show(jid)
            explain_out = c.run([sys.executable, "-m", "slurm_antman.cli", "explain", str(jid)],
                                env=dict(c.env, PYTHONPATH=str(REPO))).stdout
            if record.exists() and int(info.get("Restarts", "0")) >= 1 and \
                    re.search(r"kept off node\(s\) .*node1", explain_out):
                break
            time.sleep(1)
        yield {"c": c, "jid": jid, "info": c.show(jid), "record": record, "explain": explain_out,
               "sidecar_log": sidecar_log, "cfg": cfg}
    finally:
        if jid is not None:
            c.run(["scancel", str(jid)])
            c.wait_empty(30)
        record.unlink(missing_ok=True)
        # Every device program on the scope is this fixture's: it had none before.
        detached = [subprocess.run(["bpftool", "cgroup", "detach", str(scope), "cgroup_device", "id", str(p["id"])],
                                   capture_output=True, text=True, timeout=30) for p in own(scope)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _count(sidecar_log, HEALTHY_AGAIN) <= healthy_again:
            time.sleep(0.5)
        assert all(d.returncode == 0 for d in detached) and own(scope) == [], ([d.stderr for d in detached], own(scope))
        assert _count(sidecar_log, HEALTHY_AGAIN) > healthy_again, \
            "node1's sidecar still reports the node unhealthy after the device-failure record was removed"
        # The coordinator gives node1 its opportunistic slots back in Slurm (it had left it the one minimum slot).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and opp_slots(c, cfg, "node1") <= 1:
            time.sleep(0.5)
        assert opp_slots(c, cfg, "node1") > 1


def opp_slots(c, cfg, node: str) -> int:
    """The count of the node's opportunistic GRES in slurmctld (``Gres=...,antman_opp:N``)."""
    r = c.run(["scontrol", "show", "node", node, "-o"])
    m = re.search(rf"(?:^| )Gres=\S*\b{re.escape(cfg.slurm.opportunistic_gres)}:(\d+)", r.stdout)
    assert m, (r.stdout, r.stderr)
    return int(m.group(1))


def test_a_failed_grant_never_runs_the_job_and_says_why_once(failed_grant):
    f = failed_grant
    c, jid = f["c"], f["jid"]
    submitted_by_the_user(c, jid)
    placed = parse_tag(f["info"]["AdminComment"]).gpus["node1"]
    assert len(placed) == 1
    cause = (f"cannot allow its GPU {NVIDIA_MAJOR}:{placed[0]} on this cgroup v2 node: a device program attached "
             "with BPF_F_ALLOW_MULTI applies to the cgroup (File exists)")
    # One line in slurmd's log, naming the job, its GPU and the cause; none on the other node. (When the task
    # reaches its task_init before the requeue ends it, that adds its own "not started" line with the refusal.)
    logs = {h: (c.c.dir / "log" / f"slurmd-{h}.log").read_text(errors="replace") for h in c.c.nodes}
    said = [l for h in logs for l in logs[h].splitlines() if f"antman: job {jid}: cannot allow its GPU" in l]
    assert len(said) == 1 and f"antman: job {jid}: {cause}; the job is requeued" in said[0], said
    assert f"[{jid}.batch]" in said[0] and "cannot allow its GPU" not in logs["node2"], said
    assert "refusal could not be recorded" not in logs["node1"]
    # The task never ran a line of the script.
    assert "SCRIPT-RAN" not in c.output(jid)
    # The Prolog hook, run by the plugin with the cause, requeued it (COMPLETING for a moment on the way).
    info = f["info"]
    deadline = time.monotonic() + 30
    while info["JobState"] == "COMPLETING" and time.monotonic() < deadline:
        time.sleep(0.5)
        info = c.show(jid)
    assert int(info["Restarts"]) >= 1 and info["JobState"] in ("PENDING", "REQUEUED"), info
    # A refused task is not a failed launch: Slurm drains nothing (a launch failure drains the node).
    state = c.run(["sinfo", "-h", "-n", "node1", "-o", "%T"]).stdout
    assert "drain" not in state.lower(), state
    hooks = (Path(f["cfg"].state_dir) / "hooks.log").read_text(errors="replace")
    assert f"job {jid} on node1: not started, requeued: its GPU could not be granted on node1: {cause}" in hooks
    # Its record, root's: the job and the cause.
    st = f["record"].lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0
    data = json.loads(f["record"].read_text())
    assert data["job_id"] == str(jid) and data["cause"] == cause, data
    assert 0 <= time.time() - data["ts"] < device_failure.HOLD_S
    # node1's sidecar reports itself unhealthy with that cause.
    assert f"node node1 takes no new opportunistic job: job {jid}'s GPU could not be granted here ({cause})" in \
        f["sidecar_log"].read_text(errors="replace")


def test_the_coordinator_keeps_the_requeued_job_off_the_node(failed_grant):
    f = failed_grant
    out = f["explain"]
    # node1 has no room for opportunistic jobs any more: the job is kept off it (node2 the user excluded).
    assert re.search(r"kept off node\(s\) node1, node2\n", out), out
    assert "no_room=['node1']" in out and "user_excluded=['node2']" in out, out
    assert "node1" in f["info"]["ExcNodeList"], f["info"]


def test_explain_names_the_device_failure_that_keeps_the_job_off(failed_grant):
    out = failed_grant["explain"]
    assert "node1 takes no opportunistic job: job " in out and "could not be granted here" in out, out
    assert "BPF_F_ALLOW_MULTI" in out, out
