"""Who is on the other end of a job's socket. libzmq reads the connecting process's credentials
(SO_PEERCRED) when it accepts an IPC connection and appends ``:UID:GID:PID`` to the message property
``Peer-Address``; the kernel vouches for them, unlike anything the agent writes into ``register``.
/proc then says which Slurm job (cgroup) the process belongs to, where Slurm runs jobs in cgroups."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_JOB_IN_CGROUP = re.compile(r"/job_(\d+)(?=/|$)")


@dataclass(frozen=True)
class Peer:
    uid: int
    gid: int
    pid: int


def from_peer_address(text: Optional[str]) -> Optional[Peer]:
    """``localhost:UID:GID:PID`` (libzmq's IPC peer address); None when it carries no credentials."""
    if not text:
        return None
    parts = text.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return Peer(int(parts[1]), int(parts[2]), int(parts[3]))


def namespace_pids(pid: int, proc: str = "/proc") -> list[int]:
    """``pid`` as each PID namespace it lives in sees it, host first (``NSpid`` of its status): an agent
    in a container with its own PID namespace reports the last one as its pid."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:] if x.isdigit()]
    except OSError:
        return []
    return [pid]


def slurm_jobs_of(pid: int, proc: str = "/proc") -> Optional[set[str]]:
    """Slurm job ids in ``pid``'s cgroup paths; None when none is there (Slurm does not use cgroups here,
    or the process is gone), which says nothing either way."""
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            found = set(_JOB_IN_CGROUP.findall(f.read()))
    except OSError:
        return None
    return found or None


def check(peer: Optional[Peer], claimed_pid: int, job_id: str, job_uid: int, proc: str = "/proc") -> tuple[int, str]:
    """(the agent's pid as the host sees it, "" or why the registration is refused)."""
    if peer is None:
        return claimed_pid, ""  # no credentials (not IPC): the socket's permissions are all there is
    if peer.uid not in (job_uid, 0):
        return claimed_pid, f"the connecting process runs as uid {peer.uid}, not as the job's user ({job_uid})"
    if claimed_pid != peer.pid and claimed_pid not in namespace_pids(peer.pid, proc)[1:]:
        return claimed_pid, (f"register.pid {claimed_pid} is not the connecting process (pid {peer.pid}): an agent "
                             "registers from the process it measures")
    jobs = slurm_jobs_of(peer.pid, proc)
    if jobs is not None and job_id not in jobs:
        return peer.pid, f"the connecting process belongs to Slurm job {', '.join(sorted(jobs))}, not to job {job_id}"
    return peer.pid, ""
