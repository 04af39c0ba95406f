"""Per-process memory limit that may go down and up while the job runs.

On CUDA the limit is PyTorch's per-process memory fraction of the device. Lowering the fraction frees
nothing by itself: cached blocks stay reserved, so a shrink is followed by ``empty_cache()``, which
hands the cached, unused blocks back to the driver where the other job can take them.

On CPU there is nothing to enforce, but the limit is tracked and acknowledged like on CUDA, so the
whole control path (sidecar -> agent -> ack at the next iteration) runs and is tested without a GPU.

Emulation (trace replays on CPU, slurm_antman/lab/evaluation/emulated_job.py): :meth:`MemoryController.emulate`
makes :meth:`~MemoryController.stats` report a job's GPU footprint instead of the process RSS. Under a
limit below the footprint, what does not fit counts as spilled to host memory, as it would under a
real limit with host spill; the sidecar's emulated telemetry then sees the memory the job would hold.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("torch_patch.memory")


class MemoryLimitError(ValueError):
    pass


@dataclass
class MemoryStats:
    allocated_bytes: int
    reserved_bytes: int
    peak_bytes: int
    spilled_bytes: int
    limit_bytes: Optional[int]
    total_bytes: Optional[int]

    def as_dict(self) -> dict:
        return {
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "peak_bytes": self.peak_bytes,
            "spilled_bytes": self.spilled_bytes,
            "limit_bytes": self.limit_bytes,
            "total_bytes": self.total_bytes,
        }


def check_limit(limit: object) -> Optional[int]:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise MemoryLimitError(f"memory limit must be a positive number of bytes or null, got {limit!r}")
    return limit


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryController:
    """Applies a memory limit to this process's device (CUDA) or tracks it (CPU)."""

    def __init__(self, use_cuda: Optional[bool] = None, spill: bool = False) -> None:
        import torch

        self._torch = torch
        self.cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.limit_bytes: Optional[int] = None
        self._cpu_peak = 0
        self.emulated_bytes: Optional[int] = None  # set by emulate(): the footprint stats() reports
        self.paused = False  # emulation only: the footprint is on the host (pause.Pauser)
        self.spill = None
        if self.cuda:
            self.device = torch.cuda.current_device()
            self.total_bytes: Optional[int] = torch.cuda.get_device_properties(self.device).total_memory
            if spill:
                from .spill import HostSpill

                try:
                    self.spill = HostSpill(self.device)
                except Exception as e:  # no managed memory, no cudart: the job runs without spill
                    log.warning("slurm-antman: host spill unavailable, OOM stays an error: %s", e)
        else:
            self.device = None
            self.total_bytes = None

    def set_limit(self, limit: Optional[int]) -> None:
        limit = check_limit(limit)
        if not self.cuda:
            self.limit_bytes = limit
            return
        torch = self._torch
        old = self.limit_bytes
        fraction = 1.0 if limit is None else min(1.0, limit / self.total_bytes)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        self.limit_bytes = limit
        shrinking = limit is not None and (old is None or limit < old)
        if shrinking:
            torch.cuda.empty_cache()

    def emulate(self, footprint_bytes: int) -> None:
        """Report ``footprint_bytes`` of device memory from now on (CPU trace replays only)."""
        if self.cuda:
            raise ValueError("emulation is for CPU-only trace replays; this process uses CUDA")
        if isinstance(footprint_bytes, bool) or not isinstance(footprint_bytes, int) or footprint_bytes <= 0:
            raise ValueError(f"mem_bytes must be a positive number of bytes, got {footprint_bytes!r}")
        self.emulated_bytes = footprint_bytes

    def stats(self) -> MemoryStats:
        if self.paused and not self.cuda:
            # On CPU the footprint (emulated, or the RSS standing in for it) is what a GPU job would hold
            # on its device; paused, that state is on the host: the device holds none of it.
            return MemoryStats(0, 0, 0, 0, self.limit_bytes, None)
        if self.emulated_bytes is not None:
            want = self.emulated_bytes
            held = want if self.limit_bytes is None else min(want, self.limit_bytes)
            return MemoryStats(held, held, held, want - held, self.limit_bytes, None)
        spilled = self.spill.spilled_bytes if self.spill is not None else 0
        if not self.cuda:
            rss = _rss_bytes()
            self._cpu_peak = max(self._cpu_peak, rss)
            return MemoryStats(rss, rss, self._cpu_peak, spilled, self.limit_bytes, None)
        s = self._torch.cuda.memory_stats(self.device)
        return MemoryStats(
            allocated_bytes=int(s.get("allocated_bytes.all.current", 0)),
            reserved_bytes=int(s.get("reserved_bytes.all.current", 0)),
            peak_bytes=int(s.get("allocated_bytes.all.peak", 0)),
            spilled_bytes=spilled,
            limit_bytes=self.limit_bytes,
            total_bytes=self.total_bytes,
        )
