"""What the sidecar keeps for each registered job and for each agent connection to it. The
registry (registry.py) writes a job's ``record()`` to the state directory, so a restarted sidecar
rebinds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import zmq

from slurm_antman import protocol as p
from slurm_antman.policy.node.core import UNLIMITED, JobLimits, PreemptRequest


@dataclass
class AgentConnection:
    identity: bytes
    reg: p.Register
    gpu: Optional[int]
    last_seen: float
    last_sent: float
    report: Optional[p.Report] = None
    report_unix: Optional[float] = None
    acked_seq: int = 0
    # The idle-slot page this agent was last told of: (path, role, generation); None: none (slot_pages.py).
    slot_sent: Optional[tuple[str, str, int]] = None


@dataclass
class RegisteredJob:
    job_id: str
    job_class: str
    uid: int
    gid: Optional[int]
    user: str
    gpus: list[int]
    placement: str
    note: str
    registered_unix: float
    socket: Optional[zmq.Socket] = None
    agents: dict[bytes, AgentConnection] = field(default_factory=dict)
    limits: JobLimits = UNLIMITED
    seq: int = 0
    preempt: Optional[PreemptRequest] = None
    account: str = ""
    limits_sent_unix: Optional[float] = None  # when the limits of ``seq`` were sent
    first_report_unix: Optional[float] = None  # its agents' first report since this sidecar started
    # Pause in place: the pause in force (its seq), when it was sent, when its agents acked it.
    pause_seq: int = 0
    paused: bool = False
    pause_sent_mono: Optional[float] = None
    paused_unix: Optional[float] = None
    resume_sent_mono: Optional[float] = None
    # Elastic width (docs/elastic.md): the narrowest width (None: not elastic), the GPUs it was placed on (it
    # may run on any subset of them; ``gpus`` is the one it runs on now), the latest change, and the
    # GPUs it was told to give up: GPU -> (since when, the deadline to have left it).
    elastic_min: Optional[int] = None
    elastic_gpus: list[int] = field(default_factory=list)
    width_seq: int = 0
    width_sent_mono: Optional[float] = None
    shed: dict[int, tuple[float, float]] = field(default_factory=dict)
    # A task of an elastic array across nodes: the array's job id (None: none). Kept in the record, or a
    # restarted sidecar would place the array's next task on this one's GPU.
    elastic_group: Optional[str] = None
    checkpoint_seq: int = 0  # the latest `checkpoint` sent to its agents (a sibling task leaving or joining)

    def record(self) -> dict:
        return {"job_id": self.job_id, "job_class": self.job_class, "uid": self.uid, "gid": self.gid,
                "user": self.user, "gpus": self.gpus, "placement": self.placement, "note": self.note,
                "registered_unix": self.registered_unix, "account": self.account,
                "elastic_min": self.elastic_min, "elastic_gpus": self.elastic_gpus, "width_seq": self.width_seq,
                "elastic_group": self.elastic_group}


def agent_memory(a: AgentConnection, proc_mem: dict[int, int]) -> int:
    """GPU memory one agent holds: the larger of what it reports and what the driver shows for its process
    (``proc_mem``, pid -> bytes)."""
    reported = a.report.mem_reserved_bytes if a.report else 0
    return max(reported, proc_mem.get(a.reg.pid, 0))
