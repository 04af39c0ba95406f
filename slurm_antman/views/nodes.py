"""``antman nodes [--json]``: every node with Slurm's state and GRES, and every GPU with the memory,
utilisation and jobs its sidecar reports. A node whose sidecar does not answer is still listed, with
``sidecar: false`` and ``gpus: null``; its jobs then come from Slurm alone."""

from __future__ import annotations

import argparse
from typing import Any

from ..slurm import Job, Node, default_backend
from .squeue import HOLDING_STATES, console, load_config, show, sidecar_states


def rows(nodes: list[Node], jobs: list[Job], states: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for n in nodes:
        st = states.get(n.name)
        slurm_jobs = [{"job_id": j.job_id, "class": j.antman_class, "gpus": j.gpus_by_node.get(n.name, [])}
                      for j in jobs if j.state in HOLDING_STATES and n.name in j.nodes]
        row: dict[str, Any] = {
            **n.to_json(), "sidecar": st is not None, "telemetry": st.telemetry if st else None,
            "jobs": slurm_jobs, "gpus": None,
        }
        if st is not None:
            live = {js.job_id: js for js in st.jobs}
            row["gpus"] = [{
                "index": g.index, "memory_used_bytes": g.memory_used_bytes,
                "memory_total_bytes": g.memory_total_bytes, "utilization": g.utilization,
                "utilization_avg": g.utilization_avg,
                "jobs": [{"job_id": int(jid), "class": live[jid].job_class if jid in live else None}
                         for jid in g.jobs],
            } for g in st.gpus]
        out.append(row)
    return out


def collect(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = load_config(args)
    backend = default_backend(gres_name=cfg.slurm.gpu_gres if cfg else "gpu")
    nodes = backend.nodes()
    jobs = backend.jobs()
    return rows(nodes, jobs, sidecar_states(cfg, [n.name for n in nodes]))


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
