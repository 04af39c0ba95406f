"""The elastic launcher (torch_patch/elastic_launch.py) and a whole elastic job through a shrink and a
grow, on CPU: torchrun with gloo, CUDA_VISIBLE_DEVICES only a list here. The sidecar is a real ZeroMQ
ROUTER in the test, on the agent channel, as the sidecar's side of docs/protocol.md."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import zmq

from slurm_antman import protocol as P
from torch_patch import elastic_launch as EL

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "slurm_antman" / "lab" / "jobs" / "elastic_train.py"
HB = 0.2


# --- the launcher's pieces, without processes ---------------------------------------------------


@pytest.mark.parametrize("data, why", [
    (b"", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "exactly seq and gpus"),
    (b'{"seq": 1}', "exactly seq and gpus"),
    (b'{"seq": 1, "gpus": [0], "x": 1}', "exactly seq and gpus"),
    (b'{"seq": 0, "gpus": [0]}', "seq 0"),
    (b'{"seq": true, "gpus": [0]}', "seq True"),
    (b'{"seq": 1.0, "gpus": [0]}', "seq 1.0"),
    (b'{"seq": "1", "gpus": [0]}', "seq '1'"),
    (b'{"seq": 1, "gpus": []}', "1 to 64"),
    (b'{"seq": 1, "gpus": "0,1"}', "1 to 64"),
    (b'{"seq": 1, "gpus": [0, 0]}', "listed twice"),
    (b'{"seq": 1, "gpus": [0, -1]}', "integers 0-1023"),
    (b'{"seq": 1, "gpus": [1024]}', "integers 0-1023"),
    (b'{"seq": 1, "gpus": [false]}', "integers 0-1023"),
    (b'{"seq": 1, "gpus": [1.5]}', "integers 0-1023"),
    (json.dumps({"seq": 1, "gpus": list(range(65))}).encode(), "1 to 64"),
    (b'{"seq": 1, "gpus": [0]}' + b" " * 4096, "over 4096"),
])
def test_a_bad_datagram_is_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(EL.BadDatagram, match=re.escape(why)):
        EL.parse_datagram(data)


def test_a_good_datagram_and_the_command_line() -> None:
    assert EL.parse_datagram(b'{"seq": 7, "gpus": [3, 0, 1023]}') == (7, [3, 0, 1023])
    assert EL.parse_datagram(json.dumps({"gpus": list(range(64)), "seq": 2}).encode())[1] == list(range(64))
    assert EL.parse_args(["--width", "2", "--stop-timeout=5", "--tee", "3", "t.py", "--width", "9"]) == \
        (2, 5.0, EL.STANDBY_AFTER_S, ["--tee", "3", "t.py", "--width", "9"])
    assert EL.parse_args(["--", "--width", "t.py"]) == (None, EL.DEFAULT_STOP_TIMEOUT_S, EL.STANDBY_AFTER_S,
                                                        ["--width", "t.py"])
    assert EL.parse_args(["--no-standby", "t.py"])[2] is None
    assert EL.parse_args(["--standby-after", "0", "t.py"])[2] == 0.0
    for bad in (["--width", "0", "t.py"], ["--width=65", "t.py"], ["--stop-timeout", "x", "t.py"], ["--width", "2"], [],
                ["--stop-timeout=0", "t.py"], ["--standby-after=-1", "t.py"]):
        with pytest.raises(EL.UsageError):
            EL.parse_args(bad)
    cvd = P.ENV_CUDA_VISIBLE_DEVICES
    assert EL.initial_gpus({cvd: "2,5", P.ENV_GPUS: "7"}, None) == (["2", "5"], 2)
    assert EL.initial_gpus({cvd: "", P.ENV_GPUS: "4,1,6"}, None) == (["4", "1", "6"], 3)
    assert EL.initial_gpus({cvd: "GPU-3f2a-11"}, 4) == (["GPU-3f2a-11"], 1)  # the list wins
    assert EL.initial_gpus({}, 3) == (None, 3)
    assert EL.initial_gpus({P.ENV_ELASTIC: "1:4"}, None) == (None, 4)
    for env in ({}, {P.ENV_ELASTIC: "3:2"}, {cvd: "NoDevFiles"}):
        with pytest.raises(EL.UsageError):
            EL.initial_gpus(env, None)


def test_physical_gpus_map_to_the_names_the_job_knows_them_by() -> None:
    cvd = P.ENV_CUDA_VISIBLE_DEVICES
    # ConstrainDevices=yes: the Prolog numbers the job's GPUs 0..n-1 and lists the physical ones alike.
    constrained = {cvd: "0,1", P.ENV_GPUS: "2,3"}
    assert EL.visible_names(constrained, ["0", "1"]) == {2: "0", 3: "1"}
    launcher = EL.Launcher(["t.py"], ["0", "1"], 2, 5.0, None, env=constrained)
    assert launcher._gpu_env() == {cvd: "0,1", P.ENV_GPUS: "2,3"}
    # A GPU outside the job's device set could not be opened: the change is refused before anything stops.
    launcher._change(5, [7], time.perf_counter())
    assert (launcher.last_seq, launcher.gpus, launcher.proc) == (5, ["0", "1"], None)
    # Without device constraints the names are the physical indices; outside a job, the list itself.
    assert EL.visible_names({cvd: "2,3", P.ENV_GPUS: "2,3"}, ["2", "3"]) == {2: "2", 3: "3"}
    assert EL.visible_names({cvd: "4,5"}, ["4", "5"]) == {4: "4", 5: "5"}
    assert EL.visible_names({}, None) == {}


# --- the launcher with a plain script (no torch in the workers, no agent) ----------------------------

WORKER = r"""
import json, os, signal, sys, time
out, stop = sys.argv[1], sys.argv[2]
def note(doc):
    with open(out, "a") as f:
        f.write(json.dumps(doc) + "\n")
def on_signal(s, f):
    note({"signal": s, "pid": os.getpid()})
    if s == signal.SIGTERM:
        sys.exit(0)
signal.signal(signal.SIGUSR1, on_signal)
signal.signal(signal.SIGTERM, on_signal)
note({"pid": os.getpid(), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "world": os.environ["WORLD_SIZE"],
      "local_rank": os.environ["LOCAL_RANK"], "socket": os.environ.get("ANTMAN_LAUNCHER_SOCKET")})
while not os.path.exists(stop):
    time.sleep(0.02)
sys.exit(int(sys.argv[3]))
"""


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTMAN_", "SLURM_", "TORCHELASTIC_"))}
    env.pop(P.ENV_CUDA_VISIBLE_DEVICES, None)
    return env


def _wait(cond: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _launcher_socket(stderr: Path) -> Optional[str]:
    m = re.search(r"antman-elastic-launch: socket (\S+);", stderr.read_text() if stderr.exists() else "")
    return m.group(1) if m else None


def _changes(stderr: Path) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"antman-elastic-launch: width change (\{.*\})", stderr.read_text())]


def _send(path: str, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, path)


@pytest.fixture
def plain_job(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out, stop, err = tmp_path / "out.jsonl", tmp_path / "stop", tmp_path / "launcher.err"
    procs = []

    def start(code: int = 0, options: tuple = ()) -> subprocess.Popen:
        env = _clean_env()
        env[P.ENV_CUDA_VISIBLE_DEVICES] = "0,1"
        p = subprocess.Popen([sys.executable, "-m", "torch_patch.elastic_launch", *options, str(script), str(out),
                              str(stop), str(code)], env=env, stderr=open(err, "w"), cwd=tmp_path)
        procs.append(p)
        return p

    yield start, out, stop, err
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_launcher_ignores_bad_datagrams_restarts_on_a_good_one_and_passes_on_the_exit_code(plain_job):
    start, out, stop, err = plain_job
    launcher = start(code=3, options=("--standby-after", "0"))  # the change below takes the standby
    first = _wait(lambda: len(_lines(out)) >= 2 and _lines(out), 30, "two workers")
    assert sorted((w["local_rank"], w["world"], w["cvd"]) for w in first) == [("0", "2", "0,1"), ("1", "2", "0,1")]
    sock = first[0]["socket"]
    d = os.path.dirname(sock)
    assert sock == _launcher_socket(err) and os.stat(d).st_mode & 0o777 == 0o700
    # Bad datagrams: each logged and ignored, the workers untouched.
    for bad in (b"nonsense", b'{"seq": 1, "gpus": [0, 0]}', b'{"seq": 1, "gpus": [0], "why": 1}', b"x" * 5000):
        _send(sock, bad)
    if os.geteuid() == 0:
        # Another user who got as far as the socket (the directory opened up for the test) is refused.
        os.chmod(d, 0o755)
        os.chmod(sock, 0o777)
        subprocess.run([sys.executable, "-c", f"import os, socket; os.setgid(65534); os.setuid(65534); "
                        f"socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'{{\"seq\":1,\"gpus\":[1]}}', {sock!r})"],
                       check=True, timeout=30)
        os.chmod(d, 0o700)
    _wait(lambda: err.read_text().count("ignoring a") >= 4 + (os.geteuid() == 0), 10, "the launcher's refusals")
    text = err.read_text()
    assert "not JSON" in text and "listed twice" in text and "exactly seq and gpus" in text and "over 4096" in text
    if os.geteuid() == 0:
        assert "ignoring a datagram from uid 65534" in text
    time.sleep(0.3)
    assert len(_lines(out)) == 2 and launcher.poll() is None and not _changes(err)
    # SIGUSR1 reaches both workers, which go on.
    launcher.send_signal(signal.SIGUSR1)
    _wait(lambda: len([x for x in _lines(out) if x.get("signal") == signal.SIGUSR1]) == 2, 10, "SIGUSR1 in the workers")
    assert launcher.poll() is None
    # A good one: the workers are stopped (SIGTERM) and one is started on GPU 1.
    _send(sock, b'{"seq": 4, "gpus": [1]}')
    _wait(lambda: _changes(err), 30, "the width change")
    new = _wait(lambda: [x for x in _lines(out) if "world" in x and x["pid"] not in {w["pid"] for w in first}],
                30, "the new worker")
    assert [(w["local_rank"], w["world"], w["cvd"], w["socket"]) for w in new] == [("0", "1", "1", sock)]
    assert {x["pid"] for x in _lines(out) if x.get("signal") == signal.SIGTERM} == {w["pid"] for w in first}
    change = _changes(err)[0]
    assert (change["seq"], change["gpus_from"], change["gpus_to"], change["width_to"]) == (4, ["0", "1"], ["1"], 1)
    assert change["standby"] is True
    assert 0 < change["gone_s"] <= change["started_s"]
    print(f"\nlauncher alone: old workers gone {change['gone_s']:.3f} s, new torchrun started {change['started_s']:.3f} s")
    # A stale seq is ignored.
    _send(sock, b'{"seq": 4, "gpus": [0, 1]}')
    _wait(lambda: "ignoring width seq 4" in err.read_text(), 10, "the stale seq refused")
    stop.touch()
    assert launcher.wait(30) == 3  # the training's own exit code
    assert not os.path.exists(d)


def test_sigterm_to_the_launcher_stops_the_workers_and_removes_its_directory(plain_job):
    start, out, stop, err = plain_job
    launcher = start()
    first = _wait(lambda: len(_lines(out)) >= 2 and _lines(out), 30, "two workers")
    d = os.path.dirname(first[0]["socket"])
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(30) == 128 + signal.SIGTERM
    assert {x["pid"] for x in _lines(out) if x.get("signal") == signal.SIGTERM} == {w["pid"] for w in first}
    for w in first:
        assert not os.path.exists(f"/proc/{w['pid']}") or "zombie" in Path(f"/proc/{w['pid']}/status").read_text()
    assert not os.path.exists(d)


# --- a whole elastic job with a sidecar ------------------------------------------------------------


@dataclass
class Got:
    t: float
    ident: bytes
    msg: P.Message


class Sidecar:
    """A ROUTER on the agent channel: answers register, heartbeats every agent, sends to one agent."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.endpoint = P.ipc(path)
        self.got: list[Got] = []
        self._cond = threading.Condition()
        self._out: "queue.Queue[tuple[bytes, P.Message]]" = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Sidecar":
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def send(self, ident: bytes, body: P.Body) -> str:
        msg = P.Message(body=body)
        self._out.put((ident, msg))
        return msg.id

    def wait(self, pred: Callable[[Got], bool], timeout: float, what: str) -> Got:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for g in self.got:
                    if pred(g):
                        return g
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"sidecar: no {what} in {timeout} s; got {[g.msg.type for g in self.got][-12:]}")
                self._cond.wait(left)

    def registers(self) -> list[Got]:
        with self._cond:
            return [g for g in self.got if g.msg.type == "register"]

    def _run(self) -> None:
        ctx = zmq.Context(1)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        sock.bind(self.endpoint)
        self._ready.set()
        idents: dict[bytes, float] = {}
        last_hb = time.monotonic()
        try:
            while not self._stop.is_set():
                if sock.poll(20):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        ident = frames[0]
                        msg = P.decode(frames[1:], accept=P.AGENT_TO_SIDECAR)
                        idents[ident] = time.monotonic()
                        if msg.type == "register":
                            sock.send_multipart([ident, *P.encode(P.reply(msg, P.Registered(
                                job_id="42", job_class="opportunistic", seq=0, mem_limit_bytes=None,
                                compute_share=1.0, heartbeat_s=HB, throttle="launch")))])
                        elif msg.type == "bye":
                            idents.pop(ident, None)
                        with self._cond:
                            self.got.append(Got(time.perf_counter(), ident, msg))
                            self._cond.notify_all()
                while not self._out.empty():
                    ident, msg = self._out.get()
                    sock.send_multipart([ident, *P.encode(msg)])
                if time.monotonic() - last_hb >= HB:
                    last_hb = time.monotonic()
                    for ident, seen in list(idents.items()):
                        if last_hb - seen > 10 * HB:
                            idents.pop(ident)  # gone without a bye
                        else:
                            sock.send_multipart([ident, *P.encode(P.Message(body=P.Heartbeat()))])
        finally:
            sock.close(0)
            ctx.term()


@pytest.fixture
def sidecar(tmp_path):
    short = f"/tmp/antman-elastic-test-{os.getpid()}-{tmp_path.name[-12:]}"
    s = Sidecar(os.path.join(short, "jobs", "42", "agent.sock")).start()
    yield s
    s.stop()
    shutil.rmtree(short, ignore_errors=True)


# Slow (13 s): tests/test_cluster_elastic.py runs the same job through the real sidecar and Slurm, and
# make test is at its 15-minute limit; this one stays for a run without a cluster.
@pytest.mark.slow
def test_an_elastic_job_shrinks_and_grows_under_the_launcher_losing_nothing(tmp_path, sidecar):
    steps, every = 50, 10
    ckpt, log, err = tmp_path / "ckpt.pt", tmp_path / "train.jsonl", tmp_path / "launcher.err"
    env = _clean_env()
    env.update({P.ENV_JOB_ID: "42", P.ENV_CLASS: "opportunistic", P.ENDPOINT_ENV: sidecar.endpoint,
                P.ENV_CUDA_VISIBLE_DEVICES: "0,1"})
    t_start = time.monotonic()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch_patch.elastic_launch", str(TRAIN), "--ckpt", str(ckpt), "--log-file", str(log),
         "--steps", str(steps), "--step-s", "0.1", "--ckpt-every", str(every)],
        env=env, stderr=open(err, "w"), cwd=tmp_path)
    try:
        def step_lines() -> list[dict]:
            return [x for x in _lines(log) if x["event"] == "step"]

        def agents(world: int, n: int, after: float) -> list[Got]:
            regs = {g.msg.body.pid: g for g in sidecar.registers() if g.t > after and g.msg.body.world_size == world}
            return sorted(regs.values(), key=lambda g: g.msg.body.local_rank) if len(regs) >= n else []

        def change(seq: int, gpus: list[int], at_least: int, world_before: int, n_after: int) -> tuple[Got, float]:
            _wait(lambda: [x for x in step_lines() if x["world_size"] == world_before and x["step"] >= at_least],
                  60, f"step {at_least} at world size {world_before}")
            regs = agents(world_before, world_before, 0.0 if seq == 1 else sidecar_t[-1])
            rank0 = [g for g in regs if P.FEATURE_WIDTH in g.msg.body.features]
            assert len(rank0) == 1 and rank0[0].msg.body.local_rank == 0
            sent = time.perf_counter()
            mid = sidecar.send(rank0[0].ident, P.Width(seq=seq, gpus=gpus, reason=f"test change {seq}"))
            done = sidecar.wait(lambda g: g.msg.type == "width_done" and g.msg.body.seq == seq, 30, f"width_done {seq}")
            assert done.ident == rank0[0].ident and done.msg.ref == mid and done.msg.body.checkpoint_ms >= 0
            sidecar_t.append(sent)
            _wait(lambda: agents(len(gpus), n_after, sent), 60, f"{n_after} agents at world size {len(gpus)}")
            return done, sent

        sidecar_t: list[float] = []
        _wait(lambda: agents(2, 2, 0.0), 60, "the first two agents")
        done1, _ = change(1, [0], 6, 2, 1)
        first_at_1 = _wait(lambda: [x for x in step_lines() if x["world_size"] == 1], 60, "a step at width 1")[0]
        # Late enough for the launcher's standby torchrun (started 3 s after each start) to be ready.
        done2, _ = change(2, [0, 1], first_at_1["step"] + 15, 1, 2)
        assert launcher.wait(90) == 0
        wall = time.monotonic() - t_start
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

    # --- what the sidecar saw: 5 workers, one register each (plus re-registrations), rank 0's with "width" ---
    regs = sidecar.registers()
    by_pid: dict[int, P.Register] = {}
    for g in regs:
        by_pid.setdefault(g.msg.body.pid, g.msg.body)
    assert sorted((r.world_size, r.local_rank) for r in by_pid.values()) == [(1, 0), (2, 0), (2, 0), (2, 1), (2, 1)]
    for r in by_pid.values():
        assert (P.FEATURE_WIDTH in r.features) == (r.local_rank == 0), r
    assert all(P.FEATURE_WIDTH in g.msg.body.features for g in regs if g.msg.body.local_rank == 0)
    assert not [g for g in sidecar.got if g.msg.type == "error"]
    # The old workers leave with a bye (elastic_train's SIGTERM handler stops the agent); the sidecar
    # must not count on it (a worker killed outright says nothing), so it is reported, not asserted.
    old = {g.ident for g in regs if g.t < sidecar_t[-1]}
    byes = {g.ident for g in sidecar.got if g.msg.type == "bye"} & old

    # --- the training log: 3 starts, world sizes 2 -> 1 -> 2, nothing skipped, repeats only back to the checkpoint ---
    lines = _lines(log)
    starts = [i for i, x in enumerate(lines) if x["event"] == "start"]
    assert [lines[i]["world_size"] for i in starts] == [2, 1, 2] and lines[starts[0]]["step"] == 0
    segments = [lines[a + 1:b] for a, b in zip(starts, starts[1:] + [len(lines)])]
    gaps = []
    for k, seg in enumerate(segments):
        seg_steps = [x for x in seg if x["event"] == "step"]
        begin = lines[starts[k]]["step"]
        assert [x["step"] for x in seg_steps] == list(range(begin + 1, begin + 1 + len(seg_steps))), k
        assert all(x["world_size"] == lines[starts[k]]["world_size"] for x in seg_steps)
        for x in seg_steps:
            assert (x["first"], x["last"]) == ((x["step"] - 1) * 8, x["step"] * 8 - 1)
        if k:
            prev = [x for x in segments[k - 1] if x["event"] == "step"]
            # The width change's checkpoint holds the last step logged before it: nothing is skipped and
            # nothing repeated (a checkpoint every `every` steps bounds it in any case).
            assert prev[-1]["step"] == begin, (prev[-1], lines[starts[k]])
            gaps.append(seg_steps[0]["time"] - prev[-1]["time"])
    assert segments[-1][-1]["event"] == "end" and segments[-1][-1]["step"] == steps
    assert [x["step"] for x in lines if x["event"] == "step"] == list(range(1, steps + 1))
    assert ckpt.exists() and not list(tmp_path.glob("ckpt.pt.*.tmp"))

    # --- the launcher: two changes logged, its directory gone ---
    changes = _changes(err)
    assert [(c["seq"], c["gpus_to"], c["width_to"]) for c in changes] == [(1, ["0"], 1), (2, ["0", "1"], 2)]
    d = os.path.dirname(_launcher_socket(err) or "/nonexistent/x")
    assert os.path.basename(d).startswith("antman-elastic-") and not os.path.exists(d)
    print(f"\nelastic job: {steps} steps in {wall:.1f} s wall; byes from the old agents: {len(byes)} of {len(old)}")
    for c, gap, done in zip(changes, gaps, (done1, done2)):
        print(f"  width {c['width_from']} -> {c['width_to']}: checkpoint_ms {done.msg.body.checkpoint_ms:.1f}, "
              f"old workers gone {c['gone_s']:.3f} s, new torchrun started {c['started_s']:.3f} s "
              f"({'standby' if c['standby'] else 'cold'}), training gap (last step before -> first step after) {gap:.2f} s")
