"""The job's checkpoint hooks (``torch_patch.on_preempt``) and the three moments the agent calls them:

- a **preemption** notice: at the next iteration boundary, or from a timer at half the grace time if no
  boundary comes (a long iteration, a stuck job), so the checkpoint is taken before the requeue;
- a **width change** (docs/elastic.md): at the boundary, before the launcher restarts the workers;
- a **checkpoint request** (the ``checkpoint`` message, docs/protocol.md) while the job trains on: a task
  of the job's elastic array across nodes is about to leave, or has just joined, and either restarts
  every worker from the latest checkpoint. Without one the restart goes back to the job's last periodic
  checkpoint and trains again everything since. The protocol thread stores the request; the training
  thread takes it at the first boundary from ``at_unix`` less ``LEAD_ITERATIONS`` iterations. The lead
  makes the checkpoint as late as it can be while still, by that margin, before the moment asked for:
  what a restart trains again is what came after the checkpoint.

Each rank's agent calls the hooks at its own boundary: a hook that needs every rank at once (a sharded
checkpoint's collective) agrees on the step itself."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, Optional

from .client import CheckpointRequest, PreemptNotice

log = logging.getLogger("torch_patch")

PreemptHook = Callable[[PreemptNotice], None]

# Iterations of lead before ``at_unix``: one so that the boundary after the checkpoint still comes
# before the sibling leaves, one for the jitter of an iteration's length.
LEAD_ITERATIONS = 2.0


class CheckpointHooks:
    def __init__(self) -> None:
        self.hooks: list[PreemptHook] = []
        self._preempt: Optional[PreemptNotice] = None
        self._preempt_done = threading.Event()
        self._preempt_lock = threading.Lock()
        self._req_lock = threading.Lock()
        self._req: Optional[CheckpointRequest] = None
        self._req_seq = 0
        # Checkpoint requests done: (seq, the hooks' milliseconds, their start less at_unix in ms).
        self.done: list[tuple[int, float, float]] = []

    def add(self, fn: PreemptHook) -> None:
        if not callable(fn):
            raise TypeError(f"on_preempt needs a callable taking the notice, got {fn!r}")
        self.hooks.append(fn)

    def call(self, notice: PreemptNotice, what: str, without: str) -> None:
        """Every hook, each on its own: one that fails is logged and the rest still run."""
        if not self.hooks:
            sys.stderr.write(f"slurm-antman: {what}; no checkpoint hook is registered "
                             f"(torch_patch.on_preempt(fn)): {without}.\n")
        for fn in self.hooks:
            try:
                fn(notice)
            except Exception:
                log.exception("slurm-antman: the checkpoint hook %r failed (%s)", fn, what)

    # --- preemption ---------------------------------------------------------------------------

    def preempt_arrived(self, notice: PreemptNotice) -> None:
        """Protocol thread. The first notice counts (a repeated one keeps the first deadline)."""
        with self._preempt_lock:
            if self._preempt is not None:
                return
            self._preempt = notice
        remaining = max(0.0, notice.deadline_unix - time.time())
        timer = threading.Timer(remaining / 2.0, self.run_preempt)
        timer.daemon = True
        timer.start()

    @property
    def preempt_due(self) -> bool:
        return self._preempt is not None and not self._preempt_done.is_set()

    def run_preempt(self) -> None:
        with self._preempt_lock:
            if self._preempt_done.is_set() or self._preempt is None:
                return
            self._preempt_done.set()
            notice = self._preempt
        self.call(notice, f"preemption notice ({notice.reason})",
                  f"the job is requeued at {time.ctime(notice.deadline_unix)}")

    # --- checkpoint requests ------------------------------------------------------------------

    def request_arrived(self, req: CheckpointRequest) -> None:
        """Protocol thread."""
        with self._req_lock:
            if req.seq <= self._req_seq:
                return  # a repeated or stale message: the sidecar's seq only grows
            self._req_seq = req.seq
            # A newer request replaces one not taken yet: one checkpoint, at the newer moment.
            self._req = req

    def request_due(self, now_unix: float, iteration_s: float) -> Optional[CheckpointRequest]:
        """Training thread: the request to run at this boundary, taken off; None if none is due yet."""
        req = self._req
        if req is None or now_unix < req.at_unix - LEAD_ITERATIONS * max(0.0, iteration_s):
            return None
        with self._req_lock:
            if self._req is not req:
                return None
            self._req = None
        return req

    def run_request(self, req: CheckpointRequest) -> tuple[float, float]:
        """The hooks for ``req``; (their milliseconds, their start less ``at_unix`` in milliseconds)."""
        started, t0 = time.time(), time.perf_counter()
        self.call(PreemptNotice(deadline_unix=req.at_unix, grace_s=max(0.0, req.at_unix - started),
                                reason=req.reason, kind="checkpoint"),
                  f"checkpoint asked for ({req.reason})", "a restart goes back to the job's own last checkpoint")
        out = ((time.perf_counter() - t0) * 1000.0, (started - req.at_unix) * 1000.0)
        self.done.append((req.seq, *out))
        return out
