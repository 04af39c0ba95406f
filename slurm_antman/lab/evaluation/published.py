"""Published GPU measurements the workload model rests on, and how its numbers are derived from them.

The only published measurement of deep-learning jobs *sharing* a GPU that covers several of the
zoo's model classes is Gavel's (Narayanan et al., "Heterogeneity-Aware Cluster Scheduling Policies
for Deep Learning Workloads", OSDI 2020): throughputs of single jobs and of pairs of jobs time-sharing
one V100, in the repository stanford-futuredata/gavel, file ``scheduler/oracle_throughputs_v2.json``
at commit 9aef8421fd294d3867e81754519716c09ec5fe83 (the V100 entries are the same at 4605a9cb). Its
format (``scheduler/utils.py``, ``read_all_throughputs_json_v2``): ``v100[job][other]`` is
``[this job's mini-batches/s, the other's]`` with the two on one GPU, ``v100[job]["null"]`` the job
alone. For a job paired with its own type the profiling script stores the mean of the two.

The rates below are transcribed from that file (the key is Gavel's job key); everything else is
computed from them here, so a test can check that the workload model's numbers are what these
measurements give. Caveats the file does not settle: the V100's memory size, whether CUDA MPS was on,
and Gavel's profiler binding both jobs of a pair to the same block of at most 8 CPUs (a job with many
data-loader workers, like its ResNet-50, also competes for CPU there).
"""

from __future__ import annotations

from typing import Mapping

GAVEL_SOURCE = ("stanford-futuredata/gavel scheduler/oracle_throughputs_v2.json "
                "@9aef8421fd294d3867e81754519716c09ec5fe83, worker type v100")

# Gavel job type -> (its key in the file, mini-batches per second alone on a V100).
GAVEL_V100_SOLO: Mapping[str, tuple[str, float]] = {
    "R50_32": ("('ResNet-50 (batch size 32)', 1)", 7.787264918596293),
    "T64": ("('Transformer (batch size 64)', 1)", 8.61775899193302),
    "LM80": ("('LM (batch size 80)', 1)", 28.239955054085122),
    "A3C": ("('A3C', 1)", 7.175767179667988),
    "CG": ("('CycleGAN', 1)", 4.426088263367452),
}

# (a, b) -> (a's mini-batches/s, b's) with a and b on one V100.
GAVEL_V100_PAIRS: Mapping[tuple[str, str], tuple[float, float]] = {
    ("R50_32", "R50_32"): (2.852068932216815, 2.852068932216815),
    ("R50_32", "T64"): (3.7572849330016997, 1.7429199843855467),
    ("R50_32", "LM80"): (3.282205183282951, 13.362400273243319),
    ("R50_32", "A3C"): (3.7006780060370756, 1.4121266425370025),
    ("R50_32", "CG"): (3.924503440877175, 1.1766637303838121),
    ("T64", "T64"): (6.415534418591446, 6.415534418591446),
    ("T64", "LM80"): (4.607009421447851, 23.329665967771952),
    ("T64", "A3C"): (5.768531621138351, 6.200074918226523),
    ("T64", "CG"): (4.809500924998379, 3.0057518231881124),
    ("LM80", "LM80"): (17.487845478909826, 17.487845478909826),
    ("LM80", "A3C"): (20.245824136281957, 3.0063695359612894),
    ("LM80", "CG"): (16.561448379683288, 1.5532872869320196),
    ("A3C", "A3C"): (3.6571693541475607, 3.6571693541475607),
    ("A3C", "CG"): (4.562135656281291, 3.1632656249608218),
    ("CG", "CG"): (2.7653153938815924, 2.7653153938815924),
}

# Which measured Gavel job stands for which zoo profile. Exact: the same model, batch and input
# size. Proxy: the nearest measured job of the same kind (documented in docs/workload_model.md);
# profiles not listed have no measured counterpart and take their class's mean.
GAVEL_FOR_PROFILE: Mapping[str, tuple[str, str]] = {
    "resnet50": ("R50_32", "exact: ResNet-50, batch 32, ImageNet, FP32"),
    "cyclegan": ("CG", "exact: CycleGAN, batch 1, 256x256, 9-block generators"),
    "transformer_nmt": ("T64", "same model and batch; Multi30k's short sentences, not WMT"),
    "lstm_lm": ("LM80", "proxy: a 2x200 word LSTM, not 2x1500"),
    "rl_ppo_atari": ("A3C", "proxy: A3C on Pong with 4 CPU workers, not PPO"),
}


def solo_ms(job: str) -> float:
    return 1000.0 / GAVEL_V100_SOLO[job][1]


def pair_slowdowns() -> dict[tuple[str, str], float]:
    """(i, j) -> i's mini-batch time beside j over its time alone."""
    out: dict[tuple[str, str], float] = {}
    for (a, b), (ra, rb) in GAVEL_V100_PAIRS.items():
        out[(a, b)] = GAVEL_V100_SOLO[a][1] / ra
        out[(b, a)] = GAVEL_V100_SOLO[b][1] / rb
    return out
