"""The node sidecar daemon, assembled: its options, its state and its lifecycle (start, reload,
close). What it does lives in one module per idea, each mixed into :class:`Sidecar`:

- loop.py: the ZeroMQ poller loop and the root-only control socket's requests;
- registry.py: the job registry (placement included) and its records in the state directory;
- agent_channel.py: each job's agents, over the job's own socket;
- enforcement.py: telemetry, the local policy on every report and tick, and what enforces it;
- views.py: the node as node_state (control socket) and node_report (coordinator) show it;
- coordinator_channel.py: the uplink to the coordinator;
- slot_pages.py: the idle-slot pages of GPUs shared by a guaranteed job and opportunistic ones.

Single-threaded on purpose: every zmq socket lives in the loop's thread, so no locks are needed;
``stop()`` is the only method another thread may call.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import zmq

from slurm_antman import protocol as p
from slurm_antman.policy.node.core import PolicyState, PreemptRequest
from slurm_antman.ratelimit import RateLimitedLog

from . import driver_caps, peers
from .agent_channel import AgentChannel
from .coordinator_channel import CoordinatorChannel
from .endpoints import SocketDir
from .enforcement import Enforcement
from .loop import SocketLoop, bound_router
from .options import SidecarOptions
from .records import AgentConnection, RegisteredJob
from .registry import JobRegistry
from .slot_pages import SlotDirError, SlotPageChannel, SlotPages
from .telemetry import GpuSample, ProcessSample, Telemetry, UtilizationWindow
from .uplink import Uplink
from .views import ReportViews

__all__ = ["AgentConnection", "RegisteredJob", "Sidecar", "SidecarOptions"]

log = logging.getLogger("antman.sidecar")


class Sidecar(SocketLoop, JobRegistry, AgentChannel, Enforcement, ReportViews, CoordinatorChannel, SlotPageChannel):
    def __init__(self, options: SidecarOptions, telemetry: Telemetry):
        self.opt = options
        self.telemetry = telemetry
        self.dir = SocketDir(options.socket_dir)
        self.slot_pages = SlotPages(self.dir.root)
        self.jobs: dict[str, RegisteredJob] = {}
        self.policy_state = PolicyState()
        # Placement memory from the coordinator's preempt_notice: job -> (GPUs to keep it off, until
        # when). Used when Slurm requeues the job onto this node again; lost on a restart (a
        # preference, never a ban), bounded so a flood of notices cannot grow it without end.
        self.avoid: dict[str, tuple[frozenset[int], float]] = {}
        self.progress: dict[str, float] = {}  # opportunistic job -> progress, as the last decision measured
        self.util = UtilizationWindow(options.utilization_window_s)
        self.gpu_samples: list[GpuSample] = []
        self.proc_samples: list[ProcessSample] = []
        self._ctx = zmq.Context()
        self._control: Optional[zmq.Socket] = None
        self._poller = zmq.Poller()
        self._sock_job: dict[zmq.Socket, RegisteredJob] = {}
        self._stop = threading.Event()
        self._dirty = False
        self._rlog = RateLimitedLog(log)
        self._peer: Optional[peers.Peer] = None  # credentials of the sender of the message in hand
        self._uplink: Optional[Uplink] = None
        self._report_now = False
        self.started = threading.Event()
        self.started_unix = time.time()  # the utilisation window holds nothing from before this
        # Set by whoever serves metrics (the CLI); filled from the loop thread once per tick.
        self.metrics = None
        self.placement_waits = 0  # opportunistic jobs answered "wait" (no GPU met the rules)
        self.state_write_errors = 0
        self.pauses_total = 0
        self.pause_seconds_total = 0.0
        self.pause_bytes_moved_total = 0
        self.pause_ack_ms: list[float] = []  # sidecar's pause sent -> agent's ack, the latest ones
        self.resume_ack_ms: list[float] = []  # resume sent -> agent's resumed (training again)
        # Elastic width (docs/elastic.md): GPUs shed and grown, shed GPUs not given back in time, and how long
        # each shed GPU took to come back (the width sent -> its last process of the job gone), the latest.
        self.width_shrinks_total = 0
        self.width_grows_total = 0
        self.width_unreturned_total = 0
        self.width_return_s: list[float] = []
        self.unhealthy = ""  # why no opportunistic job may start here now (health.node_problem); "" = healthy
        # Driver-level memory caps (MPS v3 memory partitioning), set in start() where the node has them.
        self.caps_support = driver_caps.Support("emulated telemetry: no NVIDIA driver")
        self.caps: Optional[driver_caps.MemoryCaps] = None
        self.cap_errors = 0
        self.gpu_pids_by_job: dict[str, list[int]] = {}
        self._health_checked = 0.0
        # slurm_antman.policy.node.compliance: (job, condition) -> since when; jobs asked to be requeued for it; a count.
        self.compliance_since: dict[tuple[str, str], float] = {}
        self.noncompliant: dict[str, PreemptRequest] = {}
        self.noncompliant_total = 0
        # Job -> GPU memory of each of its processes NVML shows, mapped through Slurm's cgroups once per
        # telemetry sample (not per message: it reads /proc).
        self.gpu_procs_by_job: dict[str, list[int]] = {}
        # SIGHUP: the handler only sets the flag; the loop calls ``reloader`` (which returns the new
        # options, or None to keep the old) so the options change between messages, never mid-message.
        self.reloader: Optional[Callable[[SidecarOptions], Optional[SidecarOptions]]] = None
        self._reload_requested = threading.Event()

    def start(self) -> None:
        self.started_unix = time.time()
        self.dir.prepare()
        try:
            self.slot_pages.clear_stale()
        except SlotDirError as e:
            log.warning("%s", e.strerror)
        self._control = self._ctx.socket(zmq.ROUTER)
        bound_router(self._control)
        self._control.bind(p.ipc(self.dir.control_path))
        self.dir.secure_control()
        self._poller.register(self._control, zmq.POLLIN)
        self._open_uplink()
        self._sample(time.time())
        self._restore_saved()
        if self.telemetry.kind == "nvml":
            nvml = getattr(self.telemetry, "nvml", None)
            self.caps_support = driver_caps.detect(nvml)
            if self.caps_support.available and self.opt.enforce:
                self.caps = driver_caps.MemoryCaps(nvml, self.caps_support)
        log.info("enforcement on %s: %s; %s", self.opt.node,
                 "agent limits and compliance checks" if self.opt.enforce else "none (sidecar.enforce: false)",
                 self.caps_support.describe())
        self._run_policy(time.time())
        self._publish_metrics()
        log.info("sidecar for node %s serving %s (telemetry: %s, %d GPU(s))", self.opt.node,
                 self.dir.control_path, self.telemetry.kind, self.telemetry.gpu_count())
        self.started.set()

    def stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        """Safe from a signal handler or another thread."""
        self._reload_requested.set()

    def _reload(self) -> None:
        self._reload_requested.clear()
        if self.reloader is None:
            return
        new = self.reloader(self.opt)
        if new is None:
            return
        self.opt = new
        if new.utilization_window_s != self.util.window_s:
            self.util.window_s = new.utilization_window_s
        self._dirty = True  # new policy knobs apply to every job right away
        log.info("configuration reloaded; %d job(s) kept: %s", len(self.jobs), ", ".join(sorted(self.jobs)) or "none")

    def _publish_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.publish(self.metrics_view())

    def close(self) -> None:
        """Close sockets but keep the job directories and records: a restarted sidecar rebinds them."""
        for job in self.jobs.values():
            for a in job.agents.values():
                self._send(job.socket, a, p.Bye(reason="sidecar stopping"))
            if job.socket is not None:
                job.socket.close(0)
        if self._uplink is not None:
            self._uplink.close()
        self.slot_pages.close()
        if self._control is not None:
            self._control.close(0)
        self._ctx.term()
        self.dir.release()
        self.telemetry.close()

