"""The training loop every model is built into (``TrainingLoop``), its synthetic data (``_Data``)
and the helpers models share: the one-loss backward and the meta-aware ``_Dropout``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class TrainingLoop:
    """One model with its optimizer and pre-made synthetic mini-batch; ``step()`` trains once."""

    name: str
    model: nn.Module                      # every sub-network (CycleGAN: its four nets in a ModuleDict)
    optimizer: torch.optim.Optimizer
    batch: int
    input_desc: str
    forward_backward: Callable[[], torch.Tensor] = field(repr=False)  # forward, loss, backward -> loss
    inputs: tuple[torch.Tensor, ...] = field(default=(), repr=False)  # the synthetic batch (and targets)
    clip_grad_norm: float | None = None   # the recipe's gradient clipping, where it has one
    last_loss: torch.Tensor | None = field(default=None, repr=False)  # detached; 0-dim

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward()
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        self.optimizer.step()
        self.last_loss = loss.detach()

    def param_count(self) -> int:
        # parameters() yields a shared (tied) weight once, so GPT-2's and the NMT model's tied
        # embeddings count once, as their papers count them.
        return sum(p.numel() for p in self.model.parameters())


class _Data:
    """Synthetic inputs, made once: random from a seeded CPU generator and then moved (the same data
    on every device), or bare shapes on meta, where there is no data to make. ``made`` lists them
    all: the loop's ``inputs``, which stay alive between steps (the memory tracer counts them)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int = 0):
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.made: list[torch.Tensor] = []

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        self.made.append(t)
        return t

    def _put(self, make: Callable[[], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "meta":
            return self.keep(torch.empty(shape, dtype=dtype, device="meta"))
        return self.keep(make().to(device=self.device, dtype=dtype))

    def normal(self, *shape: int) -> torch.Tensor:
        return self._put(lambda: torch.randn(shape, generator=self.gen, device="cpu"), shape, self.dtype)

    def uniform(self, *shape: int, low: float = -1.0, high: float = 1.0) -> torch.Tensor:
        return self._put(lambda: torch.rand(shape, generator=self.gen, device="cpu") * (high - low) + low,
                         shape, self.dtype)

    def ints(self, high: int, *shape: int, low: int = 0, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return self._put(lambda: torch.randint(low, high, shape, generator=self.gen, device="cpu"), shape, dtype)


def _backward(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The usual forward_backward: one loss, one backward."""
    def run() -> torch.Tensor:
        loss = loss_fn()
        loss.backward()
        return loss
    return run


class _Dropout(nn.Dropout):
    """nn.Dropout that, on meta, runs the kernel CUDA runs. On CUDA dropout is one fused kernel that
    keeps a 1-byte mask per element for backward; elsewhere (meta included) it keeps a mask in the
    input's dtype, 4 bytes in fp32, which a meta memory trace would count instead."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta and self.training and 0.0 < self.p < 1.0:
            return torch.ops.aten.native_dropout(x, self.p, True)[0]
        return super().forward(x)
