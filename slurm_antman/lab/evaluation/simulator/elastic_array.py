"""Elastic width across nodes, as the real path builds it: a Slurm job array (docs/elastic.md,
"Across nodes: a job array"; ``slurm_antman.policy.cluster.preemption``'s module doc;
``torch_patch.elastic_nodes``). On with ``elastic_arrays`` (``--elastic-arrays``), off by default
(docs/evaluation.md, "Elastic across nodes: a job array", says why).

- **Which jobs.** An elastic trace job (``elastic.is_elastic``: ``elastic_share`` of the multi-GPU jobs)
  that is wider than a node and that job_submit.lua makes opportunistic. Its class is resolved once, for
  its whole width, as for any job (see "Not modelled"). A guaranteed one stays a rigid multi-node job.
- **The array.** ``--antman-elastic=MIN:MAX --array=0-(K-1) --gres=gpu:G``: K tasks of G GPUs, one node's
  share each, MAX = K x G the trace job's GPUs. K is the fewest tasks, at least ceil(MAX / the node's
  GPUs), that divide MAX (16 on nodes of 8: 2 x 8; 12: 2 x 6; 20: 4 x 5). MIN is
  ``elastic_array_min_tasks`` tasks (default 1, so MIN = G, the narrowest a user may ask for, as a
  one-node elastic job's MIN is 1 GPU).
- **Start and grow.** Each task is an opportunistic job of G GPUs on one node, queued and placed like any
  other (no gang scheduling; two tasks may share a node). The node policy keeps a task off a GPU that
  holds a task of its own array (``choose_gpus(apart=...)``, as the sidecar does since c371626); only
  where no other GPU is left, without ``no_room: wait``, would two share one, and
  ``array_shared_gpu_starts`` counts those. Not modelled: the coordinator's keep-off of such a node.
  The training starts once task 0 (the array's lowest index, the rendezvous host) and at least MIN / G
  tasks run; every task that starts later is a grow. Tasks that run while the training does not (the
  host is not running, or fewer than MIN / G run) hold their GPUs and Slurm slots and wait, their
  workers not started: no load on their GPUs (duty and utilisation 0) and no progress to report, so
  they do not crawl.
- **Shed.** A task goes when the coordinator requeues it: the node policy's need for a guaranteed job on
  one of its GPUs (the victim the production coordinator picks, ``policy.cluster.preemption``) or a move
  of a crawling task (``policy.cluster.moves``). The other tasks train on at the smaller width. The
  coordinator makes the shed task eligible again ``elastic_hold_s`` after its requeue (``MakeEligible``
  with a start time: here the task is not startable until that decision comes); then Slurm starts it
  wherever there is room, as any pending opportunistic job, and the job grows back by one task. A task's
  width never changes within its node: the one-node rules (``elastic.py``) do not apply to tasks.
- **Losing the host.** The coordinator's preemption of task 0 preempts every running task of the array
  (``_group``) and makes them all eligible at once: a whole-job requeue. The coordinator never moves
  task 0 (``moves.step`` skips ``JobView.elastic_host``, since 61a1dfb). Should task 0 still be requeued
  alone (no path of the production coordinator does it now), the other tasks keep their GPUs and wait
  for it, as the launcher does (each waits for task 0's next rendezvous file); ``array_host_alone``
  counts these.
- **The end.** When the training is done, the running tasks end and the pending ones are cancelled (the
  launcher's ``scancel --state=PENDING``).

**Pace.** The job does MAX GPUs' worth of work. At width w (the training tasks' GPUs) it runs at the
slowest of its GPUs' rates, times Pollux's locality efficiency of its placement at that width (w GPUs
over the nodes its training tasks are on, ``scheduler._locality``: so it applies at every width, 1.0 when
all its tasks share one node), times S(w) / S(MAX) for its profile (as for a one-node elastic job,
``elastic.py``).

**Cost of a change.** Every change of width stops the training, for ``elastic_array_shrink_s`` when a
task is shed and ``elastic_array_grow_s`` when one starts while the job trains, and **restarts every
worker from the job's latest checkpoint**, so the work since it is done again, counted as a requeue's
lost work is (``engine._stop``), at the rate before the change. Which checkpoint:

- **a shed**: the one the coordinator's ``checkpoint_notice`` asks of every task, for the
  moment of the requeue (``policy.cluster.array_checkpoint``, applied here by ``_task_checkpoint``),
  taken ``ARRAY_CHECKPOINT_LEAD_S`` before it: that much is done again. Without the notice (none came,
  or ``checkpoint_on_notice`` is off) it is the job's last periodic one: the time since the training's
  last (re)start modulo ``checkpoint_s``;
- **a grow**: the running tasks are asked at once when the coordinator sees the task start, and its
  launcher meets them seconds later; the simulated coordinator sees the start only after the restart,
  so the race is not played out: with ``checkpoint_on_notice`` the grow redoes at most
  ``ARRAY_JOIN_REDO_S``, else the work since the last periodic checkpoint.

A whole-job requeue is a requeue: what it loses is counted as for any requeued job (since the last
periodic checkpoint, or since the notice when ``checkpoint_on_notice``).

``ARRAY_CHECKPOINT_LEAD_S`` (4 s) and ``ARRAY_JOIN_REDO_S`` (4 s) bound what the devcluster measured
(docs/elastic.md, "Measured with the checkpoint notices", 2026-11-26): the shed's checkpoint 4.0 s
before the requeue (two iterations of 2 s: the agent's lead), one step trained again; the grow's 3.7 s
before the launcher joined, one step (0.7 s) trained again. Where iterations are longer than 2 s the
lead is longer too; not modelled.

``ARRAY_SHRINK_S`` (9.3 s) and ``ARRAY_GROW_S`` (3.4 s) are the training gaps the devcluster measured
(docs/benchmarks.md, "Across nodes: an elastic job array", 2026-11-26: one run, three hosts, CPU with
gloo). A shrink waits out the lost node's heartbeat and the last call; a grow has no lost node to wait
for. The host's loss (10.7 s there to training again) is a requeue, whose restart the simulator does
not charge for any job (``start_overhead_s`` 0).

**Not modelled.** A task that waits for task 0 longer than the launcher's ``--join-timeout`` (600 s)
fails on the real path; here it waits on (``array_idle_gpu_s`` counts GPU-seconds held by tasks that do
not train, mostly such waits). A waiting task's footprint still counts in its GPUs' memory. job_submit.lua
counts a task's G GPUs against the tenant's quota when it resolves ``auto`` (``quota_gpus`` reads
``tres_per_node``), here the whole MAX. torchrun's ``--max-restarts`` (20 shrinks) is not counted.
``upgrade_running`` does not upgrade a task.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..locality_data import profile_speedup
from .state import FINISH, WAKE, SimJob

# What a width change across nodes trains again when the notices asked for a checkpoint (module doc).
ARRAY_CHECKPOINT_LEAD_S = 4.0
ARRAY_JOIN_REDO_S = 4.0

# One width change across nodes: the training gap, in seconds, from the last step before it to the first
# step after it, as the devcluster measured it (docs/benchmarks.md, "Across nodes: an elastic job array";
# tests/test_cluster_elastic_array.py, 2026-11-26, one run, three hosts, CPU with gloo).
ARRAY_SHRINK_S = 9.3  # a task requeued: torchrun waits out its heartbeat (1 s x 5) and the last call (1 s)
ARRAY_GROW_S = 3.4    # a task started: the agents restart their workers to admit its node


def array_shape(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(K tasks, G GPUs a task) for a job of ``gpus`` GPUs: the fewest tasks that fit a node each and
    divide the job evenly (MAX = K x G)."""
    k = max(1, -(-gpus // gpus_per_node))
    while gpus % k:
        k += 1
    return k, gpus // k


class ElasticArrays:
    """The job-array half of ``Simulator``: it works on the simulator's state (``engine``). The trace job
    (the parent) holds the training's progress and is never queued or placed; its tasks are."""

    def _array_submit(self, p: SimJob) -> bool:
        """Queues the tasks of ``p`` instead of ``p`` when it is an elastic job across nodes."""
        cfg = self.cfg
        if not (cfg.elastic_arrays and p.elastic and cfg.policy == "antman" and p.klass == "opportunistic"
                and p.job.gpus > cfg.gpus_per_node):
            return False
        k, g = array_shape(p.job.gpus, cfg.gpus_per_node)
        pid = p.job.job_id
        self.counts["arrays"] += 1
        p.width_changed_at = float("-inf")
        for t in range(k):
            tj = replace(p.job, job_id=f"{pid}_{t}", gpus=g)  # Slurm's name of an array task
            task = SimJob(tj, p.profile, p.requested, "opportunistic", p.submit, p.duration, work_left=p.duration,
                          submitted_as="opportunistic", util=p.util, duty=p.duty, array=pid, task=t)
            self.jobs[tj.job_id] = task
            p.tasks.append(tj.job_id)
            self.active[tj.job_id] = task
            self.n_pending += 1
            self._enqueue(task)
        return True

    def _array_tasks(self, p: SimJob) -> list[SimJob]:
        return [self.jobs[t] for t in p.tasks]

    def _array_running(self, p: SimJob, but: Optional[SimJob] = None) -> list[SimJob]:
        return [t for t in self._array_tasks(p) if t.state == "RUNNING" and t is not but]

    def _array_can_train(self, p: SimJob, running: list[SimJob]) -> bool:
        host = self.jobs[p.tasks[0]]
        return host in running and len(running) >= min(self.cfg.elastic_array_min_tasks, len(p.tasks))

    def _array_idle(self, p: SimJob, but: Optional[SimJob] = None) -> None:
        """GPU-seconds its running tasks (but ``but``, which just started) held while the training did not
        run, up to now."""
        if p.state != "RUNNING":
            held = sum(len(t.gpus) for t in self._array_running(p, but))
            self.array_idle_gpu_s += (self.now - p.idle_from) * held
        p.idle_from = self.now

    def _task_started(self, t: SimJob) -> None:
        """After Slurm started task ``t``: a grow, the training's (re)start, or a wait."""
        p = self.jobs[t.array]
        self._array_idle(p, but=t)
        running = self._array_running(p)
        if any(i in x.gpus for x in running if x is not t for i in t.gpus):
            self.counts["array_shared_gpu_starts"] += 1  # placed beside a task of its own array
        if p.state == "RUNNING":
            self._array_change(p, running, "grows")
        elif self._array_can_train(p, running):
            self._array_train(p, running)
        else:
            self._array_load(p, [t], False)

    def _task_leaving(self, t: SimJob) -> None:
        """Before task ``t`` is requeued (``engine._stop``, its notice and GPUs still its own): a shrink, the
        training's stop, or nothing; and when it may start again."""
        p = self.jobs[t.array]
        self._array_idle(p)
        host = self.jobs[p.tasks[0]]
        # Slurm's BeginTime after a requeue keeps the task pending until the coordinator's MakeEligible
        # (``_task_eligible``): at once for the host and for every task of a whole-job requeue, after the
        # hold for a shed task. Its next loop runs at this instant (a WAKE forces a cycle), so a requeued
        # task that is not held is eligible as soon as any requeued job is in the simulator.
        t.eligible_at = float("inf")
        self._push(self.now, WAKE, t.job.job_id, 0)
        self.counts["array_task_requeues"] += 1
        if p.state != "RUNNING":
            return
        if t is host:  # the rendezvous is gone: the training stops (the coordinator takes every task)
            if any(x.notice_at is None for x in self._array_running(p, but=t)):
                self.counts["array_host_alone"] += 1  # a move: the others stay, and wait for it
            self._advance(p)
            since = self._since_checkpoint(p)
            if self.cfg.checkpoint_on_notice and t.notice_at is not None:
                since = min(since, self.now - t.notice_at)
            self._redo(p, since)
            p.preemptions += 1
            p.restarts += 1
            self.counts["array_requeues"] += 1
            self._array_stop(p, but=t)
            return
        running = self._array_running(p, but=t)
        if self._array_can_train(p, running):
            self._array_change(p, running, "shrinks")
        else:  # under MIN: the survivors wait for more tasks, from the last checkpoint
            self._advance(p)
            self._redo(p, self._since_checkpoint(p))
            self.counts["array_stalls"] += 1
            self._array_stop(p, but=t)

    def _task_checkpoint(self, t: SimJob, at: float) -> None:
        """The coordinator's ``CheckpointNotice`` to a task: its training checkpoints at ``at`` less
        the agent's lead (one checkpoint per training, whichever task's agent takes it)."""
        p = self.jobs[t.array]  # type: ignore[index]
        if p.state == "RUNNING" and self.cfg.checkpoint_on_notice:
            p.ckpt_at = max(self.now, at - ARRAY_CHECKPOINT_LEAD_S)

    def _task_eligible(self, t: SimJob, start_unix: Optional[float]) -> None:
        """The coordinator's ``MakeEligible`` for a requeued task: at ``start_unix`` (the hold), else now."""
        at = self.now if start_unix is None else start_unix
        if t.state == "PENDING" and at != t.eligible_at:
            t.eligible_at = at
            self._push(max(at, self.now), WAKE, t.job.job_id, 0)

    def _since_checkpoint(self, p: SimJob) -> float:
        """Training seconds since the job's latest checkpoint: the periodic one (since its last (re)start,
        modulo ``checkpoint_s``, as for a requeue), or a notice's taken since that (re)start."""
        since = max(0.0, self.now - p.ckpt_from) % self.cfg.checkpoint_s
        if p.ckpt_at is not None and p.ckpt_from <= p.ckpt_at <= self.now:
            since = min(since, self.now - p.ckpt_at)
        return since

    def _redo(self, p: SimJob, since: float) -> None:
        p.lost_gpu_s += since * len(p.gpus)
        p.work_left = min(p.duration, p.work_left + p.rate * since)

    def _array_train(self, p: SimJob, running: list[SimJob]) -> None:
        """The training (re)starts on ``running``, from its checkpoint."""
        p.state, p.start = "RUNNING", self.now
        p.train = []
        self._array_load(p, running, True)
        if p.first_start is None:
            p.first_start = self.now
        p.ran_as = "opportunistic"
        p.t_last = self.now + self.cfg.start_overhead_s
        self._array_width(p, running)

    def _array_change(self, p: SimJob, running: list[SimJob], kind: str) -> None:
        """A width change while training (``kind``: shrinks or grows): every worker restarts from the
        last periodic checkpoint. Tasks that start or go at the instant of the training's (re)start or of
        another change meet in that one rendezvous round: no change of their own."""
        if self.now in (p.start, p.width_changed_at):
            self._array_width(p, running)
            return
        self.counts[kind] += 1
        self.counts[f"array_{kind}"] += 1
        self._advance(p)
        since = self._since_checkpoint(p)
        if kind == "grows" and self.cfg.checkpoint_on_notice:
            since = min(since, ARRAY_JOIN_REDO_S)
        self._redo(p, since)
        cost = self.cfg.elastic_array_shrink_s if kind == "shrinks" else self.cfg.elastic_array_grow_s
        p.t_last = max(self.now, p.t_last) + cost
        p.width_changed_at = self.now
        p.width_changes += 1
        self.counts["width_changes"] += 1
        self._array_width(p, running)

    def _array_width(self, p: SimJob, running: list[SimJob]) -> None:
        p.ckpt_from = p.t_last
        running = sorted(running, key=lambda t: t.task)
        p.train = [t.job.job_id for t in running]
        p.gpus = [i for t in running for i in t.gpus]
        p.locality = self._locality(p, p.gpus)
        p.rate = 0.0  # set by _array_rate; nothing is advanced at it
        self._array_rate(p)

    def _array_stop(self, p: SimJob, but: SimJob) -> None:
        """The training stops; its running tasks but ``but`` (which leaves) wait."""
        p.state, p.gpus, p.train, p.rate = "PENDING", [], [], 0.0
        p.version += 1
        self._array_load(p, self._array_running(p, but), False)

    def _array_load(self, p: SimJob, tasks: list[SimJob], training: bool) -> None:
        """Tasks that train load their GPUs as their job does; tasks that wait do not."""
        duty, util = (p.duty, p.util) if training else (0.0, 0.0)
        gpus = []
        for t in tasks:
            if (t.duty, t.util) != (duty, util):
                t.duty, t.util = duty, util
                gpus.extend(t.gpus)
        if gpus:
            self._refresh(gpus)

    def _array_rate(self, p: SimJob) -> None:
        """The training's pace from its tasks' GPUs (module doc), and when it finishes at that pace."""
        if p.state != "RUNNING" or not p.train:  # (not while its training starts)
            return
        self._advance(p)
        rate = min(self.gpus[i].rate.get(tid, 1.0) for tid in p.train for i in self.jobs[tid].gpus) * p.locality
        if len(p.gpus) != p.job.gpus:
            rate *= profile_speedup(p.profile.name, len(p.gpus)) / profile_speedup(p.profile.name, p.job.gpus)
        p.rate, p.version = rate, p.version + 1
        if rate > 0:
            self._push(max(self.now, p.t_last) + max(p.work_left, 0.0) / rate, FINISH, p.job.job_id, p.version)

    def _array_finish(self, p: SimJob) -> None:
        """The training is done: its running tasks end, its pending ones are cancelled."""
        self._advance(p)
        p.state, p.end = "DONE", self.now
        p.finishes += 1
        for t in self._array_tasks(p):
            jid = t.job.job_id
            if t.state == "RUNNING":
                t.state, t.end = "DONE", self.now
                del self.active[jid]
                self._release(t)
            elif t.state == "PENDING":
                t.state = "CANCELLED"
                del self.active[jid]
                self.n_pending -= 1
                key = self._queue_key(t)
                self.dead[key] = self.dead.get(key, 0) + 1
