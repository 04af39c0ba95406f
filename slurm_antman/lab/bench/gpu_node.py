"""The node side of the GPU proof: NVML sampled in the background, and the real sidecar daemon
(``slurm_antman.sidecar.daemon.Sidecar`` with NVML telemetry and the real local policy) serving in a thread of the
part's process, with jobs registered over its control socket the way the Prolog registers them.
"""

from __future__ import annotations

import getpass
import os
import statistics
import tempfile
import threading
from typing import Iterable, Mapping, Optional

from slurm_antman.sidecar.telemetry import GpuSample, NvmlTelemetry, ProcessSample, ReportedLoad


class OneGpu:
    """NVML telemetry of GPU ``index`` only, presented as GPU 0: on a node with several GPUs the proof's
    jobs must share one (CUDA's device 0 under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), as they would on a
    one-GPU node, or the sidecar would place the opportunistic job on an idle one. Every number is
    NVML's; only the other GPUs are left out."""

    kind = "nvml"

    def __init__(self, nvml: NvmlTelemetry, index: int = 0) -> None:
        self._nvml, self._index = nvml, index

    def gpu_count(self) -> int:
        return 1

    def sample(self, reported: Mapping[int, ReportedLoad]) -> tuple[list[GpuSample], list[ProcessSample]]:
        gpus, procs = self._nvml.sample({})
        return ([GpuSample(0, g.memory_used_bytes, g.memory_total_bytes, g.utilization) for g in gpus
                 if g.index == self._index],
                [ProcessSample(0, p.pid, p.memory_bytes, p.sm_utilization) for p in procs if p.gpu == self._index])

    def close(self) -> None:
        self._nvml.close()


class NvmlSampler:
    """GPU 0's utilisation and each process's memory, as NVML reports them, every ``period_s`` while
    a window runs: ``with NvmlSampler() as s: ...`` then ``s.util_mean``, ``s.peak_mem(pid)``."""

    def __init__(self, period_s: float = 0.05) -> None:
        self._period = period_s
        self._nvml = OneGpu(NvmlTelemetry())
        self._stop = threading.Event()
        self.utils: list[float] = []
        self.mem: dict[int, list[int]] = {}
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def __enter__(self) -> "NvmlSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._nvml.close()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            gpus, procs = self._nvml.sample({})
            if gpus:
                self.utils.append(gpus[0].utilization)
            for p in procs:
                if p.memory_bytes is not None:
                    self.mem.setdefault(p.pid, []).append(p.memory_bytes)

    @property
    def util_mean(self) -> Optional[float]:
        return statistics.fmean(self.utils) if self.utils else None

    def peak_mem(self, pid: int) -> Optional[int]:
        return max(self.mem[pid]) if self.mem.get(pid) else None

    def last_mem(self, pid: int) -> Optional[int]:
        return self.mem[pid][-1] if self.mem.get(pid) else None


def nvml_process_memory(pid: int) -> Optional[int]:
    """One NVML reading of the GPU memory ``pid`` holds (its CUDA context included)."""
    tele = OneGpu(NvmlTelemetry())
    try:
        for p in tele.sample({})[1]:
            if p.pid == pid:
                return p.memory_bytes
        return None
    finally:
        tele.close()


class RunningSidecar:
    """The real sidecar daemon, serving in a thread until :meth:`stop`; its socket directory is a short
    temporary path (Unix socket paths are limited to 107 bytes)."""

    def __init__(self, heartbeat_s: float = 0.5, tick_s: float = 0.25, telemetry=None) -> None:
        """``telemetry``: NVML's, of GPU 0 (default); the CPU tests of this machinery pass the sidecar's
        emulated telemetry, which the devcluster uses on nodes without GPUs."""
        from slurm_antman.sidecar.daemon import Sidecar, SidecarOptions

        self.socket_dir = tempfile.mkdtemp(prefix="am-gpu-", dir="/tmp")
        self.sidecar = Sidecar(SidecarOptions(node="gpu-proof", socket_dir=self.socket_dir,
                                              heartbeat_s=heartbeat_s, tick_s=tick_s),
                               telemetry if telemetry is not None else OneGpu(NvmlTelemetry()))
        self.sidecar.start()
        self._thread = threading.Thread(target=self.sidecar.serve_forever, name="sidecar", daemon=True)
        self._thread.start()

    def register(self, job_id: str, job_class: str) -> str:
        """Registers a job as the Prolog does; returns its agents' endpoint. A guaranteed job is bound to
        GPU 0; the sidecar places an opportunistic one itself (there is one GPU to place it on)."""
        from slurm_antman.clients import sidecar_control as client

        reply = client.register_job(self.socket_dir, job_id, os.getuid(), getpass.getuser(), job_class, 1,
                                    physical_gpus=[0] if job_class == "guaranteed" else None)
        return reply.endpoint

    def node_state(self):
        from slurm_antman.clients import sidecar_control as client

        return client.node_state(self.socket_dir)

    def reports(self, job_id: str) -> list:
        """The latest report of each agent of ``job_id`` as the sidecar received it, with the agent's pid
        (read from the daemon's thread's state: a copy, taken at once)."""
        job = self.sidecar.jobs.get(job_id)
        if job is None:
            return []
        return [(a.reg.pid, a.report) for a in list(job.agents.values()) if a.report is not None]

    def stop(self) -> None:
        import shutil

        self.sidecar.stop()
        self._thread.join(10)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def median(values: Iterable[float]) -> Optional[float]:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None
