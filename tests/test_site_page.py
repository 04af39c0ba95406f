"""The results page of a replay (``antman bench simulate --out DIR`` writes DIR/report.md): its first
lines answer the site's question from the very numbers of results.json, and it says what it could not
know."""

from __future__ import annotations

import json
import re

from slurm_antman.lab.bench import simulate as bench_simulate
from slurm_antman.lab.evaluation import site_page
from test_simulator_speed import random_trace


def _mean(doc: dict, policy: str, key: str) -> float:
    return doc["meta"]["perturbed"][policy]["metrics"][key]["mean"]


def test_the_page_answers_from_the_results_it_sits_beside(tmp_path, capsys):
    random_trace(tmp_path, 5, n=60)
    out = tmp_path / "out"
    argv = ["--trace", str(tmp_path / "t5.csv"), "--nodes", "3", "--gpus", "4", "--policy", "all", "--perturb", "3",
            "--out", str(out)]
    assert bench_simulate.main(argv) == 0
    assert f"the results page: {out / 'report.md'}" in capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    page = (out / "report.md").read_text()
    assert page.startswith("# What antman would buy this cluster\n")
    # The answer: antman's mean JCT over the best baseline's, both means over the three cycles.
    base = {p: _mean(doc, p, "jct_mean_s") for p in ("exclusive", "quota", "scavenger", "shared")}
    best = min(base, key=base.get)
    ratio = _mean(doc, "antman", "jct_mean_s") / base[best]
    m = re.search(r"mean job completion time is ([0-9.]+)x that of the best Slurm policy replayed\*\* \(`(\w+)`", page)
    assert m and m.group(2) == best and float(m.group(1)) == round(ratio, 3), page[:800]
    g = _mean(doc, "antman", "guaranteed_run_stretch_mean")
    assert f"Its guaranteed jobs run {g:.3f}x their time alone" in page
    # One row per policy, antman's mean JCT in hours with its range over the cycles.
    rows = {r.split("|")[1].strip(" `"): r for r in page.splitlines() if r.startswith("| `")}
    assert set(rows) == {"exclusive", "quota", "scavenger", "shared", "antman"}
    spread = doc["meta"]["perturbed"]["antman"]["metrics"]["jct_mean_s"]
    assert f"{spread['mean'] / 3600:,.2f}" in rows["antman"]
    lo, hi = f"{spread['min'] / 3600:,.2f}", f"{spread['max'] / 3600:,.2f}"
    assert (f"[{lo}, {hi}]" in rows["antman"]) == (lo != hi), rows["antman"]
    # The pictures it shows are there; the caveats and the command that remakes it.
    for name in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page):
        assert (out / name).is_file(), name
    assert "the history holds neither" in page and "each policy ran 3 times" in page
    assert "antman bench simulate --trace " in page and "--perturb 3" in page


def _doc(**means) -> dict:
    meta = {"jobs": 10, "trace": "t.csv", "nodes": 2, "gpus_per_node": 4, "gpu_mem_gib": 32, "utilisation": "production",
            "util_scale": 1.0, "quota_scale": 1.0}
    return {"meta": meta, "policies": {p: {"jct_mean_s": v, "jct_floor_mean_s": 1000.0,
                                           "guaranteed_run_stretch_mean": 1.0 if p == "antman" else 1.5}
                                       for p, v in means.items()}}


def test_a_loss_is_said_as_plainly_as_a_win():
    lines = " ".join(site_page.answer(_doc(exclusive=4000.0, shared=3000.0, antman=3300.0)))
    assert "1.100x that of the best Slurm policy replayed** (`shared`" in lines and "longer" in lines
    assert "goes -15% of the way from `shared`" in lines and "worse than it" in lines
    lines = " ".join(site_page.answer(_doc(exclusive=4000.0, antman=2500.0)))
    assert "0.625x" in lines and "shorter" in lines and "goes 50% of the way" in lines
    assert "replay antman and at least one slurm policy" in " ".join(site_page.answer(_doc(exclusive=1.0))).lower()


def test_a_sites_own_history_is_named_with_what_was_left_out_and_where_the_shape_came_from():
    doc = _doc(exclusive=4000.0, antman=3000.0)
    doc["meta"].update(sacct_skipped={"no_gpu": 7, "never_ran": 2, "still_running": 1},
                       shape_from_slurm={"nodes": 2, "gpus_per_node": 4}, quotas_from_slurm={"a": 2, "b": 1})
    page = site_page.page(doc, files=())
    assert "7 no gpu" in page and "2 never ran" in page and "1 still running" in page
    assert "as `scontrol show nodes` shows it" in page and "`GrpTRES=gres/gpu=N` (2 accounts)" in page
    assert "## Pictures" not in page  # none written: none shown
