"""The coordinator's audit log rotates by size (docs/admin.md, "Install", the daemons' units): nothing
written is lost while the rotated files are kept, `antman explain` (local and through the query endpoint)
reads the rotated files oldest first, and a restarted coordinator restores the state it had, after its own
rotation or a logrotate's rename."""

from __future__ import annotations

import json
from dataclasses import replace
from types import MappingProxyType

from slurm_antman import config as cfgmod
from slurm_antman.coordinator import audit
from slurm_antman.coordinator.daemon import Coordinator, restore_state
from slurm_antman.coordinator.explain import explain
from slurm_antman.coordinator.query import audit_records
from slurm_antman.policy.cluster import CoordinatorState, Preemption
from slurm_antman.slurm import CliBackend


def _decision(job: str, ts: float, kind: str = "hold_for_quota") -> dict:
    return {"ts": ts, "kind": kind, "job_id": job, "reason": f"reason {ts}", "inputs": {}, "params": {},
            "outcome": "ok"}


def _state(preempting: dict | None = None) -> dict:
    st = CoordinatorState.empty()
    if preempting:
        st = replace(st, preempting=MappingProxyType(preempting))
    return {"ts": 0.0, "kind": "state", "state": st.to_json()}


def _file_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_rotation_keeps_every_record_and_explain_reads_rotated_files(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = audit.AuditLog(path, max_bytes=400, keep=10)
    written = []
    for i in range(40):
        rec = _decision(str(100 + i % 4), float(i))
        log.append(rec)
        written.append(rec)
        if i % 5 == 4:  # a cycle's end: the coordinator writes its state
            log.append(_state())
            written.append(_state())
    log.close()
    rotated = sorted(tmp_path.glob("audit.jsonl.*"))
    assert len(rotated) >= 3, rotated
    # Every file the coordinator began starts with its state: it alone restores the coordinator.
    for f in [path, *rotated[:-1]]:
        assert _file_lines(f)[0]["kind"] == "state", f
    # Nothing lost, nothing twice, in the order written.
    assert list(audit.read(path)) == written
    # The oldest file holds job 100's first record; explain and the query endpoint find it there.
    oldest = tmp_path / f"audit.jsonl.{max(int(f.suffix[1:]) for f in rotated)}"
    first = _file_lines(oldest)[0]
    assert first["job_id"] == "100" and first["ts"] == 0.0
    assert not any(r.get("ts") == 0.0 and r["kind"] == "hold_for_quota" for r in _file_lines(path))
    text, rc = explain("100", str(path))
    assert rc == 0 and "job 100: 10 coordinator record(s)" in text and "why: reason 0.0" in text
    assert text.index("why: reason 0.0") < text.index("why: reason 36.0")  # oldest first
    assert [r["ts"] for r in audit_records(str(path), "100")] == [float(i) for i in range(0, 40, 4)]


def test_only_keep_rotated_files_remain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = audit.AuditLog(path, max_bytes=100, keep=2)
    for i in range(20):
        log.append(_decision("7", float(i)))
        log.append(_state())
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    ts = [r["ts"] for r in audit.read(path) if r["kind"] == "hold_for_quota"]
    assert ts == [float(i) for i in range(int(ts[0]), 20)] and ts[0] > 0  # the oldest went, the rest in order


def test_a_decision_alone_never_rotates(tmp_path):
    # Rotation waits for a state record, so a file is never begun by a decision the state lacks.
    path = tmp_path / "audit.jsonl"
    log = audit.AuditLog(path, max_bytes=50)
    for i in range(10):
        log.append(_decision("7", float(i)))
    assert log.rotation_due and not (tmp_path / "audit.jsonl.1").exists()
    log.append(_state())
    log.close()
    assert len(_file_lines(tmp_path / "audit.jsonl.1")) == 10 and _file_lines(path) == [_state()]


def _preemption(job: str) -> Preemption:
    return Preemption(job, "n1", 10.0, 40.0, 0, "guaranteed job 9 needs GPU 0", 0, "9")


def test_restore_after_rotation_and_after_a_logrotate_rename(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = audit.AuditLog(path, max_bytes=200)
    log.append(_state())
    for i in range(5):
        log.append(_decision("1", float(i)))
    log.append(_state({"5": _preemption("5")}))  # rotates: PATH now begins with job 5's preemption
    assert (tmp_path / "audit.jsonl.1").exists()
    st, replayed = restore_state(str(path), 30.0)
    assert set(st.preempting) == {"5"} and replayed == 0
    # A logrotate renames PATH and the requeue lands in the new file before any state record does: the
    # restore goes back to the rotated file's state and replays the requeue on it.
    path.rename(tmp_path / "audit.jsonl.9")
    (tmp_path / "audit.jsonl.1").rename(tmp_path / "audit.jsonl.10")
    (tmp_path / "audit.jsonl.9").rename(tmp_path / "audit.jsonl.1")
    log.reopen()
    log.append(_decision("5", 41.0, kind="requeue"))
    log.close()
    st, replayed = restore_state(str(path), 30.0)
    assert replayed == 1 and not st.preempting and set(st.requeued) == {"5"}
    # Its MakeEligible is replayed with when it asked the job to start, so a restarted coordinator
    # neither sends it again at once nor forgets how many it sent.
    log.reopen()
    log.append(_decision("5", 45.0, kind="make_eligible"))
    log.close()
    st, replayed = restore_state(str(path), 30.0)
    r = st.requeued["5"]
    assert replayed == 2 and (r.made_eligible, r.eligible_sent, r.eligible_unix) == (True, 1, 45.0)


def _coordinator(tmp_path, **coordinator) -> Coordinator:
    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}],
                        "coordinator": {"audit_log": str(tmp_path / "audit.jsonl"), **coordinator}})
    # No Slurm commands on this PATH: these tests never reach a cycle.
    return Coordinator(cfg, backend=CliBackend(env={"PATH": str(tmp_path)}, timeout=5))


def test_coordinator_rotates_at_a_cycle_end_and_reopens_on_sighup(tmp_path):
    coord = _coordinator(tmp_path, audit_max_bytes=300, audit_keep=3)
    coord.start()
    coord.state = replace(coord.state, preempting=MappingProxyType({"5": _preemption("5")}))
    for i in range(6):
        coord.audit.append(_decision("5", float(i)))
    coord._persist()  # the cycle's end: the state changed, and the file is due
    path = tmp_path / "audit.jsonl"
    assert _file_lines(path)[0]["kind"] == "state"
    assert [r["ts"] for r in audit.read_file(tmp_path / "audit.jsonl.1") if r["kind"] == "hold_for_quota"] == \
        [float(i) for i in range(6)]
    for i in range(6, 12):
        coord.audit.append(_decision("5", float(i)))
    coord._persist()  # unchanged state, but the file is due: a state record, and so a rotation
    assert (tmp_path / "audit.jsonl.2").exists() and _file_lines(path)[0]["kind"] == "state"
    # logrotate: rename, then SIGHUP (reload): the coordinator writes to a new PATH, state first.
    path.rename(tmp_path / "rotated-away")
    coord.reload()
    coord.audit.append(_decision("5", 99.0))
    coord.close()
    lines = _file_lines(path)
    assert lines[0]["kind"] == "state" and lines[1]["ts"] == 99.0
    assert set(restore_state(str(path), 30.0)[0].preempting) == {"5"}
    text, rc = explain("5", str(path))
    assert rc == 0 and "why: reason 0.0" in text and "why: reason 99.0" in text
