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

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from slurm_antman.evaluation import workloads

# Published (or, for models with no canonical release, config-derived) parameter counts in millions.
PUBLISHED_PARAMS_M: Mapping[str, float] = {
    # torchvision docs, ResNet50_Weights.IMAGENET1K_V1 "num_params" 25,557,032 (He et al. 2016, v1.5).
    "resnet50": 25.557032,
    # torchvision docs, VGG16_Weights.IMAGENET1K_V1 "num_params" 138,357,544 (Simonyan & Zisserman
    # 2015, Table 2: 138 M for configuration D).
    "vgg16": 138.357544,
    # torchvision docs, Inception_V3_Weights.IMAGENET1K_V1 "num_params" 27,161,264 (aux classifier
    # included). Szegedy et al. 2016 give no count.
    "inception_v3": 27.161264,
    # Devlin et al. 2019 say 110 M for BERT-base; the released config (vocab 30522, 512 positions,
    # 2 token types) gives 109,482,240 with the pooler, plus 1,538 for the 2-class head.
    "bert_base_finetune": 109.483778,
    # The released GPT-2 small checkpoint: 124,439,808 (Radford et al. 2019 Table 2 says 117 M).
    "gpt2_small": 124.439808,
    # Config-derived, Zaremba et al. 2014 "large": embedding 15.0 M + 2 LSTM layers 36.024 M +
    # decoder 15.01 M = 66,034,000; the 66 M commonly quoted for this model.
    "lstm_lm": 66.034,
    # Config-derived, Vaswani et al. 2017 base with one 37000 x 512 embedding shared by source, target
    # and output: embedding 18,944,000 + 6 encoder layers x 3,152,384 + 6 decoder layers x 4,204,032
    # = 63,082,496. The paper's Table 3 says 65 M (3 % more; it does not say how it counts).
    "transformer_nmt": 63.082496,
    # Config-derived from the configuration in _deepspeech2 (2 convs, 5 bi-GRU x 800 with summed
    # directions, 29 characters): convs 0.251 M + GRUs 40.906 M + BN and output 0.031 M = 41,187,904.
    # The DeepSpeech2 paper's models are larger; no canonical count exists for this size
    # (hidden 768 instead of 800 would give 38.2 M).
    "deepspeech2": 41.187904,
    # Config-derived: Nature-DQN CNN (Mnih et al. 2015) with PPO's policy (18 actions) and value
    # heads (Schulman et al. 2017): 1,693,875.
    "rl_ppo_atari": 1.693875,
    # Zhu et al. 2017 (official code prints 11.378 M per ResNet-9 generator and 2.765 M per PatchGAN
    # discriminator): 2 x 11,378,179 + 2 x 2,764,737 = 28,285,832.
    "cyclegan": 28.285832,
}


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


# ---------------------------------------------------------------------------------------------
# Vision: ResNet-50, VGG-16, Inception-v3


def _conv_bn(cin: int, cout: int, k: int | tuple[int, int], stride: int = 1,
             pad: int | tuple[int, int] | None = None, eps: float = 1e-5, relu: bool = True) -> nn.Sequential:
    """conv -> batch-norm (-> ReLU). No conv bias: the batch-norm's shift replaces it. ``pad`` None
    keeps the spatial size at stride 1 (k // 2 per dimension, so 1x7 pads (0, 3))."""
    k = (k, k) if isinstance(k, int) else k
    pad = (k[0] // 2, k[1] // 2) if pad is None else pad
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, pad, bias=False), nn.BatchNorm2d(cout, eps=eps)]
    return nn.Sequential(*layers, nn.ReLU(inplace=True)) if relu else nn.Sequential(*layers)


class _Bottleneck(nn.Module):
    """ResNet bottleneck: 1x1 reduce, 3x3, 1x1 expand (x4), plus the identity or a projection. v1.5
    puts the stride on the 3x3 (v1 had it on the first 1x1), as the torchvision/NVIDIA models do."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(_conv_bn(cin, width, 1), _conv_bn(width, width, 3, stride),
                                  _conv_bn(width, cout, 1, relu=False))
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout
                         else _conv_bn(cin, cout, 1, stride, pad=0, relu=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def _resnet50(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [_conv_bn(3, 64, 7, 2, 3), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    # (bottleneck width, blocks, stride of the stage's first block): He et al. 2016, Table 1.
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if i == 0 else 1))
            cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def _vgg16(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = []
    cin = 3
    # Configuration D (Simonyan & Zisserman 2015, Table 1): 13 3x3 convs, "M" a 2x2 max-pool.
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
            cin = v
    return nn.Sequential(
        *layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(),   # 7x7 at 224x224 already: the pool is a no-op there
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), _Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), _Dropout(0.5),
        nn.Linear(4096, classes))


class _Concat(nn.Module):
    """Branches side by side on one input, outputs stacked on the channel axis: every Inception
    module, and the 1x3 / 3x1 split inside the 8x8 ones."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], 1)


def _chain(cin: int, *specs) -> nn.Sequential:
    """A branch of Inception convs from compact specs: (cout, k[, stride, pad]), "avg" (3x3 stride-1
    average pool, the pooling branch) or "max" (3x3 stride-2 max pool, the grid reductions)."""
    layers: list[nn.Module] = []
    for s in specs:
        if s == "avg":
            layers.append(nn.AvgPool2d(3, 1, 1))
        elif s == "max":
            layers.append(nn.MaxPool2d(3, 2))
        else:
            cout, k, *rest = s
            layers.append(_conv_bn(cin, cout, k, *rest, eps=1e-3))   # eps 0.001 as the TF original
            cin = cout
    return nn.Sequential(*layers)


def _split(cin: int, cout: int) -> _Concat:
    # Fig. 7: a 3x3 factorised into parallel 1x3 and 3x1 whose outputs are concatenated (wider, not deeper).
    return _Concat(_chain(cin, (cout, (1, 3))), _chain(cin, (cout, (3, 1))))


def _inception_35(cin: int, pool: int) -> _Concat:   # Fig. 5: 5x5 kept as 5x5 in the first branch pair
    return _Concat(_chain(cin, (64, 1)), _chain(cin, (48, 1), (64, 5)),
                   _chain(cin, (64, 1), (96, 3), (96, 3)), _chain(cin, "avg", (pool, 1)))


def _inception_17(cin: int, c7: int) -> _Concat:     # Fig. 6: n x n factorised into 1x7 and 7x1
    return _Concat(_chain(cin, (192, 1)), _chain(cin, (c7, 1), (c7, (1, 7)), (192, (7, 1))),
                   _chain(cin, (c7, 1), (c7, (7, 1)), (c7, (1, 7)), (c7, (7, 1)), (192, (1, 7))),
                   _chain(cin, "avg", (192, 1)))


def _inception_8(cin: int) -> _Concat:               # Fig. 7: expanded filter banks
    return _Concat(_chain(cin, (320, 1)), nn.Sequential(_chain(cin, (384, 1)), _split(384, 384)),
                   nn.Sequential(_chain(cin, (448, 1), (384, 3)), _split(384, 384)),
                   _chain(cin, "avg", (192, 1)))


class _InceptionV3(nn.Module):
    """Szegedy et al. 2016 (Table 1) with the auxiliary classifier on the 17x17 grid. Grid reductions
    (Fig. 10) run a stride-2 conv branch beside a stride-2 max pool."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = _chain(3, (32, 3, 2, 0), (32, 3, 1, 0), (64, 3), "max", (80, 1), (192, 3, 1, 0), "max")
        self.to_17 = nn.Sequential(
            _inception_35(192, 32), _inception_35(256, 64), _inception_35(288, 64),
            _Concat(_chain(288, (384, 3, 2, 0)), _chain(288, (64, 1), (96, 3), (96, 3, 2, 0)), _chain(288, "max")),
            *(_inception_17(768, c7) for c7 in (128, 160, 160, 192)))
        self.aux = nn.Sequential(nn.AvgPool2d(5, 3), _chain(768, (128, 1), (768, 5, 1, 0)),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(768, classes))
        self.to_8 = nn.Sequential(
            _Concat(_chain(768, (192, 1), (320, 3, 2, 0)),
                    _chain(768, (192, 1), (192, (1, 7)), (192, (7, 1)), (192, 3, 2, 0)), _chain(768, "max")),
            _inception_8(1280), _inception_8(2048))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, classes))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.to_17(self.stem(x))
        aux = self.aux(x) if self.training else None
        return self.head(self.to_8(x)), aux


def _classifier_loop(d: _Data, model: nn.Module, opt: torch.optim.Optimizer, batch: int, size: int,
                     aux_weight: float = 0.0, smoothing: float = 0.0):
    images, labels = d.normal(batch, 3, size, size), d.ints(1000, batch)

    def loss() -> torch.Tensor:
        out = model(images)
        if isinstance(out, tuple):      # Inception: main and auxiliary logits
            main, aux = out
            return (F.cross_entropy(main, labels, label_smoothing=smoothing)
                    + aux_weight * F.cross_entropy(aux, labels, label_smoothing=smoothing))
        return F.cross_entropy(out, labels, label_smoothing=smoothing)
    return _backward(loss), f"3x{size}x{size} images, 1000 classes", None


def _build_resnet50(d: _Data, batch: int):
    model = _resnet50()
    # Goyal et al. 2017's ImageNet recipe: SGD momentum 0.9, lr 0.1 per 256 images, weight decay 1e-4.
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * batch / 256, momentum=0.9, weight_decay=1e-4)
    return model, opt, *_classifier_loop(d, model, opt, batch, 224)


def _build_vgg16(d: _Data, batch: int):
    model = _vgg16()
    # Simonyan & Zisserman sec. 3.1: SGD momentum 0.9, lr 0.01, weight decay 5e-4.
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    return model, opt, *_classifier_loop(d, model, opt, batch, 224)


def _build_inception_v3(d: _Data, batch: int):
    model = _InceptionV3()
    # Szegedy et al. sec. 8: RMSProp decay 0.9, eps 1.0, lr 0.045; label smoothing 0.1 (sec. 7).
    # Aux loss weight 0.4 as in the torchvision reference recipe (the paper gives none).
    opt = torch.optim.RMSprop(model.parameters(), lr=0.045, alpha=0.9, eps=1.0)
    return model, opt, *_classifier_loop(d, model, opt, batch, 299, aux_weight=0.4, smoothing=0.1)


# ---------------------------------------------------------------------------------------------
# Transformers: BERT-base, GPT-2 small, Transformer base (NMT)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, causal: bool) -> torch.Tensor:
    """Scaled dot-product attention over (batch, heads, length, head dim).

    On CUDA, SDPA runs a fused kernel that keeps only the output and one log-sum-exp per query for
    backward. Off CUDA (meta included) it falls back to its math path, which materialises the
    (length x length) scores, probabilities and dropout mask of every head: a meta trace of GPT-2
    at batch 8 would count a 24.6 GiB peak instead of 10.7. So on meta this calls the fused kernel
    SDPA picks for fp32 on CUDA (memory-efficient attention; flash needs fp16/bf16), which has a
    meta kernel."""
    if q.is_meta:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, grad, p, causal)[0]
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)


class _Attention(nn.Module):
    """Multi-head attention: queries from ``x``, keys and values from ``memory`` (``x`` itself for
    self-attention). The q and kv projections hold the same parameters as one (3d x d) in-projection."""

    def __init__(self, d: int, heads: int, dropout: float, causal: bool):
        super().__init__()
        self.heads, self.p, self.causal = heads, dropout, causal
        self.q, self.kv, self.out = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        mem = x if memory is None else memory
        (b, t, d), s, h = x.shape, mem.shape[1], self.heads
        q = self.q(x).view(b, t, h, d // h).transpose(1, 2)
        k, v = self.kv(mem).view(b, s, 2, h, d // h).permute(2, 0, 3, 1, 4)
        y = _attention(q, k, v, self.p if self.training else 0.0, self.causal)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    """One Transformer layer: self-attention, cross-attention over an encoder's output (``cross``,
    the NMT decoder) and a 2-layer MLP, each sub-layer with dropout on its output and a residual.
    ``pre_ln`` puts LayerNorm before each sub-layer (GPT-2) instead of after the residual add
    (post-LN: the original Transformer and BERT)."""

    def __init__(self, d: int, heads: int, ffn: int, act: nn.Module, *, pre_ln: bool, causal: bool,
                 eps: float, cross: bool = False, dropout: float = 0.1):
        super().__init__()
        self.pre_ln = pre_ln
        self.attn = _Attention(d, heads, dropout, causal)
        self.cross = _Attention(d, heads, dropout, False) if cross else None
        self.mlp = nn.Sequential(nn.Linear(d, ffn), act, nn.Linear(ffn, d))
        self.norms = nn.ModuleList(nn.LayerNorm(d, eps=eps) for _ in range(3 if cross else 2))
        self.drop = _Dropout(dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        subs = [self.attn] + ([lambda h: self.cross(h, memory)] if self.cross else []) + [self.mlp]
        for f, ln in zip(subs, self.norms):
            x = x + self.drop(f(ln(x))) if self.pre_ln else ln(x + self.drop(f(x)))
        return x


class _Bert(nn.Module):
    """BERT-base encoder (Devlin et al. 2019) with the pooler and a sentence-pair classification head."""

    def __init__(self, vocab=30522, positions=512, types=2, d=768, layers=12, heads=12, ffn=3072, classes=2):
        super().__init__()
        self.tok, self.pos, self.typ = nn.Embedding(vocab, d), nn.Embedding(positions, d), nn.Embedding(types, d)
        self.ln, self.drop = nn.LayerNorm(d, eps=1e-12), _Dropout(0.1)
        self.blocks = nn.Sequential(*(_Block(d, heads, ffn, nn.GELU(), pre_ln=False, causal=False, eps=1e-12)
                                      for _ in range(layers)))
        self.pooler = nn.Sequential(nn.Linear(d, d), nn.Tanh())   # on the [CLS] (first) token
        self.classifier = nn.Sequential(_Dropout(0.1), nn.Linear(d, classes))
        for e in (self.tok, self.pos, self.typ):
            nn.init.normal_(e.weight, std=0.02)                  # BERT's initializer_range

    def forward(self, tokens: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.blocks(self.drop(self.ln(self.tok(tokens) + self.pos(pos) + self.typ(types))))
        return self.classifier(self.pooler(h[:, 0]))


def _build_bert(d: _Data, batch: int, seq: int = 128):
    model = _Bert()
    # Fine-tuning (Devlin et al. sec. 4 / appendix A.3): Adam with decoupled weight decay 0.01, lr 2e-5.
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    tokens, labels = d.ints(30522, batch, seq), d.ints(2, batch)
    types = d.keep(torch.zeros_like(tokens))
    types[:, seq // 2:] = 1                                      # a sentence pair: second half is segment B
    return model, opt, _backward(lambda: F.cross_entropy(model(tokens, types), labels)), \
        f"seq {seq} tokens (sentence pairs), vocab 30522, 2 classes", None


class _GPT2(nn.Module):
    """GPT-2 small (Radford et al. 2019): pre-LN causal decoder (tanh-approximated GELU), a final
    LayerNorm, output projection tied to the token embedding."""

    def __init__(self, vocab=50257, positions=1024, d=768, layers=12, heads=12):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(vocab, d), nn.Embedding(positions, d), _Dropout(0.1)
        self.blocks = nn.Sequential(*(_Block(d, heads, 4 * d, nn.GELU("tanh"), pre_ln=True, causal=True, eps=1e-5)
                                      for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.ln_f(self.blocks(self.drop(self.wte(tokens) + self.wpe(pos))))
        return h @ self.wte.weight.t()                          # tied: logits against the embedding


def _build_gpt2(d: _Data, batch: int, seq: int = 1024):
    model = _GPT2()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = d.ints(50257, batch, seq + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]             # next-token prediction over the full 1024

    def loss() -> torch.Tensor:
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return model, opt, _backward(loss), f"seq {seq} tokens, vocab 50257", None


def _sinusoids(length: int, d: int) -> torch.Tensor:
    """Vaswani et al. sec. 3.5 positional encoding: sin on even, cos on odd dimensions."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(length, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return pe


class _Seq2Seq(nn.Module):
    """Transformer base (Vaswani et al. 2017): 6 post-LN encoder layers, 6 decoder layers (causal
    self-attention, then attention over the encoder's output), ReLU MLPs, one embedding shared by
    source, target and the output projection (sec. 3.4, a joint BPE vocabulary) scaled by
    sqrt(d_model), fixed sinusoidal positions, dropout 0.1 on embeddings and sub-layer outputs."""

    def __init__(self, vocab=37000, d=512, heads=8, layers=6, ffn=2048, max_len=1024):
        super().__init__()
        self.d = d
        self.embed = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed.weight, std=d ** -0.5)        # unit-scale after the sqrt(d) multiply
        self.register_buffer("pe", _sinusoids(max_len, d), persistent=False)
        self.drop = _Dropout(0.1)
        self.encoder = nn.ModuleList(_Block(d, heads, ffn, nn.ReLU(), pre_ln=False, causal=False, eps=1e-5)
                                     for _ in range(layers))
        self.decoder = nn.ModuleList(_Block(d, heads, ffn, nn.ReLU(), pre_ln=False, causal=True, eps=1e-5,
                                            cross=True) for _ in range(layers))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * math.sqrt(self.d) + self.pe[: tokens.shape[1]].to(self.embed.weight.dtype)
        return self.drop(x)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self._embed(src)
        for layer in self.encoder:
            memory = layer(memory)
        h = self._embed(tgt)
        for layer in self.decoder:
            h = layer(h, memory)
        return h @ self.embed.weight.t()


def _build_transformer_nmt(d: _Data, batch: int, src_len: int = 64, tgt_len: int = 64):
    model = _Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=7e-4, betas=(0.9, 0.98), eps=1e-9)   # sec. 5.3
    src, tgt = d.ints(37000, batch, src_len), d.ints(37000, batch, tgt_len + 1)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]                  # teacher forcing, shifted by one

    def loss() -> torch.Tensor:
        logits = model(src, tgt_in)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1), label_smoothing=0.1)
    return model, opt, _backward(loss), \
        f"{src_len} source + {tgt_len} target tokens per sentence, shared BPE vocab 37000", None


# ---------------------------------------------------------------------------------------------
# Recurrent: LSTM word LM, DeepSpeech2


class _WordLM(nn.Module):
    """Zaremba et al. 2014 "large": 2-layer LSTM, 1500 units, dropout 0.65 on non-recurrent
    connections, untied input embedding and softmax decoder."""

    def __init__(self, vocab=10000, hidden=1500, layers=2, dropout=0.65):
        super().__init__()
        self.embed, self.drop = nn.Embedding(vocab, hidden), _Dropout(dropout)
        self.lstm = nn.LSTM(hidden, hidden, layers, dropout=dropout)
        self.decoder = nn.Linear(hidden, vocab)
        for p in self.parameters():
            nn.init.uniform_(p, -0.04, 0.04)                      # the paper's initialisation for "large"

    def forward(self, tokens, state):                           # tokens (T, B)
        y, state = self.lstm(self.drop(self.embed(tokens)), state)
        return self.decoder(self.drop(y)), state


def _build_lstm_lm(d: _Data, batch: int, bptt: int = 35, hidden: int = 1500, layers: int = 2):
    model = _WordLM(hidden=hidden, layers=layers)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    tokens = d.ints(10000, bptt + 1, batch)
    inputs, targets = tokens[:-1], tokens[1:]
    zeros = torch.zeros(layers, batch, hidden, device=d.device, dtype=d.dtype)
    state = [(d.keep(zeros), d.keep(zeros.clone()))]

    def loss() -> torch.Tensor:
        # Truncated BPTT: the state carries over from the last step but gradients stop at its edge.
        logits, (h, c) = model(inputs, tuple(s.detach() for s in state[0]))
        state[0] = (h, c)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    # Zaremba et al.: plain SGD, lr 1, gradient norm clipped at 10.
    return model, opt, _backward(loss), f"bptt {bptt} tokens, vocab 10000", 10.0


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


class _DeepSpeech2(nn.Module):
    """DeepSpeech2-like (Amodei et al. 2016) at the size the open-source ports train: two 2-D convs
    over (frequency, time) with BN and clipped ReLU (hardtanh 0..20), five bidirectional GRUs of 800
    whose two directions are *summed* (half the next layer's input of concatenating, as in
    deepspeech.pytorch), sequence-wise BN on every GRU input but the first (paper sec. 3.2), and a
    BN + linear output to 29 characters (a-z, space, apostrophe, CTC blank)."""

    def __init__(self, bins=161, hidden=800, layers=5, classes=29, channels=32):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, (41, 11), (2, 2), (20, 5), bias=False), nn.BatchNorm2d(channels),
            nn.Hardtanh(0, 20, inplace=True),
            nn.Conv2d(channels, channels, (21, 11), (2, 1), (10, 5), bias=False), nn.BatchNorm2d(channels),
            nn.Hardtanh(0, 20, inplace=True))
        freq = ((bins + 2 * 20 - 41) // 2 + 1 + 2 * 10 - 21) // 2 + 1   # 161 bins -> 81 -> 41
        self.rnns = nn.ModuleList(nn.GRU(channels * freq if i == 0 else hidden, hidden, bidirectional=True)
                                  for i in range(layers))
        self.norms = nn.ModuleList(nn.BatchNorm1d(hidden) for _ in range(layers - 1))
        self.out = nn.Sequential(nn.BatchNorm1d(hidden), nn.Linear(hidden, classes, bias=False))

    @staticmethod
    def _seqwise(f: nn.Module, x: torch.Tensor) -> torch.Tensor:
        t, b, _ = x.shape                                       # BN/linear over every (time, utterance)
        return f(x.reshape(t * b, -1)).view(t, b, -1)

    def forward(self, spec: torch.Tensor) -> torch.Tensor:     # spec (B, 1, bins, frames)
        x = self.conv(spec)
        b, c, f, t = x.shape
        x = x.reshape(b, c * f, t).permute(2, 0, 1)             # (T', B, features)
        for i, rnn in enumerate(self.rnns):
            if i:
                x = self._seqwise(self.norms[i - 1], x)
            y = _gru_all_steps(rnn, x) if x.device.type == "meta" else rnn(x)[0]
            x = y.view(t, b, 2, -1).sum(2)                      # forward + backward direction
        return self._seqwise(self.out, x)                       # (T', B, classes)


def _build_deepspeech2(d: _Data, batch: int, frames: int = 1000, target_len: int = 100):
    _ensure_ctc_meta_kernel()
    model = _DeepSpeech2()
    # deepspeech.pytorch's recipe: SGD, Nesterov momentum 0.9, gradient norm clipped at 400.
    opt = torch.optim.SGD(model.parameters(), lr=3e-4, momentum=0.9, nesterov=True)
    spec = d.normal(batch, 1, 161, frames)
    targets = d.ints(29, batch, target_len, low=1)              # 0 is the blank
    out_frames = (frames + 2 * 5 - 11) // 2 + 1                 # the first conv's time stride 2
    in_lens, tgt_lens = [out_frames] * batch, [target_len] * batch   # lists: see _ensure_ctc_meta_kernel

    def loss() -> torch.Tensor:
        # CTC in fp32 whatever the model dtype (the CPU/CUDA kernels take float and double only).
        log_probs = model(spec).float().log_softmax(-1)
        return F.ctc_loss(log_probs, targets, in_lens, tgt_lens, blank=0, zero_infinity=True)
    return model, opt, _backward(loss), \
        f"161-bin spectrogram x {frames} frames (~{frames // 100} s), {target_len} target chars of 29", 400.0


# ---------------------------------------------------------------------------------------------
# RL: PPO learner on Atari; GAN: CycleGAN


class _NatureCNN(nn.Module):
    """Mnih et al. 2015's Atari network, shared trunk of PPO's policy (18 actions) and value heads."""

    def __init__(self, actions: int = 18):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU())
        self.policy, self.value = nn.Linear(512, actions), nn.Linear(512, 1)

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(frames.to(self.value.weight.dtype) / 255.0)   # frames stay uint8 until here
        return self.policy(h), self.value(h).squeeze(-1)


def _build_rl_ppo_atari(d: _Data, batch: int, actions: int = 18, clip: float = 0.1):
    model = _NatureCNN(actions)
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5)   # Schulman et al. 2017, Table 5
    frames = d.ints(256, batch, 4, 84, 84, dtype=torch.uint8)
    acts = d.ints(actions, batch)
    # Synthetic rollout statistics: advantages already normalised, old policy near uniform.
    adv, returns = d.normal(batch), d.normal(batch)
    old_logp = d.uniform(batch, low=-math.log(actions) - 0.5, high=-math.log(actions) + 0.5)

    def loss() -> torch.Tensor:
        logits, value = model(frames)
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(1, acts[:, None]).squeeze(1)
        ratio = torch.exp(logp - old_logp)
        surrogate = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
        value_loss = F.mse_loss(value, returns)
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        return surrogate + 0.5 * value_loss - 0.01 * entropy     # c1 0.5, c2 0.01 (Table 5)
    # The Atari PPO baselines clip the gradient norm at 0.5.
    return model, opt, _backward(loss), f"4x84x84 uint8 frames, {actions} actions", 0.5


class _ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c), nn.ReLU(True),
                                  nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _generator(ngf: int = 64, blocks: int = 9) -> nn.Sequential:
    """Zhu et al. 2017 appendix 7.2 (after Johnson et al. 2016): c7s1-64, d128, d256, 9 x R256, u128,
    u64, c7s1-3. Instance norm has no affine parameters, so the convs keep their bias; reflection
    padding avoids border artefacts."""
    layers: list[nn.Module] = [nn.ReflectionPad2d(3), nn.Conv2d(3, ngf, 7), nn.InstanceNorm2d(ngf), nn.ReLU(True)]
    c = ngf
    for _ in range(2):
        layers += [nn.Conv2d(c, 2 * c, 3, 2, 1), nn.InstanceNorm2d(2 * c), nn.ReLU(True)]
        c *= 2
    layers += [_ResBlock(c) for _ in range(blocks)]
    for _ in range(2):
        layers += [nn.ConvTranspose2d(c, c // 2, 3, 2, 1, output_padding=1), nn.InstanceNorm2d(c // 2),
                   nn.ReLU(True)]
        c //= 2
    return nn.Sequential(*layers, nn.ReflectionPad2d(3), nn.Conv2d(c, 3, 7), nn.Tanh())


def _patch_discriminator(ndf: int = 64) -> nn.Sequential:
    """70x70 PatchGAN: C64 (no norm), C128, C256, C512 (stride 1), then a 1-channel map of patch
    real/fake scores. 4x4 convs, LeakyReLU 0.2."""
    layers: list[nn.Module] = [nn.Conv2d(3, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True)]
    c = ndf
    for stride in (2, 2, 1):
        layers += [nn.Conv2d(c, 2 * c, 4, stride, 1), nn.InstanceNorm2d(2 * c), nn.LeakyReLU(0.2, True)]
        c *= 2
    return nn.Sequential(*layers, nn.Conv2d(c, 1, 4, 1, 1))


def _build_cyclegan(d: _Data, batch: int, size: int = 256, lam_cycle: float = 10.0, lam_idt: float = 0.5):
    nets = nn.ModuleDict({"G_ab": _generator(), "G_ba": _generator(),
                          "D_a": _patch_discriminator(), "D_b": _patch_discriminator()})
    g_ab, g_ba, d_a, d_b = nets["G_ab"], nets["G_ba"], nets["D_a"], nets["D_b"]
    # One Adam over all four nets (lr 2e-4, beta1 0.5, sec. 4). The official code steps a generator
    # optimizer, then a discriminator one; a single step after both backwards is the same update:
    # the discriminator loss sees the fakes detached and the discriminators' own weights, neither of
    # which the generator step changes. (The official 50-image history pool of fakes is left out:
    # it changes which fake D sees, not the work or the memory of a step.)
    opt = torch.optim.Adam(nets.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real_a, real_b = d.uniform(batch, 3, size, size), d.uniform(batch, 3, size, size)

    def lsgan(pred: torch.Tensor, real: bool) -> torch.Tensor:   # least-squares GAN loss (sec. 4)
        return F.mse_loss(pred, torch.ones_like(pred) if real else torch.zeros_like(pred))

    def forward_backward() -> torch.Tensor:
        fake_b, fake_a = g_ab(real_a), g_ba(real_b)
        rec_a, rec_b = g_ba(fake_b), g_ab(fake_a)
        idt_b, idt_a = g_ab(real_b), g_ba(real_a)               # identity loss (sec. 5.2): lam_idt * lam_cycle
        # Generators: the discriminators judge but are not trained by this loss.
        d_a.requires_grad_(False)
        d_b.requires_grad_(False)
        loss_g = (lsgan(d_b(fake_b), True) + lsgan(d_a(fake_a), True)
                  + lam_cycle * (F.l1_loss(rec_a, real_a) + F.l1_loss(rec_b, real_b))
                  + lam_cycle * lam_idt * (F.l1_loss(idt_b, real_b) + F.l1_loss(idt_a, real_a)))
        loss_g.backward()
        d_a.requires_grad_(True)
        d_b.requires_grad_(True)
        # Discriminators: real vs the (detached) fakes, halved to slow D relative to G (sec. 7.1).
        loss_d = 0.5 * (lsgan(d_a(real_a), True) + lsgan(d_a(fake_a.detach()), False)
                        + lsgan(d_b(real_b), True) + lsgan(d_b(fake_b.detach()), False))
        loss_d.backward()
        return loss_g.detach() + loss_d.detach()
    return nets, opt, forward_backward, f"3x{size}x{size} unpaired images, domains A and B", None


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
