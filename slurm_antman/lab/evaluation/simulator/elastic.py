"""Elastic width for antman's opportunistic jobs (issue 29, after Amoeba): give up one GPU instead of
requeueing the whole job, and grow back into GPUs that have room.

An elastic job asks for ``MIN:MAX`` GPUs (here 1 to the trace's count, ``elastic_share`` of the
multi-GPU jobs, chosen by a hash of the job id so every policy and run picks the same ones). It does
``MAX`` GPUs' worth of work; at width ``w`` it progresses ``S(w) / S(MAX)`` as fast, S being its
profile's one-node speedup that Pollux measured (``locality_data.profile_speedup``: measured for 1-4
GPUs; beyond 4 the per-GPU efficiency of 4 held, an assumption, so between widths of 4 and more the
pace is ``w / MAX`` as before). Across nodes Pollux's efficiency applies, as to any job. Each width
change stops its progress for ``elastic_change_s``: torchrun's elastic rendezvous restarts every worker
at a membership change, and they reload the checkpoint the agent saved at the change. The default,
0.3 s, is 5 % of the 6.04 s a requeued job on the devcluster took to train again (docs/benchmarks.md),
from Amoeba's "around 95 %" lower cost of scaling than a naive stop-resume (Wu et al., Elastic deep
learning in multi-tenant GPU cluster, arXiv:1909.11985, 2019); it is a swept parameter, not a
measurement of this system.

When, before each coordinator cycle:

- a GPU whose guaranteed job needs its room (a preemption need) or on which an elastic job crawls
  past ``move_after_s`` sheds the elastic jobs on it that are wider than their minimum; the need is
  answered if nothing else is left there. Every GPU a job sheds at one instant is one width change
  (one restart of its workers). A job at its minimum goes the usual way (requeue, move);
- an elastic job under its maximum whose width last changed ``elastic_hold_s`` ago or more takes one
  more GPU on a node it runs on, where the node policy's rules place an opportunistic job. The hold
  is the hysteresis: a width bought must pay for its change before it may change again.

An elastic job that finds no node with room for all of it starts on the node with the most room.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from .state import SimJob


def is_elastic(job_id: str, gpus: int, share: float, seed: int) -> bool:
    """Whether this trace job is one of the ``share`` of multi-GPU jobs that are elastic."""
    if gpus < 2 or share <= 0:
        return False
    h = hashlib.blake2b(f"elastic:{seed}:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2 ** 64 < share


class ElasticWidth:
    """The elastic half of ``Simulator``: it works on the simulator's state (``engine``)."""

    def _elastic_now(self, j: SimJob) -> bool:
        return j.elastic and j.state == "RUNNING" and j.klass == "opportunistic" and self.cfg.policy == "antman"

    def _elastic_before_cycle(self) -> None:
        wait = self.cfg.move_after_s
        # First what each elastic job sheds, then one width change per job: a job losing several
        # GPUs at one instant (a whole node reclaimed) restarts its workers once, not once a GPU.
        shed: dict[str, list[int]] = {}
        for g in self.gpus:
            crawling = [jid for jid, since in g.crawl.items() if wait is not None and self.now - since >= wait]
            if g.need is None and not crawling:
                continue
            for jid in (g.opp if g.need is not None else crawling):
                if self._elastic_now(self.jobs[jid]):
                    shed.setdefault(jid, []).append(g.index)
        for jid, gpus in shed.items():
            self._shrink(self.jobs[jid], gpus)
        for i in {i for gpus in shed.values() for i in gpus}:
            g = self.gpus[i]
            if g.need is not None and not g.opp:
                g.need = None  # the room is free: nobody needs requeueing for it
        for j in list(self.active.values()):
            if (self._elastic_now(j) and len(j.gpus) < j.job.gpus
                    and self.now - j.width_changed_at >= self.cfg.elastic_hold_s):
                self._grow(j)

    def _width_change(self, j: SimJob, gpus: list[int], touched: list[int]) -> None:
        self._advance(j)
        j.gpus = gpus
        j.locality = self._locality(j, gpus)
        j.t_last = max(self.now, j.t_last) + self.cfg.elastic_change_s
        j.width_changed_at = self.now
        j.width_changes += 1
        self.counts["width_changes"] += 1
        self._refresh(touched)

    def _shrink(self, j: SimJob, gpus: list[int]) -> None:
        """Off ``gpus``, keeping at least one (the job's last GPU goes the usual way: requeue or move)."""
        drop = [i for i in dict.fromkeys(gpus) if i in j.gpus][:len(j.gpus) - 1]
        if not drop:
            return
        jid = j.job.job_id
        for i in drop:
            g = self.gpus[i]
            g.opp.remove(jid)
            g.rate.pop(jid, None)
            g.share.pop(jid, None)
            g.crawl.pop(jid, None)
            self.node_opp[g.node] -= 1
        self.counts["shrinks"] += 1
        keep = [i for i in j.gpus if i not in drop]
        self._width_change(j, keep, drop + keep)

    def _grow(self, j: SimJob) -> Optional[int]:
        wait = self.cfg.no_room == "wait"
        gpu = None
        for k in sorted({self.gpus[i].node for i in j.gpus}):
            got = self._opp_pick(j, k, 1, wait, exclude=set(j.gpus))  # never a GPU it is on already
            if got:
                gpu = got[0]
                break
        if gpu is None:
            return None
        g = self.gpus[gpu]
        g.opp.append(j.job.job_id)
        self.node_opp[g.node] += 1
        self.counts["grows"] += 1
        self._width_change(j, j.gpus + [gpu], j.gpus + [gpu])
        return gpu
