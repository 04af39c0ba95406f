"""GPU telemetry sources behind one interface: NVML (real GPUs, via nvidia-ml-py) and an emulation
for nodes without GPUs (the devcluster), whose numbers come from the config and the agents' reports.

The emulation is never chosen silently where NVML works: ``auto`` takes NVML whenever nvmlInit
succeeds and finds at least one GPU, and the sidecar logs and reports which source it uses.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

from slurm_antman.errors import AntmanError

log = logging.getLogger("antman.sidecar.telemetry")

MiB = 1 << 20


class TelemetryError(AntmanError, RuntimeError):
    """No telemetry source can be opened. Still a RuntimeError, as it was before it derived from
    AntmanError, so no caller's ``except RuntimeError`` changes meaning."""


@dataclass(frozen=True)
class GpuSample:
    index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float  # 0..1, SM busy fraction


@dataclass(frozen=True)
class ProcessSample:
    gpu: int
    pid: int
    memory_bytes: Optional[int]       # None where the driver does not tell
    sm_utilization: Optional[float]   # 0..1, None where unsupported


@dataclass(frozen=True)
class ReportedLoad:
    """What the agents on one GPU report, summed: the emulation's only input."""

    memory_bytes: int = 0
    busy_fraction: float = 0.0


class Telemetry(Protocol):
    kind: str  # "nvml" | "emulated"

    def gpu_count(self) -> int: ...

    def sample(self, reported: Mapping[int, ReportedLoad]) -> tuple[list[GpuSample], list[ProcessSample]]: ...

    def close(self) -> None: ...


class EmulatedTelemetry:
    """Emulated GPUs: ``count`` devices of ``memory_bytes`` each. Memory used and utilisation are
    what the agents report, so the policy sees the same numbers it would from NVML on a node whose
    only GPU users are slurm-antman jobs."""

    kind = "emulated"

    def __init__(self, count: int, memory_bytes: int):
        if count < 1 or memory_bytes < 1:
            raise TelemetryError(f"emulated telemetry needs at least one GPU with memory; got {count} x {memory_bytes} B")
        self._count = count
        self._memory = memory_bytes
        log.warning("telemetry: EMULATED %d GPU(s) of %d MiB; memory and utilisation come from agent reports",
                    count, memory_bytes // MiB)

    def gpu_count(self) -> int:
        return self._count

    def sample(self, reported: Mapping[int, ReportedLoad]) -> tuple[list[GpuSample], list[ProcessSample]]:
        gpus = []
        for i in range(self._count):
            r = reported.get(i, ReportedLoad())
            gpus.append(GpuSample(i, min(r.memory_bytes, self._memory), self._memory,
                                  min(1.0, max(0.0, r.busy_fraction))))
        return gpus, []

    def close(self) -> None:
        pass


class NvmlTelemetry:
    kind = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as e:
            raise TelemetryError(f"NVML telemetry needs nvidia-ml-py (import pynvml): {e}") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise TelemetryError(f"nvmlInit failed: {e}") from None
        try:
            n = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        except pynvml.NVMLError as e:
            pynvml.nvmlShutdown()
            raise TelemetryError(f"NVML could not list GPUs: {e}") from None
        if not self._handles:
            pynvml.nvmlShutdown()
            raise TelemetryError("NVML works but finds no GPUs")
        self._last_seen = [0] * n  # per-GPU timestamp for nvmlDeviceGetProcessUtilization
        self._proc_util_supported = [True] * n
        log.info("telemetry: NVML, %d GPU(s), driver %s", n, self._driver())

    def _driver(self) -> str:
        try:
            v = self._nvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        except self._nvml.NVMLError:
            return "unknown"

    def gpu_count(self) -> int:
        return len(self._handles)

    @property
    def nvml(self) -> Any:
        """The initialised pynvml module (driver caps use it too)."""
        return self._nvml

    def sample(self, reported: Mapping[int, ReportedLoad]) -> tuple[list[GpuSample], list[ProcessSample]]:
        nv = self._nvml
        gpus: list[GpuSample] = []
        procs: list[ProcessSample] = []
        for i, h in enumerate(self._handles):
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            except nv.NVMLError as e:
                log.warning("NVML GPU %d: %s", i, e)
                continue
            gpus.append(GpuSample(i, int(mem.used), int(mem.total), min(1.0, max(0.0, util))))
            sm: dict[int, float] = {}
            if self._proc_util_supported[i]:
                try:
                    for s in nv.nvmlDeviceGetProcessUtilization(h, self._last_seen[i]):
                        sm[int(s.pid)] = s.smUtil / 100.0
                        self._last_seen[i] = max(self._last_seen[i], int(s.timeStamp))
                except nv.NVMLError_NotSupported:
                    self._proc_util_supported[i] = False
                except nv.NVMLError:
                    pass  # NOT_FOUND: no samples since last time
            try:
                running = nv.nvmlDeviceGetComputeRunningProcesses(h)
            except nv.NVMLError:
                running = []
            for pr in running:
                used = pr.usedGpuMemory
                procs.append(ProcessSample(i, int(pr.pid), int(used) if used is not None else None,
                                           sm.get(int(pr.pid))))
        return gpus, procs

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def open_telemetry(mode: str, emulated_count: int, emulated_memory_bytes: int) -> Telemetry:
    """``mode`` is auto | nvml | emulated. ``nvml`` fails if NVML does not work; ``auto`` falls back
    to the emulation only when NVML is missing or finds no GPU, and says so."""
    if mode not in ("auto", "nvml", "emulated"):
        raise TelemetryError(f"telemetry {mode!r} is not allowed; allowed: auto, nvml, emulated")
    if mode in ("auto", "nvml"):
        try:
            return NvmlTelemetry()
        except TelemetryError as e:
            if mode == "nvml":
                raise
            log.warning("telemetry auto: NVML unavailable (%s); using the emulation", e)
    return EmulatedTelemetry(emulated_count, emulated_memory_bytes)


class UtilizationWindow:
    """Per-GPU utilisation averaged over the last ``window_s`` seconds of samples (time-weighted
    by sample, which is even when the sidecar samples on a fixed tick)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: dict[int, deque[tuple[float, float]]] = {}

    def add(self, now: float, gpu: int, utilization: float) -> None:
        q = self._samples.setdefault(gpu, deque())
        q.append((now, utilization))
        while q and q[0][0] < now - self.window_s:
            q.popleft()

    def average(self, gpu: int) -> float:
        q = self._samples.get(gpu)
        if not q:
            return 0.0
        return sum(u for _, u in q) / len(q)
