"""Agents are checked against the kernel's word (SO_PEERCRED via libzmq's Peer-Address) and Slurm's
cgroups, not their own: a process may register only as itself, as the job's user, from the job."""

from __future__ import annotations

import os

import pytest

from slurm_antman.clients import sidecar_control as client
from slurm_antman.sidecar import peers
from slurm_antman import protocol as p

from test_sidecar_daemon import SimAgent, sidecar, sockdir  # noqa: F401 - fixtures


def fake_proc(tmp_path, pid: int, nspid: str = "", cgroup: str = "0::/user.slice\n"):
    d = tmp_path / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "status").write_text(f"Name:\tpython\nNSpid:\t{nspid or pid}\n")
    (d / "cgroup").write_text(cgroup)
    return str(tmp_path)


def test_peer_address_parsing():
    assert peers.from_peer_address("localhost:1000:100:4242") == peers.Peer(1000, 100, 4242)
    assert peers.from_peer_address("127.0.0.1") is None and peers.from_peer_address(None) is None


SLURM_CG = "0::/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0\n"


@pytest.mark.parametrize("peer,claimed,cgroup,nspid,want", [
    (peers.Peer(1000, 100, 500), 500, SLURM_CG, "", (500, "")),                       # the job's own process
    (peers.Peer(1000, 100, 500), 500, "0::/user.slice\n", "", (500, "")),             # no Slurm cgroups: no say
    (peers.Peer(0, 0, 500), 500, SLURM_CG, "", (500, "")),                            # root
    (peers.Peer(1001, 100, 500), 500, SLURM_CG, "", (500, "uid 1001")),               # another user
    (peers.Peer(1000, 100, 500), 501, SLURM_CG, "", (501, "not the connecting process")),  # lies about its pid
    (peers.Peer(1000, 100, 500), 7, SLURM_CG, "500\t7", (500, "")),                   # in a PID namespace
    (peers.Peer(1000, 100, 500), 500, SLURM_CG.replace("77", "78"), "", (500, "Slurm job 78, not to job 77")),
])
def test_check(tmp_path, peer, claimed, cgroup, nspid, want):
    proc = fake_proc(tmp_path, peer.pid, nspid, cgroup)
    pid, why = peers.check(peer, claimed, "77", 1000, proc)
    assert pid == want[0] and (want[1] in why if want[1] else why == "")


def test_an_agent_claiming_another_pid_is_refused_on_a_live_socket(sidecar, sockdir):  # noqa: F811
    r = client.register_job(sockdir, "300", uid=0, user="r", job_class="opportunistic", gpus=1)
    liar = SimAgent(r.endpoint, "300", pid=1)  # init's pid, not ours
    honest = SimAgent(r.endpoint, "300")
    try:
        liar.send(p.Register(job_id="300", pid=1, rank=0, local_rank=0, world_size=1, hostname="n1",
                             agent_version="sim", torch_version="none", device="cuda", job_class="opportunistic"))
        err = liar.recv("error").body
        assert err.code == "forbidden" and f"not the connecting process (pid {os.getpid()})" in err.message
        assert honest.register().body.job_id == "300"
        st = client.node_state(sockdir)
        assert next(j for j in st.jobs if j.job_id == "300").agents == 1
    finally:
        liar.close()
        honest.close()
