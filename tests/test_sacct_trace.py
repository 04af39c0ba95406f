"""A site's own history as a trace (lab/evaluation/sacct_trace.py): what the sacct of Slurm 22.05, 24.11
and 26.05 printed for jobs of the devcluster (tests/data/sacct/, captured 2026-11-29 with `sacct -X --json`
and `sacct -X -P --format=...`; 24.11 in the trixie chroot, 26.05 in the cgroup v2 guest), read the same
from either form; and every malformed input named by line or job and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_antman.lab.bench import simulate as bench_simulate
from slurm_antman.lab.evaluation import sacct_trace, traces

DATA = Path(__file__).parent / "data" / "sacct"
JSON = DATA / "slurm-22.05.json"
PARSABLE = DATA / "slurm-22.05-P.txt"


def _load(path):
    skips = sacct_trace.SacctSkips()
    return sacct_trace.load(path, skips), skips


def test_both_forms_of_one_history_give_the_same_jobs():
    from_json, skips_json = _load(JSON)
    from_p, skips_p = _load(PARSABLE)
    assert from_json == from_p and skips_json == skips_p
    by_id = {j.job_id: j for j in from_json}
    # The captured jobs: a guaranteed 2-GPU job, an opportunistic one (it holds gres/antman_opp), a 2-node
    # job with one GPU on each node (AllocTRES gres/gpu=2 is the whole allocation), a failed job (it ran:
    # it is replayed), and a job without GPUs (left out, counted).
    assert by_id["slurm-9900001"].gpus == 2 and by_id["slurm-9900002"].gpus == 1
    assert by_id["slurm-9900005"].gpus == 2
    assert "slurm-9900006" not in by_id and skips_json.no_gpu == 1
    assert skips_json.states == {"COMPLETED": 6, "FAILED": 1}
    assert by_id["slurm-9900008"].submit_s == 24.0 and by_id["slurm-9900008"].duration_s == 1.0
    assert min(j.submit_s for j in from_json) == 0.0
    assert all(j.tenant == "research" for j in from_json)
    assert traces.detect_format(JSON) == traces.detect_format(PARSABLE) == traces.SACCT


@pytest.mark.parametrize("release", ["24.11", "26.05"])
def test_a_newer_release_s_history_reads_the_same_from_both_forms(release):
    # Their JSON: the state is a list (["COMPLETED"]), many numbers wrapped ({"set": ..., "number": N}).
    from_json, skips = _load(DATA / f"slurm-{release}.json")
    assert (from_json, skips) == _load(DATA / f"slurm-{release}-P.txt")
    assert {j.job_id: (j.gpus, j.tenant) for j in from_json} == {
        "slurm-9900001": (2, "research"), "slurm-9900002": (1, "research"), "slurm-9900003": (1, "product"),
        "slurm-9900004": (2, "research"), "slurm-9900006": (1, "research")}
    assert skips.no_gpu == 1 and skips.states == {"COMPLETED": 5, "FAILED": 1}


def test_a_window_and_accounts_narrow_a_history_read_once():
    # Seconds from the first submission kept, as for the research traces; the tenants are the accounts.
    assert [j.job_id for j in traces.load(JSON, "20:")] == ["slurm-9900008"]
    assert [j.job_id for j in traces.load(DATA / "slurm-26.05.json", None, ["product"])] == ["slurm-9900003"]
    jobs, t0 = sacct_trace.load_with_start(JSON)
    assert t0 == traces.trace_start_unix(JSON) == 1795923853.0 and jobs == sacct_trace.load(JSON)


def test_gpus_are_read_from_every_form_tres_takes():
    assert sacct_trace.gpus_of("billing=4,cpu=4,gres/gpu=2,mem=8G,node=1") == 2
    # A typed GPU shows as both; the untyped total counts once.
    assert sacct_trace.gpus_of("cpu=8,gres/gpu=4,gres/gpu:a100=4,node=1") == 4
    assert sacct_trace.gpus_of("cpu=8,gres/gpu:a100=2,gres/gpu:h100=1,node=1") == 3
    assert sacct_trace.gpus_of("cpu=1,gres/antman_opp=1,node=1") == 1
    assert sacct_trace.gpus_of("cpu=1,mem=4000M,node=1") == 0
    with pytest.raises(ValueError, match="not a whole number"):
        sacct_trace.gpus_of("gres/gpu=two")


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


HEADER = "JobIDRaw|Account|Submit|Start|End|ElapsedRaw|State|AllocTRES|ReqTRES"


def test_a_job_that_never_started_or_still_runs_is_counted_and_requested_gpus_stand_in_for_none_allocated(tmp_path):
    p = _write(tmp_path, "h.txt", "\n".join([
        HEADER,
        "10|a|2026-11-01T10:00:00|Unknown|2026-11-01T10:05:00|0|CANCELLED by 1000||gres/gpu=1",
        "11|a|2026-11-01T10:00:10|2026-11-01T10:00:20|Unknown|500|RUNNING|gres/gpu=1|gres/gpu=1",
        "12|b|2026-11-01T10:01:00|2026-11-01T10:01:30|2026-11-01T11:01:30|3600|COMPLETED||cpu=2,gres/gpu=4",
        "12.batch|b|2026-11-01T10:01:00|2026-11-01T10:01:30|2026-11-01T11:01:30|3600|COMPLETED|cpu=2|",
        "13|a|2026-11-01T10:02:00|2026-11-01T10:02:00|2026-11-01T10:02:00|0|TIMEOUT|gres/gpu=1|gres/gpu=1",
    ]) + "\n")
    jobs, skips = _load(p)
    assert [(j.job_id, j.submit_s, j.duration_s, j.gpus, j.tenant) for j in jobs] == [
        ("slurm-12", 0.0, 3600.0, 4, "b"),  # time 0 is the first submission kept
        ("slurm-13", 60.0, 1.0, 1, "a"),    # ran under a second: sacct says 0, one second here
    ]
    assert (skips.never_ran, skips.still_running, skips.no_gpu) == (1, 1, 0)


@pytest.mark.parametrize("line, expected", [
    ("20|a|2026-11-01T10:00:00|2026-11-01T10:00:01|x|ten|COMPLETED|gres/gpu=1|", "line 2, column 'ElapsedRaw'"),
    ("20|a|yesterday|2026-11-01T10:00:01|x|10|COMPLETED|gres/gpu=1|", "line 2, column 'Submit'"),
    ("20|a|2026-11-01T10:00:00|2026-11-01T10:00:01|x|10|COMPLETED|gres/gpu=one|", "line 2, column 'AllocTRES'"),
    ("20|a|2026-11-01T10:00:00|10|COMPLETED", "line 2: 5 fields, the header names 9"),
])
def test_a_malformed_parsable_line_is_named_with_its_field(tmp_path, line, expected):
    p = _write(tmp_path, "bad.txt", HEADER + "\n" + line + "\n")
    with pytest.raises(traces.TraceError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _load(p)


def test_a_parsable_header_without_the_needed_fields_says_which_and_how_to_get_them(tmp_path):
    p = _write(tmp_path, "short.txt", "JobIDRaw|Account|Submit\n1|a|2026-11-01T10:00:00\n")
    with pytest.raises(traces.TraceError, match=r"line 1: sacct -P output without Start, End, ElapsedRaw.*--format="):
        _load(p)


def test_a_malformed_json_job_is_named_by_index_and_field(tmp_path):
    doc = json.loads(JSON.read_text())
    doc["jobs"][3]["time"]["submission"] = "soon"
    p = _write(tmp_path, "bad.json", json.dumps(doc))
    with pytest.raises(traces.TraceError, match=r"column 'time.submission': jobs\[3\]: 'soon' is not a number"):
        _load(p)
    with pytest.raises(traces.TraceError, match=r"cut.json, line 11: not JSON"):
        _load(_write(tmp_path, "cut.json", JSON.read_text()[:200]))


def test_the_numbers_newer_releases_wrap_read_as_the_plain_ones():
    # From 23.02 sacct --json prints a number as {"set": true, "infinite": false, "number": N}.
    assert sacct_trace._number({"set": True, "infinite": False, "number": 1795923853}) == 1795923853.0
    assert sacct_trace._number({"set": False, "infinite": False, "number": 0}) is None
    assert sacct_trace._number(42) == 42.0 and sacct_trace._number(None) is None


def test_the_simulate_command_replays_a_history_and_records_what_it_left_out(capsys):
    assert bench_simulate.main(["--trace", str(PARSABLE), "--nodes", "2", "--gpus", "4", "--policy", "exclusive,antman",
                                "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["meta"]["jobs"] == 6 and doc["meta"]["sacct_skipped"]["no_gpu"] == 1
    assert "Accounting holds no GPU utilisation or memory" in out.err
    assert {p: r["jobs_done"] for p, r in doc["policies"].items()} == {"exclusive": 6, "antman": 6}


def test_the_simulate_command_wants_one_source(capsys):
    assert bench_simulate.main(["--nodes", "2"]) == 2
    assert "give --trace FILE or --from-sacct" in capsys.readouterr().err
    assert bench_simulate.main(["--trace", str(JSON), "--from-sacct"]) == 2
