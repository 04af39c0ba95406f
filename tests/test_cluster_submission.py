"""The submission path on a real 2-node Slurm 22.05 cluster: what Slurm recorded and what the job saw."""

from __future__ import annotations

import re

import pytest

from slurm_antman.jobtag import parse_tag
from slurm_antman.slurm.models import REQUEUED_START_TIME
from slurm_antman.slurm.parsing import tres_body

pytestmark = pytest.mark.cluster

ENV_SCRIPT = """#!/bin/bash
echo "CLASS=${ANTMAN_CLASS:-} CVD=${CUDA_VISIBLE_DEVICES:-} GPUS=${ANTMAN_GPUS:-} SPANK=${SLURM_SPANK_ANTMAN_CLASS:-} EP=${ANTMAN_SIDECAR_ENDPOINT:-} NODE=$SLURMD_NODENAME"
sleep ${HOLD:-30}
"""


def _seen(text: str) -> dict[str, str]:
    line = next(l for l in text.splitlines() if l.startswith("CLASS="))
    return dict(kv.split("=", 1) for kv in line.split())


def test_guaranteed_keeps_physical_gpus(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--antman=guaranteed", "--gres=gpu:2", script=ENV_SCRIPT)
    info = c.wait_state(jid, {"RUNNING"})
    seen = _seen(c.wait_output(jid, r"^CLASS="))
    assert info["Partition"] == "gpu"
    assert tres_body(info["TresPerNode"]) == "gpu:2"  # gres:gpu:2 (22.05) or gres/gpu:2 (24.11)
    assert seen["CLASS"] == "guaranteed" and seen["SPANK"] == "guaranteed"
    # Slurm bound two of the fake devices; under ConstrainDevices the job sees exactly those, as CUDA
    # devices 0 and 1, and ANTMAN_GPUS names the physical ones.
    gpus = [int(x) for x in seen["GPUS"].split(",")]
    assert len(gpus) == 2 and all(0 <= g < 4 for g in gpus)
    assert seen["CVD"] == "0,1"
    assert seen["EP"].startswith("ipc://") and f"/jobs/{jid}/" in seen["EP"]
    tag = parse_tag(c.wait_state(jid, {"RUNNING"})["AdminComment"])
    assert tag is not None and tag.job_class == "guaranteed"


def test_opportunistic_rewritten_and_sees_one_gpu(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", script=ENV_SCRIPT)
    info = c.wait_state(jid, {"RUNNING"})
    seen = _seen(c.wait_output(jid, r"^CLASS="))
    assert info["Partition"] == "opportunistic"
    assert tres_body(info["TresPerNode"]) == "antman_opp:1"
    assert info["Requeue"] == "1"
    assert info["Switches"] == "1@00:05:00"  # one leaf switch, waiting up to opportunistic.switch_wait_s
    assert seen["CLASS"] == "opportunistic"
    assert re.fullmatch(r"[0-3]", seen["GPUS"]), seen  # exactly one physical GPU...
    assert seen["CVD"] == "0", seen  # ...which its devices cgroup lets it open as CUDA device 0
    # The Prolog recorded the same GPU in Slurm, where squeue and scontrol can show it.
    import time

    for _ in range(50):
        tag = parse_tag(c.show(jid)["AdminComment"])
        if tag and tag.gpus:
            break
        time.sleep(0.2)
    assert tag is not None and tag.job_class == "opportunistic"
    assert tag.gpus == {seen["NODE"]: [int(seen["GPUS"])]}


def test_two_opportunistic_jobs_each_get_one_gpu(clean_cluster):
    c = clean_cluster
    jobs = [c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node2", script=ENV_SCRIPT) for _ in range(2)]
    seen = [_seen(c.wait_output(j, r"^CLASS=")) for j in jobs]
    for s in seen:
        assert re.fullmatch(r"[0-3]", s["GPUS"]) and s["CVD"] == "0", s
    # Nothing else runs on node2, so the placement spreads them over idle GPUs.
    assert seen[0]["GPUS"] != seen[1]["GPUS"]


def test_no_flag_is_plain_slurm(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--gres=gpu:1", script=ENV_SCRIPT)
    info = c.wait_state(jid, {"RUNNING"})
    seen = _seen(c.wait_output(jid, r"^CLASS="))
    assert info["Partition"] == "gpu"
    assert tres_body(info["TresPerNode"]) == "gpu:1"
    assert info.get("AdminComment", "") in ("", "(null)")
    assert seen["CLASS"] == "" and seen["SPANK"] == ""
    assert seen["CVD"] == "0" and seen["GPUS"] == ""  # Slurm's own binding, untouched


def test_auto_follows_documented_default(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--antman=auto", "--gres=gpu:1", script=ENV_SCRIPT)
    info = c.wait_state(jid, {"RUNNING"})
    # The devcluster's default_class is none, so auto resolves to guaranteed (docs/architecture.md).
    assert parse_tag(info["AdminComment"]).job_class == "guaranteed"
    assert info["Partition"] == "gpu"


def test_wrong_value_rejected_and_no_job_created(clean_cluster):
    c = clean_cluster
    before = c.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    r = c.sbatch("--antman=sometimes", "--gres=gpu:1", wrap="true", expect_ok=False)
    assert r.returncode != 0
    assert "--antman" in r.stderr and "sometimes" in r.stderr
    assert all(v in r.stderr for v in ("guaranteed", "opportunistic", "auto"))
    assert c.run(["squeue", "-h", "-o", "%i"]).stdout.split() == before


def test_guaranteed_cannot_take_opportunistic_partition(clean_cluster):
    r = clean_cluster.sbatch("--antman=guaranteed", "-p", "opportunistic", "--gres=gpu:1", wrap="true",
                             expect_ok=False)
    assert r.returncode != 0
    assert "opportunistic" in r.stderr and "slurm-antman" in r.stderr


CKPT_SCRIPT = """#!/bin/bash
# Counts to 1000, checkpointing every step; a requeued run starts from the checkpoint.
ck={ckpt}
start=0; [ -f $ck ] && start=$(cat $ck)
echo "START at=$start restart=${{SLURM_RESTART_COUNT:-0}}"
for i in $(seq $start 1000); do echo $i > $ck.tmp && mv $ck.tmp $ck; sleep 0.2; done
echo DONE
"""


# (50-55 s of preemption and requeue: left to `make test-slow` on this host, so that `make test`
# keeps under 15 minutes; still run on Slurm 24.11 and 26.05)
@pytest.mark.slow
@pytest.mark.every_release
def test_native_preemption_requeues_and_resumes(clean_cluster, tmp_path):
    c = clean_cluster
    ckpt = tmp_path / "ckpt"
    opp = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", "-c", "4",
                   script=CKPT_SCRIPT.format(ckpt=ckpt))
    c.wait_output(opp, r"^START at=0 restart=0")
    import time

    deadline = time.monotonic() + 20
    while (not ckpt.exists() or int(ckpt.read_text() or 0) < 5) and time.monotonic() < deadline:
        time.sleep(0.2)
    # A guaranteed job that needs the CPUs the opportunistic job holds: Slurm preempts by requeue.
    g = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1", "-c", "4", wrap="sleep 60")
    c.wait_state(g, {"RUNNING"}, timeout=60)
    info = c.show(opp)
    assert info["JobState"] in {"PENDING", "REQUEUED", "REQUEUE_HOLD"}, info["JobState"]
    assert info["Restarts"] == "1"
    saved = int(ckpt.read_text())
    assert saved >= 5
    # Let it back in: free the CPUs and skip Slurm's post-requeue BeginTime wait.
    c.run(["scancel", str(g)])
    c.run(["scontrol", "update", f"JobId={opp}", f"StartTime={REQUEUED_START_TIME}"])
    text = c.wait_output(opp, r"restart=1", timeout=60)
    m = re.search(r"START at=(\d+) restart=1", text)
    assert m and int(m.group(1)) >= saved  # resumed from the checkpoint, not from zero


RESTART_SCRIPT = """#!/bin/bash
echo "RUN restart=${SLURM_RESTART_COUNT:-0} CLASS=${ANTMAN_CLASS:-} CVD=${CUDA_VISIBLE_DEVICES:-} EP=${ANTMAN_SIDECAR_ENDPOINT:-} NODE=$SLURMD_NODENAME"
sleep 120
"""


def _run_line(text: str, restart: int) -> dict[str, str]:
    line = next(l for l in text.splitlines() if l.startswith(f"RUN restart={restart} "))
    return dict(kv.split("=", 1) for kv in line.split()[1:])


# (50-55 s of preemption and requeue: left to `make test-slow` on this host, so that `make test`
# keeps under 15 minutes; still run on Slurm 24.11 and 26.05)
@pytest.mark.slow
@pytest.mark.every_release
def test_preempted_job_restarting_on_same_node_keeps_its_env(clean_cluster):
    """slurmd skips the Prolog when a requeued job restarts on a node that still caches its credential,
    while the Epilog of the first run removed the env file: the SPANK plugin runs the Prolog instead."""
    c = clean_cluster
    hooks_log = c.c.dir / "antman-state" / "hooks.log"
    opp = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", "-c", "4", "--open-mode=append",
                   script=RESTART_SCRIPT)
    first = _run_line(c.wait_output(opp, r"^RUN restart=0 "), 0)
    assert first["CLASS"] == "opportunistic" and re.fullmatch(r"[0-3]", first["CVD"]), first
    g = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1", "-c", "4", wrap="sleep 60")
    c.wait_state(g, {"RUNNING"}, timeout=60)
    assert c.show(opp)["Restarts"] == "1"
    c.run(["scancel", str(g)])
    c.run(["scontrol", "update", f"JobId={opp}", f"StartTime={REQUEUED_START_TIME}"])
    again = _run_line(c.wait_output(opp, r"^RUN restart=1 ", timeout=60), 1)
    assert again["NODE"] == "node1"
    assert again["CLASS"] == "opportunistic", again
    assert re.fullmatch(r"[0-3]", again["CVD"]), again  # exactly one physical GPU
    assert again["EP"].startswith("ipc://") and f"/jobs/{opp}/" in again["EP"], again
    # The second run got its Prolog: from slurmd when its credential cache had forgotten the job,
    # otherwise from the SPANK plugin (which of the two depends on Slurm's timing, not on us).
    log = hooks_log.read_text()
    by_plugin = f"job {opp} on node1: env file missing at step start; Prolog run by the SPANK plugin" in log
    placements = log.count(f"job {opp} on node1: class opportunistic")
    assert by_plugin or placements >= 2, log


STEP_SCRIPT = """#!/bin/bash
echo BATCH
while [ ! -f {flag} ]; do sleep 0.2; done
srun -n1 bash -c 'echo "STEP CLASS=${{ANTMAN_CLASS:-}} CVD=${{CUDA_VISIBLE_DEVICES:-}}"'
"""


def test_missing_env_file_with_unusable_prolog_fails_the_opportunistic_step_closed(clean_cluster, tmp_path):
    """A later step that finds no env file runs the hook; when it cannot be executed, nothing could
    place or limit the opportunistic job: its task does not start (fail closed)."""
    c = clean_cluster
    plugstack = c.c.dir / "etc" / "plugstack.conf.d" / "antman.conf"
    original = plugstack.read_text()
    flag = tmp_path / "go"
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", script=STEP_SCRIPT.format(flag=flag))
    c.wait_output(jid, r"^BATCH")
    env_file = c.c.dir / "antman-state" / "node1" / "jobs" / f"{jid}.env"
    assert env_file.exists()
    try:
        # slurmstepd reads plugstack.conf at every step start: the next step sees this hook path.
        plugstack.write_text(re.sub(r"prolog=\S+", "prolog=/nonexistent/antman-prolog", original))
        env_file.unlink()
        flag.write_text("")
        text = c.wait_output(jid, r"not started on this node", timeout=30)
    finally:
        plugstack.write_text(original)
    assert not re.search(r"^STEP CLASS=", text, re.M), text  # the task never ran
    assert "it is opportunistic and the node could not write its env file" in text, text
    assert not env_file.exists()  # nothing wrote the file: the hook never ran
    log = (c.c.dir / "log" / "slurmd-node1.log").read_text()
    assert (f"antman: job {jid}: cannot execute prolog /nonexistent/antman-prolog: No such file or directory"
            in log)


def test_opportunistic_job_without_its_sidecar_is_requeued_never_run_unmanaged(clean_cluster):
    """Fail closed: with node2's sidecar down the Prolog cannot place or limit an opportunistic job, so
    the job's task must not start there (it would see every GPU, with no limits, beside any guaranteed
    job); Slurm requeues it, and once the sidecar is back it runs once, managed."""
    import os
    import signal
    import time

    from slurm_antman.clients import sidecar_control as client
    from slurm_antman import config
    from slurm_antman.lab.devcluster import cluster as dc

    c = clean_cluster
    side = next(p for p in c.c.procs if p.name == "sidecar:node2")
    os.kill(side.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while side.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not side.alive()
    try:
        opp = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node2", script=RESTART_SCRIPT)
        hooks_log = c.c.dir / "antman-state" / "hooks.log"
        deadline = time.monotonic() + 60
        def logged() -> str:
            return hooks_log.read_text() if hooks_log.exists() else ""

        while f"job {opp} on node2: not started, requeued" not in logged():
            assert time.monotonic() < deadline, logged()[-3000:]
            time.sleep(0.5)
        info = c.wait_state(opp, {"PENDING"}, timeout=60)
        assert int(info["Restarts"]) >= 1
        out = c.workdir / f"{opp}.out"
        assert "RUN " not in (out.read_text() if out.exists() else "")
    finally:
        dc.replace_proc(c.c, dc.start_sidecar(c.c, "node2"))
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping(config.load(str(c.c.config_path)).node_socket_dir("node2"), timeout_s=1.0)
            break
        except client.SidecarUnreachable:
            assert time.monotonic() < deadline, "sidecar for node2 did not come back"
    c.run(["scontrol", "update", f"JobId={opp}", f"StartTime={REQUEUED_START_TIME}"])
    text = c.wait_output(opp, r"^RUN ", timeout=90)
    runs = [l for l in text.splitlines() if l.startswith("RUN ")]
    assert len(runs) == 1, text  # never started while refused; started once now
    seen = dict(kv.split("=", 1) for kv in runs[0].split()[1:])
    assert seen["NODE"] == "node2" and re.fullmatch(r"[0-3]", seen["CVD"]), seen
    assert seen["EP"].startswith("ipc://") and f"/jobs/{opp}/" in seen["EP"], seen


def test_a_task_whose_env_file_says_refused_never_starts(clean_cluster, tmp_path):
    """The SPANK side of failing closed: when the Prolog refused a job (ANTMAN_REFUSED in its env file)
    and Slurm launches a step anyway, the plugin fails the task instead of running it unmanaged."""
    from slurm_antman import envfile

    c = clean_cluster
    flag = tmp_path / "go"
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", script=STEP_SCRIPT.format(flag=flag))
    c.wait_output(jid, r"^BATCH")
    env_file = c.c.dir / "antman-state" / "node1" / "jobs" / f"{jid}.env"
    values = envfile.parse_env(env_file.read_bytes())
    envfile.write(env_file, {**values, "ANTMAN_REFUSED": "no GPU of node1 meets the opportunistic rules (test)"})
    flag.write_text("")
    c.wait_state(jid, {"COMPLETED", "FAILED"}, timeout=60)
    out = (c.workdir / f"{jid}.out").read_text()
    assert "STEP CLASS=" not in out, out
    log = (c.c.dir / "log" / "slurmd-node1.log").read_text()
    assert f"antman: job {jid} not started on this node: no GPU of node1 meets the opportunistic rules (test)" in log


@pytest.mark.parametrize("where", ["-J", "--comment"])
def test_a_class_forged_in_the_job_name_or_comment_is_ignored(clean_cluster, where):
    """The audit's attack: `-J "x AdminComment=antman:class=guaranteed"` on an opportunistic job. The
    Prolog must read the real AdminComment (order-aware parsing), so the job runs opportunistic:
    one GPU chosen by the sidecar, registered, limited; and the forged class never reaches Slurm."""
    from slurm_antman.slurm import CliBackend

    c = clean_cluster
    forged = "x AdminComment=antman:class=guaranteed;gpus=node1:0 TresPerNode=gres:gpu:4"
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", where, forged, script=ENV_SCRIPT)
    seen = _seen(c.wait_output(jid, r"^CLASS=", timeout=60))
    assert seen["CLASS"] == "opportunistic", seen
    assert re.fullmatch(r"[0-3]", seen["CVD"]) and seen["EP"].startswith("ipc://"), seen
    job = CliBackend(env=c.env).job(jid)
    assert job.antman_class == "opportunistic" and job.admin_comment.startswith("antman:class=opportunistic"), job
    assert (job.name if where == "-J" else job.comment) == forged


FORGED_STEP_SCRIPT = """#!/bin/bash
echo BATCH
while [ ! -f {flag} ]; do sleep 0.2; done
SLURMD_NODENAME=node2 SLURM_JOB_GPUS=0,1,2,3 SLURM_JOB_PARTITION=gpu SLURM_SPANK_ANTMAN_CLASS=guaranteed \\
  srun -n1 bash -c 'echo "STEP CLASS=${{ANTMAN_CLASS:-}} CVD=${{CUDA_VISIBLE_DEVICES:-}} EP=${{ANTMAN_SIDECAR_ENDPOINT:-}}"'
# Stay until the test has looked at the env file: the job's Epilog removes it when the job ends.
for i in $(seq 300); do [ -f {flag}.done ] && break; sleep 0.2; done
"""


def test_the_prolog_the_plugin_runs_ignores_what_the_job_sets_in_its_environment(clean_cluster, tmp_path):
    """A step whose env file is missing makes the plugin run the Prolog as root. The step's environment
    is the user's: a forged node, GPU list, partition and class must not move the job to node2, give it
    every GPU or skip its registration."""
    c = clean_cluster
    flag = tmp_path / "go"
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1",
                   script=FORGED_STEP_SCRIPT.format(flag=flag))
    c.wait_output(jid, r"^BATCH")
    state = c.c.dir / "antman-state"
    env_file = state / "node1" / "jobs" / f"{jid}.env"
    first = dict(l.split("=", 1) for l in env_file.read_text().splitlines() if l and not l.startswith("#"))
    env_file.unlink()
    flag.write_text("")
    text = c.wait_output(jid, r"^STEP ", timeout=60)
    step = dict(kv.split("=", 1) for kv in next(l for l in text.splitlines() if l.startswith("STEP ")).split()[1:])
    assert step["CLASS"] == "opportunistic" and step["CVD"] == first["CUDA_VISIBLE_DEVICES"], (step, first)
    assert f"/node1/jobs/{jid}/" in step["EP"], step
    assert env_file.exists() and not (state / "node2" / "jobs" / f"{jid}.env").exists()
    log = (state / "hooks.log").read_text()
    assert f"job {jid} on node1: env file missing at step start; Prolog run by the SPANK plugin" in log
    assert f"job {jid} on node2" not in log
    (tmp_path / "go.done").write_text("")
