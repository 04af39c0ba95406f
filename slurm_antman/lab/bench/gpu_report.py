"""``gpu.json`` and ``gpu.md`` of ``antman bench gpu``: both rewritten after every part, so a run cut
short (the GPU node's 10-minute command limit, a crash) keeps the parts that finished.

``gpu.json`` is the whole record: the environment, and per part its status, the reason for any
status but ``passed``, its checks (value measured, rule expected), its numbers and its summary lines.
``gpu.md`` is the same for a reader: a table of the parts, then each part's checks and summary.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .gpu_part import write_json

# passed: every check held; failed: a check did not hold (the numbers are the finding); error: the
# part raised or its process died; timeout: killed at its budget (what it recorded is kept);
# skipped: could not run here (the reason says why).
STATUSES = ("passed", "failed", "error", "timeout", "skipped")

FORMAT_VERSION = 1


def write_reports(doc: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "gpu.json")
    md_path = os.path.join(out_dir, "gpu.md")
    write_json(json_path, doc)
    tmp = md_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(markdown(doc))
    os.replace(tmp, md_path)
    from .gpu_plots import write_plots  # matplotlib only where it is installed, as on the GPU machine

    write_plots(doc, out_dir)
    return json_path, md_path


def markdown(doc: dict) -> str:
    env = doc.get("environment", {})
    lines = [f"# GPU proof: `antman bench gpu` ({doc.get('date', '?')})", ""]
    lines.append(f"Command: `{doc.get('command', '?')}`  ")
    lines.append(f"GPU: {env.get('gpu') or 'none'}; driver {env.get('driver') or '-'}; torch "
                 f"{env.get('torch') or '-'} (CUDA {env.get('cuda') or '-'}); Python {env.get('python') or '-'}; "
                 f"host {env.get('host') or '-'}  ")
    lines.append(f"Budget {doc.get('budget_s', 0):.0f} s; took {doc.get('elapsed_s', 0):.0f} s"
                 + ("" if doc.get("complete") else " (incomplete: still running or cut short)"))
    lines += ["", "| # | part | status | s / budget | checks | reason |", "|---|---|---|---|---|---|"]
    for i, part in enumerate(doc.get("parts", []), 1):
        checks = part.get("checks", [])
        ok = sum(1 for c in checks if c.get("ok"))
        lines.append(f"| {i} | {part['name']} | {part['status']} | {part.get('elapsed_s', 0):.0f} / "
                     f"{part.get('budget_s', 0):.0f} | {ok}/{len(checks)} | {_cell(part.get('reason', ''))} |")
    for i, part in enumerate(doc.get("parts", []), 1):
        lines += ["", f"## {i}. {part.get('title', part['name'])}: {part['status']}", ""]
        if part.get("reason"):
            lines += [part["reason"], ""]
        if part.get("checks"):
            lines += ["| check | result | measured | expected |", "|---|---|---|---|"]
            for c in part["checks"]:
                lines.append(f"| {c['name']} | {'ok' if c['ok'] else 'FAILED'} | {_cell(_short(c['value']))} "
                             f"| {_cell(c['expect'])} |")
            lines.append("")
        for s in part.get("summary", []):
            lines.append(s if s.startswith(("    ", "```")) else f"- {s}")
        if part.get("log"):
            lines += ["", f"Log: `{part['log']}`"]
    return "\n".join(lines).rstrip() + "\n"


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = json.dumps(v, default=str) if not isinstance(v, str) else v
    return text if len(text) <= 120 else text[:117] + "..."


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
