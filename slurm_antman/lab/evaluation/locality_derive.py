"""Re-derive ``locality_data.MEASURED`` and ``locality_data.ONE_NODE_SPEEDUP`` from Pollux's published
placement traces.

Pollux's simulator traces live on the ``osdi21-artifact`` branch of petuum/adaptdl, not on master::

    git clone https://github.com/petuum/adaptdl
    git -C adaptdl checkout c793c7089bd307462686339d29707925c461f9a9
    python -m slurm_antman.lab.evaluation.locality_derive adaptdl/simulator/traces          # print
    python -m slurm_antman.lab.evaluation.locality_derive adaptdl/simulator/traces --check  # compare

The first prints the ``MEASURED`` and ``ONE_NODE_SPEEDUP`` literals to paste into ``locality_data.py``;
``--check`` exits 1 if either literal there differs from what the CSVs give. The derivations are
described in ``locality_data``'s docstring; this file is their only implementation. Standard library only, so it
runs without the project's dependencies.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import sys
from collections import defaultdict
from typing import Iterable, NamedTuple, TextIO, Union

# Pollux's testbed nodes (g4dn.12xlarge, benchmark/main.tf on the same branch) held 4 GPUs; every
# placement in the traces has at most 4 GPUs per node.
POLLUX_GPUS_PER_NODE = 4
HEADER = ("placement", "local_bsz", "step_time", "sync_time")
DIGITS = 3  # already finer than the traces' noise (yolov3 steps slower at batch 6 than 8); more is false precision

Table = dict[tuple[int, int], float]
Speedups = dict[int, float]  # {gpus on one node: throughput over one GPU's}


class Row(NamedTuple):
    placement: str  # GPUs per node, one digit a node: "1111" = 4 nodes x 1 GPU
    local_bsz: int
    step_time: float  # seconds per iteration, gradient synchronisation included
    sync_time: float  # the part of step_time spent synchronising gradients

    @property
    def gpus(self) -> int:
        return sum(int(c) for c in self.placement)

    @property
    def nodes(self) -> int:
        return len(self.placement)


def parse_placements(source: Union[str, TextIO], name: str = "placements.csv") -> list[Row]:
    """The rows of a Pollux ``placements.csv`` (its text, or an open file). Raises ValueError on a
    header other than Pollux's or on a row that is not a placement with a positive step time."""
    f = io.StringIO(source) if isinstance(source, str) else source
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != HEADER:
        raise ValueError(f"{name}: header {header!r} is not Pollux's {','.join(HEADER)}")
    rows = []
    for lineno, rec in enumerate(reader, start=2):
        if not rec or all(not c.strip() for c in rec):
            continue
        try:
            placement, bsz, step, sync = (c.strip() for c in rec)
            row = Row(placement, int(bsz), float(step), float(sync))
        except ValueError as e:
            raise ValueError(f"{name}:{lineno}: {rec!r}: {e}") from None
        # A zero digit would be a node with no GPU; Pollux writes placements without them.
        if not placement.isdigit() or "0" in placement or row.local_bsz < 1 or not row.step_time > 0:
            raise ValueError(f"{name}:{lineno}: {rec!r} is not a placement with a positive step time")
        rows.append(row)
    return rows


def reference_gpus(gpus: int) -> int:
    """GPUs of the single-node placement a ``gpus``-GPU job is compared with: the job itself packed
    on one node, or for a job larger than a node, one full node (no single-node measurement of more
    GPUs exists, and a full node is the most GPUs Pollux measured with no network between them)."""
    return min(gpus, POLLUX_GPUS_PER_NODE)


def derive(rows: Iterable[Row]) -> Table:
    """{(gpus, nodes): efficiency} for every multi-node (gpus, nodes) the rows measure.

    Per-GPU throughput is local_bsz / step_time (Pollux's own simulator takes step_time as the
    iteration time, sync included). Placements with the same (gpus, nodes), e.g. "13" and "22", are
    averaged first, step time by step time, as Pollux's simulator does for a placement it did not
    measure. At each local batch size measured for both, efficiency = reference step time / spread
    step time (same batch, so the ratio of per-GPU throughputs), the reference being the single-node
    placement of ``reference_gpus(gpus)`` GPUs; the table keeps the median over those batch sizes."""
    steps: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for r in rows:
        if r.gpus > r.nodes * POLLUX_GPUS_PER_NODE:
            raise ValueError(f"placement {r.placement}: more than {POLLUX_GPUS_PER_NODE} GPUs on a node")
        steps[(r.gpus, r.nodes, r.local_bsz)].append(r.step_time)
    mean = {k: statistics.fmean(v) for k, v in steps.items()}
    bsz_of: dict[tuple[int, int], set[int]] = defaultdict(set)
    for g, n, b in mean:
        bsz_of[(g, n)].add(b)
    table: Table = {}
    for g, n in sorted(bsz_of):
        ref = reference_gpus(g)
        common = sorted(bsz_of[(g, n)] & bsz_of.get((ref, 1), set()))
        if n > 1 and common:
            ratios = [mean[(ref, 1, b)] / mean[(g, n, b)] for b in common]
            table[(g, n)] = round(statistics.median(ratios), DIGITS)
    return table


def derive_one_node(rows: Iterable[Row]) -> Speedups:
    """{gpus: speedup} for every one-node placement the rows measure: throughput (local_bsz x gpus /
    step_time) over one GPU's. The same method as ``derive``: step times of one (gpus, batch) are
    averaged, the ratio is taken at each local batch size measured for both, and the median over
    those batches kept. At one batch the speedup is gpus x one GPU's step time / the placement's."""
    steps: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in rows:
        if r.nodes == 1:
            if r.gpus > POLLUX_GPUS_PER_NODE:
                raise ValueError(f"placement {r.placement}: more than {POLLUX_GPUS_PER_NODE} GPUs on a node")
            steps[(r.gpus, r.local_bsz)].append(r.step_time)
    mean = {k: statistics.fmean(v) for k, v in steps.items()}
    bsz_of: dict[int, set[int]] = defaultdict(set)
    for g, b in mean:
        bsz_of[g].add(b)
    out: Speedups = {}
    for g in sorted(bsz_of):
        common = sorted(bsz_of[g] & bsz_of.get(1, set()))
        if common:
            out[g] = round(statistics.median(g * mean[(1, b)] / mean[(g, b)] for b in common), DIGITS)
    return out


def read_all(traces_dir: str) -> dict[str, list[Row]]:
    """{workload: rows} for every subdirectory of ``traces_dir`` holding a placements.csv."""
    out = {}
    for w in sorted(os.listdir(traces_dir)):
        path = os.path.join(traces_dir, w, "placements.csv")
        if os.path.isfile(path):
            with open(path, newline="") as f:
                out[w] = parse_placements(f, path)
    if not out:
        raise ValueError(f"{traces_dir}: no <workload>/placements.csv under it (want adaptdl's simulator/traces)")
    return out


def derive_all(traces_dir: str) -> dict[str, Table]:
    """{workload: table} for every subdirectory of ``traces_dir`` holding a placements.csv."""
    return {w: derive(rows) for w, rows in read_all(traces_dir).items()}


def format_literal(tables: dict[str, Table]) -> str:
    """The ``MEASURED`` assignment as it stands in locality_data.py, one line per GPU count: the
    text is what gets pasted, so that a re-derivation shows up as a readable diff."""
    lines = ["MEASURED: dict[str, dict[tuple[int, int], float]] = {"]
    for w, table in tables.items():
        lines.append(f'    "{w}": {{')
        for g in sorted({g for g, _ in table}):
            items = ", ".join(f"({g}, {n}): {table[(g, n)]!r}" for gg, n in sorted(table) if gg == g)
            lines.append(f"        {items},")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def format_speedup_literal(speedups: dict[str, Speedups]) -> str:
    """The ``ONE_NODE_SPEEDUP`` assignment as it stands in locality_data.py, one line per workload."""
    lines = ["ONE_NODE_SPEEDUP: dict[str, dict[int, float]] = {"]
    for w, s in speedups.items():
        lines.append(f'    "{w}": {{' + ", ".join(f"{g}: {s[g]!r}" for g in sorted(s)) + "},")
    lines.append("}")
    return "\n".join(lines)


def _diff(got: dict, have: dict) -> list[str]:
    out = []
    for w in sorted(set(got) | set(have)):
        a, b = got.get(w, {}), have.get(w, {})
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"{w} {k}: CSVs give {a.get(k)}, locality_data has {b.get(k)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces_dir", help="adaptdl's simulator/traces (branch osdi21-artifact)")
    ap.add_argument("--check", action="store_true",
                    help="compare with locality_data's literals; exit 1 on a difference")
    args = ap.parse_args(argv)
    try:
        rows = read_all(args.traces_dir)
        tables = {w: derive(r) for w, r in rows.items()}
        speedups = {w: derive_one_node(r) for w, r in rows.items()}
    except (OSError, ValueError) as e:
        print(f"locality_derive: {e}", file=sys.stderr)
        return 2
    if not args.check:
        print(format_literal(tables))
        print()
        print(format_speedup_literal(speedups))
        return 0
    from . import locality_data  # here, so that printing needs nothing but this file

    diffs = _diff(tables, locality_data.MEASURED)
    diffs += [f"one node: {d}" for d in _diff(speedups, locality_data.ONE_NODE_SPEEDUP)]
    for d in diffs:
        print(d)
    if not diffs:
        print(f"locality_data.MEASURED matches the CSVs ({sum(map(len, tables.values()))} entries), "
              f"and ONE_NODE_SPEEDUP too ({sum(map(len, speedups.values()))} entries)")
    return 1 if diffs else 0

if __name__ == "__main__":
    sys.exit(main())
