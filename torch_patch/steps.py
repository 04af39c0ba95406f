"""Mini-batch boundaries: where limits are applied, throttle debt is paid and reports are taken.

Two sources: a global optimizer step post-hook (every ``optimizer.step()`` of every optimizer, no change
to the training script), and ``torch_patch.step()`` for custom loops. Once a script calls ``step()``
itself, optimizer steps stop counting, so a loop that does both is not counted twice (and a loop with
several optimizers, e.g. a GAN, can mark its real iteration boundary with ``step()``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

BoundaryCallback = Callable[[int, float], None]


class StepCounter:
    """Counts iterations and calls ``on_boundary(iteration_that_ended, its_seconds)``."""

    def __init__(self, on_boundary: BoundaryCallback, clock: Callable[[], float] = time.perf_counter,
                 on_optimizer: Optional[Callable[[Any], None]] = None) -> None:
        self._on_boundary = on_boundary
        self._on_optimizer = on_optimizer  # every optimizer that steps (pause moves their state)
        self._clock = clock
        self.iteration = 0  # the iteration now running; the first one is 0
        self._started = clock()
        self._explicit = False
        self._hook: Optional[Any] = None
        self._lock = threading.Lock()

    def hook_optimizers(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if self._hook is None:
            self._hook = register_optimizer_step_post_hook(self._optimizer_stepped)

    def unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._on_optimizer is not None:
            self._on_optimizer(optimizer)
        if not self._explicit:
            self._boundary()

    def restart_clock(self) -> None:
        """The running iteration starts now (after a pause: its time is not the job's)."""
        with self._lock:
            self._started = self._clock()

    def step(self) -> None:
        self._explicit = True
        self._boundary()

    def _boundary(self) -> None:
        with self._lock:
            now = self._clock()
            ended, seconds = self.iteration, now - self._started
            self.iteration += 1
            self._started = now
        # Boundary-to-boundary time: the boundary's own work (throttle idle, applying limits) is
        # counted too, so iteration times add up to the job's wall time.
        self._on_boundary(ended, seconds)
