"""Checkpoints for the tasks of an elastic array around a change of its members (docs/elastic.md,
"Across nodes: a job array").

Every membership change of the array's training restarts all its workers from the latest checkpoint:
a task that leaves (its requeue: a shed, a move, the whole array with its rendezvous host) and a task
that joins (Slurm starting it: a grow). Rank 0, the rank that saves, may be on any task: torchrun's
rendezvous hands out the ranks. So every running task is asked to checkpoint:

- for a leaving task, at its requeue: ``at_s`` is the notice's grace, and each agent takes the
  checkpoint two iterations ahead of that moment (``torch_patch.checkpoint``). The coordinator
  requeues no earlier than the deadline, so the checkpoint comes before the restart, and what is
  trained again is those iterations plus the requeue's own lag. The leaving task's preemption hook
  runs too, at the notice, as for any job: without this a restart went back to that one, a whole grace
  time earlier, when rank 0 was on the leaving task, or else to the last periodic checkpoint;
- for a joining task, at once: its launcher takes seconds to import torch and meet the others
  (docs/elastic.md: 5.4-7.2 s to the first step on the devcluster), and the running tasks' workers
  restart only then. The notice races that and usually wins; when it loses, the restart falls back to
  the last checkpoint, as without it.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from .decisions import CheckpointNotice, Decision
from .model import JobView

# A task that started at most this long ago counts as joining: the cycles that may pass before the
# coordinator sees it running (1 s each by default) with margin, well under the launcher's start.
JOIN_WINDOW_S = 10.0


def _running(jobs: Iterable[JobView], group: str) -> list[JobView]:
    return sorted((j for j in jobs if j.elastic_group == group and j.state == "RUNNING" and j.node is not None),
                  key=lambda j: j.job_id)


def for_leaving(decisions: Iterable[Decision], jobs: Mapping[str, JobView]) -> list[CheckpointNotice]:
    """One notice per running task of each array a ``preempt_notice`` in ``decisions`` takes a task from,
    the leaving ones included (rank 0 may be on one of them), for the earliest of those requeues."""
    grace: dict[str, tuple[float, str]] = {}
    for d in decisions:
        j = jobs.get(d.job_id) if d.kind == "preempt_notice" else None  # type: ignore[attr-defined]
        if j is not None and j.elastic_group:
            at = float(d.grace_s)  # type: ignore[attr-defined]
            if j.elastic_group not in grace or at < grace[j.elastic_group][0]:
                grace[j.elastic_group] = (at, j.job_id)
    out = []
    for group, (at, task) in sorted(grace.items()):
        for s in _running(jobs.values(), group):
            out.append(CheckpointNotice(
                s.job_id, s.node or "", at, cause=f"leave:{task}",
                reason=f"task {task} of elastic array {group} is requeued in {at:g} s; the workers restart "
                       "without it, from this checkpoint",
                inputs={"group": group, "leaving": task, "at_s": at}))
    return out


def for_joining(now: float, jobs: Mapping[str, JobView], leaving: frozenset[str] | set[str]) -> list[CheckpointNotice]:
    """One notice per running task of an array that another task joined in the last ``JOIN_WINDOW_S``,
    to the tasks that started before it. Repeated every cycle of the window: the core's reissue rule
    sends each once (its cause names the joining task's start)."""
    out = []
    joined = [j for j in jobs.values() if j.elastic_group and j.state == "RUNNING" and j.start_unix is not None
              and 0.0 <= now - j.start_unix <= JOIN_WINDOW_S]
    for j in sorted(joined, key=lambda j: j.job_id):
        for s in _running(jobs.values(), j.elastic_group):
            if s is j or s.job_id in leaving or s.start_unix is None or s.start_unix >= j.start_unix:
                continue
            out.append(CheckpointNotice(
                s.job_id, s.node or "", 0.0, cause=f"join:{j.job_id}:{j.restarts}",
                reason=f"task {j.job_id} of elastic array {j.elastic_group} started; the workers restart to "
                       "admit it, from this checkpoint",
                inputs={"group": j.elastic_group, "joining": j.job_id, "joined_unix": j.start_unix}))
    return out
