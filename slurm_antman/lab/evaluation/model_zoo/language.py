"""Language workloads: the Transformers (BERT-base, GPT-2 small, Transformer base NMT) with their
shared attention and layer, and the LSTM word language model."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .loop import _backward, _Data, _Dropout


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
# Recurrent: LSTM word LM


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
