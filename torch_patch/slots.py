"""Idle-slot filling in the job: the guaranteed job's agent publishes its
device phases on the GPU's idle-slot page (``slurm_antman/protocol/slot_page.py``), and an
opportunistic job's agent launches only into the slots the page shows, with a bounded amount of work
in flight (one module without CUDA, ``INFLIGHT_S`` of it on CUDA: the Gate below). AntMan's GpuOpManager (OSDI'20, §4.2) does this inside the framework's executor,
per operator; here the hook points are the throttle's (every module's forward and, through its
output's autograd node, its backward), so the granularity is a module.

**Publisher** (role ``publish``, a guaranteed job): the page says ``busy`` from the first module call
after an iteration boundary, and ``idle`` once that iteration's device work has drained. Without CUDA
(the emulated jobs, whose device is synchronised before their boundary) that is the boundary itself. On
CUDA an event is recorded at the boundary and a thread waits for it (``Event.synchronize`` releases the
GIL), so the training thread never blocks; if the next iteration launched before the drain, the GPU
never went idle and the page stays ``busy``. The hook that notices the first launch removes itself, so
the guaranteed job pays one hook call per iteration.

**Gate** (role ``fill``, an opportunistic job): before each module the agent bounds its work in
flight (it is what runs over into the guaranteed job's next burst, since a device never preempts),
and then waits, polling the page, until ``slot_page.may_launch`` says the work in flight plus the next
module's fits in the guaranteed job's current idle slot. Without CUDA (the emulated device, whose
kernels run as they are called) the bound is one module: the gate waits for what it launched at the
previous hook and times it. On CUDA that wait costs a whole launch latency per module: ResNet-50 on an
H100 filled only 0.27 of the idle time that way (docs/benchmarks.md, GPU proof run 4), the device idle
while Python launched the next module. So on CUDA each module is bracketed by two timing events, the
ones that completed are retired (their elapsed time is the module's device time), and the gate waits
only while ``INFLIGHT_S`` of estimated work is queued: the host runs ahead of the device by that
much. When the page tells nothing (no publisher, stale, torn) it does not wait: the duty throttle and the sidecar's AIMD loop, which stay underneath, are the safety net.
A pause's ``hurry`` ends a wait at once.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Optional

from slurm_antman.protocol import slot_page as sp

log = logging.getLogger("slurm_antman.agent")

ROLES = ("publish", "fill")
POLL_S = 0.0002         # between two reads of the page while waiting for a slot
WORK_EWMA = 0.2         # weight of a new module's measured work in the estimate
MARGIN = 0.8            # of the mean idle period that new work may fill (slot_page.may_launch)
# The longest one launch waits for a slot. The page is the guaranteed job's word, and a page that
# claims long bursts would otherwise hold this job for up to 8 x its claimed mean before it counts as
# stale; after this the module runs anyway, under the duty throttle and the sidecar's loop.
MAX_WAIT_S = 1.0
# Estimated device work an opportunistic job may keep queued under a gate on CUDA (module doc): enough
# for the host to launch ahead of a launch-bound model (about 6 ResNet-50 modules of 75 us: 39.6 ms a
# step over ~530 hooks on an H100, run 4), and, overhanging one guaranteed burst a mini-batch, under
# 1 % of a 76 ms mini-batch. Chosen, not yet measured on a GPU.
INFLIGHT_S = 0.0005


class SlotPublisher:
    """The guaranteed job's side. ``boundary()`` from the training thread at each iteration
    boundary; the first module call after it marks the burst's start by itself."""

    def __init__(self, path: str, cuda_event: Optional[Callable[[], Any]] = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.writer = sp.SlotWriter(path, clock=clock)
        self.path = path
        self._clock = clock
        self._event = cuda_event  # () -> a recorded event with .synchronize(); None: no CUDA
        self._lock = threading.Lock()
        self._launched = False     # a module ran since the last boundary
        self._handle: Any = None
        self._drains: Optional[queue.SimpleQueue] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        if cuda_event is not None:
            self._drains = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._drain_loop, name="antman-slots", daemon=True)
            self._thread.start()
        self._arm()

    def _arm(self) -> None:
        if self._handle is None:
            from torch.nn.modules import module as nn_module

            self._handle = nn_module.register_module_forward_pre_hook(self._first_launch)

    def _first_launch(self, module: Any, args: Any) -> None:
        with self._lock:
            self._launched = True
            if not self._closed:
                self.writer.busy()
            h, self._handle = self._handle, None
        if h is not None:
            h.remove()
        return None

    def boundary(self) -> None:
        with self._lock:
            self._launched = False
            if self._closed:
                return
            if self._drains is None:
                self.writer.idle()
        if self._drains is not None:
            self._drains.put(self._event())
        self._arm()

    def _drain_loop(self) -> None:
        while True:
            ev = self._drains.get()
            if ev is None:
                return
            try:
                ev.synchronize()
            except Exception:  # a broken context: the page goes stale and readers fall back
                log.exception("slurm-antman: idle-slot drain wait failed")
                return
            with self._lock:
                if not self._launched and not self._closed:
                    self.writer.idle(self._clock())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            h, self._handle = self._handle, None
            self.writer.close()
        if h is not None:
            h.remove()
        if self._drains is not None:
            self._drains.put(None)


class SlotGate:
    """The opportunistic job's side: ``before_launch()`` at each hook, from the training thread.
    Returns the seconds it waited for a slot (idle time, as the throttle counts it).

    ``synchronize``: waits for this job's device work (no events: one module in flight). ``event``:
    records a timing event on the job's stream (``.query()``, ``.synchronize()``, ``.elapsed_time()``
    in ms, as ``torch.cuda.Event(enable_timing=True)``); with it the work in flight is tracked and
    bounded by ``inflight_s`` instead."""

    def __init__(self, path: str, synchronize: Optional[Callable[[], None]] = None,
                 hurry: Optional[threading.Event] = None, clock: Callable[[], int] = time.monotonic_ns,
                 poll_s: float = POLL_S, event: Optional[Callable[[], Any]] = None,
                 inflight_s: float = INFLIGHT_S) -> None:
        self.reader = sp.SlotReader(path, clock=clock)
        self.path = path
        self._sync = synchronize
        self._hurry = hurry or threading.Event()
        self._clock = clock
        self._poll_s = poll_s
        self._launch_ns: Optional[int] = None
        self._event = event
        self.inflight_ns = int(inflight_s * 1e9)
        self._modules: collections.deque = collections.deque()  # [start, end or None] per module in flight
        self.work_ns = 0.0          # estimated device work of one module (EWMA of the measured)
        self.waited_s = 0.0
        self.launches = 0
        self.blind = 0              # launches the page said nothing about (the duty throttle decided)
        self.forced = 0             # launches after MAX_WAIT_S without a slot
        self.most_in_flight = 0     # modules in flight at a launch, at most

    def _measured(self, took_ns: float) -> None:
        self.work_ns = took_ns if self.work_ns == 0 else self.work_ns + WORK_EWMA * (took_ns - self.work_ns)

    def _retire(self) -> None:
        """Forget the modules whose end event has completed, timing each (events only)."""
        while self._modules:
            start, end = self._modules[0]
            if end is None or not end.query():
                return
            self._modules.popleft()
            self._measured(start.elapsed_time(end) * 1e6)

    def _in_flight_ns(self) -> float:
        return len(self._modules) * self.work_ns

    def before_launch(self) -> float:
        if self._event is None:
            self.drain()  # one module in flight (a no-op if the throttle drained it already)
        else:
            self._close_module()
            self._retire()
            # Room for one more module's work: wait for the oldest (never for an empty queue, so one
            # module always fits whatever the estimate).
            # Until one module is timed, one at a time.
            while self._modules and (self.work_ns == 0 or self._in_flight_ns() + self.work_ns > self.inflight_ns):
                self._modules[0][1].synchronize()
                self._retire()
        t0 = self._clock()
        give_up = t0 + int(MAX_WAIT_S * 1e9)
        while True:
            now = self._clock()
            if self._event is not None:
                self._retire()
            ok = sp.may_launch(self.reader.read(), now, int(self._in_flight_ns() + self.work_ns), MARGIN)
            if ok is None:
                self.blind += 1
                break
            if ok or self._hurry.wait(self._poll_s):
                break
            if now >= give_up:
                self.forced += 1
                break
        now = self._clock()
        if self._event is None:
            self._launch_ns = now
        else:
            self.most_in_flight = max(self.most_in_flight, len(self._modules) + 1)
            self._modules.append([self._event(), None])
        self.launches += 1
        waited = (now - t0) / 1e9
        self.waited_s += waited
        return waited

    def _close_module(self) -> None:
        """Mark the end of the module launched at the last hook: its work is what was queued since."""
        if self._modules and self._modules[-1][1] is None:
            self._modules[-1][1] = self._event()

    def drain(self) -> None:
        """Wait for the work launched since the last hook(s) and measure it. The throttle calls it before
        it idles for its share, so that idle time is not measured as work; at a boundary, so that the
        host time before the next iteration's first launch (its data loading) is not either."""
        if self._event is not None:
            self._close_module()
            if self._modules:
                self._modules[-1][1].synchronize()
                self._retire()
            return
        if self._launch_ns is not None:
            if self._sync is not None:
                self._sync()
            self._measured(self._clock() - self._launch_ns)
            self._launch_ns = None

    boundary = drain

    def close(self) -> None:
        self.reader.close()


class SlotUse:
    """What an agent does with the page the sidecar names (docs/protocol.md, "The idle-slot page"):
    publish on it, fill from it through the throttle's gate, or neither. ``set`` from the training
    thread at a boundary, with every limits: the same path and role keep what is open, unless the
    file there is a new one (the sidecar made it afresh); no page, or a role it does not know, stops."""

    def __init__(self, throttle: Any, cuda: bool) -> None:
        self.throttle = throttle
        self.cuda = cuda
        self.publisher: Optional[SlotPublisher] = None
        self.gate: Optional[SlotGate] = None
        self._key: Optional[tuple] = None  # (path, role, inode) in use

    def set(self, path: Optional[str], role: Optional[str]) -> None:
        inode = None
        if path is not None:
            try:
                inode = os.stat(path, follow_symlinks=False).st_ino
            except OSError:
                path = None  # gone already: the next limits says what replaced it
        key = None if path is None or role not in ROLES else (path, role, inode)
        if key == self._key:
            return
        self.close()
        if key is None:
            return
        try:
            if role == "publish":
                self.publisher = SlotPublisher(path, cuda_event=_cuda_event if self.cuda else None)
            else:
                self.gate = SlotGate(path, synchronize=self.throttle.synchronize, hurry=self.throttle.hurry_event,
                                     event=_timing_event if self.cuda else None)
                self.throttle.set_gate(self.gate)
            self._key = key
        except (OSError, sp.SlotPageError) as e:
            log.warning("slurm-antman: idle-slot page %s (%s) not used: %s", path, role, e)

    def boundary(self) -> None:
        if self.publisher is not None:
            self.publisher.boundary()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.gate is not None:
            self.throttle.set_gate(None)
            self.gate.close()
            self.gate = None
        self._key = None


def _cuda_event() -> Any:
    import torch

    ev = torch.cuda.Event()
    ev.record()
    return ev


def _timing_event() -> Any:
    import torch

    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
