"""The in-job agent: step boundaries + memory control + throttle + protocol client, one per process.

Everything that changes the job (a memory limit, a compute share, the user's preemption hook) happens
in the training thread at an iteration boundary, where the model and optimizer are consistent. At
that boundary the training thread also does the protocol's socket work itself when it can (see
torch_patch/client.py); the protocol thread covers the time between boundaries.

Sidecar lost (nothing heard for ``missed_heartbeats`` x ``heartbeat_s``, or its ``bye``): a guaranteed
job runs unrestricted (no memory limit, share 1.0); an opportunistic job keeps its memory limit and
drops to ``min(share, fallback_share)`` (default 0.25, ``ANTMAN_AGENT_FALLBACK_SHARE``), because
without a sidecar nobody protects the guaranteed job it shares the GPU with. Both keep re-registering
and take the limits of the next ``registered``.

Elastic width (docs/elastic.md): under ``torch_patch.elastic_launch`` the agent of local rank 0 names the
feature ``width``; at a ``width`` it runs the checkpoint hooks at the next boundary, answers
``width_done``, hands the GPU list to the launcher's socket and waits there to be stopped.

Emulation (:meth:`Agent.emulate_device`): for trace replays on CPU-only machines, where a job stands
in for a GPU job (slurm_antman/lab/evaluation/emulated_job.py) and the sidecar's emulated telemetry takes
the GPU's memory and utilisation from the agents' reports.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

from slurm_antman import __version__
from .client import LimitsUpdate, PreemptNotice, ProtocolClient, WidthRequest, check_endpoint, default_register
from .busy import GpuBusy
from .checkpoint import CheckpointHooks, PreemptHook
from .memory import MemoryController
from .pause import Pauser
from .slots import SlotGate, SlotPublisher, SlotUse
from .steps import StepCounter
from .throttle import Throttle, check_share
from .width import hand_over
from slurm_antman import protocol as P
from slurm_antman.protocol import JOB_ID_RE, slot_page

log = logging.getLogger("torch_patch")

DEFAULT_FALLBACK_SHARE = 0.25
# The most of a job's time its reports may take (see _boundary): the report interval grows to keep it.
REPORT_BUDGET = 0.002
# ... up to this gap: the sidecar's policy ticks once a second (sidecar/options.py tick_s).
REPORT_MAX_GAP_S = 0.5
# After handing a new GPU list to the elastic launcher, the training thread waits this long to be
# stopped (the launcher's SIGTERM); if it is still alive then, the launcher did not act and the job
# trains on at the old width.
WIDTH_WAIT_S = 60.0


class AgentConfigError(ValueError):
    pass


def _env_float(name: str, default: float, lo: float, hi: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise AgentConfigError(f"{name}={raw!r}: expected a number in [{lo}, {hi}]") from None
    if not (lo <= v <= hi):
        raise AgentConfigError(f"{name}={raw!r}: expected a number in [{lo}, {hi}]")
    return v


class Agent:
    def __init__(
        self,
        job_id: Optional[str] = None,
        job_class: str = "none",
        endpoint: Optional[str] = None,
        throttle_mode: str = "launch",
        fallback_share: float = DEFAULT_FALLBACK_SHARE,
        missed_heartbeats: int = 5,
        report_interval_s: float = 0.05,
        use_cuda: Optional[bool] = None,
        launcher_socket: Optional[str] = None,
        width_wait_s: float = WIDTH_WAIT_S,
    ) -> None:
        import torch

        if job_class not in ("guaranteed", "opportunistic", "none"):
            raise AgentConfigError(
                f"ANTMAN_CLASS={job_class!r}: allowed: guaranteed, opportunistic (or unset)")
        if endpoint is not None:
            check_endpoint(endpoint)
        if job_id is not None and not JOB_ID_RE.match(job_id):
            raise AgentConfigError(f"ANTMAN_JOB_ID={job_id!r}: a Slurm job id is 1 to 10 digits")
        self.job_id = job_id
        self.job_class = job_class
        self.fallback_share = check_share(fallback_share)
        self.report_interval_s = report_interval_s
        self.cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.memory = MemoryController(use_cuda=self.cuda, spill=(self.cuda and job_class == "opportunistic"))
        sync = torch.cuda.synchronize if self.cuda else None
        self.throttle = Throttle(mode=throttle_mode, synchronize=sync)
        self.pauser = Pauser(torch, self.memory)
        # On a GPU, busy time comes from CUDA events (torch_patch/busy.py), hooked at the first boundary.
        self._gpu_busy = GpuBusy(torch, torch.device("cuda", self.memory.device)) if self.cuda else None
        self._gpu_busy_tried = False
        self.steps = StepCounter(self._boundary, on_optimizer=self.pauser.saw_optimizer)
        self.applied_seq = 0
        # (seq, iteration during which it arrived, applied_iteration, seconds it waited in the
        # agent for the boundary): for tests and the bench
        self.acks: list[tuple[int, Optional[int], int, Optional[float]]] = []
        self._pending: Optional[LimitsUpdate] = None
        self._fallback_due = False
        self._lock = threading.Lock()
        self.hooks = CheckpointHooks()  # on_preempt's: at a preemption, a width change, a checkpoint request
        # Pause in place (torch_patch.pause): requested by the protocol thread, done by the training
        # thread at its next boundary, which then blocks until resume.
        self._pause_req: Optional[tuple[int, str, float]] = None
        self._resume_t: Optional[float] = None
        self._resume_evt = threading.Event()
        self.paused_seq: Optional[int] = None
        self.pauses: list[tuple[int, int, int, float, float]] = []  # (seq, freed, moved, pause_ms, resume_ms)
        # Elastic width (docs/elastic.md): the protocol thread stores the request, the training thread
        # checkpoints at its next boundary, answers width_done and hands the list to the launcher.
        self.launcher_socket: Optional[str] = None
        self.width_wait_s = width_wait_s
        self._width_req: Optional[WidthRequest] = None
        self._width_seq = 0  # the highest width seq taken; a lower or equal one is stale
        self.widths: list[tuple[int, tuple[int, ...], float]] = []  # (seq, gpus, checkpoint_ms) handed over
        # Report accumulation (training thread only).
        self._acc_n = 0
        self._acc_ms = 0.0
        self._acc_busy_ms = 0.0
        self._busy_mark = 0.0
        self._busy_scale = 1.0  # emulate_device(): the emulated GPU is busy sm_util of the busy time
        self._last_report = time.monotonic()
        self._report_gap = report_interval_s
        self._report_cost: Optional[float] = None
        self._peak = 0
        # Idle-slot filling (torch_patch/slots.py): publish or fill, per the sidecar's role.
        self.slots = SlotUse(self.throttle, self.cuda)
        self.client: Optional[ProtocolClient] = None
        if endpoint is not None and job_id is not None:
            reg = default_register(job_id, job_class, "cuda" if self.cuda else "cpu", __version__, torch.__version__)
            if launcher_socket is None:
                launcher_socket = os.environ.get(P.ENV_LAUNCHER_SOCKET) or None
            # Only local rank 0 speaks for the job to its launcher (one launcher per node).
            if launcher_socket is not None and reg.local_rank == 0:
                self.launcher_socket = launcher_socket
            self.client = ProtocolClient(
                endpoint, reg,
                on_limits=self._limits_arrived,
                on_lost=self._sidecar_lost,
                on_preempt=self.hooks.preempt_arrived,
                on_unmanaged=self._unmanaged,
                missed_heartbeats=missed_heartbeats,
                on_pause=self._pause_arrived,
                on_resume=self._resume_arrived,
                on_width=self._width_arrived if self.launcher_socket is not None else None,
                slots=slot_page.check_platform() is None,
                on_checkpoint=self.hooks.request_arrived,
            )
        self.started = False

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> "Agent":
        if not self.started:
            self.started = True
            self.steps.hook_optimizers()
            if self.client is not None:
                self.client.start()
        return self

    def stop(self, reason: str = "exit") -> None:
        self.slots.close()
        self.steps.unhook()
        if self._gpu_busy is not None:
            self._gpu_busy.detach()
        self.throttle.close()
        if self.client is not None:
            self.client.stop(reason)

    @property
    def iteration(self) -> int:
        return self.steps.iteration

    def step(self) -> None:
        self.steps.step()

    def on_preempt(self, fn: PreemptHook) -> None:
        self.hooks.add(fn)

    def emulate_device(self, mem_bytes: int, sm_util: float) -> None:
        """Make this CPU agent report an emulated GPU job (trace replays): ``mem_bytes`` of device
        memory (less what a lower memory limit spills to the host) and a GPU busy ``sm_util`` of the
        job's own compute time, so the sidecar's emulated utilisation is ``sm_util`` x duty cycle.

        The throttle's reference (the median unthrottled iteration, which corrects for busy time
        inflated by the idling itself on a real device) is turned off: an emulated job's busy time is
        a sleep that idling does not inflate, but it does change with the neighbours' load, and a
        reference learned under one load would hold the job to the wrong duty cycle under another.
        Call it before the first iteration, from the training thread."""
        if self.cuda:
            raise ValueError("emulation is for CPU-only trace replays; this agent drives a CUDA device")
        if isinstance(sm_util, bool) or not isinstance(sm_util, (int, float)) or not 0.0 < sm_util <= 1.0:
            raise ValueError(f"sm_util must be a number in (0, 1], got {sm_util!r}")
        self.memory.emulate(mem_bytes)  # validates mem_bytes
        self._busy_scale = float(sm_util)
        self.throttle.forget_reference()

    # --- protocol thread -> training thread -----------------------------------------------------

    def _limits_arrived(self, upd: LimitsUpdate) -> None:
        with self._lock:
            if upd.received_iteration is None:
                # Read under the lock the boundary takes the update with, so this is the iteration
                # whose boundary will see it.
                upd = dataclasses.replace(upd, received_iteration=self.steps.iteration)
            prev = self._pending
            if prev is not None and prev.reset and not upd.reset:
                # A restarted sidecar's registered must still reset our seq, even if its first
                # limits overtake it before the next boundary.
                upd = dataclasses.replace(upd, reset=True, throttle=prev.throttle)
            if upd.reset:
                self._fallback_due = False
            self._pending = upd
        # The idle owed follows the new share from the next hook on (Throttle.retune); the limits
        # apply in full, and are acknowledged, at the boundary.
        self.throttle.retune(upd.compute_share)

    def _sidecar_lost(self) -> None:
        with self._lock:
            self._pending = None
            self._fallback_due = True
            # A pause nobody will end: resume (a restarted sidecar pauses the job again if it must).
            self._pause_req = None
            self._resume_t = time.perf_counter()
        self._resume_evt.set()

    def _pause_arrived(self, seq: int, reason: str, t: float) -> None:
        with self._lock:
            if self.paused_seq is not None:
                return  # already paused: the sidecar's state is the one it sent first
            self._pause_req = (seq, reason, t)
            self._resume_evt.clear()
        self.throttle.hurry()

    def _resume_arrived(self, seq: int, t: float) -> None:
        with self._lock:
            self._resume_t = t
        self._resume_evt.set()

    def _pause_here(self) -> None:
        """Training thread, at a boundary: offload, ack, wait for resume, restore, ack."""
        with self._lock:
            req, self._pause_req = self._pause_req, None
            if req is None or self._resume_evt.is_set():
                self.throttle.restart_clock()
                return  # resumed before the boundary came: nothing to do
            self.paused_seq = req[0]
        seq, reason, arrived = req
        freed, moved = self.pauser.pause()
        pause_ms = (time.perf_counter() - arrived) * 1000.0
        client = self.client
        if client is not None:
            client.send(P.Paused(seq=seq, bytes_freed=freed, bytes_moved=moved, pause_ms=pause_ms))
        log.warning("slurm-antman: paused in place (%s): %d MiB moved to host memory", reason, moved >> 20)
        # Wait in short slices: the main thread must still run signal handlers (SIGTERM's checkpoint).
        while not self._resume_evt.wait(0.2):
            pass
        with self._lock:
            resumed_at = self._resume_t or time.perf_counter()
            self._resume_t = None
            self.paused_seq = None
        self.pauser.resume()
        resume_ms = (time.perf_counter() - resumed_at) * 1000.0
        if client is not None:
            client.send(P.Resumed(seq=seq, resume_ms=resume_ms))
        self.pauses.append((seq, freed, moved, pause_ms, resume_ms))
        self.steps.restart_clock()
        self.throttle.restart_clock()

    def _width_arrived(self, req: WidthRequest) -> None:
        with self._lock:
            if req.seq <= self._width_seq:
                log.warning("slurm-antman: ignoring width seq %d (already at seq %d)", req.seq, self._width_seq)
                return
            self._width_seq = req.seq
            # A newer width replaces one the boundary has not taken yet: only the newer is answered.
            self._width_req = req
        self.throttle.hurry()

    def _width_here(self, ended: int) -> None:
        """Training thread, at a boundary: checkpoint (the on_preempt hooks), answer width_done, hand
        the list to the launcher, then wait to be stopped."""
        with self._lock:
            req, self._width_req = self._width_req, None
        if req is None:
            return
        gpus = list(req.gpus)
        notice = PreemptNotice(deadline_unix=time.time(), grace_s=0.0,
                               reason=f"width change: {req.reason}", width=tuple(gpus), kind="width")
        self.hooks.call(notice, f"width change to GPUs {gpus} ({req.reason})", "the workers restart from the last "
                         "checkpoint the job saved by itself")
        checkpoint_ms = (time.perf_counter() - req.received_t) * 1000.0
        if not hand_over(self.client, req, self.launcher_socket, checkpoint_ms, ended + 1):  # type: ignore[arg-type]
            return
        self.widths.append((req.seq, tuple(gpus), checkpoint_ms))
        sys.stderr.write(f"slurm-antman: width change seq {req.seq} to GPUs {gpus} ({req.reason}): checkpoint "
                         f"in {checkpoint_ms:.0f} ms, the launcher restarts the workers\n")
        # Wait for the launcher's SIGTERM here, at a consistent point, rather than train on past the
        # checkpoint (work that would be redone). Short slices: the main thread runs signal handlers.
        deadline = time.monotonic() + self.width_wait_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
        log.error("slurm-antman: the launcher did not restart the job within %.0f s of width seq %d; "
                  "training goes on", self.width_wait_s, req.seq)
        self.steps.restart_clock()
        self.throttle.restart_clock()

    def _unmanaged(self, why: str) -> None:
        with self._lock:
            self._pending = LimitsUpdate(self.applied_seq, None, 1.0, None, reset=True)
            self._fallback_due = False

    def _checkpoint_here(self, iteration_s: float) -> None:
        """Training thread, at a boundary: a checkpoint asked for, if due (torch_patch.checkpoint); training goes on."""
        req = self.hooks.request_due(time.time(), iteration_s)
        if req is not None:
            ms, late_ms = self.hooks.run_request(req)
            if self.client is not None:
                self.client.send(P.CheckpointDone(seq=req.seq, checkpoint_ms=ms, late_ms=late_ms), ref=req.ref)

    # --- the boundary (training thread) ---------------------------------------------------------

    def set_slot_page(self, path: Optional[str], role: Optional[str]) -> None:
        """Publish on, or fill from, the idle-slot page at ``path`` (slots.SlotUse.set)."""
        self.slots.set(path, role)

    @property
    def slot_publisher(self) -> Optional[SlotPublisher]:
        return self.slots.publisher

    @property
    def slot_gate(self) -> Optional[SlotGate]:
        return self.slots.gate

    def _boundary(self, ended: int, seconds: float) -> None:
        self.slots.boundary()
        throttle = self.throttle
        if throttle._ratio:
            throttle.end_iteration()
            busy_total = throttle.busy_s
            busy = busy_total - self._busy_mark
            self._busy_mark = busy_total
        else:
            throttle.end_iteration()  # learns the unthrottled reference
            busy = seconds
            self._busy_mark = throttle.busy_s
        gpu_busy = self._gpu_busy
        if gpu_busy is not None:
            if not self._gpu_busy_tried:
                self._gpu_busy_tried = True  # once: the model exists by the first optimizer step
                gpu_busy.attach()
            gpu_busy.boundary()
        client = self.client
        if client is not None:
            client.exchange(ended, next_within_s=2.0 * seconds)
        # Under _limits_arrived's lock: an update taken over during iteration k is seen by the
        # boundary that ends k, never a later one.
        with self._lock:
            due = self._pending is not None or self._fallback_due
        if due:
            self._apply_pending(ended + 1)
            if client is not None:
                # The ack, before a preemption hook may take long. What arrives from here on is
                # taken by the next boundary: it counts as arriving in iteration ended+1, which
                # began with this boundary (StepCounter counts boundary time to the next one).
                client.flush_queued(ended + 1)
        if self.hooks.preempt_due:
            self.hooks.run_preempt()
        self._checkpoint_here(seconds)
        if self._width_req is not None:
            self._width_here(ended)
        self.pauser.after_boundary()
        if self._pause_req is not None:
            self._pause_here()
        if client is None:
            return
        self._acc_n += 1
        self._acc_ms += seconds * 1000.0
        self._acc_busy_ms += busy * 1000.0
        now = time.monotonic()
        if now - self._last_report >= self._report_gap:
            self._send_report(ended, now)
            client.flush_queued(ended + 1)
            # A report's own cost (reading the allocator, encoding, sending) stays within
            # REPORT_BUDGET of the job's time: on a GPU it is far dearer than on a CPU.
            # Smoothed, so one report delayed by the OS scheduler does not stretch the gap by itself.
            cost = time.monotonic() - now
            self._report_cost = cost if self._report_cost is None else 0.8 * self._report_cost + 0.2 * cost
            self._report_gap = min(REPORT_MAX_GAP_S, max(self.report_interval_s, self._report_cost / REPORT_BUDGET))

    def _send_report(self, iteration: int, now: float) -> None:
        from slurm_antman.protocol import Report

        self.memory.maintain()
        st = self.memory.stats()
        n = self._acc_n
        iteration_ms = self._acc_ms / n
        busy_ms = self._acc_busy_ms / n * self._busy_scale
        if self._gpu_busy is not None and self._gpu_busy.attached:
            gpu_s, gpu_n = self._gpu_busy.collect()
            if gpu_n and not self.throttle._ratio:
                # Unthrottled, the host clock counts a data-loader stall as busy; the events do not.
                # (Throttled, the throttle's own account, drained by synchronize, is the busy time.)
                busy_ms = min(iteration_ms, gpu_s / gpu_n * 1000.0)
        self.client.send(Report(
            iteration=iteration,
            iterations=n,
            iteration_ms=iteration_ms,
            busy_ms=busy_ms,
            mem_allocated_bytes=st.allocated_bytes,
            mem_reserved_bytes=st.reserved_bytes,
            mem_peak_bytes=st.peak_bytes,
            spilled_bytes=st.spilled_bytes,
            limits_seq=self.applied_seq,
        ), wake=False)
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.memory.device)
        self._acc_n = 0
        self._acc_ms = 0.0
        self._acc_busy_ms = 0.0
        self._last_report = now

    def _apply_pending(self, next_iteration: int) -> None:
        with self._lock:
            upd, self._pending = self._pending, None
            fallback, self._fallback_due = self._fallback_due, False
        if upd is not None and (upd.reset or upd.seq > self.applied_seq):
            try:
                self.memory.set_limit(upd.mem_limit_bytes)
                if upd.throttle is not None and upd.throttle != self.throttle.mode:
                    self.throttle.set_mode(upd.throttle)
                self.throttle.set_share(upd.compute_share)
            except Exception:
                log.exception("slurm-antman: could not apply limits seq %d", upd.seq)
            self.set_slot_page(upd.slot_page, upd.slot_role)
            self.pauser.set_pin_allowance(upd.pin_bytes)
            self.applied_seq = upd.seq
            self._busy_mark = self.throttle.busy_s
            if upd.ref is not None and self.client is not None:
                from slurm_antman.protocol import Ack

                waited = None if upd.received_t is None else time.perf_counter() - upd.received_t
                self.acks.append((upd.seq, upd.received_iteration, next_iteration, waited))
                self.client.send(Ack(seq=upd.seq, applied_iteration=next_iteration), ref=upd.ref, wake=False)
        if fallback:
            job_class = (self.client.job_class if self.client is not None else None) or self.job_class
            try:
                if job_class == "opportunistic":
                    self.throttle.set_share(min(self.throttle.share, self.fallback_share))
                else:
                    self.memory.set_limit(None)
                    self.throttle.set_share(1.0)
            except Exception:
                log.exception("slurm-antman: could not apply the fallback limits")
            self._busy_mark = self.throttle.busy_s


# --- the process's one agent -------------------------------------------------------------------

_agent: Optional[Agent] = None
_agent_lock = threading.Lock()
# Set while install() builds the agent on this thread: building it imports torch, which fires the
# import hook (activation.py), whose start_from_env() must not wait for the lock install() holds.
_installing = threading.local()


def current() -> Optional[Agent]:
    return _agent


_SWITCH_INTERVAL_S = 0.001


def install(
    job_id: Optional[str] = None,
    job_class: Optional[str] = None,
    endpoint: Optional[str] = None,
    **kwargs: object,
) -> Agent:
    """Starts this process's agent (once; later calls return the same agent).

    Arguments default to the job's environment: ``ANTMAN_JOB_ID`` (or ``SLURM_JOB_ID``),
    ``ANTMAN_CLASS``, ``ANTMAN_SIDECAR_ENDPOINT``. Without an endpoint the agent still counts
    iterations and can be throttled locally, but talks to nobody.
    """
    global _agent
    with _agent_lock:
        if _agent is not None:
            return _agent
        env = os.environ
        job_id = job_id or env.get(P.ENV_JOB_ID) or env.get("SLURM_JOB_ID")
        job_class = job_class or env.get(P.ENV_CLASS) or "none"
        endpoint = endpoint or env.get(P.ENDPOINT_ENV) or None
        if "fallback_share" not in kwargs:
            kwargs["fallback_share"] = _env_float("ANTMAN_AGENT_FALLBACK_SHARE", DEFAULT_FALLBACK_SHARE, 0.01, 1.0)
        if endpoint is None and job_id is not None:
            sys.stderr.write(f"slurm-antman: {P.ENDPOINT_ENV} is not set; the agent runs without a sidecar\n")
        _installing.active = True
        try:
            agent = Agent(job_id=job_id, job_class=job_class, endpoint=endpoint, **kwargs)  # type: ignore[arg-type]
        finally:
            _installing.active = False
        if endpoint is not None and sys.getswitchinterval() > _SWITCH_INTERVAL_S:
            # The protocol thread sleeps in poll() and needs the GIL only to handle a message; with
            # CPython's default 5 ms switch interval a message could wait that long behind the
            # training thread. 1 ms bounds it at little cost, since the thread is idle otherwise.
            sys.setswitchinterval(_SWITCH_INTERVAL_S)
        agent.start()
        _agent = agent
        atexit.register(_shutdown)
        return agent


def uninstall() -> None:
    """Stops the agent and removes its hooks (tests; a script that wants to go unmanaged)."""
    global _agent
    with _agent_lock:
        agent, _agent = _agent, None
    if agent is not None:
        agent.stop()


def _shutdown() -> None:
    try:
        uninstall()
    except Exception:
        pass


def _forget_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) has no protocol thread and is not a rank: it must
    # neither throttle nor count steps as the parent's agent.
    global _agent
    agent, _agent = _agent, None
    if agent is not None:
        try:
            agent.steps.unhook()
            agent.throttle.close()
        except Exception:
            pass


os.register_at_fork(after_in_child=_forget_in_child)


def start_from_env() -> Optional[Agent]:
    """Called by the import hook once torch is imported. None when install() on this thread is
    what imported torch: it is building the agent with its own arguments."""
    if getattr(_installing, "active", False):
        return None
    return install()
