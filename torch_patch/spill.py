"""Host spill for opportunistic jobs on CUDA (AntMan's "universal memory").

When an allocation does not fit under the job's limit, PyTorch would raise OOM. Instead it falls back
to a ``torch.cuda.MemPool(..., use_on_oom=True)`` whose allocator hands out *pinned, mapped host
memory* (``cudaHostAlloc`` with ``cudaHostAllocMapped``): with unified addressing the GPU reads and
writes it directly over PCIe/NVLink, slower, but the job keeps training and takes no GPU memory from the
guaranteed job. This is what AntMan's GPUVMemAllocator does (GPU first, pinned host memory after).

Why not ``cudaMallocManaged``: managed pages migrate to the GPU when touched, and that GPU memory is
outside the limit PyTorch enforces, so it would take exactly the room we promised the other job.

The allocator is two ctypes callbacks into the CUDA runtime already loaded by PyTorch, the mechanism
PyTorch itself uses for ``torch.cuda._use_uvm``; no compiled extension is needed, so it works on nodes
without a compiler. The callbacks only run when the caching allocator creates or frees a whole
segment of the spill pool, not per tensor, so their Python cost is small.

The pool must be filled ahead of time. On an OOM PyTorch's caching allocator only looks for a *free
block already cached* in a ``use_on_oom`` pool (``get_free_block``); it never asks the pool's allocator
for a new segment there (c10/cuda/CUDACachingAllocator.cpp, ``malloc``, "try to use existing mempools
as a last resort"; torch 2.8 to 2.13). The first GPU run (2026-11-26, H200, torch 2.11) found this the
hard way: an empty pool turned the first allocation over the limit into an OOM. So :meth:`HostSpill.grow`
allocates host segments into the pool and frees them at once: they stay cached there, free, for the OOM
path to split.

Those host segments count towards the per-process memory fraction (the allocator adds every segment,
device or not, to ``total_allocated_memory``), so the memory controller sets the fraction to the
limit *plus* the host bytes held (torch_patch/memory.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from typing import Optional

log = logging.getLogger("torch_patch.spill")

_CUDA_HOST_ALLOC_MAPPED = 0x02
_CUDA_HOST_ALLOC_PORTABLE = 0x01

# What grow() first sets aside for small (<= 1 MiB) requests: 16 segments of 2 MiB (the caching
# allocator's kSmallBuffer), two 1 MiB blocks each.
SMALL_BLOCK = 1 << 20
SMALL_SEGMENTS = 16

_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


def _loaded_cudart_path() -> Optional[str]:
    """The libcudart PyTorch loaded: using another copy would mean a second CUDA runtime."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def load_cudart() -> ctypes.CDLL:
    candidates = [_loaded_cudart_path(), "libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")]
    errors = []
    for name in candidates:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise OSError("CUDA runtime (libcudart) not found: " + "; ".join(errors or ["no candidates"]))


_LIVE_CALLBACKS: list = []


class HostSpill:
    """A MemPool that PyTorch uses when a device allocation runs out of memory."""

    def __init__(self, device: int) -> None:
        import torch

        self._cudart = load_cudart()
        self._cudart.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        self._cudart.cudaHostAlloc.restype = ctypes.c_int
        self._cudart.cudaFreeHost.argtypes = [ctypes.c_void_p]
        self._cudart.cudaFreeHost.restype = ctypes.c_int
        self._torch = torch
        self.device = device
        self._lock = threading.Lock()
        self._segments: dict[int, int] = {}  # host pointer -> size, for the snapshot fallback
        self.held_bytes = 0  # host bytes held now (segments of the pool, used or free)
        self.held_total_bytes = 0  # host bytes ever handed out
        self.failures = 0
        # The callbacks must outlive the pool, which PyTorch may free after this object is cleared
        # at interpreter shutdown: the module keeps them too.
        self._alloc_cb = _ALLOC_FN(self._alloc)
        self._free_cb = _FREE_FN(self._free)
        _LIVE_CALLBACKS.extend((self._alloc_cb, self._free_cb))
        alloc_ptr = ctypes.cast(self._alloc_cb, ctypes.c_void_p).value
        free_ptr = ctypes.cast(self._free_cb, ctypes.c_void_p).value
        self._allocator = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
        with torch.cuda.device(device):
            self.pool = torch.cuda.MemPool(self._allocator, use_on_oom=True)

    def _alloc(self, size: int, device: int, stream: Optional[int]) -> Optional[int]:
        ptr = ctypes.c_void_p()
        err = self._cudart.cudaHostAlloc(ctypes.byref(ptr), size, _CUDA_HOST_ALLOC_MAPPED | _CUDA_HOST_ALLOC_PORTABLE)
        if err != 0 or not ptr.value:
            with self._lock:
                self.failures += 1
            return None  # PyTorch turns a null pointer into its usual OOM error
        with self._lock:
            self.held_bytes += size
            self.held_total_bytes += size
            self._segments[ptr.value] = size
        return ptr.value

    def _free(self, ptr: Optional[int], size: int, device: int, stream: Optional[int]) -> None:
        if not ptr:
            return
        try:
            cudart = self._cudart
        except AttributeError:
            # Interpreter shutdown cleared this object while the pool still frees its segments: the
            # host memory goes with the process.
            return
        cudart.cudaFreeHost(ptr)
        with self._lock:
            self.held_bytes -= size
            self._segments.pop(ptr, None)

    def _pool_segments(self) -> list[dict]:
        torch = self._torch
        try:
            return list(torch.cuda.memory_snapshot(self.pool.id, include_traces=False))
        except TypeError:  # an older torch: the whole allocator's snapshot, ours picked by address
            with self._lock:
                ours = set(self._segments)
            return [s for s in torch.cuda.memory_snapshot() if s.get("address") in ours]

    def in_use_bytes(self) -> int:
        """Host bytes of the pool that hold live tensors now (the rest is free, waiting for an OOM)."""
        if not self.held_bytes:
            return 0
        return sum(int(s.get("allocated_size", 0)) for s in self._pool_segments())

    def grow(self, add_bytes: int) -> int:
        """Caches at least ``add_bytes`` more free host memory in the pool (see the module's note);
        returns the host bytes held after. The caller lifts the memory fraction around this call:
        the new segments count towards it."""
        torch = self._torch
        if add_bytes <= 0:
            return self.held_bytes
        start = self.held_bytes
        held = []
        with torch.cuda.use_mem_pool(self.pool, device=self.device):
            if not start:
                # Requests of 1 MiB or less come from the pool's small blocks, 2 MiB segments of
                # their own: a few for the small tensors an iteration allocates over the limit.
                held += [torch.empty(SMALL_BLOCK, dtype=torch.uint8, device=self.device)
                         for _ in range(2 * SMALL_SEGMENTS)]
            # Free blocks already in the pool would serve a request first, so keep allocating (and
            # holding) until the pool has really grown by add_bytes.
            for _ in range(8):
                missing = start + add_bytes - self.held_bytes
                if missing <= 0:
                    break
                held.append(torch.empty(missing, dtype=torch.uint8, device=self.device))
        del held
        return self.held_bytes
