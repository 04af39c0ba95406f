"""The trace loader: both real traces load, windows and tenant filters select the right jobs, and a
malformed row names the file, the line and the column."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_antman.lab.evaluation import traces
from slurm_antman.lab.evaluation.traces import TraceError, TraceJob, Window, load, load_sorted, parse_window

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
PHILLY = TRACES / "philly_pollux.csv"
OPENB = TRACES / "openb_pod_list_default.csv"
needs_traces = pytest.mark.skipif(not PHILLY.exists(), reason=f"traces not found at {TRACES}")

PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"
OPENB_HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
                "deletion_time,scheduled_time\n")


def write(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def philly_slice(tmp_path: Path) -> Path:
    return write(tmp_path, PHILLY_HEADER
                 + "2017-10-01 00:10:00,600.0,1,600.0,aaa\n"
                 + "2017-10-01 00:00:00,100.0,2,200.0,bbb\n"      # earliest, but second in the file
                 + "2017-10-01 01:00:00,50.0,4,200.0,aaa\n")


def test_philly_slice_relative_times_ids_and_sort(tmp_path):
    p = philly_slice(tmp_path)
    jobs = load_sorted(p)
    assert [j.job_id for j in jobs] == ["philly-3", "philly-2", "philly-4"]
    assert [j.submit_s for j in jobs] == [0.0, 600.0, 3600.0]
    assert jobs[0] == TraceJob("philly-3", 0.0, 100.0, 2, "bbb")
    assert all(j.gpu_fraction is None and j.qos is None for j in jobs)


def test_window_seconds_iso_and_tenants(tmp_path):
    p = philly_slice(tmp_path)
    assert [j.job_id for j in load_sorted(p, "0:601")] == ["philly-3", "philly-2"]
    assert [j.job_id for j in load_sorted(p, "600:")] == ["philly-2", "philly-4"]
    assert [j.job_id for j in load_sorted(p, "2017-10-01T00:05:00/2017-10-01T02:00:00")] == ["philly-2", "philly-4"]
    assert [j.job_id for j in load_sorted(p, "2017-10-01T00:05:00:2017-10-01T00:30:00")] == ["philly-2"]
    assert [j.job_id for j in load_sorted(p, None, tenants=["aaa"])] == ["philly-2", "philly-4"]


@pytest.mark.parametrize("text", ["abc", "5:1", "1:2:3", "2017-13-45T00:00:00/2017-10-02"])
def test_bad_window_is_named(text):
    with pytest.raises(TraceError, match="window"):
        parse_window(text, 0.0)


def test_iso_window_needs_absolute_trace():
    with pytest.raises(TraceError, match="openb counts seconds"):
        parse_window("2017-10-01/2017-10-02", None)
    assert parse_window("10:20") == Window(10.0, 20.0)


@pytest.mark.parametrize("row,line,column,what", [
    ("2017-10-01 00:00:00,100.0,1,100.0\n", 3, "cluster", "column missing"),
    ("2017-10-01 00:00:00,abc,1,100.0,aaa\n", 3, "duration", "not a number"),
    ("2017-10-01 00:00:00,-5,1,-5,aaa\n", 3, "duration", "negative"),
    ("2017-10-01 25:00:00,100,1,100,aaa\n", 3, "timestamp", "not a timestamp"),
    ("yesterday,100,1,100,aaa\n", 3, "timestamp", "not a timestamp"),
    ("2017-10-01 00:00:00,100,1.5,150,aaa\n", 3, "num_gpus", "not an integer"),
    ("2017-10-01 00:00:00,100,0,0,aaa\n", 3, "num_gpus", ">= 1"),
])
def test_philly_malformed_rows(tmp_path, row, line, column, what):
    p = write(tmp_path, PHILLY_HEADER + "2017-10-01 00:00:00,100.0,1,100.0,aaa\n" + row)
    with pytest.raises(TraceError) as e:
        list(load(p))
    assert e.value.line == line and e.value.column == column
    assert str(p) in str(e.value) and f"line {line}" in str(e.value) and what in str(e.value)


def test_missing_header_column_and_unknown_format(tmp_path):
    p = write(tmp_path, "name,num_gpu,gpu_milli,qos,creation_time,deletion_time\nx,1,1000,LS,0,5\n")
    with pytest.raises(TraceError, match="unknown trace format") as e:
        list(load(p))
    assert e.value.line == 1
    with pytest.raises(TraceError, match="No such file"):
        list(load(tmp_path / "absent.csv"))


def test_openb_fractions_qos_and_skips(tmp_path):
    p = write(tmp_path, OPENB_HEADER
              + "pod-a,1000,100,1,460,,BE,Running,10,110,20\n"
              + "pod-b,1000,100,0,0,,LS,Running,11,50,11\n"          # CPU only
              + "pod-c,1000,100,1,1000,,LS,Pending,12,90,\n"         # never ran
              + "pod-d,1000,100,2,1000,,LS,Succeeded,30,100,40\n")
    skips = traces.OpenbSkips()
    jobs = list(load(p, skips=skips))
    assert jobs == [TraceJob("pod-a", 10.0, 90.0, 1, "default", 0.46, "BE"),
                    TraceJob("pod-d", 30.0, 60.0, 2, "default", 1.0, "LS")]
    assert (skips.cpu_only, skips.never_ran) == (1, 1)
    assert [j.job_id for j in load(p, "20:")] == ["pod-d"]


@pytest.mark.parametrize("row,column,what", [
    ("pod-x,1000,100,1,460,,BE,Running,10,5,8\n", "deletion_time", "negative duration"),
    ("pod-x,1000,100,1,1460,,BE,Running,10,50,10\n", "gpu_milli", "exceeds 1000"),
    ("pod-x,1000,100,one,460,,BE,Running,10,50,10\n", "num_gpu", "not a number"),
    ("pod-x,1000,100,1,460,,,Running,10,50,10\n", "qos", "empty"),
])
def test_openb_malformed_rows(tmp_path, row, column, what):
    p = write(tmp_path, OPENB_HEADER + row)
    with pytest.raises(TraceError) as e:
        list(load(p))
    assert (e.value.line, e.value.column) == (2, column) and what in str(e.value)


@needs_traces
def test_real_philly_window_streams_and_counts():
    start = traces.trace_start_unix(PHILLY)
    assert start == traces._parse_iso("2017-09-04 10:30:41")
    week = load_sorted(PHILLY, "0:604800")
    assert 0 < len(week) < 82_247
    assert all(0 <= j.submit_s < 604_800 and j.gpus >= 1 for j in week)
    big = [j for j in load(PHILLY, "0:604800", tenants=["6214e9"])]
    assert big and all(j.tenant == "6214e9" for j in big)


@needs_traces
def test_real_openb_loads():
    skips = traces.OpenbSkips()
    jobs = list(load(OPENB, skips=skips))
    assert len(jobs) + skips.cpu_only + skips.never_ran == 8152
    assert {j.qos for j in jobs} >= {"LS", "BE"}
    assert any(j.gpu_fraction is not None and j.gpu_fraction < 1 for j in jobs)
