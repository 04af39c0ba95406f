"""The GPU proof's curves as pictures, beside ``gpu.json`` (``antman bench gpu``, or afterwards
``python -m slurm_antman.lab.bench.gpu_plots GPU_JSON OUT_DIR`` on a report already written):

- ``interference.png``: the guaranteed job's slowdown against the opportunistic neighbour's compute
  share, one curve per duty cycle of the guaranteed job, measured (solid) and the workload model's
  formula (dashed);
- ``slots.png``: each way of sharing the GPU (the duty throttle at each share, slot filling) as the
  opportunistic job's progress against the guaranteed job's slowdown, beside the node loop's 2 % line.

matplotlib is optional (the GPU machine's image has it): without it nothing is drawn."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional


def _part(doc: dict, name: str) -> Optional[dict]:
    for part in doc.get("parts") or []:
        if isinstance(part, dict) and part.get("name") == name and isinstance(part.get("results"), dict):
            return part["results"]
    return None


def interference_series(doc: dict) -> list[dict]:
    """Per duty: shares, measured slowdowns and the formula's, from the interference part's sweep."""
    res = _part(doc, "interference") or {}
    out = []
    for s in (res.get("sweep") or {}).get("series") or []:
        rows = [r for r in s.get("rows") or [] if isinstance(r.get("share"), (int, float))
                and isinstance(r.get("slowdown"), (int, float))]
        if rows:
            rows.sort(key=lambda r: r["share"])
            out.append({"duty": s.get("duty"), "share": [r["share"] for r in rows],
                        "slowdown": [r["slowdown"] for r in rows],
                        "formula": [r.get("formula_slowdown") for r in rows]})
    return out


def slot_modes(doc: dict) -> list[dict]:
    """Each sharing mode of the slots part but ``alone``: the opportunistic progress and the guaranteed
    slowdown it gave."""
    res = (_part(doc, "slots") or {}).get("slots") or {}
    return [{"mode": name, "progress": m["opportunistic_progress"], "slowdown": m["guaranteed_slowdown"]}
            for name, m in (res.get("modes") or {}).items()
            if name != "alone" and isinstance(m, dict)
            and isinstance(m.get("opportunistic_progress"), (int, float))
            and isinstance(m.get("guaranteed_slowdown"), (int, float))]


def write_plots(doc: dict, out_dir: str | Path) -> list[str]:
    """The pictures the report's parts allow; the paths written (none without matplotlib)."""
    series, modes = interference_series(doc), slot_modes(doc)
    if not series and not modes:
        return []
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out_dir)
    written: list[str] = []
    gpu = (doc.get("environment") or {}).get("gpu_name") or (doc.get("environment") or {}).get("gpu") or ""
    if series:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in series:
            line, = ax.plot(s["share"], s["slowdown"], "o-", label=f"duty {s['duty']:g} measured")
            if all(isinstance(f, (int, float)) for f in s["formula"]):
                ax.plot(s["share"], s["formula"], "--", color=line.get_color(), label=f"duty {s['duty']:g} formula")
        ax.set_xscale("log")
        ax.set_xlabel("opportunistic job's compute share")
        ax.set_ylabel("guaranteed job's step time / alone")
        ax.set_title(f"interference {gpu}".strip(), fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "interference.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    if modes:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in modes:
            ax.plot([m["progress"]], [m["slowdown"]], "o")
            ax.annotate(m["mode"], (m["progress"], m["slowdown"]), textcoords="offset points", xytext=(6, 4),
                        fontsize=9)
        ax.axhline(1.02, color="grey", lw=0.6, ls="--")
        ax.set_xlabel("opportunistic job's progress (its steps / alone)")
        ax.set_ylabel("guaranteed job's step time / alone (dashed: the loop's 2 %)")
        ax.set_title(f"sharing one GPU: duty throttle and slot filling {gpu}".strip(), fontsize=10)
        fig.tight_layout()
        path = out / "slots.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m slurm_antman.lab.bench.gpu_plots GPU_JSON OUT_DIR", file=sys.stderr)
        return 2
    try:
        doc: Any = json.loads(Path(args[0]).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"gpu_plots: {args[0]}: {e}", file=sys.stderr)
        return 2
    Path(args[1]).mkdir(parents=True, exist_ok=True)
    for path in write_plots(doc, args[1]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
