"""What the adapter hands out: jobs and nodes as plain dataclasses, whatever backend produced them."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from ..jobtag import JobTag
from .tag import AntmanTag, read_admin_comment

# Slurm's base job states (job_state_string). Anything else a backend sees is kept as-is, upper case.
TERMINAL_STATES = frozenset({
    "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
    "OUT_OF_MEMORY",
})
ACTIVE_STATES = frozenset({
    "PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD",
    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT",
})

ANTMAN_CLASSES = ("guaranteed", "opportunistic", "none")

# What `scontrol update StartTime=` gets to lift the ~121 s BeginTime wait of a requeued job. Not
# "now": slurmd treats a job credential created in the same second as the revocation it made when the
# job was requeued as revoked ("Killing non-startable batch JobId=N: Job credential revoked"), and
# slurmctld then ends the job (exit 1) instead of requeueing it: seen on Slurm 22.05 when the job was
# started again on the same node within that second. Two seconds puts the new credential past it.
REQUEUED_START_TIME = "now+2"


# The Reason of a pending job with Priority=0: an admin's hold, which the coordinator's quota hold is.
HELD_BY_ADMIN = "JobHeldAdmin"


def array_ref(job_id: int, array_job_id: Optional[int], array_task: Optional[str]) -> str:
    """``A_T`` for an array task, ``A_[2-5]`` for an array's pending rest, the raw id otherwise."""
    if not array_job_id or array_task is None:
        return str(job_id)
    return f"{array_job_id}_{array_task}" if array_task.isdigit() else f"{array_job_id}_[{array_task}]"


@dataclass
class Job:
    job_id: int
    name: str
    user: str
    account: str
    partition: str
    state: str
    reason: str
    nodelist: str
    nodes: list[str]
    restarts: int
    admin_comment: str
    comment: str
    antman_class: str
    # Physical GPU indices per node: Slurm's GRES for guaranteed/none jobs, the Prolog's choice
    # (AdminComment gpus=) for opportunistic jobs, whose GRES is count-only and has no indices.
    gpus_by_node: dict[str, list[int]]
    tres_per_node: str
    submit_time: Optional[datetime]
    start_time: Optional[datetime]
    excluded_nodes: list[str] = field(default_factory=list)  # ExcNodeList, expanded
    raw: dict = field(default_factory=dict, repr=False)
    # A job array's task: its array's id and its index ("3"); the array's record of tasks not started
    # yet carries their range ("2-5"). job_id stays the raw id (SLURM_JOB_ID, what nodes and agents know).
    array_job_id: Optional[int] = None
    array_task: Optional[str] = None

    # The parser's reading of admin_comment (which also gave antman_class); read on first use when absent.
    tag_reading: Optional[AntmanTag] = field(default=None, repr=False, compare=False)

    @property
    def _tag_reading(self) -> AntmanTag:
        if self.tag_reading is None:
            self.tag_reading = read_admin_comment(self.admin_comment)
        return self.tag_reading

    @property
    def tag(self) -> Optional[JobTag]:
        """The slurm-antman tag in AdminComment; None when the job has none or it is damaged."""
        return self._tag_reading.tag

    @property
    def tag_problem(self) -> Optional[str]:
        """Why a tag present in AdminComment could not be read; None when it could, or there is none."""
        return self._tag_reading.problem

    def checked_tag(self) -> Optional[JobTag]:
        """The tag, None when there is none; jobtag's TagError when it is damaged (for whoever would
        act on the tag, and must not act on a guess)."""
        return self._tag_reading.checked()

    @property
    def slurm_id(self) -> str:
        """The id to act on this job alone. An array task's raw id may be its array's own id, and
        ``scontrol requeue|update|hold ARRAY_ID`` acts on every task: ``ARRAY_TASK`` acts on one."""
        return array_ref(self.job_id, self.array_job_id, self.array_task)

    @property
    def display_id(self) -> str:
        """What squeue shows: ``ARRAY_TASK`` for an array task, the raw id otherwise."""
        if self.array_job_id and self.array_task is not None:
            task = self.array_task if self.array_task.isdigit() else f"[{self.array_task}]"
            return f"{self.array_job_id}_{task}"
        return str(self.job_id)

    @property
    def gpus(self) -> list[int]:
        """Indices on all nodes, in node order (the per-node mapping is in ``gpus_by_node``)."""
        return [i for n in self.nodes for i in self.gpus_by_node.get(n, [])] or \
            [i for idx in self.gpus_by_node.values() for i in idx]

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_json(self) -> dict:
        return {
            "job_id": self.job_id, "name": self.name, "user": self.user, "account": self.account,
            "partition": self.partition, "state": self.state, "reason": self.reason,
            "nodelist": self.nodelist, "nodes": self.nodes, "restarts": self.restarts,
            "admin_comment": self.admin_comment, "class": self.antman_class,
            "gpus_by_node": self.gpus_by_node, "tres_per_node": self.tres_per_node,
            "submit_time": self.submit_time.isoformat() if self.submit_time else None,
            "array_job_id": self.array_job_id, "array_task": self.array_task, "display_id": self.display_id,
            "start_time": self.start_time.isoformat() if self.start_time else None,
        }


@dataclass
class Node:
    name: str
    state: str                      # base state, upper case: IDLE, MIXED, ALLOCATED, DOWN...
    state_flags: list[str]          # DRAIN, NOT_RESPONDING, ...
    gres: dict[str, int]            # configured: {"gpu": 4, "antman_opp": 8}
    gres_used: dict[str, int]
    partitions: list[str]
    cpus: int
    alloc_cpus: int
    real_memory_mb: int
    reason: str
    raw: dict = field(default_factory=dict, repr=False)

    def to_json(self) -> dict:
        return {
            "name": self.name, "state": self.state, "state_flags": self.state_flags, "gres": self.gres,
            "gres_used": self.gres_used, "partitions": self.partitions, "cpus": self.cpus,
            "alloc_cpus": self.alloc_cpus, "real_memory_mb": self.real_memory_mb, "reason": self.reason,
        }


@dataclass(frozen=True)
class Association:
    """One row of ``sacctmgr show associations``: an account's own limits when ``user`` is empty."""

    cluster: str
    account: str
    user: str
    parent: str
    grp_tres: dict[str, str]  # "gres/gpu" -> "4", as Slurm printed it (a value is parsed by its reader)
