"""Pause in place (issue 16, after PipeSwitch, OSDI'20): move a job's GPU state to pinned host memory
and free the device, then bring it back, overlapping the copy back with the first iterations.

What moves: every parameter (and its gradient) and buffer of the job's ``nn.Module`` objects that
live on the device, and every tensor in the state of the optimizers the agent has seen step. Tensors
are swapped in place (``param.data``, ``module._buffers``, ``optimizer.state``), so the training
script's references stay valid and it continues as if nothing happened.

Back in, the copies run on a side stream in the modules' order, one CUDA event per module; a
one-shot forward pre-hook makes the compute stream wait only for that module's event, so the first
layers compute while later ones are still copying (PipeSwitch's layer pipelining), and a one-shot
optimizer pre-hook waits for everything before the first ``step()``.

On CPU there is no device memory: with memory emulation (trace replays) the emulated footprint is
what is freed and restored, so the protocol and the policy run end to end without a GPU.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional


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


def _device_modules(torch: Any, device: Any) -> list[Any]:
    """The job's top-level modules with state on ``device`` (found through the garbage collector:
    the agent never sees the model being built), each once, children with their root."""
    mods = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    children = {id(c) for m in mods for c in m.children()}
    roots = [m for m in mods if id(m) not in children]
    out = []
    for m in roots:
        tensors = list(m.parameters(recurse=True)) + list(m.buffers(recurse=True))
        if any(t.device == device for t in tensors):
            out.append(m)
    return out


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

    def _to_host(self, t: Any) -> Any:
        host = self.torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        self.bytes_moved += t.numel() * t.element_size()
        return host

    def offload(self) -> int:
        """Everything to pinned host memory; returns the bytes moved. The device memory is freed by
        the caller's ``empty_cache`` once the references here are gone."""
        torch = self.torch
        self.bytes_moved = 0
        seen: set[int] = set()
        for root in _device_modules(torch, self.device):
            for mod in root.modules():
                moved = _Moved(mod)
                for name, p in list(mod._parameters.items()):
                    if p is None or id(p) in seen or p.device != self.device:
                        continue
                    seen.add(id(p))
                    moved.slots.append(("param", p, name))
                    moved.hosts.append(self._to_host(p.data))
                    if p.grad is not None:
                        moved.slots.append(("grad", p, name))
                        moved.hosts.append(self._to_host(p.grad))
                for name, b in list(mod._buffers.items()):
                    if b is None or b.device != self.device:
                        continue
                    moved.slots.append(("buffer", mod, name))
                    moved.hosts.append(self._to_host(b))
                if moved.slots:
                    self._moved.append(moved)
        for opt in self.optimizers:
            for st in opt.state.values():
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and v.device == self.device:
                        self._opt_moved.append((st, k, self._to_host(v)))
        torch.cuda.synchronize(self.device)
        # Only now, with every copy done, drop the device tensors.
        for moved in self._moved:
            for slot, host in zip(moved.slots, moved.hosts):
                _put(slot, host)
        for st, k, host in self._opt_moved:
            st[k] = host
        return self.bytes_moved

    def restore(self) -> None:
        """Copies back on a side stream, module by module; the compute stream waits per module."""
        torch = self.torch
        side = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        side.wait_stream(compute)
        last = None
        with torch.cuda.stream(side):
            for moved in self._moved:
                for slot, host in zip(moved.slots, moved.hosts):
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

    def release(self) -> None:
        """Drop the hooks and, once the copies are done, the host copies."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._keep and self._last is not None:
            self._last.synchronize()
        self._keep = []


class Pauser:
    """The agent's side of pause/resume: what to move and how much it freed."""

    def __init__(self, torch: Any, memory: Any):
        self.torch = torch
        self.memory = memory
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._state: Optional[DeviceState] = None
        self._restored: Optional[DeviceState] = None  # its hooks live until the first step after resume
        self._emulated: Optional[int] = None

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
        before = torch.cuda.memory_reserved(mem.device)
        self._state = DeviceState(torch, torch.device("cuda", mem.device), list(self._optimizers))
        moved = self._state.offload()
        gc.collect()
        torch.cuda.empty_cache()
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
        """At each iteration boundary: once the first step after a resume has run, drop its hooks."""
        if self._restored is not None and self._restored.stepped:
            self._restored.release()
            self._restored = None
