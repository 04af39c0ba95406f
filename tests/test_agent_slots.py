"""Slot filling in the agent (torch_patch/slots.py, the throttle's gate): the guaranteed side
publishes its phases from real module calls, the opportunistic side launches only into idle slots."""

from __future__ import annotations

import os
import threading
import time

import torch

from slurm_antman.protocol import slot_page as sp
from torch_patch.slots import SlotGate, SlotPublisher
from torch_patch.throttle import Throttle

MS = 10**6


def _page(tmp_path, name="gpu0.slots") -> str:
    path = str(tmp_path / name)
    sp.create(path)
    return path


def test_publisher_marks_the_burst_from_the_first_module_to_the_boundary(tmp_path):
    path = _page(tmp_path)
    pub = SlotPublisher(path)
    reader = sp.SlotReader(path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    try:
        assert reader.read().state == sp.NONE  # nothing launched yet
        for _ in range(3):
            model(torch.ones(2, 4))
            assert reader.read().state == sp.BUSY
            # One hook call per iteration: it removed itself after the first module.
            assert pub._handle is None
            time.sleep(0.002)
            pub.boundary()  # no CUDA: the work is done by the boundary
            s = reader.read()
            assert s.state == sp.IDLE
            time.sleep(0.003)
        s = reader.read()
        assert s.periods == 3 and s.busy_mean_ns >= 2 * MS and s.idle_mean_ns >= 3 * MS
    finally:
        pub.close()
    assert reader.read().state == sp.NONE


class _Event:
    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        self.done.wait(5)


def test_on_cuda_the_page_goes_idle_only_when_the_work_drained_and_nothing_new_was_launched(tmp_path):
    path = _page(tmp_path)
    events: list[_Event] = []

    def record() -> _Event:
        events.append(_Event())
        return events[-1]

    pub = SlotPublisher(path, cuda_event=record)
    reader = sp.SlotReader(path)
    lin = torch.nn.Linear(2, 2)
    try:
        lin(torch.ones(1, 2))
        pub.boundary()  # the training thread goes on; the GPU has not drained yet
        assert reader.read().state == sp.BUSY
        events[0].done.set()
        deadline = time.monotonic() + 5
        while reader.read().state != sp.IDLE and time.monotonic() < deadline:
            time.sleep(0.001)
        assert reader.read().state == sp.IDLE
        # Next iteration: launched before the drain of its predecessor, so never idle in between.
        lin(torch.ones(1, 2))
        pub.boundary()
        lin(torch.ones(1, 2))
        events[1].done.set()
        time.sleep(0.05)
        assert reader.read().state == sp.BUSY
    finally:
        for e in events:
            e.done.set()
        pub.close()


def _history(path: str) -> sp.SlotWriter:
    """A guaranteed job's history on the page: three 20 ms bursts, each followed by 40 ms idle."""
    w = sp.SlotWriter(path)
    for _ in range(3):
        w.busy()
        time.sleep(0.02)
        w.idle()
        time.sleep(0.04)
    return w


def test_gate_waits_for_the_slot_and_counts_the_wait_as_idle(tmp_path):
    path = _page(tmp_path)
    w = _history(path)
    w.busy()  # and busy now
    syncs: list[float] = []
    gate = SlotGate(path, synchronize=lambda: syncs.append(time.monotonic()))
    th = Throttle(mode="launch")
    th.set_gate(gate)
    lin = torch.nn.Linear(2, 2)
    flip = threading.Timer(0.03, w.idle)
    flip.start()
    try:
        t0 = time.monotonic()
        lin(torch.ones(1, 2))  # waits until the guaranteed job goes idle
        took = time.monotonic() - t0
        assert took >= 0.025, took
        assert gate.waited_s >= 0.025 and th.idle_s >= 0.025
        lin(torch.ones(1, 2))  # in the slot: the previous module is drained first, no wait
        assert len(syncs) == 1 and gate.launches == 2 and gate.blind == 0
    finally:
        flip.cancel()
        th.close()
        gate.close()


def test_gate_without_a_publisher_leaves_it_to_the_duty_throttle(tmp_path):
    gate = SlotGate(_page(tmp_path))  # state NONE
    assert gate.before_launch() < 0.01 and gate.blind == 1


def test_hurry_ends_a_wait_for_a_slot_that_never_comes(tmp_path):
    path = _page(tmp_path)
    w = sp.SlotWriter(path)
    w.busy()
    w.idle()
    w.busy()  # busy, with an idle mean of ~0: no slot will ever fit
    hurry = threading.Event()
    gate = SlotGate(path, hurry=hurry)
    threading.Timer(0.05, hurry.set).start()
    t0 = time.monotonic()
    gate.before_launch()
    assert 0.04 <= time.monotonic() - t0 < 2.0


def test_a_page_that_claims_endless_bursts_holds_a_launch_for_at_most_max_wait(tmp_path, monkeypatch):
    import torch_patch.slots as slots

    monkeypatch.setattr(slots, "MAX_WAIT_S", 0.05)
    path = _page(tmp_path)
    with open(path, "r+b") as f:  # a hostile writer: busy since now, bursts of an hour, no idle yet
        import struct

        f.write(struct.pack("<8Q", sp.MAGIC, 0, sp.BUSY, time.monotonic_ns(), 1, sp.MAX_PERIOD_NS, 1, 1))
    gate = SlotGate(path)
    t0 = time.monotonic()
    gate.before_launch()
    assert time.monotonic() - t0 < 1.0 and gate.forced == 1


def test_the_agent_opens_the_page_the_sidecar_names_and_reopens_a_new_file(tmp_path):
    from torch_patch.agent import Agent

    path = _page(tmp_path)
    g = Agent(job_id=None, job_class="guaranteed", use_cuda=False).start()
    o = Agent(job_id=None, job_class="opportunistic", use_cuda=False).start()
    lin = torch.nn.Linear(2, 2)
    try:
        g.set_slot_page(path, "publish")
        o.set_slot_page(path, "fill")
        assert g.slot_publisher is not None and o.throttle.gate is o.slot_gate is not None
        reader = sp.SlotReader(path)
        lin(torch.ones(1, 2))
        assert reader.read().state == sp.BUSY
        g.step()  # the guaranteed job's boundary: its work is done (no CUDA)
        assert reader.read().state == sp.IDLE
        # The same page named again keeps what is open ...
        gate = o.slot_gate
        o.set_slot_page(path, "fill")
        assert o.slot_gate is gate
        # ... a new file at the same path (the sidecar made it afresh) is opened anew ...
        os.unlink(path)
        _page(tmp_path)
        o.set_slot_page(path, "fill")
        assert o.slot_gate is not gate and o.throttle.gate is o.slot_gate
        # ... and no page, or a role it does not know, stops filling.
        o.set_slot_page(path, "steal")
        assert o.slot_gate is None and o.throttle.gate is None
        o.set_slot_page(None, None)
        assert o.throttle._handles == []  # share 1 and no gate: no hooks at all
    finally:
        g.stop()
        o.stop()
    assert reader.read().state == sp.NONE  # the publisher left the page saying nobody publishes


class _Stream:
    """A device stream as CUDA has one, for the gate's event path: work launched returns at once and
    runs in order on a thread of its own; an event completes when everything queued before it has."""

    def __init__(self) -> None:
        self.q: "queue.SimpleQueue" = __import__("queue").SimpleQueue()
        self.busy_until = 0.0
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if isinstance(item, float):
                time.sleep(item)
            else:
                item.t_ms = time.monotonic() * 1e3
                item.done.set()

    def launch(self, seconds: float) -> None:
        self.q.put(float(seconds))

    def event(self) -> "_Event":
        ev = _Event()
        self.q.put(ev)
        return ev

    def close(self) -> None:
        self.q.put(None)
        self.th.join(2)


class _Event:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.t_ms = 0.0

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(5), "an event never completed"

    def elapsed_time(self, end: "_Event") -> float:
        assert self.done.is_set() and end.done.is_set()
        return end.t_ms - self.t_ms


def _idle_page(tmp_path) -> str:
    """A guaranteed job idle for a long while (slots of 10 s): the gate always finds room."""
    path = _page(tmp_path)
    w = sp.SlotWriter(path)
    t = time.monotonic_ns()
    w.busy(t - 20 * 10**9)
    w.idle(t - 10 * 10**9)
    w.busy(t - 10**6)  # idle for 10 s, then a 1 ms burst
    w.idle(t)
    return path


def _launch_modules(gate: SlotGate, dev: _Stream, n: int, work_s: float) -> list[int]:
    in_flight = []
    for _ in range(n):
        gate.before_launch()
        in_flight.append(len(gate._modules))  # this module included
        dev.launch(work_s)
    return in_flight


def test_on_cuda_the_gate_lets_the_host_run_ahead_by_its_budget_and_no_further(tmp_path):
    dev = _Stream()
    gate = SlotGate(_idle_page(tmp_path), event=dev.event, inflight_s=0.0035)
    try:
        t0 = time.monotonic()
        in_flight = _launch_modules(gate, dev, 40, 0.001)
        gate.drain()
        took = time.monotonic() - t0
        assert dev.q.empty() and not gate._modules  # drained: nothing left queued
        # Each module's device time, from its two events (1 ms of sleep, a little more on a busy host).
        assert 0.0009e9 <= gate.work_ns <= 0.005e9, gate.work_ns
        # Ahead of the device, by the budget: 3 modules queued and the one launched, never more.
        assert max(in_flight) == gate.most_in_flight and 2 <= gate.most_in_flight <= 4, in_flight
        assert took >= 0.040  # the device's own time: the gate never skipped work
    finally:
        dev.close()
        gate.close()


def test_on_cuda_a_budget_of_nothing_keeps_one_module_in_flight(tmp_path):
    dev = _Stream()
    gate = SlotGate(_idle_page(tmp_path), event=dev.event, inflight_s=0.0)
    try:
        in_flight = _launch_modules(gate, dev, 10, 0.001)
        assert set(in_flight) == {1} and gate.most_in_flight == 1
        assert gate.launches == 10 and gate.blind == 0
    finally:
        gate.drain()
        dev.close()
        gate.close()


def test_on_cuda_the_work_in_flight_counts_against_the_guaranteed_jobs_slot(tmp_path, monkeypatch):
    """Slots of ~40 ms, of which 0.8 may be filled: a 15 ms module launches at once into a fresh slot,
    but behind 2 x 15 ms of estimated work still queued it does not fit, and the gate waits (the
    budget, 1 s, has room: it is the slot that is full)."""
    import torch_patch.slots as slots

    monkeypatch.setattr(slots, "MAX_WAIT_S", 0.1)
    path = _page(tmp_path)
    w = _history(path)
    dev = _Stream()
    gates = []
    try:
        waits = []
        for queued in (0, 2):
            gate = SlotGate(path, event=dev.event, inflight_s=1.0)
            gates.append(gate)
            gate.work_ns = 0.015e9
            for _ in range(queued):  # as before_launch leaves them: every module but the last closed
                if gate._modules:
                    gate._modules[-1][1] = dev.event()
                gate._modules.append([dev.event(), None])
                dev.launch(0.030)
            w.busy()
            w.idle()  # a slot begins now
            gate.before_launch()
            waits.append(gate.waited_s)
            gate.drain()
        assert waits[0] < 0.01 and waits[1] >= 0.05, waits
    finally:
        dev.close()
        for g in gates:
            g.close()
