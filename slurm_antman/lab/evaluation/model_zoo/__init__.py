"""Real PyTorch training loops for the workload model's ten profiles (``workloads.ZOO``).

``antman bench models`` runs these to measure the numbers docs/workload_model.md uses (peak memory
and FLOPs anywhere; SM utilisation, mini-batch time and pairwise slowdown on a GPU). Each profile is its paper's architecture, written here from the
papers' descriptions with nothing but ``torch`` (no torchvision, no Hugging Face), and trained the
standard way in fp32 on synthetic data made once in ``build()``, so ``step()`` is pure training: no
data loading, no host-to-device copies.

Every loop runs on ``cpu``, ``cuda`` and ``meta``. The meta device carries shapes and no data; the
memory tracer (``memory_trace.py``) runs a step there to count tensor bytes without a GPU, so on
meta the models run what CUDA would run, where the default path differs:

- CTC loss: ``aten::_ctc_loss_backward`` has no meta kernel in PyTorch 2.11-2.13;
  ``_ensure_ctc_meta_kernel`` registers a shape-only one.
- attention (``_attention``) and dropout (``_Dropout``): off CUDA they take unfused paths that keep
  more for backward (the full attention matrix; a float dropout mask); on meta they call the fused
  CUDA kernels' operators, which have meta kernels.
- GRU (``_gru_all_steps``): runs on meta but unrolled, at 45 s a DeepSpeech2 step; on meta the time
  steps are batched into one (same shapes, no values).

Parameter counts are checked against ``PUBLISHED_PARAMS_M`` by tests/test_model_zoo.py.
"""

from __future__ import annotations

from typing import Callable

import torch

from slurm_antman.lab.evaluation import workloads

from .language import (
    _build_bert, _build_gpt2, _build_lstm_lm, _build_transformer_nmt,
)
from .loop import TrainingLoop, _Data
from .params import PUBLISHED_PARAMS_M
from .speech_rl import _build_deepspeech2, _build_rl_ppo_atari
from .vision import (
    _build_cyclegan, _build_inception_v3, _build_resnet50, _build_vgg16,
)

# Private names re-exported for tests/test_model_zoo.py, which tests them as ``model_zoo._...``.
from .language import _Attention
from .loop import _Dropout
from .meta_kernels import (
    _ctc_loss_meta, _ensure_ctc_meta_kernel, _gru_all_steps,
)

__all__ = ["NAMES", "PUBLISHED_PARAMS_M", "TrainingLoop", "build"]

# name -> builder(data, batch) -> (model, optimizer, forward_backward, input_desc, clip_grad_norm)
_BUILDERS: dict[str, Callable] = {
    "resnet50": _build_resnet50,
    "vgg16": _build_vgg16,
    "inception_v3": _build_inception_v3,
    "bert_base_finetune": _build_bert,
    "gpt2_small": _build_gpt2,
    "lstm_lm": _build_lstm_lm,
    "transformer_nmt": _build_transformer_nmt,
    "deepspeech2": _build_deepspeech2,
    "rl_ppo_atari": _build_rl_ppo_atari,
    "cyclegan": _build_cyclegan,
}

# Inception's auxiliary head batch-normalises 1x1 maps: in training that needs 2 samples per channel.
_MIN_BATCH = {"inception_v3": 2}

NAMES: tuple[str, ...] = tuple(p.name for p in workloads.ZOO if p.name in _BUILDERS)


def build(name: str, device: str | torch.device = "cpu", batch: int | None = None,
          dtype: torch.dtype = torch.float32) -> TrainingLoop:
    """The training loop of profile ``name`` on ``device``, at ``batch`` (None: the profile's batch),
    its weights and float inputs in ``dtype``. The model is created directly on the device (no CPU
    copy of a 138 M-parameter VGG to move; nothing at all allocated on meta)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(NAMES)}")
    batch = workloads.BY_NAME[name].batch if batch is None else batch
    if batch < _MIN_BATCH.get(name, 1):
        raise ValueError(f"{name}: batch must be at least {_MIN_BATCH.get(name, 1)}, got {batch}")
    device = torch.device(device)
    data = _Data(device, dtype)
    with device:                      # every parameter and buffer created on the target device
        model, opt, forward_backward, desc, clip = _BUILDERS[name](data, batch)
    # The optimizers above hold the parameters themselves, so the in-place dtype cast keeps them valid.
    model.to(dtype=dtype).train()
    return TrainingLoop(name, model, opt, batch, desc, forward_backward, tuple(data.made), clip)
