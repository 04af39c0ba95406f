"""The site proof's report: ``site.json`` (every measurement, the NVML samples, the jobs' output) and
``site.md``, the page a reader takes the result from (docs/gpu_runs/ keeps the GPU runs' ones)."""

from __future__ import annotations

import json
import time
from pathlib import Path

GiB = 1 << 30


def write_report(out: Path, rec: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "site.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    tmp.replace(out / "site.json")
    (out / "site.md").write_text(markdown(rec))


def _gib(v) -> str:
    return "-" if v is None else f"{v / GiB:.1f} GiB"


def markdown(rec: dict) -> str:
    gpu = rec.get("gpu") or {}
    m = rec.get("machine", {})
    lp = rec.get("loop", {})
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(rec.get("started_unix", 0)))
    lines = [f"# Site proof: {rec.get('result', 'running')}", "",
             f"{when}, commit {rec.get('commit')}; device: "
             + (f"{gpu.get('name')} ({_gib(gpu.get('memory_bytes'))}, driver {gpu.get('driver')})" if gpu
                else "the devcluster's emulated GPU (CPU only)"),
             f"; {rec.get('slurm_version', 'Slurm not started')}"
             + (" carried into a prefix" if rec.get("slurm_carried") else " as installed")
             + f"; kernel {m.get('kernel')}, cgroup {m.get('cgroup')}, systemd {'running' if m.get('systemd') else 'absent'}"
             + f"; device confinement (ConstrainDevices=yes): {'on' if rec.get('confine_devices') else 'off'}.", ""]
    if rec.get("error"):
        lines += [f"**Stopped:** {rec['error']}", ""]
    lines += ["| check | measured | held |", "|---|---|---|"]
    for name, c in rec.get("checks", {}).items():
        shown = {k: v for k, v in c.items() if k != "ok"}
        held = {True: "yes", False: "**no**", None: "recorded"}[c.get("ok")]
        lines.append(f"| {name} | {_brief(shown)} | {held} |")
    lines += ["", "## The loop", ""]
    if lp.get("alone_ms"):
        lines.append(f"- Guaranteed step time alone {lp['alone_ms']:.1f} ms, beside the opportunistic job "
                     f"{lp['beside_ms']:.1f} ms over {lp['beside_s']:.0f} s ({lp['beside_ms'] / lp['alone_ms'] - 1:+.1%}); "
                     f"opportunistic mean share {lp['mean_share']:.2f}, {lp['opportunistic_step_lines_per_s']:.2f} step lines/s.")
    if "limit_after_bytes" in lp:
        lines.append(f"- Growth: the opportunistic limit {_gib(lp['limit_before_bytes'])} -> {_gib(lp['limit_after_bytes'])}, "
                     f"share {lp['share_before']:.2f} -> {lp['share_lowest']:.2f}.")
    if "burst_to_paused_s" in lp:
        lines.append(f"- Burst to PAUSED {lp['burst_to_paused_s']:.1f} s; burst end to training again "
                     f"{lp.get('burst_end_to_training_s', float('nan')):.1f} s (both as polled, 0.3-2 s apart).")
    if lp.get("resumed_line"):
        lines.append(f"- Requeue: `{lp.get('preempted_line')}`; resumed: `{lp['resumed_line']}`.")
    for key, title in (("squeue_sharing", "antman squeue, sharing"), ("squeue_paused", "antman squeue, paused"),
                       ("explain", "antman explain")):
        if lp.get(key):
            lines += ["", f"### {title}", "", "```", lp[key], "```"]
    lines += ["", "## Left out", ""] + [f"- {x}" for x in rec.get("left_out", [])]
    failed = [x for x in rec.get("attempts", []) if not x.get("ok")]
    for x in failed:
        lines += ["", f"Start with confine_devices={x['confine_devices']} failed:", "", "```", x.get("error", ""),
                  x.get("slurmd_log", ""), "```"]
    return "\n".join(lines) + "\n"


def _brief(d: dict) -> str:
    parts = []
    for k, v in d.items():
        if isinstance(v, float):
            v = f"{v:.3g}"
        elif isinstance(v, list):
            v = f"{len(v)} items"
        parts.append(f"{k} {v}")
    return "; ".join(parts).replace("|", "/")
