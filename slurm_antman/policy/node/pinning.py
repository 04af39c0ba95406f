"""Which opportunistic jobs may keep pinned host memory for a pause, out of the node's budget.

A pause moves a job's GPU state into page-locked host memory (torch_patch.pause). Fresh pages cost the
kernel's zeroing first (about 20 GiB/s with 8 threads on the H200 VM, 2026-11-26), so a job's first pause
ran 3.1-10.8x the copies alone. A job granted an allowance keeps its arena after a resume and pins one
ahead while it runs where a pause can come (torch_patch.pinned.prepin). Pinned memory is taken from the
node's RAM for good, so the grants stay within ``NodePolicyParams.pin_budget_bytes`` (antman.yaml
``sidecar.pin_budget_mb``).

Who first: a paused job's state already lies pinned (counted, so the rest fits beside it); then the jobs
a pause would reach first. The node policy pauses the newest opportunistic job on a GPU first (last in,
first out; core.py), so newest first. A job gets all it needs or nothing: half an arena still zeroes
pages at the pause. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Collection, Mapping

from .model import JobInfo

# As torch_patch.pinned: arenas are registered in chunks of 256 MiB, and a pre-pin sizes its arena at the
# state's bytes and an eighth more (Adam's moments appear at the first step).
CHUNK_BYTES = 256 << 20


def need_bytes(job: JobInfo) -> int:
    """The allowance a job's arena needs: what it holds on its GPU at the boundary (its state and what the
    allocator keeps), an eighth more, in whole chunks."""
    want = job.mem_demand_bytes * 9 // 8
    return -(-want // CHUNK_BYTES) * CHUNK_BYTES if want > 0 else 0


def pin_grants(jobs: Collection[JobInfo], guarded_gpus: Collection[int], paused: Collection[str],
               budget_bytes: int) -> Mapping[str, int]:
    """job id -> the host bytes it may keep pinned (absent: none). ``guarded_gpus``: GPUs with a
    guaranteed job on them (where a pause can come); ``paused``: jobs paused in place now."""
    if budget_bytes <= 0:
        return {}
    candidates = [j for j in jobs if j.job_class == "opportunistic" and j.can_pause and j.elastic_group is None
                  and (j.job_id in paused or any(g in guarded_gpus for g in j.gpus))]
    order = sorted(candidates, key=lambda j: (j.job_id not in paused, -j.registered_unix, j.job_id))
    left, out = budget_bytes, {}
    for j in order:
        need = need_bytes(j)
        if 0 < need <= left:
            out[j.job_id] = need
            left -= need
    return out
