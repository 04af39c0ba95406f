"""Compute throttle: hold a job's busy/(busy+idle) ratio at a commanded share.

AntMan's GpuOpManager delays the job's GPU operations so that its idle time is spread between them,
instead of one long sleep per mini-batch that would leave the GPU to the other job in big, bursty
holes. Here the hook points are the forward of every module (global module hooks) and the backward of
every module output (a pre-hook on its autograd node), so the delay is spread over forward and
backward. Every hook adds the busy time since the last hook to a *debt* of idle time
(busy * (1 - share) / share) and pays it off once it exceeds a quantum; what is still owed at the end
of an iteration is paid at the step boundary, so each iteration hits the share exactly.

The debt is measured busy time, and on a shared node busy time itself grows under throttling (the
caches are cold after each idle period; on a CPU a 3 ms iteration runs ~50% slower right after a
2 ms sleep). So once the job has run unthrottled iterations, their median is the reference: an
iteration at share ``s`` is stretched to ``reference / s`` at the boundary (what was already idled
inside the iteration counts), which is the duty cycle a co-located job actually sees. Without a
reference (a job throttled from its first iteration) the measured-busy debt alone is used.

``mode="iteration"`` pays the whole debt at the step boundary only (one delay per iteration);
``mode="off"`` never delays (the share is only recorded).

At share 1.0 no hook is installed at all, so an unthrottled job pays nothing.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Any, Callable, Optional

# Names as in the protocol's `registered.throttle`: "launch" spreads the delay between operations.
MODES = ("launch", "iteration", "off")

# Sleeps shorter than this overshoot by a large fraction on Linux; debt is carried instead.
DEFAULT_QUANTUM_S = 0.001
# Never sleep longer than this at one hook; the rest is paid at the next hook or the boundary.
_MAX_SLEEP_S = 1.0
# The reference is the median of the latest unthrottled iterations (robust to a slow outlier).
_REF_SAMPLES = 15
_REF_MIN_SAMPLES = 3


class ThrottleError(ValueError):
    pass


def check_share(share: object) -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)):
        raise ThrottleError(f"compute share must be a number in (0, 1], got {share!r}")
    share = float(share)
    if not (0.0 < share <= 1.0):
        raise ThrottleError(f"compute share must be in (0, 1], got {share}")
    return share


class Throttle:
    """Spreads idle time between a job's operations; one instance per process."""

    def __init__(
        self,
        mode: str = "launch",
        quantum_s: float = DEFAULT_QUANTUM_S,
        synchronize: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if mode not in MODES:
            raise ThrottleError(f"throttle mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.quantum_s = quantum_s
        # On CUDA, kernels run asynchronously: the GPU only idles during a sleep if the queue is
        # drained first. The wait for the drain is busy time, which is what the clock then sees.
        self._synchronize = synchronize
        self._clock = clock
        # hurry(): a pause in place is waiting for the boundary, and the job will be idle anyway.
        self._hurry = threading.Event()
        self._sleep = self._hurriable_sleep if sleep is time.sleep else sleep
        self._share = 1.0
        self._ratio = 0.0  # idle seconds owed per busy second
        # A new share from the protocol thread (retune), taken by the training thread's next hook.
        self._retuned: Optional[float] = None
        self._debt = 0.0
        self._carry = 0.0
        self._iter_idle = 0.0
        self._idle_cap = float("inf")
        self._mark = clock()
        self._iter_start = self._mark
        self.reference_s: Optional[float] = None  # median unthrottled iteration time
        self._unthrottled: collections.deque[float] = collections.deque(maxlen=_REF_SAMPLES)
        self._skip_next = True
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        # Slot filling (torch_patch/slots.py): with a gate, every hook first waits for the guaranteed
        # job's idle slot; the share's idle debt still applies on top.
        self.gate: Optional[Any] = None

    @property
    def share(self) -> float:
        return self._share

    def set_share(self, share: float) -> None:
        """Applies at once; callers apply it at an iteration boundary."""
        share = check_share(share)
        with self._lock:
            if share < 1.0 and self._share >= 1.0 and len(self._unthrottled) >= _REF_MIN_SAMPLES:
                self.reference_s = statistics.median(self._unthrottled)
            self._skip_next = True
            self._retuned = None  # this boundary's share is the sidecar's latest word
            self._share = share
            self._ratio = (1.0 - share) / share
            self._debt = 0.0
            self._carry = 0.0
            self._iter_idle = 0.0
            self._idle_cap = float("inf") if self.reference_s is None else self.reference_s * self._ratio
            self._mark = self._clock()
            self._iter_start = self._mark
            if share >= 1.0 or self.mode == "off":
                self._ratio = 0.0
            want = self.gate is not None or (self._ratio > 0.0 and self.mode == "launch")
            if want and not self._handles:
                self._install_hooks()
            elif not want:
                self._remove_hooks()

    def retune(self, share: float) -> None:
        """A new share, from any thread: the training thread's next hook scales the idle still owed
        to it, instead of paying the old share's until the boundary (where ``set_share`` applies it in
        full, and the agent acknowledges it). A job whose iteration is long at a low share (0.9 s of
        work at 0.05 takes 18 s) would otherwise act on the sidecar's word an iteration late, and the
        loop, which changes the share every guaranteed report, would see its cuts act only after the
        raises that followed them. Held at 0.01 while a guaranteed neighbour's baseline was probed,
        such a job would owe 89 s after the probe ended. Only while hooks are installed (a share
        below 1): from 1 the boundary installs them."""
        if isinstance(share, (int, float)) and not isinstance(share, bool) and 0.0 < share <= 1.0:
            self._retuned = float(share)

    def _take_retune(self) -> None:
        share, self._retuned = self._retuned, None
        if share is None or share == self._share or self._ratio == 0.0:
            return
        ratio = (1.0 - share) / share
        scale = ratio / self._ratio
        self._debt *= scale
        if self._idle_cap != float("inf"):
            self._idle_cap *= scale
        self._share, self._ratio = share, ratio
        self._skip_next = True  # a sample spanning two shares is no reference

    @property
    def synchronize(self) -> Optional[Callable[[], None]]:
        """What drains this job's device before the throttle idles (None: nothing to drain)."""
        return self._synchronize

    def set_synchronize(self, synchronize: Optional[Callable[[], None]]) -> None:
        """Drain with ``synchronize`` from now on: an agent made before its device was known (the
        emulated jobs' contending device, which plays CUDA's ``synchronize``)."""
        self._synchronize = synchronize

    def set_gate(self, gate: Optional[Any]) -> None:
        """Launch into the guaranteed job's idle slots (a ``slots.SlotGate``), or stop (None)."""
        with self._lock:
            self.gate = gate
        self.set_share(self._share)

    @property
    def hurry_event(self) -> threading.Event:
        return self._hurry

    def _hurriable_sleep(self, seconds: float) -> None:
        self._hurry.wait(seconds)

    def hurry(self) -> None:
        """Skip the idle owed until the next boundary (a pause waits for it: the GPU is about to be
        given up whole, which protects the neighbour more than an idle slice does)."""
        self._hurry.set()

    def restart_clock(self) -> None:
        """Time from now on (after a pause in place: the time paused was neither busy nor owed)."""
        self._hurry.clear()
        with self._lock:
            self._mark = self._clock()
            self._iter_start = self._mark
            self._debt = 0.0
            self._iter_idle = 0.0

    def forget_reference(self) -> None:
        """Never learn an unthrottled reference (and drop the one learned): for a job whose busy time
        changes with its neighbours' load, where one learned under another load would be wrong."""
        with self._lock:
            self._unthrottled = collections.deque(maxlen=0)
            self.reference_s = None
        self.set_share(self._share)

    # --- accounting -------------------------------------------------------------------------

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ThrottleError(f"throttle mode must be one of {', '.join(MODES)}, got {mode!r}")
        with self._lock:
            self._remove_hooks()
            self.mode = mode
        self.set_share(self._share)

    def tick(self, final: bool = False) -> None:
        """Counts busy time since the last tick; idles when enough is owed (or all, if final)."""
        if self._retuned is not None:
            self._take_retune()
        if self._ratio == 0.0:
            return
        now = self._clock()
        busy = now - self._mark
        if busy > 0:
            self.busy_s += busy
            self._debt += busy * self._ratio
        # With a slot gate the idle owed is paid by the waits for slots and at the boundary, never in
        # the middle of a slot, which the gate found for exactly this work.
        threshold = 0.0 if final else (float("inf") if self.gate is not None else self.quantum_s)
        # With a reference, idle inside an iteration is capped by its budget (see end_iteration).
        cap = self._idle_cap - self._iter_idle
        if self._debt > cap:
            self._debt = max(0.0, cap)
        if self._debt > threshold and self._debt > 0:
            if self._synchronize is not None:
                self._synchronize()
                after_sync = self._clock()
                # The drain was GPU work still running: it is busy time, and it owes idle time too.
                drained = after_sync - now
                self.busy_s += drained
                self._debt += drained * self._ratio
                now = after_sync
            want = min(self._debt, _MAX_SLEEP_S)
            self._sleep(want)
            end = self._clock()
            slept = end - now
            self.idle_s += slept
            self._iter_idle += slept
            # Oversleeping is credited, so the error does not build up over an iteration.
            self._debt -= slept
            now = end
        self._mark = now

    def end_iteration(self) -> None:
        """Iteration boundary: pays what is owed for the iteration, or learns the reference."""
        if self._retuned is not None:
            self._take_retune()
        if self.gate is not None:
            self.gate.boundary()
        if self._ratio == 0.0:
            now = self._clock()
            took = now - self._iter_start
            self._iter_start = now
            if self._share >= 1.0 and took > 0:
                if self._skip_next:
                    self._skip_next = False  # spans start-up or a share change: not a clean sample
                else:
                    self._unthrottled.append(took)
            return
        ref = self.reference_s
        if ref is None:
            self.tick(final=True)
            self._iter_start = self._mark
            self._iter_idle = 0.0
            return
        # Count the busy time up to here, without paying the measured debt ...
        quantum, self.quantum_s = self.quantum_s, float("inf")
        try:
            self.tick()
        finally:
            self.quantum_s = quantum
        # ... and stretch the iteration to reference / share instead.
        target = ref / self._share
        budget = target - ref
        now = self._mark
        owed = target - (now - self._iter_start)
        if owed > 0 and self._synchronize is not None:
            self._synchronize()
            now = self._clock()
            owed = target - (now - self._iter_start)
        if owed > 0:
            self._sleep(min(owed, _MAX_SLEEP_S))
            end = self._clock()
            self.idle_s += end - now
            now = end
        # Integral feedback: an iteration that came out longer than the target (busy time grown by
        # the idling itself) lowers the idle allowed inside the next ones, and vice versa.
        self._carry = min(budget, max(-budget, self._carry + target - (now - self._iter_start)))
        self._idle_cap = max(0.0, budget + self._carry)
        self._debt = 0.0
        self._iter_idle = 0.0
        self._mark = now
        self._iter_start = now

    def duty_cycle(self) -> float:
        total = self.busy_s + self.idle_s
        return self.busy_s / total if total > 0 else 1.0

    # --- hooks ------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        from torch.nn.modules import module as nn_module

        self._handles.append(nn_module.register_module_forward_pre_hook(self._forward_pre))
        self._handles.append(nn_module.register_module_forward_hook(self._forward_post))

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def close(self) -> None:
        with self._lock:
            self._remove_hooks()
            self._ratio = 0.0

    def _forward_pre(self, module: Any, args: Any) -> None:
        if self.gate is not None:
            self.gate.drain()
        self.tick()
        if self.gate is not None:
            self._wait_for_slot()
        return None

    def _wait_for_slot(self) -> None:
        waited = self.gate.before_launch()
        if waited > 0:
            # Waiting for a slot is idle time: it pays the share's debt rather than adding to it.
            self.idle_s += waited
            self._iter_idle += waited
            self._debt = max(0.0, self._debt - waited)
            self._mark = self._clock()

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        self.tick()
        # A pre-hook on the output's autograd node fires when backward reaches this module, so
        # backward gets its share of the idle time without wrapping the module's outputs.
        grad_fn = getattr(output, "grad_fn", None)
        if grad_fn is not None and not module._modules:
            try:
                grad_fn.register_prehook(self._backward_pre)
            except (RuntimeError, AttributeError):
                pass
        return None

    def _backward_pre(self, grad_outputs: Any) -> None:
        if self.gate is not None:
            self.gate.drain()
        self.tick()
        if self.gate is not None:
            self._wait_for_slot()
        return None
