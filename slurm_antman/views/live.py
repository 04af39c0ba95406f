"""Where the views get their live numbers: the coordinator's query endpoint first (any user, any host
that reaches it: each user sees the details of their own jobs), then this host's sidecar control
sockets for nodes the coordinator said nothing about (root on the node: the sockets are root's).

Both sources become :class:`LiveNode`: one shape for the views, with ``visible`` false on a job
whose details the caller may not see.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

from slurm_antman.clients import coordinator_query

SIDECAR_TIMEOUT_S = 1.0

COORDINATOR = "coordinator"
SIDECAR = "sidecar"


@dataclass
class LiveJob:
    job_id: str
    job_class: str
    gpus: list[int]
    visible: bool
    mem_limit_bytes: Optional[int]
    mem_used_bytes: Optional[int]
    compute_share: Optional[float]
    iteration_ms: Optional[float]
    paused: Optional[bool]


@dataclass
class LiveGpu:
    index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float
    utilization_avg: float
    jobs: list[str]


@dataclass
class LiveNode:
    node: str
    source: str                 # COORDINATOR or SIDECAR
    telemetry: Optional[str]
    gpus: list[LiveGpu]
    jobs: list[LiveJob]


def from_sidecar(st: Any) -> LiveNode:
    """A ``node_state_reply`` (root on the node: every job's details)."""
    return LiveNode(
        node=st.node, source=SIDECAR, telemetry=st.telemetry,
        gpus=[LiveGpu(g.index, g.memory_used_bytes, g.memory_total_bytes, g.utilization, g.utilization_avg,
                      list(g.jobs)) for g in st.gpus],
        jobs=[LiveJob(js.job_id, js.job_class, list(js.gpus), True, js.mem_limit_bytes, js.mem_used_bytes,
                      js.compute_share, js.iteration_ms, bool(getattr(js, "paused", False))) for js in st.jobs])


def _job(q: Any) -> LiveJob:
    return LiveJob(q.job_id, q.job_class, list(q.gpus), q.visible, q.mem_limit_bytes, q.mem_used_bytes,
                   q.compute_share, q.iteration_ms, q.paused)


def from_query_node(n: Any) -> LiveNode:
    """A ``query_nodes_reply`` node. The coordinator has the window's average utilisation only: both
    utilisation fields carry it."""
    return LiveNode(node=n.node, source=COORDINATOR, telemetry=n.telemetry,
                    gpus=[LiveGpu(g.index, g.memory_used_bytes, g.memory_total_bytes, g.utilization, g.utilization,
                                  list(g.jobs)) for g in n.gpus],
                    jobs=[_job(j) for j in n.jobs])


def from_query_jobs(rows: list) -> dict[str, LiveNode]:
    out: dict[str, LiveNode] = {}
    for q in rows:
        out.setdefault(q.node, LiveNode(q.node, COORDINATOR, None, [], [])).jobs.append(_job(q))
    return out


def sidecar_dir(cfg: Any, node: str) -> Optional[str]:
    """Where ``node``'s sidecar control socket lives, if this host can reach it.

    Several nodes on one host (the devcluster) each use ``SOCKET_DIR/NODE``; on a real node the
    sidecar uses ``SOCKET_DIR`` itself, reachable only from that node.
    """
    from slurm_antman import protocol

    root = cfg.sidecar.socket_dir
    per_node = os.path.join(root, node)
    if _usable(protocol.control_path(per_node)):
        return per_node
    if node == socket.gethostname().split(".")[0] and _usable(protocol.control_path(root)):
        return root
    return None


def _usable(path: str) -> bool:
    # Connecting to a unix socket takes write permission on it: without, a try only costs a timeout.
    return os.path.exists(path) and os.access(path, os.W_OK)


def sidecar_states(cfg: Any, nodes: list[str], timeout_s: float = SIDECAR_TIMEOUT_S) -> dict[str, Any]:
    """``node_state`` of each node's sidecar; nodes whose sidecar does not answer are left out."""
    if cfg is None:
        return {}
    from slurm_antman.clients import sidecar_control as client

    out: dict[str, Any] = {}
    for node in dict.fromkeys(nodes):
        d = sidecar_dir(cfg, node)
        if d is None:
            continue
        try:
            out[node] = client.node_state(d, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - unreachable, refusing or garbled: all mean "no live numbers"
            continue
    return out


def gather(cfg: Any, nodes: list[str], want: str = "jobs") -> tuple[dict[str, LiveNode], Optional[str]]:
    """Live numbers of ``nodes`` by node, and why the coordinator could not give them (None when it did,
    or is not configured). ``want``: ``jobs`` (what squeue needs) or ``nodes`` (GPUs too)."""
    if cfg is None:
        return {}, None
    out: dict[str, LiveNode] = {}
    problem = None
    address = coordinator_query.address_of(cfg)
    if address is not None and nodes:
        try:
            if want == "nodes":
                _, got = coordinator_query.nodes(address)
                out = {n.node: from_query_node(n) for n in got}
            else:
                _, rows = coordinator_query.jobs(address)
                out = from_query_jobs(rows)
        except coordinator_query.QueryError as e:
            problem = str(e)
    missing = [n for n in dict.fromkeys(nodes) if n not in out]
    for node, st in sidecar_states(cfg, missing).items():
        out[node] = from_sidecar(st)
    return out, problem
