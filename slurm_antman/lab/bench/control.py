"""``antman bench control``: the agent <-> sidecar control path, measured on this machine.

It runs a real PyTorch training loop under the real agent (torch_patch), connected over ZeroMQ IPC
to :class:`PeerSidecar`, a minimal sidecar that speaks the agent side of docs/protocol.md (it binds
the per-job ROUTER, answers ``register``, sends ``limits``/``preempt``/anything, records what comes
back). The tests use the same peer. It measures:

- ``rtt_p50_us`` / ``rtt_p99_us``: a ``limits`` sent by the sidecar until its ``ack`` is back, while
  the job runs a custom loop of short iterations (``torch_patch.step()`` after a small matmul,
  ``rtt_loop_iteration_us`` each): transport both ways, decoding, applying the limits at the
  boundary and the ack, plus the wait for that boundary, which this loop keeps small;
- ``floor_rtt_p50_us`` / ``floor_rtt_p99_us``: in the same run, a bare DEALER/ROUTER echo between the
  same two processes over IPC, no protocol, nothing else running: what this machine's ZeroMQ and
  scheduler cost before slurm-antman does anything;
- ``rtt_training_p50_us`` / ``rtt_training_p99_us``: the same round trip while the job trains with
  optimizer steps of ``rtt_training_iteration_us``: a limit waits for the next boundary by design, so
  this grows with the job's iteration time;
- ``propagation_iterations``: over both loops, the worst ``ack.applied_iteration`` minus the iteration
  during which the limits arrived (1: applied from the next iteration on);
- ``throttle_error``: the worst |duty cycle - share| over shares 0.25, 0.5, 0.75, the duty cycle
  being the unthrottled iteration time over the throttled one, measured interleaved;
- ``overhead_ratio``: the loop's time with the agent attached (share 1, reporting to the sidecar)
  over the same loop without it, interleaved A-B-B-A blocks, median ratio;
  ``overhead_control_ratio`` is the same measurement with the agent detached on both sides (what
  this machine's noise alone reports), ``boundary_cost_us`` one boundary's cost timed directly,
  against ``overhead_loop_iteration_us``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import zmq

from torch_patch.client import drain_wakeups

from slurm_antman import protocol as P


@dataclass
class Received:
    t: float  # perf_counter on arrival
    msg: Optional[P.Message]
    error: Optional[P.ProtocolError] = None


@dataclass
class PeerSidecar:
    """A ROUTER at ``path`` that plays the sidecar for one job's agents (tests and this benchmark)."""

    path: str
    job_id: str = "42"
    job_class: str = "opportunistic"
    mem_limit_bytes: Optional[int] = None
    compute_share: float = 1.0
    heartbeat_s: float = 0.2
    throttle: str = "launch"
    seq: int = 0
    received: list = field(default_factory=list)
    sent_at: dict = field(default_factory=dict)  # message id -> perf_counter when sent

    def __post_init__(self) -> None:
        self.endpoint = P.ipc(self.path)
        self._cmds: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self._stop = threading.Event()
        self._identities: list[bytes] = []
        self._ready = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="peer-sidecar", daemon=True)
        # Commands wake the thread at once (a polling interval would add to every round trip).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # --- control from the test / bench thread -----------------------------------------------

    def start(self) -> "PeerSidecar":
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError(f"peer sidecar did not bind {self.endpoint}")
        return self

    def stop(self, bye: bool = False) -> None:
        if bye:
            self.send_body(P.Bye(reason="sidecar stopping"))
        self._stop.set()
        self._wake()
        self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def send_body(self, body: P.Body) -> str:
        msg = P.Message(body=body)
        self._cmds.put(("frames", (msg.id, P.encode(msg))))
        self._wake()
        return msg.id

    def send_raw(self, frames: list[bytes]) -> None:
        self._cmds.put(("frames", (None, frames)))
        self._wake()

    def send_limits(self, mem_limit_bytes: Optional[int], compute_share: float) -> tuple[int, str]:
        self.seq += 1
        self.mem_limit_bytes, self.compute_share = mem_limit_bytes, compute_share
        mid = self.send_body(P.Limits(seq=self.seq, mem_limit_bytes=mem_limit_bytes, compute_share=compute_share))
        return self.seq, mid

    def of_type(self, mtype: str) -> list[Received]:
        with self._cond:
            return [r for r in self.received if r.msg is not None and r.msg.type == mtype]

    def wait_for(self, pred: Callable[[Received], bool], timeout: float = 5.0) -> Received:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for r in self.received:
                    if pred(r):
                        return r
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [r.msg.type if r.msg else f"error {r.error}" for r in self.received][-10:]
                    raise TimeoutError(f"peer sidecar: expected message not received in {timeout} s; last: {seen}")
                self._cond.wait(left)

    def wait_type(self, mtype: str, timeout: float = 5.0, where: Callable[[Any], bool] = lambda b: True) -> Received:
        return self.wait_for(lambda r: r.msg is not None and r.msg.type == mtype and where(r.msg.body), timeout)

    # --- thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context(1)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock.bind(self.endpoint)
        self._ready.set()
        last_sent = time.monotonic()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                wait_ms = max(0.0, self.heartbeat_s - (time.monotonic() - last_sent)) * 1000.0
                events = dict(poller.poll(wait_ms))
                if self._wake_r in events:
                    drain_wakeups(self._wake_r)
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if self._handle(sock, frames):
                            last_sent = time.monotonic()
                while True:
                    try:
                        kind, arg = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    mid, frames = arg
                    for ident in self._identities:
                        if mid is not None:
                            self.sent_at[mid] = time.perf_counter()
                        sock.send_multipart([ident, *frames])
                    last_sent = time.monotonic()
                if time.monotonic() - last_sent >= self.heartbeat_s:
                    for ident in self._identities:
                        sock.send_multipart([ident, *P.encode(P.Message(body=P.Heartbeat()))])
                    last_sent = time.monotonic()
        finally:
            sock.close(0)
            ctx.term()

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> bool:
        """Records one message; True if it was answered."""
        t = time.perf_counter()
        ident, rest = frames[0], frames[1:]
        try:
            msg = P.decode(rest, accept=P.AGENT_TO_SIDECAR)
        except P.ProtocolError as e:
            with self._cond:
                self.received.append(Received(t, None, e))
                self._cond.notify_all()
            return False
        answered = False
        if isinstance(msg.body, P.Register):
            answered = True
            if ident not in self._identities:
                self._identities.append(ident)
            out = P.reply(msg, P.Registered(
                job_id=self.job_id, job_class=self.job_class, seq=self.seq,
                mem_limit_bytes=self.mem_limit_bytes, compute_share=self.compute_share,
                heartbeat_s=self.heartbeat_s, throttle=self.throttle))
            sock.send_multipart([ident, *P.encode(out)])
        with self._cond:
            self.received.append(Received(t, msg))
            self._cond.notify_all()
        return answered


# --- the benchmark ---------------------------------------------------------------------------------


def _small_job(width: int, depth: int, batch: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    layers: list = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)
    y = torch.randn(batch, 1)

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return iteration


def _timed(fn: Callable[[], None], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _peer_main(path: str, conn: Any) -> None:
    """The bench's sidecar, in its own process as on a real node (no shared GIL with the job)."""
    peer = PeerSidecar(path, heartbeat_s=0.5).start()
    echo: Optional[zmq.Socket] = None
    conn.send("ready")
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "rtt":
                conn.send(_limits_round_trips(peer, cmd[1]))
            elif cmd[0] == "echo":
                if echo is None:
                    echo = zmq.Context.instance().socket(zmq.ROUTER)
                    echo.setsockopt(zmq.LINGER, 0)
                    echo.bind(P.ipc(cmd[1]))
                conn.send("echoing")
                for _ in range(cmd[2]):
                    echo.send_multipart(echo.recv_multipart())
    finally:
        peer.stop()
        if echo is not None:
            echo.close(0)


def _limits_round_trips(peer: PeerSidecar, n: int) -> list[tuple[int, float]]:
    rtts = []
    for i in range(n):
        # Memory limits only: the share stays 1, so the job is never throttled here.
        seq, mid = peer.send_limits((1 << 30) * (1 + i % 2), 1.0)
        try:
            ack = peer.wait_type("ack", timeout=5.0, where=lambda b: b.seq == seq)
        except TimeoutError:
            continue
        rtts.append((seq, (ack.t - peer.sent_at[mid]) * 1e6))
        with peer._cond:
            del peer.received[:]
        time.sleep(_GAP_S)
    return rtts


# Between samples, so each round trip starts from an idle control path, as limits do on a node.
_GAP_S = 0.002


def _loop_time_us(iteration: Callable[[], None], n: int) -> float:
    for _ in range(min(n, 20)):
        iteration()
    return _timed(iteration, n) / n * 1e6


def _step_loop(agent: Any) -> Callable[[], None]:
    """A custom loop's iteration: a little work, then a boundary, as ``torch_patch.step()`` marks it."""
    import torch

    a = torch.randn(32, 32)

    def iteration() -> None:
        torch.mm(a, a)
        agent.step()

    return iteration


def measure_rtt(agent: Any, conn: Any, iteration: Callable[[], None], samples: int) -> dict:
    """limits -> ack round trips (µs), measured by the sidecar, while the job runs ``iteration``."""
    iteration_us = _loop_time_us(iteration, 200)
    first = len(agent.acks)
    conn.send(("rtt", samples))
    while not conn.poll():
        iteration()
    rtts = [us for _, us in conn.recv()]
    worst = 0
    for _seq, received, applied, _waited in agent.acks[first:]:
        if received is not None:
            worst = max(worst, applied - received)
    return {"rtt": rtts, "propagation": worst, "iteration_us": iteration_us}


def measure_floor(conn: Any, path: str, samples: int) -> list[float]:
    """Bare ZeroMQ echo round trips (µs) to the bench sidecar's process, same transport and gap."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        conn.send(("echo", path, samples))
        if conn.recv() != "echoing":
            raise RuntimeError("the bench sidecar did not start its echo")
        sock.connect(P.ipc(path))
        rtts = []
        for _ in range(samples):
            t = time.perf_counter()
            sock.send(b"x")
            sock.recv()
            rtts.append((time.perf_counter() - t) * 1e6)
            time.sleep(_GAP_S)
        return rtts
    finally:
        sock.close(0)


def measure_throttle(agent: Any, shares: tuple[float, ...], iters: int, rounds: int) -> dict[float, float]:
    """Duty cycle per share: unthrottled time / throttled time, interleaved rounds, medians."""
    iteration = _small_job(256, 4, 64)
    for _ in range(5):
        iteration()
    duty: dict[float, list[float]] = collections.defaultdict(list)
    for _ in range(rounds):
        for share in shares:
            agent.throttle.set_share(1.0)
            base = _timed(iteration, iters)
            agent.throttle.set_share(share)
            throttled = _timed(iteration, iters)
            agent.throttle.set_share(1.0)
            duty[share].append(base / throttled)
    return {s: statistics.median(v) for s, v in duty.items()}


def measure_overhead(agent: Any, iters: int, rounds: int,
                     iteration: Optional[Callable[[], None]] = None) -> dict[str, float]:
    """Same loop with the agent's hooks attached vs detached, in A-B-B-A rounds (so neither side
    always runs first); median of the per-round ratios. The same rounds with both sides detached
    (an A/A control) give the ratio this machine reports when nothing differs, and one boundary's
    own cost is timed directly. ``iteration``: the loop (default: a small MLP on the CPU; ``antman
    bench gpu`` passes a zoo model on the GPU)."""
    iteration = iteration or _small_job(256, 4, 64)
    for _ in range(5):
        iteration()
    half = max(1, iters // 2)
    ratios, controls = [], []

    def abba(attach: bool) -> float:
        agent.steps.unhook()
        without = _timed(iteration, half)
        if attach:
            agent.steps.hook_optimizers()
        other = _timed(iteration, half) + _timed(iteration, half)
        agent.steps.unhook()
        return other / (without + _timed(iteration, half))

    for _ in range(rounds):
        ratios.append(abba(True))
        controls.append(abba(False))
    agent.steps.hook_optimizers()
    t = time.perf_counter()
    for _ in range(1000):
        agent.steps._boundary()
    boundary_us = (time.perf_counter() - t) / 1000 * 1e6
    return {"ratio": statistics.median(ratios), "control": statistics.median(controls),
            "boundary_us": boundary_us, "iteration_us": _loop_time_us(iteration, 50)}


@contextlib.contextmanager
def agent_with_peer(path: str, use_cuda: bool) -> Iterator[tuple[Any, Any]]:
    """The bench sidecar (``_peer_main``) in a process of its own, as on a real node (no GIL shared with
    the job), and this process's agent (job 42, opportunistic) registered with it at ``path``: yields
    ``(agent, conn)``, ``conn`` the pipe that commands the sidecar. Both are stopped on the way out."""
    from torch_patch.agent import Agent

    mp = multiprocessing.get_context("spawn")
    conn, child_conn = mp.Pipe()
    proc = mp.Process(target=_peer_main, args=(path, child_conn), daemon=True)
    proc.start()
    agent = None
    try:
        if not conn.poll(60) or conn.recv() != "ready":
            raise RuntimeError("the bench sidecar did not start")
        agent = Agent(job_id="42", job_class="opportunistic", endpoint=P.ipc(path), use_cuda=use_cuda)
        agent.start()
        if not agent.client.registered.wait(30):
            raise RuntimeError("the agent did not register with the bench sidecar")
        yield agent, conn
    finally:
        if agent is not None:
            agent.stop()
        try:
            conn.send(("stop",))
        except OSError:
            pass
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(1)


def run(quick: bool = False) -> dict:
    import torch

    import torch_patch

    torch.set_num_threads(1)
    torch_patch.uninstall()  # the bench drives its own agent, not one the import hook may have started
    with tempfile.TemporaryDirectory(prefix="antman-bench-") as tmp:
        with agent_with_peer(os.path.join(tmp, "jobs", "42", "agent.sock"), use_cuda=False) as (agent, conn):
            # One optimizer step applies the registered limits before measuring.
            _small_job(8, 1, 2)()
            n = 100 if quick else 300
            training = measure_rtt(agent, conn, _small_job(64, 2, 16), n // 2)
            shares = (0.25, 0.5, 0.75)
            duty = measure_throttle(agent, shares, iters=10 if quick else 20, rounds=2 if quick else 3)
            overhead = measure_overhead(agent, iters=100 if quick else 200, rounds=4 if quick else 10)
            # Last: once the job calls step() itself, optimizer steps stop marking boundaries.
            # Interleaved halves, so a noisy stretch of the machine hits both alike.
            rtt = {"rtt": [], "propagation": 0, "iteration_us": []}
            floor: list[float] = []
            for _ in range(2):
                r = measure_rtt(agent, conn, _step_loop(agent), n // 2)
                rtt["rtt"] += r["rtt"]
                rtt["propagation"] = max(rtt["propagation"], r["propagation"])
                rtt["iteration_us"].append(r["iteration_us"])
                floor += measure_floor(conn, os.path.join(tmp, "echo.sock"), n // 2)
    rtts = rtt["rtt"]

    def pct(values: list[float], q: float) -> Optional[float]:
        return round(_pct(values, q), 1) if values else None

    return {
        "rtt_p50_us": pct(rtts, 0.5),
        "rtt_p99_us": pct(rtts, 0.99),
        "rtt_samples": len(rtts),
        "rtt_loop_iteration_us": round(statistics.median(rtt["iteration_us"]), 1),
        "floor_rtt_p50_us": pct(floor, 0.5),
        "floor_rtt_p99_us": pct(floor, 0.99),
        "rtt_training_p50_us": pct(training["rtt"], 0.5),
        "rtt_training_p99_us": pct(training["rtt"], 0.99),
        "rtt_training_iteration_us": round(training["iteration_us"], 1),
        "propagation_iterations": max(rtt["propagation"], training["propagation"]),
        "throttle_error": round(max(abs(duty[s] - s) for s in duty), 4),
        "throttle_duty": {str(s): round(d, 4) for s, d in duty.items()},
        "overhead_ratio": round(overhead["ratio"], 4),
        "overhead_control_ratio": round(overhead["control"], 4),
        "boundary_cost_us": round(overhead["boundary_us"], 1),
        "overhead_loop_iteration_us": round(overhead["iteration_us"], 1),
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="antman bench control", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--quick", action="store_true", help="fewer samples (about 20 s)")
    a = ap.parse_args(argv)
    res = run(quick=a.quick)
    if a.json:
        print(json.dumps(res))
        return 0
    targets = {"rtt_p99_us": "<= 1000", "propagation_iterations": "<= 1", "overhead_ratio": "<= 1.01"}
    for k, v in res.items():
        t = targets.get(k)
        print(f"{k:24} {v}" + (f"   (target {t})" if t else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
