"""Page-locked host memory for a pause's offload (torch_patch.pause), pinned in parallel and used as
soon as each part of it is ready.

Why not ``torch.empty(..., pin_memory=True)`` per tensor: every call is a ``cudaHostAlloc`` of fresh
memory, which the kernel zeroes and the driver locks page by page, one call after the other, before
the tensor's copy can start. On the first H200 run (2026-11, 8 GiB of model and Adam state) that made
the offload 5.8 s against 155 ms for the copies alone.

Here: one pageable arena for all the bytes (``torch.empty``: nothing resident yet), each tensor a
slice of it at an aligned offset. Worker threads fault the pages in, in parallel (the kernel zeroes
them), and one more thread registers the arena (``cudaHostRegister``) chunk by chunk, in order:
page-aligned ranges of :data:`CHUNK_BYTES`, each its own registration. Faulting first keeps the
zeroing out of the registration, which holds a driver-wide lock (PyTorch's own
``pinned_use_cuda_host_register`` pre-faults for the same reason). The caller issues each tensor's
device-to-host copy the moment the chunks under its slice are registered, so the copies run while the
rest is still being pinned.

A chunk that fails to register is not an error: the tensors over it (and those over chunks not yet
tried) get the caller's per-tensor fallback, and why is logged once. Nothing here touches CUDA except
through the runtime passed in, so the layout and the bookkeeping run (and are tested) on CPU with a
stand-in runtime.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("torch_patch.pinned")

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SLICE_ALIGN = 4096  # each tensor's slice starts on a page: DMA-friendly, and any dtype can view it
CHUNK_BYTES = 256 << 20  # one registration: small enough that the first copies start early
ARENA_ALIGN = 2 << 20  # the arena starts on a huge-page boundary, so transparent huge pages can back it
# cudaHostRegister flags (CUDA runtime API, driver_types.h): Default 0, Portable 1, Mapped 2,
# IoMemory 4, ReadOnly 8. With unified addressing (every 64-bit CUDA platform) the default already
# makes the memory mapped and portable.
REGISTER_DEFAULT = 0
REGISTER_PORTABLE = 1
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the range in, writable, without writing it from here


def threads_default() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Where each tensor goes in the arena and how the arena is cut into registrations."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int  # bytes of the arena: a whole number of pages, so the last registration ends on one
    chunks: tuple[tuple[int, int], ...]  # [start, end) of each registration, in order
    chunk_bytes: int

    def needs(self, i: int) -> range:
        """The chunks tensor ``i``'s slice lies on (none for an empty tensor)."""
        off, n = self.offsets[i], self.sizes[i]
        if n == 0:
            return range(0)
        return range(off // self.chunk_bytes, (off + n - 1) // self.chunk_bytes + 1)


def layout(sizes: Sequence[int], align: int = SLICE_ALIGN, chunk: int = CHUNK_BYTES, page: int = PAGE) -> Layout:
    """Slices in order, each at a multiple of ``align``; chunks of ``chunk`` bytes (a multiple of the
    page: two registrations must never share a page, the driver refuses the second)."""
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment must be a power of two, not {align}")
    if chunk <= 0 or chunk % page:
        raise ValueError(f"chunk size {chunk} is not a multiple of the page size {page}")
    offsets, pos = [], 0
    for n in sizes:
        if n < 0:
            raise ValueError(f"negative size {n}")
        pos = align_up(pos, align)
        offsets.append(pos)
        pos += n
    total = align_up(pos, page)
    chunks = tuple((s, min(s + chunk, total)) for s in range(0, total, chunk))
    return Layout(tuple(offsets), tuple(int(n) for n in sizes), total, chunks, chunk)


_libc: Any = None
_populate_ok = True  # MADV_POPULATE_WRITE works here (else: memset, which faults the pages too)
_said: set[str] = set()


def _say_once(key: str, msg: str) -> None:
    """A job may pause hundreds of times: say each kind of trouble once."""
    if key not in _said:
        _said.add(key)
        log.warning("slurm-antman: %s", msg)


def _madvise(addr: int, n: int, advice: int) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        return _libc.madvise(addr, n, advice) == 0
    except (OSError, AttributeError):
        return False


def _fault_in(addr: int, n: int) -> None:
    """Make the pages resident (ctypes calls release the GIL, so the workers run in parallel)."""
    global _populate_ok
    if _populate_ok and _madvise(addr, n, _MADV_POPULATE_WRITE):
        return
    _populate_ok = False  # older kernel or sandbox: write the bytes instead
    ctypes.memset(addr, 0, n)


_rt: Any = None


def cudart() -> Any:
    """The CUDA runtime PyTorch loaded (spill.load_cudart), with the signatures used here."""
    global _rt
    if _rt is None:
        from .spill import load_cudart

        rt = load_cudart()
        rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        rt.cudaHostRegister.restype = ctypes.c_int
        rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        rt.cudaHostUnregister.restype = ctypes.c_int
        rt.cudaSetDevice.argtypes = [ctypes.c_int]
        rt.cudaSetDevice.restype = ctypes.c_int
        _rt = rt
    return _rt


class Arena:
    """A pageable buffer, faulted in by ``threads`` workers in parallel and registered with CUDA chunk
    by chunk, in order, by ``registrars`` more (one by default), all started at once.

    Why one registrar: registering pages already resident is fast (H200 VM, 2026-11: 4 GiB in about
    100 ms from one thread) and holds a driver-wide lock, so eight registrars took the same time and
    five times the CPU, waiting on each other. The faulting is what takes the time (about 20 GiB/s
    with 8 threads there, 7 with one). Why the threads are all started before any page is touched: a
    new thread maps its stack, which waits behind a fault-in holding the process's address-space lock
    (a pool started lazily spent 0.5 s of an 8 GiB pause starting)."""

    def __init__(self, torch: Any, plan: Layout, rt: Any, device: int, threads: int,
                 flags: int = REGISTER_DEFAULT, registrars: int = 1):
        self.plan, self._rt, self.device, self.flags = plan, rt, device, flags
        self.buf = torch.empty(plan.total + ARENA_ALIGN, dtype=torch.uint8)  # untouched: not resident
        self.base = self.buf.data_ptr() + (-self.buf.data_ptr()) % ARENA_ALIGN
        # The slices' storage must *start* at the registered base: torch's is_pinned() asks CUDA about
        # a storage's first byte, and the bytes before the aligned base are not registered. So the
        # arena is a tensor over [base, base + total) that holds on to the allocation (``_owner``):
        # a slice kept by anyone keeps the memory alive, even after release().
        raw = (ctypes.c_uint8 * plan.total).from_address(self.base)
        raw._owner = self.buf
        self.bytes = torch.frombuffer(raw, dtype=torch.uint8) if plan.total else self.buf[:0]
        self.hugepages = plan.total > 0 and _madvise(self.base, plan.total, _MADV_HUGEPAGE)
        n = len(plan.chunks)
        self.registered: list[int] = []  # chunk indices, each unregistered once in release()
        self.error: Optional[str] = None
        self.fault_s = self.register_s = 0.0  # summed over the workers
        self.unpin_s: Optional[float] = None  # the unregistering in release(), once done
        self._lock = threading.Lock()
        self._faulted = [threading.Event() for _ in range(n)]
        self._done = [threading.Event() for _ in range(n)]
        self._ok = [False] * n
        self._next = {"fault": 0, "register": 0}
        self.threads = max(1, min(threads, n))
        self._go = threading.Event()
        self._workers = [threading.Thread(target=self._faulter, name="antman-fault", daemon=True)
                         for _ in range(self.threads)]
        self._workers += [threading.Thread(target=self._registrar, name="antman-register", daemon=True)
                          for _ in range(max(1, min(registrars, n)))]
        for w in self._workers:
            w.start()
        self.started = time.perf_counter()
        self.pinned_at = self.started  # when the last registration returned
        self._go.set()

    def _take(self, what: str) -> Optional[int]:
        with self._lock:
            i = self._next[what]
            if i >= len(self.plan.chunks):
                return None
            self._next[what] = i + 1
            return i

    def _fail(self, msg: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = msg

    def _faulter(self) -> None:
        self._go.wait()
        while (i := self._take("fault")) is not None:
            try:
                if self.error is None:  # once a chunk failed, the rest goes the per-tensor way
                    start, end = self.plan.chunks[i]
                    t0 = time.perf_counter()
                    _fault_in(self.base + start, end - start)
                    with self._lock:
                        self.fault_s += time.perf_counter() - t0
            except Exception as e:  # never let the offload fail for it: the tensors fall back
                self._fail(f"faulting in the arena: {e!r}")
            finally:
                self._faulted[i].set()

    def _registrar(self) -> None:
        self._go.wait()
        # A new thread's runtime would pick device 0 and could create a context there, on a GPU that
        # may be another job's: bind the job's device first.
        try:
            err = self._rt.cudaSetDevice(self.device)
        except Exception as e:
            err = repr(e)
        if err != 0:
            self._fail(f"cudaSetDevice({self.device}) returned {err}")
        while (i := self._take("register")) is not None:
            try:
                self._faulted[i].wait()
                if self.error is None:
                    start, end = self.plan.chunks[i]
                    t0 = time.perf_counter()
                    err = self._rt.cudaHostRegister(self.base + start, end - start, self.flags)
                    t1 = time.perf_counter()
                    with self._lock:
                        self.register_s += t1 - t0
                        self.pinned_at = max(self.pinned_at, t1)
                        if err == 0:
                            self.registered.append(i)
                            self._ok[i] = True
                    if err != 0:
                        self._fail(f"cudaHostRegister of {end - start} bytes returned {err}")
            except Exception as e:
                self._fail(f"cudaHostRegister: {e!r}")
            finally:
                self._done[i].set()

    def fits(self, plan: Layout) -> bool:
        """Whether ``plan``'s slices lie within this arena's registrations: a kept (or pre-pinned) arena
        serves a later offload whose state is no larger, cut into chunks of the same size."""
        return (self.bytes is not None and self.error is None and plan.chunk_bytes == self.plan.chunk_bytes
                and plan.total <= self.plan.total)

    def adopt(self, plan: Layout) -> None:
        """Take ``plan``'s slices (``fits`` must hold); the registrations stay as they are."""
        self.plan = Layout(plan.offsets, plan.sizes, self.plan.total, self.plan.chunks, self.plan.chunk_bytes)

    def ready(self, chunks: range) -> bool:
        """Wait until ``chunks`` are registered; False if one of them could not be."""
        for c in chunks:
            self._done[c].wait()
            if not self._ok[c]:
                return False
        return True

    def slice(self, i: int, like: Any) -> Any:
        """Tensor ``i``'s place in the arena, typed and shaped like ``like``."""
        off, n = self.plan.offsets[i], self.plan.sizes[i]
        return self.bytes[off:off + n].view(like.dtype).view(like.shape)

    def finish(self) -> None:
        """Wait for every worker (all chunks tried)."""
        for w in self._workers:
            w.join()

    def release(self, wait: bool = True) -> None:
        """Unregister every registered chunk, then let the memory go. Only once nothing reads or writes
        it any more: the caller has synchronized the copies. ``wait=False`` leaves the unregistering
        (about 100 ms per 4 GiB on the H200 VM) to a thread of its own, off the training thread."""
        self.finish()
        with self._lock:
            chunks, self.registered = self.registered, []
        # The thread holds the buffers until every chunk is unregistered: freed memory must never be
        # registered still. It binds the job's device, like the registrar.
        w = threading.Thread(target=self._unpin, args=(chunks, self.bytes, self.buf), name="antman-unregister",
                             daemon=True)
        self.bytes = self.buf = None
        w.start()
        if wait:
            w.join()

    def _unpin(self, chunks: list[int], *keep: Any) -> None:
        errs: list[Any] = []
        t0 = time.perf_counter()
        try:
            if chunks:
                self._rt.cudaSetDevice(self.device)
            for i in chunks:
                err = self._rt.cudaHostUnregister(self.base + self.plan.chunks[i][0])
                if err:
                    errs.append(err)
        except Exception as e:
            errs.append(repr(e))
        self.unpin_s = time.perf_counter() - t0
        if errs:
            _say_once("unregister", f"cudaHostUnregister returned {errs[0]} for {len(errs)} chunk(s) of the "
                      "pause arena")


def prepin(torch: Any, nbytes: int, *, rt: Any, device: int, threads: Optional[int] = None,
           chunk: int = CHUNK_BYTES) -> Arena:
    """An arena of ``nbytes`` pinned now, in the background (the workers fault and register while the
    caller goes on), for a later offload (``copy_out(kept=)``): the first pause then finds its host
    memory ready instead of waiting for the kernel to zero fresh pages."""
    return Arena(torch, layout([nbytes], chunk=chunk), rt, device, threads or threads_default())


def copy_out(torch: Any, tensors: Sequence[Any], *, rt: Any, device: int, fallback: Callable[[Any], Any],
             sync: Callable[[], None], timings: dict, threads: Optional[int] = None,
             chunk: int = CHUNK_BYTES, kept: Optional[Arena] = None) -> tuple[list[Any], Optional[Arena]]:
    """Host copies of ``tensors``: each one's ``non_blocking`` copy is *issued* into its slice of one
    arena as soon as that slice is pinned, or made by ``fallback(t)`` where pinning failed. Nothing is
    waited for: the caller synchronizes before it reads a copy or drops a source. Returns the copies
    and the arena (None if unused), which must outlive every use of the copies (``Arena.release``).

    ``timings`` gets alloc_s (the pageable arena), pin_s (arena start to the last registration), the
    workers' summed fault_cpu_s and register_cpu_s, the arena's shape and whether each tensor used it.

    ``kept``: an arena pinned before (kept from the last pause, or pre-pinned): used where the state fits
    in it (``kept_arena`` in ``timings``), let go where it does not."""
    started = time.perf_counter()
    sizes = [t.numel() * t.element_size() for t in tensors]
    plan = layout(sizes, chunk=chunk)
    n_threads = threads or threads_default()
    timings.update(arena_bytes=plan.total, chunks=len(plan.chunks), threads=0, fallback_tensors=0,
                   alloc_s=0.0, pin_s=0.0, fault_cpu_s=0.0, register_cpu_s=0.0, hugepages=False, kept_arena=False)
    timings.setdefault("error", None)
    arena: Optional[Arena] = None
    if kept is not None and plan.total and kept.fits(plan):
        arena = kept
        arena.adopt(plan)
        timings["kept_arena"] = True
    elif kept is not None:  # grown past it (or broken): pinned afresh below, as without one
        kept.release(wait=False)
    if arena is None and rt is None:
        timings["error"] = timings["error"] or "no CUDA runtime (libcudart) to register host memory with"
    elif arena is None and plan.total:
        t0 = time.perf_counter()
        try:
            arena = Arena(torch, plan, rt, device, n_threads)
        except (RuntimeError, MemoryError) as e:  # the host could not even reserve it
            timings["error"] = f"arena of {plan.total} bytes: {e}"
        timings["alloc_s"] = time.perf_counter() - t0
    hosts: list[Any] = []
    last_fallback = None
    try:
        for i, t in enumerate(tensors):
            host = None
            if arena is not None and arena.ready(plan.needs(i)):
                try:
                    host = arena.slice(i, t)
                except RuntimeError:  # a dtype a byte view cannot take: that one tensor goes alone
                    host = None
            if host is not None:
                host.copy_(t, non_blocking=True)
            else:
                host = fallback(t)
                timings["fallback_tensors"] += 1
                last_fallback = time.perf_counter()
            hosts.append(host)
        if arena is not None:
            arena.finish()
    except BaseException:
        # Nothing was swapped yet: the job's state is still on the device. Let the copies already
        # issued land before the arena goes away under them.
        try:
            sync()
        finally:
            if arena is not None:
                arena.release()
        raise
    # When the last host memory was pinned (the caller's copy_s is what the copies took after it).
    timings["pinned_at"] = max(arena.pinned_at if arena is not None else 0.0, last_fallback or 0.0)
    if arena is not None and timings["kept_arena"]:
        # Pinned before the pause: only what was still pinning when it came counts (a pre-pin under way).
        timings["pin_s"] += max(0.0, arena.pinned_at - started)
        timings.update(threads=arena.threads, hugepages=arena.hugepages, error=arena.error)
    elif arena is not None:
        timings["pin_s"] += arena.pinned_at - arena.started  # after the fallback's own, if any
        timings.update(fault_cpu_s=arena.fault_s,
                       register_cpu_s=arena.register_s, threads=arena.threads, hugepages=arena.hugepages,
                       error=arena.error)
        if not arena.registered:  # nothing of it is in use: give it back now
            arena.release()
            arena = None
    if timings["error"] and timings["fallback_tensors"]:
        _say_once("fallback", f"pause: {timings['fallback_tensors']} tensor(s) pinned one by one (slower): "
                              f"{timings['error']}")
    return hosts, arena
