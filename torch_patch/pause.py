"""Pause in place (after PipeSwitch, OSDI'20): move a job's GPU state to pinned host memory
and free the device, then bring it back, overlapping the copy back with the first iterations.

What moves: every parameter (and its gradient) and buffer of the job's ``nn.Module`` objects that
live on the device, and every tensor in the state of the optimizers the agent has seen step. Tensors
are swapped in place (``param.data``, ``module._buffers``, ``optimizer.state``), so the training
script's references stay valid and it continues as if nothing happened.

Back in, the copies run on a side stream in the modules' order, one CUDA event per module; a
one-shot forward pre-hook makes the compute stream wait only for that module's event, so the first
layers compute while later ones are still copying (PipeSwitch's layer pipelining), and a one-shot
optimizer pre-hook waits for everything before the first ``step()``. Gradients alone come back first
and are waited for at once: ``zero_grad`` touches them before any forward.

The host side is one arena for all the bytes, pinned chunk by chunk in parallel while the first
copies already run (torch_patch.pinned); where pinning it fails, each tensor gets its own pinned
memory as before. It stays pinned until the first step after the resume has waited for the copies
back, then is unregistered and freed.

On CPU there is no device memory: with memory emulation (trace replays) the emulated footprint is
what is freed and restored, so the protocol and the policy run end to end without a GPU.
"""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from . import pinned
from .busy import root_modules


@dataclass
class _Moved:
    """One module's tensors on the host: (container, key) pairs and their host copies."""
    module: Any
    slots: list[tuple[Any, Any, Any]] = field(default_factory=list)  # (kind, owner, key) -> host tensor below
    hosts: list[Any] = field(default_factory=list)


def _put(slot: tuple[str, Any, Any], tensor: Any) -> None:
    """Swap ``tensor`` in where ``slot`` says: a parameter's data, its gradient, or a module's buffer."""
    kind, owner, key = slot
    if kind == "param":
        owner.data = tensor
    elif kind == "grad":
        owner.grad = tensor
    else:
        owner._buffers[key] = tensor


class DeviceState:
    """Offload and restore one process's training state on one CUDA device."""

    def __init__(self, torch: Any, device: Any, optimizers: Iterable[Any]):
        self.torch = torch
        self.device = device
        self.optimizers = list(optimizers)
        self._moved: list[_Moved] = []
        self._opt_moved: list[tuple[dict, Any, Any]] = []  # (state dict of a param, key, host tensor)
        self._hooks: list[Any] = []
        self._keep: list[Any] = []  # host tensors whose async copies may still run
        self._last: Any = None  # the event after the last copy back
        self.stepped = False  # the first optimizer step after the restore has waited for the copies
        self.bytes_moved = 0
        self.timings: dict[str, Any] = {}
        self._arena: Optional[pinned.Arena] = None  # the host copies live in it until release()

    def _pinned_copy(self, t: Any) -> Any:
        """The per-tensor way (fresh pinned memory each): what the arena falls back to."""
        t0 = time.perf_counter()
        host = self.torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        self.timings["pin_s"] = self.timings.get("pin_s", 0.0) + time.perf_counter() - t0
        host.copy_(t, non_blocking=True)
        return host

    def _collect(self) -> tuple[list[tuple[Any, Any]], list[Any]]:
        """What moves, in the modules' order (the restore's order too): (owner, slot) and its tensor.
        ``owner`` is the :class:`_Moved` of a module, or an optimizer's per-parameter state dict."""
        slots: list[tuple[Any, Any]] = []
        tensors: list[Any] = []
        seen: set[int] = set()
        for root in root_modules(self.torch, self.device, buffers=True):
            for mod in root.modules():
                moved, n0 = _Moved(mod), len(slots)
                for name, p in list(mod._parameters.items()):
                    if p is None or id(p) in seen or p.device != self.device:
                        continue
                    seen.add(id(p))
                    slots.append((moved, ("param", p, name)))
                    tensors.append(p.data)
                    if p.grad is not None:
                        slots.append((moved, ("grad", p, name)))
                        tensors.append(p.grad)
                for name, b in list(mod._buffers.items()):
                    if b is None or b.device != self.device:
                        continue
                    slots.append((moved, ("buffer", mod, name)))
                    tensors.append(b)
                if len(slots) > n0:
                    self._moved.append(moved)
        for opt in self.optimizers:
            for st in opt.state.values():
                for k, v in list(st.items()):
                    if isinstance(v, self.torch.Tensor) and v.device == self.device:
                        slots.append((st, k))
                        tensors.append(v)
        return slots, tensors

    def offload(self, kept: Optional[pinned.Arena] = None) -> int:
        """Everything to pinned host memory; returns the bytes moved. The device memory is freed by
        the caller's ``empty_cache`` once the references here are gone. ``timings`` says where the
        time went (find_s: the garbage collector's scan; alloc_s, pin_s: the host memory; copy_s:
        the copying left after the last pinning, to the synchronize; swap_s). ``kept``: host memory pinned
        before (``Pauser``'s kept or pre-pinned arena), used where the state fits in it."""
        torch = self.torch
        t0 = time.perf_counter()
        slots, tensors = self._collect()
        t1 = time.perf_counter()
        self.timings = {"find_s": t1 - t0, "tensors": len(tensors)}
        try:
            rt = pinned.cudart()
        except (OSError, AttributeError) as e:  # no libcudart, or one without these calls
            rt = None
            self.timings["error"] = str(e)
        hosts, self._arena = pinned.copy_out(
            torch, tensors, rt=rt, device=self.device.index, fallback=self._pinned_copy,
            sync=lambda: torch.cuda.synchronize(self.device), timings=self.timings, kept=kept)
        t2 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        t3 = time.perf_counter()
        # Only now, with every copy done, drop the device tensors.
        for (owner, slot), host in zip(slots, hosts):
            if isinstance(owner, _Moved):
                owner.slots.append(slot)
                owner.hosts.append(host)
            else:
                self._opt_moved.append((owner, slot, host))
        for moved in self._moved:
            for slot, host in zip(moved.slots, moved.hosts):
                _put(slot, host)
        for st, k, host in self._opt_moved:
            st[k] = host
        t4 = time.perf_counter()
        pinned_at = self.timings.pop("pinned_at", t2)
        self.timings.update(stage_s=t3 - t1, copy_s=t3 - max(pinned_at, t1), swap_s=t4 - t3,
                            arena=self._arena is not None and not self.timings.get("fallback_tensors"))
        self.bytes_moved = sum(t.numel() * t.element_size() for t in tensors)
        return self.bytes_moved

    def restore(self) -> None:
        """Copies back on a side stream, module by module; the compute stream waits per module."""
        torch = self.torch
        side = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        side.wait_stream(compute)
        last = None
        with torch.cuda.stream(side):
            # Gradients first, and the compute stream waits for them at once: a loop's
            # zero_grad(set_to_none=False) zeroes them in place before any forward hook fires, and a
            # copy landing after that brought the old gradients back into the next step (the GPU test
            # here, H200, 2026-11). Each is assigned below, once its parameter is back on the device.
            grads = {}
            for moved in self._moved:
                for j, (slot, host) in enumerate(zip(moved.slots, moved.hosts)):
                    if slot[0] == "grad":
                        grads[id(moved), j] = host.to(self.device, non_blocking=True)
                        self._keep.append(host)
            if grads:
                ready = torch.cuda.Event()
                ready.record(side)
                compute.wait_event(ready)
            for moved in self._moved:
                for j, (slot, host) in enumerate(zip(moved.slots, moved.hosts)):
                    if slot[0] == "grad":
                        _put(slot, grads[id(moved), j])
                    else:
                        _put(slot, host.to(self.device, non_blocking=True))
                        self._keep.append(host)
                ev = torch.cuda.Event()
                ev.record(side)
                last = ev
                self._hooks.append(moved.module.register_forward_pre_hook(self._waiter(ev)))
            for st, k, host in self._opt_moved:
                st[k] = host.to(self.device, non_blocking=True)
                self._keep.append(host)
            if self._opt_moved or last is None:
                last = torch.cuda.Event()
                last.record(side)
        self._last = last
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hooks.append(register_optimizer_step_pre_hook(self._before_step))
        self._moved, self._opt_moved = [], []

    def _waiter(self, ev: Any):
        fired = [False]

        def pre_hook(module: Any, args: Any) -> None:
            if not fired[0]:
                fired[0] = True
                self.torch.cuda.current_stream(self.device).wait_event(ev)
        return pre_hook

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # The hooks are removed later (release(), at the agent's next boundary): torch is iterating
        # over them right now, and a dict must not change under its iteration.
        if not self.stepped:
            self.torch.cuda.current_stream(self.device).wait_event(self._last)
            self.stepped = True

    def tensor_bytes(self) -> int:
        """The bytes an offload would move now (the state's tensors on the device)."""
        return sum(t.numel() * t.element_size() for t in self._collect()[1])

    def release(self, keep_arena: bool = False) -> Optional[pinned.Arena]:
        """Drop the hooks and, once the copies are done, the host copies and their arena; with
        ``keep_arena``, the arena is handed back, still pinned, instead of let go."""
        t0 = time.perf_counter()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._last is not None:
            self._last.synchronize()
        t1 = time.perf_counter()
        self._keep = []
        arena, self._arena = self._arena, None
        if arena is not None and not keep_arena:
            # Unregistered only now: the copies back read from it until _last. In the background:
            # this is the training thread.
            arena.release(wait=False)
            arena = None
        self.timings.update(release_wait_s=t1 - t0, release_arena_s=time.perf_counter() - t1)
        return arena


class Pauser:
    """The agent's side of pause/resume: what to move and how much it freed."""

    def __init__(self, torch: Any, memory: Any):
        self.torch = torch
        self.memory = memory
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._state: Optional[DeviceState] = None
        self._restored: Optional[DeviceState] = None  # its hooks live until the first step after resume
        self._emulated: Optional[int] = None
        # Pinned host memory held between pauses (docs/architecture.md, "Pause in place"): the first
        # pause of a job pinned fresh pages, which the kernel zeroes (about 20 GiB/s with 8 threads on
        # the H200 VM, 2026-11-26), so it ran 3.1-10.8x its ideal. The sidecar grants each job an
        # allowance out of the node's budget (sidecar.pin_budget_mb); within it the arena is kept after
        # a resume, and pinned ahead once the job runs where a pause can come.
        self.pin_allowance = 0
        self._kept: Optional[pinned.Arena] = None
        self._prepinned_for: Optional[int] = None  # the allowance a pre-pin was last tried for
        # Where the last pause's time went (DeviceState.offload's timings, free_s: the collection and
        # empty_cache, total_s; release_s once its host memory is let go): for the GPU benchmark.
        self.last_timings: dict[str, Any] = {}

    def saw_optimizer(self, opt: Any) -> None:
        self._optimizers.add(opt)

    def pause(self) -> tuple[int, int]:
        """(bytes freed on the device, bytes moved to the host)."""
        mem = self.memory
        if mem.emulated_bytes is not None:
            held = mem.stats().reserved_bytes
            self._emulated = mem.emulated_bytes
            mem.paused = True
            return held, held
        if not mem.cuda:
            return 0, 0
        torch = self.torch
        if self._restored is not None:
            # Resumed, but no step since: its copies back must have landed before these copies out
            # read the same tensors (on another stream), and its host memory can go now.
            self._release()
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(mem.device)
        self._state = DeviceState(torch, torch.device("cuda", mem.device), list(self._optimizers))
        kept, self._kept = self._kept, None
        moved = self._state.offload(kept=kept)
        t1 = time.perf_counter()
        gc.collect()
        torch.cuda.empty_cache()
        t2 = time.perf_counter()
        self.last_timings = dict(self._state.timings, free_s=t2 - t1, total_s=t2 - t0)
        return max(0, before - torch.cuda.memory_reserved(mem.device)), moved

    def resume(self) -> None:
        mem = self.memory
        if self._emulated is not None:
            mem.paused = False
            self._emulated = None
            return
        if self._state is not None:
            self._state.restore()
            self._restored, self._state = self._state, None

    def after_boundary(self) -> None:
        """At each iteration boundary: once the first step after a resume has run, drop its hooks; pin
        ahead where an allowance came and nothing is pinned yet."""
        if self._restored is not None and self._restored.stepped:
            self._release()
        if (self.pin_allowance and self._kept is None and self._state is None and self._restored is None
                and self._prepinned_for != self.pin_allowance and self.memory.cuda
                and self.memory.emulated_bytes is None):
            self._prepin()

    def set_pin_allowance(self, nbytes: int) -> None:
        """The host bytes this job may keep pinned (from the sidecar's limits; 0: none). An arena larger
        than a lowered allowance is let go at once."""
        self.pin_allowance = max(0, int(nbytes))
        if self._kept is not None and self._kept.plan.total > self.pin_allowance:
            self._kept.release(wait=False)
            self._kept = None

    def _prepin(self) -> None:
        """An arena for the state as it is now, with an eighth more for what grows (Adam's moments
        appear at the first step), pinned in the background; none where that exceeds the allowance."""
        self._prepinned_for = self.pin_allowance
        torch = self.torch
        state = DeviceState(torch, torch.device("cuda", self.memory.device), list(self._optimizers))
        need = pinned.align_up(state.tensor_bytes() * 9 // 8, pinned.CHUNK_BYTES)
        if not need or need > self.pin_allowance:
            return
        try:
            self._kept = pinned.prepin(torch, need, rt=pinned.cudart(), device=self.memory.device)
        except (OSError, AttributeError, RuntimeError, MemoryError):  # no runtime, no memory: pause as before
            self._kept = None

    def _release(self) -> None:
        t = time.perf_counter()
        arena = self._restored._arena
        keep = arena is not None and arena.plan.total <= self.pin_allowance
        kept = self._restored.release(keep_arena=keep)
        if kept is not None:
            self._kept = kept
        self.last_timings["arena_kept"] = kept is not None
        for k in ("release_wait_s", "release_arena_s"):
            self.last_timings[k] = self._restored.timings.get(k)
        self._restored = None
        self.last_timings["release_s"] = time.perf_counter() - t
