"""How long the GPU worked on each iteration, from CUDA events (the agent's ``busy_ms`` on a GPU).

An unthrottled job's iteration is boundary to boundary on the host clock, and that includes the time
the GPU waits for the next mini-batch (a data-loader stall): the first GPU run (2026-11-26, H200)
found an agent reporting 1.00 busy for a job NVML saw 0.42 busy. The sidecar takes a job's duty cycle
from these reports, so a stalled guaranteed job looked like a full GPU, leaving no room beside it.

Here an event is recorded when the iteration's first forward starts (a pre-hook on the job's root
modules, one call per iteration, not one per layer) and another at the boundary; the GPU time
between them is the iteration's busy time. The GPU runs asynchronously, so the pairs are read when
their end has completed, at a later report, never waited for.
"""

from __future__ import annotations

import collections
import gc
from typing import Any, Optional

# Pairs not yet completed when the window is read stay queued; a bound keeps a stuck stream (or a
# job whose GPU never catches up) from growing the queue without end.
_MAX_PENDING = 64


def root_modules(torch: Any, device: Any, buffers: bool = False) -> list[Any]:
    """The process's top-level modules with parameters (and, with ``buffers``, buffers) on ``device``,
    each once, children with their root. Found through the garbage collector: the agent never sees
    the model being built. Shared with torch_patch/pause.py, which moves buffers too."""
    mods = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    children = {id(c) for m in mods for c in m.children()}
    out = []
    for m in mods:
        if id(m) in children:
            continue
        tensors = list(m.parameters(recurse=True))
        if buffers:
            tensors += list(m.buffers(recurse=True))
        if any(t.device == device for t in tensors):
            out.append(m)
    return out


class GpuBusy:
    """Busy GPU seconds per iteration, from a pair of CUDA events around its work."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.device = device
        self._start: Optional[Any] = None
        self._pending: collections.deque = collections.deque()
        self._spare: list[Any] = []
        self._handles: list[Any] = []
        self.attached = False

    def attach(self) -> int:
        """Hooks the roots found now; returns how many. Called once, at the first boundary, when
        the model exists."""
        roots = root_modules(self.torch, self.device)
        for m in roots:
            self._handles.append(m.register_forward_pre_hook(self._first_forward))
        self.attached = bool(roots)
        return len(roots)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.attached = False

    def _event(self) -> Any:
        return self._spare.pop() if self._spare else self.torch.cuda.Event(enable_timing=True)

    def _first_forward(self, module: Any, args: Any) -> None:
        if self._start is None:
            ev = self._event()
            ev.record()
            self._start = ev

    def boundary(self) -> None:
        """The iteration's end: closes its pair (an iteration with no forward has none)."""
        start, self._start = self._start, None
        if start is None:
            return
        end = self._event()
        end.record()
        self._pending.append((start, end))
        while len(self._pending) > _MAX_PENDING:
            self._spare.extend(self._pending.popleft())

    def collect(self) -> tuple[float, int]:
        """(busy seconds, iterations) of the pairs completed since the last call."""
        busy, n = 0.0, 0
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            busy += start.elapsed_time(end) / 1000.0
            n += 1
            self._spare += (start, end)
        return busy, n
