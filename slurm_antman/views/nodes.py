"""``antman nodes [--json]``: every node with Slurm's state and GRES, and every GPU with the memory,
utilisation and jobs its sidecar reports (through the coordinator's query endpoint, or this host's
sidecar sockets as root: views/live.py). A node whose sidecar does not answer is still listed, with
``sidecar: false`` and ``gpus: null``; its jobs then come from Slurm alone. A GPU's telemetry is
everyone's, as ``scontrol show node`` is; the numbers of a job on it are its owner's and the admins'
(null, with ``visible: false``, for anyone else). ``live`` says where the numbers came from."""

from __future__ import annotations

import argparse
from typing import Any

from ..slurm import Job, Node, default_backend
from .live import gather
from .squeue import HOLDING_STATES, console, load_config, show, warn_unlive

_DETAILS = ("mem_used_bytes", "mem_limit_bytes", "compute_share", "iteration_ms", "paused")


def _gpu_job(jid: str, live: dict[str, Any]) -> dict[str, Any]:
    js = live.get(jid)
    visible = js is not None and getattr(js, "visible", True)
    out: dict[str, Any] = {"job_id": int(jid), "class": js.job_class if js is not None else None, "visible": visible}
    out.update({k: getattr(js, k) if visible else None for k in _DETAILS})
    return out


def rows(nodes: list[Node], jobs: list[Job], states: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for n in nodes:
        st = states.get(n.name)
        slurm_jobs = [{"job_id": j.job_id, "class": j.antman_class, "gpus": j.gpus_by_node.get(n.name, [])}
                      for j in jobs if j.state in HOLDING_STATES and n.name in j.nodes]
        row: dict[str, Any] = {
            **n.to_json(), "sidecar": st is not None, "telemetry": st.telemetry if st else None,
            "jobs": slurm_jobs, "gpus": None, "live": getattr(st, "source", "sidecar") if st else None,
        }
        if st is not None:
            live = {js.job_id: js for js in st.jobs}
            row["gpus"] = [{
                "index": g.index, "memory_used_bytes": g.memory_used_bytes,
                "memory_total_bytes": g.memory_total_bytes, "utilization": g.utilization,
                "utilization_avg": g.utilization_avg,
                "jobs": [_gpu_job(jid, live) for jid in g.jobs],
            } for g in st.gpus]
        out.append(row)
    return out


def collect(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = load_config(args)
    backend = default_backend(gres_name=cfg.slurm.gpu_gres if cfg else "gpu")
    nodes = backend.nodes()
    jobs = backend.jobs()
    states, problem = gather(cfg, [n.name for n in nodes], "nodes")
    out = rows(nodes, jobs, states)
    warn_unlive("nodes", problem, any(r["gpus"] is None for r in out))
    return out


def _gres(d: dict[str, int]) -> str:
    return ",".join(f"{k}:{v}" for k, v in d.items()) or "-"


def render_table(data: list[dict[str, Any]]) -> None:
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("NODE", "STATE", "GRES (USED/TOTAL)", "TELEMETRY", "GPU", "MEM USED/TOTAL", "UTIL", "JOBS"):
        t.add_column(col, no_wrap=True)
    for r in data:
        state = "+".join([r["state"], *r["state_flags"]])
        gres = f"{_gres(r['gres_used'])} / {_gres(r['gres'])}"
        if r["gpus"] is None:
            jobs = " ".join(f"{j['job_id']}({j['class']})" for j in r["jobs"]) or "-"
            t.add_row(r["name"], state, gres, "no sidecar", "-", "-", "-", jobs)
            continue
        for k, g in enumerate(r["gpus"]):
            mem = f"{g['memory_used_bytes'] / 2**30:.1f}G/{g['memory_total_bytes'] / 2**30:.1f}G"
            jobs = " ".join(f"{j['job_id']}({j['class'] or '?'})" for j in g["jobs"]) or "-"
            first = k == 0
            t.add_row(r["name"] if first else "", state if first else "", gres if first else "",
                      r["telemetry"] if first else "", str(g["index"]), mem, f"{g['utilization'] * 100:.0f}%", jobs)
    console().print(t)


def main(args: argparse.Namespace) -> int:
    return show(collect(args), args.json, render_table)
