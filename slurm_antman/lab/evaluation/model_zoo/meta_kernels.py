"""Meta-device support for DeepSpeech2: shape-only CTC loss kernels (registered where PyTorch has
none) and the batched GRU path that stands in for the unrolled one on meta."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _ctc_loss_meta(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    # The real kernels return the per-utterance loss and the forward variables log_alpha, which they
    # keep for backward: (batch, input frames, 2 * longest target + 1), the blank-interleaved target.
    t, b, _ = log_probs.shape
    return (log_probs.new_empty(b),
            log_probs.new_empty(b, t, 2 * max(target_lengths, default=0) + 1))


def _ctc_loss_backward_meta(grad, log_probs, targets, input_lengths, target_lengths,
                            neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    # The real kernels return the gradient w.r.t. log_probs: same shape, dtype and layout.
    return torch.empty_like(log_probs)


_CTC_META_LIB: torch.library.Library | None = None


def _has_meta_kernel(op: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta")
    except (AttributeError, RuntimeError):    # private API: if it goes, assume missing and register
        return False


def _ensure_ctc_meta_kernel() -> None:
    """Give the CTC loss's operators meta kernels where PyTorch has none. PyTorch 2.11-2.13 have one
    for the forward ``aten::_ctc_loss`` (integer-list lengths; the ``.Tensor`` overload, taking
    lengths as tensors, has none, which is why the loss is called with Python lists) and none for
    ``aten::_ctc_loss_backward``. Shape-only kernels are exact for the memory tracer: the real ones
    return exactly these tensors; only the backward's transient workspace (log_beta) goes unseen.
    Registered once, on first use, and only where missing, so a PyTorch that ships its own keeps it."""
    global _CTC_META_LIB
    if _CTC_META_LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")                   # kept alive: dropping it unregisters
    for op, fn in (("_ctc_loss", _ctc_loss_meta), ("_ctc_loss_backward", _ctc_loss_backward_meta)):
        if not _has_meta_kernel(f"aten::{op}"):
            lib.impl(op, fn, "Meta")
    _CTC_META_LIB = lib


def _gru_all_steps(rnn: nn.GRU, x: torch.Tensor) -> torch.Tensor:
    """A one-layer (bi)GRU on the meta device, all time steps as one batched step.

    nn.GRU runs on meta, but off CUDA it unrolls into ~40 small ops per time step and direction,
    and each meta op costs ~0.2 ms in Python: a DeepSpeech2 step (500 steps x 5 layers x 2
    directions) took 45 s. Meta has no data, so only shapes matter: this evaluates the GRU cell's
    equations (Cho et al. 2014, PyTorch's gate layout r, z, n) once on (T, B, .) tensors with a zero
    stand-in for h_{t-1}. Same parameters, output shape and gradients' shapes, and the same
    activations saved for backward as the unrolled loop keeps (T per-step (B, 3H) / (B, H) tensors
    become one (T, B, 3H) / (T, B, H) tensor). Its values would be wrong, hence meta only."""
    t, b, _ = x.shape
    outs = []
    for sfx in ("", "_reverse")[: 1 + rnn.bidirectional]:
        w_ih, w_hh = getattr(rnn, "weight_ih_l0" + sfx), getattr(rnn, "weight_hh_l0" + sfx)
        b_ih, b_hh = getattr(rnn, "bias_ih_l0" + sfx), getattr(rnn, "bias_hh_l0" + sfx)
        h_prev = x.new_zeros(t, b, rnn.hidden_size)
        i_r, i_z, i_n = F.linear(x, w_ih, b_ih).chunk(3, -1)
        h_r, h_z, h_n = F.linear(h_prev, w_hh, b_hh).chunk(3, -1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        outs.append((1 - z) * n + z * h_prev)
    return torch.cat(outs, -1)
