"""`make gpu-site-proof` without a GPU: the same target and the same sequence as on the GPU machine (a
one-node site, jobs submitted by an ordinary user through sbatch, the carried Slurm), run on the
devcluster's emulated GPU, so that the command cannot rot while no device comes (docs/gpu_proof.md)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import TEST_PORT_BASE, _require_slurm
from slurm_antman.lab.siteproof import proof

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.cluster
@pytest.mark.slow
def test_make_gpu_site_proof_runs_the_loop_with_the_carried_slurm(carried_bundle, tmp_path):
    _require_slurm()
    out = tmp_path / "out"
    r = subprocess.run(["make", "-s", "gpu-site-proof", f"SITE_BUNDLE={carried_bundle}", f"GPU_SITE_PROOF_DIR={out}",
                        f"GPU_SITE_PROOF_ARGS=--dir {tmp_path / 'site'} --port-base {TEST_PORT_BASE + 950}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})
    rec = json.loads((out / "site.json").read_text())
    assert r.returncode == 0, (rec.get("error"), r.stdout[-3000:], r.stderr[-2000:])
    assert rec["result"] == "passed" and rec["device"] == "emulated" and rec["gpu"] is None
    assert rec["slurm_carried"] is not None and "22.05" in rec["slurm_version"]
    assert rec["confine_devices"] is True  # this host's cgroup v1 device control
    failed = {k: v for k, v in rec["checks"].items() if v["ok"] is False}
    assert rec["checks"]["guaranteed_beside"]["ok"] is None  # a GPU's target: on the emulated one, recorded
    assert not failed and {"guaranteed_beside", "opportunistic_progress", "shrink", "pause_resume", "requeue_resume",
                           "no_job_lost_or_twice", "explain"} <= set(rec["checks"]), rec["checks"]
    loop = rec["loop"]
    assert "antman-dev" in loop["squeue_sharing"] and "PAUSED" in loop["squeue_paused"]
    assert loop["limit_after_bytes"] < loop["limit_before_bytes"]
    md = (out / "site.md").read_text()
    assert md.startswith("# Site proof: passed") and "carried into a prefix" in md and "antman explain" in md


def _rec(**loop) -> dict:
    base = {"alone_ms": 100.0, "beside_ms": 101.0, "beside_s": 20, "mean_share": 0.3,
            "opportunistic_step_lines_per_s": 1.0, "opportunistic_job": 2}
    return {"device": "cuda", "loop": {**base, **loop}, "outputs": {}}


def test_the_guaranteed_jobs_slowdown_is_held_to_the_target_plus_its_own_noise():
    assert proof.checks(_rec())["guaranteed_beside"]["ok"]
    assert not proof.checks(_rec(beside_ms=104.0))["guaranteed_beside"]["ok"]
    rec = _rec(beside_ms=104.0)
    # alone, the job's 20-step means vary by about 3 %: 4 % beside it is within target plus noise
    rec["outputs"]["resnet50-guaranteed.out"] = "\n".join(
        f"step {i * 20} phase=base gpu_mem=1MiB held=0MiB waits=0 step_ms={ms}" for i, ms in
        enumerate([500.0, 97.0, 103.0, 97.0, 103.0]))
    got = proof.checks(rec)["guaranteed_beside"]
    assert 0.02 < got["noise"] < 0.04 and got["ok"], got


def test_nvml_memory_over_the_limit_is_counted_once_the_limit_stood():
    gib = 1 << 30
    samples = [{"t": i / 2, "used": {"2": 3 * gib}, "limit": {"2": 8 * gib}} for i in range(6)]
    assert proof._nvml_under_limit(samples, "2") == {"samples": 2, "over": 0, "worst_excess_bytes": -5 * gib,
                                                     "slack_bytes": gib, "ok": True}
    # a limit just lowered is given two seconds (four samples); after that, NVML over it by more than the slack counts
    lowered = samples + [{"t": 3 + i / 2, "used": {"2": 3 * gib}, "limit": {"2": 1 * gib}} for i in range(6)]
    got = proof._nvml_under_limit(lowered, "2")
    assert got["over"] == 2 and not got["ok"], got


def test_a_cgroup_v2_machine_without_systemd_gets_a_cgroup_conf_slurmd_can_start_with():
    """The GPU machine may boot cgroup v2 with no systemd to ask for slurmstepd's scope: Slurm's own
    IgnoreSystemd then, and the file even unconfined (slurmd loads its cgroup plugin regardless)."""
    from slurm_antman.lab.devcluster import files

    bare = files.cgroup_conf(unified=True, systemd=False, constrain=False)
    assert "CgroupPlugin=cgroup/v2" in bare and "IgnoreSystemd=yes" in bare and "CgroupAutomount=yes" in bare
    assert "ConstrainDevices=no" in bare
    site = files.cgroup_conf(unified=True, systemd=True)
    assert "CgroupPlugin=autodetect" in site and "IgnoreSystemd" not in site and "ConstrainDevices=yes" in site
    assert "CgroupPlugin=cgroup/v1" in files.cgroup_conf(unified=False)


def _wait_for(path: Path, text: str, proc, timeout: float = 120, after: str = "") -> str:
    """``path``'s text once ``text`` shows in it (past the first ``after``, when given)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = path.read_text() if path.exists() else ""
        if after in out and text in out.split(after, 1)[1] if after else text in out:
            return out
        assert proc.poll() is None, out[-2000:]
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s: {out[-2000:]}")


@pytest.mark.slow  # about 40 s of CPU training: `make test` stays under 15 minutes
def test_the_gpu_jobs_of_the_site_proof_run_their_phases_and_resume_from_a_checkpoint(tmp_path):
    """The device run's job scripts, on the CPU (ANTMAN_SITE_DEVICE=cpu, a small zoo model): the guaranteed
    job takes and gives back memory as its phase file says, the opportunistic one checkpoints on SIGTERM
    and resumes from it. A device session must not be spent on a script that cannot start."""
    import signal
    import sys

    from slurm_antman.lab import jobs

    env = {**os.environ, "ANTMAN_SITE_DEVICE": "cpu", "PYTHONPATH": str(REPO)}
    phase, out = tmp_path / "phase", tmp_path / "g.out"
    phase.write_text("base")
    with open(out, "w") as f:
        g = subprocess.Popen([sys.executable, str(jobs.script("site_guaranteed.py")), "rl_ppo_atari", "8", str(phase)],
                             stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(out, "phase=base", g)
        phase.write_text("grow")  # a quarter of the notional 1 GiB: one 256 MiB chunk
        _wait_for(out, "phase=grow gpu_mem=256MiB held=256MiB", g)
        phase.write_text("base")
        text = _wait_for(out, "phase=base gpu_mem=0MiB held=0MiB waits=0", g, after="phase=grow")
        assert "step_ms=" in text
    finally:
        g.kill()
        g.wait()
    ckpt, tout = tmp_path / "o.ckpt", tmp_path / "o.out"
    with open(tout, "w") as f:
        o = subprocess.Popen([sys.executable, str(jobs.script("site_train.py")), str(ckpt), "rl_ppo_atari", "8"],
                             stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(tout, "step 10 ", o)
        o.send_signal(signal.SIGTERM)
        assert o.wait(60) == 143 and ckpt.exists()
    finally:
        o.kill()
    preempted = int(tout.read_text().split("PREEMPTED at step ", 1)[1].split(":")[0])
    with open(tout, "a") as f:
        o = subprocess.Popen([sys.executable, str(jobs.script("site_train.py")), str(ckpt), "rl_ppo_atari", "8",
                              str(tmp_path / "stop")], stdout=f, stderr=subprocess.STDOUT,
                             env={**env, "SLURM_RESTART_COUNT": "1"})
    try:
        text = _wait_for(tout, f"START step={preempted} restarts=1", o)
        (tmp_path / "stop").write_text("")
        assert o.wait(60) == 0 and "DONE step=" in tout.read_text()
    finally:
        o.kill()
    assert preempted > 0 and "model=rl_ppo_atari" in text
