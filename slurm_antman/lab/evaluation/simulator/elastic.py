"""Elastic width for antman's opportunistic jobs (after Amoeba, 2019): give up one GPU instead of
requeueing the whole job, and grow back onto it later.

The default model is the real path's rules, as ``slurm_antman.policy.node.core`` builds them (its
module doc, "Elastic width"; ``can_shed`` and ``_width_changes``; docs/elastic.md):

- **Which jobs.** An elastic job asks for ``MIN:MAX`` GPUs, here 1 to the trace's count. It is one of
  ``elastic_share`` of the multi-GPU jobs, chosen by a hash of the job id so every policy and run picks
  the same ones. These rules are for a job that fits one node: job_submit.lua refuses an elastic job
  that may span nodes unless it is a job array, and keeps it on one (``max_nodes=1``). A wider job
  stays rigid, or with ``elastic_arrays`` is an array of one-node tasks (below, "Across nodes"). Under
  ``placement="nodes"`` a job that fits a node already runs on one. Under ``"spread"``, the model
  until 2026-11-26, an elastic job still takes one node.
- **Start.** It starts at full width ``MAX``, on the GPUs the node policy places it on: its device set.
  It waits for room for all of it, like any job; there is no narrow start.
- **Shed for a guaranteed job.** When a guaranteed job needs the room on one of its GPUs, the job sheds
  that GPU instead of being paused or requeued, if it stays at ``MIN`` or above. The need can come
  from the memory rule or from ``slow_preempt_s``. The elastic job must be the victim the local policy
  picks: for the memory rule, the jobs its ``decide`` asks to leave; for ``slow_preempt_s``, the newest
  opportunistic job on the GPU. There is no hold. Every GPU a job sheds at one instant is one width
  change. A job at its minimum goes the usual way (requeue, move).
- **Shed when crawling.** A crawling elastic job (progress under ``min_progress``, the local policy's
  ``crawling``) sheds one GPU: of those it shares with a guaranteed job, the one whose opportunistic
  budget is lowest. It does so only if its last width change was ``elastic_hold_s`` ago or more. A job
  that has not changed width yet needs no hold. It does not wait for ``move_after_s``: that is the
  coordinator's wait before a move.
- **Grow.** It grows back one GPU per change, and only onto a GPU of its own device set that holds no
  other job (idle) and has room for its footprint. It does so at most once per ``elastic_hold_s``. The
  hold is the hysteresis: a width must pay for its change before it may change again.
- **Slurm's slots.** Slurm's allocation does not change with the width: the job keeps its ``MAX``
  opportunistic slots on its node until it ends. The coordinator counts them as allocated, and it sees
  a shed GPU as a slot in use that the sidecar does not show (placement.node_slots' ``unseen``).
- **One change per job per cycle.** A shed for a need comes first, then a shed when crawling, then a
  grow, as in ``_width_changes``.

**Pace and cost.** A job does ``MAX`` GPUs' worth of work. At width ``w`` it progresses ``S(w) /
S(MAX)`` as fast, where S is its profile's one-node speedup that Pollux measured
(``locality_data.profile_speedup``). S is measured for 1-4 GPUs. Beyond 4 the per-GPU efficiency of 4
is held, an assumption, so between widths of 4 and more the pace is ``w / MAX``.

Each width change stops the job's progress for ``elastic_change_s``: the workers restart from the
checkpoint saved at the change. The default, 2.2 s, is measured: the median training gap of the
devcluster runs of tests/test_cluster_elastic.py. That is CPU, gloo, torchrun under
torch_patch.elastic_launch, 2026-11-26, with 2.05/2.28, 2.08/1.93 and 2.44/2.84 s (shrink/grow);
tests/test_elastic_launch.py gives 2.1-2.6 s. A requeue takes 6.04 s to training again there
(docs/benchmarks.md). On a real GPU a restart also pays CUDA context creation and a larger checkpoint,
which is not measured yet. Amoeba's "around 95 %" lower cost than a stop-resume (Wu et al., Elastic
deep learning in multi-tenant GPU cluster, arXiv:1909.11985) would give 0.3 s (5 % of 6.04 s). That
is a swept value.

**What-if options, not built on the real path** (off by default, for comparison with the model before
this one):

- ``elastic_narrow_start``: a job that finds no node with room for all of it starts on the node with
  the most room, at a narrower width. Its Slurm slots are the GPUs it starts on. It may grow onto the
  node's other GPUs once the hold from its start is over (with a free slot, where it has no shed one).
- ``elastic_grow_shared``: a job grows onto any GPU of a node it runs on where the node policy's
  rules (``choose_gpus``) would place an opportunistic job, not only onto an idle GPU of its set.

**Across nodes** (``elastic_arrays``, ``--elastic-arrays``): built on the real path now, as a Slurm job
array of one-node tasks whose width changes by whole tasks, and modelled so in ``elastic_array.py``. It
is still off by default until it is measured. It replaced the what-if ``elastic_multinode``, under which
jobs wider than a node shed GPU by GPU like one-node ones, which the real path does not do.

Not modelled: with ``pause_max_s`` set, the simulated local policy pauses a victim before the shed is
looked at, so an elastic job is paused rather than shed. In the real path the shed comes first.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from .state import SLOW, SimGpu, SimJob

# The narrowest width of every elastic trace job (--antman-elastic=1:MAX).
ELASTIC_MIN = 1


def is_elastic(job_id: str, gpus: int, share: float, seed: int, max_gpus: Optional[int] = None) -> bool:
    """Whether this trace job is one of the ``share`` of multi-GPU jobs that are elastic. ``max_gpus``:
    the most GPUs an elastic job may have (a node's; None: any width, with ``elastic_arrays``)."""
    if gpus < 2 or share <= 0 or (max_gpus is not None and gpus > max_gpus):
        return False
    h = hashlib.blake2b(f"elastic:{seed}:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2 ** 64 < share


class ElasticWidth:
    """The elastic half of ``Simulator``: it works on the simulator's state (``engine``)."""

    def _elastic_now(self, j: SimJob, named: bool = False) -> bool:
        """Whether ``j`` can change width now (the sidecar's ``can_resize``). It must be a running elastic
        opportunistic job with no preemption notice and not paused. Unless the local policy named it as
        the victim of a need (``named``), it must also not be asked to leave by it."""
        if not (j.elastic and j.state == "RUNNING" and j.klass == "opportunistic" and self.cfg.policy == "antman"
                and j.notice_at is None):
            return False
        jid = j.job.job_id
        for i in j.gpus:
            st = self.gpus[i].lp_state
            if jid in st.paused or (not named and jid in st.preempted):
                return False
        return True

    def _held(self, j: SimJob) -> bool:
        return self.now - j.width_changed_at >= self.cfg.elastic_hold_s

    def _need_victims(self, g: SimGpu) -> list[str]:
        """The opportunistic jobs the local policy would ask to leave ``g`` for its need: those its
        memory rule named, or else the newest one that is not paused (the ``slow_preempt_s`` rule)."""
        named = [x for x in g.opp if x in g.lp_state.preempted]
        if named:
            return named
        active = [x for x in g.opp if x not in g.lp_state.paused]
        return [max(active, key=lambda x: (self.jobs[x].start or 0.0, x))] if active else []

    def _elastic_before_cycle(self) -> None:
        if self.cfg.elastic_share <= 0:
            return
        changed: set[str] = set()
        # 1. Sheds for the guaranteed jobs' needs, no hold: first what each job sheds, then one width
        # change per job (a job losing several GPUs at one instant restarts its workers once).
        shed: dict[str, list[int]] = {}
        for g in self.gpus:
            if g.need is None or not g.opp:
                continue
            for jid in self._need_victims(g):
                j = self.jobs[jid]
                if self._elastic_now(j, named=True) and len(j.gpus) - len(shed.get(jid, ())) - 1 >= ELASTIC_MIN:
                    shed.setdefault(jid, []).append(g.index)
        for jid, gpus in shed.items():
            self._shrink(self.jobs[jid], gpus)
            changed.add(jid)
        for i in {i for gpus in shed.values() for i in gpus}:
            g = self.gpus[i]
            if g.need is not None and not any(x in g.lp_state.preempted for x in g.opp):
                g.need = None  # answered: nobody needs requeueing for it
        # 2 and 3. Crawling jobs shed a GPU shared with a guaranteed job; others grow. Both after the hold.
        for j in [x for x in self.active.values() if x.elastic]:
            jid = j.job.job_id
            if jid in changed or not self._held(j) or not self._elastic_now(j):
                continue
            mine = [i for i in j.gpus if self.gpus[i].guar]
            # As the local policy (_sheddable): crawling on a GPU shared with a guaranteed job, its own
            # pace there (not its width) slow, and a GPU without one left to it; else it grows if it can,
            # and a job narrowed for good is moved by the coordinator.
            if (any(jid in self.gpus[i].crawl for i in j.gpus)
                    and any(self.gpus[i].rate.get(jid, 1.0) < self.lp_params.crawl_below for i in mine)
                    and len(mine) < len(j.gpus) and len(j.gpus) - 1 >= ELASTIC_MIN):
                worst = min(mine, key=lambda i: (sum(self.gpus[i].share.values()), i))
                self._shrink(j, [worst])
                changed.add(jid)
            elif len(j.gpus) < j.job.gpus:
                if self._grow(j) is not None:
                    changed.add(jid)

    def _width_change(self, j: SimJob, gpus: list[int], touched: list[int]) -> None:
        self._advance(j)
        jid = j.job.job_id
        j.gpus = gpus
        j.locality = self._locality(j, gpus)
        j.t_last = max(self.now, j.t_last) + self.cfg.elastic_change_s
        j.width_changed_at = self.now
        j.width_changes += 1
        self.counts["width_changes"] += 1
        for i in gpus:
            self.gpus[i].crawl.pop(jid, None)  # a change ends its crawl: it counts again from here
        self._refresh(touched)
        if self.cfg.elastic_hold_s > 0:  # a cycle when the hold is over, to shed or grow if due
            self._push(self.now + self.cfg.elastic_hold_s, SLOW, jid, 0)

    def _shrink(self, j: SimJob, gpus: list[int]) -> None:
        """Off ``gpus``, keeping at least ``ELASTIC_MIN``; the job keeps their Slurm slots (``j.off``)."""
        drop = [i for i in dict.fromkeys(gpus) if i in j.gpus][:len(j.gpus) - ELASTIC_MIN]
        if not drop:
            return
        jid = j.job.job_id
        for i in drop:
            g = self.gpus[i]
            g.opp.remove(jid)
            g.rate.pop(jid, None)
            g.share.pop(jid, None)
            g.crawl.pop(jid, None)
        j.off.extend(drop)
        self.counts["shrinks"] += 1
        keep = [i for i in j.gpus if i not in drop]
        self._width_change(j, keep, drop + keep)

    def _grow_candidates(self, j: SimJob) -> list[int]:
        """The real path's: the idle GPUs of its device set (the GPUs it shed, ``j.off``) with room for
        its footprint. Under ``elastic_narrow_start`` also the idle GPUs of its node that it never
        had, where Slurm has a free slot."""
        per = self.cfg.gpus_per_node
        cands = sorted(j.off)
        if len(j.gpus) + len(j.off) < j.job.gpus:
            for k in sorted({self.gpus[i].node for i in j.gpus}):
                if self.opp_slots[k] - self.node_opp[k] > 0:
                    cands += [i for i in range(k * per, (k + 1) * per) if i not in j.gpus and i not in j.off]
        need = max(j.profile.mem_bytes, self.lp_params.min_opportunistic_bytes)
        return [i for i in cands if not self.gpus[i].guar and not self.gpus[i].opp
                and self.gpus[i].mem_total - self.lp_params.headroom_bytes >= need]

    def _grow(self, j: SimJob) -> Optional[int]:
        gpu = None
        if self.cfg.elastic_grow_shared:
            wait = self.cfg.no_room == "wait"
            for k in sorted({self.gpus[i].node for i in j.gpus}):
                held = sum(1 for i in j.off if self.gpus[i].node == k)
                got = self._opp_pick(j, k, 1, wait, exclude=set(j.gpus), extra_slots=held)
                if got:
                    gpu = got[0]
                    break
        else:
            cands = self._grow_candidates(j)
            gpu = cands[0] if cands else None
        if gpu is None:
            return None
        g = self.gpus[gpu]
        # Its own shed slot on that node if it has one (that GPU's first), else a new one.
        mine = [i for i in j.off if i == gpu] or [i for i in j.off if self.gpus[i].node == g.node]
        if mine:
            j.off.remove(mine[0])
        else:
            self.node_opp[g.node] += 1
        g.opp.append(j.job.job_id)
        self.counts["grows"] += 1
        self._width_change(j, j.gpus + [gpu], j.gpus + [gpu])
        return gpu

    def _elastic_release(self, j: SimJob) -> None:
        """The job leaves its GPUs (end, requeue, upgrade): the Slurm slots of the GPUs it shed go too."""
        for i in j.off:
            self.node_opp[self.gpus[i].node] -= 1
        j.off = []
