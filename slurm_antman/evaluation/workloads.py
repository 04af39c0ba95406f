"""The workload model: a small zoo of deep-learning training jobs, what each needs from a GPU, how it
slows when it shares one, and a deterministic assignment of a profile to every trace job.

Every number is documented with its source in docs/workload_model.md; ``SOURCES`` holds the same
text so a report can print it. Numbers not taken from a publication are marked as estimates there,
with the command that is to measure them on a GPU.

Interference (why a formula and not a table of pairs): a trace mixes ten models into a hundred
pairs, and published pairwise measurements cover a handful. A job's GPU time is time-sliced with its
neighbours, so its mini-batch stretches in proportion to how busy the neighbours keep the GPU:

    slowdown_i = 1 + sensitivity_i * sum_j (util_j * share_j)

``util_j`` is neighbour j's solo SM utilisation and ``share_j`` its compute share (1.0 uncontrolled;
the compute share the local policy gives an opportunistic job under AntMan, whose throttle holds the
job's busy/(busy+idle) ratio at the share, so its GPU duty falls by that factor). Two jobs that each
keep the GPU fully busy (util 1, sensitivity 1) both run at half speed, as time-slicing predicts.
An opportunistic job throttled to ``share`` progresses at ``share / slowdown`` of its solo rate.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

GiB = 1 << 30

# Smallest GPU the zoo must fit on: a 16 GB V100 (Philly's and PAI's clusters had 12-32 GB GPUs; the
# largest footprint here stays under 16 GiB so every profile runs anywhere a trace job ran).
MIN_GPU_MEMORY_BYTES = 16 * GiB


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    domain: str
    params_millions: float        # published parameter count
    batch: int                    # per-GPU mini-batch the numbers below assume
    mem_bytes: int                # peak GPU memory per GPU (weights, grads, optimizer, activations, context)
    sm_util: float                # solo SM utilisation, 0..1, averaged over the run (input stalls included)
    iter_ms: float                # solo mini-batch time on a V100-class GPU
    sensitivity: float            # how much a busy neighbour stretches this job's mini-batch (see module doc)
    weight: float                 # share of trace jobs given this profile

    def slowdown(self, neighbour_load: float) -> float:
        """Mini-batch time over the solo time, with neighbours keeping the GPU ``neighbour_load`` busy
        (sum of their util * share)."""
        return 1.0 + self.sensitivity * max(0.0, neighbour_load)

    @property
    def mem_gib(self) -> float:
        return self.mem_bytes / GiB


def _p(name, domain, params, batch, mem_gib, util, iter_ms, sens, weight) -> Profile:
    return Profile(name, domain, params, batch, int(mem_gib * GiB), util, iter_ms, sens, weight)


# Parameter counts are published (see SOURCES); the per-job resource numbers are estimates (see
# docs/workload_model.md for each one's reasoning and the command that will measure it).
ZOO: tuple[Profile, ...] = (
    _p("resnet50", "vision", 25.6, 32, 6.0, 0.80, 110.0, 0.9, 0.18),
    _p("vgg16", "vision", 138.4, 32, 8.5, 0.85, 180.0, 1.0, 0.08),
    _p("inception_v3", "vision", 27.2, 32, 7.0, 0.75, 150.0, 0.9, 0.08),
    _p("bert_base_finetune", "nlp", 110.0, 32, 9.0, 0.70, 250.0, 0.8, 0.12),
    _p("gpt2_small", "nlp", 124.0, 8, 12.0, 0.80, 300.0, 0.9, 0.08),
    _p("lstm_lm", "nlp", 66.0, 64, 3.0, 0.45, 60.0, 0.6, 0.12),
    _p("transformer_nmt", "nlp", 65.0, 64, 8.0, 0.65, 200.0, 0.8, 0.10),
    _p("deepspeech2", "speech", 38.0, 32, 7.5, 0.55, 400.0, 0.7, 0.08),
    _p("rl_ppo_atari", "rl", 1.7, 256, 1.5, 0.20, 30.0, 0.4, 0.08),
    _p("cyclegan", "vision", 28.3, 1, 4.0, 0.60, 250.0, 0.8, 0.08),
)

BY_NAME: Mapping[str, Profile] = {p.name: p for p in ZOO}

SOURCES: Mapping[str, str] = {
    "params": "parameter counts: torchvision model docs (resnet50 25.6M, vgg16 138.4M, inception_v3 27.2M), "
              "Devlin et al. NAACL'19 (BERT-base 110M), Radford et al. 2019 (GPT-2 small, 124M as released), "
              "Vaswani et al. NeurIPS'17 Table 3 (Transformer base 65M)",
    "estimates": "mem_bytes, sm_util, iter_ms, sensitivity: estimates (docs/workload_model.md gives the "
                 "reasoning for each), to be measured on a GPU with `antman bench models` (not written yet)",
    "mix": "mix weights: estimate; docs/workload_model.md",
}


def _unit_hash(job_id: str, seed: int) -> float:
    """A uniform number in [0, 1) from the job id: the same job gets the same profile in every run
    and every policy, which a side-by-side comparison needs."""
    h = hashlib.blake2b(f"{seed}:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0 ** 64


def assign(job_id: str, seed: int = 0, zoo: Sequence[Profile] = ZOO) -> Profile:
    u = _unit_hash(job_id, seed) * sum(p.weight for p in zoo)
    acc = 0.0
    for p in zoo:
        acc += p.weight
        if u < acc:
            return p
    return zoo[-1]


def mean_util(zoo: Sequence[Profile] = ZOO) -> float:
    """Mix-weighted solo utilisation: the expected load of a random neighbour."""
    return sum(p.weight * p.sm_util for p in zoo) / sum(p.weight for p in zoo)


def validate(zoo: Sequence[Profile] = ZOO, gpu_memory_bytes: int = MIN_GPU_MEMORY_BYTES) -> list[str]:
    """Problems with a zoo (empty when it is sound): the invariants the simulator relies on."""
    out: list[str] = []
    for p in zoo:
        if not 0 < p.mem_bytes <= gpu_memory_bytes:
            out.append(f"{p.name}: memory {p.mem_gib:.1f} GiB does not fit a {gpu_memory_bytes / GiB:g} GiB GPU")
        if not 0.0 < p.sm_util <= 1.0:
            out.append(f"{p.name}: sm_util {p.sm_util} outside (0, 1]")
        if p.iter_ms <= 0 or p.sensitivity < 0 or p.weight <= 0:
            out.append(f"{p.name}: iter_ms, sensitivity and weight must be positive")
    if len({p.name for p in zoo}) != len(zoo):
        out.append("profile names repeat")
    return out
