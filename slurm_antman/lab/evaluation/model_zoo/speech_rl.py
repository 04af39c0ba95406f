"""Speech and RL workloads: DeepSpeech2 (bi-GRU, CTC loss) and the PPO learner on Atari."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .loop import _backward, _Data
from .meta_kernels import _ensure_ctc_meta_kernel, _gru_all_steps


# ---------------------------------------------------------------------------------------------
# Recurrent: DeepSpeech2


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
# RL: PPO learner on Atari


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
