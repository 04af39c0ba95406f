"""Where an opportunistic job may go: the node's free Slurm slots, then the node policy's choice among
its GPUs (``policy.node.placement.choose_gpus``: antman's rules, or the plain ones under ``shared``).

A scheduling pass asks every node for every waiting opportunistic job, and most answers repeat: the
node's GPUs did not change since the last job asked. So a node's answer for a job of no placement memory
there, no sibling tasks and no GPUs to leave out is kept per (GPUs wanted, free slots, wait) until one
of the node's GPUs changes (``_node_changed``: every change of a GPU's jobs, load or memory goes through
``interference._model_gpu``, and a new guaranteed job's utilisation window ends with a ``MEASURED``
event). A job's shape (GPUs a node, wait, the GPU it avoids) that found no node with room fails again
at once while no node's room changed, and once some did, only those nodes are asked (``place_epoch``,
``node_stamp``; across nodes, the others' answers of then are kept with the failure).
``check_caches`` recomputes every kept answer and fails on a difference (the tests turn it on).
"""

from __future__ import annotations

from typing import Iterable, Optional

from slurm_antman.policy.node.placement import GpuLoad, choose_gpus, exclusion

from .state import WAKE, SimJob


class OpportunisticPlacement:
    """The opportunistic placement's half of ``SlurmScheduler``: it works on the simulator's state (``engine``)."""

    check_caches = False  # tests: recompute every kept answer and compare
    checked = 0           # (how many, in that mode)
    shapes_checked = 0    # (how many failed shapes failed again the long way, in that mode)
    nodes_checked = 0     # (how many nodes' answers kept with a multi-node failure were right, in that mode)

    def _node_changed(self, k: int) -> None:
        """One of node ``k``'s GPUs changed: what was worked out about its room is stale."""
        self.unfit_nodes.discard(k)
        self.node_picks.pop(k, None)
        self._room_changed(k)

    def _room_changed(self, k: int) -> None:
        """Node ``k``'s room changed (its GPUs, its free slots, or whether it is kept off): a shape
        that failed everywhere before may fit there now (``place_epoch``, ``node_stamp``)."""
        self.place_epoch += 1
        self.node_stamp[k] = self.place_epoch

    def _opp_pick(self, j: SimJob, k: int, take: int, wait: bool, exclude: Iterable[int] = (),
                  extra_slots: int = 0) -> list[int]:
        """Up to ``take`` GPUs of node ``k`` for an opportunistic job: the node's free slots (plus
        ``extra_slots`` the job holds there already), then the node policy's choice among its GPUs with
        room (antman) or its plain rules (shared). The coordinator's keep-off is a pending job's
        ExcNodeList: a running job growing on a node it runs on is not kept off it."""
        per_node = self.cfg.gpus_per_node
        free_slots = self.opp_slots[k] - self.node_opp[k] + extra_slots
        if free_slots <= 0 or (wait and (k in self.unfit_nodes or (
                k in self.no_room_nodes and not any(self.gpus[i].node == k for i in j.gpus)))):
            return []
        avoid = [i - k * per_node for i in j.avoid if i // per_node == k] if j.avoid else None
        if exclude or avoid or j.array is not None:
            got, unfit = self._opp_choose(j, k, take, free_slots, wait, exclude, avoid or [])
        else:
            key = (take, free_slots, wait)
            picks = self.node_picks.setdefault(k, {})
            kept = picks.get(key)
            if kept is None:
                kept = picks[key] = self._opp_choose(j, k, take, free_slots, wait, (), [])
            elif self.check_caches:
                fresh = self._opp_choose(j, k, take, free_slots, wait, (), [])
                assert fresh == kept, f"node {k} at {self.now}: kept {kept}, now {fresh}"
                OpportunisticPlacement.checked += 1
            got, unfit = kept
        if unfit:
            self.unfit_nodes.add(k)
        return list(got)

    def _opp_choose(self, j: SimJob, k: int, take: int, free_slots: int, wait: bool, exclude: Iterable[int],
                    avoid: list[int]) -> tuple[tuple[int, ...], bool]:
        """The GPUs the node's rules give the job, and whether the node counts as without room for any
        job (``unfit_nodes``) from now on."""
        per_node = self.cfg.gpus_per_node
        node_gpus = self.gpus[k * per_node:(k + 1) * per_node]
        room = [g for g in node_gpus if len(g.opp) < self.cfg.slots_per_gpu and g.index not in exclude]
        take = min(take, free_slots, len(room))
        if take <= 0:
            return (), False
        loads = [GpuLoad(g.local, g.mem_total, g.mem_used, g.util, len(g.guar), len(g.opp), self.now >= g.measured_at)
                 for g in room]
        if self.cfg.policy == "antman":
            # A task of an elastic array is kept off its siblings' GPUs, as the sidecar does (apart=).
            sibs = ({x.job.job_id for x in self._array_tasks(self.jobs[j.array]) if x is not j}
                    if j.array is not None else set())
            apart = [g.local for g in room if sibs.intersection(g.opp)] if sibs else []
            pick = choose_gpus(loads, take, self.cfg.slots_per_gpu, self.cfg.util_threshold, self.cfg.util_window_s,
                               self.lp_params.target_slowdown, self.cfg.min_progress, avoid, wait, fill=self.cfg.fill,
                               apart=apart)
            unfit = wait and not pick.gpus and not avoid and not exclude
        else:
            pick = choose_gpus(loads, take, self.cfg.slots_per_gpu, self.cfg.util_threshold, self.cfg.util_window_s)
            unfit = False
        return tuple(k * per_node + i for i in pick.gpus), unfit

    def _waits_for_room(self, j: SimJob) -> bool:
        """Under no_room=wait an opportunistic job waits for a GPU that meets the rules; with the what-if
        ``no_room_wait_max_s`` (not built on the real path) only that long after its submission, then
        it takes the least-loaded GPUs as under fallback."""
        if self.cfg.policy != "antman" or self.cfg.no_room != "wait":
            return False
        return self.cfg.no_room_wait_max_s is None or self.now - j.submit < self.cfg.no_room_wait_max_s

    def _waiting_for_room(self, j: SimJob, width: int) -> None:
        """A job that waits for room: the study's sample, and under ``no_room_wait_max_s`` a pass when
        its wait is over (nothing else may happen on the cluster until then)."""
        if width == 1 and self.cfg.wait_study_s is not None:
            self._study_wait()
        if self.cfg.no_room_wait_max_s is not None and j.job.job_id not in self.wait_woken:
            self.wait_woken.add(j.job.job_id)
            self._push(j.submit + self.cfg.no_room_wait_max_s, WAKE, j.job.job_id, 0)

    def _study_wait(self) -> None:
        """``cfg.wait_study_s``: which rule keeps each GPU from a waiting one-GPU opportunistic job."""
        if self.now < self.wait_study_next:
            return
        self.wait_study_next = self.now + self.cfg.wait_study_s
        per = self.cfg.gpus_per_node
        self.wait_study["samples"] = self.wait_study.get("samples", 0) + 1
        for k in range(self.cfg.nodes):
            full = self.opp_slots[k] - self.node_opp[k] <= 0
            for g in self.gpus[k * per:(k + 1) * per]:
                load = GpuLoad(g.local, g.mem_total, g.mem_used, g.util, len(g.guar), len(g.opp),
                               self.now >= g.measured_at)
                rule = exclusion(load, self.cfg.slots_per_gpu, self.cfg.util_threshold, self.cfg.util_window_s,
                                 self.lp_params.target_slowdown, self.cfg.min_progress, fill=self.cfg.fill)[0] or "qualifies"
                if full:  # the coordinator's slot count for the node, from its last cycle, is used up
                    rule = f"node_slots:{rule}"
                self.wait_study[rule] = self.wait_study.get(rule, 0) + 1

    def _open_nodes(self, j: SimJob, wait: bool) -> list[int]:
        """The nodes ``_opp_pick`` does not turn away at its first test (a free slot; under wait, not
        unfit and not kept off, a job's own nodes never kept off it), without a call per node."""
        slots, used = self.opp_slots, self.node_opp
        if not wait:
            return [k for k in range(self.cfg.nodes) if slots[k] > used[k]]
        closed = self.unfit_nodes | (self.no_room_nodes - {self.gpus[i].node for i in j.gpus})
        return [k for k in range(self.cfg.nodes) if slots[k] > used[k] and k not in closed]

    def _failed_at(self, shape: tuple, plain: bool) -> Optional[int]:
        """The ``place_epoch`` at which a job of this shape last found no room, for a job with nothing
        of its own in the answer but its placement memory (``plain``: no GPUs yet, no sibling tasks;
        the GPU it avoids is part of its shape). At the epoch now it fails again: the nodes' answers
        are kept per (GPUs, free slots, wait) until their GPUs change (module doc), and the free slots,
        the kept-off nodes and the counts change only with a node's room too (``_room_changed``)."""
        return self.failed_shapes.get(shape) if plain else None

    def _shape_failed(self, shape: tuple, plain: bool, known: bool, picks: Optional[dict] = None) -> None:
        if plain:
            OpportunisticPlacement.shapes_checked += known  # (check mode: it failed again the long way)
            self.failed_shapes[shape] = self.place_epoch
            if picks is not None:
                self.failed_picks[shape] = picks

    def _place_opportunistic(self, j: SimJob, counts: list[int]) -> Optional[list[int]]:
        """On one node for a job that fits one (the first node, in order, with room for all of it),
        else on nodes each with room for its part, under one switch while it waits for one. A shape
        is the GPUs a node, the wait and (across nodes) the wait for one switch."""
        wait = self._waits_for_room(j)
        plain = not (j.gpus or j.array is not None)
        if len(counts) == 1:
            narrow: list[int] = []
            narrow_start = j.elastic and self.cfg.policy == "antman" and self.cfg.elastic_narrow_start
            shape, plain = (counts[0], wait, j.avoid), plain and not narrow_start
            since = self._failed_at(shape, plain)
            known = since == self.place_epoch
            if known and not self.check_caches:
                if wait:
                    self._waiting_for_room(j, counts[0])
                return None
            # Where the shape failed before, the nodes whose room has not changed since answer no again:
            # only the changed ones are asked (the first of them that fits is the first node that fits).
            stamp = self.node_stamp
            for k in self._open_nodes(j, wait):
                if since is not None and stamp[k] <= since and not self.check_caches:
                    continue
                got = self._opp_pick(j, k, counts[0], wait)
                if len(got) >= counts[0]:
                    assert not known, f"{j.job.job_id} at {self.now}: its shape {shape} failed with no room changed since"
                    assert since is None or stamp[k] > since, \
                        f"{j.job.job_id} at {self.now}: node {k} fits its shape {shape}, which failed there unchanged since"
                    return got
                if narrow_start and len(got) > len(narrow):
                    narrow = got
            # The what-if elastic_narrow_start (not built on the real path, elastic.py): start on the
            # node with the most room rather than wait.
            if not narrow and wait:
                self._waiting_for_room(j, counts[0])
            if not narrow:
                self._shape_failed(shape, plain, known)
            return narrow or None
        one_switch = self._switch_wait(j)
        shape = (tuple(counts), wait, one_switch, j.avoid)
        since = self._failed_at(shape, plain)
        known = since == self.place_epoch
        if known and not self.check_caches:
            return None
        # Where the shape failed before, a node whose room has not changed since gives what it gave then.
        before = self.failed_picks.get(shape, {}) if since is not None else None
        stamp = self.node_stamp
        picks: dict[int, list[int]] = {}
        for k in self._open_nodes(j, wait):
            kept = before is not None and stamp[k] <= since
            if kept and not self.check_caches:
                if k in before:
                    picks[k] = before[k]
                continue
            got = self._opp_pick(j, k, counts[0], wait)
            if len(got) >= counts[0]:
                picks[k] = got
            if kept:  # (check mode)
                assert before.get(k) == picks.get(k), f"node {k} at {self.now}: kept {before.get(k)}, now {got}"
                OpportunisticPlacement.nodes_checked += 1
        nodes = self._pick_nodes({k: len(v) for k, v in picks.items()}, counts, one_switch=one_switch)
        if nodes is None:
            self._shape_failed(shape, plain, known, picks)
            return None
        assert not known, f"{j.job.job_id} at {self.now}: its shape {shape} failed with no room changed since"
        return [i for n, c in zip(nodes, counts) for i in picks[n][:c]]
