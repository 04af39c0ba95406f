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


# Free host memory kept in the spill pool beyond the expected overflow (see _fill_spill).
SPILL_HEADROOM_BYTES = 64 << 20


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


def cuda_memory(torch, device: int) -> tuple[int, int, int]:
    """(allocated, reserved, peak allocated) bytes of the caching allocator. Read from the nested
    dict the allocator returns: ``torch.cuda.memory_stats()`` flattens all ~150 counters in Python
    first, which is most of a report's cost on a GPU (the agent reads these at every report)."""
    try:
        n = torch._C._cuda_memoryStats(device)
        a, r = n["allocated_bytes"]["all"], n["reserved_bytes"]["all"]
        return int(a["current"]), int(r["current"]), int(a["peak"])
    except (AttributeError, KeyError, TypeError):
        s = torch.cuda.memory_stats(device)
        return (int(s.get("allocated_bytes.all.current", 0)), int(s.get("reserved_bytes.all.current", 0)),
                int(s.get("allocated_bytes.all.peak", 0)))


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
        self._peak_allocated = 0
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
        self.limit_bytes = limit
        if limit is not None and self.spill is not None:
            self._fill_spill()
        self._set_fraction()
        shrinking = limit is not None and (old is None or limit < old)
        if shrinking:
            torch.cuda.empty_cache()

    def _set_fraction(self) -> None:
        # The spill pool's host segments count towards the fraction (torch_patch/spill.py), so the
        # device gets the limit and the host pool its own bytes on top.
        limit = self.limit_bytes
        held = self.spill.held_bytes if self.spill is not None else 0
        fraction = 1.0 if limit is None else min(1.0, (limit + held) / self.total_bytes)
        self._torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    def _footprint(self) -> int:
        """The most this job has had allocated (device and host spill alike), across the agent's
        peak resets: what it needs, fragmentation aside."""
        self._peak_allocated = max(self._peak_allocated, cuda_memory(self._torch, self.device)[2])
        return self._peak_allocated

    def _fill_spill(self) -> None:
        """Under a limit, keep enough free host memory cached in the spill pool for the part of the
        footprint that does not fit, plus headroom: the OOM path can only use what is already there."""
        need = self._footprint()
        # Headroom for what the caching allocator rounds and fragments, and for an iteration a little
        # larger than the ones seen: 10 % of the footprint and 64 MiB.
        want_free = max(0, need + need // 10 + SPILL_HEADROOM_BYTES - self.limit_bytes)
        spill = self.spill
        free = spill.held_bytes - spill.in_use_bytes()
        if free >= want_free:
            return
        # New segments are checked against the fraction: lift it while the pool grows.
        self._torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        try:
            spill.grow(want_free - free)
            # grow() allocated its segments as tensors: that is no part of the job's peak, and the
            # next _footprint() must not read it as one (the peak seen so far is kept above).
            self._torch.cuda.reset_peak_memory_stats(self.device)
        except Exception as e:  # pinned host memory exhausted: what fits under the limit still trains
            log.warning("slurm-antman: the host spill pool could not grow by %d MiB: %s",
                        (want_free - free) >> 20, e)

    def maintain(self) -> None:
        """At a report boundary: top the spill pool up if the job has grown since the limit came."""
        if self.cuda and self.spill is not None and self.limit_bytes is not None:
            before = self.spill.held_bytes
            self._fill_spill()
            if self.spill.held_bytes != before:
                self._set_fraction()

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
        if not self.cuda:
            rss = _rss_bytes()
            self._cpu_peak = max(self._cpu_peak, rss)
            return MemoryStats(rss, rss, self._cpu_peak, 0, self.limit_bytes, None)
        allocated, reserved, peak = cuda_memory(self._torch, self.device)
        self._peak_allocated = max(self._peak_allocated, peak)
        spilled = held = 0
        if self.spill is not None and self.spill.held_bytes:
            # The allocator counts the host pool as its own: what is on the device is the rest.
            held = self.spill.held_bytes
            spilled = self.spill.in_use_bytes()
        return MemoryStats(
            allocated_bytes=max(0, allocated - spilled),
            reserved_bytes=max(0, reserved - held),
            peak_bytes=peak,
            spilled_bytes=spilled,
            limit_bytes=self.limit_bytes,
            total_bytes=self.total_bytes,
        )
