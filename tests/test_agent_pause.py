"""Pause in place (after PipeSwitch, OSDI'20), the agent's side, against a sidecar peer over real ZeroMQ
IPC with a real training loop on CPU. GPU memory is emulated here (the agent's trace-replay emulation):
what a pause frees and restores is the emulated footprint; the CUDA move itself is the gpu test
below."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import torch_patch
from slurm_antman import protocol as P
from torch_patch.agent import Agent

HB = 0.1


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 32), torch.randn(64, 1)

    def iteration() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return iteration


@pytest.fixture
def peer(agent_peer):
    return agent_peer


@pytest.fixture(autouse=True)
def _no_global_agent():
    torch_patch.uninstall()
    yield


def test_an_agent_says_it_can_pause_and_an_old_one_is_never_asked(peer):
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    try:
        reg = peer.wait_for(lambda r: r.msg is not None and r.msg.type == "register").msg.body
        assert P.FEATURE_PAUSE in reg.features
    finally:
        agent.stop()
    # A register without the field (an older agent) decodes with no features.
    old = P.message(P.Register(job_id="1", pid=1, rank=0, local_rank=0, world_size=1, hostname="h",
                               agent_version="0.0.9", torch_version="2.0", device="cpu", job_class="none"))
    frames = P.encode(old)
    frames[-1] = frames[-1].replace(b',"features":[]', b"")
    assert b"features" not in frames[-1] and P.decode(frames).body.features == ()


def test_pause_frees_the_footprint_blocks_training_and_resume_continues_where_it_was(peer):
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    agent.emulate_device(3 << 30, 0.9)
    it = _job()
    losses: list[float] = []
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set() and len(losses) < 100_000:
            losses.append(it())

    t = threading.Thread(target=train, daemon=True)
    try:
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "register")
        t.start()
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "report" and r.msg.body.mem_reserved_bytes == 3 << 30)
        sent = time.perf_counter()
        peer.send_body(P.Pause(seq=1, reason="guaranteed job 7 needs GPU 0's memory"))
        paused = peer.wait_for(lambda r: r.msg is not None and r.msg.type == "paused").msg.body
        acked_ms = (time.perf_counter() - sent) * 1000.0
        assert paused.seq == 1 and paused.bytes_freed == 3 << 30 and paused.bytes_moved == 3 << 30
        assert 0.0 <= paused.pause_ms <= acked_ms
        n = len(losses)
        time.sleep(0.5)
        assert len(losses) == n  # blocked at the boundary
        assert agent.memory.stats().reserved_bytes == 0
        # Heartbeats go on while paused: the peer keeps hearing from the agent.
        heard = len(peer.received)
        time.sleep(3 * HB)
        assert len(peer.received) > heard
        peer.send_body(P.Resume(seq=1))
        resumed = peer.wait_for(lambda r: r.msg is not None and r.msg.type == "resumed").msg.body
        assert resumed.seq == 1 and resumed.resume_ms >= 0.0
        deadline = time.monotonic() + 5
        while len(losses) < n + 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(losses) >= n + 20 and losses[-1] < losses[n - 1]  # training went on, and on improving
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "report" and r.msg.body.mem_reserved_bytes == 3 << 30)
        assert [p[0] for p in agent.pauses] == [1]
    finally:
        stop.set()
        agent._resume_evt.set()
        t.join(5)
        agent.stop()


def test_a_paused_job_whose_sidecar_goes_away_resumes_by_itself(peer):
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False,
                  missed_heartbeats=3).start()
    agent.emulate_device(1 << 30, 0.5)
    it = _job()
    stop = threading.Event()
    count = [0]

    def train() -> None:
        while not stop.is_set():
            it()
            count[0] += 1

    t = threading.Thread(target=train, daemon=True)
    try:
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "register")
        t.start()
        peer.send_body(P.Pause(seq=5, reason="test"))
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "paused")
        n = count[0]
        peer.stop()  # no resume will ever come
        deadline = time.monotonic() + 5
        while count[0] <= n + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert count[0] > n + 5 and agent.paused_seq is None
    finally:
        stop.set()
        t.join(5)
        agent.stop()


def test_bench_pause_runs_a_real_sidecar_and_training_process_through_every_round():
    """`antman bench pause --no-requeue`: each round a burst pauses the job and its end resumes it,
    acked by the job's real agent (the numbers themselves go to docs/benchmarks.md, not here)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "bench", "pause", "--no-requeue", "--rounds", "2",
                        "--footprint-gib", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)["pause"]
    assert doc["rounds"] == 2 and len(doc["pause_ack_ms"]) == len(doc["resume_ms"]) == 2
    assert all(v >= 0 for v in doc["pause_ack_ms"] + doc["resume_ms"])
    bad = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "bench", "pause", "--footprint-gib", "20"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--footprint-gib must be in (0, 14]" in bad.stderr


# The pinned arena of the offload (torch_patch.pinned): its layout and bookkeeping run on CPU against
# a stand-in CUDA runtime that records what would have been registered.

class _FakeRuntime:
    """cudaSetDevice / cudaHostRegister / cudaHostUnregister as the arena calls them (plain ints)."""

    def __init__(self, fail_after: int | None = None, err: int = 201):
        import threading as th

        self.local = th.local()
        self.lock = th.Lock()
        self.registered: list[tuple[int, int, int]] = []  # (address, bytes, flags)
        self.unregistered: list[int] = []
        self.fail_after, self.err, self.calls = fail_after, err, 0

    def cudaSetDevice(self, dev: int) -> int:
        self.local.dev = dev
        return 0

    def cudaHostRegister(self, addr: int, n: int, flags: int) -> int:
        assert getattr(self.local, "dev", None) == 3, "a worker registered before binding the job's device"
        with self.lock:
            self.calls += 1
            if self.fail_after is not None and self.calls > self.fail_after:
                return self.err
            self.registered.append((addr, n, flags))
        return 0

    def cudaHostUnregister(self, addr: int) -> int:
        with self.lock:
            self.unregistered.append(addr)
        return 0


def _sources():
    torch.manual_seed(1)
    return [torch.arange(7), torch.zeros(0, 4), torch.rand(3, 3) > 0.5, torch.tensor(2.5),
            torch.randn(20_000).to(torch.bfloat16), torch.randn(300, 500), torch.randn(70_000),
            torch.randint(0, 9, (5, 3), dtype=torch.int8)]


def test_the_arena_layout_aligns_every_slice_and_cuts_whole_pages_into_registrations():
    from torch_patch.pinned import layout

    lay = layout([10, 0, 4096, 5000, 1], align=4096, chunk=8192, page=4096)
    assert lay.offsets == (0, 4096, 4096, 8192, 16384)
    assert lay.total == 20480 and lay.chunks == ((0, 8192), (8192, 16384), (16384, 20480))
    assert [lay.needs(i) for i in range(5)] == [range(0, 1), range(0), range(0, 1), range(1, 2), range(2, 3)]
    # A slice over a chunk boundary needs both chunks; the last chunk ends on a page, past the bytes.
    lay = layout([6000, 6000], align=512, chunk=8192, page=4096)
    assert lay.offsets == (0, 6144) and lay.total == 12288
    assert lay.chunks == ((0, 8192), (8192, 12288)) and lay.needs(1) == range(0, 2)
    assert layout([], chunk=8192, page=4096).chunks == () and layout([0], chunk=8192, page=4096).total == 0
    with pytest.raises(ValueError):
        layout([1], align=3)
    with pytest.raises(ValueError):
        layout([1], chunk=5000, page=4096)


def test_copy_out_copies_each_tensor_into_its_slice_only_once_its_chunks_are_registered(monkeypatch):
    from torch_patch import pinned

    taken = []
    real_slice = pinned.Arena.slice

    def checked_slice(self, i, like):
        # The pipelining's one rule: a copy lands in a slice only after every chunk under it is pinned.
        with self._lock:
            assert set(self.plan.needs(i)) <= set(self.registered)
        taken.append(i)
        return real_slice(self, i, like)

    monkeypatch.setattr(pinned.Arena, "slice", checked_slice)
    src, rt, timings = _sources(), _FakeRuntime(), {}
    chunk = 64 << 10
    hosts, arena = pinned.copy_out(torch, src, rt=rt, device=3, fallback=lambda t: pytest.fail("fell back"),
                                   sync=lambda: None, timings=timings, threads=4, chunk=chunk)
    plan = pinned.layout([t.numel() * t.element_size() for t in src], chunk=chunk)
    assert arena is not None and arena.plan == plan and taken == list(range(len(src)))
    for t, h, off in zip(src, hosts, plan.offsets):
        assert h.dtype == t.dtype and h.shape == t.shape and torch.equal(h, t)
        if t.numel():
            assert h.data_ptr() == arena.base + off
            assert h.untyped_storage().data_ptr() == arena.base  # is_pinned() asks about the storage's start
    assert arena.base % pinned.ARENA_ALIGN == 0 and plan.total % pinned.PAGE == 0
    # Every chunk registered once, page-aligned, exactly covering the arena, with the default flags.
    assert sorted(rt.registered) == [(arena.base + s, e - s, 0) for s, e in plan.chunks]
    assert plan.offsets[-1] + plan.sizes[-1] <= plan.total == sum(n for _, n, _ in rt.registered)
    assert timings["fallback_tensors"] == 0 and timings["chunks"] == len(plan.chunks) > 4 and timings["threads"] == 4
    assert timings["error"] is None and timings["arena_bytes"] == plan.total and timings["pin_s"] >= 0
    registered = sorted(a for a, _, _ in rt.registered)
    kept = hosts[0]
    arena.release()
    assert sorted(rt.unregistered) == registered and arena.buf is None and arena.registered == []
    assert torch.equal(kept, src[0])  # a slice still held keeps its memory, registered or not


def test_copy_out_falls_back_per_tensor_where_registration_fails_and_says_why_once(monkeypatch, caplog):
    from torch_patch import pinned

    monkeypatch.setattr(pinned, "_said", set())
    src, chunk = _sources(), 64 << 10
    plan = pinned.layout([t.numel() * t.element_size() for t in src], chunk=chunk)
    fell: list = []

    def fallback(t):
        fell.append(t)
        return t.clone()

    # One worker, so the chunks are tried in order: the first two register, the third fails.
    rt, timings = _FakeRuntime(fail_after=2), {}
    hosts, arena = pinned.copy_out(torch, src, rt=rt, device=3, fallback=fallback, sync=lambda: None,
                                   timings=timings, threads=1, chunk=chunk)
    in_arena = [i for i in range(len(src)) if all(c < 2 for c in plan.needs(i))]
    assert in_arena == [0, 1, 2, 3, 4]  # those on the first two chunks; the rest went alone
    assert all(torch.equal(h, t) for h, t in zip(hosts, src))
    assert timings["fallback_tensors"] == len(fell) == len(src) - len(in_arena)
    assert all(hosts[i].data_ptr() == arena.base + plan.offsets[i] for i in in_arena if src[i].numel())
    assert rt.calls == 3 and "cudaHostRegister" in timings["error"] and "returned 201" in timings["error"]
    arena.release()
    assert sorted(rt.unregistered) == sorted(a for a, _, _ in rt.registered) and len(rt.unregistered) == 2
    # Nothing registers at all: no arena kept, everything the per-tensor way; the warning came once.
    for _ in range(2):
        hosts, arena = pinned.copy_out(torch, src, rt=_FakeRuntime(fail_after=0), device=3, fallback=fallback,
                                       sync=lambda: None, timings={}, threads=2, chunk=chunk)
        assert arena is None and all(torch.equal(h, t) for h, t in zip(hosts, src))
    timings = {}
    hosts, arena = pinned.copy_out(torch, src, rt=None, device=3, fallback=fallback, sync=lambda: None,
                                   timings=timings, chunk=chunk)
    assert arena is None and "libcudart" in timings["error"] and timings["fallback_tensors"] == len(src)
    assert len([r for r in caplog.records if "pinned one by one" in r.getMessage()]) == 1


def test_copy_out_that_fails_midway_waits_for_its_copies_and_unpins_before_raising():
    from torch_patch import pinned

    rt, synced = _FakeRuntime(fail_after=1), []

    def fallback(t):
        raise RuntimeError("no pinned memory left")

    with pytest.raises(RuntimeError, match="no pinned memory left"):
        pinned.copy_out(torch, _sources(), rt=rt, device=3, fallback=fallback, sync=lambda: synced.append(1),
                        timings={}, threads=1, chunk=64 << 10)
    assert synced == [1] and len(rt.registered) == 1
    assert rt.unregistered == [rt.registered[0][0]]


def _gpu_twin_check(cycles: int, steps_between: int = 2):
    """Pause and resume ``cycles`` times; the losses must be an unpaused twin's. Returns the pauser
    and the timings of each pause."""
    from torch_patch.memory import MemoryController
    from torch_patch.pause import Pauser

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.BatchNorm1d(4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    x = torch.randn(256, 1024, device="cuda")

    def step(m, o):
        o.zero_grad(set_to_none=False)
        loss = m(x).square().mean()
        loss.backward()
        o.step()
        return loss.item()

    m1, o1 = build()
    m2, o2 = build()
    for _ in range(3):
        step(m1, o1), step(m2, o2)
    pauser = Pauser(torch, MemoryController(use_cuda=True))
    pauser.saw_optimizer(o1)
    paused, twin, timings = [], [], []
    for _ in range(cycles):
        before = torch.cuda.memory_allocated()
        freed, moved = pauser.pause()
        assert moved > 0 and torch.cuda.memory_allocated() < before
        assert all(p.device.type == "cpu" and p.is_pinned() for p in m1.parameters())
        assert all(v.is_pinned() for st in o1.state.values() for v in st.values() if v.numel() > 1)
        pauser.resume()
        paused.append(step(m1, o1))
        pauser.after_boundary()
        timings.append(dict(pauser.last_timings))
        paused += [step(m1, o1) for _ in range(steps_between)]
    twin = [step(m2, o2) for _ in range(len(paused))]
    assert paused == twin
    return pauser, timings


@pytest.mark.gpu
def test_pause_moves_parameters_grads_buffers_and_optimizer_state_to_the_host_and_back():
    """On a GPU: the device memory a model, its gradients, a BatchNorm's buffers and Adam's state
    hold is freed by a pause, and training resumes with identical numbers to an unpaused twin, pause
    after pause, with the host copies in one registered arena that is let go after each resume."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pauser, timings = _gpu_twin_check(cycles=2)
    for t in timings:
        assert t["arena"] and t["fallback_tensors"] == 0 and t["error"] is None, t
        assert t["release_s"] >= 0 and t["pin_s"] > 0
    assert pauser._restored is None


@pytest.mark.gpu
def test_pause_falls_back_to_per_tensor_pinned_memory_when_registration_fails(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torch_patch import pinned

    real = pinned.cudart()

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        def cudaHostRegister(self, addr, n, flags):
            return 1  # cudaErrorInvalidValue

    monkeypatch.setattr(pinned, "cudart", lambda: Refusing())
    _, timings = _gpu_twin_check(cycles=1)
    assert not timings[0]["arena"] and timings[0]["fallback_tensors"] == timings[0]["tensors"] > 0
