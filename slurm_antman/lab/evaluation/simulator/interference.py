"""The GPU physics: how fast each job on a GPU progresses beside its neighbours (the workload model's
interference, docs/workload_model.md), how busy the GPU is and how much of its memory is used, and
when footprints that exceed the memory make a job fail with OOM.
"""

from __future__ import annotations

from typing import Iterable

from ..locality_data import profile_speedup
from .slot_fill import slot_rates
from .state import FINISH, SimGpu

SPILL_RATE = 0.5  # opportunistic job whose memory limit is under its footprint (estimate, see docs)


class GpuInterference:
    """The per-GPU model's half of ``Simulator``: it works on the simulator's state (``engine``).
    Under ``antman`` the compute shares and memory limits come from the node policy (``antman``)."""

    def _oom_on(self, gpus: Iterable[int]) -> bool:
        for i in gpus:
            g = self.gpus[i]
            if sum(self.jobs[x].profile.mem_bytes for x in g.guar + g.opp) > g.mem_total:
                return True
        return False

    def _refresh(self, gpus: Iterable[int]) -> None:
        gpus = list(dict.fromkeys(gpus))
        touched: set[str] = set()
        for i in gpus:
            g = self.gpus[i]
            for jid in g.guar + g.opp:
                self._advance(self.jobs[jid])
                touched.add(jid)
        for i in gpus:
            self._model_gpu(self.gpus[i])
            self.dirty_nodes.add(self.gpus[i].node)
        arrays: set[str] = set()
        for jid in touched:
            j = self.jobs[jid]
            if j.state != "RUNNING":
                continue
            if j.array is not None:  # a task of an elastic array: the pace is its training's (elastic_array.py)
                arrays.add(j.array)
                continue
            # The slowest of its GPUs sets the pace of a synchronous job, and crossing nodes costs
            # what Pollux measured for its kind of model (locality_data.py).
            # An elastic job below its width does the share of its work's pace that its profile's
            # measured scaling curve gives (elastic.py); only then, so a full-width job's rate is
            # exactly what it was before widths could change.
            rate = min(self.gpus[i].rate.get(jid, 1.0) for i in j.gpus) * j.locality
            if len(j.gpus) != j.job.gpus:
                rate *= profile_speedup(j.profile.name, len(j.gpus)) / profile_speedup(j.profile.name, j.job.gpus)
            j.rate, j.version, j.view = rate, j.version + 1, None
            self._end_changed(j)  # (backfill.py)
            if rate > 0:  # 0: paused in place; its resume sets a rate again
                self._push(max(self.now, j.t_last) + max(j.work_left, 0.0) / rate, FINISH, jid, j.version)
        for pid in sorted(arrays):
            self._array_rate(self.jobs[pid])

    def _model_gpu(self, g: SimGpu) -> None:
        self._node_changed(g.node)  # (opp_place.py: every change of a GPU comes through here)
        jobs = self.jobs
        guar = [jobs[x] for x in g.guar]
        opp = [jobs[x] for x in g.opp]
        shares: dict[str, float] = {}
        spill: set[str] = set()
        if self.cfg.policy == "antman" and opp:
            shares, spill = self._local_policy(g, guar, opp)
        else:
            shares = {j.job.job_id: 1.0 for j in opp}
            self._track_slow(g, guar, False)
            # No opportunistic job left to free room from: a need raised for this GPU is answered (the
            # slow_preempt_s need is raised outside the local policy, which clears the others).
            g.need = None
        here = guar + opp
        # A job's load on the GPU: its duty (production idle time) times its compute share.
        load = {j.job.job_id: j.duty * shares.get(j.job.job_id, 1.0) for j in here}
        total = sum(j.profile.sm_util * load[j.job.job_id] for j in here)
        g.rate = {}
        useful = 0.0
        filled = None
        if self.cfg.compute == "slots" and self.cfg.policy == "antman" and guar and opp:
            # Slot filling (slot_fill.py): the opportunistic jobs take the guaranteed job's idle slots
            # instead of a duty-cycle share; a paused one (share 0) takes none. Idle and need are device
            # time: a job's utilisation (its duty times its profile's SM busy fraction), not its duty.
            g_rate, o_rates = slot_rates(max(j.util for j in guar),
                                         [j.util if shares.get(j.job.job_id, 1.0) > 0 else 0.0 for j in opp],
                                         self.cfg.slot_fill)
            filled = {j.job.job_id: g_rate for j in guar}
            filled.update({j.job.job_id: r for j, r in zip(opp, o_rates)})
            total = min(1.0, sum(j.profile.sm_util * j.duty for j in guar)
                        + sum(j.profile.sm_util * j.duty * filled[j.job.job_id] for j in opp))
        for j in here:
            jid = j.job.job_id
            if filled is not None:
                r = filled[jid]
            else:
                r = 1.0 / j.profile.slowdown(((o.profile.kind, load[o.job.job_id]) for o in here if o is not j), j.duty)
                if jid in shares:
                    r *= shares[jid]
            if jid in spill:
                r *= SPILL_RATE
            g.rate[jid] = r
            useful += r * j.util  # the busy time it would need alone for the progress it makes
        g.share = shares
        new_util = min(1.0, total)
        new_mem = min(g.mem_total, sum(j.profile.mem_bytes for j in guar + opp
                                       if shares.get(j.job.job_id, 1.0) > 0 or j in guar))
        self.util_sum += new_util - g.util
        self.mem_sum += new_mem - g.mem_used
        self.useful_sum += useful - g.useful
        g.util, g.mem_used, g.useful = new_util, new_mem, useful
        if self.cfg.policy == "antman":
            self._track_crawl(g, guar, opp)

