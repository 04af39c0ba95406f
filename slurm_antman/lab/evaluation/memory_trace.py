"""Peak tensor memory of a training step, measured without a GPU.

A training step's GPU footprint is mostly the bytes of the tensors alive at its worst moment:
weights, gradients, optimizer state and the activations autograd keeps for the backward pass. Those
are properties of the model, the batch and the optimizer, not of the GPU, so they can be counted by
running the step on PyTorch's ``meta`` device (shapes and dtypes, no data, no arithmetic) under a
dispatch mode that sees every tensor each operator returns. What this does not see is what only a
real GPU has: the CUDA context and kernel images, cuDNN/cuBLAS workspaces and the caching
allocator's unused cached blocks. ``antman bench models --device cuda`` measures those on a GPU.

Counting is by storage, not by tensor: views share their base's storage and cost nothing. A storage
is counted from the first operator that returns it until PyTorch frees it (a weak reference that
expires), which is what the CUDA caching allocator's ``allocated`` statistic counts; like it, each
storage is rounded up to the allocator's 512-byte granule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The CUDA caching allocator hands out blocks in multiples of 512 bytes (kMinBlockSize), and its
# allocated-bytes statistic counts the rounded size.
ALLOCATOR_GRANULE = 512


def _rounded(nbytes: int, granule: int) -> int:
    return -(-nbytes // granule) * granule if granule > 1 else nbytes


class LiveStorages(TorchDispatchMode):
    """Bytes of live tensor storages, current and peak, while the mode is active."""

    def __init__(self, granule: int = ALLOCATOR_GRANULE) -> None:
        super().__init__()
        self.granule = granule
        self._live: dict[StorageWeakRef, int] = {}
        self.current = 0
        self.peak = 0

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Counts tensors made before the mode was entered (the model's weights, the batch)."""
        for t in tensors:
            self._track(t)
        self.peak = max(self.peak, self.current)

    def sweep(self) -> None:
        """Forgets storages PyTorch has freed."""
        dead = [k for k in self._live if k.expired()]
        for k in dead:
            self.current -= self._live.pop(k)

    def reset_peak(self) -> None:
        self.sweep()
        self.peak = self.current

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        if key not in self._live:
            n = _rounded(storage.nbytes(), self.granule)
            self._live[key] = n
            self.current += n

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Frees happen between operators; sweeping before counting the outputs means a buffer freed
        # by this operator's inputs going away is not double-counted with its outputs.
        self.sweep()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        if self.current > self.peak:
            self.peak = self.current
        return out


@dataclass(frozen=True)
class StepMemory:
    weights_bytes: int        # parameters and buffers
    steady_bytes: int         # alive between steps: weights, optimizer state, the batch
    peak_bytes: int           # the worst moment of a steady-state step

    def as_dict(self) -> dict:
        return {"weights_bytes": self.weights_bytes, "steady_bytes": self.steady_bytes,
                "peak_bytes": self.peak_bytes}


def trace_step(model: torch.nn.Module, inputs: Iterable[torch.Tensor], step: Callable[[], None],
               warmup_steps: int = 1, granule: int = ALLOCATOR_GRANULE) -> StepMemory:
    """Peak live tensor bytes of ``step()`` once warmed up.

    The first step creates the optimizer's state, so the peak is taken over the step after
    ``warmup_steps`` (the steady state a long job lives in), not over the first one.
    """
    if warmup_steps < 1:
        raise ValueError("warmup_steps must be at least 1: the first step creates the optimizer state")
    mode = LiveStorages(granule)
    weights = [*model.parameters(), *model.buffers()]
    mode.adopt(weights)
    weights_bytes = mode.current
    mode.adopt(inputs)
    with mode:
        for _ in range(warmup_steps):
            step()
        mode.reset_peak()
        step()
        mode.sweep()
    return StepMemory(weights_bytes=weights_bytes, steady_bytes=mode.current, peak_bytes=mode.peak)
