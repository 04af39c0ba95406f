"""Slot filling on the devcluster (docs/protocol.md, "The idle-slot page"), end to end: a real
Slurm 22.05 with device cgroups, the real sidecar with ``sidecar.slot_filling: true``, the SPANK plugin
and job_submit.lua, and two emulated training jobs (``emulated_job --contend``) submitted as the
cluster's unprivileged user onto the one GPU of a one-node cluster, each under the real agent, which
sees every "kernel launch" as a module call.

The guaranteed job (rl_ppo_atari: 15 % of its mini-batch on the GPU, the rest input stalls) starts
first; the opportunistic one (resnet50: all GPU) lands beside it on the same GPU. Asserted:

- while both run, the sidecar has made ``SOCKET_DIR/node1/slots/gpu0.slots``: owned by the guaranteed
  job's uid, mode 0640 with its ACL (owner rw, nobody else but the GPU's opportunistic users), a page
  the owner reads (the probe can succeed) and an unrelated uid cannot open (it can still stat it:
  the file's permission refuses it, not the way there);
- the guaranteed job's agent opened the page as its publisher and published busy periods; the
  opportunistic job's agent opened it as a filler, launched through its gate, and waited for slots;
- when the guaranteed job has ended (COMPLETED), the page is gone while the opportunistic job still
  runs, and the sidecar told its agent so: its gate was closed before it ended;
- both jobs COMPLETED, on the same node and GPU.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_antman.clients import sidecar_control as client
from slurm_antman.lab.devcluster.files import sidecar_socket_dir
from slurm_antman.lab.devcluster.jobs import JobsError, wait_for
from slurm_antman.protocol import slot_page
from slurm_antman.sidecar import slot_pages as sp
from conftest import TEST_PORT_BASE, ClusterHandle, managed_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PORT_BASE = TEST_PORT_BASE + 1900
NODE = "node1"
UNRELATED = 4242  # a uid no job here runs as (no passwd entry needed)
SYSTEM_PY = "/usr/bin/python3"
WINDOW_S = 4.0                # opportunistic.utilization_window_s (10 s by default): how long the sidecar
                              # measures the guaranteed job before it lets an opportunistic one beside it
GUARANTEED_WORK_S = 20.0      # rl_ppo_atari: ~143 mini-batches of 139 ms, 21 ms of each on the GPU
OPPORTUNISTIC_WORK_S = 12.0   # resnet50: outlives the guaranteed job, so the page's end is seen while it runs

PROBE = r"""
import os, sys
path = sys.argv[1]
os.stat(path)  # the way there is open to everyone: a denial below is the file's own permission
try:
    with open(path, "rb") as f:
        print(f.read(8).hex())
except PermissionError:
    print("denied")
"""


@pytest.fixture(scope="module")
def slots_cluster(tmp_path_factory):
    # One node with one GPU: the opportunistic job can only land beside the guaranteed one. No
    # coordinator, no accounting: slot filling is the node's own business.
    with managed_cluster(tmp_path_factory.mktemp("slots-cluster"), tmp_path_factory.mktemp("slots-jobs"),
                         nodes=1, gpus=1, cpus=4, port_base=PORT_BASE, accounting=False, coordinator=False,
                         # The emulated GPU's own fill efficiency (antman bench interleave), as a site
                         # sets what its GPUs measured.
                         overrides={"sidecar": {"slot_filling": True, "slot_fill_efficiency": 0.69},
                                    "opportunistic": {"utilization_window_s": WINDOW_S}}) as c:
        yield c


def _wait(pred, timeout: float, what: str, why=lambda: "", step: float = 0.2):
    """The devcluster's wait_for, and what the cluster said when it ran out (``why``)."""
    try:
        return wait_for(pred, timeout, what, step)
    except JobsError as e:
        raise AssertionError(f"{e}\n{why()}") from None


def _probe(uid: int, gid: int, path: Path) -> str:
    r = subprocess.run([SYSTEM_PY, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=30, cwd="/",
                       user=uid, group=gid, extra_groups=[])
    assert r.returncode == 0, f"probe as uid {uid}: {r.stderr}"
    return r.stdout.strip()


def _records(state: Path, job_id: int) -> list[dict]:
    """The job's run records; the directory is the job user's, so root opens no link there."""
    try:
        fd = os.open(state / f"{job_id}.runs.jsonl", os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    with os.fdopen(fd) as f:
        return [json.loads(line) for line in f.read().splitlines()]


def _job_script(profile: str, work_s: float, state: Path, board: Path) -> str:
    return (f"#!/bin/bash\nexec {sys.executable} -m slurm_antman.lab.evaluation.emulated_job --profile {profile} "
            f"--work-s {work_s} --state-dir {state} --board-dir {board} --contend\n")


def test_an_opportunistic_job_fills_the_guaranteed_jobs_idle_slots_through_the_page(slots_cluster: ClusterHandle,
                                                                                     tmp_path):
    c = slots_cluster
    t0 = time.monotonic()
    state, board = tmp_path / "state", tmp_path / "board"
    dev = pwd.getpwnam(c.c.user)
    page = sidecar_socket_dir(PORT_BASE) / NODE / sp.SLOTS_DIR / "gpu0.slots"
    sidecar_log = c.c.dir / "log" / f"sidecar-{NODE}.log"

    def diagnose() -> str:
        side = sidecar_log.read_text(errors="replace") if sidecar_log.exists() else "(no sidecar log)"
        return (f"sidecar:\n{side[-3000:]}\nguaranteed job:\n{c.output(gj)[-2000:]}\n"
                f"opportunistic job:\n{c.output(oj)[-2000:] if oj else ''}")

    oj = None
    gj = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", NODE,
                  script=_job_script("rl_ppo_atari", GUARANTEED_WORK_S, state, board))
    c.wait_state(gj, {"RUNNING"}, timeout=60)
    # An opportunistic job is let beside a guaranteed one only once the sidecar has measured it (else
    # the Prolog requeues it to wait for room).
    socket_dir = sidecar_socket_dir(PORT_BASE) / NODE

    def measured() -> bool:
        st = client.node_state(str(socket_dir), timeout_s=2.0)
        return any(j.job_id == str(gj) for j in st.jobs) and all(g.util_measured for g in st.gpus)

    _wait(measured, 60, "the guaranteed job's utilisation measured", diagnose, step=0.5)
    oj = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", NODE,
                  script=_job_script("resnet50", OPPORTUNISTIC_WORK_S, state, board))
    c.wait_state(oj, {"RUNNING"}, timeout=60)

    # While both run: the page, as the sidecar made it.
    # (Root looks at the page without following links; the slots directory is root's anyway.)
    _wait(lambda: os.path.lexists(page), 60, f"the idle-slot page {page}", diagnose)
    st = os.stat(page, follow_symlinks=False)
    both_running = [c.show(j)["JobState"] for j in (gj, oj)]
    assert both_running == ["RUNNING", "RUNNING"], diagnose()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == dev.pw_uid, (st, diagnose())
    assert stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)  # the ACL's mask (r) in the group bits, other none
    acl = os.getxattr(page, sp.ACL_XATTR, follow_symlinks=False)
    # The opportunistic job runs as the guaranteed job's user, so no USER entry: the owner reads and writes.
    assert acl == sp.page_acl([]), acl.hex()
    magic = slot_page.MAGIC.to_bytes(8, "little").hex()
    assert _probe(dev.pw_uid, dev.pw_gid, page) == magic  # the probe can read where the ACL lets it
    assert _probe(UNRELATED, UNRELATED, page) == "denied"
    assert re.search(r"GPU 0: idle-slot page %s for guaranteed job %d \(uid %d\)" % (re.escape(str(page)), gj,
                                                                                    dev.pw_uid), diagnose())

    # The guaranteed job ends by itself; the page goes with it, while the opportunistic job runs on.
    c.wait_state(gj, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=120)
    assert c.show(gj)["JobState"] == "COMPLETED", diagnose()
    _wait(lambda: not os.path.lexists(page), 30, "the page to go with the guaranteed job", diagnose)
    assert c.show(oj)["JobState"] == "RUNNING", diagnose()
    assert re.search(r"GPU 0: idle-slot page of job %d removed" % gj, diagnose())

    c.wait_state(oj, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=120)
    assert c.show(oj)["JobState"] == "COMPLETED", diagnose()
    took = time.monotonic() - t0

    (g,), (o,) = _records(state, gj), _records(state, oj)
    assert g["completed"] and o["completed"] and g["contend"] and o["contend"]
    assert (g["class"], o["class"]) == ("guaranteed", "opportunistic")
    assert (g["node"], g["gpus"]) == (o["node"], o["gpus"]) == (NODE, [0])  # one emulated GPU, both contending
    gs, fs = g["slots"], o["slots"]
    print(f"\nslot filling on the devcluster ({took:.0f} s for both jobs): guaranteed {gs}, slowdown "
          f"{g['mean_slowdown']:.3f}; opportunistic {fs}, slowdown {o['mean_slowdown']:.3f}")
    # The guaranteed job's agent published on the one page it was given, busy periods and all.
    assert gs["role"] == "publish" and gs["pages"] == 1 and gs["paths"] == [str(page)] and gs["periods"] > 0, gs
    # (its page was still there as it ended: the opportunistic job ran on)
    assert gs["launches"] == 0 and gs["open_at_end"] == "publish", gs
    # The opportunistic job's agent filled from it: launches through the gate, which waited for slots,
    # and most of them decided by the page (not blind, not forced after the longest wait).
    assert fs["role"] == "fill" and fs["pages"] == 1 and fs["paths"] == [str(page)] and fs["periods"] == 0, fs
    # A gate that never held a launch back spends microseconds per launch (a page read); this one waited
    # for the guaranteed job's bursts to drain.
    assert fs["launches"] > 0 and fs["waited_s"] > 0.002 * fs["launches"], fs
    assert fs["launches"] > 2 * (fs["blind"] + fs["forced"]), fs
    # Told that the page went away with the guaranteed job, it stopped filling before it ended.
    assert fs["open_at_end"] is None, fs
