"""``antman bench trade``: one picture of several ``bench simulate`` runs of the same trace: each policy's
mean JCT against its guaranteed jobs' run time over their work, with the ``--perturb`` range where the
run has one. The runs may differ in settings (``shared`` at its best slot count beside antman at its
own): a point is labelled with the policy, and with the slot count where the runs differ in it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from slurm_antman.lab.evaluation.report import PLOT_HINT, trade_plot, trade_points


def points_from(paths: list[str]) -> list[dict]:
    """The trade points of the results.json files ``paths`` (``bench simulate --out``), in order."""
    docs = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a results.json of antman bench simulate ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("policies"), dict):
            raise ValueError(f"{path}: not a results.json of antman bench simulate (no \"policies\")")
        docs.append(doc)
    traces = {(d.get("meta") or {}).get("trace") for d in docs}
    if len(traces) > 1:
        raise ValueError(f"the runs replay different traces ({', '.join(sorted(map(str, traces)))}): "
                         "one picture compares policies on one trace")
    slots = {(d.get("meta") or {}).get("slots_per_gpu") for d in docs}
    out = []
    for d in docs:
        meta = d.get("meta") or {}
        runs = [SimpleNamespace(policy=name, metrics=m) for name, m in d["policies"].items()]
        for p in trade_points(runs, meta.get("perturbed")):
            if len(slots) > 1 and p["policy"] in ("shared", "antman"):
                p["policy"] = f"{p['policy']} @{meta.get('slots_per_gpu')}"
            out.append(p)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="antman bench trade", description=__doc__)
    p.add_argument("results", nargs="+", help="results.json files written by antman bench simulate --out")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--title", default="", help="the picture's title")
    a = p.parse_args(argv)
    try:
        points = points_from(a.results)
    except ValueError as e:
        print(f"antman bench trade: {e}", file=sys.stderr)
        return 2
    if not points:
        print("antman bench trade: no run has guaranteed jobs with a run time over work", file=sys.stderr)
        return 2
    try:
        trade_plot(points, Path(a.out), ranged=any(pt["x_range"][0] != pt["x_range"][1] for pt in points),
                   title=a.title)
    except ImportError:
        print(f"antman bench trade: {PLOT_HINT}", file=sys.stderr)
        return 2
    for pt in points:
        print(f"{pt['policy']:<14} mean JCT {pt['y']:>10,.0f} s [{pt['y_range'][0]:,.0f}, {pt['y_range'][1]:,.0f}]"
              f"   guaranteed run time / work {pt['x']:.3f} [{pt['x_range'][0]:.3f}, {pt['x_range'][1]:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
