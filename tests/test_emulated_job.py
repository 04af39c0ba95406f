"""The emulated trace job (slurm_antman/lab/evaluation/emulated_job.py) and its GPU board, for real: the job
runs as a subprocess under the real torch_patch agent, talking ZeroMQ IPC to
``control.PeerSidecar`` (the sidecar side of docs/protocol.md); the board is real files.

No assertion depends on how fast this machine is: timing-dependent numbers (the duty cycle) get wide
bounds, everything else is exact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_antman import protocol as P
from slurm_antman.lab.bench.control import PeerSidecar
from slurm_antman.lab.evaluation import emulated_job as ej
from slurm_antman.lab.evaluation.emulated_gpu import (
    OK, OOM, WAIT, Board, BoardError, Entry, oom_decision, parse_entry,
)
from slurm_antman.lab.evaluation.published import pair_slowdowns
from slurm_antman.lab.evaluation.workloads import BY_NAME

REPO = Path(__file__).resolve().parents[1]
RESNET = BY_NAME["resnet50"]
LSTM = BY_NAME["lstm_lm"]


# --- helpers -------------------------------------------------------------------------------------


@pytest.fixture
def short_dir(tmp_path):
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    d = f"/tmp/antman-emu-{os.getpid()}-{tmp_path.name[-20:]}"
    os.makedirs(d, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _peer(short_dir: str, job_id: str, job_class: str = "opportunistic") -> PeerSidecar:
    return PeerSidecar(os.path.join(short_dir, "jobs", job_id, "agent.sock"), job_id=job_id,
                       job_class=job_class, heartbeat_s=0.2).start()


def _env(job_id: str, peer: PeerSidecar | None, job_class: str = "opportunistic", gpus: str = "0",
         restart: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTMAN_", "SLURM_", "CUDA_VISIBLE"))}
    env.update(SLURM_JOB_ID=job_id, ANTMAN_JOB_ID=job_id, ANTMAN_CLASS=job_class, ANTMAN_GPUS=gpus,
               SLURMD_NODENAME="emu1")
    if peer is not None:
        env["ANTMAN_SIDECAR_ENDPOINT"] = peer.endpoint
    if restart is not None:
        env["SLURM_RESTART_COUNT"] = str(restart)
    return env


def _start(tmp_path: Path, env: dict[str, str], *args: str, work_s: float = 1.0,
           profile: str = "resnet50") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slurm_antman.lab.evaluation.emulated_job", "--profile", profile,
           "--work-s", str(work_s), "--state-dir", str(tmp_path / "state"),
           "--board-dir", str(tmp_path / "board"), "--iter-scale", "0.1", *args]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the emulated job did not exit in {timeout} s; stderr:\n{err}")
    return proc.returncode, err


def _records(tmp_path: Path, job_id: str) -> list[dict]:
    path = tmp_path / "state" / f"{job_id}.runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ckpt(tmp_path: Path, job_id: str) -> dict:
    return json.loads((tmp_path / "state" / f"{job_id}.ckpt").read_text())


def _wait(cond, timeout: float = 30.0, what: str = "condition", proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout} s")
        time.sleep(0.02)


# --- the board -----------------------------------------------------------------------------------


def test_two_jobs_on_one_gpu_see_each_other(tmp_path):
    a = Board(str(tmp_path), "n1", [0], read_interval_s=0)
    b = Board(str(tmp_path), "n1", [0], read_interval_s=0)
    other_gpu = Board(str(tmp_path), "n1", [1], read_interval_s=0)
    a.publish("101", 0.8, 6 << 30, RESNET.kind)
    b.publish("102", 0.3, 2 << 30, LSTM.kind, 0.5)
    other_gpu.publish("103", 1.0, 1 << 30, RESNET.kind)
    # The workload model's measured interference at the neighbour's share, from what the board says.
    assert a.slowdown("101", RESNET) == pytest.approx(RESNET.slowdown([(LSTM.kind, 0.5)]))
    assert a.slowdown("101", RESNET) == pytest.approx(1 / (0.5 + 0.5 / pair_slowdowns()[(RESNET.kind, LSTM.kind)]))
    assert b.slowdown("102", LSTM) == pytest.approx(LSTM.slowdown([(RESNET.kind, 1.0)]))
    assert a.neighbour_mem("101") == 2 << 30
    assert other_gpu.slowdown("103", RESNET) == 1.0
    # A two-GPU job waits for its slowest GPU.
    both = Board(str(tmp_path), "n1", [0, 1], read_interval_s=0)
    both.publish("104", 0.5, 1 << 30, LSTM.kind)
    assert both.slowdown("104", LSTM) == pytest.approx(LSTM.slowdown([(RESNET.kind, 1.0), (LSTM.kind, 0.5)]))
    assert a.slowdown("101", RESNET) == pytest.approx(RESNET.slowdown([(LSTM.kind, 0.5), (LSTM.kind, 1.0)]))
    b.withdraw("102")
    both.withdraw("104")
    assert a.slowdown("101", RESNET) == 1.0


def test_board_ignores_stale_and_garbage_entries(tmp_path):
    now = time.time()
    old = Board(str(tmp_path), "n1", [0], clock=lambda: now - 60)
    old.publish("200", 1.0, 1 << 30, RESNET.kind)  # a job killed a minute ago
    me = Board(str(tmp_path), "n1", [0], read_interval_s=0)
    me.publish("201", 0.2, 1 << 30, RESNET.kind)
    d = Path(me.gpu_dir(0))
    (d / "202").write_text('{"load": 0.5, "mem_b')  # half-written
    (d / "203").write_bytes(b"\xff\xfe garbage")
    (d / "204").write_text('{"load": -1, "mem_bytes": 1, "t": %f}' % now)
    (d / "205").write_text('[1, 2, 3]')
    (d / "206").write_text('{"load": "NaN", "mem_bytes": 1, "t": %f}' % now)
    (d / ".207.99.tmp").write_text('{"load": 0.5, "mem_bytes": 1, "t": %f}' % now)  # a write in progress
    (d / "208").mkdir()
    (d / "210").write_text('{"load": 0.5, "mem_bytes": 1, "t": %f, "kind": "../x"}' % now)
    (d / "211").write_text('{"load": 0.5, "mem_bytes": 1, "t": %f, "kind": "T64", "share": -1}' % now)
    # the one good neighbour: at a quarter share
    (d / "209").write_text('{"load": 0.25, "mem_bytes": 7, "t": %f, "kind": "T64", "share": 0.25}' % now)
    assert me.slowdown("201", RESNET) == pytest.approx(RESNET.slowdown([("T64", 0.25)]))
    assert me.neighbour_mem("201") == 7
    assert {e.job_id for e in me.entries(0)} == {"201", "209"}


def test_board_reads_are_cached(tmp_path):
    t = [100.0]
    me = Board(str(tmp_path), "n1", [0], read_interval_s=1.0, monotonic=lambda: t[0])
    other = Board(str(tmp_path), "n1", [0])
    assert me.slowdown("1", RESNET) == 1.0
    other.publish("2", 0.5, 1, RESNET.kind)
    assert me.slowdown("1", RESNET) == 1.0  # within the read interval: no file I/O
    t[0] += 1.0
    assert me.slowdown("1", RESNET) > 1.0


def test_board_validation(tmp_path):
    with pytest.raises(BoardError, match="node"):
        Board(str(tmp_path), "../etc", [0])
    with pytest.raises(BoardError, match="gpus"):
        Board(str(tmp_path), "n1", [])
    with pytest.raises(BoardError, match="gpus"):
        Board(str(tmp_path), "n1", [-1])
    b = Board(str(tmp_path), "n1", [0])
    with pytest.raises(BoardError, match="job_id"):
        b.publish(".hidden", 0.1, 1)
    with pytest.raises(BoardError, match="load"):
        b.publish("1", float("inf"), 1)
    with pytest.raises(BoardError, match="mem_bytes"):
        b.publish("1", 0.1, -5)


# --- out of memory: the decision every job on a GPU takes alone ----------------------------------

GIB = 1 << 30


def _e(job_id: str, mem_gib: float, since, t: float) -> Entry:
    return Entry(job_id, 0.5, int(mem_gib * GIB), t, since)


def test_oom_the_last_arrival_fails_and_only_it():
    a, b = _e("11", 6, 100.0, 105.0), _e("12", 6, 101.0, 105.0)
    board = [a, b]
    # 12 GiB on a 10 GiB GPU: 12 came last (its own entry on the board is ignored; it passes its numbers).
    assert oom_decision(board, "12", 101.0, 6 * GIB, 10 * GIB) == OOM
    assert oom_decision(board, "11", 100.0, 6 * GIB, 10 * GIB) == OK
    # Room for both: nobody fails.
    assert oom_decision(board, "12", 101.0, 6 * GIB, 12 * GIB) == OK
    # A third job arrives: now it is the one that gives way; the earlier ones do not.
    c = _e("13", 1, 102.0, 102.5)
    assert oom_decision(board + [c], "12", 101.0, 6 * GIB, 10 * GIB) == OK
    assert oom_decision(board + [c], "13", 102.0, 1 * GIB, 10 * GIB) == OOM
    # A footprint larger than the GPU fails alone.
    assert oom_decision([], "14", 103.0, 11 * GIB, 10 * GIB) == OOM


def test_oom_a_tie_in_arrival_is_broken_by_job_id_the_same_way_from_both_sides():
    # Same clock tick: Slurm's later (numerically larger) id arrived last, "10" after "9", not
    # "9" after "10" as a string comparison would have it.
    nine, ten = _e("9", 6, 100.0, 100.5), _e("10", 6, 100.0, 100.5)
    assert oom_decision([nine, ten], "10", 100.0, 6 * GIB, 10 * GIB) == OOM
    assert oom_decision([nine, ten], "9", 100.0, 6 * GIB, 10 * GIB) == OK
    # Non-numeric ids (not Slurm's) still give one order.
    x, y = _e("job-a", 6, 100.0, 100.5), _e("job-b", 6, 100.0, 100.5)
    assert oom_decision([x, y], "job-b", 100.0, 6 * GIB, 10 * GIB) == OOM
    assert oom_decision([x, y], "job-a", 100.0, 6 * GIB, 10 * GIB) == OK


def test_oom_waits_for_neighbours_that_have_not_refreshed_since_it_arrived():
    # A neighbour whose last refresh is older than this job's arrival may be dead (killed before it
    # withdrew; its entry is not stale yet): no verdict until it refreshes or goes stale.
    quiet = _e("20", 6, 50.0, 99.0)
    assert oom_decision([quiet], "21", 100.0, 6 * GIB, 10 * GIB) == WAIT
    assert oom_decision([_e("20", 6, 50.0, 100.4)], "21", 100.0, 6 * GIB, 10 * GIB) == OOM  # alive
    assert oom_decision([], "21", 100.0, 6 * GIB, 10 * GIB) == OK  # went stale: the reader drops it
    # The same tick as the arrival is not a refresh after it.
    assert oom_decision([_e("20", 6, 50.0, 100.0)], "21", 100.0, 6 * GIB, 10 * GIB) == WAIT
    # Live neighbours alone already overflow: no need to wait for the quiet one.
    live = _e("22", 6, 60.0, 100.2)
    assert oom_decision([quiet, live], "21", 100.0, 6 * GIB, 10 * GIB) == OOM


def test_old_entries_without_since_are_read_and_count_as_earliest():
    e = parse_entry("30", b'{"load": 0.4, "mem_bytes": 7, "t": 123.5}')
    assert e == Entry("30", 0.4, 7, 123.5, None)
    assert parse_entry("30", b'{"load": 0.4, "mem_bytes": 7, "t": 1, "since": 0.5}').since == 0.5
    for bad in (b'"x"', b'true', b'NaN', b'[1]'):  # present but not a time: not a well-formed entry
        assert parse_entry("30", b'{"load": 0.4, "mem_bytes": 7, "t": 1, "since": %s}' % bad) is None
    # Its writer never fails itself, so a job that can must give way to it.
    old = Entry("30", 0.4, 6 * GIB, 100.5, None)
    assert oom_decision([old], "31", 100.0, 6 * GIB, 10 * GIB) == OOM


def test_board_ties_and_shared_arrival_through_real_files(tmp_path):
    t = [100.0]
    clock = lambda: t[0]  # noqa: E731
    a = Board(str(tmp_path), "n1", [0], clock=clock, read_interval_s=0)
    b = Board(str(tmp_path), "n1", [0], clock=clock, read_interval_s=0)
    a.publish("41", 0.0, 6 * GIB)
    b.publish("42", 0.0, 6 * GIB)  # the same tick
    assert a.since("41") == b.since("42") == 100.0
    # Neither has refreshed since the other came: the later one waits, the earlier one goes on.
    assert b.oom_check("42", 6 * GIB, 10 * GIB, fresh=True).decision == WAIT
    assert a.oom_check("41", 6 * GIB, 10 * GIB, fresh=True).decision == OK
    t[0] = 100.5
    a.publish("41", 0.8, 6 * GIB)  # a refresh keeps the arrival
    on_disk = json.loads((tmp_path / "n1" / "0" / "41").read_text())
    assert (on_disk["since"], on_disk["t"]) == (100.0, 100.5)
    check = b.oom_check("42", 6 * GIB, 10 * GIB, fresh=True)
    assert (check.decision, check.gpu, check.others_bytes) == (OOM, 0, 6 * GIB)
    b.withdraw("42")
    assert b.since("42") is None
    assert a.oom_check("41", 6 * GIB, 10 * GIB, fresh=True).decision == OK
    # The second rank of a multi-GPU job shares its job's entry: it keeps the job's arrival.
    t[0] = 101.0
    rank1 = Board(str(tmp_path), "n1", [0], clock=clock)
    rank1.publish("41", 0.8, 6 * GIB)
    assert rank1.since("41") == 100.0
    with pytest.raises(BoardError, match="has not published"):
        Board(str(tmp_path), "n1", [0]).oom_check("43", 1, 10)


# --- the agent's emulation hook ------------------------------------------------------------------


def test_emulated_memory_stats():
    from torch_patch.memory import MemoryController

    m = MemoryController(use_cuda=False)
    m.emulate(8 << 30)
    s = m.stats()
    assert (s.allocated_bytes, s.reserved_bytes, s.peak_bytes, s.spilled_bytes) == (8 << 30,) * 3 + (0,)
    m.set_limit(3 << 30)
    s = m.stats()
    assert (s.reserved_bytes, s.allocated_bytes, s.peak_bytes) == (3 << 30,) * 3
    assert s.spilled_bytes == 5 << 30 and s.limit_bytes == 3 << 30
    m.set_limit(16 << 30)  # room enough: nothing spilled
    assert (m.stats().reserved_bytes, m.stats().spilled_bytes) == (8 << 30, 0)
    m.set_limit(None)
    assert m.stats().reserved_bytes == 8 << 30


def test_emulate_device_validation():
    from torch_patch.agent import Agent

    agent = Agent(job_id="5", use_cuda=False)
    try:
        for bad in (0, -1, 1.5, True, "6GiB"):
            with pytest.raises(ValueError, match="mem_bytes must be a positive number of bytes"):
                agent.emulate_device(bad, 0.5)
        for bad in (0, 0.0, -0.1, 1.01, True, "0.5", float("nan")):
            with pytest.raises(ValueError, match=r"sm_util must be a number in \(0, 1\]"):
                agent.emulate_device(1 << 30, bad)
        assert agent.memory.emulated_bytes is None, "a rejected call must change nothing"
        agent.emulate_device(1 << 30, 1)
        assert agent.memory.stats().reserved_bytes == 1 << 30
    finally:
        agent.stop()


def test_emulate_device_refuses_cuda():
    import torch
    from torch_patch.agent import Agent

    if torch.cuda.is_available():
        agent = Agent(job_id="5", use_cuda=True)
    else:
        # No GPU here: an agent that believes it drives one, which is all emulate_device looks at.
        agent = Agent(job_id="5", use_cuda=False)
        agent.cuda = agent.memory.cuda = True
    try:
        with pytest.raises(ValueError, match="emulation is for CPU-only trace replays"):
            agent.emulate_device(1 << 30, 0.5)
        assert agent.memory.emulated_bytes is None
    finally:
        agent.stop()


# --- the job -------------------------------------------------------------------------------------


def test_reports_footprint_spill_and_utilisation(tmp_path, short_dir):
    peer = _peer(short_dir, "301")
    proc = _start(tmp_path, _env("301", peer), work_s=120)
    try:
        first = peer.wait_type("report", timeout=30).msg.body
        assert (first.mem_reserved_bytes, first.mem_allocated_bytes, first.spilled_bytes) == (RESNET.mem_bytes, RESNET.mem_bytes, 0)
        # Unthrottled, the agent's busy time is the iteration: the emulated GPU is busy sm_util of it.
        assert first.busy_ms / first.iteration_ms == pytest.approx(RESNET.sm_util, abs=0.02)
        reg = peer.of_type("register")[0].msg.body
        assert (reg.job_id, reg.device, reg.job_class) == ("301", "cpu", "opportunistic")

        limit = RESNET.mem_bytes // 3
        seq, _ = peer.send_limits(limit, 1.0)
        rep = peer.wait_type("report", timeout=10, where=lambda b: b.limits_seq == seq).msg.body
        assert (rep.mem_reserved_bytes, rep.mem_allocated_bytes) == (limit, limit)
        assert rep.spilled_bytes == RESNET.mem_bytes - limit

        seq2, _ = peer.send_limits(limit, 0.5)
        def throttled():
            reps = [r.msg.body for r in peer.of_type("report") if r.msg.body.limits_seq == seq2]
            return reps if len(reps) >= 3 else None

        reps = _wait(throttled, what="three reports under share 0.5", proc=proc)
        # Throttled to 0.5 by the agent's real idle time: busy/iteration ~ sm_util * 0.5 (loose: timing).
        ratio = reps[-1].busy_ms / reps[-1].iteration_ms
        assert 0.2 < ratio < 0.6, ratio
        # What the job tells its GPU's neighbours.
        entry = json.loads((tmp_path / "board" / "emu1" / "0" / "301").read_text())
        assert entry["load"] == pytest.approx(RESNET.sm_util * 0.5) and entry["mem_bytes"] == RESNET.mem_bytes
    finally:
        proc.terminate()
        rc, err = _finish(proc)
        peer.stop()
    assert rc == 143, err
    rec, = _records(tmp_path, "301")
    assert rec["completed"] is False and rec["class"] == "opportunistic"


def test_job_completes_and_slows_by_its_neighbours_load(tmp_path, short_dir):
    # An uncontrolled Transformer on the same emulated GPU, kept fresh while the job runs: the
    # measured pair slows ResNet-50 to 2.07x.
    neighbour = Board(str(tmp_path / "board"), "emu1", [1])
    neighbour.publish("999", 1.0, 4 << 30, "T64")
    peer = _peer(short_dir, "302", job_class="guaranteed")
    proc = _start(tmp_path, _env("302", peer, job_class="guaranteed", gpus="1"), work_s=0.5)
    try:
        while proc.poll() is None:
            neighbour.publish("999", 1.0, 4 << 30, "T64")
            time.sleep(0.5)
        rc, err = _finish(proc)
        assert rc == 0, err
        assert peer.wait_type("bye").msg.body.reason == "exit"
    finally:
        peer.stop()
    rec, = _records(tmp_path, "302")  # exactly one line for one run
    assert rec["completed"] is True and rec["work_done_s"] >= 0.5
    assert (rec["job_id"], rec["profile"], rec["node"], rec["gpus"], rec["class"]) == \
        ("302", "resnet50", "emu1", [1], "guaranteed")
    assert rec["restart_count"] == 0 and rec["start_unix"] < rec["end_unix"]
    assert rec["mean_slowdown"] == pytest.approx(RESNET.slowdown([("T64", 1.0)]))
    assert _ckpt(tmp_path, "302")["work_done_s"] == rec["work_done_s"]
    # Its own board entry is gone; the neighbour's is untouched.
    assert sorted(os.listdir(tmp_path / "board" / "emu1" / "1")) == ["999"]


def test_preempt_checkpoints_and_the_requeued_run_resumes(tmp_path, short_dir):
    peer = _peer(short_dir, "303")
    proc = _start(tmp_path, _env("303", peer), work_s=3.0)
    try:
        peer.wait_type("report", timeout=30)
        peer.send_body(P.Preempt(deadline_unix=time.time() + 30, grace_s=30, reason="guaranteed job waiting"))
        ckpt = tmp_path / "state" / "303.ckpt"
        _wait(ckpt.exists, what="the checkpoint from the preemption hook", proc=proc)
        saved = _ckpt(tmp_path, "303")
        assert saved["work_done_s"] > 0 and saved["restarts"] == 0
        proc.send_signal(signal.SIGTERM)  # Slurm requeues the job
        rc, err = _finish(proc)
    finally:
        peer.stop()
    assert rc == 143, err
    first, = _records(tmp_path, "303")
    assert first["completed"] is False and first["work_done_s"] >= saved["work_done_s"]
    assert _ckpt(tmp_path, "303")["work_done_s"] == first["work_done_s"]

    # The requeued run (no sidecar this time: the agent runs alone) picks up where the first stopped.
    rc, err = _finish(_start(tmp_path, _env("303", None, restart=1), work_s=3.0))
    assert rc == 0, err
    first, second = _records(tmp_path, "303")
    assert second["restart_count"] == 1 and second["completed"] is True
    assert second["resumed_from_s"] == first["work_done_s"] > 0
    assert second["work_done_s"] >= 3.0
    assert second["iterations"] < 3.0 / (RESNET.iter_ms / 1000 * 0.1)  # it did not start over
    assert _ckpt(tmp_path, "303")["restarts"] == 1


def test_sigterm_saves_and_exits_143(tmp_path):
    proc = _start(tmp_path, _env("304", None), work_s=600)
    entry = tmp_path / "board" / "emu1" / "0" / "304"
    _wait(entry.exists, what="the job's board entry", proc=proc)
    time.sleep(0.3)  # some iterations, so there is progress to save
    proc.send_signal(signal.SIGTERM)
    rc, err = _finish(proc)
    assert rc == 143, err
    rec, = _records(tmp_path, "304")
    assert rec["completed"] is False and rec["work_done_s"] < 600
    assert _ckpt(tmp_path, "304") == {"work_done_s": rec["work_done_s"], "restarts": 0}
    assert not entry.exists(), "a terminated job withdraws from the board"


# --- out of memory, for real: two emulated ResNet-50 jobs on a GPU that holds one and a half -------

OOM_ARGS = ("--gpu-mem-bytes", str(RESNET.mem_bytes * 3 // 2))


def _running(tmp_path: Path, job_id: str, proc: subprocess.Popen) -> dict:
    """Waits until the job computes (its entry carries its load: it is past its arrival)."""
    entry = tmp_path / "board" / "emu1" / "0" / job_id

    def loaded():
        try:
            d = json.loads(entry.read_text())
        except (OSError, ValueError):
            return None
        return d if d["load"] > 0 else None

    return _wait(loaded, what=f"job {job_id} computing", proc=proc)


def test_oom_the_later_job_fails_like_pytorch_and_the_first_runs_on(tmp_path):
    first = _start(tmp_path, _env("401", None), *OOM_ARGS, work_s=600)
    try:
        arrived = _running(tmp_path, "401", first)
        second = _start(tmp_path, _env("402", None), *OOM_ARGS, work_s=600)
        rc, err = _finish(second)
        assert rc == 1, err
        gib, cap = RESNET.mem_bytes / GIB, RESNET.mem_bytes * 3 // 2 / GIB
        assert (f"CUDA out of memory. Tried to allocate {gib:.2f} GiB (GPU 0; {cap:.2f} GiB total capacity; "
                f"{gib:.2f} GiB already allocated") in err
        assert first.poll() is None, "the first job must not fail"
        rec, = _records(tmp_path, "402")
        assert (rec["oom"], rec["completed"], rec["work_done_s"], rec["iterations"]) == (True, False, 0.0, 0)
        assert not (tmp_path / "board" / "emu1" / "0" / "402").exists(), "the failed job withdrew"
        # The survivor's arrival did not move.
        assert json.loads((tmp_path / "board" / "emu1" / "0" / "401").read_text())["since"] == arrived["since"]
    finally:
        first.terminate()
        rc, err = _finish(first)
    assert rc == 143, err
    rec, = _records(tmp_path, "401")
    assert rec["oom"] is False and rec["work_done_s"] > 0


def test_without_the_flag_nothing_runs_out_of_memory(tmp_path):
    first = _start(tmp_path, _env("403", None), work_s=600)
    try:
        _running(tmp_path, "403", first)
        rc, err = _finish(_start(tmp_path, _env("404", None), work_s=0.3))
        assert rc == 0, err
        assert first.poll() is None
    finally:
        first.terminate()
        _finish(first)
    rec, = _records(tmp_path, "404")
    assert rec["completed"] is True and rec["oom"] is False


def test_two_jobs_arriving_together_exactly_one_fails(tmp_path):
    procs = {j: _start(tmp_path, _env(j, None), *OOM_ARGS, work_s=600) for j in ("405", "406")}
    try:
        _wait(lambda: any(p.poll() is not None for p in procs.values()), timeout=60, what="one job failing")
        time.sleep(1.5)  # the other has seen the failed one withdraw, and goes on
        ended = {j: p.returncode for j, p in procs.items() if p.poll() is not None}
        assert list(ended.values()) == [1], ended
        loser, = ended
        winner, = set(procs) - {loser}
        assert _records(tmp_path, loser)[0]["oom"] is True
        assert (tmp_path / "board" / "emu1" / "0" / winner).exists()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
            _finish(p)


def test_a_dead_neighbours_entry_delays_but_does_not_fail_the_job(tmp_path):
    # A neighbour killed without withdrawing: its entry, 6 s old and never refreshed, still counts
    # as fresh (stale after 10 s). The job waits for it instead of failing, then runs.
    now = time.time()
    dead = Board(str(tmp_path / "board"), "emu1", [0], clock=lambda: now - 6)
    dead.publish("499", 0.8, 6 * GIB)
    rc, err = _finish(_start(tmp_path, _env("407", None), *OOM_ARGS, work_s=0.3))
    assert rc == 0, err
    rec, = _records(tmp_path, "407")
    assert (rec["completed"], rec["oom"]) == (True, False)
    assert rec["end_unix"] >= now + 4  # it waited for the entry to go stale


def test_a_live_neighbour_in_the_old_entry_format_makes_the_job_fail(tmp_path):
    # An entry without "since" (from before it existed), kept fresh: it counts as there first.
    entry = tmp_path / "board" / "emu1" / "0" / "498"
    entry.parent.mkdir(parents=True)
    proc = _start(tmp_path, _env("408", None), *OOM_ARGS, work_s=600)
    try:
        while proc.poll() is None:
            entry.write_text(json.dumps({"load": 0.8, "mem_bytes": 6 * GIB, "t": time.time()}))
            time.sleep(0.2)
        rc, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 1 and "CUDA out of memory" in err, err
    assert _records(tmp_path, "408")[0]["oom"] is True


def test_bad_arguments_exit_2_naming_the_flag(tmp_path):
    proc = _start(tmp_path, _env("305", None), "--profile", "nope")
    rc, err = _finish(proc)
    assert rc == 2
    assert "--profile 'nope'" in err and "allowed:" in err and "resnet50" in err and "cyclegan" in err


@pytest.mark.parametrize("args, needle", [
    (["--work-s", "0"], "--work-s must be a number > 0"),
    (["--work-s", "nan"], "--work-s must be a number > 0"),
    (["--spill-rate", "0"], "--spill-rate must be in (0, 1]"),
    (["--spill-rate", "1.5"], "--spill-rate must be in (0, 1]"),
    (["--iter-scale", "-1"], "--iter-scale must be a number > 0"),
    (["--gpu-mem-bytes", "0"], "--gpu-mem-bytes must be an integer >= 1"),
    (["--gpu-mem-bytes", "16GiB"], "--gpu-mem-bytes: invalid int value"),
])
def test_bad_flag_values(tmp_path, capsys, args, needle):
    base = {"--profile": "lstm_lm", "--work-s": "1", "--state-dir": str(tmp_path / "s"),
            "--board-dir": str(tmp_path / "b")}
    argv = [x for k, v in base.items() if k not in args for x in (k, v)] + args
    with pytest.raises(SystemExit) as e:
        ej.parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_state_dir_must_be_a_directory(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        ej.parse_args(["--profile", "lstm_lm", "--work-s", "1", "--state-dir", str(f / "x"),
                       "--board-dir", str(tmp_path / "b")])
    assert e.value.code == 2 and "--state-dir" in capsys.readouterr().err


@pytest.mark.parametrize("env, needle", [
    ({}, "SLURM_JOB_ID=''"),
    ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a'"),
    ({"SLURM_JOB_ID": "7", "ANTMAN_GPUS": "0,x"}, "ANTMAN_GPUS='0,x'"),
    ({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "GPU-1234"}, "CUDA_VISIBLE_DEVICES='GPU-1234'"),
    ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT='-1'"),
])
def test_bad_environment(env, needle):
    with pytest.raises(ej.UsageError) as e:
        ej.identity_from_env(env)
    assert needle in str(e.value)


def test_identity_from_environment():
    i = ej.identity_from_env({"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n3", "ANTMAN_GPUS": "2,3",
                              "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_RESTART_COUNT": "2", "ANTMAN_CLASS": "guaranteed"})
    assert i == ej.Identity("9", "n3", (2, 3), 2, "guaranteed")
    i = ej.identity_from_env({"SLURM_JOB_ID": "9", "CUDA_VISIBLE_DEVICES": "1"})
    assert (i.gpus, i.restart_count, i.job_class) == ((1,), 0, None) and i.node


def test_missing_job_id_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    rc = ej.main(["--profile", "lstm_lm", "--work-s", "1", "--state-dir", str(tmp_path / "s"),
                  "--board-dir", str(tmp_path / "b")])
    assert rc == 2 and "SLURM_JOB_ID" in capsys.readouterr().err
