"""The launcher across nodes (torch_patch/elastic_nodes.py, torch_patch/elastic_rdzv.py): the rendezvous
file's strict reading, the options, and launcher processes playing the tasks of one job array on
loopback (no Slurm: the array's variables are set by hand, scancel is a stub on PATH that records its
arguments), training slurm_antman/lab/jobs/elastic_train.py on CPU with gloo through a shrink and a grow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from slurm_antman import protocol as P
from torch_patch import elastic_launch as EL
from torch_patch import elastic_nodes as EN
from torch_patch import elastic_rdzv as ER

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "slurm_antman" / "lab" / "jobs" / "elastic_train.py"
ARRAY = str(900000 + os.getpid() % 100000)  # the rendezvous id: unique to this run of the tests
GOOD = {"addr": "127.0.0.1", "port": 29400, "job_id": "1001", "array_job_id": ARRAY, "restart": 0,
        "time": 1795000000.5}


# --- the rendezvous file -----------------------------------------------------------------------------


def _doc(**change: object) -> bytes:
    return json.dumps({**GOOD, **change}).encode()


@pytest.mark.parametrize("data, why", [
    (b"", "not JSON"),
    (b"\xff{", "not JSON"),
    (b"[1]", "exactly addr"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "time"}).encode(), "exactly addr"),
    (_doc(extra=1), "exactly addr"),
    (_doc(addr=7), "addr 7"),
    (_doc(addr="10.0.0.1; rm -rf"), "addr '10.0.0.1; rm -rf'"),
    (_doc(addr=""), "addr ''"),
    (_doc(port="29400"), "port '29400'"),
    (_doc(port=True), "port True"),
    (_doc(port=29400.0), "port 29400.0"),
    (_doc(port=0), "port 0"),
    (_doc(port=65536), "port 65536"),
    (_doc(job_id=1001), "job_id 1001"),
    (_doc(job_id="1001_3"), "job_id '1001_3'"),
    (_doc(array_job_id=int(ARRAY)), "array_job_id"),
    (_doc(array_job_id="12345"), "this task is of array"),
    (_doc(restart=-1), "restart -1"),
    (_doc(restart=False), "restart False"),
    (_doc(time="now"), "time 'now'"),
    (_doc(time=0), "time 0"),
    (b'{"addr": "127.0.0.1", "port": 1, "job_id": "1", "array_job_id": "' + ARRAY.encode()
     + b'", "restart": 0, "time": NaN}', "time nan"),
    (_doc() + b" " * 4096, "over 4096"),
])
def test_a_bad_rendezvous_file_is_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(ER.Refused, match=re.escape(why)):
        ER.parse_rdzv(data, ARRAY)


def test_the_rendezvous_file_is_written_privately_and_read_only_as_a_regular_file(tmp_path) -> None:
    path = ER.rdzv_path(str(tmp_path), ARRAY)
    assert os.path.basename(path) == f".antman-rdzv.{ARRAY}.json"
    assert ER.read_rdzv(path, ARRAY) is None  # not there yet: wait
    st = ER.write_rdzv(path, GOOD)
    assert st.st_mode & 0o777 == 0o600 and os.listdir(tmp_path) == [os.path.basename(path)]
    assert ER.read_rdzv(path, ARRAY) == GOOD and ER.parse_rdzv(_doc(addr="node-3.cluster"), ARRAY)["addr"]
    assert ER.endpoint(GOOD) == "127.0.0.1:29400" and ER.endpoint({**GOOD, "addr": "::1"}) == "[::1]:29400"
    # A symbolic link in its place (to a good file, even) is refused: opened with O_NOFOLLOW.
    os.rename(path, tmp_path / "real.json")
    os.symlink(tmp_path / "real.json", path)
    with pytest.raises(ER.Refused, match="a symbolic link; refused"):
        ER.read_rdzv(path, ARRAY)
    os.unlink(path)
    os.mkdir(path)
    with pytest.raises(ER.Refused, match="refused"):
        ER.read_rdzv(path, ARRAY)
    os.rmdir(path)
    os.mkfifo(path)  # would block a plain open
    with pytest.raises(ER.Refused, match="not a regular file"):
        ER.read_rdzv(path, ARRAY)
    os.unlink(path)
    Path(path).write_bytes(b"{not json")
    with pytest.raises(ER.Refused, match=f"rendezvous file {re.escape(path)}: not JSON"):
        ER.read_rdzv(path, ARRAY)
    if os.geteuid() == 0:
        ER.write_rdzv(path, GOOD)
        os.chown(path, 65534, 65534)  # another user's file in a shared directory
        with pytest.raises(ER.Refused, match="not a regular file of uid 0"):
            ER.read_rdzv(path, ARRAY)


def test_a_free_port_answers_only_once_something_listens() -> None:
    import socket

    port = ER.free_port()
    assert not ER.answers("127.0.0.1", port)  # nothing listens on the port it hands out
    with socket.create_server(("127.0.0.1", port)):
        assert ER.answers("127.0.0.1", port)


# --- options, the environment, the command line ----------------------------------------------------------


def _parse(argv: list[str]) -> EN.Options:
    return EN.parse_args(argv, EL.parse_args)


def test_the_options_and_what_goes_to_torchrun() -> None:
    o = _parse(["--width", "2", "--node-addr=10.1.2.3", "--rdzv-dir", "/shared/x", "--max-restarts", "5",
                "--no-standby", "--join-timeout=60", "--tee", "3", "t.py", "--width", "9"])
    assert (o.width, o.node_addr, o.rdzv_dir, o.max_restarts, o.join_timeout, o.rest) == \
        (2, "10.1.2.3", "/shared/x", 5, 60, ["--tee", "3", "t.py", "--width", "9"])
    o = _parse(["--", "--node-addr", "t.py"])
    assert (o.width, o.node_addr, o.max_restarts, o.join_timeout, o.stop_timeout, o.rest) == \
        (None, None, 20, 600, EL.DEFAULT_STOP_TIMEOUT_S, ["--node-addr", "t.py"])
    for bad in (["--node-addr", "a b", "t.py"], ["--max-restarts=-1", "t.py"], ["--max-restarts=1001", "t.py"],
                ["--join-timeout=5", "t.py"], ["--join-timeout=1.5", "t.py"], ["--width", "0", "t.py"],
                ["--node-addr"], ["--rdzv-dir", "/x"]):
        with pytest.raises(ValueError):
            _parse(bad)


def _array_env(tmp_path: Path, task: int, **more: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTMAN_", "SLURM_", "TORCHELASTIC_"))}
    env.pop(P.ENV_CUDA_VISIBLE_DEVICES, None)
    env.update({"SLURM_ARRAY_JOB_ID": ARRAY, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_JOB_ID": str(int(ARRAY) + 1 + task), P.ENV_ELASTIC: "1:2",
                "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"})
    env.update(more)
    return env


def _across(argv: list[str], env: dict) -> Optional[int]:
    return EN.across_nodes(argv, EL.parse_args, EL.initial_gpus, env)


def test_only_an_array_task_narrower_than_max_is_one_node_of_many(tmp_path, capsys) -> None:
    env = _array_env(tmp_path, 0)
    # A training of its own: not an array, no range, or this task holds MAX itself.
    assert _across(["--width", "1", "t.py"], {k: v for k, v in env.items() if k != "SLURM_ARRAY_JOB_ID"}) is None
    assert _across(["--width", "1", "t.py"], {k: v for k, v in env.items() if k != P.ENV_ELASTIC}) is None
    assert _across(["--width", "2", "t.py"], env) is None
    assert _across(["t.py"], env) is None  # no GPU list, no --width: the one-node launcher's MAX
    assert _across(["t.py"], {**env, P.ENV_CUDA_VISIBLE_DEVICES: "0,1"}) is None
    # Refusals, one line each.
    assert _across(["--width", "1", "t.py"], {**env, P.ENV_ELASTIC: "2:3", P.ENV_CUDA_VISIBLE_DEVICES: "0,1"}) == 2
    assert "MAX is not a whole number of nodes of 2 GPUs" in capsys.readouterr().err
    assert _across(["--width", "1", "--node-addr", "127.0.0.1", "t.py"], env) == 2  # no SLURM_SUBMIT_DIR
    assert "pass --rdzv-dir DIR" in capsys.readouterr().err
    assert _across(["--width", "1", "--node-addr", "127.0.0.1", "t.py"], {**env, "SLURM_ARRAY_TASK_MIN": "x"}) == 2
    assert "SLURM_ARRAY_TASK_MIN='x'" in capsys.readouterr().err
    assert _across(["--help"], env) == 0 and "--node-addr ADDR" in capsys.readouterr().out
    assert _across(["--width", "1", "--max-restarts", "x", "t.py"], env) == 2
    assert "--max-restarts='x'" in capsys.readouterr().err


def _stub(tmp_path: Path, name: str, body: str) -> None:
    (tmp_path / "bin").mkdir(exist_ok=True)
    path = tmp_path / "bin" / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_the_node_address_is_slurms_nodeaddr_and_the_command_line(tmp_path, capsys) -> None:
    _stub(tmp_path, "scontrol", 'echo "$*" > "$(dirname "$0")/scontrol.argv"\n'
          'echo "NodeName=$4 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.9.8.7 NodeHostName=devhost Version=22.05"\n')
    env = _array_env(tmp_path, 1, SLURMD_NODENAME="node-1", SLURM_SUBMIT_DIR=str(tmp_path))
    assert EN.slurm_node_addr(env) == "10.9.8.7"
    assert (tmp_path / "bin" / "scontrol.argv").read_text().split() == ["show", "node", "-o", "node-1"]
    opts = _parse(["--width", "2", "--max-restarts", "7", "--join-timeout", "120", "t.py", "--lr", "1"])
    task = EN.NodeTask(opts, {**env, P.ENV_ELASTIC: "3:8"}, None, 2, (2, 4))
    assert (task.addr, task.host, task.path) == ("10.9.8.7", False, ER.rdzv_path(str(tmp_path), ARRAY))
    assert task.owned({**GOOD, "addr": "10.0.0.5"}) == [
        "--nnodes=2:4", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.5:29400",
        f"--rdzv-id={ARRAY}", "--rdzv-conf=is_host=0,join_timeout=120,last_call_timeout=1,keep_alive_interval=1,"
        "keep_alive_max_attempt=5", "--local-addr=10.9.8.7", "--max-restarts=7"]
    # Without a usable NodeAddr the task stops at once, saying what to pass.
    _stub(tmp_path, "scontrol", 'echo "scontrol: error: Node node-1 not found" >&2; exit 1\n')
    with pytest.raises(ER.Refused, match="Node node-1 not found.*pass --node-addr ADDR"):
        EN.slurm_node_addr(env)
    _stub(tmp_path, "scontrol", 'echo "NodeName=node-1 NodeAddr=(null)"\n')
    with pytest.raises(ER.Refused, match=r"NodeAddr='\(null\)'.*pass --node-addr"):
        EN.slurm_node_addr(env)
    assert _across(["--width", "1", "t.py"], env) == 2
    assert "pass --node-addr ADDR" in capsys.readouterr().err


def test_torchrun_refuses_the_options_the_launcher_owns_across_nodes(tmp_path) -> None:
    owned = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1",
             f"--rdzv-id={ARRAY}", "--local-addr=127.0.0.1", "--max-restarts=3"]
    r = subprocess.run([sys.executable, "-m", "torch_patch._torchrun", f"--antman-nodes={len(owned)}", *owned,
                        "--rdzv-conf=join_timeout=5", "t.py"], capture_output=True, text=True, timeout=120,
                       env=_array_env(tmp_path, 0))
    assert r.returncode == 2 and "do not pass --rdzv-conf" in r.stderr and "across nodes" in r.stderr, r.stderr


# --- tasks of one array, on loopback ---------------------------------------------------------------


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


def _starts(err: Path) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"^antman-elastic-nodes: (\{.*\})$", err.read_text(), re.M)]


class Array:
    """Launchers as the tasks of one array: task k at its own loopback address."""

    def __init__(self, tmp_path: Path, steps: int, step_s: float, agent: bool = False) -> None:
        self.tmp = tmp_path
        self.log, self.ckpt = tmp_path / "train.jsonl", tmp_path / "ckpt.pt"
        self.steps, self.step_s, self.agent = steps, step_s, agent
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        _stub(tmp_path, "scancel", 'printf "%s\\n" "$*" >> "$(dirname "$0")/scancel.argv"\n')

    def start(self, task: int, addr: str, restart: int = 0) -> tuple[subprocess.Popen, Path]:
        more = {"SLURM_RESTART_COUNT": str(restart), "SLURM_JOB_ID": str(int(ARRAY) + 10 * restart + task + 1)}
        if self.agent:
            # What a slurm-antman job has, but no sidecar: the workers' agents run without one.
            more.update({P.ENV_JOB_ID: more["SLURM_JOB_ID"], P.ENV_CLASS: "opportunistic"})
        err = self.tmp / f"task{task}.{len(self.procs)}.err"
        p = subprocess.Popen(
            [sys.executable, "-m", "torch_patch.elastic_launch", "--width", "1", "--node-addr", addr,
             "--rdzv-dir", str(self.tmp), "--join-timeout", "120", str(TRAIN), "--ckpt", str(self.ckpt),
             "--log-file", str(self.log), "--steps", str(self.steps), "--step-s", str(self.step_s), "--ckpt-every", "1"],
            env=_array_env(self.tmp, task, **more), stderr=open(err, "w"), stdout=subprocess.DEVNULL, cwd=self.tmp)
        self.procs.append((p, err))
        return p, err

    def steps_at(self, world: int, after: float = 0.0) -> list[dict]:
        return [x for x in _lines(self.log) if x["event"] == "step" and x["world_size"] == world and x["time"] > after]

    def scancels(self) -> list[str]:
        f = self.tmp / "bin" / "scancel.argv"
        return f.read_text().splitlines() if f.exists() else []

    def close(self) -> None:
        for p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, _ in self.procs:
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _check_log(log: Path, steps: int) -> list[int]:
    """Every step from 1 to the last, none skipped (one may be redone after a restart, from the
    checkpoint); each on its own samples. The world sizes, in order, with repeats folded."""
    lines = _lines(log)
    done = 0
    for x in lines:
        if x["event"] == "start":
            assert x["step"] <= done, ("a start ahead of the steps logged", x, done)
        elif x["event"] == "step":
            assert 1 <= x["step"] <= done + 1, ("a step skipped", x, done)
            assert (x["first"], x["last"]) == ((x["step"] - 1) * 8, x["step"] * 8 - 1)
            done = max(done, x["step"])
    assert lines[-1]["event"] == "end" and lines[-1]["step"] == steps == done
    worlds: list[int] = []
    for x in lines:
        if x["event"] == "step" and (not worlds or worlds[-1] != x["world_size"]):
            worlds.append(x["world_size"])
    return worlds


def test_the_log_check_takes_a_redone_step_and_refuses_a_skipped_one(tmp_path) -> None:
    """The training test's own check (``_check_log``) must be able to fail: a step redone from the
    checkpoint after a restart passes, a gap in the steps does not."""
    def step(n: int, world: int) -> dict:
        return {"event": "step", "step": n, "first": (n - 1) * 8, "last": n * 8 - 1, "world_size": world}

    def log(*xs: dict) -> Path:
        f = tmp_path / "log.jsonl"
        f.write_text("".join(json.dumps(x) + "\n" for x in xs))
        return f

    redone = log({"event": "start", "step": 0}, step(1, 2), step(2, 2), {"event": "start", "step": 1},
                 step(2, 1), step(3, 1), {"event": "end", "step": 3})
    assert _check_log(redone, 3) == [2, 1]
    with pytest.raises(AssertionError, match="a step skipped"):
        _check_log(log({"event": "start", "step": 0}, step(1, 2), step(3, 2), {"event": "end", "step": 3}), 3)
    with pytest.raises(AssertionError, match="a start ahead"):
        _check_log(log({"event": "start", "step": 0}, step(1, 2), {"event": "start", "step": 2}), 2)


@pytest.mark.slow  # ~30 s of torch imports and rendezvous: `make test-slow` (make test's 15 minutes)
def test_two_tasks_train_shrink_to_one_and_grow_back_losing_nothing(tmp_path) -> None:
    steps = 120  # about 30 are done when the grow is back at world size 2: room for a slow machine
    array = Array(tmp_path, steps, 0.1, agent=True)
    path = Path(ER.rdzv_path(str(tmp_path), ARRAY))
    # A file an earlier task 0 left behind (killed outright): its store never answers.
    ER.write_rdzv(str(path), {**GOOD, "port": ER.free_port(), "job_id": "17"})
    t_begin = time.monotonic()
    try:
        # Task 1 at 127.0.0.1 sorts first: its node has rank 0 while it runs, so rank 0 moves at each change.
        task1, err1 = array.start(1, "127.0.0.1")
        _wait(lambda: "waiting for task 0's store" in err1.read_text(), 60, "task 1 waiting on the stale file")
        task0, err0 = array.start(0, "127.0.0.2")
        _wait(lambda: len(array.steps_at(2)) >= 5, 90, "(a) five steps at world size 2")
        assert json.loads(path.read_text())["job_id"] == str(int(ARRAY) + 1) and path.stat().st_mode & 0o777 == 0o600

        t_shrink = time.time()
        task1.send_signal(signal.SIGTERM)  # Slurm requeueing task 1
        assert task1.wait(60) == 128 + signal.SIGTERM
        first1 = _wait(lambda: array.steps_at(1, t_shrink), 90, "(b) a step at world size 1")[0]
        _wait(lambda: len(array.steps_at(1, t_shrink)) >= 5, 60, "five steps at world size 1")

        t_grow = time.time()
        task1b, err1b = array.start(1, "127.0.0.1", restart=1)  # Slurm starting the requeued task again
        first2 = _wait(lambda: array.steps_at(2, t_grow), 90, "(c) a step at world size 2 again")[0]
        assert task0.wait(120) == 0 and task1b.wait(60) == 0
        wall = time.monotonic() - t_begin
    finally:
        array.close()

    assert first2["step"] < steps, "the training ended before the grow: raise steps"
    worlds = _check_log(array.log, steps)
    assert worlds[-3:] == [2, 1, 2] and len(worlds) <= 4, worlds  # (a 1 first: task 0 alone at the start)
    assert array.scancels() == [f"--state=PENDING {ARRAY}"]  # once, by task 0, at the end
    assert not path.exists() and not list(tmp_path.glob(".antman-rdzv.*"))
    s0, s1, s1b = _starts(err0), _starts(err1), _starts(err1b)
    assert [(s["task"], s["host"]) for s in s0 + s1 + s1b] == [(0, True), (1, False), (1, False)]
    assert s1[0]["endpoint"] == s0[0]["endpoint"] == s1b[0]["endpoint"]
    assert s0[0]["torchrun"][:9] == [
        "torchrun", "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={s0[0]['endpoint']}", f"--rdzv-id={ARRAY}",
        "--rdzv-conf=is_host=1,join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5",
        "--local-addr=127.0.0.2", "--max-restarts=20"]
    assert s0[0]["torchrun"][9] == str(TRAIN)
    # The workers' agents ran without a sidecar and got no launcher socket (no width changes here).
    assert "the agent runs without a sidecar" in err0.read_text()
    assert "Traceback" not in err1b.read_text()
    shrink, grow = first1["time"] - t_shrink, first2["time"] - t_grow
    print(f"\nacross nodes, 2 tasks on loopback (CPU, gloo): {steps} steps in {wall:.1f} s; training gap at the "
          f"shrink (SIGTERM to task 1 -> first step at world size 1) {shrink:.2f} s, at the grow (task 1 "
          f"started -> first step at world size 2) {grow:.2f} s")
    assert 0 < shrink < 60 and 0 < grow < 60


@pytest.mark.slow  # ~30 s of torch imports and rendezvous: `make test-slow` (make test's 15 minutes)
def test_when_task_0_goes_the_others_wait_for_its_next_store_and_go_on(tmp_path) -> None:
    steps = 60  # about 5 are done when task 0 goes
    array = Array(tmp_path, steps, 0.1)
    try:
        task0, err0 = array.start(0, "127.0.0.1")
        task1, err1 = array.start(1, "127.0.0.2")
        _wait(lambda: len(array.steps_at(2)) >= 5, 90, "five steps at world size 2")
        t_gone = time.time()
        task0.send_signal(signal.SIGTERM)  # task 0 requeued: its store goes with it
        assert task0.wait(60) == 128 + signal.SIGTERM
        assert not Path(ER.rdzv_path(str(tmp_path), ARRAY)).exists()
        _wait(lambda: "is gone: waiting for its next rendezvous file (retry 1 of 20)" in err1.read_text(), 90,
              "task 1 noticing the store gone")
        t_back = time.time()
        task0b, err0b = array.start(0, "127.0.0.1", restart=1)
        first = _wait(lambda: array.steps_at(2, t_back), 90, "a step at world size 2 with task 0's new store")[0]
        assert task0b.wait(120) == 0 and task1.wait(60) == 0
    finally:
        array.close()
    assert first["step"] < steps
    _check_log(array.log, steps)
    s1 = _starts(err1)
    assert [s["start"] for s in s1] == [1, 2] and s1[0]["endpoint"] != s1[1]["endpoint"] == _starts(err0b)[0]["endpoint"]
    assert array.scancels() == [f"--state=PENDING {ARRAY}"]
    print(f"\ntask 0 requeued: training stopped {t_back - t_gone:.1f} s until it came back, then trained "
          f"again {first['time'] - t_back:.2f} s after its start")
