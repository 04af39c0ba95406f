"""``antman bench gpu`` (docs/gpu_proof.md): the runner, the reports and the wheel step on CPU; the GPU proof's
claims under ``@pytest.mark.gpu`` (they run each part the way the bench does, in its own process,
and assert on what it measured; without CUDA they skip)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from slurm_antman.lab.bench import gpu, gpu_report, wheels
from slurm_antman.lab.bench.gpu import BY_NAME, PARTS, Part, Requirements, budgets, plan, run_all

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is false)")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour: every part skipped")


def _no_needs() -> Requirements:
    return Requirements({k: (lambda: None) for k in gpu.NEEDS})


# --- plan, flags, budgets -------------------------------------------------------------------------


def test_plan_lists_every_part_in_the_issues_order_with_its_budget():
    text = plan(PARTS, budgets(PARTS, None), _no_needs())
    lines = text.splitlines()
    assert "8 part(s)" in lines[0] and f"{sum(p.budget_s for p in PARTS):.0f} s in all" in lines[0]
    names = [ln.split()[1] for ln in lines[1:] if ln.strip()[0].isdigit()]
    assert names == ["memory", "spill", "interference", "telemetry", "overhead", "zoo", "pause", "slots"]
    for p in PARTS:
        row = next(ln for ln in lines if ln.split()[1:2] == [p.name])
        assert f"{p.budget_s:.0f} s" in row and p.what[:30] in row
    # Pause exists now: nothing but the machine keeps its part from running.
    from slurm_antman.lab.bench.gpu_pause import missing
    assert missing() is None and "not implemented" not in text


def test_the_default_budget_fits_the_issues_eight_minutes():
    assert sum(p.budget_s for p in PARTS) <= 8 * 60 - 15  # room for the runner's own start-up


def test_budgets_scale_down_together_and_never_up():
    parts = [BY_NAME["memory"], BY_NAME["spill"]]
    assert budgets(parts, None) == [25.0, 40.0]
    assert budgets(parts, 1000) == [25.0, 40.0]
    assert budgets(parts, 32.5) == [12.5, 20.0]


@pytest.mark.parametrize("argv, words", [
    (["--parts", "memory,warp"], ["--parts", "warp", "allowed: memory, spill, interference"]),
    (["--parts", ","], ["--parts", "allowed"]),
    (["--budget-s", "0", "--plan"], ["--budget-s 0", "positive"]),
    (["--budget-s", "-5", "--out", "x"], ["--budget-s -5", "positive"]),
    ([], ["--out DIR is required"]),
])
def test_bad_flags_name_the_flag_and_what_is_allowed(argv, words, capsys):
    assert gpu.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("antman bench gpu: ")
    for w in words:
        assert w in err


def test_the_cli_registers_bench_gpu_like_the_other_benches(capsys):
    from slurm_antman import cli

    assert cli.main(["bench", "gpu", "--plan", "--parts", "spill,memory"]) == 0
    out = capsys.readouterr().out
    assert out.index(" memory ") < out.index(" spill ")  # docs/gpu_proof.md's order, whatever the flag's


# --- a run on CPU ---------------------------------------------------------------------------------


@cpu_only
def test_on_cpu_every_part_skips_with_its_reason_and_both_reports_are_complete(tmp_path, capsys):
    out = tmp_path / "proof"
    assert gpu.main(["--out", str(out)]) == 0
    doc = json.loads((out / "gpu.json").read_text())
    assert doc["complete"] and doc["format"] == gpu_report.FORMAT_VERSION
    assert [p["name"] for p in doc["parts"]] == [p.name for p in PARTS]
    for p in doc["parts"]:
        assert p["status"] == "skipped" and p["reason"] and "\n" not in p["reason"]
    by = {p["name"]: p for p in doc["parts"]}
    assert "no CUDA device" in by["memory"]["reason"] and "no CUDA device" in by["pause"]["reason"]
    md = (out / "gpu.md").read_text()
    for p in PARTS:
        assert f"| {p.name} | skipped |" in md and f"## " in md
    assert "8 skipped" in capsys.readouterr().out


FAKE_PARTS = '''
import os, time
from slurm_antman.lab.bench.gpu_part import PartSkipped

def boom(ctx):
    ctx.put("before", 1)
    raise ValueError("broken on purpose")

def ok(ctx):
    ctx.put("answer", 42)
    ctx.check("holds", True, 42, "42")
    ctx.note("a line")

def crash(ctx):
    ctx.put("before", 2)
    os._exit(3)

def slow(ctx):
    ctx.put("before", 3)
    time.sleep(60)

def wrong(ctx):
    ctx.check("holds", True, 1, "1")
    ctx.check("does not hold", False, 2, "3")

def skip(ctx):
    raise PartSkipped("not here")
'''


def test_a_broken_part_is_recorded_and_the_others_keep_their_results(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "fakeparts.py").write_text(textwrap.dedent(FAKE_PARTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(gpu, "KILL_GRACE_S", 0.5)
    names = ["boom", "ok", "crash", "slow", "wrong", "skip"]
    parts = [Part(n, n.title(), 30.0, f"fakeparts:{n}", (), n) for n in names]
    part_budgets = [30.0, 30.0, 30.0, 1.0, 30.0, 30.0]
    out = tmp_path / "out"
    doc = run_all(parts, part_budgets, str(out), "test", _no_needs(), log=lambda s: None)
    by = {p["name"]: p for p in json.loads((out / "gpu.json").read_text())["parts"]}
    assert list(by) == names and doc["complete"]
    assert by["boom"]["status"] == "error" and "ValueError: broken on purpose" in by["boom"]["reason"]
    assert by["boom"]["results"] == {"before": 1}  # what it measured before breaking is kept
    assert by["ok"]["status"] == "passed" and by["ok"]["results"] == {"answer": 42} and by["ok"]["reason"] == ""
    assert by["crash"]["status"] == "error" and "exited with 3" in by["crash"]["reason"]
    assert by["crash"]["results"] == {"before": 2}
    assert by["slow"]["status"] == "timeout" and "budget of 1 s" in by["slow"]["reason"]
    assert by["slow"]["results"] == {"before": 3}
    assert by["wrong"]["status"] == "failed" and by["wrong"]["reason"] == "check(s) not met: does not hold"
    assert by["skip"]["status"] == "skipped" and by["skip"]["reason"] == "not here"
    assert (out / "logs" / "boom.log").read_text().count("broken on purpose") >= 1
    md = (out / "gpu.md").read_text()
    assert "| does not hold | FAILED | 2 | 3 |" in md and "- a line" in md


def test_the_report_writer_makes_valid_json_and_escapes_markdown(tmp_path):
    doc = {"format": 1, "date": "2026-11-23", "command": "antman bench gpu --out x", "budget_s": 10,
           "elapsed_s": 3.0, "complete": True, "environment": {"gpu": "NVIDIA H100", "torch": "2.11"},
           "parts": [{"name": "spill", "title": "Spill", "status": "failed", "reason": "a | b",
                      "budget_s": 10, "elapsed_s": 3.0, "summary": ["numbers", "```\ntable\n```"],
                      "results": {"nan": math.nan, "inf": math.inf, "t": (1, 2)},
                      "checks": [{"name": "c", "ok": False, "value": 0.123456789, "expect": "x | y"}]}]}
    j, m = gpu_report.write_reports(doc, str(tmp_path))
    back = json.loads(open(j).read())  # strict: NaN would not parse as JSON elsewhere
    assert back["parts"][0]["results"] == {"nan": None, "inf": None, "t": [1, 2]}
    md = open(m).read()
    assert "| 1 | spill | failed | 3 / 10 | 0/1 | a \\| b |" in md
    assert "| c | FAILED | 0.1235 | x \\| y |" in md
    assert "GPU: NVIDIA H100" in md and "- numbers" in md and "```\ntable\n```" in md


def test_the_reports_curves_are_drawn_from_what_an_h100_measured(tmp_path):
    """The interference sweep and the slot-filling modes of the 2026-11-26 H100 runs (docs/gpu_runs/)
    as the pictures the report writes beside gpu.json; a report without those parts draws none."""
    from pathlib import Path

    from slurm_antman.lab.bench import gpu_plots

    runs = Path(__file__).resolve().parent.parent / "docs" / "gpu_runs"
    sweep = json.loads((runs / "2026-11-26-h100-run3-interference.json").read_text())
    series = gpu_plots.interference_series(sweep)
    assert [s["duty"] for s in series] == [1.0, 0.5]
    full = series[0]
    assert full["share"] == sorted(full["share"]) and full["slowdown"][-1] == pytest.approx(2.1887, abs=1e-3)
    slots = json.loads((runs / "2026-11-26-h100-run4.json").read_text())
    modes = {m["mode"]: m for m in gpu_plots.slot_modes(slots)}
    assert set(modes) == {"duty 0.1", "duty 0.2", "slots"}
    assert modes["slots"]["slowdown"] < modes["duty 0.1"]["slowdown"] and modes["slots"]["progress"] > 0.1
    assert gpu_plots.write_plots(sweep, tmp_path) == [str(tmp_path / "interference.png")]
    gpu_report.write_reports(slots, str(tmp_path / "r4"))
    assert (tmp_path / "r4" / "slots.png").read_bytes()[:4] == b"\x89PNG"
    assert gpu_plots.write_plots({"parts": [{"name": "spill", "results": {}}]}, tmp_path / "none") == []


# --- the wheels an offline GPU node needs ---------------------------------------------------------


def test_wheels_needed_are_the_missing_and_the_older_ones(tmp_path):
    for name in ("pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", "pyyaml-6.0.3-cp312-cp312-x.whl",
                 "pydantic-2.14.3-py3-none-any.whl", "typing_extensions-4.16.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    carried = wheels.carried_wheels(str(tmp_path))
    assert carried["pyyaml"][1] == "6.0.3" and carried["typing_extensions"][1] == "4.16.0"
    here = {"pyzmq": None, "PyYAML": "6.0.3", "pydantic": "2.9.0", "typing_extensions": "4.20.0",
            "pydantic_core": None}
    got = [os.path.basename(p) for p in wheels.needed(carried, lambda d: here.get(d))]
    # pyzmq missing, pydantic older: installed; PyYAML equal and typing_extensions newer: left alone.
    assert got == ["pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", "pydantic-2.14.3-py3-none-any.whl"]
    # pydantic_core is missing and not carried: named, so the operator knows to run make gpu-wheels.
    assert "pydantic_core" in wheels.missing_wheels(carried, lambda d: here.get(d))
    assert wheels.version_tuple("2.50.4") > wheels.version_tuple("2.9.10") and wheels.version_tuple("1.0rc1") == (1, 0)


def test_wheel_install_is_offline_into_its_own_directory(tmp_path):
    (tmp_path / "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    ran = []
    target = str(tmp_path / "site")
    # Nothing of pyzmq is in the fresh target and this venv has it: nothing to install.
    assert wheels.install(str(tmp_path), target, run=lambda c: ran.append(c) or 0) == 0 and ran == []
    cmd = wheels.install_command(["a.whl"], target)
    assert cmd[1:4] == ["-m", "pip", "install"] and "--no-index" in cmd and "--no-deps" in cmd
    assert cmd[cmd.index("--target") + 1] == target and cmd[-1] == "a.whl"


def test_the_carried_wheels_are_what_the_gpu_code_path_imports():
    code = ("import sys, torch_patch.agent, slurm_antman.sidecar.daemon, slurm_antman.lab.bench.gpu_worker, "
            "slurm_antman.lab.bench.gpu_node; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    env = dict(os.environ, ANTMAN_AGENT_DISABLE="1")
    mods = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=env).stdout.split())
    assert set(wheels.CARRIED.values()) <= mods
    assert not {"rich", "prometheus_client"} & mods  # not carried, so they must not be needed
    pins = wheels.pins()
    assert [p.split("==")[0] for p in pins] == list(wheels.CARRIED) and all("==" in p for p in pins)


# --- the worker and the share path, on CPU --------------------------------------------------------


def test_a_worker_takes_its_share_from_the_sidecar_over_the_protocol(tmp_path):
    from slurm_antman import protocol as P
    from slurm_antman.lab.bench.control import PeerSidecar
    from slurm_antman.lab.bench.gpu_worker import Worker, WorkerError, start, windows

    sock = os.path.join("/tmp", f"am-test-{os.getpid()}", "agent.sock")
    peer = PeerSidecar(sock, job_id="202", job_class="opportunistic").start()
    w = Worker("opp", "rl_ppo_atari", str(tmp_path / "w.log"), batch=2, device="cpu", job_id="202",
               job_class="opportunistic", endpoint=P.ipc(sock))
    try:
        start([w])
        assert w.info["ready"] and w.info["pid"] == w.pid
        seq, _ = peer.send_limits(None, 0.5)
        r = windows([w], 0.5)[0]
        assert r["steps"] >= 1 and r["applied_seq"] >= seq and r["share"] == 0.5
        assert r["losses"] and all(math.isfinite(x) for x in r["losses"])
        w.send({"cmd": "dance"})
        with pytest.raises(WorkerError, match="exited"):
            w.recv(30)
        assert "unknown command" in (tmp_path / "w.log").read_text()
    finally:
        w.stop()
        peer.stop()


def test_sweep_helpers():
    from slurm_antman.lab.bench.gpu_interference import inversions
    from slurm_antman.lab.bench.gpu_zoo import chunks, runs_in

    assert inversions([2.0, 1.5, 1.1]) == 0 and inversions([2.0, 2.1, 1.0]) == 1
    assert chunks()[0] == ["resnet50", "lstm_lm"] and runs_in(chunks()[0]) == 5
    assert sorted(n for c in chunks() for n in c) == sorted(__import__(
        "slurm_antman.lab.evaluation.model_zoo", fromlist=["NAMES"]).NAMES)


# --- on a GPU: the parts' claims ------------------------------------------------------------------

_RESULTS: dict = {}


def _part(name: str, tmp_path_factory) -> dict:
    """Runs one part as the bench does (its own process, its budget) once per test session."""
    part = BY_NAME[name]
    reason = Requirements().skip_reason(part)
    if reason is not None:
        pytest.skip(reason)
    if name not in _RESULTS:
        out = tmp_path_factory.mktemp(f"gpu-{name}")
        _RESULTS[name] = gpu.run_part(part, part.budget_s, str(out))
    rec = _RESULTS[name]
    assert rec["status"] in ("passed", "failed"), f"part {name}: {rec['status']}: {rec['reason']}"
    return rec["results"]


@pytest.mark.gpu
@needs_cuda
def test_gpu_memory_allocation_over_the_limit_fails_and_after_grow_succeeds(tmp_path_factory):
    sg = _part("memory", tmp_path_factory)["shrink_grow"]
    assert sg["reserved_after_shrink"] < sg["reserved_before_shrink"]
    assert sg["oom_under_limit"] is True
    assert sg["grown_allocation_ok"] is True and sg["allocated_after_grow"] >= sg["request_mib"] << 20


@pytest.mark.gpu
@needs_cuda
def test_gpu_memory_limit_changes_while_resnet50_trains_apply_at_the_next_iteration(tmp_path_factory):
    from slurm_antman.lab.bench.gpu_memory import SCHEDULE

    tr = _part("memory", tmp_path_factory)["while_training"]
    assert len(tr["changes"]) == len(SCHEDULE) and not any("oom" in c for c in tr["changes"])
    for c in tr["changes"]:
        assert c["applied_iteration"] == c["received_iteration"] + 1
        if c["limit_bytes"] is not None:
            assert c["reserved_bytes"] <= c["limit_bytes"]


@pytest.mark.gpu
@needs_cuda
def test_gpu_spilled_run_keeps_training_with_the_unspilled_losses(tmp_path_factory):
    from slurm_antman.lab.bench.gpu_spill import LOSS_RTOL

    r = _part("spill", tmp_path_factory)["spill"]
    assert r["spilled"]["spilled_peak_bytes"] > 0 and r["spilled"]["spill_failures"] == 0
    assert r["steps_compared"] >= 3
    assert r["max_rel_diff"] <= LOSS_RTOL  # the tolerance gpu.md states; bit_for_bit is recorded
    assert all(math.isfinite(x) for x in r["spilled"]["losses"])


@pytest.mark.gpu
@needs_cuda
def test_gpu_spilled_process_holds_no_more_gpu_memory_than_its_limit(tmp_path_factory):
    from slurm_antman.lab.bench.gpu_spill import NVML_SLACK_BYTES

    r = _part("spill", tmp_path_factory)["spill"]
    assert r["nvml_peak_bytes"] is not None
    assert r["nvml_peak_bytes"] <= r["limit_bytes"] + max(0, r["outside_torch_bytes"]) + NVML_SLACK_BYTES
    assert r["limit_bytes"] < r["footprint_bytes"]  # the limit really was under the footprint


@pytest.mark.gpu
@needs_cuda
def test_gpu_throttle_protects_the_guaranteed_job_more_at_smaller_shares(tmp_path_factory):
    from slurm_antman.lab.bench.gpu_interference import inversions

    for series in _part("interference", tmp_path_factory)["sweep"]["series"]:
        rows = {r["share"]: r for r in series["rows"]}
        assert rows[0.05]["slowdown"] < rows[1.0]["slowdown"]
        throttled = [r for r in series["rows"] if r["share"] > 0]
        assert inversions([r["slowdown"] for r in throttled]) <= 1  # monotone but for noise
        assert rows[1.0]["progress"] > rows[0.05]["progress"] > 0 and rows[0.0]["progress"] == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_interference_formula_matches_the_measurements(tmp_path_factory):
    from slurm_antman.lab.bench.gpu_interference import FORMULA_TOL, REDUCED_DUTY

    series = _part("interference", tmp_path_factory)["sweep"]["series"]
    reduced = next(s for s in series if s["duty"] == REDUCED_DUTY)
    assert 0 < reduced["formula_duty"] < 1  # NVML saw the stall
    for s in series:
        for r in s["rows"]:
            assert r["formula_error"] <= FORMULA_TOL, (s["duty"], r)


@pytest.mark.gpu
@needs_cuda
def test_gpu_aimd_holds_the_guaranteed_slowdown_near_its_target(tmp_path_factory):
    from slurm_antman.lab.bench.gpu_interference import AIMD_BAND

    cl = _part("interference", tmp_path_factory)["closed_loop"]
    assert cl["target"] == 0.02 and len(cl["slices"]) >= 4
    assert abs(cl["second_half_slowdown"] - cl["target"]) <= AIMD_BAND
    shares = [p["share"] for p in cl["trace"] if p.get("share") is not None]
    assert shares and min(shares) < 0.5  # the loop acted: below the policy's initial share


@pytest.mark.gpu
@needs_cuda
def test_gpu_nvml_utilisation_agrees_with_the_agents_reports(tmp_path_factory):
    from slurm_antman.lab.bench.gpu_telemetry import UTIL_TOL

    full = _part("telemetry", tmp_path_factory)["telemetry"]["full_duty"]
    assert full["nvml_util"] is not None
    assert abs(full["nvml_util"] - full["reported_busy_sum"]) <= UTIL_TOL


@pytest.mark.gpu
@needs_cuda
def test_gpu_nvml_process_memory_agrees_with_the_agents_reports(tmp_path_factory):
    from slurm_antman.lab.bench.gpu_telemetry import OUTSIDE_MAX_BYTES

    agents = _part("telemetry", tmp_path_factory)["telemetry"]["full_duty"]["agents"]
    assert {a["job"] for a in agents} == {"401", "402"}
    for a in agents:
        assert a["nvml_bytes"] is not None
        assert 0 <= a["nvml_bytes"] - a["reported_reserved_bytes"] <= OUTSIDE_MAX_BYTES


@pytest.mark.gpu
@needs_cuda
def test_gpu_pause_and_resume_free_and_give_back_the_gpu(tmp_path_factory):
    pause = _part("pause", tmp_path_factory)["pause"]
    assert pause["bytes_freed"] >= 0.9 * pause["bytes_moved"] > 0
    assert pause["pause_s"] <= 2 * pause["ideal_pause_s"] and pause["resume_s"] <= 2 * pause["ideal_resume_s"]
    assert pause["losses_after"] == pause["twin_losses"]


def test_the_slots_part_runs_every_mode_and_hands_each_gate_its_budget(tmp_path):
    """Part 8's plumbing on CPU (the claims are the GPU's): both gates, the duty shares, and the
    quantities the simulator takes, from the workers' own records."""
    from slurm_antman.lab.bench import gpu_slots
    from torch_patch.slots import INFLIGHT_S

    r = gpu_slots.measure(str(tmp_path), 0.6, device="cpu", batch=2, model="rl_ppo_atari")
    assert list(r["modes"]) == ["alone"] + [f"duty {s:g}" for s in gpu_slots.SHARES] + ["slots, one module", "slots"]
    for mode, inflight in (("slots, one module", 0.0), ("slots", INFLIGHT_S)):
        gate = r["modes"][mode]["opportunistic"]["gate"]
        assert gate["inflight_ms"] == pytest.approx(inflight * 1e3)
        # The guaranteed worker published: the gate judged launches by the page, not blind.
        assert gate["launches"] > 0 and gate["blind"] < gate["launches"]
    assert 0.0 < r["guaranteed_idle_fraction"] < 1.0
    for key in ("fill_efficiency", "fill_efficiency_one_module"):
        assert r[key] == pytest.approx(r["modes"]["slots" if key == "fill_efficiency" else "slots, one module"]
                                       ["opportunistic_progress"] / r["guaranteed_idle_fraction"])
