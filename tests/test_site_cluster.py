"""What every real GPU site has, on the devcluster: device cgroups (ConstrainDevices=yes), job arrays
and job steps with GPUs.

The emulated GPUs are ``c 195 N`` device nodes without a driver: a job's ``open()`` of a GPU its
devices cgroup allows fails with ENXIO, of one it denies with EPERM, so each job reports exactly
which GPUs Slurm (or, for an opportunistic job, slurm-antman) let it use.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from slurm_antman.jobtag import parse_tag
from slurm_antman.lab.devcluster.processes import unified_cgroup_host
from slurm_antman.slurm import CliBackend, JobNotFound

pytestmark = pytest.mark.cluster

GPUS_PER_NODE = 4
REPO = Path(__file__).resolve().parent.parent

# One line per process: what it may open, and what it was told.
PROBE = """python3 - <<'EOF'
import errno, os
seen = []
for i in range({n}):
    try:
        os.close(os.open("{dev}/nvidia%d" % i, os.O_RDWR))
        seen.append("open")
    except OSError as e:
        seen.append({{errno.ENXIO: "allowed", errno.EPERM: "denied"}}.get(e.errno, errno.errorcode.get(e.errno, "?")))
env = os.environ
print("{tag}", "job=%s" % env.get("SLURM_JOB_ID", ""), "task=%s" % env.get("SLURM_ARRAY_TASK_ID", "-"),
      "step=%s" % env.get("SLURM_STEP_ID", "-"), "restart=%s" % env.get("SLURM_RESTART_COUNT", "0"),
      "class=%s" % env.get("ANTMAN_CLASS", ""), "gpus=%s" % env.get("ANTMAN_GPUS", ""),
      "cvd=%s" % env.get("CUDA_VISIBLE_DEVICES", ""), "ep=%s" % ("yes" if env.get("ANTMAN_SIDECAR_ENDPOINT") else "no"),
      "node=%s" % env.get("SLURMD_NODENAME", ""), "dev=" + ",".join(seen), flush=True)
EOF
"""


def probe(c, tag: str = "PROBE") -> str:
    return PROBE.format(n=GPUS_PER_NODE, dev=c.c.dir / "dev", tag=tag)


def lines(text: str, tag: str) -> list[dict[str, str]]:
    return [dict(kv.split("=", 1) for kv in l.split()[1:]) for l in text.splitlines() if l.startswith(tag + " ")]


def allowed(line: dict[str, str]) -> list[int]:
    return [i for i, s in enumerate(line["dev"].split(",")) if s == "allowed"]


def gpus(line: dict[str, str]) -> list[int]:
    return [int(g) for g in line["gpus"].split(",") if g]


def test_each_class_opens_exactly_its_own_gpus(clean_cluster):
    c = clean_cluster
    script = "#!/bin/bash\n" + probe(c) + "sleep 20\n"
    g = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1", script=script)
    o1 = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", script=script)
    o2 = c.sbatch("--antman=opportunistic", "--gres=gpu:2", "-w", "node1", script=script)
    plain = c.sbatch("-w", "node1", script=script)
    seen = {j: lines(c.wait_output(j, r"^PROBE ", timeout=60), "PROBE")[0] for j in (g, o1, o2, plain)}
    # Guaranteed: the GPU Slurm bound; opportunistic: the GPU(s) its sidecar chose, and nothing else.
    for j, n in ((g, 1), (o1, 1), (o2, 2)):
        s = seen[j]
        assert len(gpus(s)) == n and allowed(s) == sorted(gpus(s)), s
        assert s["cvd"] == ",".join(map(str, range(n))), s  # CUDA numbers what the job can open from 0
    assert seen[g]["class"] == "guaranteed" and seen[o1]["class"] == seen[o2]["class"] == "opportunistic"
    # A job without a GPU opens none, and the device rules of one job do not leak to another.
    assert allowed(seen[plain]) == [] and seen[plain]["dev"].count("denied") == GPUS_PER_NODE, seen[plain]


def test_requeued_opportunistic_job_opens_only_its_new_gpu(clean_cluster):
    c = clean_cluster
    script = "#!/bin/bash\n" + probe(c) + "sleep 60\n"
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "--open-mode=append", script=script)
    first = lines(c.wait_output(jid, r"^PROBE .*restart=0", timeout=60), "PROBE")[0]
    assert allowed(first) == gpus(first), first
    c.run(["scontrol", "requeue", str(jid)], check=True)
    # Slurm holds a requeued job back ~120 s (BeginTime); an admin's StartTime=now lets it go at once.
    text = ""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "restart=1" not in text:
        c.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"])
        time.sleep(1)
        text = c.output(jid)
    again = [l for l in lines(text, "PROBE") if l["restart"] == "1"]
    assert again, text
    assert allowed(again[0]) == gpus(again[0]) and len(gpus(again[0])) == 1, again[0]
    # Slurm's record shows where it runs now, not also where it ran before the requeue.
    tag = parse_tag(CliBackend(env=c.env).job(jid).admin_comment)
    assert tag is not None and tag.gpus == {again[0]["node"]: gpus(again[0])}, tag


ARRAY_TASK = """#!/bin/bash
{probe}
sleep 3
"""


# Every class in CI; make test keeps one of each kind (its 15 minutes), make test-slow has the rest.
CLASSES = ["opportunistic", pytest.param("guaranteed", marks=pytest.mark.slow), pytest.param("auto", marks=pytest.mark.slow)]


@pytest.mark.parametrize("job_class", CLASSES)
def test_array_every_task_runs_once_managed_on_its_own_placement(clean_cluster, job_class):
    c = clean_cluster
    out = c.workdir / f"array-{job_class}-%A_%a.out"
    r = c.run_as_user(["sbatch", "--parsable", f"--antman={job_class}", "--gres=gpu:1", "--array=0-7%4", "-D", str(c.workdir),
               "-o", str(out), "--open-mode=append", "--wrap", ARRAY_TASK.replace("{probe}", probe(c, "TASK"))])
    assert r.returncode == 0, r.stderr
    array_id = int(r.stdout.strip().split(";")[0])
    b = CliBackend(env=c.env)

    def tasks() -> dict:
        # Each task by ARRAY_TASK: 24.11's squeue --json no longer lists finished jobs, scontrol does.
        out = {}
        for t in range(8):
            try:
                j = b.job(f"{array_id}_{t}")
            except JobNotFound:
                continue
            out[j.array_task] = j
        return out

    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        mine = tasks()
        if len(mine) == 8 and all(j.finished for j in mine.values()):
            break
        time.sleep(1)
    mine = tasks()
    assert sorted(mine, key=int) == [str(t) for t in range(8)], sorted(mine)
    assert {j.state for j in mine.values()} == {"COMPLETED"}, {t: (j.state, j.reason) for t, j in mine.items()}
    assert {j.restarts for j in mine.values()} == {0}, "a task was requeued"
    assert {j.user for j in mine.values()} == {c.c.user}  # an ordinary user's array, not root's
    for t in range(8):
        runs = lines((c.workdir / f"array-{job_class}-{array_id}_{t}.out").read_text(), "TASK")
        assert len(runs) == 1, (t, runs)  # ran once
        s = runs[0]
        assert s["task"] == str(t) and s["restart"] == "0"
        # Managed: it has its class, its placement and its sidecar endpoint, and can open that GPU only.
        assert s["class"] in ("guaranteed", "opportunistic") and s["ep"] == "yes", s
        if job_class != "auto":
            assert s["class"] == job_class, s
        assert len(gpus(s)) == 1 and allowed(s) == gpus(s), s
        # The Prolog recorded this task's GPU on this task alone (not on the array's other tasks).
        tag = parse_tag(mine[str(t)].admin_comment)
        assert tag is not None and tag.gpus == {s["node"]: gpus(s)}, (mine[str(t)].admin_comment, s)
    log = (c.c.dir / "antman-state" / "hooks.log").read_text()
    assert "left to plain Slurm" not in log and "expected one line" not in log


def test_requeue_of_the_task_that_carries_the_array_id_touches_that_task_only(clean_cluster):
    """An array task's raw id may be its array's own id, and ``scontrol requeue ARRAY_ID`` requeues every
    task: the adapter acts on ``ARRAY_TASK``."""
    c = clean_cluster
    r = c.run_as_user(["sbatch", "--parsable", "--antman=opportunistic", "--gres=gpu:1", "--array=0-3", "-D", str(c.workdir),
               "-o", str(c.workdir / "req-%A_%a.out"), "--wrap", "sleep 120"])
    assert r.returncode == 0, r.stderr
    array_id = int(r.stdout.strip().split(";")[0])
    b = CliBackend(env=c.env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tasks = [j for j in b.jobs() if j.array_job_id == array_id]
        if len(tasks) == 4 and all(j.state == "RUNNING" for j in tasks):
            break
        time.sleep(0.5)
    carrier = next(j for j in tasks if j.job_id == array_id)
    assert carrier.slurm_id == f"{array_id}_{carrier.array_task}"
    b.requeue(carrier.slurm_id)
    time.sleep(2)
    after = {j.array_task: j for j in b.jobs() if j.array_job_id == array_id}
    assert after[carrier.array_task].restarts == 1
    assert all(j.restarts == 0 and j.state == "RUNNING" for t, j in after.items() if t != carrier.array_task), after
    assert b.job(carrier.slurm_id).job_id == array_id  # the task's record, not the first line printed
    # antman squeue and antman explain take the task as squeue shows it.
    other = next(j for j in tasks if j.job_id != array_id)
    r = c.run_as_user([sys.executable, "-m", "slurm_antman.cli", "squeue", "--json", "-j", other.display_id],
                      env=dict(c.env, PYTHONPATH=str(REPO)), cwd=c.workdir)
    assert r.returncode == 0, r.stderr
    assert [row["display_id"] for row in json.loads(r.stdout)] == [other.display_id]
    r = c.run([sys.executable, "-m", "slurm_antman.cli", "explain", other.display_id], env=dict(c.env, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and f"job {other.display_id} (raw id {other.job_id})" in r.stdout, (r.stdout, r.stderr)
    assert "placed on" in r.stdout


def test_explain_of_a_job_that_does_not_exist_says_so(clean_cluster):
    c = clean_cluster
    for job in ("99999", "99999_3"):
        r = c.run([sys.executable, "-m", "slurm_antman.cli", "explain", job], env=dict(c.env, PYTHONPATH=str(REPO)))
        assert r.returncode == 1 and r.stderr.strip() == f"job {job} does not exist (neither slurmctld nor " \
            "accounting knows it)", r.stderr
        assert "Traceback" not in r.stderr


STEPS = """#!/bin/bash
set -u
srun -n1 --gres=gpu:1 {probe_a}
srun -n1 --gpus=1 {probe_b}
srun -n2 --gpus-per-task=1 {probe_c}
srun -n1 --gpus-per-node=2 {probe_d}
# Two steps at once, each with one of the job's two GPUs' worth of slots.
srun -n1 --gres=gpu:1 --exact {probe_e} & srun -n1 --gres=gpu:1 --exact {probe_e} & wait
echo STEPS-DONE
"""


@pytest.mark.parametrize("job_class", CLASSES)
def test_srun_steps_with_gpus_in_a_batch_job(clean_cluster, job_class):
    c = clean_cluster
    steps = {k: f"bash {probe_file(c, 'STEP' + k.upper())}" for k in "abcde"}
    script = STEPS.format(**{f"probe_{k}": v for k, v in steps.items()})
    jid = c.sbatch(f"--antman={job_class}", "--gres=gpu:2", "-n2", "-w", "node2", script=script)
    text = c.wait_output(jid, r"^STEPS-DONE", timeout=90)
    assert "error" not in text.lower(), text
    seen = {k: lines(text, "STEP" + k.upper()) for k in "abcde"}
    assert [len(seen[k]) for k in "abcde"] == [1, 1, 2, 1, 2], text
    # The job has ended: its GPUs are in the tag its Prolog wrote (Slurm's GRES detail is gone).
    placed = parse_tag(CliBackend(env=c.env).job(jid).admin_comment).gpus["node2"]
    assert len(placed) == 2
    for k, runs in seen.items():
        for s in runs:
            # Every step's processes belong to the job: its class, its sidecar, its GPUs, no other GPU.
            assert s["job"] == str(jid) and s["ep"] == "yes", (k, s)
            assert set(allowed(s)) <= set(placed) and allowed(s), (k, s, placed)
            if job_class == "opportunistic":
                assert allowed(s) == placed and sorted(gpus(s)) == placed, (k, s, placed)


def probe_file(c, tag: str):
    path = c.workdir / f"probe-{tag}.sh"
    path.write_text("#!/bin/bash\n" + probe(c, tag))
    return path


# Probes the GPUs over and over, each round one line: when, and what it could open. Written to a file of the
# process's own (step id and pid in its name), so that lines of processes running at once never mix.
PROBE_LOOP = """python3 - <<'EOF'
import errno, os, time
env = os.environ
# The batch step: no SLURM_STEP_ID up to 25.11, SLURM_BATCH_SCRIPT (-5) from 26.05.
step = {{None: "batch", "-5": "batch"}}.get(env.get("SLURM_STEP_ID"), env.get("SLURM_STEP_ID"))
out = open("{out}/conc-%s-%s-%d.log" % (env["SLURM_JOB_ID"], step, os.getpid()), "w")
for k in range({rounds}):
    seen = []
    for i in range({n}):
        try:
            os.close(os.open("{dev}/nvidia%d" % i, os.O_RDWR))
            seen.append("open")
        except OSError as e:
            seen.append({{errno.ENXIO: "allowed", errno.EPERM: "denied"}}.get(e.errno, errno.errorcode.get(e.errno, "?")))
    print("CONC", "job=%s" % env.get("SLURM_JOB_ID", ""), "step=%s" % step,
          "round=%d" % k, "t=%.3f" % time.time(), "gpus=%s" % env.get("ANTMAN_GPUS", ""),
          "dev=" + ",".join(seen), file=out, flush=True)
    time.sleep({every})
EOF
"""

CONCURRENT_STEPS = """#!/bin/bash
set -u
# The batch step probes, and three steps start a second apart while it and the steps before them probe.
bash {probe} &
for i in 1 2 3; do sleep 1; srun -n1 --overlap bash {probe} & done
wait
echo CONC-DONE
"""


@pytest.mark.parametrize("job_class", ["opportunistic", pytest.param("guaranteed", marks=pytest.mark.slow)])
def test_concurrent_srun_steps_each_open_exactly_the_jobs_gpu_throughout(clean_cluster, job_class):
    """Steps of one job started while others run: under cgroup v1 each new step's slurmstepd rewrites the
    job-level device rules (a deny on the job's cgroup takes an exception away from every cgroup below it),
    under cgroup v2 it attaches the job-level program again; every round of every running step must still
    open exactly the job's GPU and no other (spank/README.md, "Devices under cgroup v2" and "cgroup v1")."""
    c = clean_cluster
    rounds, every = 80, 0.1  # 8 s and more of probing per process: longer than the steps take to start
    path = c.workdir / f"conc-probe-{job_class}.sh"
    path.write_text("#!/bin/bash\n" + PROBE_LOOP.format(out=c.workdir, rounds=rounds, n=GPUS_PER_NODE,
                                                        dev=c.c.dir / "dev", every=every))
    jid = c.sbatch(f"--antman={job_class}", "--gres=gpu:1", "-n2", "-w", "node2",
                   script=CONCURRENT_STEPS.format(probe=path))
    text = c.wait_output(jid, r"^CONC-DONE", timeout=120)
    assert "error" not in text.lower(), text
    logs = sorted(c.workdir.glob(f"conc-{jid}-*.log"))
    runs = {p.name: lines(p.read_text(), "CONC") for p in logs}
    # The batch step and three srun steps, each a process of its own that probed every round.
    assert len(runs) == 4 and {len(r) for r in runs.values()} == {rounds}, {k: len(v) for k, v in runs.items()}
    steps = sorted(r[0]["step"] for r in runs.values())
    assert steps == ["0", "1", "2", "batch"], steps
    # They ran at once: some moment lies within every process's probing.
    assert max(float(r[0]["t"]) for r in runs.values()) < min(float(r[-1]["t"]) for r in runs.values()), \
        {k: (v[0]["t"], v[-1]["t"]) for k, v in runs.items()}
    placed = parse_tag(CliBackend(env=c.env).job(jid).admin_comment).gpus["node2"]
    assert len(placed) == 1
    # No round of any process opened a GPU other than the job's: each one was allowed or denied.
    leaked = [(name, s["round"], s["dev"]) for name, r in runs.items() for s in r
              if set(allowed(s)) - set(placed) or s["dev"].count("denied") + len(allowed(s)) != GPUS_PER_NODE
              or s["job"] != str(jid)]
    assert not leaked, (placed, leaked)
    if job_class == "opportunistic":
        assert all(gpus(s) == placed for r in runs.values() for s in r), runs
    lost = {(name, int(s["round"])): float(s["t"]) for name, r in runs.items() for s in r if allowed(s) != placed}
    if unified_cgroup_host():
        # cgroup v2: each task runs a program of its own; a new step's job-level program does not reach it.
        assert not lost, (placed, sorted(lost))
        return
    # cgroup v1: a new step's slurmstepd denies every GPU the job holds no GRES for at the job's cgroup, which
    # takes the exception away from every running task, before the plugin's grant in that step's
    # task_post_fork puts it back in every cgroup of the job. A running task's open() in between is refused:
    # measured on Slurm 22.05, every running task loses its GPU for 5-16 ms at each step start, 60-110 ms
    # before the new step's first round. The window is Slurm's: it writes the job's rules before it forks the
    # new step's tasks, and the plugin grants from that step's task_post_fork. So here a lost round must lie
    # within the second before a later process's first round, and never three rounds in a row: the grant
    # comes back at once, not at some later step's start.
    firsts = [float(r[0]["t"]) for r in runs.values()]
    late = sorted(k + (t,) for k, t in lost.items() if not any(0 <= f - t <= 1.0 for f in firsts))
    assert not late, (placed, late, sorted(firsts))
    long = sorted(k for k in lost if (k[0], k[1] - 1) in lost and (k[0], k[1] - 2) in lost)
    assert not long, (placed, long)


def test_srun_with_antman_makes_its_own_allocation(clean_cluster):
    c = clean_cluster
    r = c.run_as_user(["srun", "--antman=opportunistic", "--gres=gpu:1", "-w", "node1", "bash", "-c",
                       probe(c, "DIRECT")], timeout=90, cwd=c.workdir)
    assert r.returncode == 0, r.stderr
    s = lines(r.stdout, "DIRECT")[0]
    assert s["class"] == "opportunistic" and len(gpus(s)) == 1 and allowed(s) == gpus(s), s
    # auto is decided at submission, after srun has asked for its step: refused with the way out.
    r = c.run_as_user(["srun", "--antman=auto", "--gres=gpu:1", "true"], timeout=60, cwd=c.workdir)
    assert r.returncode != 0
    assert "srun --antman=auto with GPUs outside an allocation" in r.stderr and "salloc or sbatch" in r.stderr


def test_requests_no_node_can_hold_are_refused_at_submission(clean_cluster):
    """An opportunistic job larger than any node was accepted (the opportunistic GRES has slots_per_gpu x
    GPUs per node) and requeued forever; a heterogeneous job has no slurm-antman meaning. Both are refused
    at submission with one line that says why."""
    c = clean_cluster
    r = c.sbatch("--antman=opportunistic", f"--gres=gpu:{GPUS_PER_NODE + 1}", wrap="true", expect_ok=False)
    assert r.returncode != 0
    assert f"at most {GPUS_PER_NODE} GPUs per node" in r.stderr and f"gpu:{GPUS_PER_NODE + 1}" in r.stderr, r.stderr
    for cls in ("opportunistic", "guaranteed", "auto"):
        r = c.sbatch(f"--antman={cls}", "--gres=gpu:1", "-n1", ":", "-n1", wrap="true", expect_ok=False)
        assert r.returncode != 0 and "heterogeneous jobs are not supported" in r.stderr, (cls, r.stderr)
    r = c.run(["squeue", "-h", "-o", "%i"])
    assert r.stdout.strip() == "", "a refused submission left a job behind"


def test_auto_burst_never_admits_more_guaranteed_gpus_than_the_quota(clean_cluster):
    """Six `--antman=auto` submissions at once, faster than the coordinator's cycle, against a quota of
    4 GPUs (the devcluster tenant's): job_submit.lua counts what it admitted since the quota file's
    snapshot, so exactly 4 are guaranteed."""
    import concurrent.futures

    c = clean_cluster
    time.sleep(7)  # admissions of earlier tests fall out of job_submit.lua's window (5 s margin)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = list(pool.map(lambda _: c.sbatch("--antman=auto", "--gres=gpu:1", "-A", "research", wrap="sleep 60"),
                             range(6)))
    b = CliBackend(env=c.env)
    classes = sorted(b.job(j).antman_class for j in jobs)
    assert classes == ["guaranteed"] * 4 + ["opportunistic"] * 2, classes
