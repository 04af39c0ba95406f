"""Terse constructors for hand-made cluster policy snapshots (slurm_antman.policy.cluster): the policy tests
and `antman bench coordinator` use them; the daemons never do."""

from __future__ import annotations

from slurm_antman.policy.cluster.model import GpuView, JobView, NodeView, PolicyParams, PreemptNeed, Snapshot

GiB = 1024 ** 3
NOW = 10_000.0

PARAMS = PolicyParams(grace_s=30.0, slots_per_gpu=2, util_threshold=0.8, min_opp_mem_bytes=1 * GiB,
                      headroom_bytes=GiB // 2, queue_to_opportunistic_s=None)


def job(job_id: str, *, account: str = "a", state: str = "PENDING", requested: str = "guaranteed",
        job_class: str | None = None, gpus: int = 1, node: str | None = None, submit: float = 0.0,
        start: float | None = None, restarts: int = 0, ckpt: float | None = None, held: bool = False,
        excluded: tuple[str, ...] = (), begin_wait: bool = False) -> JobView:
    if job_class is None:
        job_class = {"auto": "guaranteed", "none": "none"}.get(requested, requested)
    if state == "RUNNING" and node is None:
        node = "n1"
    if state == "RUNNING" and start is None:
        start = submit + 1.0
    return JobView(job_id, account, "u", state, requested, job_class, gpus, node, submit, start, restarts, ckpt, held,
                   excluded, begin_wait)


def gpu(index: int, *, used_gib: float = 0.0, total_gib: float = 80.0, util: float = 0.0,
        g: tuple[str, ...] = (), o: tuple[str, ...] = (), progress: dict | None = None,
        crawling: dict | None = None, measured: bool = True) -> GpuView:
    return GpuView(index, int(total_gib * GiB), int(used_gib * GiB), util, g, o,
                   tuple((progress or {}).items()), tuple((crawling or {}).items()), measured)


def node(name: str = "n1", gpus: tuple[GpuView, ...] | None = None, *, configured: int = 8, in_slurm: int = 8,
         reported: float | None = NOW - 1, unhealthy: str = "") -> NodeView:
    if gpus is None:
        gpus = tuple(gpu(i) for i in range(4))
    return NodeView(name, gpus, configured, in_slurm, reported, unhealthy)


def snap(jobs=(), nodes=None, quotas=None, needs=(), now: float = NOW) -> Snapshot:
    if nodes is None:
        nodes = ()
    return Snapshot(now, tuple(jobs), tuple(nodes), dict(quotas or {}), tuple(needs))


def need(job_id: str, node_name: str = "n1", gpu_index: int = 0, since: float = NOW - 2) -> PreemptNeed:
    return PreemptNeed(node_name, gpu_index, job_id, "memory", since)


def synthetic_cluster(n_nodes: int = 1250, gpus_per_node: int = 8, n_jobs: int = 5000, seed: int = 0,
                      now: float = 1_700_000_000.0) -> Snapshot:
    """A busy cluster for the cycle benchmark: guaranteed and opportunistic jobs spread over the GPUs,
    a queue of pending jobs over and under quota, some preemption needs, GRES counts out of date."""
    import random

    rng = random.Random(seed)
    tenants = [f"t{i}" for i in range(20)]
    gpu_jobs: list[tuple[list[str], list[str]]] = [([], []) for _ in range(n_nodes * gpus_per_node)]
    jobs: list[JobView] = []
    n_running_g, n_running_o = n_jobs * 5 // 10, n_jobs * 3 // 10
    # Quotas around each tenant's running guaranteed share: some tenants have room, some are over.
    share = n_running_g / len(tenants)
    quotas = {t: rng.randint(int(share * 0.7), int(share * 1.4) + 1) for t in tenants}
    for i in range(n_jobs):
        jid = str(100_000 + i)
        acct = rng.choice(tenants)
        submit = now - rng.uniform(60, 86_400)
        if i < n_running_g + n_running_o:
            guaranteed = i < n_running_g
            g = rng.randrange(len(gpu_jobs))
            (gpu_jobs[g][0] if guaranteed else gpu_jobs[g][1]).append(jid)
            start = submit + rng.uniform(0, 60)
            ckpt = start + rng.uniform(0, now - start) if rng.random() < 0.7 else None
            jobs.append(JobView(jid, acct, "u", "RUNNING", rng.choice(("auto", "guaranteed" if guaranteed else "opportunistic")),
                                "guaranteed" if guaranteed else "opportunistic", 1, f"node{g // gpus_per_node:05d}",
                                submit, start, rng.randint(0, 2), ckpt, False))
        else:
            requested = rng.choice(("auto", "guaranteed", "opportunistic"))
            cls = "guaranteed" if requested == "auto" else requested
            jobs.append(JobView(jid, acct, "u", "PENDING", requested, cls, rng.randint(1, 4), None, submit, None, 0,
                                None, requested == "guaranteed" and rng.random() < 0.5))
    nodes = []
    for n in range(n_nodes):
        gpus = tuple(
            GpuView(k, 80 * GiB, rng.randint(0, 80) * GiB, rng.random(), tuple(gpu_jobs[n * gpus_per_node + k][0]),
                    tuple(gpu_jobs[n * gpus_per_node + k][1]))
            for k in range(gpus_per_node))
        nodes.append(NodeView(f"node{n:05d}", gpus, 2 * gpus_per_node, rng.randint(0, 2 * gpus_per_node),
                              None if rng.random() < 0.02 else now - rng.uniform(0, 5)))
    needs = []
    for gi, (g, o) in enumerate(gpu_jobs):
        if g and o and len(needs) < 50:
            needs.append(PreemptNeed(f"node{gi // gpus_per_node:05d}", gi % gpus_per_node, g[0], "memory", now - 1))
    return Snapshot(now, tuple(jobs), tuple(nodes), quotas, tuple(needs))
