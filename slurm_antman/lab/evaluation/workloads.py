"""The workload model: a small zoo of deep-learning training jobs, what each needs from a GPU, how it
slows when it shares one, and a deterministic assignment of a profile (and a utilisation) to every
trace job.

Every number is documented with its source in docs/workload_model.md; ``SOURCES`` holds the same
text so a report can print it.

Interference follows from each job's idle time. A profile's ``sm_util`` is how busy it keeps a GPU
as a benchmark runs it, and its ``kind`` names the job type whose slowdown beside each other job type
Gavel measured on one V100 (``published.GAVEL_V100_PAIRS``) as benchmarks, i.e. at full utilisation.
A job in a production cluster keeps the GPU busy only a fraction of that: its *duty*
``b = min(1, u / sm_util)`` for a production utilisation ``u`` (``utilisation.py`` draws ``u`` from
published production figures). Job i beside neighbours j, each running a ``share_j`` of the time
(1.0 uncontrolled; the compute share the local policy gives an opportunistic job, whose throttle keeps
it idle the rest of the time), takes

    slowdown_i = 1 + b_i * sum_j b_j * share_j * (1 + pi_ij)

times its solo mini-batch time. ``b_i * b_j * share_j`` is the fraction of i's time in which both
have work on the GPU (their busy periods overlap at random: neither knows the other's phase), and in
that time the pair time-slices (each gets half: 1) and pays a contention penalty ``pi_ij`` on top
(caches, memory bandwidth, context switches; negative where two kernels overlap better than a
time slice). The penalty is calibrated to Gavel's measured pairs at full utilisation (b = 1,
share = 1): ``pi_ij = measured_slowdown_ij - 2``, so two benchmark-busy jobs slow by exactly the
measured pair, and two that each keep the GPU 40 % of its benchmark busy mostly interleave
(1 + 0.16 (1 + pi)). An opportunistic job throttled to ``share`` progresses at
``share / slowdown`` of its solo rate.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .published import pair_slowdowns

GiB = 1 << 30

# (victim kind, neighbour kind) -> extra mini-batch time beside that neighbour running all the time,
# both at full utilisation: 1 + pi, the time slice plus the contention penalty (module doc). A pair
# measured as faster together than alone (noise) counts as no interference.
INTERFERENCE: Mapping[tuple[str, str], float] = {k: max(0.0, d - 1.0) for k, d in pair_slowdowns().items()}


def contention_penalty(victim_kind: str, neighbour_kind: str) -> float:
    """``pi``: what a measured pair costs beyond an even time slice (``measured - 2``)."""
    return INTERFERENCE[(victim_kind, neighbour_kind)] - 1.0


def pair_slowdown(victim_kind: str, neighbour_kind: str, duty_victim: float, duty_neighbour: float,
                  share_neighbour: float = 1.0) -> float:
    """The formula for one pair: what ``antman bench models --pairs-with`` checks on a GPU."""
    load = max(0.0, duty_neighbour) * max(0.0, share_neighbour)
    return 1.0 + max(0.0, duty_victim) * load * INTERFERENCE.get((victim_kind, neighbour_kind), 0.0)
KINDS = frozenset(k for k, _ in INTERFERENCE)

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
    kind: str                     # the measured job type its interference is taken from (module doc)
    weight: float                 # share of trace jobs given this profile

    def slowdown(self, neighbours: Iterable[tuple[str, float]], duty: float = 1.0) -> float:
        """Mini-batch time over the solo time beside ``neighbours``: (kind, load) of every other job
        on the GPU, its load being its duty times its compute share; ``duty`` is this job's own
        (module doc). With every duty 1 this is the measured pair beside one uncontrolled neighbour."""
        return 1.0 + max(0.0, duty) * sum(
            INTERFERENCE.get((self.kind, k), 0.0) * max(0.0, load) for k, load in neighbours)

    def duty(self, utilisation: float) -> float:
        """The fraction of its benchmark's GPU work a job does when it keeps the GPU ``utilisation``
        busy: its utilisation over the benchmark's, at most 1."""
        return min(1.0, max(0.0, utilisation) / self.sm_util)

    @property
    def mem_gib(self) -> float:
        return self.mem_bytes / GiB


def _p(name, domain, params, batch, mem_gib, util, iter_ms, kind, weight) -> Profile:
    return Profile(name, domain, params, batch, int(mem_gib * GiB), util, iter_ms, kind, weight)


# Where each number comes from (docs/workload_model.md has the table with every source):
# - params: the model as built in model_zoo (torchvision's and the papers' counts, tests/test_model_zoo.py);
# - mem: ``antman bench models --device meta``: the traced peak tensor bytes of a steady-state step
#   plus CUDA_CONTEXT_BYTES (a lower bound of what NVML shows: allocator cache and cuDNN workspaces
#   are not in it);
# - util: nvidia-smi GPU utilisation published in the Lucid artifact (profile itself or its nearest
#   relative there);
# - iter_ms: measured on a V100 (Gavel, DLPerf) where the same model was; otherwise the model's
#   traced FLOPs per step at the measured ResNet-50's (CNN, recurrent) or BERT's (transformer) rate;
# - kind: the Gavel job type whose measured pair slowdowns it takes (exact or nearest relative);
# - weight: the mix, an estimate.
ZOO: tuple[Profile, ...] = (
    _p("resnet50", "vision", 25.6, 32, 3.51, 1.00, 128.4, "R50_32", 0.18),
    _p("vgg16", "vision", 138.4, 32, 4.44, 1.00, 490.0, "R50_32", 0.08),
    _p("inception_v3", "vision", 27.2, 32, 3.90, 1.00, 181.0, "R50_32", 0.08),
    _p("bert_base_finetune", "nlp", 109.5, 32, 4.36, 0.997, 268.0, "T64", 0.12),
    _p("gpt2_small", "nlp", 124.4, 8, 11.42, 0.997, 890.0, "T64", 0.08),
    _p("lstm_lm", "nlp", 66.0, 64, 1.46, 0.97, 113.0, "LM80", 0.12),
    _p("transformer_nmt", "nlp", 63.1, 64, 4.62, 0.75, 116.0, "T64", 0.10),
    _p("deepspeech2", "speech", 41.2, 32, 6.46, 0.97, 713.0, "LM80", 0.08),
    _p("rl_ppo_atari", "rl", 1.7, 256, 0.82, 0.15, 139.4, "A3C", 0.08),
    _p("cyclegan", "vision", 28.3, 1, 3.10, 0.578, 225.9, "CG", 0.08),
)

BY_NAME: Mapping[str, Profile] = {p.name: p for p in ZOO}

SOURCES: Mapping[str, str] = {
    "params": "parameter counts: the models of evaluation/model_zoo/, which match torchvision's and the "
              "papers' published counts (tests/test_model_zoo.py)",
    "mem": "traced peak tensor bytes of a training step (`antman bench models --device meta`) plus a 781 MB "
           "CUDA context (pytorch/pytorch#34323)",
    "util": "nvidia-smi GPU utilisation from the Lucid artifact (S-Lab-System-Group/Lucid "
            "simulation/analyzer/single_data.csv @9b9ba894), the profile or its nearest relative",
    "iter_ms": "V100 FP32 measurements (Gavel oracle_throughputs_v2.json; DLPerf BERT-base) or traced FLOPs "
               "at a measured model's rate; docs/workload_model.md",
    "interference": "measured V100 pair slowdowns, " + "Gavel (published.GAVEL_SOURCE)",
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
        if p.iter_ms <= 0 or p.weight <= 0:
            out.append(f"{p.name}: iter_ms and weight must be positive")
        if p.kind not in KINDS:
            out.append(f"{p.name}: kind {p.kind!r} has no measured interference; known: {', '.join(sorted(KINDS))}")
    if len({p.name for p in zoo}) != len(zoo):
        out.append("profile names repeat")
    return out
