"""The record a node keeps when it could not grant an opportunistic job its GPU, and how the sidecar reads it:
fresh and root's, the node takes no opportunistic job; stale, forged or damaged, it changes nothing."""

from __future__ import annotations

import json
import os

import pytest

from slurm_antman import device_failure as df


def test_a_fresh_record_names_the_job_the_cause_and_how_to_clear_it(tmp_path):
    p = df.record(tmp_path / "node1", "4711", "BPF_PROG_ATTACH refused\n(Operation not permitted)", now=1000.0)
    assert p == tmp_path / "node1" / df.FILE_NAME
    assert json.loads(p.read_text()) == {"job_id": "4711", "cause": "BPF_PROG_ATTACH refused (Operation not permitted)",
                                         "ts": 1000.0}
    why = df.problem(tmp_path / "node1", now=1000.0 + df.HOLD_S - 1)
    assert "job 4711's GPU could not be granted here (BPF_PROG_ATTACH refused (Operation not permitted))" in why
    assert str(p) in why


@pytest.mark.parametrize("age", [df.HOLD_S, df.HOLD_S + 1, -5.0])
def test_a_stale_record_or_one_from_the_future_does_not_count(tmp_path, age):
    df.record(tmp_path, "1", "x", now=5000.0)
    assert df.problem(tmp_path, now=5000.0 + age) == ""


def test_no_record_no_directory_no_problem(tmp_path):
    assert df.problem(tmp_path / "absent", now=1.0) == ""
    assert df.problem(None, now=1.0) == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a file of another owner is made with chown")
def test_only_roots_regular_file_counts(tmp_path):
    df.record(tmp_path / "a", "1", "x", now=10.0)
    os.chown(df.path(tmp_path / "a"), 65534, 65534)  # what a job (any non-root user) could have written
    assert df.problem(tmp_path / "a", now=10.0) == ""
    real = df.record(tmp_path / "b", "2", "y", now=10.0)
    (tmp_path / "c").mkdir()
    os.symlink(real, df.path(tmp_path / "c"))
    assert df.problem(tmp_path / "c", now=10.0) == ""
    assert df.problem(tmp_path / "b", now=10.0) != ""


@pytest.mark.parametrize("text", ["", "{", "[]", '{"job_id": "1", "cause": "x"}', '{"job_id": "1", "cause": "x", "ts": "soon"}',
                                  "x" * (df.MAX_BYTES + 1)])
def test_a_damaged_record_is_ignored_not_a_crash(tmp_path, text):
    df.path(tmp_path).write_text(text)
    assert df.problem(tmp_path, now=1.0) == ""
