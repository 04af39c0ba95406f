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
published production figures). Job i beside neighbours j, each with work on the GPU a fraction
``x_j = b_j * share_j`` of the time (``share_j`` 1.0 uncontrolled; the compute share the local policy
gives an opportunistic job, whose throttle keeps it idle the rest of the time), at random phases
(neither knows the other's), takes

    slowdown_i = 1 - b_i + b_i / rate_i,    rate_i = E[ 1 / (1 + sum over the active j of e_ij) ]

times its solo mini-batch time: its host time (1 - b_i) is untouched, and its GPU work proceeds at
``rate_i`` of its solo speed, 1 while no neighbour is active and ``1 / (1 + e_ij)`` while j is (the
pair time-slices, and more than one active neighbour is a wider slice: their extra costs add). The
expectation is over which neighbours are active, each independently with probability ``x_j``. With one
neighbour, ``rate = 1 - x + x / d``. The extra cost ``e_ij = d_ij - 1`` is Gavel's measured pair
slowdown at full utilisation (b = 1, share = 1), so two benchmark-busy jobs slow by exactly the
measured pair.

The rate is averaged over the victim's *work*, not its solo time. Until 2026-11-26 the model was
``1 + b_i * sum_j x_j * e_ij``, which counts the overlap as a fraction of the victim's solo time and so
forgets that its work inside the overlap takes longer; at small loads that is d times too steep. An
H100 measured the throttle's curve (docs/benchmarks.md, "Run 2 and 3": ResNet-50 pairs at shares 1 to
0.05): this form within 0.03, the linear one off by up to 0.21. Both agree at full load. An
opportunistic job throttled to ``share`` progresses at ``share / slowdown`` of its solo rate (the
same runs: progress 0.456 x share, the form's 1 / 2.19 = 0.457).
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


# Up to this many active-capable neighbours the rate is the exact expectation (2^k terms at most);
# beyond, the mean-field rate, floored at the rate with all of them active.
_EXACT_NEIGHBOURS = 8


def gpu_rate(neighbours: Iterable[tuple[float, float]]) -> float:
    """A job's GPU work rate, solo = 1, beside neighbours given as (load x_j, extra cost e_j) (module
    doc). Loads are clamped to [0, 1], negative extra costs to 0."""
    items = [(min(1.0, x), e) for x, e in ((float(x), max(0.0, float(e))) for x, e in neighbours)
             if x > 0.0 and e > 0.0]
    if not items:
        return 1.0
    if len(items) > _EXACT_NEIGHBOURS:
        rate = 1.0 - sum(x * e / (1.0 + e) for x, e in items)
        return max(rate, 1.0 / (1.0 + sum(e for _, e in items)))
    dist = {0.0: 1.0}  # the sum of the active neighbours' extra costs -> its probability
    for x, e in items:
        nxt: dict[float, float] = {}
        for y, p in dist.items():
            nxt[y] = nxt.get(y, 0.0) + p * (1.0 - x)
            nxt[y + e] = nxt.get(y + e, 0.0) + p * x
        dist = nxt
    return sum(p / (1.0 + y) for y, p in dist.items())


def slowdown_beside(duty_victim: float, load: float, full_slowdown: float) -> float:
    """The formula for one neighbour of load ``load`` whose pair at full load measured
    ``full_slowdown`` (module doc). Not clamped: a pair measured faster together (noise) stays as
    measured at full load, as ``antman bench models`` checks it."""
    x = min(1.0, max(0.0, load))
    b = max(0.0, duty_victim)
    return 1.0 - b + b * full_slowdown / (full_slowdown * (1.0 - x) + x)  # exactly d at full load


def pair_slowdown(victim_kind: str, neighbour_kind: str, duty_victim: float, duty_neighbour: float,
                  share_neighbour: float = 1.0) -> float:
    """The formula for one pair: what ``antman bench models --pairs-with`` checks on a GPU."""
    load = max(0.0, duty_neighbour) * max(0.0, share_neighbour)
    return slowdown_beside(duty_victim, load, 1.0 + INTERFERENCE.get((victim_kind, neighbour_kind), 0.0))


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
        b = max(0.0, duty)
        if b == 0.0:
            return 1.0
        rate = gpu_rate((load, INTERFERENCE.get((self.kind, k), 0.0)) for k, load in neighbours)
        return 1.0 - b + b / rate

    def share_curve(self, neighbour_duties: Iterable[tuple[str, float]], duty: float = 1.0) -> tuple[float, float]:
        """(a, q) with ``slowdown(share) = 1 - a + a / (1 - share q)`` for neighbours (kind, duty) all
        throttled to one share: exact for one neighbour; for several, q is the sum of their slopes at
        share 0 (the AIMD loop works at small shares). What ``simulator.antman`` feeds the loop."""
        q = 0.0
        for k, d in neighbour_duties:
            e = INTERFERENCE.get((self.kind, k), 0.0)
            q += min(1.0, max(0.0, d)) * e / (1.0 + e)
        return max(0.0, duty), q

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
