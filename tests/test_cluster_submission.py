"""The submission path on a real 2-node Slurm 22.05 cluster: what Slurm recorded and what the job saw."""

from __future__ import annotations

import re

import pytest

from slurm_antman.jobtag import parse_tag

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
    assert info["TresPerNode"] == "gres:gpu:2"
    assert seen["CLASS"] == "guaranteed" and seen["SPANK"] == "guaranteed"
    # Slurm bound two of the fake devices; the job sees exactly those.
    cvd = [int(x) for x in seen["CVD"].split(",")]
    assert len(cvd) == 2 and all(0 <= g < 4 for g in cvd)
    assert seen["GPUS"] == seen["CVD"]
    assert seen["EP"].startswith("ipc://") and f"/jobs/{jid}/" in seen["EP"]
    tag = parse_tag(c.wait_state(jid, {"RUNNING"})["AdminComment"])
    assert tag is not None and tag.job_class == "guaranteed"


def test_opportunistic_rewritten_and_sees_one_gpu(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", script=ENV_SCRIPT)
    info = c.wait_state(jid, {"RUNNING"})
    seen = _seen(c.wait_output(jid, r"^CLASS="))
    assert info["Partition"] == "opportunistic"
    assert info["TresPerNode"] == "gres:antman_opp:1"
    assert info["Requeue"] == "1"
    assert seen["CLASS"] == "opportunistic"
    assert re.fullmatch(r"[0-3]", seen["CVD"]), seen  # exactly one physical GPU
    assert seen["GPUS"] == seen["CVD"]
    # The Prolog recorded the same GPU in Slurm, where squeue and scontrol can show it.
    import time

    for _ in range(50):
        tag = parse_tag(c.show(jid)["AdminComment"])
        if tag and tag.gpus:
            break
        time.sleep(0.2)
    assert tag is not None and tag.job_class == "opportunistic"
    assert tag.gpus == {seen["NODE"]: [int(seen["CVD"])]}


def test_two_opportunistic_jobs_each_get_one_gpu(clean_cluster):
    c = clean_cluster
    jobs = [c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node2", script=ENV_SCRIPT) for _ in range(2)]
    seen = [_seen(c.wait_output(j, r"^CLASS=")) for j in jobs]
    for s in seen:
        assert re.fullmatch(r"[0-3]", s["CVD"]), s
    # Nothing else runs on node2, so the placement spreads them over idle GPUs.
    assert seen[0]["CVD"] != seen[1]["CVD"]


def test_no_flag_is_plain_slurm(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--gres=gpu:1", script=ENV_SCRIPT)
    info = c.wait_state(jid, {"RUNNING"})
    seen = _seen(c.wait_output(jid, r"^CLASS="))
    assert info["Partition"] == "gpu"
    assert info["TresPerNode"] == "gres:gpu:1"
    assert info.get("AdminComment", "") in ("", "(null)")
    assert seen["CLASS"] == "" and seen["SPANK"] == ""
    assert re.fullmatch(r"[0-3]", seen["CVD"])  # Slurm's own binding, untouched


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
    c.run(["scontrol", "update", f"JobId={opp}", "StartTime=now"])
    text = c.wait_output(opp, r"restart=1", timeout=60)
    m = re.search(r"START at=(\d+) restart=1", text)
    assert m and int(m.group(1)) >= saved  # resumed from the checkpoint, not from zero
